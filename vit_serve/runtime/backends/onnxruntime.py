"""The ONNX Runtime backend: `<name>.onnx` (logits, and the embedding when exported with it) and, when present,
`<name>_explain.onnx` (logits + rollout) and `<name>_naflex.onnx` (SigLIP 2 NaFlex patches; `vit-export --naflex`,
used when its metadata names this `<name>.onnx`'s sha256).

The sidecars `vit-export` wrote beside them give the resolution, preprocessing, labels and the explain graph's
rollout settings, which are baked into the graph: `explain` with other settings raises ValueError naming them.
CUDA is used when onnxruntime has its CUDA provider and the device is not forced to the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from vit_serve.manifest import EMBEDDING, LOGITS, PIXEL_VALUES, ROLLOUT, RolloutSettings, read_manifest
from vit_serve.runtime.backends.base import LocalBackend
from vit_serve.runtime.backends.sidecar import check_bytes, read_export

log = logging.getLogger("vit_serve.runtime")
NAFLEX_SUFFIX = "_naflex"  # = vit_export.pipeline.naflex_target's
NAFLEX_METADATA_KEY = "vit_export_naflex"  # = vit_export.naflex_graph.METADATA_KEY


def session_providers(device: str) -> list[str]:
    """onnxruntime providers for `device` ("auto": CUDA first when this onnxruntime has it, "cpu", "cuda")."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if device == "cuda" and "CUDAExecutionProvider" not in available:
        raise ValueError(f"--device cuda: this onnxruntime has no CUDAExecutionProvider (it has {available})")
    if device != "cpu" and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]



def session_options(threads: int | None, spinning: bool = False) -> Any:
    """The gateway's onnxruntime session options: `threads` intra-op threads, one inter-op, quiet, and the
    intra-op threads spinning between parallel sections only with `spinning`."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads is not None:
        opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    # onnxruntime's intra-op threads spin between runs by default, burning the cores the gateway's decode
    # threads need: on 2 cores with unique 12 MP uploads, spinning off cut the model's CPU per image by a
    # third and raised throughput 15-25% (benchmarks/serve_load.py). Where decoding is cheap (small photos, a
    # model-bound server) the futex wake-up at each of the graph's parallel sections costs instead: ViT-S/16 on
    # 2 cores ran 14-25% faster with spinning on (benchmarks/serve_batching.py), hence the setting.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return opts

class OnnxRuntimeBackend(LocalBackend):
    name = "onnxruntime"

    def __init__(self, onnx_path: str | Path, model_name: str | None = None, device: str = "auto",
                 threads: int | None = None, spinning: bool = False) -> None:
        import onnxruntime as ort

        path = Path(onnx_path)
        self.info, explain = read_export(path, model_name, self.name, "graph")
        check_bytes(path, explain)

        opts = session_options(threads, spinning)
        providers = session_providers(device)
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=providers)
            self.explain_session = (ort.InferenceSession(str(explain), opts, providers=providers)
                                    if explain is not None else None)
        except Exception as e:  # onnxruntime raises its own exception types for unreadable models
            raise ValueError(f"onnxruntime cannot load {path.name}: {' '.join(str(e).split())}") from e
        # fp16 exports take float16 pixels; everything leaves as float32.
        self.input_dtype = np.float16 if "float16" in self.session.get_inputs()[0].type else np.float32
        used = tuple(self.session.get_providers())
        has_embedding = any(o.name == EMBEDDING for o in self.session.get_outputs())
        self.naflex_session, max_patches = _naflex_twin(path, read_manifest(path).file_sha256, opts, providers)
        naflex_dim = 0 if self.naflex_session is None else next(
            (o.shape[-1] for o in self.naflex_session.get_outputs() if o.name == EMBEDDING), 0)
        self.info = dataclasses.replace(self.info, providers=used,
                                        device="cuda" if "CUDAExecutionProvider" in used else "cpu",
                                        embedding_dim=self.info.embedding_dim if has_embedding else (
                                            naflex_dim if isinstance(naflex_dim, int) else 0),
                                        max_patches=max_patches)

    def _feed(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return {PIXEL_VALUES: x if x.dtype == self.input_dtype else x.astype(self.input_dtype)}

    def classify(self, x: np.ndarray) -> np.ndarray:
        (logits,) = self.session.run([LOGITS], self._feed(x))
        return logits.astype(np.float32, copy=False)

    def embed(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self.info.embedding_dim:
            return super().embed(x)
        logits, embedding = self.session.run([LOGITS, EMBEDDING], self._feed(x))
        return logits.astype(np.float32, copy=False), embedding.astype(np.float32, copy=False)

    def explain(self, x: np.ndarray, rollout: RolloutSettings | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The explain graph, whose rollout settings are its own (`rollout`, resolved against them, is not
        needed here)."""
        if self.explain_session is None:
            raise NotImplementedError(f"no explain graph beside {Path(self.info.source).name} "
                                      f"(vit-export writes NAME_explain.onnx)")
        logits, heat = self.explain_session.run([LOGITS, ROLLOUT], self._feed(x))
        return logits.astype(np.float32, copy=False), heat.astype(np.float32, copy=False)

    def embed_patches(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """NaFlex (`naflex.pack`'s [B, 1 + M, K]) on the NaFlex twin graph."""
        if self.naflex_session is None:
            return super().embed_patches(x)
        shapes = np.rint(x[:, 0, :2]).astype(np.int64)  # `vit_serve.naflex.unpack`, without torch
        patches = np.ascontiguousarray(x[:, 1:], dtype=np.float32)
        mask = (np.arange(patches.shape[1])[None] < shapes.prod(-1)[:, None]).astype(np.int64)
        logits, embedding = self.naflex_session.run([LOGITS, EMBEDDING], {"patches": patches,
                                                                          "spatial_shapes": shapes, "mask": mask})
        return logits.astype(np.float32, copy=False), embedding.astype(np.float32, copy=False)


def _naflex_twin(path: Path, graph_sha256: str, opts: Any, providers: list[str]) -> tuple[Any, int | None]:
    """(session, patch budget) of `<name>_naflex.onnx` beside `path` when its metadata names this graph's sha256;
    (None, None) without one, or with one of another export (logged)."""
    import onnxruntime as ort

    twin = path.with_name(path.stem + NAFLEX_SUFFIX + path.suffix)
    if not twin.is_file():
        return None, None
    try:
        session = ort.InferenceSession(str(twin), opts, providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types for unreadable models
        raise ValueError(f"onnxruntime cannot load {twin.name}: {' '.join(str(e).split())}") from e
    meta = json.loads(session.get_modelmeta().custom_metadata_map.get(NAFLEX_METADATA_KEY, "{}"))
    if meta.get("graph_sha256", "").lower() != graph_sha256.lower():
        log.warning("%s is not of the export of %s (its metadata names another graph): not used", twin.name,
                    path.name)
        return None, None
    return session, int(meta["max_patches"])
