"""flashcourse.memory: the allocation tracker sees new tensors, not views, and frees them."""

import torch

from flashcourse import memory


def test_tracker_records_largest_and_peak():
    x = torch.randn(64, 64)
    with memory.AllocationTracker() as tracker:
        y = x @ x                      # 16 KiB, new
        z = y.t()                      # a view: no new storage
        del y, z
        w = torch.zeros(10)            # 40 bytes
    assert tracker.largest.shape == (64, 64) and tracker.largest.nbytes == 64 * 64 * 4
    assert tracker.peak_bytes == 64 * 64 * 4 + 40 or tracker.peak_bytes == 64 * 64 * 4
    assert len(tracker.allocations) == 2
    assert tracker.live_bytes == 40
    assert [a.shape for a in tracker.created(1000)] == [(64, 64)]
    del w


def test_views_of_inputs_are_not_allocations():
    x = torch.randn(100, 100)
    with memory.AllocationTracker() as tracker:
        x[:10].t().reshape(-1, 10)
        x.mul_(2.0)
    assert tracker.allocations == []


def test_measure_full_versus_tiled():
    from flashcourse.engine.online_attention import causal_attention, online_attention

    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
    _, full = memory.measure(causal_attention, q, k, v)
    _, tiled = memory.measure(online_attention, q, k, v, tile=32)
    assert full.how == "dispatch tracker"
    assert full.largest.numel >= 2 * 256 * 256          # the whole score matrix
    assert tiled.largest.numel < 256 * 256              # never a [T, S] matrix
    assert tiled.peak_bytes * 3 < full.peak_bytes
