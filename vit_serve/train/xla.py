"""XLA / TPU glue (the `[tpu]` extra: torch_xla with its matching torch release, jax for the Pallas kernels).

The step stays XLA-friendly: no host syncs inside the loop (the loss is read only at log steps), gradients
all-reduced by torch_xla (`xm.reduce_gradients`, before clipping, as DDP does), then a graph cut per step.
Several processes join torch_xla's own process group (backend "xla", `init_method="xla://"`: rank, world
size and master address come from the PJRT runtime), never gloo, whose CPU collectives cannot take XLA
tensors. On TPU, attention runs torch_xla's Pallas flash-attention kernel wherever it is exact
(:func:`pallas_is_exact`), SDPA elsewhere.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# torch_xla's FlashAttention.DEFAULT_BLOCK_SIZES["block_k_major"] and ["block_k"] (torch_xla 2.5-2.9).
PALLAS_KV_BLOCK = 512


def available() -> bool:
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True


def device() -> torch.device:
    import torch_xla

    return torch_xla.device()


def hardware(dev: torch.device) -> str:
    """"TPU", "CPU", "CUDA" ... of an XLA device."""
    import torch_xla.core.xla_model as xm

    return xm.xla_device_hw(dev)


def init_process_group() -> None:
    """Join torch_xla's process group under torchrun (before the XLA device is first touched: the
    rendezvous initialises the PJRT runtime for this process)."""
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" backend and xla://

    dist.init_process_group("xla", init_method="xla://")
    launched = int(os.environ.get("WORLD_SIZE", 1))
    if dist.get_world_size() != launched:
        # xla:// takes the world from the PJRT runtime, not from torchrun. On PJRT_DEVICE=CPU every process is
        # its own world of one: training on would run independent replicas that overwrite each other's files.
        world = dist.get_world_size()
        dist.destroy_process_group()
        runtime = os.environ.get("PJRT_DEVICE", "?")
        raise RuntimeError(f"torchrun started {launched} processes but the XLA runtime ({runtime}) joins them into "
                           f"a world of {world}: multi-process XLA needs TPUs (or XLA GPUs); on PJRT_DEVICE=CPU run "
                           "one process")


def manual_seed(seed: int, dev: torch.device) -> None:
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(seed, str(dev))


def pallas_is_exact(seq_len: int, block: int = PALLAS_KV_BLOCK) -> bool:
    """Whether torch_xla's Pallas flash attention computes exact attention over `seq_len` tokens.

    torch_xla pads K and V with zeros up to a multiple of min(block, N) and masks the padding only when an
    additive bias `ab` is passed; without one the zero keys (logit 0) enter every softmax. So the kernel is
    exact only when no padding happens: N <= block or N a multiple of block. (ViT at 224/16: N = 197, exact;
    at 384/16: N = 577, 447 zero keys: not exact.)
    """
    return seq_len <= block or seq_len % block == 0


class PallasAttention:
    """An `Attention.attention_fn`: the Pallas kernel where it is exact, SDPA otherwise (other lengths,
    attention dropout or an additive mask such as token merging's proportional attention, which the kernel
    lacks)."""

    def __init__(self, flash_attention) -> None:
        self.flash_attention = flash_attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                 attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if dropout_p or attn_mask is not None or not pallas_is_exact(k.shape[-2]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        return self.flash_attention(q, k, v, causal=False, sm_scale=q.shape[-1] ** -0.5)


def use_pallas_attention(model: torch.nn.Module) -> None:
    """Route every Attention module through :class:`PallasAttention`. The kernel is traced with jax when it is
    called, so jax is imported here: a missing one is an error naming the extra, never a silent fallback."""
    try:
        from torch_xla.experimental.custom_kernel import flash_attention
    except ImportError as e:
        raise ImportError(f"the Pallas flash-attention kernel of torch_xla cannot be imported ({e}); "
                          "install torch_xla[tpu,pallas] (pip install -e '.[tpu]')") from e
    try:
        import jax.experimental.pallas  # noqa: F401
    except ImportError as e:
        raise ImportError(f"torch_xla's Pallas flash attention needs jax and Pallas ({e}); install "
                          "torch_xla[tpu,pallas] (pip install -e '.[tpu]')") from e
    from vit_serve.model import Attention

    attention = PallasAttention(flash_attention)
    for m in model.modules():
        if isinstance(m, Attention):
            m.attention_fn = attention


def reduce_gradients(optimizer: torch.optim.Optimizer) -> None:
    """All-reduce (mean) the gradients across the XLA processes; nothing with one process."""
    import torch_xla.core.xla_model as xm

    xm.reduce_gradients(optimizer)


def sync() -> None:
    """Cut the lazy graph here and run it (one compiled step)."""
    import torch_xla

    if hasattr(torch_xla, "sync"):
        torch_xla.sync()
    else:  # older releases
        import torch_xla.core.xla_model as xm

        xm.mark_step()
