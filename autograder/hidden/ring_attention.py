"""Hidden checks for 07_ring_attention: merges, zigzag layouts and rings of 2, 3 and 4 processes, a ring given
group= other than the default (checks.ring_attention.check_ring_on_groups: a group numbered in another order, a sub-group),
and rings of 11 and 12 whose ranks' memory is measured from outside (checks.ring_attention.check_ring_memory: no all_gather).

Rings run on real process groups (flashcourse.distributed, gloo), in the jail when grading, with a
timeout per group (flashcourse.checks.ring_attention.RING_TIMEOUT_S) so a deadlocked ring fails instead of
hanging. Outputs are compared with the float64 reference at flashcourse.checks.core.TOLERANCES
(float32: 1e-4); merges at checks.ring_attention.MERGE_TOL (1e-4). Every case is seeded but the
memory probe's, drawn when it runs (checks.core.unpredictable_seed).
"""

import math

import torch

from flashcourse.checks import core as ac
from flashcourse.checks import ring_attention as rc


def _three_parts(seed: int):
    """(o, lse) of three key chunks of one causal sequence (float32) and the exact whole (float64)."""
    case = ac.make_case("three chunks", batch=2, q_heads=6, kv_heads=3, t=7, s=21, seed=seed)
    qp, kp = torch.arange(14, 21), torch.arange(21)
    parts = [tuple(x.float() for x in rc.partial_attention(case.q, case.k[:, :, a:b], case.v[:, :, a:b], qp, kp[a:b]))
             for a, b in ((0, 5), (5, 15), (15, 21))]
    whole = rc.partial_attention(case.q, case.k, case.v, qp, kp)
    return parts, whole


def test_merge_lse(merge_lse) -> None:
    """The visible cases, then three chunks merged in two groupings (the result may not depend on it)."""
    rc.check_merge_lse(merge_lse)
    ((o1, l1), (o2, l2), (o3, l3)), (o_want, lse_want) = _three_parts(seed=80)
    for grouping, (o, lse) in (("(1, 2), 3", merge_lse(*merge_lse(o1, l1, o2, l2), o3, l3)),
                               ("1, (3, 2)", merge_lse(o1, l1, *merge_lse(o3, l3, o2, l2)))):
        assert torch.allclose(lse.double(), lse_want, rtol=rc.MERGE_TOL, atol=rc.MERGE_TOL), \
            f"merging three chunks as {grouping}: lse differs from the whole sequence's"
        assert torch.allclose(o.double(), o_want, rtol=rc.MERGE_TOL, atol=rc.MERGE_TOL), \
            f"merging three chunks as {grouping}: o differs from the whole sequence's attention"
    empty = torch.full_like(l1, -math.inf)                     # merging with an empty part changes nothing
    o, lse = merge_lse(torch.zeros_like(o1), empty, o1, l1)
    assert torch.allclose(o, o1, atol=1e-6) and torch.allclose(lse, l1, atol=1e-6), \
        "merging with an empty part (o = 0, lse = -inf everywhere) should give the other part back"


def test_zigzag(zigzag_shard, zigzag_unshard) -> None:
    """The visible checks, then P up to 5, T from 2P to 4P + 5, other dims, and shard -> unshard round trips."""
    rc.check_zigzag(zigzag_shard, zigzag_unshard)
    gen = torch.Generator().manual_seed(90)
    for world_size in (3, 5):
        for length in (2 * world_size, 4 * world_size + 5):
            x = torch.randn(2, length, 3, generator=gen)                     # sharded along dim 1
            for rank in range(world_size):
                got = zigzag_shard(x, rank, world_size, dim=1)
                want = rc.shard(x, rank, world_size, "zigzag", dim=1)
                assert got.shape == want.shape and torch.equal(got, want), \
                    f"zigzag_shard(x, {rank}, {world_size}, dim=1) with T = {length} along dim 1 is wrong"
            back = zigzag_unshard([zigzag_shard(x, r, world_size, dim=1) for r in range(world_size)], dim=1)
            assert torch.equal(back, x), f"zigzag_unshard(zigzag_shard(...)) with P = {world_size}, T = {length}, " \
                                         "dim=1 does not give x back"


def test_ring_attention(ring_attention) -> None:
    """P = 4 and 2, both layouts, causal or not, GQA, T a multiple of 2P or not, large scores; a ring given group=
    (every rank of 4 in another order, and ranks 1 and 2 of 4); rings of 12 measured."""
    gqa = ac.make_case("GQA 8 : 2, T = 16", batch=2, q_heads=8, kv_heads=2, t=16, d=8, seed=101)
    rc.check_ring_attention(ring_attention, [gqa], world_sizes=(4,))
    uneven = ac.make_case("MHA, T = 19", batch=1, q_heads=2, kv_heads=2, t=19, d=16, seed=102)
    rc.check_ring_attention(ring_attention, [uneven], world_sizes=(2,), causal_options=(True,))
    large = ac.make_case("large scores, T = 24", batch=1, q_heads=4, kv_heads=1, t=24, d=8, seed=103, score_scale=30.0)
    rc.check_ring_attention(ring_attention, [large], world_sizes=(4,), layouts=("zigzag",), causal_options=(True,))
    rc.check_ring_on_groups(ring_attention, seed=105)
    rc.check_ring_memory(ring_attention, world_size=12, layout="zigzag", seed=ac.unpredictable_seed())


def test_ring_attention_odd(ring_attention) -> None:
    """P = 3 (an odd ring: no rank is its own mirror), GQA and MQA, T = 6, 17 and 30, both layouts."""
    tiny = ac.make_case("GQA 6 : 3, T = 6 (one token per chunk)", batch=1, q_heads=6, kv_heads=3, t=6, d=8, seed=111)
    rc.check_ring_attention(ring_attention, [tiny], world_sizes=(3,))
    uneven = ac.make_case("GQA 4 : 2, T = 17", batch=2, q_heads=4, kv_heads=2, t=17, d=8, seed=112)
    rc.check_ring_attention(ring_attention, [uneven], world_sizes=(3,), layouts=("zigzag",), causal_options=(True,))
    mqa = ac.make_case("MQA 3 : 1, T = 30", batch=1, q_heads=3, kv_heads=1, t=30, d=16, seed=113)
    rc.check_ring_attention(ring_attention, [mqa], world_sizes=(3,), causal_options=(True,))
    rc.check_ring_memory(ring_attention, world_size=11, layout="contiguous", seed=114)
