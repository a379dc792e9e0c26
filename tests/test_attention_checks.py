"""flashcourse.checks.core: correct implementations pass, each classic mistake is named."""

import math

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
