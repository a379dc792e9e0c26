"""The compiled backward kernels on a CUDA GPU: bf16 and fp16 gradients against FP32 autograd, every
autotuned block configuration, odd lengths, GQA, and dQ the same bit for bit on every run."""

import functools

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")]


@pytest.fixture(scope="module")
def bw():
    from instructor.bench_backward import engine

    return engine()


def _relative_errors(got, q, k, v, do, causal, query_offset=None):
    """max |got - want| / max |want| for (dq, dk, dv), want by FP32 autograd of the naive attention."""
    from instructor.bench_backward import gradients, naive_attention

    if query_offset is None:
        attention = lambda q, k, v: naive_attention(q, k, v, causal)  # noqa: E731
    else:  # queries at query_offset + i: the naive attention over a longer query axis, cut to the last T rows
        from flashcourse.checks import reference

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
    from instructor.bench_backward import _inputs

    q, k, v, do = _inputs(2, 8, 2, 1000, 1000, d, dtype)
    o, lse = bw.flash_attention_lse(q, k, v, causal=causal)
    got = bw.flash_attention_backward(q, k, v, o, lse, do, causal=causal)
    assert [g.dtype for g in got] == [dtype] * 3 and [g.shape for g in got] == [q.shape, k.shape, v.shape]
    errors = _relative_errors(got, q, k, v, do, causal)
    assert max(errors) < 2e-2, f"relative errors of dq, dk, dv: {errors}"


def test_every_block_configuration(bw, monkeypatch):
    """Each autotuned configuration of the dK/dV and dQ kernels on its own, causal, T = 1000 over S = 1337."""
    from instructor.bench_backward import _inputs

    q, k, v, do = _inputs(1, 8, 2, 1000, 1337, 128, torch.bfloat16)
    o, lse = bw.flash_attention_lse(q, k, v)
    for dkdv, dq in zip(list(bw.dkdv_tuned.configs), list(bw.dq_tuned.configs)):
        monkeypatch.setattr(bw.dkdv_tuned, "configs", [dkdv])
        monkeypatch.setattr(bw.dq_tuned, "configs", [dq])
        monkeypatch.setattr(bw.dkdv_tuned, "cache", {})
        monkeypatch.setattr(bw.dq_tuned, "cache", {})
        errors = _relative_errors(bw.flash_attention_backward(q, k, v, o, lse, do), q, k, v, do, True, 1337 - 1000)
        assert max(errors) < 2e-2, f"dK/dV {dkdv}, dQ {dq}: relative errors of dq, dk, dv {errors}"


@pytest.mark.parametrize("atomic_dq", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [16, 64])
def test_short_fp16_sequences_every_configuration(bw, monkeypatch, d, causal, atomic_dq):
    """fp16, T = S = 1, 2 and 3 under each dQ and dK/dV configuration, dq by its kernel or by atomics: a key tile
    that is mostly padding.

    A padded key loads as 0, so its score is 0 and P = exp(-lse) there: with a very negative lse that passes
    fp16's 65504 when dS is rounded for the product, and inf times the padded key's 0 is NaN in dq."""
    from instructor.bench_backward import _inputs, gradients, naive_attention

    for t in (1, 2, 3):
        _, k, v, do = _inputs(1, 2, 2, t, t, d, torch.float16)
        q = -4 * k                                 # each query against its own key: a score of -4 sqrt(D)
        o, lse = bw.flash_attention_lse(q, k, v, causal=causal)
        for dkdv, dq in zip(list(bw.dkdv_tuned.configs), list(bw.dq_tuned.configs)):
            for tuned, config in ((bw.dkdv_tuned, dkdv), (bw.dq_tuned, dq)):
                monkeypatch.setattr(tuned, "configs", [config])
                monkeypatch.setattr(tuned, "cache", {})
            got = bw.flash_attention_backward(q, k, v, o, lse, do, causal=causal, atomic_dq=atomic_dq)
            assert all(bool(g.isfinite().all()) for g in got), f"T = S = {t}, D = {d}, dQ {dq}: NaN or inf"
            want = gradients(lambda q, k, v: naive_attention(q, k, v, causal), q.float(), k.float(), v.float(),
                             do.float())
            # Relative to the largest gradient, or to 1 where it is 0 (one key: dq = dk = 0 exactly).
            errors = [float((a.float() - b).abs().max() / b.abs().max().clamp(min=1)) for a, b in zip(got, want)]
            assert max(errors) < 2e-2, f"T = S = {t}, D = {d}, dK/dV {dkdv}, dQ {dq}: relative errors {errors}"


@pytest.mark.parametrize("t, s, offset", [(300, 1000, None), (300, 1000, 200), (1000, 700, 0), (1000, 700, -250)])
def test_query_offset(bw, t, s, offset):
    """Chunked prefill (T < S), T > S with every query after key 0, and queries before key 0 (zero gradients)."""
    from instructor.bench_backward import _inputs

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
    from instructor.bench_backward import _inputs

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

    from instructor.bench_backward import _inputs

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


@functools.cache
def _dq_by_key_blocks():
    """The kernel of _racy_backward, defined (and compiled) once; Triton is imported only where a GPU runs."""
    import triton
    import triton.language as tl

    @triton.jit
    def dq_by_key_blocks(
        q_ptr, k_ptr, v_ptr, do_ptr,         # q, do [T, D]; k, v [S, D]; contiguous FP32
        lse_ptr, delta_ptr,                  # lse and Δ [T], FP32
        dq_ptr,                              # dq [T, D], FP32, zeroed: every program adds into it
        T, S,                                # number of queries and of keys
        sm_scale,                            # 1 / sqrt(D)
        D: tl.constexpr,                     # head dimension
        BLOCK_M: tl.constexpr,               # >= T: all queries in one tile
        BLOCK_N: tl.constexpr,               # keys per program
        ATOMIC: tl.constexpr,                # tl.atomic_add, or a racy load-add-store
    ):
        keys = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, D)
        row_ok = rows < T
        key_ok = keys < S
        q = tl.load(q_ptr + rows[:, None] * D + cols[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptr + rows[:, None] * D + cols[None, :], mask=row_ok[:, None], other=0.0)
        k = tl.load(k_ptr + keys[:, None] * D + cols[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + keys[:, None] * D + cols[None, :], mask=key_ok[:, None], other=0.0)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale                 # [BLOCK_M, BLOCK_N]
        p = tl.where(row_ok[:, None] & key_ok[None, :], tl.exp(s - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])
        dq = tl.dot(ds, k, input_precision="ieee") * sm_scale                         # [BLOCK_M, D]
        at = dq_ptr + rows[:, None] * D + cols[None, :]
        if ATOMIC:
            tl.atomic_add(at, dq, mask=row_ok[:, None])
        else:
            tl.store(at, tl.load(at, mask=row_ok[:, None], other=0.0) + dq, mask=row_ok[:, None])

    return dq_by_key_blocks


def _racy_backward(bw, atomic: bool):
    """A backward whose dQ comes from one program per block of 64 keys, each adding its share into the same
    FP32 rows of dQ: with tl.atomic_add (atomic) or with a plain load-add-store (a race). dK and dV are the
    engine's. For one head (B = Hq = Hkv = 1), T <= 64 queries that see every key."""
    import triton

    dq_by_key_blocks = _dq_by_key_blocks()

    def backward(q, k, v, o, lse, do, query_offset=None):
        _, dk, dv = bw.flash_attention_backward(q, k, v, o, lse, do, query_offset)
        T, S, D = q.shape[2], k.shape[2], q.shape[3]
        dq = torch.zeros(T, D, device=q.device, dtype=torch.float32)
        dq_by_key_blocks[(triton.cdiv(S, 64),)](q[0, 0].contiguous(), k[0, 0].contiguous(), v[0, 0].contiguous(),
                                               do[0, 0].contiguous(), lse[0, 0].contiguous(),
                                               bw.backward_delta(o, do)[0, 0].contiguous(), dq, T, S, D ** -0.5,
                                               D=D, BLOCK_M=64, BLOCK_N=64, ATOMIC=atomic)
        return dq[None, None], dk, dv

    backward.__name__ = "atomic_dq_backward" if atomic else "racy_dq_backward"
    return backward


def test_dq_race_is_caught(bw):
    """64 queries over 4096 keys in FP32, 64 programs adding into the same rows of dQ: the repeated check fails
    a load-add-store every time and names the race; atomics and the engine's two dQ paths pass it."""
    from flashcourse.checks import core as ac
    from flashcourse.checks import backward as bc

    crowded = ac.make_case("64 queries over 4096 keys", batch=1, q_heads=1, kv_heads=1, t=64, s=4096, d=64,
                           query_offset=4095, seed=7, dtype=torch.float32, device="cuda")
    for trial in range(3):
        with pytest.raises(AssertionError, match="changes from run to run"):
            bc.check_backward_repeated(_racy_backward(bw, atomic=False), crowded, runs=5)
    bc.check_backward_repeated(_racy_backward(bw, atomic=True), crowded, runs=5)
    bc.check_backward_repeated(bw.flash_attention_backward, crowded, runs=5)
    with_atomics = lambda *args, **kwargs: bw.flash_attention_backward(*args, atomic_dq=True, **kwargs)  # noqa: E731
    bc.check_backward_repeated(with_atomics, crowded, runs=5)


def test_hidden_checks_pass_compiled(bw):
    """The engine passes 06's hidden Triton cells compiled (float32, true FP32 products), each kernel alone (the
    repeated many-key-block case of dQ included) and trained through. In float32 each backward kernel runs its
    smallest configuration alone, or the blocks a case names; test_every_block_configuration checks every one in
    bf16."""
    from autograder.hidden import backward as hidden

    hidden.test_backward_delta(bw.backward_delta)
    hidden.test_backward_dkdv(bw.backward_dkdv)
    hidden.test_backward_dq(bw.backward_dq)
    hidden.test_flash_attention_train(bw.train_step_gradients)
