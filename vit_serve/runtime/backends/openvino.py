"""The OpenVINO backend (CPU plugin): `<name>.onnx` as vit-export writes it, or an OpenVINO IR `<name>.xml`
(`.bin` beside it; preferred to `<name>.onnx` beside it), with the same companions as onnxruntime's:
`<name>_explain.onnx` / `.xml` (logits + rollout) and the manifest, which gives the resolution, preprocessing,
labels and the explain graph's rollout settings.

Each graph is compiled once per model version (`OpenVINOOptions`): in the precision asked for (`auto`: the
plugin's native `INFERENCE_PRECISION_HINT`, bf16 on CPUs with AVX512-BF16 or AMX, else f32; `int8`: a graph
NNCF quantized, its FakeQuantize nodes in int8), with a latency or throughput hint, streams and threads, and
OpenVINO's model cache (`CACHE_DIR`) so that a restart reads the compiled blob instead of compiling again. A
precision other than f32 passes the accuracy gate first (`runtime.accuracy_gate`): measured against the fp32
graph on real photos, refused with the numbers unless forced.

Each model thread has its own infer request, so instances run at once (on streams of their own with the
throughput hint). A compiled model runs whole: there are no staged runs to pause between (`staged` is None), so
a batch once started runs to its end; deadlines and cancellation act on the requests still queued. NaFlex twin
graphs are not run here (onnxruntime runs them); a text tower beside the model is (`GraphSession`, f32).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from vit_serve import signal_stack
from vit_serve.manifest import EMBEDDING, LOGITS, PIXEL_VALUES, ROLLOUT, RolloutSettings, read_manifest
from vit_serve.runtime import accuracy_gate
from vit_serve.runtime.backends.base import LocalBackend
from vit_serve.runtime.backends.sidecar import check_bytes, explain_path_of, read_export

log = logging.getLogger("vit_serve.runtime")
Precision = Literal["auto", "f32", "bf16", "f16", "int8"]
PerformanceHint = Literal["latency", "throughput"]
PRECISIONS = ("auto", "f32", "bf16", "f16", "int8")
SUFFIXES = (".onnx", ".xml")
DEVICE = "CPU"
_FLOAT_HINTS = {"f32": "f32", "bf16": "bf16", "f16": "f16"}


def default_cache_dir() -> str:
    """Where compiled models are cached when no folder is given: `$XDG_CACHE_HOME/vit-serve/openvino`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vit-serve", "openvino")


@dataclass(frozen=True)
class OpenVINOOptions:
    """How a graph is compiled. precision: "auto" (the plugin's native), "f32", "bf16", "f16", or "int8" (a
    quantized graph); hint: OpenVINO's PERFORMANCE_HINT; streams: NUM_STREAMS (None: the hint's); threads:
    INFERENCE_NUM_THREADS (None: all cores); cache_dir: CACHE_DIR (None: `default_cache_dir()`, "": no cache);
    force: serve a precision that missed its accuracy bounds (logged)."""

    precision: Precision = "auto"
    hint: PerformanceHint = "latency"
    streams: int | None = None
    threads: int | None = None
    cache_dir: str | None = None
    force: bool = False

    def config(self, precision: str | None = None) -> dict[str, Any]:
        """The compile_model properties, in `precision` (an INFERENCE_PRECISION_HINT; None: the plugin's)."""
        config: dict[str, Any] = {"PERFORMANCE_HINT": self.hint.upper()}
        if precision is not None:
            config["INFERENCE_PRECISION_HINT"] = precision
        if self.streams is not None:
            config["NUM_STREAMS"] = self.streams
        if self.threads is not None:
            config["INFERENCE_NUM_THREADS"] = self.threads
        cache = default_cache_dir() if self.cache_dir is None else self.cache_dir
        if cache:
            try:
                os.makedirs(cache, exist_ok=True)
                config["CACHE_DIR"] = cache
            except OSError as e:  # a read-only home: compile every time rather than refuse the model
                log.warning("OpenVINO's model cache %s cannot be made (%s): compiling without it", cache, e)
        return config


def require_openvino() -> None:
    """ImportError with the install line when openvino is not installed."""
    try:
        import openvino  # noqa: F401
    except ImportError as e:
        raise ImportError("--backend openvino needs OpenVINO: pip install 'vit-serve[openvino]'") from e


def is_quantized(model: Any) -> bool:
    """Whether an OpenVINO model holds FakeQuantize nodes (NNCF's int8)."""
    return any(op.get_type_name() == "FakeQuantize" for op in model.get_ops())


def compile_model(source: str | os.PathLike | Any, config: dict[str, Any], core: Any = None) -> Any:
    """`source` (a graph's path, or an `openvino.Model`) compiled by the CPU plugin with the properties `config`.
    Every OpenVINO compile of the project goes through here: the plugin gives the compiling thread an alternate
    signal stack of its own and unmaps it when the compiled model is released, so the thread's own stack is kept
    around the call (`vit_serve.signal_stack`)."""
    import openvino as ov

    core = core if core is not None else ov.Core()
    graph = os.fspath(source) if isinstance(source, (str, os.PathLike)) else source
    with signal_stack.kept():
        return core.compile_model(graph, DEVICE, config)


class _Compiled:
    """A compiled model with an infer request per calling thread (a request runs one inference at a time)."""

    def __init__(self, core: Any, path: Path, config: dict[str, Any]) -> None:
        try:
            self.model = compile_model(path, config, core)
        except Exception as e:  # OpenVINO raises RuntimeError subclasses of its own for unreadable models
            raise ValueError(f"OpenVINO cannot compile {path.name}: {' '.join(str(e).split())}") from e
        self.outputs = {name for o in self.model.outputs for name in o.get_names()}
        self.input_dtype = np.float16 if self.model.input(0).get_element_type().get_type_name() == "f16" \
            else np.float32
        self._local = threading.local()

    def run(self, x: np.ndarray, names: tuple[str, ...]) -> list[np.ndarray]:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.model.create_infer_request()
        x = x if x.dtype == self.input_dtype else x.astype(self.input_dtype)
        result = request.infer({PIXEL_VALUES: np.ascontiguousarray(x)})
        return [np.asarray(result[self.model.output(n)], dtype=np.float32) for n in names]

    def precision(self) -> str:
        """The INFERENCE_PRECISION_HINT it was compiled with ("f32", "bf16", "f16")."""
        return self.model.get_property("INFERENCE_PRECISION_HINT").get_type_name()


class GraphSession:
    """Any ONNX graph compiled in f32 behind onnxruntime's `run(names, feed)` call: the text tower beside an image
    model served on OpenVINO (`runtime.text_tower.TextTower`). f32: its class embeddings are cached and shared by
    every request, and no accuracy gate measures a text graph."""

    def __init__(self, path: Path, threads: int | None = None) -> None:
        require_openvino()
        try:
            self.model = compile_model(path, OpenVINOOptions("f32", threads=threads, cache_dir="").config("f32"))
        except Exception as e:  # OpenVINO's own exception types
            raise ValueError(f"OpenVINO cannot compile {path.name}: {' '.join(str(e).split())}") from e
        self._local = threading.local()

    def run(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.model.create_infer_request()
        result = request.infer(feed)
        return [np.asarray(result[self.model.output(n)]) for n in names]


class OpenVINOBackend(LocalBackend):
    name = "openvino"

    def __init__(self, path: str | Path, model_name: str | None = None,
                 options: OpenVINOOptions = OpenVINOOptions()) -> None:
        require_openvino()
        import openvino as ov

        path = Path(path)
        if path.suffix.lower() == ".onnx" and path.with_suffix(".xml").is_file():
            path = path.with_suffix(".xml")  # the IR written for this graph (vit-export --format openvino)
        if path.suffix.lower() not in SUFFIXES:
            raise ValueError(f"--backend openvino serves NAME.onnx or an OpenVINO IR NAME.xml, not {path.name}")
        self.info, explain = read_export(path, model_name, self.name, "graph")
        explain = explain or _explain_onnx_of_ir(path)
        _check_bytes(path, explain)
        self.options = options
        core = ov.Core()
        quantized = is_quantized(core.read_model(str(path)))
        hint = _precision_hint(options.precision, quantized, path)
        self.session = _Compiled(core, path, options.config(hint))
        self.explain_session = _Compiled(core, explain, options.config(hint)) if explain is not None else None
        self.explain_path = explain
        precision = "int8" if quantized else _short(self.session.precision())
        if hint is not None and _short(hint) != precision:
            log.warning("%s: OpenVINO's %s plugin computes %s in %s (this CPU has no %s arithmetic)", self.info.name,
                        DEVICE, path.name, precision, hint)
        check = None
        if precision != "fp32":
            check = self._gate(core, path, precision)
        has_embedding = EMBEDDING in self.session.outputs
        space = self.info.embedding_space  # the export's, in its precision: the vectors move with the arithmetic
        if space is not None and not quantized and space.precision != precision:
            space = space.with_precision(precision)
        self.info = dataclasses.replace(
            self.info, precision=precision, embedding_space=space, device="cpu",
            device_name=core.get_property(DEVICE, "FULL_DEVICE_NAME"), providers=(DEVICE,),
            embedding_dim=self.info.embedding_dim if has_embedding else 0, accuracy=check)

    def _gate(self, core: Any, path: Path, precision: str) -> accuracy_gate.GateResult | None:
        """The accuracy gate of this compiled precision against the fp32 graph (itself in f32, or, for a quantized
        graph, the fp32 export it came from)."""
        reference_path = _fp32_reference(path) if precision == "int8" else path
        if reference_path is None:
            why = (f"{self.info.name}: no fp32 graph found beside {path.name} to check its int8 accuracy against "
                   f"(the manifest's source_onnx, or NAME.onnx of precision fp32 beside it)")
            if not self.options.force:
                raise accuracy_gate.PrecisionRefusedError(why + "; refused unless forced (force_precision)")
            log.warning("%s; served as forced", why)
            return None
        reference = _Compiled(core, reference_path, dataclasses.replace(self.options, cache_dir="").config("f32"))
        x = accuracy_gate.gate_images(self.info.preprocess)
        names = (LOGITS, EMBEDDING) if EMBEDDING in self.session.outputs & reference.outputs else (LOGITS,)

        def forward(compiled: _Compiled) -> accuracy_gate.Forward:
            def run(b: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
                out = compiled.run(b, names)
                return out[0], out[1] if len(out) > 1 else None
            return run

        check = accuracy_gate.measure(precision, forward(reference), forward(self.session), x)
        return accuracy_gate.enforce(check, self.info.name, self.options.force,
                                     self._rollout_difference(core, reference_path, x))

    def _rollout_difference(self, core: Any, reference_path: Path, x: np.ndarray) -> float | None:
        """The explain graph's largest rollout difference from the fp32 one's: the same graph's in f32, or, for a
        quantized model, the fp32 export's (None: no explain graph here or there)."""
        explain = self.explain_session
        if explain is None or self.explain_path is None:
            return None
        same = reference_path == Path(self.info.source)
        reference = self.explain_path if same else explain_path_of(reference_path)
        if not reference.is_file():
            return None
        fp32 = _Compiled(core, reference, dataclasses.replace(self.options, cache_dir="").config("f32"))
        return accuracy_gate.rollout_difference(lambda b: fp32.run(b, (ROLLOUT,))[0],
                                                lambda b: explain.run(b, (ROLLOUT,))[0], x)

    def classify(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(x, (LOGITS,))[0]

    def embed(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self.info.embedding_dim:
            return super().embed(x)
        logits, embedding = self.session.run(x, (LOGITS, EMBEDDING))
        return logits, embedding

    def explain(self, x: np.ndarray, rollout: RolloutSettings | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The explain graph, whose rollout settings are its own (baked in)."""
        if self.explain_session is None:
            raise NotImplementedError(f"no explain graph beside {Path(self.info.source).name} "
                                      f"(vit-export writes NAME_explain.onnx)")
        logits, heat = self.explain_session.run(x, (LOGITS, ROLLOUT))
        return logits, heat


def _short(precision: str) -> str:
    return {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}.get(precision, precision)


def _precision_hint(precision: str, quantized: bool, path: Path) -> str | None:
    """The INFERENCE_PRECISION_HINT of `precision` (None: the plugin's own); ValueError for int8 on a graph that
    is not quantized."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "int8" and not quantized:
        raise ValueError(f"precision int8 needs a quantized graph (vit-export --format openvino --precision int8); "
                         f"{path.name} has no FakeQuantize nodes")
    return _FLOAT_HINTS.get(precision)


def _check_bytes(path: Path, explain: Path | None) -> None:
    """`sidecar.check_bytes` for the files whose manifest records them (an IR written beside an ONNX graph may
    share its manifest, which records the ONNX graph's bytes)."""
    check_bytes(*(f if f is not None and read_manifest(f).file == f.name else None for f in (path, explain)))


def _explain_onnx_of_ir(path: Path) -> Path | None:
    """An IR's explain graph as ONNX (`NAME_explain.onnx` beside `NAME.xml`), when only that was written."""
    if path.suffix.lower() != ".xml":
        return None
    candidate = explain_path_of(path.with_suffix(".onnx"))
    return candidate if candidate.is_file() and candidate.with_suffix(".json").is_file() else None


def _fp32_reference(path: Path) -> Path | None:
    """The fp32 graph a quantized one came from: the manifest's `source_onnx` (beside it or one folder up), else
    NAME.onnx beside it when its own manifest says fp32."""
    side = read_manifest(path)
    candidates = []
    if side.source_onnx:
        candidates += [path.parent / Path(side.source_onnx).name, path.parent.parent / Path(side.source_onnx).name]
    candidates.append(path.with_suffix(".onnx"))
    for c in candidates:
        if c != path and c.is_file() and c.with_suffix(".json").is_file() and read_manifest(c).precision == "fp32":
            return c
    return None
