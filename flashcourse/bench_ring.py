"""07's ring attention timed on P GPUs with NCCL, beside one GPU's SDPA on the whole sequence.

    python -m flashcourse.bench_ring [--t 32768] [--world-size 2] [--repeats 5]

Prints a markdown table: milliseconds per ring call (the slowest rank's median over `repeats` calls,
after one warm-up), milliseconds per ring step (call / P), tokens per second, for both layouts; then
torch's scaled_dot_product_attention on one GPU over the whole sequence, and the largest difference of
the unsharded ring output from SDPA's. The ring's per-step attention is 07's shard_attention, which
materialises each step's [T/P, T/P] float32 scores: this measures the course's ring as written, not a
fused kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from . import distributed, ring_checks
from .engine import ring_attention as ring

B, HQ, HKV, D = 1, 16, 4, 128
DTYPE = torch.bfloat16


def inputs(length: int, seed: int = 0):
    """q [B, Hq, T, D], k and v [B, Hkv, T, D] in bf16 on the CPU, seeded."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, length, D, generator=gen).to(DTYPE) for h in (HQ, HKV, HKV))


def timed_ring(rank: int, world_size: int, *, length: int, repeats: int) -> dict:
    """On one rank, for each layout: (median ms per call, this rank's output shard on the CPU)."""
    import torch.distributed as dist

    timings = {}
    for layout in ring_checks.LAYOUTS:
        q, k, v = (ring_checks.shard(x, rank, world_size, layout).cuda() for x in inputs(length))
        out = ring.ring_attention(q, k, v, layout=layout)                   # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = ring.ring_attention(q, k, v, layout=layout)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        timings[layout] = (statistics.median(times), out.cpu())
        del q, k, v, out
        torch.cuda.empty_cache()
    return timings


def sdpa_ms(length: int, repeats: int):
    """(median ms, output) of SDPA, causal, on GPU 0 over the whole sequence (K and V repeated to Hq heads)."""
    q, k, v = (x.cuda() for x in inputs(length))
    k, v = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
    attend = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    out = attend()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = attend()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), out.float().cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, default=32768)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    length, world_size = args.t, args.world_size
    print(f"B = {B}, Hq = {HQ}, Hkv = {HKV}, D = {D}, T = {length}, {DTYPE}, causal; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}\n")
    print("| what | ms per call | ms per step | tokens/s | max abs diff from SDPA |")
    print("|---|---|---|---|---|")
    answers = distributed.run(partial(timed_ring, length=length, repeats=args.repeats), world_size,
                              backend="nccl", timeout_s=400)
    reference_ms, reference_out = sdpa_ms(length, args.repeats)
    for layout in ring_checks.LAYOUTS:
        ms = max(answer[layout][0] for answer in answers)                  # the ring waits for its slowest rank
        shards = [answer[layout][1] for answer in answers]
        diff = (ring_checks.unshard(shards, layout).float() - reference_out).abs().max().item()
        print(f"| ring, {world_size} GPUs, {layout} | {ms:.1f} | {ms / world_size:.1f} | {length / ms * 1e3:,.0f} "
              f"| {diff:.3g} |")
    print(f"| SDPA, 1 GPU, whole sequence | {reference_ms:.2f} | | {length / reference_ms * 1e3:,.0f} | 0 |")


if __name__ == "__main__":
    main()
