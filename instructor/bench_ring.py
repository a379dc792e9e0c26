"""07's ring attention on P GPUs (NCCL) against one GPU and against PyTorch's own context parallel.

    python -m instructor.bench_ring [--t 32768 65536 131072 262144] [--world-size 2] [--repeats 3] [--out FILE]

bf16, causal, B = 1, Hq = 32, Hkv = 8, D = 128. For each T, every rank runs the same list on its own
GPU, all from one process group:

- one GPU, whole sequence: the course's kernel (08's attention_lse, the ring's step: the Gluon kernel on a
  Hopper GPU, 05's fast_attention_lse elsewhere), and
  torch's scaled_dot_product_attention with its cuDNN and FlashAttention-2 backends;
- the ring (07's ring_attention, its step on that kernel) in both layouts, overlapped (the next
  shard's transfer runs while this step computes) and not (`transfers_waited_at_once`: each transfer
  finished before the step computes);
- torch.distributed.tensor.experimental.context_parallel over SDPA (cuDNN and flash backends).

SDPA and context_parallel get K and V repeated to Hq heads (SDPA's backends take equal head counts), so
they attend the same keys; the ring and the course's kernel read the Hkv heads as they are. Times are
the median over `repeats` calls after one warm-up, the slowest rank's for P GPUs. TFLOP/s per GPU counts
the visible half of the causal scores, 2 * B * Hq * T^2 * D for QK^T and PV together, divided by the
GPUs. "max abs diff" is the largest difference from the course's kernel on one GPU, after unsharding.
With --out the report is written there as markdown; it is printed either way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager, nullcontext
from functools import partial

import torch

from flashcourse import distributed
from flashcourse.checks import ring_attention as ring_checks

B, HQ, HKV, D = 1, 32, 8, 128
DTYPE = torch.bfloat16
LENGTHS = (32768, 65536, 131072, 262144)
SDPA_BACKENDS = ("cuDNN", "flash")


def inputs(length: int, seed: int = 0):
    """q [B, Hq, T, D], k and v [B, Hkv, T, D] in bf16 on this rank's GPU, the same on every rank."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(B, h, length, D, generator=gen, device="cuda", dtype=DTYPE) for h in (HQ, HKV, HKV))


def causal_flops(length: int) -> float:
    """FLOP of causal attention over the whole sequence: QK^T and PV over the visible half of the scores."""
    return 2.0 * B * HQ * length * length * D


@contextmanager
def transfers_waited_at_once():
    """Inside: dist.batch_isend_irecv waits for its transfers before it returns, so the ring's step
    computes only once the next shard has arrived (the ring without overlap)."""
    import torch.distributed as dist

    started = dist.batch_isend_irecv

    def waited(ops):
        requests = started(ops)
        for request in requests:
            request.wait()
        return requests

    dist.batch_isend_irecv = waited
    try:
        yield
    finally:
        dist.batch_isend_irecv = started


def timed(fn, repeats: int) -> tuple[float, object]:
    """(median ms over repeats, the last result) of fn() after one warm-up call, every rank starting together."""
    import torch.distributed as dist

    out = fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), out


def attempt(results: dict, key: tuple, rank: int, fn) -> None:
    """results[key] = fn(), which gives (ms, max abs diff); (nan, nan) when it raises, with the error printed,
    so one failing row (a backend that refuses a shape) leaves the others. Each row is printed as it comes."""
    try:
        results[key] = fn()
    except Exception as error:  # noqa: BLE001  (reported, and the row reads nan)
        results[key] = (float("nan"), float("nan"))
        print(f"rank {rank}, T = {key[0]}, {key[1]}: {type(error).__name__}: {str(error)[:300]}", flush=True)
    print(f"rank {rank}, T = {key[0]}, {key[1]}: {results[key][0]:.2f} ms, max abs diff {results[key][1]:.3g}", flush=True)


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item()


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"cuDNN": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name]


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # looked up at call time


def measure(rank: int, world_size: int, *, lengths, repeats: int) -> dict:
    """On one rank: {(T, what): (ms, max abs diff)} for every T and every row of the report."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import sdpa_kernel

    from flashcourse.engine.any_input import attention_lse
    from flashcourse.engine import ring_attention as ring

    mesh = init_device_mesh("cuda", (world_size,))
    results = {}
    for length in lengths:
        q, k, v = inputs(length)
        ms, (reference, _) = timed(lambda: attention_lse(q, k, v, causal=True), repeats)
        attempt(results, (length, "course kernel, 1 GPU"), rank, lambda: (ms, 0.0))
        k_rep, v_rep = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k, v))   # [B, Hq, T, D]

        def one_gpu(name):
            with sdpa_kernel(_sdpa_backend(name)):
                ms, out = timed(lambda: _sdpa(q, k_rep, v_rep), repeats)
            return ms, _max_diff(out, reference)

        def ring_row(layout, overlapped):
            shards = [ring_checks.shard(x, rank, world_size, layout) for x in (q, k, v)]
            with nullcontext() if overlapped else transfers_waited_at_once():
                ms, out = timed(lambda: ring.ring_attention(*shards, layout=layout), repeats)
            return ms, _max_diff(out, ring_checks.shard(reference, rank, world_size, layout))

        def context_parallel_row(name):
            buffers = [q.clone(), k_rep.clone(), v_rep.clone()]
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]), sdpa_kernel(_sdpa_backend(name)):
                ms, out = timed(lambda: _sdpa(*buffers), repeats)
                whole = context_parallel_unshard(mesh, [out], [2])[0]
            return ms, _max_diff(whole, reference)

        for name in SDPA_BACKENDS:
            attempt(results, (length, f"SDPA {name}, 1 GPU"), rank, partial(one_gpu, name))
        for layout in ring_checks.LAYOUTS:
            for overlapped in (True, False):
                what = f"ring, {layout}, {'overlapped' if overlapped else 'not overlapped'}"
                attempt(results, (length, what), rank, partial(ring_row, layout, overlapped))
        for name in SDPA_BACKENDS:
            attempt(results, (length, f"context_parallel, SDPA {name}"), rank, partial(context_parallel_row, name))
        del q, k, v, k_rep, v_rep, reference
        torch.cuda.empty_cache()
        dist.barrier()
    return {"results": results,
            "versions": f"torch {torch.__version__}, triton {__import__('triton').__version__}, "
                        f"{torch.cuda.get_device_name(rank)}"}


ROWS = ("course kernel, 1 GPU", "SDPA cuDNN, 1 GPU", "SDPA flash, 1 GPU",
        "ring, zigzag, overlapped", "ring, zigzag, not overlapped",
        "ring, contiguous, overlapped", "ring, contiguous, not overlapped",
        "context_parallel, SDPA cuDNN", "context_parallel, SDPA flash")


def gpus(what: str, world_size: int) -> int:
    return 1 if what.endswith("1 GPU") else world_size


def report(answers: list, lengths, world_size: int, repeats: int) -> str:
    """The markdown report: one table of every row, then the headline per T."""
    ms = {key: max(a["results"][key][0] for a in answers) for key in answers[0]["results"]}   # the slowest rank
    diff = {key: max(a["results"][key][1] for a in answers) for key in answers[0]["results"]}
    lines = [f"# Ring attention on {world_size} GPUs (07), against one GPU and PyTorch's context parallel", "",
             f"`python -m instructor.bench_ring --t {' '.join(map(str, lengths))} --world-size {world_size} "
             f"--repeats {repeats}`; {answers[0]['versions']} x {world_size}, NCCL.", "",
             f"bf16, causal, B = {B}, Hq = {HQ}, Hkv = {HKV}, D = {D}. Median of {repeats} calls after a warm-up, the "
             "slowest rank's. TFLOP/s per GPU: 2 * B * Hq * T^2 * D / time / GPUs. Speed-up: the course's kernel on "
             "one GPU over this row. Max abs diff: from the course's kernel on one GPU, after unsharding.", "",
             "| T | what | GPUs | ms | TFLOP/s per GPU | speed-up over 1 GPU | max abs diff |",
             "|---|---|---|---|---|---|---|"]
    for length in lengths:
        single = ms[length, ROWS[0]]
        for what in ROWS:
            n = gpus(what, world_size)
            t = ms[length, what]
            lines.append(f"| {length} | {what} | {n} | {t:.2f} | {causal_flops(length) / n / t / 1e9:.0f} | "
                         f"{single / t:.2f} | {diff[length, what]:.3g} |")
    lines += ["", "Headline: the zigzag ring, overlapped, against one GPU and against the faster context_parallel.", "",
              "| T | course kernel, 1 GPU, ms | ring, ms | ring speed-up | context_parallel best, ms | ring / context_parallel speed |",
              "|---|---|---|---|---|---|"]
    for length in lengths:
        ring_ms = ms[length, "ring, zigzag, overlapped"]
        best_cp = min(ms[length, f"context_parallel, SDPA {name}"] for name in SDPA_BACKENDS)
        lines.append(f"| {length} | {ms[length, ROWS[0]]:.2f} | {ring_ms:.2f} | {ms[length, ROWS[0]] / ring_ms:.2f} | "
                     f"{best_cp:.2f} | {best_cp / ring_ms:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the markdown report to this file")
    args = parser.parse_args()
    answers = distributed.run(partial(measure, lengths=args.t, repeats=args.repeats), args.world_size,
                              backend="nccl", timeout_s=580)
    text = report(answers, args.t, args.world_size, args.repeats)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)


if __name__ == "__main__":
    main()
