"""Speed, memory and precision of the course's Triton kernel, measured on a CUDA GPU.

    python -m flashcourse.bench                 the benchmark: bf16 causal attention, D = 128 and 64,
                                                T = 1k..16k, flash_attention at its best block sizes
                                                against SDPA's flash and cuDNN backends, same process
    python -m flashcourse.bench --out FILE.md   the same, also written to FILE.md (with the GPU and versions)

In a notebook: `sweep()` measures flash_attention, torch's scaled_dot_product_attention and the
unfused causal attention across T (time, TFLOP/s, peak memory) and `plot()` draws it;
`tf32_errors()` shows what input_precision does to FP32 inputs. Every function here needs a GPU;
`GPU_NEEDED` is what a notebook prints on a CPU instead, beside what was measured on the course's GPU:
`measured(name)` finds those results, in flashcourse/bench/measured/, installed with the package.

FLOPs of causal attention: two matrix products of 2 T S D operations each, half of them masked
away, so 2 B H T^2 D (the convention of FlashAttention's papers for causal runs).
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

GPU_NEEDED = ("This measurement needs a CUDA GPU: on a CPU the kernel runs in Triton's interpreter, "
              "whose speed says nothing about the compiled kernel. Skipped.")
MEASURED = Path(__file__).resolve().parent / "measured"   # results from the course's GPU, package data


def measured(name: str) -> Path | None:
    """flashcourse/bench/measured/<name>, a result measured on the course's GPU and installed with the package;
    None, and a line that says so, where this copy of the package lacks it."""
    path = MEASURED / name
    if path.is_file():
        return path
    print(f"The course's measurement {name} is not installed with this copy of flashcourse (looked in {MEASURED}).")
    return None

# (block_m, block_n, num_warps, num_stages) tried for flash_attention; the best one is reported.
CONFIGS = [(32, 32, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]
LENGTHS = [1024, 2048, 4096, 8192, 16384]
TOKENS = 4 * 32 * 8192          # B * H * T held fixed, so every length does enough work


def causal_flops(batch: int, heads: int, t: int, d: int) -> float:
    return 2.0 * batch * heads * t * t * d


def _time_ms(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def _tflops(flops: float, fn) -> float:
    """flops / time in TFLOP/s, NaN when `fn` cannot run here (say, a backend this build lacks)."""
    try:
        return flops / _time_ms(fn) / 1e9
    except RuntimeError as error:
        print(f"  {type(error).__name__}: {str(error).splitlines()[0]}")
        return math.nan


def _inputs(batch, heads, t, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(batch, heads, t, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3)]


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run(q, k, v):
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


def _max_error(out: torch.Tensor, q, k, v, heads: int = 2) -> float:
    """Largest |out - reference| over the first batch and `heads` heads (the reference in float64)."""
    from flashcourse.checks import reference

    want = reference.attention(q[:1, :heads], k[:1, :heads], v[:1, :heads])
    return float((out[:1, :heads].double() - want).abs().max())


@dataclass
class Row:
    d: int
    t: int
    batch: int
    heads: int
    flash_config: str
    flash: float        # TFLOP/s of flash_attention at its best configuration
    sdpa_flash: float   # TFLOP/s of SDPA's FlashAttention backend
    sdpa_cudnn: float   # TFLOP/s of SDPA's cuDNN backend
    flash_error: float  # max |error| against the float64 reference
    sdpa_error: float
    by_config: dict


def benchmark(dims=(128, 64), lengths=LENGTHS, configs=CONFIGS, heads: int = 32) -> list[Row]:
    """bf16 causal attention: TFLOP/s of flash_attention (best of `configs`) and of SDPA's backends."""
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.triton_flash import flash_attention

    rows = []
    for d in dims:
        for t in lengths:
            batch = max(1, TOKENS // (heads * t))
            q, k, v = _inputs(batch, heads, t, d, torch.bfloat16)
            flops = causal_flops(batch, heads, t, d)
            by_config = {}
            for bm, bn, warps, stages in configs:
                run = lambda: flash_attention(q, k, v, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)  # noqa: E731
                try:
                    by_config[f"{bm}x{bn} w{warps} s{stages}"] = flops / _time_ms(run) / 1e9
                except Exception as error:  # noqa: BLE001  (a config can run out of shared memory)
                    print(f"  {bm}x{bn} w{warps} s{stages}: {type(error).__name__}")
            best = max(by_config, key=by_config.get)
            bm, bn = (int(x) for x in best.split()[0].split("x"))
            warps, stages = int(best.split()[1][1:]), int(best.split()[2][1:])
            flash_out = flash_attention(q, k, v, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            sdpa_flash, sdpa_cudnn = _sdpa(SDPBackend.FLASH_ATTENTION), _sdpa(SDPBackend.CUDNN_ATTENTION)
            row = Row(d, t, batch, heads, best, by_config[best],
                      _tflops(flops, lambda: sdpa_flash(q, k, v)), _tflops(flops, lambda: sdpa_cudnn(q, k, v)),
                      _max_error(flash_out, q, k, v), _max_error(sdpa_flash(q, k, v), q, k, v), by_config)
            print(f"D={d:4d} T={t:6d}: flash {row.flash:6.1f} ({best}), SDPA flash {row.sdpa_flash:6.1f}, "
                  f"cuDNN {row.sdpa_cudnn:6.1f} TFLOP/s", flush=True)
            rows.append(row)
            del q, k, v, flash_out
            torch.cuda.empty_cache()
    return rows


def environment() -> str:
    import triton

    return (f"{datetime.date.today().isoformat()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"triton {triton.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}")


def report(rows: list[Row]) -> str:
    """The benchmark as markdown: one table of the best configurations, one of every configuration."""
    lines = [
        "# flash_attention against SDPA, bf16 causal attention",
        "",
        f"Measured {environment()}.",
        f"B x H x T = {TOKENS} (H = {rows[0].heads}); TFLOP/s = 2 B H T^2 D / time (causal); times by "
        "triton.testing.do_bench; every number from one process. Errors: max |out - reference| over batch 0, "
        "heads 0-1, against the float64 reference.",
        "",
        "| D | T | B | flash_attention TFLOP/s | best blocks | SDPA flash | SDPA cuDNN | flash / SDPA flash "
        "| flash / cuDNN | flash max error | SDPA max error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.d} | {r.t} | {r.batch} | {r.flash:.1f} | {r.flash_config} | {r.sdpa_flash:.1f} | "
                     f"{r.sdpa_cudnn:.1f} | {r.flash / r.sdpa_flash:.2f} | {r.flash / r.sdpa_cudnn:.2f} | "
                     f"{r.flash_error:.2e} | {r.sdpa_error:.2e} |")
    configs = list(rows[0].by_config)
    lines += ["", "flash_attention, TFLOP/s per configuration (BLOCK_M x BLOCK_N, warps, stages):", "",
              "| D | T | " + " | ".join(configs) + " |", "|---|---|" + "---|" * len(configs)]
    for r in rows:
        lines.append(f"| {r.d} | {r.t} | " + " | ".join(f"{r.by_config.get(c, float('nan')):.1f}" for c in configs) + " |")
    return "\n".join(lines) + "\n"


def _unfused():
    """The unfused causal attention of assignment 03 when it has been built, else the course's reference."""
    try:
        from flashcourse.engine.online_attention import causal_attention
        return "causal_attention (unfused)", causal_attention
    except ImportError:
        from flashcourse.checks import reference
        return "reference.attention (unfused, float64)", reference.attention


def sweep(lengths=(512, 1024, 2048, 4096, 8192), d: int = 64, batch: int = 2, heads: int = 16,
          dtype=torch.bfloat16, block_m: int = 128, block_n: int = 64, num_warps: int = 8,
          num_stages: int = 3) -> list[dict]:
    """Time (ms), TFLOP/s and peak memory (MiB, beyond the inputs) of three causal attentions across T."""
    from torch.nn.functional import scaled_dot_product_attention

    from flashcourse.engine.triton_flash import flash_attention

    unfused_name, unfused = _unfused()
    methods = {
        "flash_attention (Triton)": lambda q, k, v: flash_attention(q, k, v, block_m=block_m, block_n=block_n,
                                                                    num_warps=num_warps, num_stages=num_stages),
        "torch SDPA": lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True),
        unfused_name: unfused,
    }
    rows = []
    for t in lengths:
        q, k, v = _inputs(batch, heads, t, d, dtype)
        for name, fn in methods.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                fn(q, k, v)
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                ms = _time_ms(lambda: fn(q, k, v))
            except torch.OutOfMemoryError:
                rows.append(dict(method=name, t=t, ms=math.nan, tflops=math.nan, peak_mib=math.nan))
                torch.cuda.empty_cache()
                continue
            rows.append(dict(method=name, t=t, ms=ms, tflops=causal_flops(batch, heads, t, d) / ms / 1e9,
                             peak_mib=peak))
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], title: str = ""):
    """Two panels against T: TFLOP/s and peak memory (log scale)."""
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(12, 4))
    for name in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == name]
        ts = [r["t"] for r in mine]
        speed.plot(ts, [r["tflops"] for r in mine], "o-", label=name)
        memory.plot(ts, [r["peak_mib"] for r in mine], "o-", label=name)
    for ax in (speed, memory):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T")
        ax.legend()
    speed.set_ylabel("TFLOP/s (causal)")
    speed.set_title("speed")
    memory.set_yscale("log")
    memory.set_ylabel("peak memory beyond the inputs (MiB)")
    memory.set_title("memory")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def tf32_errors(batch: int = 1, heads: int = 4, t: int = 1024, d: int = 64) -> dict:
    """FP32 inputs through flash_attention with each dot precision: max |error| against float64."""
    from flashcourse.checks import core as attention_checks, reference
    from flashcourse.engine.triton_flash import flash_attention

    q, k, v = _inputs(batch, heads, t, d, torch.float32, seed=1)
    want = reference.attention(q, k, v)
    rtol, atol = attention_checks.tolerance(torch.float32)
    errors = {}
    for precision in ("ieee", "tf32x3", "tf32"):
        try:
            got = flash_attention(q, k, v, DOT_PRECISION=precision).double()
        except Exception as error:  # noqa: BLE001  (a Triton build may not offer every precision)
            errors[precision] = {"max_error": math.nan, "passes": False, "error": f"{type(error).__name__}: {error}"}
            continue
        errors[precision] = {"max_error": float((got - want).abs().max()),
                             "passes": bool(((got - want).abs() <= atol + rtol * want.abs()).all())}
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "shape": f"B={batch}, H={heads}, T=S={t}, D={d}, float32", "rtol": rtol, "atol": atol,
            "errors": errors}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(GPU_NEEDED)
        return 1
    text = report(benchmark(args.dims, args.lengths))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0

