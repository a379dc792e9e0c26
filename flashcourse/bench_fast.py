"""The fast kernel of assignment 05 against 04's kernel and torch's SDPA backends, on a CUDA GPU.

    python -m flashcourse.bench_fast --out benchmarks/results/DATE-GPU-fast.md \
        --json flashcourse/measured/fast.json --png flashcourse/measured/fast.png   (what 05 shows on a CPU)

Three measurements, every number from one process:

- steps: bf16 causal attention, D = 128, T = 8192, B = 4, H = 32, one step of assignment 05 at a
  time (04's kernel, then exp2, the diagonal split, tensor descriptors, autotuned blocks);
- prefill: fast_attention (autotuned), 04's flash_attention (its best blocks, causal only), SDPA's
  flash and cuDNN backends, TFLOP/s and the ratio to cuDNN, max |error| against an FP32 reference;
- decode: fast_decode against SDPA's backends and 04's kernel, in TB/s of K and V read, next to a
  plain device copy (torch's copy_, bytes read plus bytes written over time).

Prefill times are triton.testing.do_bench (L2 flushed before every run). TFLOP/s: 2 B Hq T^2 D
causal, 4 B Hq T^2 D not causal (the FlashAttention papers' convention). The prefill grid is
TOKENS = B x T fixed, so every length does enough work.

A decode call is tens of microseconds of GPU work, less than Python takes to launch a Triton kernel,
so a plain timing loop measures the launcher. Every decode implementation is therefore timed the way
serving engines run decode: captured in one CUDA graph that calls it on several copies of the cache in
turn (together more than the L2 holds, so every read comes from memory), replayed, the time divided
by the number of calls. fast_decode's plain (eager) time is reported beside it.
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch

from flashcourse.bench import GPU_NEEDED, environment

TOKENS = 4 * 8192               # B * T held fixed
PREFILL = [  # (dtype, causal, D, Hq, Hkv, lengths)
    ("bf16", True, 128, 32, 32, (1024, 2048, 4096, 8192, 16384)),
    ("bf16", False, 128, 32, 32, (1024, 2048, 4096, 8192, 16384)),
    ("bf16", True, 64, 32, 32, (1024, 2048, 4096, 8192, 16384)),
    ("bf16", False, 64, 32, 32, (1024, 4096, 16384)),
    ("bf16", True, 128, 32, 8, (1024, 4096, 16384)),
    ("fp16", True, 128, 32, 32, (1024, 4096, 8192, 16384)),
    ("fp16", False, 128, 32, 32, (4096, 16384)),
]
DECODE = [(b, s) for b in (1, 8) for s in (8192, 16384, 32768, 65536, 131072)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
L2_FLUSH_BYTES = 240e6           # four times the H200's 60 MB of L2


def _ms(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def _or_nan(measure, what) -> float:
    """measure(what) in milliseconds, NaN when an implementation refuses the shape (or a graph capture)."""
    try:
        return measure(what)
    except (RuntimeError, ValueError) as error:
        print(f"    skipped: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
        return math.nan


def _sdpa(backend, causal: bool, gqa: bool):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run(q, k, v):
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return run


def _graph_ms(calls, replays: int = 20) -> float:
    """Milliseconds per call: `calls` captured once in a CUDA graph, replayed `replays` times."""
    for call in calls:                    # compile and autotune outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays / len(calls)


def _inputs(batch, q_heads, kv_heads, t, s, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, q_heads, t, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, kv_heads, s, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, kv_heads, s, d, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


def max_error(out, q, k, v, causal: bool, heads: int = 2) -> float:
    """max |out - reference| over batch 0 and the first `heads` query heads, the reference in FP32."""
    group = q.shape[1] // k.shape[1]
    q32 = q[:1, :heads].float()
    k32 = k[:1].float().repeat_interleave(group, 1)[:, :heads]
    v32 = v[:1].float().repeat_interleave(group, 1)[:, :heads]
    scores = q32 @ k32.transpose(-2, -1) / math.sqrt(q.shape[-1])          # [1, heads, T, S]
    if causal:
        t, s = scores.shape[-2:]
        hidden = torch.arange(s, device="cuda")[None, :] > torch.arange(t, device="cuda")[:, None] + (s - t)
        scores = scores.masked_fill(hidden, float("-inf"))
    want = torch.softmax(scores, -1) @ v32
    return float((out[:1, :heads].float() - want).abs().max())


def steps() -> list[dict]:
    """Each step of assignment 05 at bf16 causal D=128 T=8192 B=4 H=32 (TFLOP/s)."""
    from flashcourse.engine.fast_kernel import fast_attention
    from flashcourse.engine.triton_flash import flash_attention

    q, k, v = _inputs(4, 32, 32, 8192, 8192, 128, torch.bfloat16)
    flops = 2.0 * 4 * 32 * 8192**2 * 128
    fixed = dict(block_m=64, block_n=64, num_warps=4, num_stages=3)   # 04's best configuration
    variants = [
        ("04 flash_attention, 64x64 w4 s3", lambda: flash_attention(q, k, v, **fixed)),
        ("fast kernel, exp, one masked loop", lambda: fast_attention(q, k, v, exp2=False, split_diagonal=False,
                                                                     tma=False, **fixed)),
        ("+ exp2, log2(e) in the scale", lambda: fast_attention(q, k, v, split_diagonal=False, tma=False, **fixed)),
        ("+ diagonal split", lambda: fast_attention(q, k, v, tma=False, **fixed)),
        ("+ tensor descriptors (TMA)", lambda: fast_attention(q, k, v, **fixed)),
        ("+ autotuned blocks, warps, stages", lambda: fast_attention(q, k, v)),
    ]
    rows = []
    for name, fn in variants:
        ms = _or_nan(_ms, fn)
        rows.append(dict(step=name, ms=ms, tflops=flops / ms / 1e9))
        print(f"  {name:40s} {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    return rows


def prefill(grid=PREFILL, rows=None, done=lambda: None) -> list[dict]:
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.fast_kernel import fast_attention, fast_fwd_tuned
    from flashcourse.engine.triton_flash import flash_attention

    rows = [] if rows is None else rows   # filled in place; done() after each row lets the caller save it
    for dtype_name, causal, d, q_heads, kv_heads, lengths in grid:
        dtype, gqa = DTYPES[dtype_name], q_heads != kv_heads
        for t in lengths:
            batch = max(1, TOKENS // t)
            q, k, v = _inputs(batch, q_heads, kv_heads, t, t, d, dtype)
            flops = (2.0 if causal else 4.0) * batch * q_heads * t * t * d
            impls = {
                "fast_attention": lambda: fast_attention(q, k, v, causal=causal),
                "SDPA flash": lambda: _sdpa(SDPBackend.FLASH_ATTENTION, causal, gqa)(q, k, v),
                "SDPA cuDNN": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, causal, gqa)(q, k, v),
            }
            if causal:
                impls["04 flash_attention"] = lambda: flash_attention(q, k, v, block_m=64, block_n=64, num_warps=4,
                                                                      num_stages=3)
            row = dict(dtype=dtype_name, causal=causal, d=d, q_heads=q_heads, kv_heads=kv_heads, t=t, batch=batch)
            for name, fn in impls.items():
                ms = _or_nan(_ms, fn)
                row[name] = flops / ms / 1e9
                row[f"{name} error"] = max_error(fn(), q, k, v, causal) if ms == ms else math.nan
            row["fast config"] = str(fast_fwd_tuned.best_config)
            rows.append(row)
            done()
            print(f"  {dtype_name} {'causal' if causal else 'full  '} D={d} H={q_heads}/{kv_heads} T={t:5d} B={batch:2d}: "
                  + ", ".join(f"{n} {row[n]:.0f}" for n in impls) + f"  [{row['fast config']}]", flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def copy_bandwidth(gib: float = 4.0) -> float:
    """TB/s of a plain device-to-device copy, counting the bytes read and the bytes written."""
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _ms(lambda: y.copy_(x))
    del x, y
    return 2 * gib * 2**30 / ms / 1e9


def decode(grid=DECODE, q_heads=32, kv_heads=8, d=128, rows=None, done=lambda: None) -> list[dict]:
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.fast_kernel import fast_decode
    from flashcourse.engine.triton_flash import flash_attention

    rows = [] if rows is None else rows
    for batch, s in grid:
        kv_bytes = 2 * batch * kv_heads * s * d * 2                        # K and V in bf16
        copies = max(2, math.ceil(L2_FLUSH_BYTES / kv_bytes))               # calls per graph: together past the L2
        caches = [_inputs(batch, q_heads, kv_heads, 1, s, d, torch.bfloat16, seed=i) for i in range(copies)]
        impls = {"fast_decode": fast_decode,
                 "04 flash_attention": functools.partial(flash_attention, block_m=16, block_n=64)}
        for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
                              ("SDPA efficient", SDPBackend.EFFICIENT_ATTENTION)):
            impls[name] = _sdpa(backend, False, True)
        row = dict(batch=batch, s=s, copies=copies)
        q, k, v = caches[0]
        for name, fn in impls.items():
            ms = _or_nan(_graph_ms, [functools.partial(fn, *cache) for cache in caches])
            row[name] = kv_bytes / ms / 1e9
            row[f"{name} error"] = max_error(fn(q, k, v), q, k, v, False) if ms == ms else math.nan
        row["fast_decode eager"] = kv_bytes / _ms(lambda: fast_decode(q, k, v)) / 1e9
        rows.append(row)
        done()
        print(f"  decode B={batch} S={s:6d}: " + ", ".join(f"{n} {row[n]:.2f}" for n in impls) +
              f" TB/s (fast_decode eager {row['fast_decode eager']:.2f})", flush=True)
        del caches, q, k, v
        torch.cuda.empty_cache()
    return rows


def _best_sdpa(row: dict) -> float:
    """The fastest SDPA backend that ran at this decode shape."""
    return max(row[n] for n in ("SDPA flash", "SDPA cuDNN", "SDPA efficient") if not math.isnan(row.get(n, math.nan)))


def report(result: dict) -> str:
    """The measurements as markdown tables."""
    lines = ["# The fast kernel (assignment 05) against 04's kernel and SDPA", "",
             f"Measured {result['environment']}.", "",
             "Prefill times by triton.testing.do_bench (L2 flushed before each run); decode times per call of a "
             "replayed CUDA graph that reads several copies of the cache in turn (eager: do_bench of plain calls); "
             "every number from one process. TFLOP/s = 2 B Hq T^2 D / time causal, 4 B Hq T^2 D not causal. Errors: max |out - reference| over "
             "batch 0, heads 0-1, the reference in FP32.", "",
             "## Step by step: bf16, causal, D = 128, T = 8192, B = 4, H = 32", "",
             "| step | TFLOP/s | ms |", "|---|---|---|"]
    lines += [f"| {r['step']} | {r['tflops']:.1f} | {r['ms']:.3f} |" for r in result["steps"]]
    names = ["fast_attention", "04 flash_attention", "SDPA flash", "SDPA cuDNN"]
    lines += ["", "## Prefill (TFLOP/s; T = S; B x T = %d)" % TOKENS, "",
              "| dtype | causal | D | Hq/Hkv | T | B | " + " | ".join(names) +
              " | fast / cuDNN | fast / SDPA flash | fast error | cuDNN error | fast config |",
              "|---" * (6 + len(names) + 5) + "|"]
    for r in result["prefill"]:
        cells = [f"{r.get(n, math.nan):.1f}" for n in names]
        lines.append(f"| {r['dtype']} | {'yes' if r['causal'] else 'no'} | {r['d']} | {r['q_heads']}/{r['kv_heads']} | "
                     f"{r['t']} | {r['batch']} | " + " | ".join(cells) +
                     f" | {r['fast_attention'] / r['SDPA cuDNN']:.2f} | {r['fast_attention'] / r['SDPA flash']:.2f} | "
                     f"{r['fast_attention error']:.1e} | {r['SDPA cuDNN error']:.1e} | {r['fast config']} |")
    dnames = ["fast_decode", "04 flash_attention", "SDPA flash", "SDPA cuDNN", "SDPA efficient", "fast_decode eager"]
    copy = result["copy_tbs"]
    lines += ["", f"## Decode (TB/s of K and V read): bf16, Hq = 32, Hkv = 8, D = 128, T = 1; plain copy {copy:.2f} TB/s", "",
              "| B | S | " + " | ".join(dnames) + " | fast / copy | fast / best SDPA | fast error |",
              "|---" * (2 + len(dnames) + 3) + "|"]
    for r in result["decode"]:
        lines.append(f"| {r['batch']} | {r['s']} | " + " | ".join(f"{r.get(n, math.nan):.2f}" for n in dnames) +
                     f" | {r['fast_decode'] / copy:.0%} | {r['fast_decode'] / _best_sdpa(r):.2f} | {r['fast_decode error']:.1e} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str):
    """Three panels: the steps, prefill TFLOP/s against T (bf16 causal D=128), decode TB/s against S (B=1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_steps, ax_prefill, ax_decode) = plt.subplots(1, 3, figsize=(18, 4.8))
    st = result["steps"]
    ax_steps.barh([r["step"] for r in st][::-1], [r["tflops"] for r in st][::-1], color="tab:blue")
    ax_steps.set_xlabel("TFLOP/s")
    ax_steps.set_title("steps: bf16 causal, D=128, T=8192, B=4, H=32")
    rows = [r for r in result["prefill"] if r["dtype"] == "bf16" and r["causal"] and r["d"] == 128
            and r["q_heads"] == r["kv_heads"]]
    for name in ("fast_attention", "04 flash_attention", "SDPA flash", "SDPA cuDNN"):
        ax_prefill.plot([r["t"] for r in rows], [r[name] for r in rows], "o-", label=name)
    ax_prefill.set_xscale("log", base=2)
    ax_prefill.set_xlabel("T = S")
    ax_prefill.set_ylabel("TFLOP/s")
    ax_prefill.set_title("prefill: bf16 causal, D=128, H=32")
    ax_prefill.legend()
    rows = [r for r in result["decode"] if r["batch"] == 1]
    for name in ("fast_decode", "fast_decode eager", "SDPA flash", "SDPA cuDNN", "SDPA efficient", "04 flash_attention"):
        ax_decode.plot([r["s"] for r in rows], [r.get(name, math.nan) for r in rows], "o:" if "eager" in name else "o-", label=name)
    ax_decode.axhline(result["copy_tbs"], color="gray", ls="--", label="device copy")
    ax_decode.set_xscale("log", base=2)
    ax_decode.set_xlabel("S (keys)")
    ax_decode.set_ylabel("TB/s of K and V read")
    ax_decode.set_title("decode: B=1, Hq=32, Hkv=8, D=128, bf16")
    ax_decode.legend()
    fig.suptitle(result["environment"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the markdown report to this file")
    parser.add_argument("--json", help="write the measurements as JSON to this file (after every row)")
    parser.add_argument("--png", help="write the plot to this file")
    parser.add_argument("--small", action="store_true", help="a small grid: T = 1k, 8k; S = 32k, 128k")
    parser.add_argument("--from-json", help="measure nothing: write the report and plot of this earlier --json")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
    elif not torch.cuda.is_available():
        print(GPU_NEEDED)
        return 1
    else:
        grid, decode_grid = PREFILL, DECODE
        if args.small:
            grid = [(dt, c, d, hq, hkv, tuple(t for t in ts if t in (1024, 8192)) or ts[:1])
                    for dt, c, d, hq, hkv, ts in PREFILL]
            decode_grid = [(b, s) for b, s in DECODE if s in (32768, 131072)]
        result = {"environment": environment(), "steps": [], "copy_tbs": math.nan, "decode": [], "prefill": []}

        def save():
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
        print("steps", flush=True)
        result["steps"] = steps()
        save()
        print("decode", flush=True)
        result["copy_tbs"] = copy_bandwidth()
        decode(decode_grid, rows=result["decode"], done=save)
        print("prefill", flush=True)
        prefill(grid, rows=result["prefill"], done=save)
    text = report(result)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.png:
        plot(result, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
