"""The Triton backward kernels of 06 under Triton's interpreter on a CPU, in float32: gradients against
torch.autograd on the float64 reference, on small irregular shapes."""

import math

import pytest
import torch

from flashcourse.checks import core as ac
from flashcourse.checks import backward as bc
from flashcourse import runtime
from flashcourse.checks import reference
from instructor.bench_backward import engine

RT = runtime.current()
pytestmark = pytest.mark.skipif(not RT.interpret, reason="the interpreter's float32 run; the GPU has its own tests")
bw = engine()
RTOL, ATOL = 1e-4, 1e-5   # float32 kernels against float64 autograd (errors seen: below 1e-6)


def _inputs(batch, q_heads, kv_heads, t, s, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, t, d, generator=gen)
    k = torch.randn(batch, kv_heads, s, d, generator=gen)
    v = torch.randn(batch, kv_heads, s, d, generator=gen)
    do = torch.randn(batch, q_heads, t, d, generator=gen)
    return q, k, v, do


def _reference(q, k, v, do, offset, causal=True):
    """(o, lse, dq, dk, dv) in float64: reference.attention and its autograd, queries at offset + i."""
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    positions = offset + torch.arange(q.shape[2])
    o = reference.attention(*leaves, query_positions=positions, causal=causal)
    group = q.shape[1] // k.shape[1]
    scores = leaves[0] @ leaves[1].repeat_interleave(group, 1).transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~reference.visible_mask(q, k, query_positions=positions), -math.inf)
    lse = torch.logsumexp(scores, -1)
    return (o.detach(), lse.detach(), *torch.autograd.grad(o, leaves, do.double()))


def _check(got, want, names=("o", "lse", "dq", "dk", "dv")):
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a.double(), b, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


CASES = {  # batch, Hq, Hkv, T, S, D, query_offset, causal
    "odd T and S, GQA 2": (2, 4, 2, 45, 51, 32, None, True),
    "T > S, GQA 4": (1, 4, 1, 37, 21, 16, 0, True),
    "chunked prefill, custom offset": (1, 2, 1, 23, 50, 16, 9, True),
    "not causal, T != S": (1, 2, 2, 33, 19, 16, None, False),
    "decode, one query": (2, 4, 2, 1, 29, 16, None, True),
}


@pytest.mark.parametrize("name", CASES)
def test_gradients(name):
    """o, lse, dq, dk and dv against float64 autograd: odd T and S, GQA, query offsets, not causal, decode."""
    batch, q_heads, kv_heads, t, s, d, offset, causal = CASES[name]
    q, k, v, do = _inputs(batch, q_heads, kv_heads, t, s, d)
    o, lse = bw.flash_attention_lse(q, k, v, offset, causal)
    dq, dk, dv = bw.flash_attention_backward(q, k, v, o, lse, do, offset, causal)
    want = _reference(q, k, v, do, s - t if offset is None else offset, causal)
    assert lse.dtype == torch.float32 and lse.shape == (batch, q_heads, t)
    assert [g.shape for g in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
    _check((o, lse, dq, dk, dv), want)


def test_rows_that_see_no_key():
    """query_offset = -13: the first 13 queries see no key: o = 0, lse = -inf, dq = 0, no NaN anywhere."""
    q, k, v, do = _inputs(1, 2, 1, 40, 30, 16)
    o, lse = bw.flash_attention_lse(q, k, v, -13)
    dq, dk, dv = bw.flash_attention_backward(q, k, v, o, lse, do, -13)
    assert torch.equal(lse[:, :, :13], torch.full((1, 2, 13), -math.inf))
    assert not o[:, :, :13].any() and not dq[:, :, :13].any()
    assert not any(torch.isnan(x).any() for x in (o, lse[:, :, 13:], dq, dk, dv))
    # the other queries sit at positions 0..26: the reference on them alone (blind rows add nothing to dk, dv)
    want = _reference(q[:, :, 13:], k, v, do[:, :, 13:], 0)
    _check((o[:, :, 13:], lse[:, :, 13:], dq[:, :, 13:], dk, dv), want)


def test_atomic_dq():
    """dq accumulated with atomics inside the dK/dV kernel matches the separate dQ kernel's."""
    q, k, v, do = _inputs(2, 4, 2, 45, 51, 32)
    o, lse = bw.flash_attention_lse(q, k, v)
    separate = bw.flash_attention_backward(q, k, v, o, lse, do)
    atomic = bw.flash_attention_backward(q, k, v, o, lse, do, atomic_dq=True)
    for a, b in zip(separate, atomic):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_delta_rows_past_t():
    """Δ = rowsum(dO ∘ O) for T = 19 in blocks of 64: the rows past T are neither read nor written."""
    o, do = (torch.randn(2, 3, 19, 32, generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    delta = bw.backward_delta(o, do)
    assert delta.shape == (2, 3, 19) and delta.dtype == torch.float32
    torch.testing.assert_close(delta.double(), (o.double() * do.double()).sum(-1), rtol=RTOL, atol=ATOL)


def test_loss_backward_through_train():
    """loss.backward() through flash_attention_train gives autograd's gradients; the default offset is S - T."""
    q, k, v, do = _inputs(1, 4, 2, 21, 21, 16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    (bw.flash_attention_train(*leaves) * do).sum().backward()
    want = _reference(q, k, v, do, 0)
    _check([x.grad for x in leaves], want[2:], names=("dq", "dk", "dv"))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True)
    torch.testing.assert_close(bw.flash_attention_train(q, k, v), sdpa, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("shape, why", [((1, 2, 8, 24), "D = 24 is not a power of two"),
                                        ((1, 2, 8, 8), "D = 8 is below 16"),
                                        ((1, 3, 8, 16), "Hq = 3 is not a multiple of Hkv = 2")])
def test_validation(shape, why):
    """ValueError before anything is launched."""
    q = torch.randn(shape)
    k = torch.randn(1, 2, 8, shape[-1])
    with pytest.raises(ValueError):
        bw.flash_attention_train(q, k, k)
    with pytest.raises(ValueError):
        bw.flash_attention_backward(q, k, k, q, torch.zeros(shape[:3]), q)


def test_lse_shape_checked():
    """flash_attention_backward refuses an lse that is not [B, Hq, T]."""
    q, k, v, do = _inputs(1, 2, 1, 8, 8, 16)
    o, lse = bw.flash_attention_lse(q, k, v)
    with pytest.raises(ValueError, match="lse"):
        bw.flash_attention_backward(q, k, v, o, lse[..., None], do)


def test_float32_takes_the_smallest_configuration():
    """Both autotuned kernels prune FP32 inputs to the smallest pair of blocks (one configuration compiled) and
    keep every configuration for bf16 and fp16, which are tuned."""
    import triton

    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4) for m, n in ((64, 128), (32, 64), (64, 64))]
    for tuned in (bw.dkdv_tuned, bw.dq_tuned):
        assert tuned.early_config_prune is bw._smallest_for_float32
    for dtype in (torch.bfloat16, torch.float16):
        assert bw._smallest_for_float32(configs, {"q_ptr": torch.empty(1, dtype=dtype)}) == configs
    assert bw._smallest_for_float32(configs, {"q_ptr": torch.empty(1)}) == [configs[1]]


# Mistakes planted in the exported kernels' source text (a mutation of the solution, imported as a module of
# its own): (edits, the hidden cell that must fail, words its message must contain).
DS_T_LINE = "ds_t = p_t * (dp_t - delta[None, :])"
DS_LINE = "ds = p * (dp - delta[:, None])"
BKV_LINE = "bkv = b * kv_heads + h // group"
BH_LINE = "bh = (b * kv_heads + kv_h) * group + g"
DQ_DIAGONAL_CALL = "dq = _dq_tile(dq, q_block, keys_from, bkv, n0, True,"
KERNEL_MUTATIONS = {
    "delta_rowsum_do": ([("tl.sum(o * do, axis=1)", "tl.sum(do, axis=1)")], "test_backward_delta",
                        bc.DELTA_BUGS["rowsum_do"]),
    "dk_delta_missing": ([(DS_T_LINE, "ds_t = p_t * dp_t")], "test_backward_dkdv", bc.DKDV_BUGS["dk_delta_missing"]),
    "dq_delta_missing": ([(DS_LINE, "ds = p * dp")], "test_backward_dq", bc.DQ_BUGS["dq_delta_missing"]),
    "lse_read_as_base2": ([('float("inf"), lse * 1.4426950408889634)', 'float("inf"), lse)')],
                          "test_backward_dkdv", bc.BACKWARD_BUGS["lse_read_as_base2"]),
    "dq_no_scale": ([("dq = dq * sm_scale", "dq = dq")], "test_backward_dq", bc.BACKWARD_BUGS["dq_no_scale"]),
    "dq_heads_modulo": ([(BKV_LINE, "bkv = b * kv_heads + h % kv_heads")], "test_backward_dq",
                        bc.DQ_BUGS["dq_heads_modulo"]),
    "dq_heads_no_batch": ([(BKV_LINE, "bkv = h // group")], "test_backward_dq", bc.DQ_BUGS["dq_heads_no_batch"]),
    "dq_diagonal_unmasked": ([(DQ_DIAGONAL_CALL, DQ_DIAGONAL_CALL.replace("True,", "False,"))], "test_backward_dq",
                             bc.DQ_DIAGONAL),
    "dkdv_heads_modulo": ([(BH_LINE, "bh = b * kv_heads * group + g * kv_heads + kv_h")], "test_backward_dkdv",
                          bc.DKDV_BUGS["dkdv_heads_modulo"]),
    "gqa_last_head": ([("        " + BH_LINE, "        dk = tl.zeros((BLOCK_N, D), tl.float32)\n"
                        "        dv = tl.zeros((BLOCK_N, D), tl.float32)\n        " + BH_LINE)],
                      "test_backward_dkdv", bc.BACKWARD_BUGS["gqa_last_head"]),
    "start_late": ([("start = tl.minimum((first // BLOCK_M) * BLOCK_M, T)",
                     "start = tl.minimum(tl.cdiv(first, BLOCK_M) * BLOCK_M, T)")],
                   "test_backward_dkdv", bc.START_LATE),
    "dkdv_diagonal_unmasked": ([("_dkdv_tile(dk, dv, kv_block, queries, bh, m0, True,",
                                 "_dkdv_tile(dk, dv, kv_block, queries, bh, m0, False,")],
                               "test_backward_dkdv", bc.DKDV_DIAGONAL),
    "backward_not_written": ([("        q, k, v, o, lse = ctx.saved_tensors\n", "        return None, None, None, None, None\n")],
                             "test_flash_attention_train", "No gradient reached q, k or v"),
}
GRADED = {"test_backward_delta": "backward_delta", "test_backward_dkdv": "backward_dkdv",
          "test_backward_dq": "backward_dq", "test_flash_attention_train": "train_step_gradients"}


def _mutant_engine(tmp_path, name, edits):
    """flashcourse.engine.backward with `edits` applied to its text, imported from a file of its own."""
    import importlib.util
    from pathlib import Path

    text = Path(bw.__file__).read_text()
    for old, new in edits:
        assert old in text, f"the engine no longer contains {old!r}"
        text = text.replace(old, new)
    path = tmp_path / f"mutant_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"mutant_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mistake", sorted(KERNEL_MUTATIONS))
def test_planted_kernel_mistake_is_named(mistake, tmp_path):
    """Each mistake planted in the kernels fails its part's hidden cell with a message that names it."""
    from autograder.hidden import backward as hidden

    edits, cell, words = KERNEL_MUTATIONS[mistake]
    mutant = _mutant_engine(tmp_path, mistake, edits)
    with pytest.raises(AssertionError) as failure:
        getattr(hidden, cell)(getattr(mutant, GRADED[cell]))
    assert words in str(failure.value), str(failure.value)


def test_correct_kernels_pass_every_hidden_cell():
    """The engine passes the four hidden Triton cells; a correct kernel is never given a diagnosis."""
    from autograder.hidden import backward as hidden

    hidden.test_backward_delta(bw.backward_delta)
    hidden.test_backward_dkdv(bw.backward_dkdv)
    hidden.test_backward_dq(bw.backward_dq)
    hidden.test_flash_attention_train(bw.train_step_gradients)


# The three mistakes that once got generic messages, each recognised by its part's visible check on the visible
# cell's cases: named when planted, not named on the correct kernel, nor on another mistake of the same kernel.
VISIBLE = [ac.make_case("GQA 2:1, T = S = 37", batch=2, q_heads=4, kv_heads=2, t=37, seed=60),
           ac.make_case("GQA 2:1, chunked prefill T = 21, S = 50", batch=1, q_heads=4, kv_heads=2, t=21, s=50, seed=61)]
RECOGNISERS = {  # planted mistake -> (check, launcher, words, an unrelated mistake of the same kernel)
    "dk_delta_missing": (bc.check_dkdv, "backward_dkdv", "Δ was left out of dK", "dkdv_heads_modulo"),
    "dq_heads_modulo": (bc.check_dq, "backward_dq", "the KV head index of program bh is wrong", "dq_delta_missing"),
    "dq_diagonal_unmasked": (bc.check_dq, "backward_dq", "the diagonal block of dQ is not masked", "dq_no_scale"),
}


@pytest.mark.parametrize("mistake", sorted(RECOGNISERS))
def test_each_part_names_its_planted_mistake_and_nothing_else(mistake, tmp_path):
    """The planted mistake's message names it; the correct kernel passes; an unrelated mistake is not called it."""
    check, launcher, words, unrelated = RECOGNISERS[mistake]
    with pytest.raises(AssertionError) as planted:
        check(getattr(_mutant_engine(tmp_path, mistake, KERNEL_MUTATIONS[mistake][0]), launcher), VISIBLE)
    assert words in str(planted.value), str(planted.value)
    check(getattr(bw, launcher), VISIBLE)
    with pytest.raises(AssertionError) as other:
        check(getattr(_mutant_engine(tmp_path, unrelated, KERNEL_MUTATIONS[unrelated][0]), launcher), VISIBLE)
    assert words not in str(other.value) and "This is exactly what happens when" in str(other.value), str(other.value)


def test_a_mistake_matching_no_variant_gets_an_accurate_generic_message():
    """dQ scaled by 1.5: wrong, named as no mistake, with where it is wrong and what to check."""
    def off(*args, **kwargs):
        return bw.backward_dq(*args, **kwargs) * 1.5

    with pytest.raises(AssertionError) as failure:
        bc.check_dq(off, VISIBLE[:1])
    message = str(failure.value)
    assert "dq wrong" in message and "This is exactly" not in message and "Check, in _dq_tile" in message, message


def test_delta_check_names_its_mistakes():
    """Δ from rowsum(O) and padding stored over the next head's first rows are named; the right Δ passes."""
    case = ac.make_case("T = 37, blocks of 16", batch=2, q_heads=3, kv_heads=3, t=37, seed=70, block_m=16)
    bc.check_delta(bw.backward_delta, [case])
    for bug in ("rowsum_o", "store_unmasked"):
        with pytest.raises(AssertionError, match="This is exactly what happens") as failure:
            bc.check_delta(lambda o, do, block_m=64, bug=bug: bc.delta_variant(case, bug, 16).float(), [case])
        assert bc.DELTA_BUGS[bug] in str(failure.value)


def test_not_causal_run_causally_is_named():
    """A dK/dV kernel that masks although causal=False gives the causal gradients: named as such."""
    case = ac.make_case("not causal, T = 33, S = 19", batch=1, q_heads=4, kv_heads=2, t=33, s=19, seed=8, causal=False)
    bc.check_dkdv(bw.backward_dkdv, [case])

    def causal_anyway(*args, causal=True, **kwargs):
        return bw.backward_dkdv(*args, causal=True, **kwargs)

    with pytest.raises(AssertionError) as failure:
        bc.check_dkdv(causal_anyway, [case])
    assert bc.CAUSAL_WHEN_NOT in str(failure.value), str(failure.value)


def _assert_race_named_only_when_dq_changes(check, right, case, racy, unscaled, no_scale: str) -> None:
    """`check` (check_backward_repeated or check_dq_repeated) names a race for `racy`, whose wrong dq differs from
    run to run, but not for `unscaled`, always the same wrong dq, where it names the missing scale (`no_scale`);
    `right` passes."""
    with pytest.raises(AssertionError, match="changes from run to run"):
        check(racy, case, runs=3)
    with pytest.raises(AssertionError) as failure:
        check(unscaled, case, runs=3)
    assert "run to run" not in str(failure.value) and no_scale in str(failure.value)
    check(right, case, runs=2)


def test_race_named_only_when_dq_changes_between_runs():
    """check_backward_repeated names a race when a wrong dq differs from run to run, and not when it is always
    the same wrong dq (there it names the mistake, here the missing scale)."""
    case = ac.make_case("crowded", batch=1, q_heads=1, kv_heads=1, t=5, s=40, query_offset=39, seed=3)
    noise = torch.Generator().manual_seed(0)

    def racy(q, k, v, o, lse, do, query_offset=None):
        dq, dk, dv = bw.flash_attention_backward(q, k, v, o, lse, do, query_offset)
        return dq * (1 - torch.rand(1, generator=noise)), dk, dv   # some additions lost, a different share each run

    def unscaled(q, k, v, o, lse, do, query_offset=None):
        dq, dk, dv = bw.flash_attention_backward(q, k, v, o, lse, do, query_offset)
        return dq * math.sqrt(q.shape[-1]), dk, dv

    _assert_race_named_only_when_dq_changes(bc.check_backward_repeated, bw.flash_attention_backward, case, racy,
                                            unscaled, bc.BACKWARD_BUGS["dq_no_scale"])


def test_dq_race_named_by_the_part_check_only_when_dq_changes_between_runs():
    """check_dq_repeated, Part C's check on a GPU, names a race when a wrong dq differs from run to run, and the
    mistake when it is always the same wrong dq."""
    case = ac.make_case("crowded", batch=1, q_heads=1, kv_heads=1, t=5, s=40, query_offset=39, seed=3)
    noise = torch.Generator().manual_seed(0)

    def racy(*args, **kwargs):
        return bw.backward_dq(*args, **kwargs) * (1 - torch.rand(1, generator=noise))

    def unscaled(*args, **kwargs):
        return bw.backward_dq(*args, **kwargs) * math.sqrt(case.q.shape[-1])

    _assert_race_named_only_when_dq_changes(bc.check_dq_repeated, bw.backward_dq, case, racy, unscaled,
                                            bc.DQ_BUGS["dq_no_scale"])
