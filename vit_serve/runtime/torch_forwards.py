"""What a checkpoint's classify / embed can run on besides PyTorch eager (`FORWARDS`), and the choice among them when
the torch backend loads it (`choose_forward`, `runtime.runtime_choice`).

On a CPU, eager PyTorch is often not the fastest way to run a ViT: onnxruntime ran ViT-S/16 1.2-1.5x faster on 2
AVX-512 cores. So on the CPU, in fp32, in eager mode (no --compile or --torchscript), the backend exports the model
in memory with the TorchScript exporter (`torch.onnx.export(dynamo=False)`: ~2 s for a ViT-S/16 on 2 cores; logits
and embedding, any batch) for each runtime installed (onnxruntime; OpenVINO in its native precision), checks each
one's logits against eager's on a fixed seeded batch (`runtime_choice.BOUNDS`), times them all at batch 1 and at the
batch limit within a budget, and runs classify / embed through the fastest that passes. Explain, grad_rollout and
NaFlex stay eager. A pin (`pin_runtime`) serves one without measuring. A runtime is one line in `FORWARDS`.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import threading
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch

from vit_serve.runtime.runtime_choice import (
    BUDGET_S,
    Row,
    RuntimeChoice,
    accuracy,
    choose,
    parse_pin,
    refusal,
    time_runs,
)

log = logging.getLogger("vit_serve.runtime")

Forward = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
EAGER = "eager"
ACCURACY_IMAGES = 8  # the seeded batch each contender's logits are compared with eager's on


class _Embedding(torch.nn.Module):
    """`model.forward_embedding` as a module's forward (what the exporter traces)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward_embedding(x)


def onnx_bytes(model: torch.nn.Module, x: torch.Tensor) -> bytes:
    """`model` (x [B, 3, H, W] -> logits, embedding) as an ONNX graph in memory, any batch size."""
    buf = io.BytesIO()
    axes = {n: {0: "batch"} for n in ("pixel_values", "logits", "embedding")}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(_Embedding(model), (x,), buf, dynamo=False, opset_version=17,
                          input_names=["pixel_values"], output_names=["logits", "embedding"], dynamic_axes=axes)
    return buf.getvalue()


def onnxruntime_forward(model: torch.nn.Module, x: torch.Tensor, spinning: bool = False) -> Forward:
    """`model`'s in-memory export in an onnxruntime session with the gateway's options
    (`runtime.backends.onnxruntime.session_options`) on torch's intra-op threads."""
    import onnxruntime as ort

    from vit_serve.runtime.backends.onnxruntime import session_options

    session = ort.InferenceSession(onnx_bytes(model, x), session_options(torch.get_num_threads(), spinning),
                                   providers=["CPUExecutionProvider"])

    def forward(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, embedding = session.run(None, {"pixel_values": pixels.numpy()})
        return torch.from_numpy(logits), torch.from_numpy(embedding)

    return forward


def openvino_forward(model: torch.nn.Module, x: torch.Tensor, spinning: bool = False) -> Forward:
    """`model`'s in-memory export compiled by OpenVINO's CPU plugin in its native precision (bf16 where the CPU
    has it; the `precision` attribute of the forward says which), on torch's intra-op threads, with no compiled
    model cache (the graph is made anew at each load); an infer request per calling thread."""
    import openvino as ov

    from vit_serve.runtime.backends.openvino import OpenVINOOptions, compile_model

    core = ov.Core()
    options = OpenVINOOptions(threads=torch.get_num_threads(), cache_dir="")
    compiled = compile_model(core.read_model(onnx_bytes(model, x)), options.config(), core)
    local = threading.local()
    logits_out, embedding_out = compiled.output("logits"), compiled.output("embedding")

    def forward(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        request = getattr(local, "request", None)
        if request is None:
            request = local.request = compiled.create_infer_request()
        result = request.infer({"pixel_values": pixels.numpy()})
        return torch.from_numpy(np.array(result[logits_out])), torch.from_numpy(np.array(result[embedding_out]))

    hint = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    forward.precision = {"f32": "fp32", "f16": "fp16"}.get(hint, hint)  # type: ignore[attr-defined]
    return forward


# The runtimes besides eager, by name: (the module that must be installed, the forward's builder, its precision:
# "auto" is what the built forward says it runs in).
FORWARDS: dict[str, tuple[str, Callable[..., Forward], str]] = {
    "onnxruntime": ("onnxruntime", onnxruntime_forward, "fp32"),
    "openvino": ("openvino", openvino_forward, "auto"),
}


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` has a choice: the CPU, in fp32."""
    return device.type == "cpu" and dtype == torch.float32


def installed() -> list[str]:
    """The runtimes of `FORWARDS` whose module is installed."""
    return [n for n, (module, _, _) in FORWARDS.items() if importlib.util.find_spec(module) is not None]


def _contenders(model: torch.nn.Module, x: torch.Tensor, names: list[str], spinning: bool
                ) -> tuple[dict[str, Forward], dict[str, str]]:
    """(the forwards built, by name; why the others could not be: export or session errors)."""
    built: dict[str, Forward] = {}
    failed: dict[str, str] = {}
    for n in names:
        try:
            built[n] = FORWARDS[n][1](model, x, spinning)
        except Exception as e:  # the exporter and the runtimes raise many types; a contender less
            failed[n] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return built, failed


def choose_forward(model: torch.nn.Module, resolution: tuple[int, int], *, pin: str | None = None,
                   budget_s: float = BUDGET_S, max_batch: int = 1, spinning: bool = False
                   ) -> tuple[Forward | None, RuntimeChoice]:
    """(the forward classify / embed should run through, None for eager; the table). Without `pin`: every installed
    runtime, checked against eager on `ACCURACY_IMAGES` seeded images and timed at batch 1 and `max_batch` within
    `budget_s` (`runtime_choice.time_runs`); the fastest that passes serves. With `pin` ("eager", "onnxruntime",
    "onnxruntime:fp32"): that one, unmeasured; ValueError when it is not installed or cannot be built."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(ACCURACY_IMAGES, 3, *resolution, generator=gen)
    names = installed()
    if pin is not None:
        runtime = parse_pin(pin)[0]
        names = [n for n in names if n == runtime]
        if runtime != EAGER and not names:
            raise ValueError(f"pin_runtime {pin!r}: a checkpoint on the CPU runs on {', '.join([EAGER, *FORWARDS])} "
                             f"(installed: {', '.join([EAGER, *installed()])})")
    built, failed = _contenders(model, images[:1], names, spinning)
    if pin is not None and names and not built:
        raise ValueError(f"pin_runtime {pin!r}: {failed[names[0]]}")
    with torch.inference_mode():
        reference = model(images).float().numpy()
        runs = {EAGER: lambda x: model(torch.from_numpy(x)), **{
            n: (lambda x, f=f: f(torch.from_numpy(x))[0]) for n, f in built.items()}}
        rates = {} if pin is not None else time_runs(runs, images[:1].numpy(), sorted({1, max_batch}), budget_s)
        rows = [Row(EAGER, "fp32", rates.get(EAGER, {}), 1.0, 1.0)]
        for n, f in built.items():
            agree, cos = accuracy(reference, f(images)[0].float().numpy())
            precision = getattr(f, "precision", FORWARDS[n][2])
            rows.append(Row(n, precision, rates.get(n, {}), agree, cos, refusal(precision, agree, cos)))
    rows += [Row(n, FORWARDS[n][2], refused=f"cannot run: {why}") for n, why in failed.items()]
    chosen = choose(rows, None if pin is None else pin.removesuffix(":auto"))
    table = RuntimeChoice(tuple(rows), chosen.key, pin is not None, torch.get_num_threads(),
                          time.perf_counter() - t0)
    return (None if chosen.runtime == EAGER else built[chosen.runtime]), table
