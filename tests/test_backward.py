"""06_backward on a CPU: the engine's forward with lse and backward against autograd, and the checks
recognising each planted mistake by name while staying silent on correct variants.

Mistakes are planted by editing the engine's own source text (a mutation of the solution), so each
one is the real mistake in real code, not the checks' simulation of it. float32 inputs, seeded;
tolerances are attention_checks.TOLERANCES[float32].
"""

import inspect
import math

import pytest
import torch

from autograder.hidden import backward as hidden
from flashcourse.checks import core as ac
from flashcourse.checks import backward as bc
from flashcourse.engine import backward as engine

PADDING = 10**6


def _cases():
    return [
        ac.make_case("GQA 2:1, chunked prefill", batch=2, q_heads=4, kv_heads=2, t=5, s=11, seed=1, tile=3),
        ac.make_case("prefill, Dv != D", batch=1, q_heads=2, kv_heads=2, t=7, s=7, d=16, dv=8, seed=2, tile=4),
        ac.make_case("rows with no key", batch=1, q_heads=2, kv_heads=2, t=3, s=8, seed=3, tile=2,
                     key_positions=torch.tensor([PADDING] * 3 + list(range(5))), query_positions=torch.tensor([-1, 3, 4])),
    ]


def _mutant(function, *edits):
    """`function` of the engine with its source text edited: (old, new) pairs, each old present once."""
    text = inspect.getsource(function)
    for old, new in edits:
        assert text.count(old) == 1, f"the engine no longer contains {old!r}: update this mutation"
        text = text.replace(old, new)
    namespace = dict(vars(engine))
    exec(text, namespace)
    return namespace[function.__name__]


P_LINE = 'p = torch.exp(scores.masked_fill(~visible, float("-inf")) - ref)'
DQ_LINE = "dq += scale * ds @ k_tile"
DK_LINE = "dk[:, :, start:stop] = scale * (ds.transpose(-2, -1) @ q5).sum(2)"
DV_LINE = "dv[:, :, start:stop] = (p.transpose(-2, -1) @ do5).sum(2)"
DELTA_LINE = "delta = (do.float() * o.float()).sum(-1).reshape(grouped)"
BACKWARD_MUTATIONS = {
    "delta_missing": [("ds = p * (dp - delta)", "ds = p * dp")],
    "delta_from_do": [(DELTA_LINE, "delta = do.float().sum(-1).reshape(grouped)")],
    "delta_from_o": [(DELTA_LINE, "delta = o.float().sum(-1).reshape(grouped)")],
    "lse_read_as_base2": [(P_LINE, 'p = torch.exp2(scores.masked_fill(~visible, float("-inf")) * 1.4426950408889634 - ref)')],
    "dq_no_scale": [(DQ_LINE, "dq += ds @ k_tile")],
    "dk_no_scale": [(DK_LINE, "dk[:, :, start:stop] = (ds.transpose(-2, -1) @ q5).sum(2)")],
    "dq_dk_no_scale": [(DQ_LINE, "dq += ds @ k_tile"), (DK_LINE, "dk[:, :, start:stop] = (ds.transpose(-2, -1) @ q5).sum(2)")],
    "dq_scale_twice": [(DQ_LINE, "dq += scale * scale * ds @ k_tile")],
    "dk_scale_twice": [("scores = scale * q5 @", "scores = q5 @"),
                       ("q5 = q.float().reshape(grouped)", "q5 = q.float().reshape(grouped) * scale")],
    "dq_dk_scale_twice": [(DQ_LINE, "dq += scale * scale * ds @ k_tile"),
                          (DK_LINE, "dk[:, :, start:stop] = scale * scale * (ds.transpose(-2, -1) @ q5).sum(2)")],
    "no_causal_backward": [(P_LINE, "p = torch.exp(scores - ref)")],
    "gqa_last_head": [(DK_LINE, "dk[:, :, start:stop] = scale * (ds.transpose(-2, -1) @ q5)[:, :, -1]"),
                      (DV_LINE, "dv[:, :, start:stop] = (p.transpose(-2, -1) @ do5)[:, :, -1]")],
    "dk_delta_missing": [(DK_LINE, "dk[:, :, start:stop] = scale * ((p * dp).transpose(-2, -1) @ q5).sum(2)")],
    "dq_delta_missing": [(DQ_LINE, "dq += scale * (p * dp) @ k_tile")],
}


def test_engine_forward_matches_reference():
    """online_attention_lse: o and lse equal the float64 reference, rows with no key give (0, -inf)."""
    cases = ac.standard_cases(torch.float32) + _cases()
    bc.check_forward_lse(engine.online_attention_lse, [c.with_kwargs(tile=t) for c in cases for t in (1, 4, 64)])


def test_engine_backward_matches_autograd():
    """attention_backward equals torch.autograd through the reference, GQA and empty rows included."""
    cases = ac.standard_cases(torch.float32) + _cases()
    bc.check_backward(engine.attention_backward, [c.with_kwargs(tile=t) for c in cases for t in (1, 4, 64)])


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_backward_formulas_equal_autograd(case):
    """The checks' own backward formulas (no mistake) equal autograd in float64, to 1e-10."""
    do = bc.upstream(case)
    for got, want in zip(bc.backward_variant(case, do), bc.reference_gradients(case, do)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("bug", sorted(BACKWARD_MUTATIONS))
def test_planted_backward_mistake_is_named(bug):
    """Each mistake planted in the engine's backward is recognised as exactly that mistake, and named."""
    case = _cases()[0]
    wrong = _mutant(engine.attention_backward, *BACKWARD_MUTATIONS[bug])
    result, do = bc.call_backward(wrong, case)
    message = bc.explain_gradients(result, case, do, "attention_backward")
    assert message is not None and bc.BACKWARD_BUGS[bug] in message, message
    got = tuple(x.double() for x in result)
    assert bc.matching_bugs(got, case, do, bc.reference_gradients(case, do), 1e-4, 1e-4) == [bug]


@pytest.mark.parametrize("bug, transform", [("p_from_max", "max"), ("base2_lse_with_exp", "base2")])
def test_wrong_saved_statistic_is_named(bug, transform):
    """A correct backward fed the row maximum, or a base-2 lse, gives exactly those mistakes' gradients."""
    case = _cases()[0]
    o, lse = bc.saved(case)
    if transform == "max":
        scores, _, mask = ac._scores_and_mask(case)
        lse = scores.masked_fill(~mask, -math.inf).amax(-1).float()
    else:
        lse = lse * bc.LOG2E
    do = bc.upstream(case)
    result = engine.attention_backward(case.q, case.k, case.v, o, lse, do, tile=3)
    message = bc.explain_gradients(result, case, do)
    assert message is not None and bc.BACKWARD_BUGS[bug] in message, message


def test_nan_on_rows_without_key_is_named():
    """P rebuilt as exp(S - lse) with lse = -inf gives NaN, named as such; not said where no row is empty."""
    nan_backward = _mutant(engine.attention_backward, (P_LINE, P_LINE.replace("- ref)", "- lse5)")))
    empty = _cases()[2]
    result, do = bc.call_backward(nan_backward, empty)
    assert bc.NAN_HINT in bc.explain_gradients(result, empty, do)
    full = _cases()[0]
    result, do = bc.call_backward(nan_backward, full)
    assert bc.explain_gradients(result, full, do) is None, "no row is empty: the same code is correct there"


def test_a_late_start_names_every_block_size_that_explains_it():
    """A dK/dV loop that rounds its first query block up, with 32 x 64 blocks at offset 36, drops the same rows
    as one starting a block late with 16 x 64 blocks: the diagnosis names both sizes, not only the first it tried."""
    case = ac.make_case("query offset 36", batch=1, q_heads=2, kv_heads=1, t=92, s=200, d=16, query_offset=36, seed=7)
    do = bc.upstream(case)
    late = bc.dkdv_start_variant(case, do, 32, 64, rounded_up=True)
    message = bc.explain_gradients(late, case, do)
    assert bc.START_LATE in message and "(16, 64)" in message and "(32, 64)" in message, message


@pytest.mark.parametrize("bug, edit", [
    ("lse_is_max", ("lse = torch.where(seen, m + torch.log(torch.where(seen, l, torch.ones_like(l))), m)", "lse = m")),
    ("lse_log_l", ("m + torch.log(torch.where(seen, l,", "torch.log(torch.where(seen, l,")),
])
def test_planted_lse_mistake_is_named(bug, edit):
    """A forward that saves m, or log(l) alone, is named by the lse check."""
    wrong = _mutant(engine.online_attention_lse, edit)
    case = _cases()[0]
    message = bc.explain_forward(case.call(wrong), case, tile=3)
    assert message is not None and bc.LSE_BUGS[bug] in message, message


def test_base2_lse_is_named():
    """An lse in base 2 is named; one in float64 is refused for its dtype."""
    case = _cases()[1]
    o, lse = engine.online_attention_lse(case.q, case.k, case.v, tile=4)
    assert bc.LSE_BUGS["lse_base2"] in bc.explain_forward((o, lse * bc.LOG2E), case)
    assert "float32" in bc.explain_forward((o, lse.double()), case)


def test_correct_variants_pass_silently():
    """Correct gradients written otherwise (autograd in float32, exp2 with a base-2 lse) pass, no mistake named."""
    exp2_backward = _mutant(engine.attention_backward, (
        P_LINE, 'p = torch.exp2((scores.masked_fill(~visible, float("-inf")) - ref) * 1.4426950408889634)'))
    for case in _cases()[:2]:
        result, do = bc.call_backward(exp2_backward, case)
        assert bc.explain_gradients(result, case, do) is None
        assert bc.recognise_gradients(result, case, do) == "correct"
        q, k, v = (x.clone().requires_grad_() for x in (case.q, case.k, case.v))
        group = q.shape[1] // k.shape[1]
        t, s = q.shape[2], k.shape[2]
        visible = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
        scores = (q @ k.repeat_interleave(group, 1).transpose(-2, -1) / math.sqrt(q.shape[-1]))
        out = torch.softmax(scores.masked_fill(~visible, -math.inf), -1) @ v.repeat_interleave(group, 1)
        grads = torch.autograd.grad(out, (q, k, v), do)
        assert bc.explain_gradients(grads, case, do) is None


def test_memory_check_flags_a_whole_p():
    """The tracker passes the tiled engine and names a backward that builds P whole."""
    case = ac.make_case("memory", q_heads=2, kv_heads=1, t=32, s=48, d=8, seed=4, tile=8)
    bc.check_backward_memory(engine.attention_backward, case)
    whole = case.with_kwargs(tile=48)                     # one tile of every key: P whole
    with pytest.raises(AssertionError, match="as large as the whole"):
        bc.check_backward_memory(engine.attention_backward, whole)


def test_the_probes_saved_forward_is_the_reference():
    """The memory probe's o and lse, computed in float32 chunks of rows, equal the float64 reference's, with
    rows before key 0 (o = 0, lse = -inf), GQA, and chunks that do not divide T."""
    case = ac.make_case("chunks", batch=2, q_heads=4, kv_heads=2, t=23, s=17, d=8, seed=9)
    case = ac.Case(case.name, case.q, case.k, case.v, query_positions=torch.arange(23) - 6)
    want_o, want_lse = bc.saved(case)
    got_o, got_lse = bc._saved_by_rows(case, chunk=5)
    assert torch.allclose(got_o, want_o, atol=1e-6) and got_o.dtype == want_o.dtype
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse)) and bool(torch.isinf(got_lse[:, :, :6]).all())
    finite = torch.isfinite(want_lse)
    assert torch.allclose(got_lse[finite], want_lse[finite], atol=1e-5)


@pytest.mark.parametrize("name", ["test_online_attention_lse", "test_online_attention_lse_edges", "test_attention_backward",
                                  "test_attention_backward_gqa", "test_attention_backward_edges"])
def test_hidden_checks_pass_the_solution(name):
    """Every hidden check of 06 passes the engine (the executed solution's functions)."""
    fn = engine.online_attention_lse if "lse" in name else engine.attention_backward
    getattr(hidden, name)(fn)


@pytest.mark.parametrize("q_shape, k_shape, v_shape, words", [
    ((1, 2, 8, 24), (1, 2, 8, 24), (1, 2, 8, 24), "power of two >= 16"),
    ((1, 2, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8), "power of two >= 16"),
    ((1, 3, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), "multiple of KV heads"),
    ((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 9, 16), "expected k and v of shape"),
    ((2, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), "expected k and v of shape"),
])
def test_kernel_input_checks(q_shape, k_shape, v_shape, words):
    """positions.check_kernel_inputs, which 06's kernels call before launching, names each wrong shape and lets
    a right one through (GQA 4:1, T != S)."""
    from flashcourse.positions import check_kernel_inputs

    with pytest.raises(ValueError, match=words):
        check_kernel_inputs(torch.zeros(q_shape), torch.zeros(k_shape), torch.zeros(v_shape))
    check_kernel_inputs(torch.zeros(1, 8, 5, 32), torch.zeros(1, 2, 11, 32), torch.zeros(1, 2, 11, 32))


VISIBLE_LINE = "visible = kp[:, None, None, None, start:stop] <= qp[:, None, None, :, None]"
ROWS = "torch.arange(t)[None, None, None, :, None]"                  # query row i as if at position i


def _dkdv_visible(condition):
    """Edits that give dK and dV a mask of their own, `condition` (on kp, qp, rows = the query rows, start), while
    dQ keeps the right one."""
    return [(P_LINE, P_LINE + f"\n        rows = {ROWS}\n        p_kv = torch.exp(scores.masked_fill(~(visible & "
                              f"({condition})), float('-inf')) - ref)"),
            (DV_LINE, DV_LINE.replace("(p.transpose", "(p_kv.transpose")),
            (DK_LINE, DK_LINE.replace("(ds.transpose", "((p_kv * (dp - delta)).transpose"))]


CHUNKED = _cases()[0]                                                    # GQA 2:1, T = 5, S = 11: offset 6
PREFILL = ac.make_case("prefill", batch=1, q_heads=2, kv_heads=2, t=16, s=16, seed=8)
OFFSET_HANDS = {   # name: (edits, case, tile, the mistake it equals there, or None)
    "the backward's mask at the row index": ([(VISIBLE_LINE, VISIBLE_LINE.replace("qp[:, None, None, :, None]", ROWS))],
                                             CHUNKED, 3, "offset_ignored_backward"),
    "dK/dV's mask at the row index": (_dkdv_visible(f"kp[:, None, None, None, start:stop] <= {ROWS}"), CHUNKED, 3,
                                      "dkdv_offset_ignored"),
    "dK/dV's queries from the key's index, tiles of 1": (_dkdv_visible("rows >= start"), CHUNKED, 1,
                                                         "dkdv_offset_ignored"),
    "dK/dV's queries from the key's index, tiles of 3": (_dkdv_visible("rows >= start"), CHUNKED, 3, None),
    "dK/dV's queries from the key's tile": (_dkdv_visible("rows >= start // tile * tile"), CHUNKED, 3, None),
    "dK/dV's queries one tile late": (_dkdv_visible("rows >= (max(start - (s - t), 0) // tile + 1) * tile"),
                                      CHUNKED, 3, None),
    "dK/dV's queries one tile late, prefill, tiles of 16": (
        _dkdv_visible("rows >= (max(start - (s - t), 0) // tile + 1) * tile"), PREFILL, 16, None),
    "dK/dV's bound off by one": (_dkdv_visible("kp[:, None, None, None, start:stop] < qp[:, None, None, :, None]"),
                                 CHUNKED, 3, None),
    "the key loop from the second tile": ([("for start in range(0, s, tile):", "for start in range(tile, s, tile):")],
                                          CHUNKED, 3, None),
}


@pytest.mark.parametrize("hand", list(OFFSET_HANDS))
def test_the_query_offset_is_named_in_the_pytorch_backward_only_where_it_is_that(hand):
    """attention_backward whose causal bound leaves out the query offset (chunked prefill: offset S - T = 6), in dK
    and dV or everywhere, is named so; a loop over a key's queries started at the key's index equals it with tiles
    of 1 and is named there too, not with tiles of 3. Other hands' mistakes around the offset (the queries of a key
    from its tile or a tile late, the bound off by one, the key loop begun a tile late) are named as nothing, and
    never as a Triton kernel's loop over blocks, which a PyTorch backward does not have (before, a start one tile
    late, in a prefill with tiles of 16, was called 'the dK/dV loop starts one query block late' with blocks from
    (16, 16) to (128, 128))."""
    edits, case, tile, expected = OFFSET_HANDS[hand]
    with pytest.raises(AssertionError) as failure:
        bc.check_backward(_mutant(engine.attention_backward, *edits), [case.with_kwargs(tile=tile)])
    message = str(failure.value)
    named = [bug for bug, words in bc.BACKWARD_BUGS.items() if words in message]
    assert named == ([expected] if expected else []), message
    assert "BLOCK_M" not in message and bc.START_LATE not in message and bc.DKDV_DIAGONAL not in message, message


SAFE_REF = "ref = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))   # safe reference"
SAFE_DIVIDE = "o = torch.where(seen, acc / torch.where(seen, l, torch.ones_like(l)), torch.zeros_like(acc))"
FORWARD_NAN = {   # mistake -> (edits of the engine's online_attention_lse, what the message must say, must not)
    "no safe reference": ([(SAFE_REF, "ref = m_new"), (SAFE_DIVIDE, "o = acc / l")], "Likely cause: " + ac.NAN_HINT,
                          "0 / 0"),
    "0 / 0 on the rows that see no key": ([(SAFE_DIVIDE, "o = acc / l")], "That row sees no key", "Likely cause"),
    "0 / 0 after placing queries 4 early": ([(SAFE_DIVIDE, "o = acc / l"),
                                             ("<= qp[:, None, None, :, None]", "<= qp[:, None, None, :, None] - 4")],
                                            ac.NAN_CHECKLIST, "Likely cause"),
}


@pytest.mark.parametrize("mistake", FORWARD_NAN)
def test_nan_in_the_forward_with_empty_rows_is_named_only_as_what_it_equals(mistake):
    """On the case with rows that see no key (and rows whose first tile is empty), a NaN output is blamed on a
    missing safe reference only when it is that mistake's output; 0 / 0 on the empty rows is said as such, and
    a NaN in a row that should see keys, from queries placed wrong, gets the checklist that names no cause."""
    edits, says, never = FORWARD_NAN[mistake]
    forward = _mutant(engine.online_attention_lse, *edits)
    case = _cases()[2]
    message = bc.explain_forward(case.call(forward), case, tile=case.kwargs["tile"])
    assert message and says in message and never not in message, message


class Measured:
    """Stands for attention_backward run in the grading jail (its limited_call), computing with `backward`."""
    __name__ = "attention_backward"

    def __init__(self, backward, scale=1.0):
        self.backward, self.scale = backward, scale

    def limited_call(self, allowance, *args, **kwargs):
        return tuple(g * self.scale for g in self.backward(*args, **kwargs))


@pytest.mark.parametrize("backward, scale, passes", [(engine.attention_backward, 1.0, True),
                                                     ("delta_missing", 1.0, True),
                                                     (engine.attention_backward, 1.5, False)])
def test_the_backward_memory_probe_takes_the_gradient_or_a_recognised_mistake(backward, scale, passes):
    """The probe from outside (one head, T = 9472, S = 14208) accepts the gradients and a recognised mistake's
    (graded elsewhere), and refuses an answer that is neither: its rows are compared with the gradient first and
    with the mistakes only when they are not it."""
    if isinstance(backward, str):
        backward = _mutant(engine.attention_backward, *BACKWARD_MUTATIONS[backward])
    case = ac.make_case("memory", q_heads=1, kv_heads=1, t=128, s=192, d=8, seed=4, tile=32)
    if passes:
        bc.check_backward_memory(Measured(backward, scale), case)
    else:
        with pytest.raises(AssertionError, match="neither the gradient nor a recognised mistake"):
            bc.check_backward_memory(Measured(backward, scale), case)
