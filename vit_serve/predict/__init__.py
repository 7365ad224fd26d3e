"""Offline batch prediction over image files: `predict(PredictOptions(...))`, what `vit-serve predict` runs.

The modules, each standing on the ones after it:

- `job`: the run (`predict`): SRC listed (`list_images`), MODEL resolved (`resolve_model`), OUT checked, the
  result (`PredictResult`).
- `local`: the local engine (`run_local`): decode threads or processes overlapped with the model, batches formed
  by the gateway's scheduler (`vit_serve.runtime.scheduling.BatchingRunner`).
- `ray`: the same job on Ray Data (`--engine ray`); imported only when that engine runs.
- `batch`: one batch, whichever engine runs it: `Item`, `load_backend`, `decode_file`, `batch_tasks`,
  `split_outputs`, `compute`, `make_rows`, `Sink`.
- `texts`: `--task embed-text`: a text file of queries through the model's text tower.
- `options`: `PredictOptions`, one field per flag of `vit-serve predict`.
- `writers`: JSON Lines / CSV / Parquet rows, resume, the manifest, the errors file, the rollout maps.

Importing this package imports neither Ray nor the gateway (nor does running it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Loaded on first use (PEP 562): `vit-serve predict --help` reads `options` alone, without torch.
_HOMES = {"Item": "batch", "Sink": "batch", "compute": "batch", "decode_file": "batch", "load_backend": "batch",
          "make_rows": "batch", "PredictResult": "job", "list_images": "job", "predict": "job",
          "resolve_model": "job", "PredictOptions": "options"}

if TYPE_CHECKING:
    from vit_serve.predict.batch import Item, Sink, compute, decode_file, load_backend, make_rows
    from vit_serve.predict.job import PredictResult, list_images, predict, resolve_model
    from vit_serve.predict.options import PredictOptions

__all__ = ["Item", "PredictOptions", "PredictResult", "Sink", "compute", "decode_file", "list_images",
           "load_backend", "make_rows", "predict", "resolve_model"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'vit_serve.predict' has no attribute {name!r}")
    return getattr(importlib.import_module(f"vit_serve.predict.{_HOMES[name]}"), name)
