"""The PyTorch backend: a checkpoint (any format `vit_serve.load` reads) run in eager mode, or with `compile`
(--compile) its classify / embed forward through `torch.compile` (`compile_forward`), or with `torchscript`
(--torchscript) through a TorchScript trace (`torchscript_forward`).

Why TorchScript: eager PyTorch runs each operator from Python, so a model thread takes Python's GIL back between
operators; while the gateway's event loop holds it (a storm of requests) the model waits, and on a small CPU
it runs far slower than the cores it gets allow. A traced module runs the whole forward in TorchScript's
interpreter, which releases the GIL for the call.

On the CPU in fp32 and eager mode, with `choose` (the gateway's choose_runtime) or a `pin`, classify and embed run
on the runtime measured fastest at load among eager and the in-memory exports of `runtime.torch_forwards` (the
table in `info.runtime_choice`, logged); explain, grad_rollout and NaFlex stay eager.

classify and embed also run in stages (`staged`, `Stages`: the stem, each encoder block, the tail; traced one by
one with --torchscript), which the batching runner steps through for a less urgent batch that may have to give
its model instance to a more urgent request; not with --compile (one graph) or token merging (its state is one
forward's).

classify in inference mode; explain with `vit_serve.explain.explain_forward` (any head fusion and discard ratio;
through the model's token merges, if set); grad_rollout with `vit_serve.explain.grad_rollout` (the only backend
with it); explain and grad_rollout stay eager with --compile and --torchscript (they need the attentions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from vit_serve.accuracy_bounds import AccuracyCheck, judge
from vit_serve.explain import explain_forward, explain_patches, grad_rollout
from vit_serve.fingerprint import weights_digest
from vit_serve.manifest import EMBEDDING, LOGITS, RolloutSettings, TokenMergingRecord, embedding_of, embedding_space_of
from vit_serve.naflex import unpack
from vit_serve.preprocess import PreprocessConfig
from vit_serve.runtime.backends.base import LocalBackend, ModelInfo, Staged
from vit_serve.runtime.runtime_choice import RuntimeChoice
from vit_serve.runtime.spec import BOTH_FORWARDS
from vit_serve.runtime.task import Task
from vit_serve.runtime.torch_forwards import choose_forward, wanted
from vit_serve.similarity import patch_tokens, similarity_map
from vit_serve.tome import TomeR

log = logging.getLogger("vit_serve.runtime")

Forward = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
T = TypeVar("T")

# Compiled or traced vs eager: max |difference| over max |eager| of the logits (and of the embedding). Inductor's
# fused fp32 kernels differ from eager's by reassociation only (~1e-6 relative; TorchScript runs eager's own
# kernels); a wrong graph is off by far more.
PARITY_RTOL = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available to PyTorch")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def mismatch(got: torch.Tensor, want: torch.Tensor, rtol: float) -> tuple[float, float] | None:
    """(max |got - want|, the tolerance `rtol` x max |want|, floored at 1e-5) when they differ by more than that,
    else None."""
    diff = float((got.float() - want.float()).abs().max())
    tol = rtol * float(want.float().abs().max()) + 1e-5
    return (diff, tol) if not diff <= tol else None  # NaN fails


COMPILE_PRECISIONS = ("fp32", "bf16", "auto")
GATE_IMAGES = 64  # held-out digits scans the bf16 gate measures on


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX512_BF16 or AMX), as oneDNN (which inductor's bf16 matmuls
    call) reports it."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _bf16(forward: Forward) -> Forward:
    """`forward` under CPU bf16 autocast (matmuls in bf16, LayerNorm and softmax in fp32, as autocast lists them),
    its outputs back in fp32."""

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, emb = forward(x)
        return logits.float(), emb.float()

    return run


def gate_inputs(resolution: tuple[int, int], n: int = GATE_IMAGES) -> tuple[torch.Tensor, str]:
    """The fixed set a reduced precision is judged on: `n` held-out digits scans (real images, scikit-learn's),
    resized to `resolution` with the library's default contract; seeded N(0, 1) inputs when scikit-learn is not
    installed (said in the description)."""
    try:
        from vit_serve.data import digits_tensors

        x, _ = digits_tensors("test", PreprocessConfig(input_size=resolution))
        return x[:n], f"{min(n, len(x))} held-out digits scans"
    except ImportError:
        gen = torch.Generator().manual_seed(0)
        return torch.randn((n, 3, *resolution), generator=gen), f"{n} N(0, 1) inputs (no scikit-learn for scans)"


def bf16_gate(model: torch.nn.Module, forward: Forward, resolution: tuple[int, int], device: torch.device,
              batch: int = 8) -> AccuracyCheck:
    """`forward` (bf16) against eager fp32 on `gate_inputs`, judged by the bf16 bounds (>= 99.5% top-1
    agreement, cosine >= 0.999, logits and embedding)."""
    x, _ = gate_inputs(resolution)
    got, want = [], []
    with torch.inference_mode():
        for i in range(0, len(x), batch):
            xb = x[i : i + batch].to(device)
            got.append([t.float().cpu().numpy() for t in forward(xb)])
            want.append([t.float().cpu().numpy() for t in model.forward_embedding(xb)])
    cat = lambda rows, k: np.concatenate([r[k] for r in rows])  # noqa: E731
    return judge(cat(want, 0), cat(got, 0), "bf16", (cat(want, 1), cat(got, 1)))


def compile_forward(model: torch.nn.Module, resolution: tuple[int, int], device: torch.device, name: str,
                    precision: str = "fp32", force: bool = False) -> Forward:
    """`model.forward_embedding` through `torch.compile` (inductor), compiled at batch 1 (its own static graph:
    dynamo specialises sizes of 1) and batch 2 with the batch dimension dynamic (one graph for every batch of 2
    or more: no recompile as the batcher's sizes vary), each graph's logits and embedding checked against eager
    on a seeded N(0, 1) input. Returns the compiled callable in dynamo's run-only mode: an input no checked
    graph fits (another dtype, say) runs eager, never a graph compiled later unchecked. ValueError (one line)
    when compiling fails or a graph's outputs differ from eager's beyond `PARITY_RTOL`.

    precision: "fp32"; "bf16" (CPU autocast, on a CPU with bf16), its accuracy measured against eager fp32 by
    `bf16_gate` and refused with the numbers below the bounds unless `force`; "auto": bf16 where the CPU has it
    and it passes the gate, else fp32 (logged)."""
    if precision not in COMPILE_PRECISIONS:
        raise ValueError(f"compile precision {precision!r} is not one of {', '.join(COMPILE_PRECISIONS)}")
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cpu" and cpu_has_bf16())
    if bf16 and (device.type != "cpu" or not cpu_has_bf16()):
        why = "CPU has no bf16 (AVX512_BF16 or AMX)" if device.type == "cpu" else "device is not the CPU"
        raise ValueError(f"--compile in bf16: this {why}; compile {name} in fp32")
    forward = _bf16(model.forward_embedding) if bf16 else model.forward_embedding
    compiled = _compiled(model, forward, resolution, device, name, bf16)
    if bf16:
        check = bf16_gate(model, compiled, resolution, device)
        log.info("--compile %s in bf16 autocast: %s", name, check.describe())
        if not check.ok and precision == "auto":
            log.warning("--compile %s: bf16 is below its bounds (%s); compiled in fp32", name, check.describe())
            return compile_forward(model, resolution, device, name, "fp32")
        if not check.ok and not force:
            raise ValueError(f"--compile {name} in bf16 is refused: {check.describe()} against eager fp32; "
                             "compile it in fp32 or force it")
    return torch._dynamo.run(compiled)


def _compiled(model: torch.nn.Module, forward: Forward, resolution: tuple[int, int], device: torch.device,
              name: str, bf16: bool) -> Forward:
    """`forward` compiled at batch 1 and 2 (dynamic), each graph checked against eager (bf16: at bf16's
    tolerance, a check for a wrong graph; its accuracy is `bf16_gate`'s)."""
    compiled = torch.compile(forward, backend="inductor")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for batch in (1, 2):
            x = torch.randn((batch, 3, *resolution), generator=gen).to(device)
            if batch > 1:
                torch._dynamo.mark_dynamic(x, 0)
            try:
                got = compiled(x)
            except Exception as e:  # inductor raises many types (a C++ compiler missing, a lowering failing)
                why = " ".join(str(e).split())[:300]
                raise ValueError(f"--compile: torch.compile (inductor) failed on {name}: {type(e).__name__}: "
                                 f"{why}: serve it without --compile") from e
            _check_parity(got, model, x, "--compile", "compiled", name, torch.bfloat16 if bf16 else None)
    return compiled


def _check_parity(got: tuple[torch.Tensor, torch.Tensor], model: torch.nn.Module, x: torch.Tensor, option: str,
                  what_ran: str, name: str, dtype: torch.dtype | None = None) -> None:
    """ValueError (one line naming `option`) when `got`, the (logits, embedding) of `x` from a compiled or traced
    forward, differ from eager's beyond `PARITY_RTOL` (of `dtype`, default the model's)."""
    rtol = PARITY_RTOL.get(dtype or next(model.parameters()).dtype, 2e-2)
    want = model.forward_embedding(x)
    for what, g, w in zip(("logits", "embedding"), got, want, strict=True):
        bad = mismatch(g, w, rtol)
        if bad is not None:
            raise ValueError(f"{option}: the {what_ran} {name} differs from eager at batch {x.shape[0]} (max "
                             f"|{what} difference| {bad[0]:.2e} > {bad[1]:.2e}): serve it without {option}")


def _traced(name: str, trace: Callable[[], T]) -> T:
    """`trace()`, a call of torch.jit's tracer, with its warnings silenced and its failure one ValueError line."""
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        # The trace records the shapes it saw as constants where Python reads them (the position embedding's
        # grid check): right for the one resolution served, and checked against eager after. torch.jit is
        # deprecated (a FutureWarning in torch 2.14) but still runs; a torch without it fails here, in one line.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", r".*torch\.jit.* is deprecated", FutureWarning)
        try:
            return trace()
        except Exception as e:  # the tracer raises many types (an op it cannot record, a Python-side branch)
            why = " ".join(str(e).split())[:300]
            raise ValueError(f"--torchscript: torch.jit.trace failed on {name}: {type(e).__name__}: {why}: serve "
                             "it without --torchscript") from e


def torchscript_forward(model: torch.nn.Module, resolution: tuple[int, int], device: torch.device, name: str
                        ) -> Forward:
    """`model.forward_embedding` traced with `torch.jit.trace_module` at batch 2 on a seeded N(0, 1) input (the
    batch dimension stays symbolic in the trace), then checked against eager at batch 1, 2 and 3. The trace
    is of this resolution only (the gateway's input size). ValueError (one line) when tracing fails or the
    trace's outputs differ from eager's beyond `PARITY_RTOL`."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((2, 3, *resolution), generator=gen).to(device)
    traced = _traced(name, lambda: torch.jit.trace_module(model, {"forward_embedding": x}, check_trace=False))
    forward: Forward = traced.forward_embedding
    _check_batches(forward, model, resolution, device, name, gen)
    return forward


def _check_batches(forward: Forward, model: torch.nn.Module, resolution: tuple[int, int], device: torch.device,
                   name: str, gen: torch.Generator) -> None:
    """`forward` (traced) against eager at batch 1, 2 and 3 (`_check_parity`)."""
    with torch.inference_mode():
        for batch in (1, 2, 3):
            x = torch.randn((batch, 3, *resolution), generator=gen).to(device)
            _check_parity(forward(x), model, x, "--torchscript", "traced", name)


class _BlockOut(torch.nn.Module):
    """An encoder block's tokens alone (its forward also returns an attention, None here): what a trace keeps."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)[0]


@dataclass(frozen=True)
class Stages:
    """`forward_embedding` (without token merging) as its stem, each encoder block and its tail
    (`VisionTransformer.forward_stem`, `.blocks`, `.forward_tail`), eager or each traced: the steps of a staged
    run (`TorchBackend.staged`), between which the runner may give the model's instance to more urgent work."""

    stem: Callable[[torch.Tensor], torch.Tensor]  # [B, 3, H, W] -> [B, T, D]
    blocks: list[Callable[[torch.Tensor], torch.Tensor]]  # [B, T, D] -> [B, T, D]
    tail: Forward  # [B, T, D] -> (logits [B, K], embedding [B, E])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stages run through at once: `forward_embedding(x)`."""
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.tail(h)

    @staticmethod
    def eager(model: torch.nn.Module) -> Stages:
        return Stages(model.forward_stem, [_BlockOut(b) for b in model.blocks], model.forward_tail)

    @staticmethod
    def traced(model: torch.nn.Module, resolution: tuple[int, int], device: torch.device, name: str) -> Stages:
        """Each stage traced as `torchscript_forward` traces the whole (batch 2, a seeded N(0, 1) input), the
        stages run through checked against eager at batch 1, 2 and 3: a paused run keeps TorchScript's release
        of the GIL."""
        gen = torch.Generator().manual_seed(1)
        x = torch.randn((2, 3, *resolution), generator=gen).to(device)
        with torch.no_grad():
            h = model.forward_stem(x)
        ends = _traced(name, lambda: torch.jit.trace_module(
            model, {"forward_stem": x, "forward_tail": h}, check_trace=False))
        blocks = [_traced(name, lambda b=b: torch.jit.trace(_BlockOut(b), h, check_trace=False))
                  for b in model.blocks]
        stages = Stages(ends.forward_stem, blocks, ends.forward_tail)
        _check_batches(stages, model, resolution, device, name, gen)
        return stages


@contextlib.contextmanager
def _cannot() -> Iterator[None]:
    """A ValueError of `vit_serve.similarity` (a model it cannot split, a layer it does not have) as the
    NotImplementedError a backend raises for a task it cannot do for this model (a 400 with its message)."""
    try:
        yield
    except ValueError as e:
        raise NotImplementedError(str(e)) from None


def _precision(dtype: torch.dtype, choice: RuntimeChoice | None) -> str:
    """The arithmetic the answers come out of: the weights' dtype, or the precision of the runtime chosen by
    measurement (`choice`, when another runtime than eager serves: e.g. OpenVINO in bf16), which the embedding
    space's fingerprint and /models then name."""
    if choice is not None and choice.chosen.count(":") == 1:
        return choice.chosen.split(":")[1]
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")


class TorchBackend(LocalBackend):
    """A checkpoint on PyTorch. `compile`: classify / embed run `compile_forward`'s callable; `torchscript`:
    `torchscript_forward`'s (not both). `choose` / `pin`: the runtime classify / embed run on, measured within
    `choice_budget_s` at batch 1 and `max_batch`, or pinned (`runtime.torch_forwards.choose_forward`)."""

    name = "torch"
    supports_grad_rollout = True

    def __init__(self, checkpoint: str | Path, model_name: str | None = None, device: str = "auto",
                 threads: int | None = None, tome: TomeR | None = None, compile: bool = False,
                 torchscript: bool = False, compile_precision: str = "fp32", force_precision: bool = False, *,
                 choose: bool = False, pin: str | None = None, choice_budget_s: float = 10.0, max_batch: int = 1,
                 spinning: bool = False) -> None:
        from vit_serve.checkpoints import load

        if threads is not None:
            torch.set_num_threads(threads)
        self.device = _device(device)
        model = load(checkpoint).eval()
        weights = weights_digest(model.state_dict())  # once, on the CPU copy: the embedding space's weights
        self.model = model.to(self.device)
        cfg = self.model.cfg
        if tome is not None:
            try:
                self.model.set_token_merging(tome)
            except ValueError as e:  # an r list longer than the model is deep
                raise ValueError(f"--tome for {Path(checkpoint).name}: {e}") from None
        res = (int(cfg.img_size[0]), int(cfg.img_size[1]))
        pre = self.model.preprocess_cfg or PreprocessConfig(input_size=res)
        name = model_name or Path(checkpoint).stem
        dtype = next(self.model.parameters()).dtype
        self._forward: Forward = self.model.forward_embedding
        eager = self._forward
        if compile and torchscript:
            raise ValueError(BOTH_FORWARDS)
        if compile:
            self._forward = compile_forward(self.model, res, self.device, name, compile_precision, force_precision)
        elif torchscript:
            self._forward = torchscript_forward(self.model, res, self.device, name)
        # a staged run (`staged`) traced where the whole forward is; none with --compile (one graph) or merging,
        # nor with RoPE (a block alone cannot know the patch grid its rotary table comes from)
        self._stages: Stages | None = None
        if not compile and self.model.token_merging is None and getattr(self.model, "rope", None) is None:
            self._stages = (Stages.traced(self.model, res, self.device, name) if torchscript
                            else Stages.eager(self.model))
        choice = None
        if (choose or pin is not None) and not (compile or torchscript) and wanted(self.device, dtype):
            chosen, choice = choose_forward(self.model, res, pin=pin, budget_s=choice_budget_s,
                                            max_batch=max_batch, spinning=spinning)
            log.info("%s: runtime %s", name, choice.describe())
            if chosen is not None:  # one graph: no stages
                self._forward, self._stages = chosen, None
        self._one_graph = self._forward is not eager
        info = ModelInfo(
            name=name,
            resolution=res,
            patch_size=cfg.patch_size,
            num_classes=cfg.num_classes,
            labels=self.model.labels,
            preprocess=pre.with_size(*res),
            explain=True,
            rollout=None,
            source=str(checkpoint),
            backend=self.name,
            device=str(self.device),
            pool=cfg.pool,
            embedding_dim=self.model.num_features,
            scores=cfg.scores,
            embedding=embedding_of(cfg),
            precision=_precision(dtype, choice if self._one_graph else None),
            token_merging=TokenMergingRecord.of(self.model.token_merging),
            compiled=compile,
            torchscript=torchscript,
            runtime_choice=choice,
            reference=None if self.model.token_merging else self.model.reference,  # made without merging
            max_patches=cfg.extra.get("max_patches"),
        )
        self.info = dataclasses.replace(info, embedding_space=embedding_space_of(
            weights, cfg, info.preprocess, info.precision, info.token_merging))

    def _input(self, x: np.ndarray) -> torch.Tensor:
        if not x.flags.writeable:  # e.g. a view of a request body; torch tensors must own writable memory
            x = x.copy()
        return torch.from_numpy(x).to(self.device, non_blocking=True)

    @staticmethod
    def _out(t: torch.Tensor) -> np.ndarray:
        return t.detach().float().cpu().numpy()

    def classify(self, x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            if self._one_graph:  # one graph serves both: its embedding costs nothing
                return self._out(self._forward(self._input(x))[0])
            return self._out(self.model(self._input(x)))

    def embed(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with torch.inference_mode():
            logits, embedding = self._forward(self._input(x))
            return self._out(logits), self._out(embedding)

    def embed_patches(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """NaFlex (`VisionTransformer.forward_patches`), eager."""
        b = unpack(self._input(x))
        with torch.inference_mode():
            logits, embedding = self.model.forward_patches(b.patches, b.spatial_shapes, b.mask)
        return self._out(logits), self._out(embedding)

    def explain_patches(self, x: np.ndarray, rollout: RolloutSettings | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
        """NaFlex rollout, each image alone at its own grid (`vit_serve.explain.explain_patches`)."""
        r = rollout or self.info.resolve_rollout()
        b = unpack(self._input(x))
        with torch.inference_mode():
            logits, maps = explain_patches(self.model, b.patches, b.spatial_shapes, r.head_fusion, r.discard_ratio)
        return self._out(logits), self._out(maps)

    def staged(self, task: Task, x: np.ndarray) -> Staged | None:
        """classify / embed one step a stage (`Stages`: the stem, each block, the tail), eager or traced as the
        whole forward is; None for explain and grad_rollout, with --compile, with token merging or RoPE."""
        if self._stages is None or task.kind not in ("classify", "embed") or task.max_patches is not None:
            return None
        return self._steps(self._stages, task, x)

    def _steps(self, stages: Stages, task: Task, x: np.ndarray) -> Staged:
        with torch.inference_mode():  # per step: inference mode is the calling thread's, and steps change thread
            h = stages.stem(self._input(x))
        for block in stages.blocks:
            yield
            with torch.inference_mode():
                h = block(h)
        yield
        with torch.inference_mode():
            logits, embedding = stages.tail(h)
        return {LOGITS: self._out(logits), **({EMBEDDING: self._out(embedding)} if task.kind == "embed" else {})}

    def explain(self, x: np.ndarray, rollout_settings: RolloutSettings | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """Any head fusion and discard ratio (`rollout_settings`; None: the defaults)."""
        r = rollout_settings or self.info.resolve_rollout()
        with torch.inference_mode():
            e = explain_forward(self.model, self._input(x), r.head_fusion, r.discard_ratio)
        return self._out(e.logits), self._out(e.heatmap.map)

    def grad_rollout(self, x: np.ndarray, target: int | None = None) -> np.ndarray:
        return self._out(grad_rollout(self.model, self._input(x), target).map[0])

    def similarity(self, x: np.ndarray, query: tuple[float, ...] | None, label: int | None,
                   rollout: RolloutSettings | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`vit_serve.similarity.similarity_map`; with `rollout`, the map times the rollout scaled to a maximum of 1
        per image (the cosine and the rest stay the plain split's)."""
        images = self._input(x)
        with torch.inference_mode(), _cannot():
            s = similarity_map(self.model, images, self._query(query, label))
            heat = s.map
            if rollout is not None:
                r = explain_forward(self.model, images, rollout.head_fusion, rollout.discard_ratio).heatmap.map
                heat = heat * (r / r.amax(dim=(1, 2), keepdim=True).clamp(min=1e-12)).to(heat)
        return self._out(heat), self._out(s.cosine), self._out(s.rest)

    def _query(self, query: tuple[float, ...] | None, label: int | None) -> torch.Tensor:
        """The query vector: as given, or the zero-shot head's row `label` (its label's text embedding)."""
        if query is not None:
            return torch.tensor(query, dtype=torch.float32, device=self.device)
        if not self.model.cfg.embed_norm or label is None:
            raise NotImplementedError(f"{self.info.name} has no zero-shot head (vit-serve convert --zero-shot "
                                      f"writes one): ask with text= or query_id=")
        return self.model.head.weight[label].detach()

    def patch_tokens(self, x: np.ndarray, layer: int = -1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`vit_serve.similarity.patch_tokens` of block `layer`, and the logits and embedding of the same images."""
        images = self._input(x)
        with torch.inference_mode(), _cannot():
            tokens = patch_tokens(self.model, images, layer)
            logits, embedding = self.model.forward_embedding(images)
        return self._out(logits), self._out(embedding), self._out(tokens)
