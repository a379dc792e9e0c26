"""The backward kernels of assignment 06 against torch's SDPA backends, on a CUDA GPU.

    python -m instructor.bench_backward --out benchmarks/results/DATE-GPU-backward.md \
        --json flashcourse/bench/measured/backward.json --png flashcourse/bench/measured/backward.png   (what 06 shows on a CPU)

Every number from one process:

- speed: bf16, GQA 32/8, causal and not, D = 64 and 128, T = S = 1k..16k (B x T fixed): the backward
  pass alone and the forward plus backward, in TFLOP/s, for flash_attention_backward and for SDPA's
  flash (FlashAttention-2) and cuDNN backends, each with the max |error| of dq, dk and dv against FP32;
- dq: the separate dQ kernel against dQ accumulated with atomics inside the dK/dV kernel;
- memory: peak memory of one forward and backward, beyond the inputs, against the naive attention
  that materializes the [T, S] scores (and SDPA's flash backend).

FLOPs (the FlashAttention papers' convention): forward 4 B Hq T S D, half of it when causal; the
backward pass does 2.5 times the forward's matrix work (five products of T x S x D instead of two).
Times by triton.testing.do_bench (L2 flushed before each run).
"""

from __future__ import annotations

import functools
import math

import torch

from flashcourse.bench import environment
from flashcourse.bench.gradients import gradient_error, gradients, naive_attention
from flashcourse.bench.reports import label_panel, report_main, report_opening, report_parser, save_json

TOKENS = 4 * 8192               # B * T held fixed
LENGTHS = (1024, 2048, 4096, 8192, 16384)
SPEED = [(causal, d) for causal in (True, False) for d in (128, 64)]  # (causal, D), each over LENGTHS
Q_HEADS, KV_HEADS = 32, 8
BACKWARD_FACTOR = 2.5           # backward FLOPs / forward FLOPs


@functools.cache
def engine():
    """The course's backward kernels (flash_attention_lse, flash_attention_backward, flash_attention_train):
    flashcourse.engine.backward, exported from 06's notebook."""
    from flashcourse.engine import backward

    return backward


def forward_flops(batch: int, q_heads: int, t: int, s: int, d: int, causal: bool) -> float:
    """Two products of 2 T S D each per head; causal (T = S) keeps half of them."""
    return (2.0 if causal else 4.0) * batch * q_heads * t * s * d


def _ms(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def _or_nan(fn) -> float:
    """_ms(fn), NaN when an implementation refuses the shape."""
    try:
        return _ms(fn)
    except (RuntimeError, ValueError) as error:
        print(f"    skipped: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
        return math.nan


def _inputs(batch, q_heads, kv_heads, t, s, d, dtype, seed=0):
    """q, k, v and an output gradient do, seeded, on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, q_heads, t, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, kv_heads, s, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, kv_heads, s, d, device="cuda", dtype=dtype, generator=gen)
    do = torch.randn(batch, q_heads, t, d, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, do


def sdpa(backend, causal: bool):
    """SDPA restricted to one backend (GQA through enable_gqa)."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run(q, k, v):
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return run


def speed(grid=SPEED, lengths=LENGTHS, rows=None, done=lambda: None) -> list[dict]:
    """Backward and forward+backward TFLOP/s of the course's kernels and of SDPA's flash and cuDNN backends."""
    from torch.nn.attention import SDPBackend

    bw = engine()
    rows = [] if rows is None else rows
    for causal, d in grid:
        for t in lengths:
            batch = max(1, TOKENS // t)
            q, k, v, do = _inputs(batch, Q_HEADS, KV_HEADS, t, t, d, torch.bfloat16)
            flops = forward_flops(batch, Q_HEADS, t, t, d, causal)
            impls = {"course": lambda q, k, v: bw.flash_attention_train(q, k, v, causal=causal),
                     "SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION, causal),
                     "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION, causal)}
            row = dict(causal=causal, d=d, q_heads=Q_HEADS, kv_heads=KV_HEADS, t=t, batch=batch)
            for name, fn in impls.items():
                try:
                    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                    out = fn(qg, kg, vg)
                    backward = _ms(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
                    both = _ms(lambda: torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), do))
                    row[f"{name} error"] = gradient_error(gradients(fn, q, k, v, do), q, k, v, do, causal)
                    del out
                except (RuntimeError, ValueError) as error:
                    print(f"    {name} skipped: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
                    backward = both = row[f"{name} error"] = math.nan
                row[f"{name} bwd"] = BACKWARD_FACTOR * flops / backward / 1e9
                row[f"{name} fwd+bwd"] = (1 + BACKWARD_FACTOR) * flops / both / 1e9
            row["dkdv config"] = str(bw.dkdv_tuned.best_config)
            row["dq config"] = str(bw.dq_tuned.best_config)
            rows.append(row)
            done()
            print(f"  {'causal' if causal else 'full  '} D={d} T={t:5d} B={batch:2d}: backward "
                  + ", ".join(f"{n} {row[n + ' bwd']:.0f}" for n in impls) + "; fwd+bwd "
                  + ", ".join(f"{n} {row[n + ' fwd+bwd']:.0f}" for n in impls)
                  + f"; errors {row['course error']:.1e} / {row['SDPA flash error']:.1e} / {row['SDPA cuDNN error']:.1e}",
                  flush=True)
            del q, k, v, do
            torch.cuda.empty_cache()
    return rows


def dq_choice(lengths=(1024, 4096, 16384), d: int = 128, rows=None, done=lambda: None) -> list[dict]:
    """The backward pass with dQ from its own kernel and with dQ by atomics, causal, bf16 (TFLOP/s)."""
    bw = engine()
    rows = [] if rows is None else rows
    for t in lengths:
        batch = max(1, TOKENS // t)
        q, k, v, do = _inputs(batch, Q_HEADS, KV_HEADS, t, t, d, torch.bfloat16)
        o, lse = bw.flash_attention_lse(q, k, v)
        flops = BACKWARD_FACTOR * forward_flops(batch, Q_HEADS, t, t, d, True)
        row = dict(d=d, t=t, batch=batch)
        for name, atomic in (("dq kernel", False), ("atomic dq", True)):
            row[name] = flops / _ms(lambda: bw.flash_attention_backward(q, k, v, o, lse, do, atomic_dq=atomic)) / 1e9
        rows.append(row)
        done()
        print(f"  dq D={d} T={t:5d}: dq kernel {row['dq kernel']:.0f}, atomics {row['atomic dq']:.0f} TFLOP/s", flush=True)
        del q, k, v, do, o, lse
        torch.cuda.empty_cache()
    return rows


def memory(lengths=LENGTHS, d: int = 128, batch: int = 1) -> list[dict]:
    """Peak memory (MiB) of one causal forward and backward, beyond the inputs, bf16, GQA 32/8."""
    from torch.nn.attention import SDPBackend

    bw = engine()
    impls = {"course": lambda q, k, v: bw.flash_attention_train(q, k, v),
             "SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION, True),
             "naive": naive_attention}
    rows = []
    for t in lengths:
        q, k, v, do = _inputs(batch, Q_HEADS, KV_HEADS, t, t, d, torch.bfloat16)
        row = dict(t=t, d=d, batch=batch)
        for name, fn in impls.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                grads = gradients(fn, q, k, v, do)
                torch.cuda.synchronize()
                row[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
                del grads
            except torch.OutOfMemoryError:
                row[name] = math.nan
            torch.cuda.empty_cache()
        rows.append(row)
        print(f"  memory T={t:5d}: " + ", ".join(f"{n} {row[n]:.0f} MiB" for n in impls), flush=True)
        del q, k, v, do
    return rows


def _fmt_config(text: str) -> str:
    """'BLOCK_M: 32, BLOCK_N: 128, num_warps: 4, ..., num_stages: 3, ...' -> '32x128 w4 s3'."""
    fields = dict(part.split(": ") for part in text.split(", ") if ": " in part)
    return f"{fields.get('BLOCK_M')}x{fields.get('BLOCK_N')} w{fields.get('num_warps')} s{fields.get('num_stages')}"


SPEED_NAMES = ("course", "SDPA flash", "SDPA cuDNN")


def _speed_table(rows: list[dict], kind: str, extra: dict) -> list[str]:
    """A markdown table of `kind` ("bwd" or "fwd+bwd") TFLOP/s per shape, the course's ratios to SDPA's two
    backends, then the `extra` columns ({header: row -> text})."""
    header = ["causal", "D", "T", *SPEED_NAMES, "course / SDPA flash", "course / cuDNN", *extra]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for r in rows:
        cells = ["yes" if r["causal"] else "no", r["d"], r["t"], *(f"{r[f'{n} {kind}']:.1f}" for n in SPEED_NAMES),
                 f"{r[f'course {kind}'] / r[f'SDPA flash {kind}']:.2f}",
                 f"{r[f'course {kind}'] / r[f'SDPA cuDNN {kind}']:.2f}", *(column(r) for column in extra.values())]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def report(result: dict) -> str:
    """The measurements as markdown tables."""
    lines = report_opening(
        "# The backward kernels (assignment 06) against SDPA", result["environment"],
        "bf16, Hq = 32, Hkv = 8, T = S, B x T = %d. Forward FLOPs 4 B Hq T^2 D (2 B Hq T^2 D causal); backward "
        "FLOPs 2.5 times those; TFLOP/s by triton.testing.do_bench (L2 flushed before each run), every number "
        "from one process. Backward: torch.autograd.grad of a kept output; forward+backward: both, through "
        "autograd (the course's kernels through flash_attention_train). Errors: max |error| of dq, dk and dv "
        "over batch 0 and KV head 0 with its 4 query heads, against FP32 autograd of the naive attention." % TOKENS,
        "The course's forward pass is flash_attention_lse, the kernel given in 06 (fixed 64 x 64 blocks on a "
        "GPU, no autotuning), which stores the log-sum-exp; its backward kernels are autotuned.",
        "## Backward pass (TFLOP/s)")
    errors = {f"{n} error": (lambda r, n=n: f"{r[n + ' error']:.1e}") for n in SPEED_NAMES}
    lines += _speed_table(result["speed"], "bwd", {"B": lambda r: r["batch"], **errors,
                                                   "dK/dV blocks": lambda r: _fmt_config(r["dkdv config"]),
                                                   "dQ blocks": lambda r: _fmt_config(r["dq config"])})
    lines += ["", "## Forward and backward (TFLOP/s)", ""]
    lines += _speed_table(result["speed"], "fwd+bwd", {})
    lines += ["", "## dQ: its own kernel or atomics (backward TFLOP/s, causal)", "",
              "| D | T | B | dQ kernel | atomic dQ |", "|---|---|---|---|---|"]
    lines += [f"| {r['d']} | {r['t']} | {r['batch']} | {r['dq kernel']:.1f} | {r['atomic dq']:.1f} |"
              for r in result["dq"]]
    lines += ["", "## Peak memory of one forward and backward beyond the inputs (MiB; causal, D = 128, B = 1)", "",
              "| T | course | SDPA flash | naive | naive / course |", "|---|---|---|---|---|"]
    lines += [f"| {r['t']} | {r['course']:.0f} | {r['SDPA flash']:.0f} | {r['naive']:.0f} | {r['naive'] / r['course']:.0f} |"
              for r in result["memory"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str):
    """Backward TFLOP/s against T (one panel per causal x D) and peak memory against T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(24, 4.5))
    for ax, (causal, d) in zip(axes, SPEED):
        rows = [r for r in result["speed"] if r["causal"] == causal and r["d"] == d]
        for name in ("course", "SDPA flash", "SDPA cuDNN"):
            ax.plot([r["t"] for r in rows], [r[f"{name} bwd"] for r in rows], "o-", label=name)
        label_panel(ax, "T = S", "backward TFLOP/s", f"backward: bf16, {'causal' if causal else 'not causal'}, D={d}, "
                    "Hq/Hkv=32/8")
    ax = axes[-1]
    for name in ("course", "SDPA flash", "naive"):
        ax.plot([r["t"] for r in result["memory"]], [r[name] for r in result["memory"]], "o-", label=name)
    label_panel(ax, "T = S", "peak MiB beyond the inputs", "forward + backward memory: causal, D=128, B=1")
    ax.set_yscale("log")
    fig.suptitle(result["environment"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return fig


def _measure_all(args) -> dict:
    """speed, dq and memory over --lengths, saved to --json after every row."""
    result = {"environment": environment(), "speed": [], "dq": [], "memory": []}

    def save():
        save_json(result, args.json)
    print("speed", flush=True)
    speed(lengths=args.lengths, rows=result["speed"], done=save)
    print("dq", flush=True)
    dq_choice(lengths=[t for t in (1024, 4096, 16384) if t in args.lengths] or args.lengths[:1],
              rows=result["dq"], done=save)
    print("memory", flush=True)
    result["memory"] = memory(args.lengths)
    save()
    return result


def main(argv=None) -> int:
    parser = report_parser(__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    return report_main(parser.parse_args(argv), _measure_all, report, plot)


if __name__ == "__main__":
    raise SystemExit(main())
