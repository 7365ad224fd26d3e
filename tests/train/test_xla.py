"""vit_serve.train.xla: when torch_xla's Pallas flash attention is exact, and what runs instead.

The reference for the padding is torch_xla 2.9's own code (torch_xla/experimental/custom_kernel.py,
`_fa_custom_forward_single_device`): K and V are padded with zeros along the sequence to a multiple of
max(block_k_major, block_k) = min(512, N), and the padding is masked (-inf) only inside an `ab` bias, which
we do not pass. `torch_xla_padded_attention` below does the same in torch, to show what the kernel would
compute where the rule refuses it. The TPU kernel itself needs a TPU; those tests skip here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vit_serve.train import xla
from vit_serve.train.xla import PallasAttention, pallas_is_exact


def torch_xla_padded_attention(q, k, v, causal=False, sm_scale=1.0):
    """torch_xla's flash_attention without `ab`, as its source pads: zero keys and values, no mask."""
    n = k.shape[-2]
    block = min(512, n)
    pad = (block - n % block) % block
    k = torch.cat([k, k.new_zeros(*k.shape[:-2], pad, k.shape[-1])], dim=-2)
    v = torch.cat([v, v.new_zeros(*v.shape[:-2], pad, v.shape[-1])], dim=-2)
    return ((q @ k.transpose(-2, -1)) * sm_scale).softmax(-1) @ v


@pytest.mark.parametrize("n, exact", [(5, True), (65, True), (197, True), (512, True), (513, False),
                                      (577, False), (1024, True), (1025, False), (2048, True)])
def test_pallas_is_exact_where_no_padding_happens(n, exact):
    assert pallas_is_exact(n) is exact
    q, k, v = torch.randn(3, 1, 2, n, 8, generator=torch.Generator().manual_seed(n)).unbind(0)
    err = (torch_xla_padded_attention(q, k, v, sm_scale=8**-0.5) - F.scaled_dot_product_attention(q, k, v)).abs().max()
    assert bool(err <= 1e-5) is exact, float(err)  # the rule says False exactly where the padding changes the result


def test_vit_sequence_lengths():
    assert pallas_is_exact(1 + 14 * 14)  # 224/16: 197 tokens
    assert not pallas_is_exact(1 + 24 * 24)  # 384/16: 577 tokens, 447 zero keys in every softmax


def test_pallas_attention_falls_back_to_sdpa():
    calls = []

    def kernel(q, k, v, causal, sm_scale):
        calls.append(k.shape[-2])
        return torch_xla_padded_attention(q, k, v, causal, sm_scale)

    attn = PallasAttention(kernel)
    g = torch.Generator().manual_seed(0)
    for n in (197, 577):
        q, k, v = torch.randn(3, 2, 3, n, 16, generator=g).unbind(0)
        want = F.scaled_dot_product_attention(q, k, v)
        assert (attn(q, k, v) - want).abs().max() <= 1e-5
    assert calls == [197]  # the kernel only where exact
    q, k, v = torch.randn(3, 2, 3, 197, 16, generator=g).unbind(0)
    torch.manual_seed(1)
    dropped = attn(q, k, v, dropout_p=0.5)
    torch.manual_seed(1)
    assert torch.equal(dropped, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))  # no dropout in the kernel
    assert calls == [197]


def test_missing_kernel_is_an_error_naming_the_extra():
    try:
        import jax.experimental.pallas  # noqa: F401
        from torch_xla.experimental.custom_kernel import flash_attention  # noqa: F401

        pytest.skip("torch_xla with Pallas is installed here")
    except ImportError:
        pass
    import vit_serve

    with pytest.raises(ImportError, match=r"torch_xla\[tpu,pallas\]"):
        xla.use_pallas_attention(vit_serve.create_model("Ti/16", num_classes=2, depth=1))


def test_xla_process_group_under_torchrun(tmp_path):
    """Two processes under torchrun join torch_xla's "xla" backend with xla://. Where the PJRT runtime forms one
    world of both (TPU), their tensors sum across it; on PJRT_DEVICE=CPU every process is a world of one (torch_xla
    2.9), and the run must stop with that reason instead of training two replicas that overwrite each other."""
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e '.[tpu]')")
    import os
    import subprocess
    import sys

    script = tmp_path / "xla_group.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from vit_serve.train import distributed\n"
        "try:\n"
        "    rank, world = distributed.setup('xla')\n"
        "except RuntimeError as e:\n"
        "    print('REFUSED', e, flush=True); raise SystemExit(0)\n"
        "from vit_serve.train import xla\n"
        "dev = xla.device()\n"
        "total = distributed.sum_across(torch.tensor(rank + 1, device=dev))\n"
        "assert dist.get_backend() == 'xla' and world == 2 and int(total.item()) == 3, (dist.get_backend(), total)\n"
        "print('SUMMED', flush=True)\n"
        "distributed.teardown()\n")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script)], capture_output=True, text=True, timeout=600, env={**os.environ,
                       "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU"), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    if os.environ.get("PJRT_DEVICE", "CPU") == "CPU":
        refused = [line for line in r.stdout.splitlines() if line.startswith("REFUSED")]
        assert len(refused) == 2 and "world of 1" in refused[0] and "torchrun started 2" in refused[0], r.stdout
    else:
        assert r.stdout.count("SUMMED") == 2, r.stdout
