"""The compiled backward kernels on a CUDA GPU: bf16 and fp16 gradients against FP32 autograd, every
autotuned block configuration, odd lengths, GQA, and dQ the same bit for bit on every run."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")]


@pytest.fixture(scope="module")
def bw():
    from flashcourse.bench_backward import engine

    return engine()


def _relative_errors(got, q, k, v, do, causal, query_offset=None):
    """max |got - want| / max |want| for (dq, dk, dv), want by FP32 autograd of the naive attention."""
    from flashcourse.bench_backward import gradients, naive_attention

    if query_offset is None:
        attention = lambda q, k, v: naive_attention(q, k, v, causal)  # noqa: E731
    else:  # queries at query_offset + i: the naive attention over a longer query axis, cut to the last T rows
        from flashcourse import reference

        qp = query_offset + torch.arange(q.shape[2], device=q.device)
        mask = reference.visible_mask(q, k, query_positions=qp)                 # [1, 1, T, S]

        def attention(q, k, v):
            group = q.shape[1] // k.shape[1]
            scores = q @ k.repeat_interleave(group, 1).transpose(-2, -1) / q.shape[-1] ** 0.5
            return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v.repeat_interleave(group, 1)
    want = gradients(attention, q.float(), k.float(), v.float(), do.float())
    return [float((a.float() - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]


@pytest.mark.parametrize("dtype, d, causal", [(torch.bfloat16, 128, True), (torch.bfloat16, 64, True),
                                              (torch.bfloat16, 128, False), (torch.bfloat16, 64, False),
                                              (torch.float16, 128, True)])
def test_gradients_against_fp32(bw, dtype, d, causal):
    """T = S = 1000 (no block divides it), GQA 8/2, autotuned: dq, dk, dv within 2 % of FP32's largest gradient."""
    from flashcourse.bench_backward import _inputs

    q, k, v, do = _inputs(2, 8, 2, 1000, 1000, d, dtype)
    o, lse = bw.flash_attention_lse(q, k, v, causal=causal)
    got = bw.flash_attention_backward(q, k, v, o, lse, do, causal=causal)
    assert [g.dtype for g in got] == [dtype] * 3 and [g.shape for g in got] == [q.shape, k.shape, v.shape]
    errors = _relative_errors(got, q, k, v, do, causal)
    assert max(errors) < 2e-2, f"relative errors of dq, dk, dv: {errors}"


def test_every_block_configuration(bw, monkeypatch):
    """Each autotuned configuration of the dK/dV and dQ kernels on its own, causal, T = 1000 over S = 1337."""
    from flashcourse.bench_backward import _inputs

    q, k, v, do = _inputs(1, 8, 2, 1000, 1337, 128, torch.bfloat16)
    o, lse = bw.flash_attention_lse(q, k, v)
    for dkdv, dq in zip(list(bw.dkdv_tuned.configs), list(bw.dq_tuned.configs)):
        monkeypatch.setattr(bw.dkdv_tuned, "configs", [dkdv])
        monkeypatch.setattr(bw.dq_tuned, "configs", [dq])
        monkeypatch.setattr(bw.dkdv_tuned, "cache", {})
        monkeypatch.setattr(bw.dq_tuned, "cache", {})
        errors = _relative_errors(bw.flash_attention_backward(q, k, v, o, lse, do), q, k, v, do, True, 1337 - 1000)
        assert max(errors) < 2e-2, f"dK/dV {dkdv}, dQ {dq}: relative errors of dq, dk, dv {errors}"


@pytest.mark.parametrize("t, s, offset", [(300, 1000, None), (300, 1000, 200), (1000, 700, 0), (1000, 700, -250)])
def test_query_offset(bw, t, s, offset):
    """Chunked prefill (T < S), T > S with every query after key 0, and queries before key 0 (zero gradients)."""
    from flashcourse.bench_backward import _inputs

    q, k, v, do = _inputs(1, 4, 1, t, s, 64, torch.bfloat16)
    o, lse = bw.flash_attention_lse(q, k, v, offset)
    dq, dk, dv = bw.flash_attention_backward(q, k, v, o, lse, do, offset)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    first = 0 if offset is None or offset >= 0 else -offset      # the first query that sees key 0
    assert torch.equal(lse[:, :, :first], torch.full_like(lse[:, :, :first], float("-inf")))
    assert not dq[:, :, :first].any(), "queries that see no key must get dq = 0"
    rows = slice(first, None)
    errors = _relative_errors((dq[:, :, rows], dk, dv), q[:, :, rows], k, v, do[:, :, rows], True,
                              (s - t if offset is None else offset) + first)
    assert max(errors) < 2e-2, f"relative errors of dq, dk, dv: {errors}"


def test_dq_deterministic(bw):
    """30 backward passes at T = S = 4096 give dq, dk and dv the same bit for bit (no race on dq)."""
    from flashcourse.bench_backward import _inputs

    q, k, v, do = _inputs(1, 8, 2, 4096, 4096, 128, torch.bfloat16)
    o, lse = bw.flash_attention_lse(q, k, v)
    first = bw.flash_attention_backward(q, k, v, o, lse, do)
    for run in range(30):
        again = bw.flash_attention_backward(q, k, v, o, lse, do)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"run {run}: {name} differs from the first run by {(a - b).abs().max():.2e}"
    atomic = bw.flash_attention_backward(q, k, v, o, lse, do, atomic_dq=True)
    assert (atomic[0].float() - first[0].float()).abs().max() <= 2e-2 * first[0].float().abs().max()


def test_train_matches_sdpa(bw):
    """flash_attention_train through loss.backward(): the same gradients as SDPA's is_causal=True, bf16, GQA."""
    from torch.nn.functional import scaled_dot_product_attention

    from flashcourse.bench_backward import _inputs

    q, k, v, do = _inputs(2, 8, 2, 777, 777, 64, torch.bfloat16)
    grads = []
    for attention in (bw.flash_attention_train,
                      lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        (attention(*leaves) * do).sum().backward()
        grads.append([x.grad.float() for x in leaves])
    for name, mine, theirs in zip(("dq", "dk", "dv"), *grads):
        assert (mine - theirs).abs().max() <= 2e-2 * theirs.abs().max(), name


def test_validation(bw):
    """D = 48 and Hq % Hkv != 0 raise ValueError on the GPU before anything is launched."""
    q = torch.randn(1, 3, 16, 48, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        bw.flash_attention_train(q, q[:, :1], q[:, :1])
    q = torch.randn(1, 3, 16, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        bw.flash_attention_train(q, q[:, :2], q[:, :2])
