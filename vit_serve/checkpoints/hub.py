"""Model-hub identifiers (`timm/<name>`, `google/vit-*`, `hf-hub:<repo>`) -> a local folder.

Downloads go through `huggingface_hub` and its cache; offline (HF_HUB_OFFLINE=1 or no network) a model
that is not cached gives a CheckpointError, never a hang or a traceback.
"""

from __future__ import annotations

import re
from pathlib import Path

from vit_serve.checkpoints.converted import CheckpointError

_HUB_ID = re.compile(r"^(?:hf-hub:)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)$")
_WEIGHT_SUFFIXES = (".safetensors", ".npz", ".pth", ".pt", ".bin", ".ckpt")
_ALLOW = ["config.json", "preprocessor_config.json", "model.safetensors", "pytorch_model.bin", "*.npz"]


def parse_hub_id(src: str) -> str | None:
    """The repository id of a hub identifier, or None when `src` is not one (or is an existing path)."""
    if Path(src).exists() or src.lower().endswith(_WEIGHT_SUFFIXES):
        return None
    m = _HUB_ID.match(src)
    return m["repo"] if m else None


def download(repo_id: str, revision: str | None = None) -> Path:
    """Fetch the config and weight files of a hub repository into the local cache; returns the folder."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub is a core dependency
        raise CheckpointError("hub identifiers need the huggingface_hub package") from e
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_ALLOW))
    except Exception as e:  # offline, unknown repo, gated repo: all one clear message
        msg = " ".join(str(e).split())[:300]
        raise CheckpointError(f"cannot fetch {repo_id!r} from the model hub (offline, unknown or private "
                              f"repository?): {msg}") from e
