"""flashcourse.checks.core: correct implementations pass, each classic mistake is named."""

import math
import re

import pytest
import torch

from flashcourse.checks import core as ac
from flashcourse.checks import reference
from flashcourse.positions import positions


def reference_attention(q, k, v, query_positions=None, key_positions=None, **_):
    return reference.attention(q, k, v, query_positions, key_positions).to(q.dtype)


def exp2_tiles(q, k, v, query_positions=None, key_positions=None, tile=4, log2e=math.log2(math.e)):
    """A correct implementation written differently: exp2, K/V repeated, heads in one loop."""
    b, hq, t, d = q.shape
    s = k.shape[2]
    group = hq // k.shape[1]
    qp = positions(query_positions, b, t, s - t, "cpu")
    kp = positions(key_positions, b, s, 0, "cpu")
    out = torch.empty(b, hq, t, v.shape[-1])
    for h in range(hq):
        qs = q[:, h].double() * (log2e / math.sqrt(d))                       # [B, T, D]
        m = torch.full((b, t, 1), -math.inf, dtype=torch.float64)
        l = torch.zeros(b, t, 1, dtype=torch.float64)
        a = torch.zeros(b, t, v.shape[-1], dtype=torch.float64)
        for start in range(0, s, tile):
            sc = qs @ k[:, h // group, start:start + tile].double().transpose(-1, -2)
            sc = sc.masked_fill(kp[:, None, start:start + tile] > qp[:, :, None], -math.inf)
            m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
            ref = torch.nan_to_num(m_new, neginf=0.0)
            p = torch.exp2(sc - ref)
            l = torch.exp2(m - ref) * l + p.sum(-1, keepdim=True)
            a = torch.exp2(m - ref) * a + p @ v[:, h // group, start:start + tile].double()
            m = m_new
        out[:, h] = (a / l).float()
    return out.to(q.dtype)


def as_buggy(bug, tiled=False):
    def fn(q, k, v, query_positions=None, key_positions=None, tile=4):
        case = ac.Case("x", q, k, v, query_positions, key_positions)
        out = ac.tiled_variant(case, tile, bug) if tiled else ac.variant(case, bug)
        return out.to(q.dtype)
    return fn


CASES = ac.standard_cases(torch.float32)
TILED = [c.with_kwargs(tile=t) for c in CASES for t in (1, 3, 16)]


def test_correct_implementations_pass():
    ac.check_attention(reference_attention, CASES)
    ac.check_attention(exp2_tiles, TILED, tile_arg="tile")


@pytest.mark.parametrize("bug", ac.WHOLE_BUGS)
def test_whole_matrix_mistakes_are_named(bug):
    with pytest.raises(AssertionError) as error:
        ac.check_attention(as_buggy(bug), TILED, tile_arg="tile")
    assert ac.BUGS[bug] in str(error.value)
    assert "batch" in str(error.value) and "query row" in str(error.value)


@pytest.mark.parametrize("bug", ac.TILED_BUGS)
def test_tiled_mistakes_are_named(bug):
    with pytest.raises(AssertionError) as error:
        ac.check_attention(as_buggy(bug, tiled=True), TILED, tile_arg="tile")
    assert ac.BUGS[bug] in str(error.value)


def test_nan_from_an_empty_first_tile_is_named():
    case = ac.make_case("padded", t=2, s=8, key_positions=torch.tensor([99, 99, 99, 0, 1, 2, 3, 4]),
                        query_positions=torch.tensor([3, 4]), tile=2)
    assert bool(ac.first_tile_empty_rows(case, 2).all())

    def no_safe_reference(q, k, v, query_positions=None, key_positions=None, tile=2):
        out = reference_attention(q, k, v, query_positions, key_positions)
        return out.masked_fill(ac.first_tile_empty_rows(case, tile)[:, None, :, None], math.nan)

    with pytest.raises(AssertionError, match=r"first tile had no visible key: .*exp\(-inf - -inf\)"):
        ac.check_attention(no_safe_reference, [case], tile_arg="tile")


def test_low_precision_tolerances():
    assert ac.tolerance(torch.bfloat16) == ac.BFLOAT16_TOL and ac.tolerance(torch.float16) == ac.FLOAT16_TOL
    ac.check_attention(reference_attention, ac.standard_cases(torch.bfloat16))
    ac.check_attention(reference_attention, ac.standard_cases(torch.float16))


def test_dtype_and_shape_are_checked():
    with pytest.raises(AssertionError, match="dtype"):
        ac.check_attention(lambda q, k, v: reference.attention(q, k, v), CASES[:1])
    with pytest.raises(AssertionError, match="shape"):
        ac.check_attention(lambda q, k, v: reference_attention(q, k, v)[:, :1], CASES[:1])


def test_check_raises():
    case = ac.make_case("x", t=2, s=4)
    ac.check_raises(lambda q, k, v: (_ for _ in ()).throw(ValueError("no")), case, "reason")
    with pytest.raises(AssertionError, match="should raise ValueError"):
        ac.check_raises(reference_attention, case, "reason")


def test_merge_checks():
    case = CASES[4]
    parts = ac.partial_states(case, [(0, 5), (5, 11), (11, 20)])

    def merge(ps):
        m = torch.stack([p[0] for p in ps]).amax(0)
        ref = torch.nan_to_num(m, neginf=0.0)
        return m, sum(torch.exp(p[0] - ref) * p[1] for p in ps), sum(torch.exp(p[0] - ref) * p[2] for p in ps)

    def lse_merge(ps):
        m, l, a = merge(ps)
        return m + torch.log(l), torch.ones_like(l), a / l

    ac.check_merge_partials(merge, parts)
    ac.check_merge_partials(lse_merge, parts[::-1])
    naive = lambda ps: (torch.stack([p[0] for p in ps]).amax(0), sum(p[1] for p in ps), sum(p[2] for p in ps))  # noqa: E731
    with pytest.raises(AssertionError, match=r"without rescaling each by exp\(m_i - m\)"):
        ac.check_merge_partials(naive, parts)


def test_single_query_checks():
    from flashcourse.engine.single_query import online_attention_single

    q, k, v = [0.3, -1.0], [1.0, 0.0, 0.5, 2.0, -1.0, 1.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    ac.check_single_query(online_attention_single, [(q, k, v, 3, 2, t) for t in (1, 2, 3, 4)])
    q4, k4, v4 = [0.3, -1.0, 2.0, 0.5], [1.0, 0.0, 0.5, 2.0, -1.0, 1.0, 0.2, 0.7], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    over_d = lambda q, k, v, S, d, tile: online_attention_single([x / math.sqrt(d) for x in q], k, v, S, d, tile)  # noqa: E731
    with pytest.raises(AssertionError, match="1/D instead of 1/sqrt"):
        ac.check_single_query(over_d, [(q4, k4, v4, 2, 4, 1)])


def test_single_query_overflow_is_named():
    """A loop that never subtracts the maximum raises OverflowError at scores above 709.78; the check says so."""
    def unshifted(q, k, v, S, d, tile):
        w = [math.exp(sum(x * y for x, y in zip(q, k[j * d:(j + 1) * d])) / math.sqrt(d)) for j in range(S)]
        return [sum(w[j] * v[j * d + e] for j in range(S)) / sum(w) for e in range(d)]

    q, k, v = [2000.0, 0.0], [0.9, 0.0, 1.0, 0.0, -1.0, 0.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    ac.check_single_query(unshifted, [([0.5, 0.0], k, v, 3, 2, 1)])
    with pytest.raises(AssertionError, match=r"tile=2\) raised OverflowError.*largest score is 1414.21.*709.78"):
        ac.check_single_query(unshifted, [(q, k, v, 3, 2, 2)])


class RightOnSomeRows:
    """Stands for online_attention run in the grading jail (its limited_call): the attention on the rows `keep`
    selects, zeros on the others, as an answer aimed at the few rows a check compares."""
    __name__ = "online_attention"

    def __init__(self, keep):
        self.keep = keep

    def limited_call(self, allowance, q, k, v, **_):
        t, s = q.shape[2], k.shape[2]
        out = torch.zeros(*q.shape[:-1], v.shape[-1])
        for start in range(0, t, 512):
            rows = torch.arange(start, min(start + 512, t))
            rows = rows[self.keep(rows)]
            out[:, :, rows] = reference.attention(q[:, :, rows], k, v, query_positions=rows + s - t).float()
        return out


SEEDED_ROWS = torch.randperm(13392, generator=torch.Generator().manual_seed(24))[:8]   # a seed the inputs tell


@pytest.mark.parametrize("keep, passes", [(lambda rows: rows >= 0, True),
                                          (lambda rows: torch.isin(rows, SEEDED_ROWS), False),
                                          (lambda rows: rows % 4 != 0, False)])
def test_the_memory_probe_compares_rows_it_picks_from_the_answer(keep, passes):
    """The large case's output (one head, T = 13392, S = 20088 here) is compared on rows drawn from the answer's
    own hash, which cannot be known before answering: an answer right only on the rows a seed taken from the
    inputs would pick, or on three rows of four, is refused; the whole attention passes."""
    case = ac.make_case("memory", q_heads=2, kv_heads=1, t=16, s=24, d=8, seed=1, tile=4)
    if passes:
        ac.check_memory_from_outside(RightOnSomeRows(keep), case)
    else:
        with pytest.raises(AssertionError, match="neither attention nor a recognised mistake"):
            ac.check_memory_from_outside(RightOnSomeRows(keep), case)


class Prepared:
    """Stands for online_attention in the grading jail with its answer computed by an earlier cell, with no memory
    limit, for the inputs it expects: the measured call does no work and hands that answer back."""
    __name__ = "online_attention"

    def __init__(self, q, k, v):
        self.answer = reference.attention(q, k, v, query_positions=torch.arange(q.shape[2]) + k.shape[2] - q.shape[2])

    def limited_call(self, allowance, q, k, v, **_):
        return self.answer.float()


def test_the_memory_probe_cannot_be_answered_ahead():
    """The large case's inputs are drawn when the check runs: an answer prepared for the inputs of an earlier run
    of the check (as for any fixed seed) is refused, while the same inputs' own answer would pass."""
    case = ac.make_case("memory", q_heads=2, kv_heads=1, t=16, s=24, d=8, seed=1, tile=4)
    seen = []

    class Recorder(RightOnSomeRows):
        def limited_call(self, allowance, q, k, v, **kwargs):
            seen.append((q, k, v))
            return super().limited_call(allowance, q, k, v, **kwargs)

    ac.check_memory_from_outside(Recorder(lambda rows: rows >= 0), case)
    with pytest.raises(AssertionError, match="neither attention nor a recognised mistake"):
        ac.check_memory_from_outside(Prepared(*seen[0]), case)


def test_exp2_without_log2e_is_named():
    """exp2 in place of exp with the scores not multiplied by log2(e): named, in a tiled loop written by hand."""
    forgot = lambda *args, **kwargs: exp2_tiles(*args, log2e=1.0, **kwargs)  # noqa: E731
    with pytest.raises(AssertionError, match=r"exp2 was used without the factor log2\(e\)"):
        ac.check_attention(forgot, TILED, tile_arg="tile")


def _drop_last_key(q, k, v, query_positions=None, key_positions=None, **_):
    """A loop over the keys one short: range(S - 1)."""
    t, s = q.shape[2], k.shape[2]
    qp = torch.arange(s - t, s) if query_positions is None else query_positions
    kp = torch.arange(s) if key_positions is None else key_positions
    return reference.attention(q, k[:, :, :-1], v[:, :, :-1], qp, kp[..., :-1]).to(q.dtype)


def test_a_dropped_last_key_is_not_called_a_mask_mistake_where_no_mask_tells_them_apart():
    """At decode the query sits at the last key's position: key < query and a loop one key short give one answer,
    and the message names both; in a prefill they differ and each is named alone; 02's single query applies
    no mask, so only the loop is named there."""
    decode = [ac.make_case("decode", t=1, s=9)]
    with pytest.raises(AssertionError) as both:
        ac.check_attention(as_buggy("mask_off_by_one"), decode)
    assert ac.BUGS["mask_off_by_one"] in str(both.value) and ac.BUGS["last_key_dropped"] in str(both.value)

    prefill = [ac.make_case("prefill", t=6, s=6)]
    with pytest.raises(AssertionError) as mask:
        ac.check_attention(as_buggy("mask_off_by_one"), prefill)
    assert ac.BUGS["mask_off_by_one"] in str(mask.value) and ac.BUGS["last_key_dropped"] not in str(mask.value)
    with pytest.raises(AssertionError) as loop:
        ac.check_attention(_drop_last_key, prefill)
    assert ac.BUGS["last_key_dropped"] in str(loop.value) and ac.BUGS["mask_off_by_one"] not in str(loop.value)

    from flashcourse.engine.single_query import online_attention_single

    short = lambda q, k, v, S, d, tile: online_attention_single(q, k[:-d], v[:-d], S - 1, d, tile)  # noqa: E731
    q, k, v = [0.3, -1.0], [1.0, 0.0, 0.5, 2.0, -1.0, 1.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    with pytest.raises(AssertionError) as single:
        ac.check_single_query(short, [(q, k, v, 3, 2, 2)])
    assert ac.BUGS["last_key_dropped"] in str(single.value) and "causal mask" not in str(single.value)


def _decode_hand(where="right", mask="<=", loop="whole", safe=True, tile=4, chunks=None):
    """A tiled attention written by hand with one way of placing the query or bounding its keys:
    where "right" (S - T + i, or the positions given), "zero" (query i at position i, the offset ignored, given
    positions too), "minus1" / "plus1" (one position off); mask "<=" or "<"; loop "whole", "short" (range(S - 1))
    or "short_per_tile" (each tile one key short); safe: a safe reference for rows with no visible key yet.
    With chunks, split_attention: each chunk of ceil(S / chunks) keys a state of its own, from m = -inf, merged
    after (rightly)."""
    def fn(q, k, v, query_positions=None, key_positions=None, tile=tile, chunks=chunks, query_offset=None, **_):
        b, hq, t, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        size = tile if chunks is None else math.ceil(s / chunks)
        qp = positions(query_positions, b, t, s - t if query_offset is None else query_offset, "cpu")
        qp = {"right": qp, "zero": torch.arange(t).expand(b, t), "minus1": qp - 1, "plus1": qp + 1}[where]
        kp = positions(key_positions, b, s, 0, "cpu")
        kk, vv = (x.double().repeat_interleave(hq // hkv, 1) for x in (k, v))
        qs = q.double() / math.sqrt(d)
        m = torch.full((b, hq, t, 1), -math.inf, dtype=torch.float64)
        l, a = torch.zeros_like(m), torch.zeros(b, hq, t, v.shape[-1], dtype=torch.float64)
        states = []
        for start in range(0, s - 1 if loop == "short" else s, size):
            if chunks is not None:
                states.append((m, l, a))
                m = torch.full_like(m, -math.inf)
                l, a = torch.zeros_like(l), torch.zeros_like(a)
            stop = min(start + size, s - 1 if loop == "short" else s) - (loop == "short_per_tile")
            if stop <= start:
                continue
            sc = qs @ kk[:, :, start:stop].transpose(-1, -2)
            seen = kp[:, None, None, start:stop] <= qp[:, None, :, None] if mask == "<=" else \
                kp[:, None, None, start:stop] < qp[:, None, :, None]
            sc = sc.masked_fill(~seen, -math.inf)
            m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
            ref = torch.nan_to_num(m_new, neginf=0.0) if safe else m_new
            l = torch.exp(m - ref) * l + torch.exp(sc - ref).sum(-1, keepdim=True)
            a = torch.exp(m - ref) * a + torch.exp(sc - ref) @ vv[:, :, start:stop]
            m = m_new
        if chunks is not None:
            states.append((m, l, a))
            top = torch.nan_to_num(torch.stack([x[0] for x in states]).amax(0), neginf=0.0)
            l = sum(torch.exp(x[0] - top) * x[1] for x in states)
            a = sum(torch.exp(x[0] - top) * x[2] for x in states)
        return (a / l).to(q.dtype)
    return fn


DECODE = ac.make_case("decode", batch=2, q_heads=4, kv_heads=2, t=1, s=23, seed=2)
DECODE_AT = ac.make_case("decode at positions 11 and 7", batch=2, q_heads=4, kv_heads=2, t=1, s=12, seed=5,
                         query_positions=torch.tensor([[11], [7]]))


def _message(fn, case, chunked=False):
    """check_attention's message for fn on one case: the case's tile, or its chunks as split_attention's."""
    with pytest.raises(AssertionError) as error:
        if chunked:
            ac.check_attention(fn, [case], tile_of=lambda c: math.ceil(c.k.shape[2] / c.kwargs["chunks"]))
        else:
            ac.check_attention(fn, [case], tile_arg="tile" if "tile" in case.kwargs else None)
    return str(error.value)


@pytest.mark.parametrize("hand", [dict(where="zero", mask="<"), dict(where="zero", mask="<", safe=False),
                                  dict(loop="short_per_tile")])
def test_a_decode_query_that_sees_no_key_is_not_called_an_empty_first_tile(hand):
    """A decode query sees every key, so no tile of it is empty: NaN there (a query placed where it sees no key, a
    loop that visits no key) is not exp(-inf - -inf) of an empty first tile, whatever the tile or chunk, and the
    message names no cause. Before, every such NaN was blamed on a missing safe reference."""
    tiles = (1,) if hand.get("loop") == "short_per_tile" else (1, 4, 64)
    for case in (DECODE, DECODE_AT):
        for tile in tiles:
            message = _message(_decode_hand(**hand, tile=tile), case.with_kwargs(tile=tile))
            assert "NaN at" in message and ac.NAN_HINT not in message and "exactly" not in message, message
            assert ac.NAN_CHECKLIST in message
        if hand.get("loop") != "short_per_tile":
            for chunks in (1, 3):
                message = _message(_decode_hand(**hand, chunks=chunks), case.with_kwargs(chunks=chunks), chunked=True)
                assert "NaN at" in message and ac.NAN_HINT not in message, message
    whole = _message(lambda q, k, v, **kw: _decode_hand(**hand, tile=tiles[0])(q, k, v, **kw), DECODE)  # tile unknown
    assert ac.NAN_HINT not in whole and ac.NAN_CHECKLIST in whole


def test_a_missing_safe_reference_is_still_named_in_a_loop_and_in_chunks():
    """The NaN of a first tile (or a chunk) with no visible key, and nothing else wrong, keeps its name."""
    padded = ac.make_case("left-padded", t=2, s=8, seed=3, key_positions=torch.tensor([ac.PADDING] * 3 + list(range(5))),
                          query_positions=torch.tensor([3, 4]))
    assert ac.NAN_HINT in _message(_decode_hand(safe=False, tile=2), padded.with_kwargs(tile=2))
    prefill = ac.make_case("prefill", q_heads=2, kv_heads=1, t=8, s=8, seed=4)
    assert ac.NAN_HINT in _message(_decode_hand(safe=False, chunks=2), prefill.with_kwargs(chunks=2), chunked=True)
    # A single loop over the same prefill meets a visible key in its first tile: the same NaN is not that.
    chunk_nan = _decode_hand(safe=False, chunks=2)
    message = _message(lambda q, k, v, tile=4, **kw: chunk_nan(q, k, v, **kw), prefill.with_kwargs(tile=4))
    assert ac.NAN_HINT not in message


@pytest.mark.parametrize("hand, case, named", [
    (dict(where="zero"), DECODE, ["offset_ignored"]),                       # query at 0: sees key 0 alone
    (dict(where="minus1"), DECODE, ["mask_off_by_one", "last_key_dropped"]),  # at S - 2: the two give one answer
    (dict(mask="<"), DECODE, ["mask_off_by_one", "last_key_dropped"]),
    (dict(loop="short"), DECODE, ["mask_off_by_one", "last_key_dropped"]),
    (dict(mask="<"), DECODE_AT, ["mask_off_by_one"]),                       # position 7 of 12: the last key is not its
    (dict(loop="short"), DECODE_AT, ["last_key_dropped"]),
    (dict(where="plus1"), standard := ac.standard_cases()[1], []),            # chunked prefill, one key too many
    (dict(loop="short_per_tile"), standard, []),
    (dict(where="minus1"), standard, ["mask_off_by_one"]),
])
def test_decode_position_mistakes_are_named_only_as_what_they_equal(hand, case, named):
    """Hand-written decode mistakes with tiles of 3: each named as every recognised mistake it equals, and only
    those; a wrong answer equal to none is named as nothing."""
    message = _message(_decode_hand(**hand, tile=3), case.with_kwargs(tile=3))
    assert [bug for bug in ac.BUGS if ac.BUGS[bug] in message] == named, message
    if not named:
        assert "exactly" not in message


LOG2E = math.log2(math.e)


def _base2_merge(convert_back=True, mix=None):
    """merge_partials rescaling in base 2: exp2(m_i log2(e) - M log2(e)), the maximum converted back to a natural
    log (or left in base 2). mix: "exp2_of_natural" weights exp2(m_i - M); "exp2_for_a" those weights for a only."""
    def merge(parts):
        m = torch.stack([p[0] for p in parts]).amax(0)
        if mix is not None:
            w = [torch.exp2(p[0] - torch.nan_to_num(m, neginf=0.0)) for p in parts]
            e = [torch.exp(p[0] - torch.nan_to_num(m, neginf=0.0)) for p in parts]
            l_w = e if mix == "exp2_for_a" else w
            return m, sum(x * p[1] for x, p in zip(l_w, parts)), sum(x * p[2] for x, p in zip(w, parts))
        m2 = [p[0] * LOG2E for p in parts]
        top = torch.stack(m2).amax(0)
        w = [torch.exp2(x - torch.nan_to_num(top, neginf=0.0)) for x in m2]
        l, a = sum(x * p[1] for x, p in zip(w, parts)), sum(x * p[2] for x, p in zip(w, parts))
        return (top / LOG2E if convert_back else top), l, a
    return merge


def _lse_merge(parts):
    """merge_partials through log-sum-exps, written with care for parts in which a row saw no key."""
    lses = [p[0] + torch.log(p[1]) for p in parts]                     # -inf for an empty part
    lse = torch.logsumexp(torch.stack(lses), 0)
    out = sum(torch.exp(x - torch.nan_to_num(lse, neginf=0.0)) * torch.where(p[1] > 0, p[2] / p[1], 0.0)
              for x, p in zip(lses, parts))
    return lse, torch.where(torch.isfinite(lse), 1.0, 0.0), out


def test_merges_in_base_2_or_with_log_sum_exps_pass_where_scores_reach_the_hundreds():
    """A merge that works in base 2 and converts back, or through log-sum-exps, is right: it passes 03's hidden
    merge checks, scores of about 730 included, where rounding m * log2(e) in float32 moves a / l by 2e-5 (more
    than the 1e-5 the check allowed before)."""
    from autograder.hidden import online_attention as hidden

    hidden.test_merge_partials(_base2_merge())
    hidden.test_merge_partials(_lse_merge)


PADDED_PART = ac.make_case("second part padding only", batch=2, q_heads=2, kv_heads=1, t=3, s=9, seed=5,
                           key_positions=torch.tensor(list(range(6)) + [ac.PADDING] * 3),
                           query_positions=torch.tensor([3, 4, 5]))


@pytest.mark.parametrize("merge", [_base2_merge(convert_back=False), _base2_merge(mix="exp2_of_natural"),
                                   _base2_merge(mix="exp2_for_a")], ids=["m left in base 2", "exp2 of natural m",
                                                                         "exp2 for a, exp for l"])
def test_merges_that_mix_bases_are_not_called_unrescaled(merge):
    """A merge that mixes bases fails, and is not said to add the states without rescaling: on parts where that
    mistake gives the right output (every row saw keys in one part only) a wrong m + log l alone was called so.
    (Weights exp2(m_i - M) are right where one part alone holds a row's keys: 2^0 = 1, 2^-inf = 0.)"""
    failures = []
    for parts in (ac.partial_states(CASES[4], [(0, 5), (5, 11), (11, 20)]),
                  ac.partial_states(PADDED_PART, [(0, 6), (6, 9)])):
        try:
            ac.check_merge_partials(merge, parts)
        except AssertionError as error:
            failures.append(str(error))
    assert failures and all("without rescaling" not in text for text in failures), failures


def test_a_merge_that_gives_nan_is_named_only_for_a_reference_of_minus_inf():
    """NaN from exp(m_i - m_1) with the first part's m = -inf is named; NaN from a_i / l_i of an empty part is
    named as that, and as both where the two give the same rows; NaN handed in by parts that hold NaN already
    (merged groups) is said to be there already. Before, all were blamed on the reference."""
    case = ac.standard_cases()[0]                                       # prefill: rows 0..7 see nothing of keys 8..15
    parts = ac.partial_states(case, [(8, 16), (0, 8)])                  # ... the first part: both mistakes' rows

    def first_reference(ps):
        ref = ps[0][0]
        return ref, sum(torch.exp(p[0] - ref) * p[1] for p in ps), sum(torch.exp(p[0] - ref) * p[2] for p in ps)

    def divides(ps):                                                    # _lse_merge without its care for l = 0
        lses = [p[0] + torch.log(p[1]) for p in ps]
        lse = torch.logsumexp(torch.stack(lses), 0)
        return lse, torch.ones_like(lse), sum(torch.exp(x - lse) * p[2] / p[1] for x, p in zip(lses, ps))

    largest = "exp(m_i - m) must be taken against the largest m"
    with pytest.raises(AssertionError) as error:                       # rows 0..7 see nothing of the first part,
        ac.check_merge_partials(first_reference, ac.partial_states(case, [(8, 12), (0, 8), (12, 16)]))  # 0..11 of one
    assert error.match(re.escape(largest)) and "0 / 0" not in str(error.value)
    with pytest.raises(AssertionError) as error:
        ac.check_merge_partials(divides, parts[::-1])                   # keys 8..15 second: only the division's rows
    assert largest not in str(error.value) and "l_i = 0, and 0 / 0 is NaN" in str(error.value)
    with pytest.raises(AssertionError) as error:
        ac.check_merge_partials(first_reference, parts)
    assert error.match(re.escape(largest)) and "l_i = 0, and 0 / 0 is NaN" in str(error.value)
    grouped = [tuple(divides(parts[:1])), tuple(divides(parts[1:]))]   # row 0 of the first group: a = 0 / 0
    with pytest.raises(AssertionError) as error:
        ac.check_merge_partials(_lse_merge, grouped, what="merge_partials of merged groups")
    assert "part 1 given to it holds NaN in that row already" in str(error.value) and largest not in str(error.value)


def test_05_decode_check_names_a_misplaced_query_only_as_what_it_equals():
    """05's check of fast_decode (check_against_baseline, splits=1 first): a query placed at position 0 is the
    ignored offset; placed there with key < query it sees no key and its NaN gets no cause (before, a missing safe
    reference was blamed); key < query at the query's own place is the mask or the short loop, which agree there."""
    def fast_decode(**hand):
        return lambda q, k, v, splits=None: _decode_hand(**hand, chunks=splits or 4)(q, k, v)

    cases = [ac.make_case("decode, GQA", q_heads=4, kv_heads=2, t=1, s=40, splits=n) for n in (None, 3, 10)]
    for hand, named in ((dict(where="zero"), ["offset_ignored"]), (dict(where="zero", mask="<"), []),
                        (dict(mask="<"), ["mask_off_by_one", "last_key_dropped"])):
        with pytest.raises(AssertionError) as error:
            ac.check_against_baseline(fast_decode(**hand), cases, {"splits": 1}, ac.STEP_HINTS["splits"])
        message = str(error.value)
        assert [bug for bug in ac.BUGS if ac.BUGS[bug] in message] == named and ac.NAN_HINT not in message, message
