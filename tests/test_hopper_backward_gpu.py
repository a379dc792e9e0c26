"""08's Gluon backward (hopper_backward, hopper_attention_train) on a Hopper GPU: gradients against float64
autograd over MHA, GQA and MQA, both masks, offsets, T != S, D 64 and 128, bf16 and fp16; the fallback to 06's
kernels where the Gluon kernels do not apply."""

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernels)")]


def _on_hopper() -> bool:
    from flashcourse.engine import hopper

    return hopper.gluon is not None and torch.cuda.get_device_capability()[0] == 9


hopper_only = pytest.mark.skipif(not torch.cuda.is_available() or not _on_hopper(),
                                 reason="the Gluon backward needs a Hopper GPU and Triton's Gluon layer")


def _inputs(batch, q_heads, kv_heads, t, s, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(batch, q_heads, t, d, device="cuda", dtype=dtype, generator=gen) for _ in "qo")
    k, v = (torch.randn(batch, kv_heads, s, d, device="cuda", dtype=dtype, generator=gen) for _ in "kv")
    return q, k, v, do


def _float64_gradients(q, k, v, do, causal, offset):
    """(dq, dk, dv) of softmax(q k^T / sqrt(D)) v in float64, query i at offset + i, K and V shared by groups."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        t, s = scores.shape[-2:]
        later = torch.arange(s, device="cuda")[None, :] > torch.arange(t, device="cuda")[:, None] + offset
        scores = scores.masked_fill(later, float("-inf"))
    o = torch.softmax(scores, -1) @ v.repeat_interleave(group, 1)
    return torch.autograd.grad(o, (q, k, v), do.double())


def _errors(got, want):
    return [float((a.double() - b).abs().max()) for a, b in zip(got, want)]


def _assert_within_twice_06(got, q, k, v, o, lse, do, causal, offset, query_offset, where=""):
    """Each of dq, dk, dv within twice the error of 06's Triton kernels (plus 2e-3) against float64 autograd."""
    from flashcourse.engine.backward import flash_attention_backward

    want = _float64_gradients(q, k, v, do, causal, query_offset)
    bounds = _errors(flash_attention_backward(q, k, v, o, lse, do, offset, causal), want)
    for name, error, bound in zip(("dq", "dk", "dv"), _errors(got, want), bounds):
        assert error <= 2 * bound + 2e-3, f"{name}{where}: error {error:.2e}, 06's kernels {bound:.2e}"


SHAPES = [  # (batch, Hq, Hkv, T, S, D, causal, query_offset)
    (2, 4, 4, 256, 256, 128, True, None), (1, 8, 2, 384, 384, 128, True, None), (1, 4, 1, 256, 512, 64, True, None),
    (2, 4, 2, 256, 384, 128, False, None), (1, 6, 2, 512, 256, 64, False, None), (1, 2, 1, 128, 512, 128, True, 100),
    (1, 2, 2, 1024, 1024, 128, True, None)]


@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("atomic_dq", [False, True])
@pytest.mark.parametrize("batch, q_heads, kv_heads, t, s, d, causal, offset", SHAPES)
def test_hopper_backward_matches_float64(batch, q_heads, kv_heads, t, s, d, causal, offset, atomic_dq, dtype):
    """dq, dk and dv of the Gluon kernels within twice 06's Triton kernels' error (plus 2e-3) against float64
    autograd, given the same o and lse; the kernels ran (fallback=False)."""
    from flashcourse.engine.backward import flash_attention_lse
    from flashcourse.engine.hopper_backward import hopper_backward

    q, k, v, do = _inputs(batch, q_heads, kv_heads, t, s, d, dtype)
    query_offset = s - t if offset is None else offset
    o, lse = flash_attention_lse(q, k, v, query_offset, causal)
    got = hopper_backward(q, k, v, o, lse, do, causal, offset, atomic_dq=atomic_dq, fallback=False)
    _assert_within_twice_06(got, q, k, v, o, lse, do, causal, offset, query_offset)
    assert [x.dtype for x in got] == [dtype] * 3 and got[1].shape == k.shape


@hopper_only
@pytest.mark.parametrize("atomic_dq", [False, True])
@pytest.mark.parametrize("batch, q_heads, kv_heads, t, s, d, causal, offset", [SHAPES[3], SHAPES[2]])
def test_hopper_backward_register_split_keeps_its_sums(batch, q_heads, kv_heads, t, s, d, causal, offset, atomic_dq):
    """The dK/dV kernel's consumer 1 at 232 or 240 registers (consumer_registers) moves spills, not sums: dk and dv
    the same bits both ways, and dq too from the dQ kernel (added in no fixed order, with atomic_dq, it may differ
    in its last bits)."""
    from flashcourse.engine.backward import flash_attention_lse
    from flashcourse.engine.hopper_backward import hopper_backward

    q, k, v, do = _inputs(batch, q_heads, kv_heads, t, s, d, torch.bfloat16)
    o, lse = flash_attention_lse(q, k, v, s - t if offset is None else offset, causal)
    first, second = (hopper_backward(q, k, v, o, lse, do, causal, offset, atomic_dq=atomic_dq, fallback=False,
                                     consumer_registers=regs) for regs in (232, 240))
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    assert torch.equal(first[0], second[0]) or atomic_dq


@hopper_only
@pytest.mark.parametrize("t", [256, 4096])
def test_hopper_backward_default_runs_the_dq_kernel_below_one_kernel_from_t(t, monkeypatch):
    """By default the dQ kernel runs below ONE_KERNEL_FROM_T queries and not from there, where the dK/dV kernel
    adds dq by TMA: GQA 2, causal, D = 64, bf16, gradients within the bound above against float64."""
    from flashcourse.engine import hopper_backward as hb
    from flashcourse.engine.backward import flash_attention_lse

    launches = []
    kernel = hb.hopper_dq_kernel

    class Counted:  # hopper_dq_kernel[grid](...), launches counted
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(hb, "hopper_dq_kernel", Counted())
    q, k, v, do = _inputs(1, 2, 1, t, t, 64, torch.bfloat16)
    o, lse = flash_attention_lse(q, k, v, 0, True)
    got = hb.hopper_backward(q, k, v, o, lse, do, fallback=False)
    assert len(launches) == (t < hb.ONE_KERNEL_FROM_T), f"{len(launches)} launches of the dQ kernel at T = {t}"
    _assert_within_twice_06(got, q, k, v, o, lse, do, True, 0, 0, where=f" at T = {t}")


@hopper_only
@pytest.mark.parametrize("causal", [True, False])
def test_hopper_attention_train_through_autograd(causal):
    """hopper_attention_train: the Gluon forward and backward through loss.backward(), GQA 4, T = S = 640, bf16.
    flash-attn's rule: each gradient's error against float64 autograd is within twice that of PyTorch's own
    bf16 attention (scaled_dot_product_attention) plus 1e-3."""
    from torch.nn.functional import scaled_dot_product_attention

    from flashcourse.engine.hopper_backward import hopper_attention_train

    q, k, v, do = _inputs(2, 8, 2, 640, 640, 128, torch.bfloat16, seed=1)
    want = _float64_gradients(q, k, v, do, causal, 0)
    errors = {}
    for name, attention in (("course", lambda *x: hopper_attention_train(*x, causal=causal)),
                            ("torch", lambda *x: scaled_dot_product_attention(*x, is_causal=causal, enable_gqa=True))):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        attention(*leaves).backward(do)
        errors[name] = _errors([x.grad for x in leaves], want)
    for grad, mine, torchs in zip(("dq", "dk", "dv"), errors["course"], errors["torch"]):
        assert mine <= 2 * torchs + 1e-3, f"{grad}: error {mine:.2e}, PyTorch's {torchs:.2e}"


@pytest.mark.parametrize("t, s, d, dtype, causal, offset", [
    (100, 100, 64, torch.bfloat16, True, None),     # T not a multiple of 128
    (128, 200, 128, torch.float16, False, None),    # S not a multiple of 128
    (256, 128, 64, torch.bfloat16, True, None),     # queries before key 0
    (128, 128, 32, torch.bfloat16, True, None),     # D = 32
    (128, 128, 64, torch.float32, True, None),      # FP32
    (1, 1, 16, torch.float16, False, None),         # the peer suite's smallest case
])
def test_hopper_backward_falls_back_to_06(t, s, d, dtype, causal, offset):
    """Inputs the Gluon kernels do not take get 06's kernels' gradients exactly; fallback=False raises."""
    from flashcourse.engine.backward import flash_attention_backward, flash_attention_lse
    from flashcourse.engine.hopper_backward import hopper_backward

    q, k, v, do = _inputs(1, 4, 2, t, s, d, dtype)
    o, lse = flash_attention_lse(q, k, v, offset, causal)
    got = hopper_backward(q, k, v, o, lse, do, causal, offset)
    want = flash_attention_backward(q, k, v, o, lse, do, offset, causal)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises((ValueError, RuntimeError)):
        hopper_backward(q, k, v, o, lse, do, causal, offset, fallback=False)
