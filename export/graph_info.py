"""What an exported ONNX graph says about itself: `GraphInfo`, stored as JSON in its metadata_props.

    metadata_props["vit_export"] = '{"resolution": [H, W] | "dynamic", "batch": N | "dynamic", "opset": 18,
        "precision": "fp32", "explain": false, "embedding": false, "resample_mode": ..., "patch_size": 16,
        "exporter": ..., "simplified": ..., (explain graphs: "head_fusion", "discard_ratio", "num_prefix_tokens",
        "pool"), (`--tome`: "token_merging": {"r": [...], "prop_attn": true, "min_grid": N | null}), "checker": ...}'

`GraphInfo.write(proto)` and `GraphInfo.read(proto or path)` are the one pair that writes and reads it; every
other module of the exporter (parity, sidecar, typed graphs, the TensorRT build) takes the typed value. Graphs
exported before a key existed read with that key's default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import onnx

from vit_serve.manifest import RolloutSettings, TokenMergingRecord

METADATA_KEY = "vit_export"

Resolution = tuple[int, int] | Literal["dynamic"]
Batch = int | Literal["dynamic"]


@dataclass(frozen=True)
class GraphInfo:
    """The export settings of one graph (`vit_export.onnx_export.export_graph` records them).

    resolution: static (H, W) or "dynamic" (None: not recorded); batch: a fixed N or "dynamic"; precision: the
    graph's compute ("fp32", "fp16", "bf16"); explain: the explain graph (logits + rollout), whose `rollout` holds
    its settings; embedding: the logits graph has an "embedding" output; exporter / simplified / checker: what
    produced and checked it. token_merging: the ToMe the graph runs (`vit-export --tome`).
    """

    resolution: Resolution | None = None
    batch: Batch | None = None
    opset: int | None = None
    precision: str = "fp32"
    explain: bool = False
    embedding: bool = False
    resample_mode: str | None = None
    patch_size: int | None = None
    exporter: str | None = None
    simplified: str | None = None
    rollout: RolloutSettings | None = None
    checker: str | None = None
    token_merging: TokenMergingRecord | None = None

    @property
    def fixed_batch(self) -> int | None:
        """The batch size of a fixed-batch graph, None for a dynamic (or unrecorded) one."""
        return self.batch if isinstance(self.batch, int) else None

    def replace(self, **changes: Any) -> GraphInfo:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, keys in the order `vit-export` has always written them."""
        out: dict[str, Any] = {
            "resolution": self.resolution if self.resolution in ("dynamic", None) else list(self.resolution),
            "batch": self.batch, "opset": self.opset, "precision": self.precision, "explain": self.explain,
            "embedding": self.embedding, "resample_mode": self.resample_mode, "patch_size": self.patch_size,
            "exporter": self.exporter, "simplified": self.simplified,
        }
        if self.rollout is not None:
            r = self.rollout
            out.update(head_fusion=r.head_fusion, discard_ratio=r.discard_ratio, num_prefix_tokens=r.num_prefix_tokens,
                       pool=r.pool)
        if self.checker is not None:
            out["checker"] = self.checker
        if self.token_merging is not None:
            out["token_merging"] = self.token_merging.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GraphInfo:
        """The JSON object as `to_dict` writes it (missing keys: their defaults)."""
        res = data.get("resolution")
        explain = bool(data.get("explain", False))
        rollout = None
        if explain:
            defaults = RolloutSettings()
            rollout = RolloutSettings(data.get("head_fusion", defaults.head_fusion),
                                      data.get("discard_ratio", defaults.discard_ratio), data.get("pool"),
                                      data.get("num_prefix_tokens"))
        return cls(
            resolution=res if res in ("dynamic", None) else (int(res[0]), int(res[1])),
            batch=data.get("batch"), opset=data.get("opset"), precision=data.get("precision", "fp32"),
            explain=explain, embedding=bool(data.get("embedding", False)),
            resample_mode=data.get("resample_mode"), patch_size=data.get("patch_size"),
            exporter=data.get("exporter"), simplified=data.get("simplified"), rollout=rollout,
            checker=data.get("checker"), token_merging=_token_merging(data.get("token_merging")),
        )

    def write(self, proto: onnx.ModelProto) -> None:
        """Store this as the proto's metadata_props["vit_export"] (replacing its metadata_props)."""
        onnx.helper.set_model_props(proto, {METADATA_KEY: json.dumps(self.to_dict())})

    @classmethod
    def read(cls, src: str | Path | onnx.ModelProto) -> GraphInfo | None:
        """The info stored in a graph (a path or an already loaded proto), None when it has none."""
        proto = load_proto(src)
        for prop in proto.metadata_props:
            if prop.key == METADATA_KEY:
                return cls.from_dict(json.loads(prop.value))
        return None


def _token_merging(data: dict[str, Any] | None) -> TokenMergingRecord | None:
    if not data:
        return None
    return TokenMergingRecord(tuple(int(v) for v in data["r"]), bool(data.get("prop_attn", True)),
                              data.get("min_grid"))


def load_proto(src: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    """`src` itself when it is a proto, else the file loaded (external data left on disk)."""
    return src if isinstance(src, onnx.ModelProto) else onnx.load(str(src), load_external_data=False)
