"""What `vit-serve predict` can be told: `PredictOptions`, one field per flag."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from vit_serve.predict_writers import output_format


@dataclass(frozen=True)
class PredictOptions:
    """What `vit-serve predict` can be told (one field per flag; checked when built: ValueError naming it)."""

    model: str
    src: str
    out: str
    model_name: str | None = None
    top_k: int = 5
    batch_size: int = 16
    workers: int = 0  # 0: the gateway's default (`default_decode_workers`)
    processes: bool = False  # decode in worker processes rather than threads
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = None
    decode: Literal["fast", "exact", "contract"] = "fast"
    embeddings: bool = False
    normalize: bool = False
    explain: bool = False
    image_folder: bool = False
    force: bool = False
    quiet: bool = False
    max_pixels: int = 50_000_000
    part_rows: int = 4096
    engine: Literal["local", "ray"] = "local"
    address: str | None = None
    actors: int = 0  # ray: model actors (0: one per GPU, or one per CPU of the cluster)

    def __post_init__(self) -> None:
        for name in ("top_k", "batch_size", "max_pixels", "part_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("workers", "actors"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be 0 (automatic) or more, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        if self.normalize and not self.embeddings:
            raise ValueError("--normalize applies to --embeddings; add --embeddings")
        choices = {"device": ("auto", "cpu", "cuda"), "decode": ("fast", "exact", "contract"),
                   "engine": ("local", "ray")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.address is not None and self.engine != "ray":
            raise ValueError("--address is for --engine ray")
        output_format(Path(self.out))
