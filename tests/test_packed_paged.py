"""09's checks (flashcourse.checks.packed_paged): the solutions pass every visible and hidden case, and each
mistake, written here in another style than the recognisers' own (one block-diagonal mask over the packed
batch, keys gathered one index at a time), is named as itself and as nothing else; mistakes the recognisers do
not know get no name at all."""

import math

import pytest
import torch

from autograder.hidden import packed_paged as hidden
from flashcourse.checks import packed_paged as pp
from flashcourse.engine.packed_paged import gather_pages, packed_attention, paged_attention


def masked_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True, bug=None):
    """Packed attention as one [Hq, total_q, total_k] matrix with a block-diagonal mask; `bug` plants a mistake."""
    total_q, q_heads, d = q.shape
    total_k, kv_heads, _ = k.shape
    seq_q = torch.repeat_interleave(torch.arange(len(cu_seqlens_q) - 1), cu_seqlens_q.diff().long())   # [total_q]
    seq_k = torch.repeat_interleave(torch.arange(len(cu_seqlens_k) - 1), cu_seqlens_k.diff().long())   # [total_k]
    len_q, len_k = cu_seqlens_q.diff().long()[seq_q], cu_seqlens_k.diff().long()
    row = torch.arange(total_q) - cu_seqlens_q[seq_q].long()           # row within its sequence
    key = torch.arange(total_k) - cu_seqlens_k[seq_k].long()
    query_pos = row + len_k[seq_q] - len_q                              # bottom-right
    if bug == "top_left":
        query_pos = row
    same = seq_q[:, None] == seq_k[None, :]
    if bug == "whole_batch":
        same = torch.ones_like(same)
        query_pos, key = torch.arange(total_q) + total_k - total_q, torch.arange(total_k)
    if bug == "earlier_sequences":
        same = seq_k[None, :] <= seq_q[:, None]
        query_pos, key = query_pos + cu_seqlens_k[seq_q].long(), torch.arange(total_k)
    if bug == "last_key_dropped":
        same &= key[None, :] < (len_k[seq_k] - 1)[None, :]
        query_pos = query_pos - 1
    seen = key[None, :] < query_pos[:, None] if bug == "mask_off_by_one" else key[None, :] <= query_pos[:, None]
    visible = same & seen if causal else same
    expand = (lambda x: x.repeat(1, q_heads // kv_heads, 1)) if bug == "gqa_modulo" else \
             (lambda x: x.repeat_interleave(q_heads // kv_heads, 1))
    scores = torch.einsum("qhd,khd->hqk", q.double(), expand(k.double())) / (d if bug == "scale_over_d" else math.sqrt(d))
    weights = torch.softmax(scores.masked_fill(~visible, -math.inf), -1)
    if bug != "nan_for_no_key":
        weights = weights.nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", weights, expand(v.double())).to(q.dtype)


def gather_one_by_one(cache, pages, length, bug=None):
    """Keys read one index at a time: page pages[j // page_size], slot j % page_size; `bug` plants a mistake."""
    page_size = cache.shape[1]
    count = -(-length // page_size) * page_size if bug == "whole_last_page" else length
    j = torch.arange(count)
    if bug == "contiguous_cache":
        return cache.flatten(0, 1)[j]
    page_index = j // page_size + (1 if bug == "page_off_by_one" else 0)
    return cache[pages.long()[page_index], j % page_size]


def paged_by_gathering(q, k_cache, v_cache, block_table, cache_seqlens, cu_seqlens_q, causal=True, bug=None):
    """Gather every sequence's keys and values, then attend as packed; `bug` plants a mistake in either step."""
    batch = len(cache_seqlens)
    rows = [(b + 1) % batch if bug == "next_sequences_pages" else 0 if bug == "first_sequences_pages" else b
            for b in range(batch)]
    gather_bug = bug if bug in pp.PAGE_MISTAKES else None
    keys = [gather_one_by_one(k_cache, block_table[r], int(n), gather_bug) for r, n in zip(rows, cache_seqlens)]
    values = [gather_one_by_one(v_cache, block_table[r], int(n), gather_bug) for r, n in zip(rows, cache_seqlens)]
    cu_k = pp.cumulative(len(x) for x in keys)
    return masked_attention(q, torch.cat(keys), torch.cat(values), cu_seqlens_q, cu_k, causal,
                            None if bug in pp.PAGE_MISTAKES + pp.TABLE_MISTAKES else bug)


def pages_with_a_bug(q, k_cache, v_cache, block_table, cache_seqlens, cu_seqlens_q, causal=True, bug=None):
    """Page by page with float32 running maxima kept per (row, head), as a kernel would; `bug` in the recurrence."""
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    page_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for b in range(len(cache_seqlens)):
        n_keys = int(cache_seqlens[b])
        for r in range(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])):
            pos = n_keys - int(cu_seqlens_q[b + 1]) + r
            for h in range(q.shape[1]):
                m, l, acc = -math.inf, 0.0, torch.zeros(v_cache.shape[-1])
                for start in range(0, n_keys, page_size):
                    page = int(block_table[b, start // page_size])
                    stop = min(n_keys, start + page_size, pos + 1 if causal else n_keys)
                    if stop <= start:
                        break
                    kp, vp = k_cache[page, :stop - start, h // group], v_cache[page, :stop - start, h // group]
                    s = kp @ q[r, h] / math.sqrt(q.shape[-1])
                    if bug == "per_page_softmax":
                        acc += torch.softmax(s, 0) @ vp
                        continue
                    m_new = max(m, float(s.max()))
                    alpha = math.exp(m - m_new)
                    p = torch.exp(s - m_new)
                    l = (l if bug == "l_not_rescaled" else l * alpha) + float(p.sum())
                    acc = (acc if bug == "a_not_rescaled" else acc * alpha) + p @ vp
                    m = m_new
                out[r, h] = acc if bug == "per_page_softmax" else acc / l
    return out


PACKED_CASES = [pp.packed_case("chunked prefill, GQA", [(5, 9), (3, 3), (4, 11)], seed=1),
                pp.packed_case("not causal", [(4, 6), (7, 2), (2, 5)], q_heads=2, kv_heads=2, causal=False, seed=2),
                pp.packed_case("more queries than keys", [(0, 3), (1, 1), (6, 4), (2, 5)], q_heads=2, kv_heads=1,
                               seed=3)]
PAGED_CASES = [pp.paged_case("decode", [(1, 9), (1, 4), (1, 1), (1, 13)], seed=7),
               pp.paged_case("chunked prefill", [(3, 10), (1, 7), (5, 5), (2, 12)], seed=9)]


def test_the_solutions_pass_every_visible_and_hidden_case():
    """The notebook's solutions, exported to the engine, pass the hidden tests (and through them the visible)."""
    hidden.test_packed_attention(packed_attention)
    hidden.test_packed_attention_edges(packed_attention)
    hidden.test_gather_pages(gather_pages)
    hidden.test_paged_decode(paged_attention)
    hidden.test_paged_prefill(paged_attention)


def test_other_correct_solutions_pass():
    """A block-diagonal mask, a gather one key at a time and a per-row page loop are accepted as they are."""
    hidden.test_packed_attention(masked_attention)
    hidden.test_packed_attention_edges(masked_attention)
    hidden.test_gather_pages(gather_one_by_one)
    hidden.test_paged_prefill(paged_by_gathering)
    pp.check_paged_attention(pages_with_a_bug, PAGED_CASES)


def _message(check, fn, cases) -> str:
    with pytest.raises(AssertionError) as caught:
        check(fn, cases)
    return str(caught.value)


def _named_exactly(message: str, mistake: str) -> None:
    assert pp.MISTAKES[mistake] in message, message
    others = [m for m in pp.MISTAKES if m != mistake and pp.MISTAKES[m] in message]
    assert not others, f"{mistake} was also named as {others}: {message}"


@pytest.mark.parametrize("mistake", pp.PACKED_MISTAKES)
def test_each_packed_mistake_is_named(mistake):
    """Each mistake of packed attention, in the block-diagonal style, is named as itself in the visible cases."""
    if mistake == "no_scale":
        fn = lambda q, k, v, *a, **kw: masked_attention(q * math.sqrt(q.shape[-1]), k, v, *a, **kw)  # noqa: E731
    else:
        fn = lambda *a, **kw: masked_attention(*a, **kw, bug=mistake)  # noqa: E731
    _named_exactly(_message(pp.check_packed_attention, fn, PACKED_CASES), mistake)


@pytest.mark.parametrize("mistake", pp.PAGE_MISTAKES)
def test_each_gather_mistake_is_named(mistake):
    """Each mistake of the address arithmetic, one index at a time, is named by gather_pages' check."""
    cache, _, table = pp.paged_cache([12, 5], page_size=4, kv_heads=2, d=8, gen=torch.Generator().manual_seed(5))
    fn = lambda c, p, n: gather_one_by_one(c, p, n, bug=mistake)  # noqa: E731
    _named_exactly(_message(lambda f, _: pp.check_gather_pages(f, cache, table[0], range(13)), fn, None), mistake)


@pytest.mark.parametrize("mistake", pp.PAGE_MISTAKES + pp.TABLE_MISTAKES + ("top_left", "gqa_modulo"))
def test_each_paged_mistake_is_named(mistake):
    """Reading the wrong pages, or attending wrongly once they are read, is named by paged_attention's check."""
    fn = lambda *a, **kw: paged_by_gathering(*a, **kw, bug=mistake)  # noqa: E731
    cases = PAGED_CASES[1:] if mistake == "top_left" else PAGED_CASES   # decode cannot show a top-left mask
    _named_exactly(_message(pp.check_paged_attention, fn, cases), mistake)


@pytest.mark.parametrize("mistake", pp.PAGE_TILE_MISTAKES)
def test_each_recurrence_mistake_over_pages_is_named(mistake):
    """l or a not rescaled, and a softmax per page, in a loop over pages, are named as themselves."""
    fn = lambda *a, **kw: pages_with_a_bug(*a, **kw, bug=mistake)  # noqa: E731
    _named_exactly(_message(pp.check_paged_attention, fn, PAGED_CASES), mistake)


def test_mistakes_it_does_not_know_get_no_name():
    """Scores divided by D, and values of the wrong head, fail with where they are wrong and no mistake named."""
    scaled = lambda *a, **kw: masked_attention(*a, **kw, bug="scale_over_d")  # noqa: E731
    swapped = lambda q, k, v, *a, **kw: packed_attention(q, k, v.flip(1), *a, **kw)  # noqa: E731
    for fn in (scaled, swapped):
        message = _message(pp.check_packed_attention, fn, PACKED_CASES)
        assert "wrong at sequence" in message and "exactly what happens" not in message, message


def test_no_key_rows_are_zero_not_nan():
    """A NaN on exactly the rows that see no key is named; the reference gives 0 there."""
    case = PACKED_CASES[2]
    assert case.expected()[1:3].abs().max() == 0 and not case.expected().isnan().any()
    fn = lambda *a, **kw: masked_attention(*a, **kw, bug="nan_for_no_key")  # noqa: E731
    _named_exactly(_message(pp.check_packed_attention, fn, [case]), "nan_for_no_key")


def test_the_spare_slots_hold_other_data():
    """Every slot no sequence owns holds data large enough that reading it changes the answer (what makes the
    partial-page and off-by-one mistakes visible)."""
    case = PAGED_CASES[0]
    for mistake in ("whole_last_page", "page_off_by_one"):
        assert (pp.paged_reference(case, mistake) - case.expected()).abs().max() > 0.1, mistake
