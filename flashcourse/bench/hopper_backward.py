"""08's Gluon backward (hopper_backward) beside 06's Triton kernels, cuDNN and FlashAttention-2, on a Hopper GPU.

    python -m flashcourse.bench.hopper_backward --out benchmarks/results/DATE-GPU-hopper-backward.md \
        --json flashcourse/bench/measured/hopper_backward.json

Every number from one process, bf16, Hq = 32, T = S, B x T = 32k. Per row: the backward pass alone (the
course's kernels given the same o and lse from hopper_attention_lse; SDPA through torch.autograd.grad of a kept
output), forward and backward through autograd, and the largest error of the Gluon gradients against FP32
autograd of the naive attention. FLOPs as in 06's benchmark: forward 4 B Hq T S D (half of it causal), the
backward 2.5 times that. Times by triton.testing.do_bench (L2 flushed before each run), each the median of three
rounds (in runs saved before 2026-12-07, the best of three) over every implementation in turn, every other
round in reverse order, each pair of rounds starting one place later.
"""

from __future__ import annotations

import functools

import torch

from flashcourse.bench import environment
from flashcourse.bench.fast import _sdpa, _time_row   # SDPA held to one backend; rounds in turn
from flashcourse.bench.gradients import gradient_error
from flashcourse.bench.reports import grouped_bars, report_main, report_opening, report_parser, save_json

TOKENS = 32 * 1024          # B * T held fixed
Q_HEADS = 32
ROUNDS = 3                  # each time the median of three rounds: the GPU's speed drifts from one second to the next
ROWS = [  # (causal, D, T, Hkv): 06's benchmark rows that the backward's goal names
    (True, 128, 1024, 32), (True, 128, 4096, 32), (True, 128, 8192, 32), (True, 128, 16384, 32),
    (False, 128, 8192, 32), (True, 64, 8192, 32), (True, 128, 8192, 8)]
BACKWARD = ["06 Triton", "Gluon", "Gluon, atomic dQ", "SDPA cuDNN", "SDPA flash"]
TRAINING = ["flash_attention_train (06)", "hopper_attention_train", "SDPA cuDNN", "SDPA flash"]


def measure_row(causal: bool, d: int, t: int, kv_heads: int) -> dict:
    from torch.nn.attention import SDPBackend

    from flashcourse.engine import backward as step06
    from flashcourse.engine.hopper import hopper_attention_lse
    from flashcourse.engine.hopper_backward import hopper_attention_train, hopper_backward

    batch = max(1, TOKENS // t)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(batch, Q_HEADS, t, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "qo")
    k, v = (torch.randn(batch, kv_heads, t, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv")
    flops = (2.0 if causal else 4.0) * batch * Q_HEADS * t * t * d
    row = dict(causal=causal, d=d, t=t, q_heads=Q_HEADS, kv_heads=kv_heads, batch=batch)
    o, lse = hopper_attention_lse(q, k, v, causal=causal, fallback=False)
    kernels = {"06 Triton": lambda: step06.flash_attention_backward(q, k, v, o, lse, do, causal=causal),
               "Gluon": lambda: hopper_backward(q, k, v, o, lse, do, causal=causal, atomic_dq=False, fallback=False),
               "Gluon, atomic dQ": lambda: hopper_backward(q, k, v, o, lse, do, causal=causal, atomic_dq=True,
                                                           fallback=False)}
    timings = {f"{name} bwd": fn for name, fn in kernels.items()}
    row["Gluon error"] = gradient_error(kernels["Gluon"](), q, k, v, do, causal)
    row["Gluon, atomic dQ error"] = gradient_error(kernels["Gluon, atomic dQ"](), q, k, v, do, causal)
    trains = {"flash_attention_train (06)": lambda q, k, v: step06.flash_attention_train(q, k, v, causal=causal),
              "hopper_attention_train": lambda q, k, v: hopper_attention_train(q, k, v, causal=causal),
              "SDPA cuDNN": _sdpa(SDPBackend.CUDNN_ATTENTION, causal, kv_heads != Q_HEADS),
              "SDPA flash": _sdpa(SDPBackend.FLASH_ATTENTION, causal, kv_heads != Q_HEADS)}
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    for name, fn in trains.items():
        if name.startswith("SDPA"):   # the backward alone, through a kept output
            timings[f"{name} bwd"] = functools.partial(torch.autograd.grad, fn(qg, kg, vg), (qg, kg, vg), do,
                                                       retain_graph=True)
        timings[f"{name} fwd+bwd"] = functools.partial(_forward_backward, fn, qg, kg, vg, do)
    work = {key: (3.5 if key.endswith("fwd+bwd") else 2.5) * flops for key in timings}
    _time_row(row, timings, work, rounds=ROUNDS)
    print(f"  {'causal' if causal else 'full  '} D={d} T={t:5d} {Q_HEADS}/{kv_heads}: backward "
          + ", ".join(f"{n} {row[n + ' bwd']:.0f}" for n in BACKWARD)
          + f"; Gluon / cuDNN {row['Gluon bwd'] / row['SDPA cuDNN bwd']:.2f}, atomic dQ / cuDNN "
          + f"{row['Gluon, atomic dQ bwd'] / row['SDPA cuDNN bwd']:.2f}; error {row['Gluon error']:.1e}",
          flush=True)
    return row


def _forward_backward(attention, q, k, v, do):
    """One training step's attention: the forward, then the gradients of q, k and v for the output's gradient do."""
    return torch.autograd.grad(attention(q, k, v), (q, k, v), do)


def _measure_all(args) -> dict:
    result = {"environment": environment(), "rows": []}
    for causal, d, t, kv_heads in ROWS:
        result["rows"].append(measure_row(causal, d, t, kv_heads))
        save_json(result, args.json)
    return result


def _shape(r: dict) -> str:
    return f"{'causal' if r['causal'] else 'not causal'} D{r['d']} T{r['t'] // 1024}k {r['q_heads']}/{r['kv_heads']}"


def report(result: dict) -> str:
    """The measurements as markdown tables."""
    lines = report_opening(
        "# The backward pass in Gluon (08, step 8) against 06's kernels, cuDNN and FlashAttention-2",
        result["environment"], __doc__.split("\n\n")[2].replace("\n", " "), "## Backward pass alone (TFLOP/s)")
    lines += ["| shape | " + " | ".join(BACKWARD) + " | Gluon / cuDNN | atomic dQ / cuDNN | Gluon / 06 | Gluon error |",
              "|---" * (len(BACKWARD) + 5) + "|"]
    lines += [f"| {_shape(r)} | " + " | ".join(f"{r[n + ' bwd']:.0f}" for n in BACKWARD)
              + f" | {r['Gluon bwd'] / r['SDPA cuDNN bwd']:.2f} | {r['Gluon, atomic dQ bwd'] / r['SDPA cuDNN bwd']:.2f}"
              + f" | {r['Gluon bwd'] / r['06 Triton bwd']:.2f} | {r['Gluon error']:.1e} |" for r in result["rows"]]
    lines += ["", "## Forward and backward through autograd (TFLOP/s, 3.5 times the forward's FLOPs)", "",
              "| shape | " + " | ".join(TRAINING) + " | hopper / cuDNN |", "|---" * (len(TRAINING) + 2) + "|"]
    lines += [f"| {_shape(r)} | " + " | ".join(f"{r[n + ' fwd+bwd']:.0f}" for n in TRAINING)
              + f" | {r['hopper_attention_train fwd+bwd'] / r['SDPA cuDNN fwd+bwd']:.2f} |" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str | None = None):
    """The backward's TFLOP/s per shape, one bar per implementation."""
    import matplotlib

    if path:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    grouped_bars(ax, [_shape(r) for r in rows], {name: [r[f"{name} bwd"] for r in rows] for name in BACKWARD})
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("backward TFLOP/s")
    ax.set_title(f"The backward pass alone, bf16\n{result['environment']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


def main(argv=None) -> int:
    return report_main(report_parser(__doc__).parse_args(argv), _measure_all, report, plot)


if __name__ == "__main__":
    raise SystemExit(main())
