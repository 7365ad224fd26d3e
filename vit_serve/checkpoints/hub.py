"""Model-hub identifiers (`hf-hub:<owner>/<name>`) -> a local folder.

A hub id carries the `hf-hub:` prefix, so that a mistyped local path (`runs/best`) is a "no such file" error and
never a hub download. `timm/<name>` and `google/vit-*` without the prefix, which earlier releases took, are still
read as hub ids when nothing by that name is on disk, with a FutureWarning (deprecated: write `hf-hub:timm/...`).
Downloads go through `huggingface_hub` and its cache; offline (HF_HUB_OFFLINE=1 or no network) a model that is not
cached gives a CheckpointError, never a hang or a traceback.
"""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path

from vit_serve.checkpoints.converted import CheckpointError

HUB_PREFIX = "hf-hub:"
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_BARE_OWNERS = ("timm/", "google/vit-")  # bare hub ids of earlier releases (deprecated)
_WEIGHT_SUFFIXES = (".safetensors", ".npz", ".pth", ".pt", ".bin", ".ckpt")
_ALLOW = ["config.json", "preprocessor_config.json", "model.safetensors", "pytorch_model.bin", "*.npz"]


def parse_hub_id(src: str) -> str | None:
    """The repository id of a hub identifier (`hf-hub:OWNER/NAME`; deprecated: a bare `timm/<name>` or
    `google/vit-*` with nothing by that name on disk), or None when `src` is not one (a local path, existing or
    not). CheckpointError for `hf-hub:` followed by no OWNER/NAME."""
    if src.startswith(HUB_PREFIX):
        repo = src[len(HUB_PREFIX):]
        if not _REPO.fullmatch(repo):
            raise CheckpointError(f"{src!r} is not a model hub id: write hf-hub:OWNER/NAME")
        return repo
    if not src.startswith(_BARE_OWNERS) or not _REPO.fullmatch(src) or Path(src).exists() \
            or src.lower().endswith(_WEIGHT_SUFFIXES):
        return None
    _warn_bare(src)
    return src


@functools.cache  # once per id, however many readers ask
def _warn_bare(src: str) -> None:
    warnings.warn(f"{src!r} is read as a model hub id; hub ids without the hf-hub: prefix are deprecated: write "
                  f"hf-hub:{src}", FutureWarning, stacklevel=3)


def missing_path(src: str) -> str:
    """The one-line error of a local path that does not exist (and is no hub id)."""
    return f"no such file or folder: {src} (a model hub id is written hf-hub:OWNER/NAME)"


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
        gated = "gated" in type(e).__name__.lower() or "gated" in msg.lower()
        why = ("a gated repository: accept its licence on the hub and log in (HF_TOKEN), or pass the folder you "
               "downloaded; vit-serve never redistributes such weights" if gated
               else "offline, unknown or private repository?")
        raise CheckpointError(f"cannot fetch {repo_id!r} from the model hub ({why}): {msg}") from e
