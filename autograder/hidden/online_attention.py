"""Hidden checks for 03_online_attention: more batches, GQA, offsets, positions, tiles, memory, merges.

The visible tests already exercise every behaviour the exercises ask for; these add variety around
them (other seeds, shapes, positions and tile sizes), one function per graded cell.
Tolerances are flashcourse.checks.core.TOLERANCES for the inputs' dtype (float32: 1e-4 relative
and absolute, bf16: 2e-2) against the float64 reference; merges are compared at 1e-5 on a / l and
m + log l. Every case is seeded but the memory probe's, drawn when it runs (checks.core.unpredictable_seed).
"""

import math

import torch

from flashcourse.checks import core as ac

PADDING = ac.PADDING


def _plain_cases(dtype=torch.float32):
    """The standard cases on other seeds, a value dim apart from D, and scores in the hundreds."""
    cases = ac.standard_cases(dtype, seed=100)
    cases.append(ac.make_case("value dim 8, key dim 16", batch=1, q_heads=3, kv_heads=1, t=6, s=11, d=16, dv=8,
                              dtype=dtype, seed=9))
    cases.append(ac.make_case("scores in the hundreds", batch=1, q_heads=2, kv_heads=2, t=6, s=14, dtype=dtype,
                              seed=10, score_scale=300.0))
    return cases


def _position_cases(dtype=torch.float32):
    """Explicit positions on other seeds, monotonic with gaps per batch, and shared [T] queries."""
    cases = ac.position_cases(dtype, seed=100)
    cases.append(ac.make_case("positions with gaps [S] and [B, T]", batch=2, q_heads=4, kv_heads=2, t=4, s=10,
                              dtype=dtype, seed=7, key_positions=torch.arange(10) * 3,
                              query_positions=torch.tensor([[2, 9, 20, 27], [0, 4, 12, 30]])))
    cases.append(ac.make_case("shared query positions [T]", batch=2, q_heads=2, kv_heads=2, t=3, s=12,
                              dtype=dtype, seed=8, query_positions=torch.tensor([4, 7, 11])))
    return cases


def _masked_first_tile_cases():
    """Custom positions where some query row's first key tiles hold no visible key."""
    b, s, t, pad = 2, 12, 4, 5
    # A left-padded batch: the padding keys come first and are never visible.
    key_pos = torch.stack([torch.arange(s), torch.cat([torch.full((pad,), PADDING), torch.arange(s - pad)])])
    query_pos = torch.stack([torch.arange(s - t, s), torch.arange(s - pad - t, s - pad)])
    yield ac.make_case("left-padded batch (padding keys first)", batch=b, q_heads=4, kv_heads=2, t=t, s=s,
                       seed=20, query_positions=query_pos, key_positions=key_pos)
    # A ring-buffer KV cache: positions 8..15 are stored before 0..7; early queries see only the second half.
    yield ac.make_case("ring-buffer KV cache", batch=1, q_heads=2, kv_heads=1, t=3, s=16, seed=21,
                       key_positions=torch.cat([torch.arange(8, 16), torch.arange(8)]),
                       query_positions=torch.tensor([3, 6, 14]))
    # Chunked prefill of a padded batch with per-batch query positions.
    yield ac.make_case("chunked prefill, padded keys", batch=2, q_heads=2, kv_heads=2, t=2, s=9, seed=22,
                       key_positions=torch.tensor([[PADDING, PADDING, PADDING, 0, 1, 2, 3, 4, 5], list(range(9))]),
                       query_positions=torch.tensor([[4, 5], [7, 8]]))


def test_causal_attention(causal_attention) -> None:
    """Default positions in float32 on other seeds and shapes, prefill and chunked prefill in bf16."""
    ac.check_attention(causal_attention, _plain_cases())
    ac.check_attention(causal_attention, ac.standard_cases(torch.bfloat16, seed=200)[:2])


def test_causal_attention_positions(causal_attention) -> None:
    """Explicit positions on other seeds, and padded or ring-buffer keys."""
    ac.check_attention(causal_attention, _position_cases())
    ac.check_attention(causal_attention, list(_masked_first_tile_cases()))


def test_online_attention(online_attention) -> None:
    """Every plain and position case with tiles of 1, 3, 7, 16 and more than S; bf16 cases."""
    cases = [case.with_kwargs(tile=tile) for case in _plain_cases() + _position_cases() for tile in (1, 3, 7, 16, 64)]
    ac.check_attention(online_attention, cases, tile_arg="tile")
    ac.check_attention(online_attention, [c.with_kwargs(tile=4) for c in ac.standard_cases(torch.bfloat16)[:2]],
                       tile_arg="tile")


def test_online_attention_edges(online_attention) -> None:
    """First tiles with no visible key (padding, ring buffer, padded chunked prefill), tiles of 1 to 5."""
    cases = [case.with_kwargs(tile=tile) for case in _masked_first_tile_cases() for tile in (1, 2, 3, 4, 5)]
    ac.check_attention(online_attention, cases, tile_arg="tile")


def test_online_attention_errors(online_attention) -> None:
    """The three ValueErrors on other shapes: a negative tile, Hq = 4 with Hkv = 3, a row of one sequence
    of the batch that sees no key."""
    base = ac.make_case("tile -2", batch=1, q_heads=2, kv_heads=1, t=4, s=6, seed=30)
    ac.check_raises(online_attention, base.with_kwargs(tile=-2), "tile must be at least 1")
    ac.check_raises(online_attention, ac.make_case("Hq = 4, Hkv = 3", q_heads=4, kv_heads=3, t=4, s=6, seed=31),
                    "query heads must be a multiple of KV heads")
    ac.check_raises(online_attention, ac.make_case("padding only before query 0 of sequence 1", batch=2, t=2, s=4,
                                                   seed=32, tile=2, query_positions=torch.tensor([[2, 3], [0, 1]]),
                                                   key_positions=torch.tensor([[0, 1, 2, 3], [PADDING, 1, 2, 3]])),
                    "the query at position 0 of sequence 1 sees no key")


def test_online_attention_memory(online_attention) -> None:
    """No tensor of T * S elements is created when tile < S, in a prefill (T = S = 128): the visible test
    probes a chunked prefill. Measured from outside, every probe is one head scaled up to the same 1 GiB float32
    score matrix (T = S = 16384 here) against 256 MiB (checks.core.PROBE_ALLOWANCE), so a second chunked
    one would cost as much as the first and catch nothing new."""
    ac.check_no_full_scores(online_attention, ac.make_case("memory, prefill", batch=1, q_heads=2, kv_heads=2,
                                                            t=128, s=128, d=8, seed=41, tile=32))


def _parts(case, cuts):
    s = case.k.shape[2]
    edges = [0, *cuts, s]
    return ac.partial_states(case, list(zip(edges[:-1], edges[1:])))


def test_merge_partials(merge_partials) -> None:
    """Random cuts: parts in order, reversed, shuffled, merged in groups; empty rows and large maxima."""
    gen = torch.Generator().manual_seed(50)
    for case in (_plain_cases() + _position_cases())[:8]:
        s = case.k.shape[2]
        cuts = sorted(torch.randperm(s - 1, generator=gen)[: min(3, s - 1)].add(1).tolist())
        parts = _parts(case, cuts)
        ac.check_merge_partials(merge_partials, parts)
        ac.check_merge_partials(merge_partials, parts[::-1])
        order = torch.randperm(len(parts), generator=gen).tolist()
        ac.check_merge_partials(merge_partials, [parts[j] for j in order])
        if len(parts) >= 3:
            grouped = [tuple(merge_partials(parts[:2])), tuple(merge_partials(parts[2:]))]
            ac.check_merge_partials(merge_partials, grouped, what="merge_partials of merged groups")
    case = ac.make_case("large scores", t=5, s=12, score_scale=200.0, seed=51)
    ac.check_merge_partials(merge_partials, _parts(case, [4, 8]))


def test_split_attention(split_attention) -> None:
    """split_attention equals attention for 1 to 4 chunks, with GQA, offsets, positions and padded keys."""
    cases = [case.with_kwargs(chunks=chunks) for case in _plain_cases() + _position_cases() for chunks in (1, 2, 3, 4)
             if chunks <= case.k.shape[2]]
    cases += [case.with_kwargs(chunks=3) for case in _masked_first_tile_cases()]
    # A chunk plays the part of a tile: per-chunk mistakes are recognised with tile = ceil(S / chunks).
    ac.check_attention(split_attention, cases, tile_of=lambda c: math.ceil(c.k.shape[2] / c.kwargs["chunks"]))
