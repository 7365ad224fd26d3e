"""What a TensorRT build does, decided from the TensorRT version alone (pure; no tensorrt import, no GPU).

TensorRT 10 and 11 build the same ViT differently:

    TensorRT 10  fp32 graph -> fp16 / bf16 engine: weakly typed network, BuilderFlag.FP16 / BF16 and
                 OBEY_PRECISION_CONSTRAINTS, every normalisation layer pinned to fp32 (ILayer.precision).
                 An fp16 graph: strongly typed (NetworkDefinitionCreationFlag.STRONGLY_TYPED).
    TensorRT 11  strongly typed only: BuilderFlag.FP16 / BF16 / OBEY_PRECISION_CONSTRAINTS and ILayer.precision
                 are gone (STRONGLY_TYPED is kept but ignored), so an fp16 or bf16 engine is built from a graph
                 typed fp16 / bf16 (LayerNorm kept in fp32 inside it; `vit_export.typed_graph`).

Also here: the timing cache's file name (kernel timings are only valid for one GPU architecture and one
TensorRT version) and the optimisation profile's shapes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED_MAJORS = (10, 11)  # keep in step with the `tensorrt` extra in pyproject.toml
ENGINE_PRECISIONS = ("fp32", "fp16", "bf16")
GRAPH_PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class BuildPlan:
    """How to build one engine: the graph precision to parse, the network's typing and what to set.

    builder_flags / creation_flags: names of `trt.BuilderFlag` / `trt.NetworkDefinitionCreationFlag` members.
    pin_norm_fp32: weak typing only; set every normalisation layer's precision and output types to fp32.
    cleared_flags: `trt.BuilderFlag` members to clear (TensorRT sets TF32 by default: an fp32 engine clears it,
    so that its matmuls are full fp32, which the fp32 parity bound assumes).
    """

    trt_version: str
    engine_precision: str
    graph_precision: str
    strongly_typed: bool
    creation_flags: tuple[str, ...]
    builder_flags: tuple[str, ...]
    pin_norm_fp32: bool
    cleared_flags: tuple[str, ...] = ()


def trt_major(version: str) -> int:
    """'10.16.1.11' -> 10; ValueError for a version string that does not start with a number."""
    m = re.match(r"\s*(\d+)\.", f"{version}.")
    if not m:
        raise ValueError(f"cannot read the TensorRT version {version!r}")
    return int(m.group(1))


def check_supported(version: str) -> int:
    """The major version, or ValueError in one line when it is outside the tested range."""
    major = trt_major(version)
    if major not in SUPPORTED_MAJORS:
        lo, hi = SUPPORTED_MAJORS[0], SUPPORTED_MAJORS[-1]
        raise ValueError(
            f"TensorRT {version} is not supported: vit-export builds with TensorRT {lo}.x and {hi}.x "
            f"(pip install 'tensorrt>={lo},<{hi + 1}')"
        )
    return major


def plan_build(version: str, engine_precision: str, graph_precision: str = "fp32") -> BuildPlan:
    """The build for an `engine_precision` engine from the exported `graph_precision` graph under TensorRT `version`.

    The returned `graph_precision` is the graph to parse: when it differs from the one given, the caller must
    export a graph typed that way first (TensorRT 11 with an fp32 graph and an fp16 / bf16 engine).
    """
    major = check_supported(version)
    if engine_precision not in ENGINE_PRECISIONS:
        known = ", ".join(ENGINE_PRECISIONS)
        raise ValueError(f"unknown TensorRT precision {engine_precision!r}; expected one of {known}")
    if graph_precision not in GRAPH_PRECISIONS:
        raise ValueError(f"unknown graph precision {graph_precision!r}; expected one of {', '.join(GRAPH_PRECISIONS)}")
    if graph_precision != "fp32" and graph_precision != engine_precision:
        raise ValueError(
            f"an {graph_precision} graph builds an {graph_precision} engine only (asked for {engine_precision}); "
            "export the graph in fp32 to choose the engine's precision"
        )
    cleared = ("TF32",) if engine_precision == "fp32" else ()  # TF32 is on by default in 10.x and 11.x
    if major == 10 and graph_precision == "fp32":
        reduced = engine_precision != "fp32"
        flags = (engine_precision.upper(), "OBEY_PRECISION_CONSTRAINTS") if reduced else ()
        return BuildPlan(version, engine_precision, "fp32", False, (), flags, reduced, cleared)
    # Strongly typed: the graph's types are the engine's. TensorRT 11 ignores (and deprecates) the creation flag.
    creation = ("STRONGLY_TYPED",) if major == 10 else ()
    return BuildPlan(version, engine_precision, engine_precision, True, creation, (), False, cleared)


def timing_cache_name(compute_capability: str, version: str) -> str:
    """'9.0', '10.16.1.11' -> 'tensorrt_sm90_trt10.16.1.11.cache': one timing cache per GPU architecture and
    TensorRT version (a cache from another one fails TensorRT's strict check, or silently misleads it)."""
    cc = compute_capability.strip()
    if not re.fullmatch(r"\d+\.\d+", cc):
        raise ValueError(f"bad compute capability {compute_capability!r}; expected e.g. '9.0'")
    v = version.strip()
    if not re.fullmatch(r"[0-9A-Za-z.+_-]+", v):
        raise ValueError(f"bad TensorRT version {version!r}")
    return f"tensorrt_sm{cc.replace('.', '')}_trt{v}.cache"


def profile_shapes(
    input_shape: tuple[int, ...], batch: tuple[int, int, int]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(min, opt, max) shapes of the [B, 3, H, W] input for the batch profile `batch`; H and W must be static.

    ValueError for a dynamic H or W (a `--res dynamic` graph) or a bad batch profile.
    """
    lo, opt, hi = batch
    if not 1 <= lo <= opt <= hi:
        raise ValueError(f"batch profile must satisfy 1 <= min <= opt <= max, got {tuple(batch)}")
    if len(input_shape) != 4:
        raise ValueError(f"expected a [B, 3, H, W] input, got shape {tuple(input_shape)}")
    _, c, h, w = (int(d) for d in input_shape)
    if h <= 0 or w <= 0 or c <= 0:
        raise ValueError(
            "TensorRT engines are built for one input size here: the graph's height and width are dynamic "
            "(export it with a fixed --res, e.g. --res 384)"
        )
    return (lo, c, h, w), (opt, c, h, w), (hi, c, h, w)
