"""The embedding space's fingerprint: one short string that two sets of vectors share when, and only when, they can
be compared with each other (indexed together, a query of one ranked against the other).

    space = EmbeddingSpace(weights=weights_digest(model.state_dict()), kind="image_embeds", dim=512, ...)
    space.fingerprint                      # "vs1-3f0c...": 32 hex digits of sha256 over the fields below
    space.normalized_as(True).fingerprint  # the same model's vectors L2-normalised (what /v1/embeddings gives)

What goes in (`EmbeddingSpace`), each because changing it moves the vectors:
- `weights`: `weights_digest` of the image model's tensors as loaded (names, dtypes, shapes, bytes), before an
  export resamples or resizes them; the classifier head is left out (it reads the embedding, it does not make it,
  so a new head on the same backbone keeps the space);
- `kind`, `pool`, `dim`: which embedding (`vit_serve.manifest.EMBEDDING_KINDS`: pre-logits, pooler output, the
  projected `image_embeds`), from which pooling ("token", "gap", "map"), its width (a Matryoshka model's vectors
  cut to their first k dimensions are another space: `truncated`);
- `normalized`: whether the vectors are L2-normalised as given;
- `preprocess`: the preprocessing contract at the served resolution (its `input_size` is the resolution; mean, std,
  resize filter, crop): the same photo becomes other pixels under another one;
- `patch_size` (FlexiViT's resize at export), `resample` (the position embedding's resampling mode, only when the
  served resolution is not the trained one: at the trained resolution nothing is resampled), `max_patches` (a
  NaFlex model's patch budget);
- `precision` ("fp32", "fp16", "bf16", "int8-dynamic", ...): the arithmetic the vectors come out of;
- `token_merging`: ToMe's r per layer and proportional attention (None: none).

What does not, so that it keeps the fingerprint: the file's name or path, the batch size, a static graph or a
dynamic one served at the same resolution, the opset, the exporter's and runtime's versions, the backend (torch,
onnxruntime, Triton: the same arithmetic within their parity tolerance), the labels and the classifier head, and
the decode path ("fast" or "exact": the gateway's setting, two ways of making the same contract's pixels, left out
of `preprocess` so that an export's manifest and the gateway serving it agree whichever the operator picks).

A CLIP-family model's text vectors (its text tower, `vit_serve.runtime.text_tower`) are trained into its image
space and carry the image space's fingerprint (normalised as given); their tower's own weights are not hashed (it
comes with the checkpoint the image tower comes from). Plain Python and hashlib (numpy or torch only to read the
tensors handed to `weights_digest`): this module imports nothing of vit-serve, so every layer may use it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

VERSION = "vs1"  # the prefix; bumped if what goes in changes, so that old and new fingerprints never collide
# The classifier's tensors: they turn the embedding into logits and leave the embedding itself as it is.
HEAD_PREFIXES = ("head.", "head_dist.")
NOT_IN_SPACE = ("decode",)  # the contract's keys that do not name other pixels (see the module docstring)


def _tensor_bytes(t: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, raw bytes) of a numpy array or a torch tensor (any dtype, bf16 included)."""
    if hasattr(t, "detach"):  # a torch tensor: its bytes through a uint8 view (numpy has no bfloat16)
        t = t.detach().cpu().contiguous()
        dtype, shape = str(t.dtype).removeprefix("torch."), tuple(t.shape)
        import torch

        return dtype, shape, memoryview(t.reshape(-1).view(torch.uint8).numpy())
    import numpy as np

    a = np.ascontiguousarray(t)
    return a.dtype.name, tuple(a.shape), memoryview(a.reshape(-1).view(np.uint8))


def weights_digest(tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                   skip: tuple[str, ...] = HEAD_PREFIXES) -> str:
    """sha256 (hex) of a model's tensors (a state dict, or (name, array) pairs) in name order: each name, dtype,
    shape and bytes, those under `skip` left out. The same weights give the same digest whatever file or format
    they were read from; one pass over the bytes (a ViT-B/16 in about a second)."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    h = hashlib.sha256()
    for name, t in sorted(items, key=lambda kv: kv[0]):
        if name.startswith(skip):
            continue
        dtype, shape, data = _tensor_bytes(t)
        h.update(json.dumps([name, dtype, list(shape), data.nbytes]).encode())
        h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class EmbeddingSpace:
    """Everything that decides a model's embedding vectors (see the module docstring for why each); `fingerprint`
    is their hash. resolution is carried by `preprocess["input_size"]`; `preprocess` is the contract as
    `PreprocessConfig.to_dict` gives it; `token_merging` is (r per layer, prop_attn) or None."""

    weights: str
    kind: str
    pool: str
    dim: int
    preprocess: Mapping[str, Any]
    patch_size: int
    precision: str = "fp32"
    normalized: bool = False
    resample: str | None = None
    max_patches: int | None = None
    token_merging: tuple[tuple[int, ...], bool] | None = None

    def __post_init__(self) -> None:
        pre = {k: v for k, v in dict(self.preprocess).items() if k not in NOT_IN_SPACE}
        object.__setattr__(self, "preprocess", json.loads(json.dumps(pre)))  # JSON types only
        if self.token_merging is not None:
            r, prop = self.token_merging
            merges = tuple(int(v) for v in r)
            # merging nothing in any layer is no merging at all
            object.__setattr__(self, "token_merging", (merges, bool(prop)) if any(merges) else None)

    @property
    def fingerprint(self) -> str:
        """`VERSION`-prefixed 32 hex digits of sha256 over the canonical JSON of the fields."""
        text = json.dumps(self.to_dict(fingerprint=False), sort_keys=True, separators=(",", ":"))
        return f"{VERSION}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"

    def normalized_as(self, normalized: bool) -> EmbeddingSpace:
        """The same model's space with its vectors L2-normalised (True) or as the model gives them (False)."""
        return self if normalized == self.normalized else dataclasses.replace(self, normalized=normalized)

    def truncated(self, dim: int | None) -> EmbeddingSpace:
        """The space of the vectors' first `dim` dimensions (a Matryoshka model's shorter vectors; None or the
        whole width: this space)."""
        return self if dim is None or dim == self.dim else dataclasses.replace(self, dim=dim)

    def with_precision(self, precision: str) -> EmbeddingSpace:
        """The space of the same model run at another precision (a TensorRT engine built from a graph)."""
        return dataclasses.replace(self, precision=precision)

    def to_dict(self, fingerprint: bool = True) -> dict[str, Any]:
        """The fields as JSON (and the fingerprint, so that a reader without this module can compare)."""
        out = {"weights": self.weights, "kind": self.kind, "pool": self.pool, "dim": self.dim,
               "preprocess": dict(self.preprocess), "patch_size": self.patch_size, "precision": self.precision,
               "normalized": self.normalized, "resample": self.resample, "max_patches": self.max_patches,
               "token_merging": None if self.token_merging is None else {
                   "r": list(self.token_merging[0]), "prop_attn": self.token_merging[1]}}
        if fingerprint:
            out["fingerprint"] = self.fingerprint
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EmbeddingSpace:
        """`to_dict`'s layout back; ValueError when a field is missing or of the wrong type, or when a stored
        fingerprint of this `VERSION` is not that of the fields (a record edited by hand)."""
        try:
            tm = data["token_merging"]
            space = cls(str(data["weights"]), str(data["kind"]), str(data["pool"]), int(data["dim"]),
                        dict(data["preprocess"]), int(data["patch_size"]), str(data["precision"]),
                        bool(data["normalized"]), data["resample"], data["max_patches"],
                        None if tm is None else (tuple(tm["r"]), bool(tm["prop_attn"])))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an embedding space record ({type(e).__name__}: {e})") from None
        stored = data.get("fingerprint")
        # one of another VERSION was made by another algorithm: the fields are what counts, hashed as this one does
        if isinstance(stored, str) and stored.startswith(f"{VERSION}-") and stored != space.fingerprint:
            raise ValueError(f"its fingerprint {stored} is not that of its fields ({space.fingerprint})")
        return space


def resample_of(served: tuple[int, int], trained: tuple[int, int], patch_size: int, trained_patch_size: int,
                mode: str) -> str | None:
    """The `resample` field: the position embedding's resampling mode when the served grid is not the trained
    one (then the mode moves the vectors), else None."""
    same = (served[0] // patch_size, served[1] // patch_size) == (trained[0] // trained_patch_size,
                                                                  trained[1] // trained_patch_size)
    return None if same else mode
