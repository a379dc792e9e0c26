"""Hidden checks for 09_packed_paged: packed attention, gather_pages and paged_attention on cases the visible tests
do not show: other lengths (long ones, zeros, more queries than keys), MQA and GQA of other groups, other head
dimensions, page sizes from 1 to 16, bf16, and block tables whose spare entries point at other data.

Every case is seeded (grading is repeatable); outputs are compared with the float64 references of
flashcourse.checks.packed_paged at flashcourse.checks.core.TOLERANCES, gathers exactly.
"""

import torch

from flashcourse.checks import packed_paged as pp


def test_packed_attention(packed_attention) -> None:
    """Longer sequences, MQA, D = 32, a sequence with fewer keys than queries in the middle, bf16."""
    pp.check_packed_attention(packed_attention, [
        pp.packed_case("five sequences, MQA 6 : 1, D = 32", [(17, 40), (1, 33), (9, 9), (30, 70), (2, 3)],
                       q_heads=6, kv_heads=1, d=32, seed=101),
        pp.packed_case("GQA 8 : 2, not causal", [(12, 5), (3, 21), (8, 8)], q_heads=8, kv_heads=2, causal=False,
                       seed=102),
        pp.packed_case("bf16, GQA 4 : 2", [(16, 16), (5, 37)], dtype=torch.bfloat16, seed=103),
    ])


def test_packed_attention_edges(packed_attention) -> None:
    """Sequences with no queries, no keys or both, at the start and the end; more queries than keys, not causal."""
    pp.check_packed_attention(packed_attention, [
        pp.packed_case("empty first and last", [(0, 0), (3, 0), (4, 2), (0, 6), (1, 1)], q_heads=4, kv_heads=4,
                       seed=111),
        pp.packed_case("more queries than keys, not causal", [(9, 3), (0, 2), (2, 7)], causal=False, seed=112),
        pp.packed_case("only single tokens", [(1, 1)] * 5, q_heads=2, kv_heads=1, seed=113),
    ])


def test_gather_pages(gather_pages) -> None:
    """Page sizes 1, 3 and 16, int64 block-table rows, bf16 values, lengths from 0 to the pages' capacity."""
    for page_size, lengths, seed in ((1, [7, 4], 121), (3, [10, 2], 122), (16, [40, 17], 123)):
        cache, _, table = pp.paged_cache(lengths, page_size, kv_heads=2, d=4, gen=torch.Generator().manual_seed(seed))
        pp.check_gather_pages(gather_pages, cache, table[0].long(), range(0, lengths[0] + 1))
    cache, _, table = pp.paged_cache([9], 4, kv_heads=1, d=8, gen=torch.Generator().manual_seed(124),
                                     dtype=torch.bfloat16)
    pp.check_gather_pages(gather_pages, cache, table[0], [9, 8, 1])


def test_paged_decode(paged_attention) -> None:
    """Decode over page sizes 1 and 16, MQA, a long sequence beside a one-key one, bf16."""
    pp.check_paged_attention(paged_attention, [
        pp.paged_case("decode, page_size 1", [(1, 6), (1, 2), (1, 9)], page_size=1, q_heads=2, kv_heads=1, seed=131),
        pp.paged_case("decode, page_size 16, MQA 8 : 1", [(1, 70), (1, 1), (1, 33)], page_size=16, q_heads=8,
                      kv_heads=1, d=32, seed=132),
        pp.paged_case("decode, bf16", [(1, 20), (1, 11)], page_size=4, dtype=torch.bfloat16, seed=133),
    ])


def test_paged_prefill(paged_attention) -> None:
    """Whole prompts (len_q = keys), chunks that end mid-page, a sequence with no new query, not causal, bf16."""
    pp.check_paged_attention(paged_attention, [
        pp.paged_case("whole prompts as one chunk, page_size 8", [(13, 13), (8, 8)], page_size=8, seed=141),
        pp.paged_case("chunks ending mid-page, GQA 6 : 2", [(5, 27), (0, 9), (7, 18), (1, 3)], page_size=4,
                      q_heads=6, kv_heads=2, seed=142),
        pp.paged_case("not causal", [(3, 10), (2, 6)], page_size=4, causal=False, seed=143),
        pp.paged_case("bf16, page_size 16", [(9, 40), (4, 16)], page_size=16, dtype=torch.bfloat16, seed=144),
    ])
