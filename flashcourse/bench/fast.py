"""The fast kernel of assignment 05 against 04's kernel and torch's SDPA backends, on a CUDA GPU.

    python -m flashcourse.bench.fast --out benchmarks/results/DATE-GPU-fast.md \
        --json flashcourse/bench/measured/fast.json --png flashcourse/bench/measured/fast.png   (what 05 shows on a CPU)

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

import functools
import json
import math
import re
import statistics

import torch

from flashcourse.bench import GPU_NEEDED, environment
from flashcourse.bench.reports import (grouped_bars, label_panel, report_main, report_opening, report_parser, save_json,
                                      show_report)

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
    """measure(what) in milliseconds, NaN when an implementation refuses the shape (or a graph capture) or fails
    to compile, so that one failure costs its cell of the table, not the run."""
    try:
        return measure(what)
    except Exception as error:  # noqa: BLE001  (reported on the next line and in the table as NaN)
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
    return float((out[:1, :heads].float() - reference_fp32(q, k, v, causal, heads)).abs().max())


def rms_error(out, q, k, v, causal: bool, heads: int = 2) -> float:
    """The root mean square of out - reference over batch 0 and the first `heads` query heads (FP32)."""
    return float((out[:1, :heads].float() - reference_fp32(q, k, v, causal, heads)).pow(2).mean().sqrt())


def reference_fp32(q, k, v, causal: bool, heads: int = 2):
    """Attention of batch 0's first `heads` query heads in FP32, keys at 0 .. S-1, query i at S - T + i."""
    group = q.shape[1] // k.shape[1]
    v32 = v[:1].float().repeat_interleave(group, 1)[:, :heads]
    return torch.softmax(reference_scores(q, k, causal, heads), -1) @ v32  # [1, heads, T, D]


def reference_scores(q, k, causal: bool, heads: int = 2):
    """reference_fp32's scaled scores [1, heads, T, S] in FP32, -inf where causal hides a key."""
    group = q.shape[1] // k.shape[1]
    q32 = q[:1, :heads].float()
    k32 = k[:1].float().repeat_interleave(group, 1)[:, :heads]
    scores = q32 @ k32.transpose(-2, -1) / math.sqrt(q.shape[-1])          # [1, heads, T, S]
    if causal:
        t, s = scores.shape[-2:]
        hidden = torch.arange(s, device=q.device)[None, :] > torch.arange(t, device=q.device)[:, None] + (s - t)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def steps() -> list[dict]:
    """Each step of assignment 05 at bf16 causal D=128 T=8192 B=4 H=32 (TFLOP/s)."""
    from flashcourse.engine.fast_attention import fast_attention
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

    from flashcourse.engine.fast_attention import fast_attention, fast_fwd_tuned
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

    from flashcourse.engine.decode import fast_decode
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
    lines = report_opening(
        "# The fast kernel (assignment 05) against 04's kernel and SDPA", result["environment"],
        "Prefill times by triton.testing.do_bench (L2 flushed before each run); decode times per call of a "
        "replayed CUDA graph that reads several copies of the cache in turn (eager: do_bench of plain calls); "
        "every number from one process. TFLOP/s = 2 B Hq T^2 D / time causal, 4 B Hq T^2 D not causal. Errors: max |out - reference| over "
        "batch 0, heads 0-1, the reference in FP32.",
        "## Step by step: bf16, causal, D = 128, T = 8192, B = 4, H = 32")
    lines += ["| step | TFLOP/s | ms |", "|---|---|---|"]
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
    label_panel(ax_prefill, "T = S", "TFLOP/s", "prefill: bf16 causal, D=128, H=32")
    rows = [r for r in result["decode"] if r["batch"] == 1]
    for name in ("fast_decode", "fast_decode eager", "SDPA flash", "SDPA cuDNN", "SDPA efficient", "04 flash_attention"):
        ax_decode.plot([r["s"] for r in rows], [r.get(name, math.nan) for r in rows], "o:" if "eager" in name else "o-", label=name)
    ax_decode.axhline(result["copy_tbs"], color="gray", ls="--", label="device copy")
    label_panel(ax_decode, "S (keys)", "TB/s of K and V read", "decode: B=1, Hq=32, Hkv=8, D=128, bf16")
    fig.suptitle(result["environment"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


# --- the last gap to cuDNN: causal shapes only, the longest-first variants and the FP8 forward ----------

LAST_GAP = [(dt, d, hq, hkv, ts) for dt, causal, d, hq, hkv, ts in PREFILL if causal]
LAST_GAP_NAMES = ["fast_attention", "LPT order", "persistent LPT", "SDPA cuDNN", "SDPA flash", "FP8", "FP8 + quantize"]
MAX_SLOTS_PER_SM = {64: 2, 128: 1}   # programs of a BLOCK_M that run at once on one multiprocessor (lpt_programs)


def tail(t: int, batch: int, heads: int, block_m: int, block_n: int, processors: int = 132) -> dict:
    """How evenly a causal grid (T = S) ends: ideal time over simulated time, for three orders of its items.

    An item, (query block, batch x head), costs its number of key tiles. The hardware starts items in
    launch order on the first free slot (processors x programs per processor); the persistent kernel
    deals them round-robin to a fixed set of programs. 1.0 is a grid that ends with every slot busy.
    """
    import heapq

    blocks = math.ceil(t / block_m)
    cost = [math.ceil(min((i + 1) * block_m, t) / block_n) for i in range(blocks)]        # tiles per query block
    slots = processors * MAX_SLOTS_PER_SM[block_m]
    fast = [cost[i] for _ in range(batch * heads) for i in reversed(range(blocks))]    # per head, longest first
    lpt = [cost[i] for i in reversed(range(blocks)) for _ in range(batch * heads)]     # all heads' longest first

    def dispatched(items):
        free = [0] * slots
        for c in items:
            heapq.heappush(free, heapq.heappop(free) + c)
        return max(free)

    dealt = max(sum(lpt[p::slots]) for p in range(min(slots, len(lpt))))
    ideal = sum(lpt) / slots
    return {"t": t, "batch": batch, "block_m": block_m, "block_n": block_n, "slots": slots, "items": len(lpt),
            "fast order": ideal / dispatched(fast), "LPT order": ideal / dispatched(lpt), "persistent LPT": ideal / dealt}


def last_gap(grid=LAST_GAP, rows=None, done=lambda: None) -> list[dict]:
    """TFLOP/s of the fast kernel, its longest-first variants, cuDNN, FlashAttention-2 and FP8 (causal, T = S)."""
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.fast_attention import fast_attention, fast_fwd_tuned
    from flashcourse.engine.fp8 import fp8_forward, fp8_fwd_tuned, prepare_fp8
    from flashcourse.engine.longest_first import lpt_attention, lpt_fwd_tuned

    rows = [] if rows is None else rows
    for dtype_name, d, q_heads, kv_heads, lengths in grid:
        dtype, gqa = DTYPES[dtype_name], q_heads != kv_heads
        for t in lengths:
            batch = max(1, TOKENS // t)
            q, k, v = _inputs(batch, q_heads, kv_heads, t, t, d, dtype)
            prepared = prepare_fp8(q, k, v)
            flops = 2.0 * batch * q_heads * t * t * d
            impls = {
                "fast_attention": lambda: fast_attention(q, k, v),
                "LPT order": lambda: lpt_attention(q, k, v, persistent=False, head_group=batch * q_heads),
                "persistent LPT": lambda: lpt_attention(q, k, v, head_group=batch * q_heads),
                "SDPA cuDNN": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, True, gqa)(q, k, v),
                "SDPA flash": lambda: _sdpa(SDPBackend.FLASH_ATTENTION, True, gqa)(q, k, v),
                "FP8": lambda: fp8_forward(prepared, out_dtype=dtype),
                "FP8 + quantize": lambda: fp8_forward(prepare_fp8(q, k, v), out_dtype=dtype),
            }
            row = dict(dtype=dtype_name, d=d, q_heads=q_heads, kv_heads=kv_heads, t=t, batch=batch)
            for name, fn in impls.items():
                ms = _or_nan(_ms, fn)
                row[name] = flops / ms / 1e9
                if name != "FP8 + quantize":
                    row[f"{name} error"] = max_error(fn(), q, k, v, True) if ms == ms else math.nan
            row["fast config"] = str(fast_fwd_tuned.best_config)
            row["persistent config"] = str(lpt_fwd_tuned[True].best_config)
            row["FP8 config"] = str(fp8_fwd_tuned.best_config)
            rows.append(row)
            done()
            print(f"  {dtype_name} D={d} H={q_heads}/{kv_heads} T={t:5d} B={batch:2d}: "
                  + ", ".join(f"{n} {row[n]:.0f}" for n in impls), flush=True)
            del q, k, v, prepared
            torch.cuda.empty_cache()
    return rows


LPT_GROUP_NAMES = ["fast_attention", "LPT order", "LPT, L2 groups", "persistent LPT, L2 groups", "SDPA cuDNN"]


def lpt_groups(lengths=(1024, 2048, 4096, 8192, 16384), d=128) -> list[dict]:
    """bf16 causal, H = 32: longest first over the whole grid, and within head groups whose K and V fit in L2."""
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.fast_attention import fast_attention
    from flashcourse.engine.longest_first import l2_head_group, lpt_attention

    rows = []
    for t in lengths:
        batch = max(1, TOKENS // t)
        q, k, v = _inputs(batch, 32, 32, t, t, d, torch.bfloat16)
        flops = 2.0 * batch * 32 * t * t * d
        impls = {"fast_attention": lambda: fast_attention(q, k, v),
                 "LPT order": lambda: lpt_attention(q, k, v, persistent=False, head_group=batch * 32),
                 "LPT, L2 groups": lambda: lpt_attention(q, k, v, persistent=False),
                 "persistent LPT, L2 groups": lambda: lpt_attention(q, k, v),
                 "SDPA cuDNN": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, True, False)(q, k, v)}
        row = dict(t=t, batch=batch, head_group=l2_head_group(k, 32))
        for name, fn in impls.items():
            row[name] = flops / _or_nan(_ms, fn) / 1e9
        row["L2 groups error"] = max_error(impls["LPT, L2 groups"](), q, k, v, True)
        rows.append(row)
        print(f"  T={t:5d} B={batch:2d} group {row['head_group']}: " + ", ".join(f"{n} {row[n]:.0f}" for n in impls),
              flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def lpt_groups_report(result: dict) -> str:
    lines = report_opening("## Longest first within L2-sized head groups (a second process: bf16, causal, D = 128, "
                           "H = 32, TFLOP/s)", result["environment"])
    lines += ["| T | B | heads per group | " + " | ".join(LPT_GROUP_NAMES) + " | L2 groups / fast | L2 groups error |",
              "|---" * (3 + len(LPT_GROUP_NAMES) + 2) + "|"]
    for r in result["lpt_groups"]:
        best = max(r["LPT, L2 groups"], r["persistent LPT, L2 groups"])
        lines.append(f"| {r['t']} | {r['batch']} | {r['head_group']} | " + " | ".join(f"{r[n]:.1f}" for n in LPT_GROUP_NAMES)
                     + f" | {best / r['fast_attention']:.2f} | {r['L2 groups error']:.1e} |")
    return "\n".join(lines) + "\n"


def outlier_inputs(batch, heads, t, d, dtype, seed=0):
    """q, k, v ~ N(0, 1) + N(0, 100) · Bernoulli(0.001): rare large entries, as in FlashAttention-3's FP8 study."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw():
        x = torch.randn(batch, heads, t, d, device="cuda", generator=gen)
        spikes = 10 * torch.randn(x.shape, device="cuda", generator=gen)
        return (x + spikes * (torch.rand(x.shape, device="cuda", generator=gen) < 1e-3)).to(dtype)
    return draw(), draw(), draw()


def fp8_errors(t: int = 4096, heads: int = 4, d: int = 128, causal: bool = True) -> list[dict]:
    """Max and RMS error against FP32 of the bf16 kernel, FP8, and FP8 with Q and K rotated, on two inputs."""
    from flashcourse.engine.fast_attention import fast_attention
    from flashcourse.engine.fp8 import fp8_attention, random_rotation

    rotation = random_rotation(d, seed=0, device="cuda")
    inputs = {"N(0, 1)": _inputs(1, heads, heads, t, t, d, torch.bfloat16),
              "N(0, 1) + outliers": outlier_inputs(1, heads, t, d, torch.bfloat16)}
    methods = {"bf16 fast_attention": lambda q, k, v: fast_attention(q, k, v, causal=causal),
               "FP8": lambda q, k, v: fp8_attention(q, k, v, causal=causal),
               "FP8 + rotation": lambda q, k, v: fp8_attention(q, k, v, causal=causal, rotation=rotation)}
    rows = []
    for input_name, (q, k, v) in inputs.items():
        for method, fn in methods.items():
            out = fn(q, k, v)
            rows.append(dict(inputs=input_name, method=method, max=max_error(out, q, k, v, causal, heads),
                             rms=rms_error(out, q, k, v, causal, heads)))
            print(f"  {input_name:20s} {method:20s} max {rows[-1]['max']:.2e}  rms {rows[-1]['rms']:.2e}", flush=True)
    return rows


# --- FP8 end to end: prepare_fp8 in one Triton pass against its PyTorch path -----------------------------------

FP8_PREPARE = [(True, 4096), (True, 8192), (True, 16384), (False, 8192)]   # (causal, T = S): bf16, D = 128, H = 32
FP8_PREPARE_NAMES = ["SDPA cuDNN", "hopper_attention", "FP8 kernel", "FP8 Gluon kernel", "FP8 Gluon kernel, Q in bf16",
                     "fp8_attention, PyTorch quantize", "fp8_attention"]


def prepare_fp8_torch(q, k, v, rotation=None, block=None):
    """prepare_fp8 as it was before quantize_fp8: quantize_blocks three times in PyTorch, then a transposed, padded
    copy of V. The reference prepare_fp8 must match bit for bit, and its time before."""
    import triton

    from flashcourse.engine.fp8 import FP8, Fp8Inputs, fp8_block, quantize_blocks

    block = fp8_block() if block is None else block
    if rotation is not None:
        q, k = q.float() @ rotation, k.float() @ rotation
    (q8, q_scale), (k8, k_scale), (v8, v_scale) = (quantize_blocks(x, block) for x in (q, k, v))
    s = v.shape[2]
    v_t = torch.zeros(*v.shape[:2], v.shape[3], triton.cdiv(s, 16) * 16, device=v.device, dtype=FP8)
    v_t[..., :s] = v8.transpose(2, 3)
    return Fp8Inputs(q8, q_scale, k8, k_scale, v_t, v_scale, block, rotation is not None)


def fp8_inputs_equal(a, b) -> bool:
    """Whether two Fp8Inputs hold the same bytes and the same scales."""
    return all(torch.equal(getattr(a, f).view(torch.uint8), getattr(b, f).view(torch.uint8)) for f in ("q", "k", "v_t")) \
        and all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("q_scale", "k_scale", "v_scale"))


def fp8_prepare(grid=FP8_PREPARE, d=128, heads=32, rows=None, done=lambda: None, rounds=1) -> list[dict]:
    """prepare_fp8's time (ms) in one Triton pass and in PyTorch, and fp8_attention end to end on bf16 inputs beside
    cuDNN, hopper_attention and the FP8 kernel alone (TFLOP/s, the median of `rounds` rounds), one process;
    B x T = TOKENS."""
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.fp8 import fp8_attention, fp8_forward, hopper_fp8_forward, prepare_fp8, random_rotation
    from flashcourse.engine.hopper import hopper_attention

    rows = [] if rows is None else rows
    rotation = random_rotation(d, seed=0, device="cuda")
    for causal, t in grid:
        batch = max(1, TOKENS // t)
        q, k, v = _inputs(batch, heads, heads, t, t, d, torch.bfloat16)
        prepared = prepare_fp8(q, k, v)                                       # for the Triton kernel
        relabelled = prepare_fp8(q, k, v, relabel=True)                       # for the Gluon kernel
        prepared_kv = prepare_fp8(q, k, v, quantize_q=False, relabel=True)   # Q left for the Gluon kernel's consumers
        row = dict(causal=causal, t=t, batch=batch, d=d, heads=heads,
                   identical=fp8_inputs_equal(prepared, prepare_fp8_torch(q, k, v)),
                   identical_rotated=fp8_inputs_equal(prepare_fp8(q, k, v, rotation), prepare_fp8_torch(q, k, v, rotation)),
                   prepare_torch_ms=_ms(lambda: prepare_fp8_torch(q, k, v)), prepare_ms=_ms(lambda: prepare_fp8(q, k, v)),
                   prepare_kv_ms=_ms(lambda: prepare_fp8(q, k, v, quantize_q=False, relabel=True)))
        flops = (2.0 if causal else 4.0) * batch * heads * t * t * d
        impls = {"SDPA cuDNN": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, causal, False)(q, k, v),
                 "hopper_attention": lambda: hopper_attention(q, k, v, causal=causal, fallback=False),
                 "FP8 kernel": lambda: fp8_forward(prepared, causal=causal, out_dtype=torch.bfloat16),
                 "FP8 Gluon kernel": lambda: hopper_fp8_forward(relabelled, causal=causal),
                 "FP8 Gluon kernel, Q in bf16": lambda: hopper_fp8_forward(prepared_kv, causal=causal),
                 "fp8_attention, PyTorch quantize": lambda: fp8_forward(prepare_fp8_torch(q, k, v), causal=causal,
                                                                        out_dtype=torch.bfloat16),
                 "fp8_attention": lambda: fp8_attention(q, k, v, causal=causal)}
        _time_row(row, impls, flops, rounds=rounds)
        for name, out in (("fp8_attention", fp8_attention(q, k, v, causal=causal)),
                          ("FP8 Gluon kernel", hopper_fp8_forward(relabelled, causal=causal))):
            row[f"{name} error"] = max_error(out, q, k, v, causal)
            row[f"{name} RMS error"] = rms_error(out, q, k, v, causal)
        rows.append(row)
        done()
        print(f"  {'causal' if causal else 'not causal'} T={t:5d} B={batch:2d}: prepare {row['prepare_torch_ms']:.2f} -> "
              f"{row['prepare_ms']:.2f} ms (identical: {row['identical']}, rotated {row['identical_rotated']}); "
              + ", ".join(f"{n} {row[n]:.0f}" for n in impls), flush=True)
        del q, k, v, prepared, relabelled, prepared_kv
        torch.cuda.empty_cache()
    return rows


def fp8_prepare_report(result: dict) -> str:
    """--fp8-prepare's table as markdown (rows saved before Q could be left to the kernel lack its columns)."""
    rows = result["fp8_prepare"]
    kv = all("prepare_kv_ms" in r for r in rows)                        # Q left to the kernel's consumers, timed
    names = [n for n in FP8_PREPARE_NAMES if all(n in r for r in rows)]
    lines = report_opening(
        "# FP8 end to end: prepare_fp8 in one Triton pass", result["environment"],
        "Times by triton.testing.do_bench (L2 flushed before each run), every number from one process. bf16 inputs, "
        f"D = 128, Hq = Hkv = 32, T = S, B x T = {TOKENS}; TFLOP/s = 2 B H T^2 D / time causal, 4 B H T^2 D not "
        "causal. prepare: prepare_fp8 (quantize_fp8, one Triton pass per tensor, Vᵀ written directly) against its "
        "PyTorch path (quantize_blocks three times and a transposed, padded copy of V); identical: the same bytes "
        "and scales, without and with a rotation of Q and K. 'FP8 kernel': fp8_forward (Triton) on inputs already prepared; 'FP8 Gluon "
        "kernel': hopper_fp8_forward on the same; 'fp8_attention': quantize_fp8 and the kernel, from bf16 (the Gluon "
        "kernel where it applies). Error: max |o - reference| of fp8_attention over batch 0, heads 0-1, against FP32."
        + (" 'FP8 Gluon kernel, Q in bf16': hopper_fp8_forward on K and V prepared alone (prepare_fp8's "
           "quantize_q=False, timed as 'prepare K, V'), its consumers quantizing Q, one scale a row, as fp8_attention "
           "does in the Gluon kernel; RMS: the RMS error of fp8_attention and of the Gluon kernel on Q quantized by "
           "prepare_fp8." if kv else "")
        + _rounds_sentence(rows))
    lines += ["| causal | T | B | prepare, PyTorch (ms) | prepare, Triton (ms) | speed-up | identical | "
              + ("prepare K, V (ms) | " if kv else "") + " | ".join(names)
              + " | fp8_attention / hopper | fp8_attention / cuDNN | FP8 error |"
              + (" RMS, fp8_attention | RMS, Q by prepare_fp8 |" if kv else ""),
              "|---" * (7 + kv + len(names) + 3 + 2 * kv) + "|"]
    for r in rows:
        lines.append(f"| {'yes' if r['causal'] else 'no'} | {r['t']} | {r['batch']} | {r['prepare_torch_ms']:.2f} | "
                     f"{r['prepare_ms']:.2f} | {r['prepare_torch_ms'] / r['prepare_ms']:.1f} | "
                     f"{'yes' if r['identical'] and r['identical_rotated'] else 'no'} | "
                     + (f"{r['prepare_kv_ms']:.2f} | " if kv else "")
                     + " | ".join(f"{r[n]:.1f}" for n in names)
                     + f" | {r['fp8_attention'] / r['hopper_attention']:.2f} | {r['fp8_attention'] / r['SDPA cuDNN']:.2f}"
                     f" | {r['fp8_attention error']:.1e} |"
                     + (f" {r['fp8_attention RMS error']:.2e} | {r['FP8 Gluon kernel RMS error']:.2e} |" if kv else ""))
    return "\n".join(lines) + "\n"


FP8_SCHEDULE = [(True, 4096), (True, 8192), (True, 16384), (False, 2048), (False, 8192)]   # (causal, T = S)
FP8_SCHEDULE_STEPS = {  # hopper_fp8_forward's keywords, each column adding one change to the one before
    "FP8, step 5's choice": "step 5",
    "+ persistent": dict(persistent=True, overlap=False, tma_store=False),
    "+ overlap": dict(persistent=True, overlap=True, tma_store=False),
    "+ o by TMA": dict(persistent=True, overlap=True, tma_store=True),
}
FP8_SCHEDULE_NAMES = ["SDPA cuDNN", "hopper_attention", *FP8_SCHEDULE_STEPS]   # --fp8-schedule's columns


def fp8_schedule(grid=FP8_SCHEDULE, d=128, heads=32, rows=None, done=lambda: None, rounds=3) -> list[dict]:
    """hopper_fp8_forward on prepared inputs with step 5's choice of persistent programs (the overlap and o by TMA
    off), then persistent, the overlap and o by TMA added one at a time (the last is its default), beside
    hopper_attention in bf16 and SDPA cuDNN: TFLOP/s, the median of `rounds` rounds; whether each gave the first's o
    bit for bit."""
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.fp8 import hopper_fp8_forward, prepare_fp8
    from flashcourse.engine.hopper import hopper_attention, hopper_schedule

    rows = [] if rows is None else rows
    for causal, t in grid:
        batch = max(1, TOKENS // t)
        q, k, v = _inputs(batch, heads, heads, t, t, d, torch.bfloat16)
        prepared = prepare_fp8(q, k, v, relabel=True)
        row = dict(dtype="bf16", causal=causal, d=d, q_heads=heads, kv_heads=heads, t=t, batch=batch)
        fp8 = {name: functools.partial(hopper_fp8_forward, prepared, causal=causal,
                                       **(dict(persistent=hopper_schedule(t, d, causal)[0], overlap=False,
                                               tma_store=False) if kw == "step 5" else kw))
               for name, kw in FP8_SCHEDULE_STEPS.items()}
        impls = {"SDPA cuDNN": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, causal, False)(q, k, v),
                 "hopper_attention": lambda: hopper_attention(q, k, v, causal=causal, fallback=False), **fp8}
        _time_row(row, impls, (2.0 if causal else 4.0) * batch * heads * t * t * d, rounds=rounds)
        first = fp8["FP8, step 5's choice"]()
        row["identical"] = all(torch.equal(first, fn()) for fn in list(fp8.values())[1:])
        rows.append(row)
        done()
        _print_row(row, impls, f", the FP8 columns bit for bit: {row['identical']}")
        del q, k, v, prepared
        torch.cuda.empty_cache()
    return rows


def fp8_schedule_report(result: dict) -> str:
    """--fp8-schedule's table as markdown."""
    steps, names = list(FP8_SCHEDULE_STEPS), FP8_SCHEDULE_NAMES
    lines = report_opening(
        "# FP8 in step 5's schedule: persistent programs, the overlap across items, o by TMA", result["environment"],
        "Times by triton.testing.do_bench (L2 flushed before each run), every number from one process, "
        f"{_rounds_text(result['fp8_schedule'])}. D = 128, Hq = Hkv = 32, T = S, B x T = {TOKENS}; TFLOP/s = "
        "2 B H T^2 D / time causal, 4 B H T^2 D not causal. hopper_attention: "
        f"bf16 inputs; the FP8 columns: hopper_fp8_forward on the same inputs prepared by prepare_fp8 (not timed). "
        f"'{steps[0]}': persistent programs where hopper_schedule takes them, one item at a time, o stored by the "
        "consumers' threads; each later column adds one change; the last is hopper_fp8_forward's default. "
        "'identical': every FP8 column gave the first's o bit for bit.")
    lines += ["| causal | T | B | " + " | ".join(names) + f" | default / {steps[0]} | default / bf16 | "
              "default / cuDNN | identical |", "|---" * (3 + len(names) + 4) + "|"]
    for r in result["fp8_schedule"]:
        lines.append(f"| {'yes' if r['causal'] else 'no'} | {r['t']} | {r['batch']} | "
                     + " | ".join(f"{r[n]:.1f}" for n in names)
                     + f" | {r[steps[-1]] / r[steps[0]]:.3f} | {r[steps[-1]] / r['hopper_attention']:.3f} | "
                     f"{r[steps[-1]] / r['SDPA cuDNN']:.3f} | {'yes' if r['identical'] else 'no'} |")
    return "\n".join(lines) + "\n"


def fp8_schedule_plot(result: dict, path: str | None = None):
    """--fp8-schedule's rows as grouped bars: TFLOP/s of cuDNN, hopper_attention in bf16 and each step of FP8's
    schedule, one group per shape. Saved to `path` when given; the figure is returned."""
    import matplotlib

    if path:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, names = result["fp8_schedule"], FP8_SCHEDULE_NAMES
    fig, ax = plt.subplots(figsize=(12, 4.8))
    grouped_bars(ax, [f"{'causal' if r['causal'] else 'not causal'}, T = {r['t']}" for r in rows],
                 {name + (" (bf16)" if name == "hopper_attention" else ""): [r[name] for r in rows] for name in names})
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(0, 1.2 * max(r[name] for r in rows for name in names))   # room for the legend above the bars
    ax.set_title("FP8 in step 5's schedule, one change at a time (D = 128, H = 32)")
    ax.legend(loc="upper center", ncol=len(names), fontsize="small")
    fig.suptitle(result["environment"])
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def profile_run(t: int) -> None:
    """Each causal D = 128 kernel once at T = t, B x T = TOKENS, between cudaProfilerStart and Stop: 05's,
    longest first, cuDNN's, the Triton FP8 kernel, and on a Hopper GPU hopper_attention and hopper_fp8_forward.

    For Nsight Compute with `--profile-from-start off`: compiling and autotuning happen before the
    profiled range, so only the timed kernels are profiled.
    """
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.fast_attention import fast_attention
    from flashcourse.engine.fp8 import fp8_forward, hopper_fp8_forward, prepare_fp8
    from flashcourse.engine.hopper import gluon, hopper_attention
    from flashcourse.engine.longest_first import lpt_attention

    batch = max(1, TOKENS // t)
    q, k, v = _inputs(batch, 32, 32, t, t, 128, torch.bfloat16)
    prepared = prepare_fp8(q, k, v)
    calls = [lambda: fast_attention(q, k, v), lambda: lpt_attention(q, k, v, head_group=batch * 32),
             lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, True, False)(q, k, v),
             lambda: fp8_forward(prepared, out_dtype=torch.bfloat16)]
    if gluon is not None and torch.cuda.get_device_capability()[0] == 9:   # step 5's kernel in bf16, then FP8
        relabelled = prepare_fp8(q, k, v, relabel=True)
        calls += [lambda: hopper_attention(q, k, v, fallback=False), lambda: hopper_fp8_forward(relabelled)]
    for call in calls:     # compile and autotune outside the profiled range
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


NCU_METRICS = {   # what the notebook reads from Nsight Compute's raw page, by metric name
    "duration_us": "gpu__time_duration.sum",
    "tensor_pipe_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "xu_pipe_pct": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",   # exponentials, conversions
    "issue_slots_pct": "sm__inst_issued.avg.pct_of_peak_sustained_elapsed",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "warps_active_per_sm": "sm__warps_active.avg.per_cycle_active",      # resident warps, idle ones included
    "issue_active_per_cycle": "smsp__issue_active.avg.per_cycle_active",  # instructions a scheduler issues a cycle
    "dram_active_pct": "dram__cycles_active.avg.pct_of_peak_sustained_elapsed",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")


def ncu_summary(csv_path: str, t: int) -> list[dict]:
    """Nsight Compute's raw CSV (`--page raw --csv`) reduced to NCU_METRICS and the stall reasons per kernel.

    A stall reason's value is the warps waiting for it per issued instruction ("selected", the warp
    that issued, is left out); the five largest are kept. A warp that waits at a barrier for the whole kernel
    (a warp-specialized kernel's warps that hold no partition) adds 1/4 / issue_active_per_cycle to "barrier".
    """
    import csv

    with open(csv_path) as f:
        table = list(csv.reader(line for line in f if line.startswith('"')))
    header, units, rows = table[0], dict(zip(table[0], table[1])), table[2:]
    to_micro = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
    kernels = []
    for cells in rows:
        raw = dict(zip(header, cells))

        def number(name):
            try:
                value = float(raw.get(name, "nan").replace(",", ""))
            except ValueError:
                return math.nan
            return value * to_micro.get(units.get(name), 1.0) if name == NCU_METRICS["duration_us"] else value
        entry = {"t": t, "kernel": raw.get("Kernel Name", "?").split("(")[0][:100]}
        entry.update({key: number(name) for key, name in NCU_METRICS.items()})
        stalls = {m[1]: number(name) for name in header if (m := STALL.fullmatch(name)) and m[1] != "selected"}
        entry["stalls_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:5])
        kernels.append(entry)
    return kernels


def profile_report(profile: dict) -> str:
    """fast_profile.json (ncu_summary's kernels) as a markdown table."""
    lines = ["## Nsight Compute: each kernel once, causal D = 128, H = 32, B x T = %d" % TOKENS, "",
             "| T | kernel | grid x threads | registers | duration (us) | tensor pipe active % | issue slots busy % | "
             "achieved occupancy % | DRAM active % | top stalls (warps per issued instruction) |",
             "|---" * 10 + "|"]
    for k in profile["kernels"]:
        stalls = ", ".join(f"{name} {value:.2f}" for name, value in k["stalls_per_issue"].items())
        lines.append(f"| {k['t']} | {k['kernel']} | {k['grid']:.0f} x {k['block']:.0f} | {k['registers']:.0f} | "
                     f"{k['duration_us']:.0f} | {k['tensor_pipe_pct']:.1f} | {k['issue_slots_pct']:.1f} | "
                     f"{k['achieved_occupancy_pct']:.1f} | {k['dram_active_pct']:.1f} | {stalls} |")
    return "\n".join(lines) + "\n"


def last_gap_report(result: dict) -> str:
    """The last-gap measurements as markdown tables."""
    lines = report_opening(
        "# The fast kernel's last gap to cuDNN: longest-first scheduling and an FP8 forward", result["environment"],
        "Times by triton.testing.do_bench (L2 flushed before each run), every number from one process. "
        "Causal, T = S, B x T = %d, TFLOP/s = 2 B Hq T^2 D / time. FP8: e4m3 Q, K, V with one scale per 128 "
        "rows, FP32 statistics, output in the input's dtype, timed on inputs already quantized; "
        "'FP8 + quantize' includes quantizing them (PyTorch). Errors: max |out - reference| over batch 0, "
        "heads 0-1, the reference in FP32." % TOKENS,
        "## Prefill, causal (TFLOP/s)")
    lines += ["| dtype | D | Hq/Hkv | T | B | " + " | ".join(LAST_GAP_NAMES) +
              " | fast / cuDNN | best bf16 ours / cuDNN | FP8 / fast | fast error | FP8 error |",
              "|---" * (5 + len(LAST_GAP_NAMES) + 5) + "|"]
    for r in result["last_gap"]:
        best = max(r["fast_attention"], r["LPT order"], r["persistent LPT"])
        lines.append(f"| {r['dtype']} | {r['d']} | {r['q_heads']}/{r['kv_heads']} | {r['t']} | {r['batch']} | "
                     + " | ".join(f"{r[n]:.1f}" for n in LAST_GAP_NAMES)
                     + f" | {r['fast_attention'] / r['SDPA cuDNN']:.2f} | {best / r['SDPA cuDNN']:.2f} | "
                     f"{r['FP8'] / r['fast_attention']:.2f} | {r['fast_attention error']:.1e} | {r['FP8 error']:.1e} |")
    lines += ["", "## FP8 error against an FP32 reference (causal, B = 1, T = S = %d, H = %d, D = 128)"
              % (result["fp8_errors_t"], result["fp8_errors_heads"]), "",
              "| inputs | method | max error | RMS error |", "|---|---|---|---|"]
    lines += [f"| {r['inputs']} | {r['method']} | {r['max']:.2e} | {r['rms']:.2e} |" for r in result["fp8_errors"]]
    lines += ["", "## The tail of the causal grid (simulated: ideal time over the grid's time)", "",
              "| T | B | BLOCK_M | items | slots | fast order | LPT order | persistent LPT |", "|---" * 8 + "|"]
    lines += [f"| {r['t']} | {r['batch']} | {r['block_m']} | {r['items']} | {r['slots']} | {r['fast order']:.3f} | "
              f"{r['LPT order']:.3f} | {r['persistent LPT']:.3f} |" for r in result["tail"]]
    return "\n".join(lines) + "\n"


def last_gap_main(args) -> int:
    """--last-gap: the grid above, the FP8 error study and the grid-tail simulation, saved after every row."""
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    result = {"environment": environment(), "last_gap": [], "fp8_errors": [], "fp8_errors_t": 4096,
              "fp8_errors_heads": 4,
              "tail": [tail(t, TOKENS // t, 32, bm, bm, processors) for t in (1024, 16384) for bm in (64, 128)]}

    def save():
        save_json(result, args.json)
    print("fp8 errors", flush=True)
    result["fp8_errors"] = fp8_errors(result["fp8_errors_t"], result["fp8_errors_heads"])
    save()
    print("last gap", flush=True)
    last_gap(rows=result["last_gap"], done=save)
    show_report(last_gap_report(result), args.out)
    return 0


# --- the last gap, continued: the lse forward, Hopper's pipelining options, decode at short caches -------

PIPELINE_TRIALS = [  # (BLOCK_M, BLOCK_N, warps, stages, warp specialization) of fast_attention_lse, tried one by one
    (64, 64, 4, 3, False), (64, 64, 4, 4, False), (64, 64, 4, 5, False), (64, 128, 4, 3, False),
    (128, 64, 8, 2, False), (128, 64, 8, 3, False), (128, 64, 8, 4, False), (128, 64, 8, 5, False),
    (128, 128, 8, 2, False), (128, 128, 8, 3, False), (128, 128, 8, 4, False),
    (64, 64, 4, 3, True), (128, 64, 4, 3, True), (128, 64, 8, 3, True), (128, 128, 8, 2, True), (128, 128, 8, 3, True),
]
SHORT_CACHES = (1024, 2048, 4096, 8192, 16384)
DECODE_LAUNCHES = [  # (keys per tile, warps, stages) of the split kernel, tried with every split count
    (128, 4, 3), (128, 4, 4), (64, 4, 3), (64, 4, 4), (32, 4, 3), (64, 8, 3)]
DECODE_SPLITS = (8, 16, 24, 32, 48, 64)


def pipeline_trials(lengths=(1024, 4096, 16384), warp_specialize=None) -> list[dict]:
    """bf16 causal D = 128, H = 32: fast_attention and fast_attention_lse autotuned, cuDNN, FlashAttention-2, and
    fast_attention_lse at each PIPELINE_TRIALS config (only those whose warp specialization is `warp_specialize`,
    when given). TFLOP/s; NaN where a config fails to compile."""
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.fast_attention import fast_attention
    from flashcourse.engine.fast_lse import fast_attention_lse, fast_lse_tuned

    trials = [c for c in PIPELINE_TRIALS if warp_specialize is None or c[4] == warp_specialize]
    rows = []
    for t in lengths:
        batch = max(1, TOKENS // t)
        q, k, v = _inputs(batch, 32, 32, t, t, 128, torch.bfloat16)
        flops = 2.0 * batch * 32 * t * t * 128
        impls = {"fast_attention": lambda: fast_attention(q, k, v),
                 "fast_attention_lse": lambda: fast_attention_lse(q, k, v),
                 "SDPA cuDNN": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, True, False)(q, k, v),
                 "SDPA flash": lambda: _sdpa(SDPBackend.FLASH_ATTENTION, True, False)(q, k, v)}
        for bm, bn, w, st, ws in trials:
            impls[f"{bm}x{bn} w{w} s{st}" + (" ws" if ws else "")] = functools.partial(
                fast_attention_lse, q, k, v, block_m=bm, block_n=bn, num_warps=w, num_stages=st, warp_specialize=ws)
        row = dict(t=t, batch=batch)
        for name, fn in impls.items():
            row[name] = flops / _or_nan(_ms, fn) / 1e9
            print(f"  T={t:5d} {name:28s} {row[name]:6.1f}", flush=True)
        row["lse config"] = str(fast_lse_tuned.best_config)
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def _same_bytes_copy(caches) -> float:
    """TB/s of a device copy moving as many bytes (read plus written) as one decode reads, graph-timed like it."""
    nbytes = sum(x.numel() * x.element_size() for x in caches[0][1:])      # K and V
    pairs = [(torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda"),
              torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")) for _ in caches]
    return nbytes / _graph_ms([functools.partial(y.copy_, x) for x, y in pairs]) / 1e9


def decode_sweep(lengths=SHORT_CACHES, q_heads=32, kv_heads=8, d=128) -> list[dict]:
    """B = 1: fast_decode's TB/s for every split count and split-kernel launch, next to SDPA and a copy.

    The launch is set by substituting decode_launch for the sweep (fast_decode reads it at each call)."""
    from torch.nn.attention import SDPBackend

    from flashcourse.engine import decode as engine

    given_launch = engine.decode_launch
    rows = []
    for s in lengths:
        kv_bytes = 2 * kv_heads * s * d * 2
        copies = max(2, math.ceil(L2_FLUSH_BYTES / kv_bytes))
        caches = [_inputs(1, q_heads, kv_heads, 1, s, d, torch.bfloat16, seed=i) for i in range(copies)]
        row = dict(s=s, copies=copies, copy_same_bytes=_same_bytes_copy(caches), configs={})
        for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):
            row[name] = kv_bytes / _or_nan(_graph_ms, [functools.partial(_sdpa(backend, False, True), *c)
                                                       for c in caches]) / 1e9
        try:
            for block_n, warps, stages in DECODE_LAUNCHES:
                engine.decode_launch = lambda device, d=128, launch=dict(BLOCK_N=block_n, num_warps=warps,
                                                                       num_stages=stages): launch
                for splits in DECODE_SPLITS:
                    tbs = kv_bytes / _or_nan(_graph_ms, [functools.partial(engine.fast_decode, *c, splits=splits)
                                                         for c in caches]) / 1e9
                    row["configs"][f"{block_n} w{warps} s{stages} / {splits}"] = tbs
        finally:
            engine.decode_launch = given_launch
        row["default"] = kv_bytes / _graph_ms([functools.partial(engine.fast_decode, *c) for c in caches]) / 1e9
        best = max(row["configs"], key=row["configs"].get)
        print(f"  S={s:6d}: default {row['default']:.2f}, best {best} {row['configs'][best]:.2f}, cuDNN "
              f"{row['SDPA cuDNN']:.2f}, flash {row['SDPA flash']:.2f}, same-bytes copy {row['copy_same_bytes']:.2f} TB/s",
              flush=True)
        rows.append(row)
        del caches
        torch.cuda.empty_cache()
    return rows


def trials_main(args) -> int:
    """--trials: pipeline_trials (warp specialization only with --warp-specialize) and, without it, decode_sweep."""
    result = {"environment": environment()}
    if args.warp_specialize:
        result["pipeline"] = pipeline_trials(warp_specialize=True)
    else:
        result["copy_tbs"] = copy_bandwidth()
        result["decode_sweep"] = decode_sweep()
        result["pipeline"] = pipeline_trials(warp_specialize=False)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


LAST_GAP_2_NAMES = ["fast_attention", "fast_attention_lse", "SDPA cuDNN", "SDPA flash"]
SHORT_DECODE = [(1, s) for s in SHORT_CACHES + (32768,)] + [(8, 1024), (8, 8192)]
DECODE_2_NAMES = ["fast_decode", "short-cache splits", "SDPA cuDNN", "SDPA flash"]


def lse_error(lse, q, k, causal: bool, heads: int = 2) -> float:
    """max |lse - reference| over batch 0 and the first `heads` query heads (natural log, FP32 reference)."""
    return float((lse[:1, :heads] - torch.logsumexp(reference_scores(q, k, causal, heads), -1)).abs().max())


def _prefill_cases(grid):
    """Each row of a prefill grid: its fields, q, k and v (T = S), its FLOPs, and SDPA's cuDNN and flash
    backends as callables on those inputs."""
    from torch.nn.attention import SDPBackend

    for dtype_name, causal, d, q_heads, kv_heads, lengths in grid:
        gqa = q_heads != kv_heads
        for t in lengths:
            batch = max(1, TOKENS // t)
            q, k, v = _inputs(batch, q_heads, kv_heads, t, t, d, DTYPES[dtype_name])
            row = dict(dtype=dtype_name, causal=causal, d=d, q_heads=q_heads, kv_heads=kv_heads, t=t, batch=batch)
            sdpa = {name: functools.partial(_sdpa(backend, causal, gqa), q, k, v) for name, backend in
                    (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA flash", SDPBackend.FLASH_ATTENTION))}
            yield row, q, k, v, (2.0 if causal else 4.0) * batch * q_heads * t * t * d, sdpa
            del q, k, v, sdpa
            torch.cuda.empty_cache()


def _time_row(row, impls, flops, rounds=1) -> None:
    """row[name] = TFLOP/s of each implementation (flops: one count for all, or a dict of counts by name), NaN
    where one fails; with rounds > 1 the median of that many rounds, the implementations taking turns, in reverse
    order every other round and, after each pair of rounds, starting one place later: neither a slow moment of
    the GPU nor a place in the order (on an H100 a kernel timed just after another could run several percent
    slower than the same kernel timed elsewhere in the round) favours one of them. The median, not the best: on
    an H200 one kernel's best rounds in two columns of one table lay up to 8 % apart, and one fast round moved a
    ratio over cuDNN by up to 3.5 % where the medians agreed (in benchmarks/results,
    2026-12-07-h200-hopper-overlap-five-rounds.md and 2026-12-07-h200-same-kernel-rounds.md). row also records
    the rounds, whether the order moved and the statistic (its reports say how each figure was timed)."""
    row["rounds"], row["rotated"], row["statistic"] = rounds, rounds > 2, "median"
    order = list(impls)
    times = {name: [] for name in order}
    for round_ in range(rounds):
        shift = round_ // 2 % len(order)
        turn = order[shift:] + order[:shift]
        for name in turn if round_ % 2 == 0 else turn[::-1]:
            times[name].append(_or_nan(_ms, impls[name]))
    for name in order:
        work = flops[name] if isinstance(flops, dict) else flops
        timed = [ms for ms in times[name] if not math.isnan(ms)]
        row[name] = work / statistics.median(timed) / 1e9 if timed else math.nan


def _rounds_text(rows) -> str:
    """How a table's figures were timed, from its rows: the median (or, in rows saved before the median, the best)
    of how many rounds, in what order (rows timed before the order also moved one place every pair of rounds say
    nothing of it, and were reversed only)."""
    rounds = " or ".join(map(str, sorted({r.get("rounds", 2) for r in rows})))   # saved before --rounds: two
    moved = all(r.get("rotated") for r in rows)
    statistic = "median" if all(r.get("statistic") == "median" for r in rows) else "best"
    return (f"the {statistic} of {rounds} rounds, every other round in reverse order"
            + (", each pair of rounds starting one place later" if moved else ""))


def _rounds_sentence(rows) -> str:
    """' TFLOP/s: ' and _rounds_text, for a table whose rows record their rounds; nothing for rows saved before
    their benchmark took rounds (each implementation timed once)."""
    return f" TFLOP/s: {_rounds_text(rows)}." if all("rounds" in r for r in rows) else ""


def _print_row(row, names, suffix="") -> None:
    print(f"  {row['dtype']} {'causal' if row['causal'] else 'full  '} D={row['d']} H={row['q_heads']}/"
          f"{row['kv_heads']} T={row['t']:5d} B={row['batch']:2d}: " + ", ".join(f"{n} {row[n]:.0f}" for n in names)
          + suffix, flush=True)


def prefill_with_lse(grid=PREFILL, rows=None, done=lambda: None) -> list[dict]:
    """bench_fast's prefill grid: fast_attention, fast_attention_lse (autotuned), SDPA cuDNN and flash (TFLOP/s)."""
    from flashcourse.engine.fast_attention import fast_attention
    from flashcourse.engine.fast_lse import fast_attention_lse, fast_lse_tuned

    rows = [] if rows is None else rows
    for row, q, k, v, flops, sdpa in _prefill_cases(grid):
        causal = row["causal"]
        impls = {"fast_attention": lambda: fast_attention(q, k, v, causal=causal),
                 "fast_attention_lse": lambda: fast_attention_lse(q, k, v, causal=causal), **sdpa}
        _time_row(row, impls, flops)
        o, lse = fast_attention_lse(q, k, v, causal=causal)
        row["lse o error"], row["lse error"] = max_error(o, q, k, v, causal), lse_error(lse, q, k, causal)
        row["lse config"] = str(fast_lse_tuned.best_config)
        rows.append(row)
        done()
        _print_row(row, impls, f"  [{row['lse config']}]")
        del o, lse
    return rows


def prefill_lse_forwards(grid=PREFILL) -> list[dict]:
    """The prefill grid's forwards that return lse: 05's fast_attention_lse and 08's hopper_attention_lse (Gluon),
    beside hopper_attention (no lse) and SDPA's cuDNN and flash backends, in TFLOP/s, with each lse's error."""
    from flashcourse.engine.fast_lse import fast_attention_lse
    from flashcourse.engine.hopper import hopper_attention, hopper_attention_lse

    rows = []
    for row, q, k, v, flops, sdpa in _prefill_cases(grid):
        causal = row["causal"]
        impls = {"fast_attention_lse": lambda: fast_attention_lse(q, k, v, causal=causal),
                 "hopper_attention_lse": lambda: hopper_attention_lse(q, k, v, causal=causal, fallback=False),
                 "hopper_attention": lambda: hopper_attention(q, k, v, causal=causal, fallback=False), **sdpa}
        _time_row(row, impls, flops)
        o, lse = hopper_attention_lse(q, k, v, causal=causal, fallback=False)
        row["hopper lse error"] = lse_error(lse, q, k, causal)
        rows.append(row)
        _print_row(row, impls, f"  hopper lse error {row['hopper lse error']:.1e}")
        del o, lse
    return rows


def _decode_cases(grid, q_heads, kv_heads, d):
    """Each (B, S) of a decode grid: its row (B, S, cache copies, short_cache_splits, the same-bytes copy's TB/s),
    the bytes of K and V one decode reads, and several copies of the cache (more than the L2 holds)."""
    from flashcourse.engine.decode import short_cache_splits

    for batch, s in grid:
        kv_bytes = 2 * batch * kv_heads * s * d * 2
        copies = max(2, math.ceil(L2_FLUSH_BYTES / kv_bytes))
        caches = [_inputs(batch, q_heads, kv_heads, 1, s, d, torch.bfloat16, seed=i) for i in range(copies)]
        row = dict(batch=batch, s=s, copies=copies, splits=short_cache_splits(batch, kv_heads, s, "cuda"),
                   copy_same_bytes=_same_bytes_copy(caches))
        yield row, kv_bytes, caches
        del caches
        torch.cuda.empty_cache()


def _time_decode(row, impls, kv_bytes, caches) -> None:
    """row[name] = TB/s of K and V read by each implementation, graph-timed over the cache copies, NaN on failure."""
    for name, fn in impls.items():
        row[name] = kv_bytes / _or_nan(_graph_ms, [functools.partial(fn, *cache) for cache in caches]) / 1e9


def decode_short(grid=SHORT_DECODE, q_heads=32, kv_heads=8, d=128, rows=None, done=lambda: None) -> list[dict]:
    """fast_decode with decode_splits and with short_cache_splits, SDPA's backends and a same-bytes copy (TB/s)."""
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.decode import fast_decode

    rows = [] if rows is None else rows
    for row, kv_bytes, caches in _decode_cases(grid, q_heads, kv_heads, d):
        impls = {"fast_decode": fast_decode, "short-cache splits": functools.partial(fast_decode, splits=row["splits"]),
                 "SDPA cuDNN": _sdpa(SDPBackend.CUDNN_ATTENTION, False, True),
                 "SDPA flash": _sdpa(SDPBackend.FLASH_ATTENTION, False, True)}
        _time_decode(row, impls, kv_bytes, caches)
        q, k, v = caches[0]
        row["short-cache error"] = max_error(impls["short-cache splits"](q, k, v), q, k, v, False)
        rows.append(row)
        done()
        print(f"  decode B={row['batch']} S={row['s']:6d} ({row['splits']} splits): "
              + ", ".join(f"{n} {row[n]:.2f}" for n in impls) + f", same-bytes copy {row['copy_same_bytes']:.2f} TB/s",
              flush=True)
        del q, k, v
    return rows


def last_gap_2_report(result: dict, trials: dict | None = None) -> str:
    """The final grid with the lse forward, decode at short caches, and (when given) the trials, as markdown."""
    lines = report_opening(
        "# The fast kernel's last gap, continued: a forward that returns lse, decode at short caches, Hopper's "
        "pipelining options", result["environment"],
        "Prefill times by triton.testing.do_bench (L2 flushed before each run); decode times per call of a "
        "replayed CUDA graph over several copies of the cache (more than the L2 holds). Every number of the first "
        "two tables from one process. TFLOP/s = 2 B Hq T^2 D / time causal, 4 B Hq T^2 D not causal; T = S, "
        f"B x T = {TOKENS}. Errors over batch 0, heads 0-1, against FP32: max |o - reference| and max |lse - "
        "reference| (natural log).",
        "## Prefill (TFLOP/s)")
    lines += ["| dtype | causal | D | Hq/Hkv | T | B | " + " | ".join(LAST_GAP_2_NAMES) +
              " | fast / cuDNN | lse / cuDNN | lse / fast | lse o error | lse error | lse config |",
              "|---" * (6 + len(LAST_GAP_2_NAMES) + 6) + "|"]
    for r in result["prefill"]:
        lines.append(f"| {r['dtype']} | {'yes' if r['causal'] else 'no'} | {r['d']} | {r['q_heads']}/{r['kv_heads']} | "
                     f"{r['t']} | {r['batch']} | " + " | ".join(f"{r[n]:.1f}" for n in LAST_GAP_2_NAMES) +
                     f" | {r['fast_attention'] / r['SDPA cuDNN']:.2f} | {r['fast_attention_lse'] / r['SDPA cuDNN']:.2f} | "
                     f"{r['fast_attention_lse'] / r['fast_attention']:.2f} | {r['lse o error']:.1e} | "
                     f"{r['lse error']:.1e} | {r['lse config']} |")
    lines += ["", f"## Decode (TB/s of K and V read; Hq = 32, Hkv = 8, D = 128, bf16; a 4 GiB device copy: "
              f"{result['copy_tbs']:.2f} TB/s)", "",
              "| B | S | splits | " + " | ".join(DECODE_2_NAMES) + " | same-bytes copy | short / 4 GiB copy | "
              "short / same-bytes copy | short / cuDNN | short-cache error |", "|---" * (3 + len(DECODE_2_NAMES) + 5) + "|"]
    for r in result["decode"]:
        short = r["short-cache splits"]
        lines.append(f"| {r['batch']} | {r['s']} | {r['splits']} | " + " | ".join(f"{r[n]:.2f}" for n in DECODE_2_NAMES)
                     + f" | {r['copy_same_bytes']:.2f} | {100 * short / result['copy_tbs']:.0f} % | "
                     f"{100 * short / r['copy_same_bytes']:.0f} % | {short / r['SDPA cuDNN']:.2f} | "
                     f"{r['short-cache error']:.1e} |")
    if trials:
        lines += ["", "## The trials (earlier processes, in one call before the tables above)", "",
                  f"Measured {trials['environment']}."]
        for key, what in (("pipeline", "one process"), ("pipeline_ws", "warp-specialized, a process of its own")):
            lines += ["", f"### fast_attention_lse one config at a time ({what}): bf16, causal, D = 128, H = 32 "
                      "(TFLOP/s; config: BLOCK_M x BLOCK_N, warps, stages, ws = warp_specialize; - : did not compile or fit)", ""]
            names = [n for n in trials[key][0] if n not in ("t", "batch", "lse config")]
            lines += ["| config | " + " | ".join(f"T = {r['t']}" for r in trials[key]) + " |",
                      "|---" * (1 + len(trials[key])) + "|"]
            lines += [f"| {n} | " + " | ".join("-" if r[n] != r[n] else f"{r[n]:.1f}" for r in trials[key]) + " |"
                      for n in names]
        lines += ["", "### Decode at B = 1: the best split count per launch of the split kernel (TB/s; launch: keys "
                  f"per tile, warps, stages; a 4 GiB copy: {trials['copy_tbs']:.2f} TB/s)", ""]
        launches = [f"{n} w{w} s{st}" for n, w, st in DECODE_LAUNCHES]
        lines += ["| S | decode_splits | " + " | ".join(launches) + " | SDPA cuDNN | same-bytes copy |",
                  "|---" * (4 + len(launches)) + "|"]
        for r in trials["decode_sweep"]:
            best = [max(((v, k.split(" / ")[1]) for k, v in r["configs"].items() if k.startswith(f"{l} /")))
                    for l in launches]
            lines.append(f"| {r['s']} | {r['default']:.2f} | " + " | ".join(f"{v:.2f} ({n})" for v, n in best)
                         + f" | {r['SDPA cuDNN']:.2f} | {r['copy_same_bytes']:.2f} |")
    return "\n".join(lines) + "\n"


def last_gap_2_main(args) -> int:
    """--last-gap-2: decode at short caches, then the prefill grid with the lse forward, saved after every row."""
    result = {"environment": environment(), "copy_tbs": copy_bandwidth(), "decode": [], "prefill": []}

    def save():
        save_json(result, args.json)
    print("decode", flush=True)
    decode_short(rows=result["decode"], done=save)
    print("prefill", flush=True)
    prefill_with_lse(rows=result["prefill"], done=save)
    show_report(last_gap_2_report(result), args.out)
    return 0


HOPPER_SCHEDULES = {  # column -> (persistent, pingpong) of hopper_attention
    "one per item": (False, False), "one per item + ping-pong": (False, True),
    "persistent": (True, False), "persistent + ping-pong": (True, True)}
HOPPER_NAMES = ["fast_attention", "hopper_attention", "SDPA cuDNN", "SDPA flash"]


def prefill_hopper(grid=PREFILL, rows=None, done=lambda: None, rounds=1) -> list[dict]:
    """bench_fast's prefill grid: hopper_attention with its own schedule and with each of HOPPER_SCHEDULES,
    fast_attention, SDPA cuDNN and flash (TFLOP/s, the median of `rounds` rounds), and both course kernels' errors
    against FP32."""
    from flashcourse.engine.fast_attention import fast_attention
    from flashcourse.engine.hopper import hopper_attention

    rows = [] if rows is None else rows
    for row, q, k, v, flops, sdpa in _prefill_cases(grid):
        causal = row["causal"]
        # hopper_attention with fallback=False: a shape it cannot run raises, never measures fast_attention
        impls = {"fast_attention": lambda: fast_attention(q, k, v, causal=causal),
                 "hopper_attention": lambda: hopper_attention(q, k, v, causal=causal, fallback=False), **sdpa}
        for name, (persistent, pingpong) in HOPPER_SCHEDULES.items():
            impls[name] = functools.partial(hopper_attention, q, k, v, causal=causal, persistent=persistent,
                                            pingpong=pingpong, fallback=False)
        _time_row(row, impls, flops, rounds=rounds)
        row["fast error"] = max_error(fast_attention(q, k, v, causal=causal), q, k, v, causal)
        row["hopper error"] = max_error(hopper_attention(q, k, v, causal=causal, fallback=False), q, k, v, causal)
        rows.append(row)
        done()
        _print_row(row, impls)
    return rows


def hopper_report(result: dict) -> str:
    """The grid of --hopper as markdown: the course's two forwards beside SDPA's, and hopper_attention's schedules."""
    schedules = list(HOPPER_SCHEDULES)
    lines = report_opening(
        "# FlashAttention-3's schedule in Gluon: hopper_attention beside fast_attention and cuDNN", result["environment"],
        "Times by triton.testing.do_bench (L2 flushed before each run), every number from one process. "
        f"TFLOP/s = 2 B Hq T^2 D / time causal, 4 B Hq T^2 D not causal; T = S, B x T = {TOKENS}. Errors: max "
        "|o - reference| over batch 0, heads 0-1, against FP32. hopper_attention's own schedule is "
        "hopper_schedule's choice; the last four columns force each (persistent or one program per work item, "
        "with or without the ping-pong)." + _rounds_sentence(result["prefill"]))
    lines += ["| dtype | causal | D | Hq/Hkv | T | B | " + " | ".join(HOPPER_NAMES) +
              " | hopper / cuDNN | best ours / cuDNN | hopper / fast | fast error | hopper error | " +
              " | ".join(schedules) + " |", "|---" * (6 + len(HOPPER_NAMES) + 5 + len(schedules)) + "|"]
    for r in result["prefill"]:
        best = max(r["fast_attention"], r["hopper_attention"])
        lines.append(f"| {r['dtype']} | {'yes' if r['causal'] else 'no'} | {r['d']} | {r['q_heads']}/{r['kv_heads']} | "
                     f"{r['t']} | {r['batch']} | " + " | ".join(f"{r[n]:.1f}" for n in HOPPER_NAMES) +
                     f" | {r['hopper_attention'] / r['SDPA cuDNN']:.2f} | {best / r['SDPA cuDNN']:.2f} | "
                     f"{r['hopper_attention'] / r['fast_attention']:.2f} | {r['fast error']:.1e} | "
                     f"{r['hopper error']:.1e} | " + " | ".join(f"{r[n]:.1f}" for n in schedules) + " |")
    return "\n".join(lines) + "\n"


CONSUMERS_GRID = [  # (dtype, causal, D, Hq, Hkv, lengths): D = 64, where a third consumer warpgroup fits
    ("bf16", True, 64, 32, 32, (1024, 2048, 4096, 8192, 16384)),
    ("bf16", False, 64, 32, 32, (1024, 4096, 16384)),
    ("bf16", True, 64, 32, 8, (4096, 16384)),
]
OVERLAP_GRID = [  # the rows of PREFILL where items are short, and two long ones for the cost elsewhere
    ("bf16", True, 128, 32, 32, (1024, 2048, 4096, 16384)),
    ("bf16", False, 128, 32, 32, (1024, 4096)),
    ("bf16", True, 64, 32, 32, (1024, 2048, 4096)),
    ("bf16", False, 64, 32, 32, (1024,)),
    ("bf16", True, 128, 32, 8, (1024, 4096)),
    ("fp16", True, 128, 32, 32, (1024,)),
]
HOPPER_CHOICES = {  # --consumers, --overlap, --tma-store: hopper_attention's keyword, its two settings, grid
    "consumers": ("consumers", {"2 consumers": 2, "3 consumers": 3}, CONSUMERS_GRID),
    "overlap": ("overlap", {"one item at a time": False, "overlap": True}, OVERLAP_GRID),
    "tma_store": ("tma_store", {"o by threads": False, "o by TMA": True}, OVERLAP_GRID),
}


def prefill_choice(choice: str, rows=None, done=lambda: None, rounds=2) -> list[dict]:
    """hopper_attention with each of HOPPER_CHOICES[choice]'s two settings (the rest of its schedule its own),
    with its own choice, and SDPA cuDNN and flash: TFLOP/s, the median of `rounds` rounds; and whether the second
    setting gave the first's o bit for bit."""
    from flashcourse.engine.hopper import hopper_attention

    keyword, settings, grid = HOPPER_CHOICES[choice]
    rows = [] if rows is None else rows
    for row, q, k, v, flops, sdpa in _prefill_cases(grid):
        run = functools.partial(hopper_attention, q, k, v, causal=row["causal"], fallback=False)
        impls = {**sdpa, "hopper_attention": run,
                 **{name: functools.partial(run, **{keyword: value}) for name, value in settings.items()}}
        _time_row(row, impls, flops, rounds=rounds)
        first, second = (impls[name]() for name in settings)
        row["identical"] = torch.equal(first, second)
        rows.append(row)
        done()
        _print_row(row, impls, f", the two settings bit for bit: {row['identical']}")
    return rows


def choice_report(result: dict, choice: str) -> str:
    """--consumers', --overlap's or --tma-store's table as markdown."""
    keyword, settings, _ = HOPPER_CHOICES[choice]
    a, b = settings
    names = ["SDPA cuDNN", "SDPA flash", "hopper_attention", a, b]
    title = {"consumers": "hopper_attention at D = 64: two consumer warpgroups or three",
             "overlap": "hopper_attention: one item at a time, or the next item's first S beside this one's last P V",
             "tma_store": "hopper_attention: o stored by the consumer's threads, or through shared memory by one TMA copy"}
    lines = report_opening(
        f"# {title[choice]}", result["environment"],
        "Times by triton.testing.do_bench (L2 flushed before each run), every number from one process, "
        f"{_rounds_text(result[choice])}. T = S, B x T = {TOKENS}; "
        "TFLOP/s = 2 B Hq T^2 D / time causal, 4 B Hq T^2 D not causal. "
        f"'{a}' and '{b}' force hopper_attention's {keyword}= to {settings[a]} and {settings[b]}, the rest of the "
        f"schedule its own; hopper_attention is all its own choice. 'identical': '{b}' gave '{a}''s o bit for bit.")
    lines += ["| dtype | causal | D | Hq/Hkv | T | B | " + " | ".join(names) +
              f" | {b} / {a} | {a} / cuDNN | {b} / cuDNN | hopper / cuDNN | identical |",
              "|---" * (6 + len(names) + 5) + "|"]
    for r in result[choice]:
        cudnn = r["SDPA cuDNN"]
        lines.append(f"| {r['dtype']} | {'yes' if r['causal'] else 'no'} | {r['d']} | "
                     f"{r['q_heads']}/{r['kv_heads']} | {r['t']} | {r['batch']} | "
                     + " | ".join(f"{r[n]:.1f}" for n in names) +
                     f" | {r[b] / r[a]:.3f} | {r[a] / cudnn:.3f} | {r[b] / cudnn:.3f} | "
                     f"{r['hopper_attention'] / cudnn:.3f} | {'yes' if r['identical'] else 'no'} |")
    return "\n".join(lines) + "\n"


def hopper_plot(result: dict, path: str | None = None):
    """Three panels of --hopper's grid (bf16, D = 128, Hq = Hkv = 32): TFLOP/s against T causal and not causal,
    and hopper_attention's four schedules causal. Saved to `path` when given; the figure is returned."""
    import matplotlib

    if path:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def rows(causal):
        return [r for r in result["prefill"] if r["dtype"] == "bf16" and r["d"] == 128 and r["causal"] == causal
                and r["q_heads"] == r["kv_heads"]]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    panels = [(axes[0], rows(True), HOPPER_NAMES, "bf16 causal, D=128, H=32"),
              (axes[1], rows(False), HOPPER_NAMES, "bf16 not causal, D=128, H=32"),
              (axes[2], rows(True), list(HOPPER_SCHEDULES) + ["SDPA cuDNN"], "hopper_attention's schedules, causal")]
    for ax, grid, names, title in panels:
        for name in names:
            ax.plot([r["t"] for r in grid], [r[name] for r in grid], "o-", label=name)
        label_panel(ax, "T = S", "TFLOP/s", title)
    fig.suptitle(result["environment"])
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def _measure_main(args, key: str, measure, report) -> int:
    """One table: measure(rows=...) saved to --json after every row, then report(result) to --out."""
    result = {"environment": environment(), key: []}
    measure(rows=result[key], done=lambda: save_json(result, args.json))
    show_report(report(result), args.out)
    return 0


FUSED_NAMES = ["fused_decode", "fast_decode", "SDPA cuDNN"]


def decode_fused(grid=SHORT_DECODE, q_heads=32, kv_heads=8, d=128, rows=None, done=lambda: None) -> list[dict]:
    """fused_decode (one launch) beside fast_decode (two launches) with the same splits (short_cache_splits),
    SDPA cuDNN and a same-bytes copy, each timed in a CUDA graph over several copies of the cache (TB/s)."""
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.decode import fast_decode, fused_decode

    rows = [] if rows is None else rows
    for row, kv_bytes, caches in _decode_cases(grid, q_heads, kv_heads, d):
        impls = {"fused_decode": functools.partial(fused_decode, splits=row["splits"]),
                 "fast_decode": functools.partial(fast_decode, splits=row["splits"]),
                 "SDPA cuDNN": _sdpa(SDPBackend.CUDNN_ATTENTION, False, True)}
        _time_decode(row, impls, kv_bytes, caches)
        q, k, v = caches[0]
        for name in ("fused_decode", "fast_decode"):
            row[f"{name} error"] = max_error(impls[name](q, k, v), q, k, v, False)
        rows.append(row)
        done()
        print(f"  decode B={row['batch']} S={row['s']:6d} ({row['splits']} splits): "
              + ", ".join(f"{n} {row[n]:.2f}" for n in FUSED_NAMES) + f", same-bytes copy {row['copy_same_bytes']:.2f} "
              f"TB/s; fused {100 * row['fused_decode'] / row['copy_same_bytes']:.0f} % of the copy", flush=True)
        del q, k, v
    return rows


def decode_fused_report(result: dict) -> str:
    """--decode-fused's table as markdown: TB/s, and each decode as a share of the same-bytes copy."""
    lines = report_opening(
        "# Decode in one launch (fused_decode) against two (fast_decode)", result["environment"],
        "TB/s of K and V read; Hq = 32, Hkv = 8, D = 128, bf16, T = 1. Every column is timed per call of a "
        "replayed CUDA graph that reads several copies of the cache in turn (more than the L2 holds), in one "
        "process; the same-bytes copy moves as many bytes (read plus written) as one decode reads. Both "
        "decodes use short_cache_splits. Errors: max |o - reference| over batch 0, heads 0-1, the reference "
        "in FP32.")
    lines += ["| B | S | splits | " + " | ".join(FUSED_NAMES) + " | same-bytes copy | fused / copy | "
              "two launches / copy | fused / two launches | fused / cuDNN | fused error | two-launch error |",
              "|---" * (3 + len(FUSED_NAMES) + 7) + "|"]
    for r in result["decode_fused"]:
        copy, fused = r["copy_same_bytes"], r["fused_decode"]
        lines.append(f"| {r['batch']} | {r['s']} | {r['splits']} | " + " | ".join(f"{r[n]:.2f}" for n in FUSED_NAMES)
                     + f" | {copy:.2f} | {100 * fused / copy:.0f} % | {100 * r['fast_decode'] / copy:.0f} % | "
                     f"{fused / r['fast_decode']:.2f} | {fused / r['SDPA cuDNN']:.2f} | "
                     f"{r['fused_decode error']:.1e} | {r['fast_decode error']:.1e} |")
    return "\n".join(lines) + "\n"


def _measure_default_run(args) -> dict:
    """The run without a flag: the steps, decode and prefill (their small grid with --small), saved to --json after
    every row."""
    grid, decode_grid = PREFILL, DECODE
    if args.small:
        grid = [(dt, c, d, hq, hkv, tuple(t for t in ts if t in (1024, 8192)) or ts[:1])
                for dt, c, d, hq, hkv, ts in PREFILL]
        decode_grid = [(b, s) for b, s in DECODE if s in (32768, 131072)]
    result = {"environment": environment(), "steps": [], "copy_tbs": math.nan, "decode": [], "prefill": []}

    def save():
        save_json(result, args.json)
    print("steps", flush=True)
    result["steps"] = steps()
    save()
    print("decode", flush=True)
    result["copy_tbs"] = copy_bandwidth()
    decode(decode_grid, rows=result["decode"], done=save)
    print("prefill", flush=True)
    prefill(grid, rows=result["prefill"], done=save)
    return result


def main(argv=None) -> int:
    parser = report_parser(__doc__)
    parser.add_argument("--small", action="store_true", help="a small grid: T = 1k, 8k; S = 32k, 128k")
    parser.add_argument("--last-gap", action="store_true", help="the causal grid with the longest-first and FP8 "
                        "kernels, the FP8 error study and the grid-tail simulation (--out, --json)")
    parser.add_argument("--lpt-groups", action="store_true", help="longest first over the grid and within L2-sized "
                        "head groups, bf16 causal D = 128 (--out, --json)")
    parser.add_argument("--ncu-csv", nargs="+", metavar="T=FILE", help="measure nothing: reduce Nsight Compute's "
                        "raw CSVs (one per T) to --json")
    parser.add_argument("--profile", type=int, metavar="T", help="run each causal D = 128 kernel once at T = S, "
                        "for Nsight Compute (--profile-from-start off)")
    parser.add_argument("--trials", action="store_true", help="the lse forward's configs, one by one, and the decode "
                        "sweep at short caches (--json)")
    parser.add_argument("--warp-specialize", action="store_true", help="with --trials: only the warp-specialized "
                        "configs, in a process of their own")
    parser.add_argument("--last-gap-2", action="store_true", help="decode at short caches and the prefill grid with "
                        "the lse forward, in one process (--out, --json)")
    parser.add_argument("--hopper", action="store_true", help="the prefill grid with hopper_attention (Gluon, "
                        "FlashAttention-3's schedule) and each of its schedules, in one process (--out, --json)")
    parser.add_argument("--consumers", action="store_true", help="hopper_attention at D = 64 with two consumer "
                        "warpgroups and with three, beside SDPA, in one process (--out, --json)")
    parser.add_argument("--overlap", action="store_true", help="hopper_attention one item at a time and with the "
                        "overlap across items, beside SDPA, in one process (--out, --json)")
    parser.add_argument("--tma-store", action="store_true", help="hopper_attention with o stored by its threads and "
                        "by TMA, beside SDPA, in one process (--out, --json)")
    parser.add_argument("--rounds", type=int, default=2, help="with --hopper, --consumers, --overlap, --tma-store, "
                        "--fp8-prepare or --fp8-schedule: the median of this many rounds (default 2)")
    parser.add_argument("--hopper-lse", action="store_true", help="the prefill grid's forwards that return lse: 05's "
                        "and 08's (Gluon), beside hopper_attention and SDPA, in one process (--json)")
    parser.add_argument("--decode-fused", action="store_true", help="decode in one launch against two, cuDNN and a "
                        "same-bytes copy: B = 1, S = 1k to 32k; B = 8, S = 1k and 8k (--out, --json)")
    parser.add_argument("--fp8-prepare", action="store_true", help="prepare_fp8 in one Triton pass against its "
                        "PyTorch path, and fp8_attention end to end beside cuDNN and hopper_attention (--out, --json)")
    parser.add_argument("--fp8-schedule", action="store_true", help="hopper_fp8_forward with step 5's choice of "
                        "schedule, then persistent programs, the overlap and o by TMA added one at a time")
    parser.add_argument("--last-gap-2-report", nargs=2, metavar=("RESULT", "TRIALS"), help="measure nothing: the "
                        "markdown of a --last-gap-2 JSON and a --trials JSON together (--out)")
    args = parser.parse_args(argv)
    if args.last_gap_2_report:
        result, trials = (json.load(open(path)) for path in args.last_gap_2_report)
        show_report(last_gap_2_report(result, trials), args.out)
        return 0
    measures_on_gpu = (args.last_gap or args.lpt_groups or args.profile or args.trials or args.last_gap_2
                       or args.hopper or args.decode_fused or args.hopper_lse or args.fp8_prepare or args.consumers
                       or args.overlap or args.tma_store or args.fp8_schedule)
    if measures_on_gpu and not torch.cuda.is_available():
        print(GPU_NEEDED)
        return 1
    if args.profile:
        profile_run(args.profile)
        return 0
    if args.last_gap:
        return last_gap_main(args)
    if args.trials:
        return trials_main(args)
    if args.last_gap_2:
        return last_gap_2_main(args)
    if args.hopper:
        return _measure_main(args, "prefill", functools.partial(prefill_hopper, rounds=args.rounds), hopper_report)
    for choice in HOPPER_CHOICES:
        if getattr(args, choice):
            return _measure_main(args, choice, functools.partial(prefill_choice, choice, rounds=args.rounds),
                                 functools.partial(choice_report, choice=choice))
    if args.hopper_lse:
        save_json({"environment": environment(), "prefill": prefill_lse_forwards()}, args.json)
        return 0
    if args.decode_fused:
        return _measure_main(args, "decode_fused", decode_fused, decode_fused_report)
    if args.fp8_prepare:
        return _measure_main(args, "fp8_prepare", functools.partial(fp8_prepare, rounds=args.rounds),
                             fp8_prepare_report)
    if args.fp8_schedule:
        return _measure_main(args, "fp8_schedule", functools.partial(fp8_schedule, rounds=args.rounds),
                             fp8_schedule_report)
    if args.lpt_groups:
        result = {"environment": environment(), "lpt_groups": lpt_groups()}
        text = lpt_groups_report(result)
        save_json(result, args.json)
        show_report(text, args.out)
        return 0
    if args.ncu_csv:
        summary = [k for item in args.ncu_csv for k in ncu_summary(item.split("=", 1)[1], int(item.split("=", 1)[0]))]
        with open(args.json, "w") as f:
            json.dump({"kernels": summary}, f, indent=1)
        print(profile_report({"kernels": summary}))
        return 0
    return report_main(args, _measure_default_run, report, plot)


if __name__ == "__main__":
    raise SystemExit(main())
