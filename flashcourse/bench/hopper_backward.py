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

With --registers: the backward alone with the dK/dV kernel's consumer 1 at 232 registers (consumer 0 then keeps
248) and at 240 (both 240), beside cuDNN's, each the median of five rounds, over the backward's rows and more
lengths without a mask; and whether dk and dv came out the same bits both ways.
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
REGISTER_ROWS = ROWS + [(False, 128, 1024, 32), (False, 128, 4096, 32), (False, 128, 16384, 32), (True, 64, 4096, 32),
                        (False, 64, 8192, 32), (False, 128, 8192, 8)]
REGISTER_SPLITS = (232, 240)   # consumer 1's registers in the dK/dV kernel (hopper_backward's consumer_registers)


def register_column(regs: int) -> str:
    """The --registers run's column of the backward with consumer 1 at `regs` registers."""
    return f"{regs} registers"


REGISTER_COLUMNS = tuple(map(register_column, REGISTER_SPLITS))   # --registers' rows, by split
REGISTER_ROUNDS = 5
BACKWARD = ["06 Triton", "Gluon", "Gluon, atomic dQ", "SDPA cuDNN", "SDPA flash"]
TRAINING = ["flash_attention_train (06)", "hopper_attention_train", "SDPA cuDNN", "SDPA flash"]


def _row_inputs(causal: bool, d: int, t: int, kv_heads: int):
    """(q, k, v, do, the forward's FLOPs, the row's description) for one row: bf16, seeded, B x T = TOKENS."""
    batch = max(1, TOKENS // t)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(batch, Q_HEADS, t, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "qo")
    k, v = (torch.randn(batch, kv_heads, t, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv")
    flops = (2.0 if causal else 4.0) * batch * Q_HEADS * t * t * d
    return q, k, v, do, flops, dict(causal=causal, d=d, t=t, q_heads=Q_HEADS, kv_heads=kv_heads, batch=batch)


def measure_row(causal: bool, d: int, t: int, kv_heads: int) -> dict:
    from torch.nn.attention import SDPBackend

    from flashcourse.engine import backward as step06
    from flashcourse.engine.hopper import hopper_attention_lse
    from flashcourse.engine.hopper_backward import hopper_attention_train, hopper_backward

    q, k, v, do, flops, row = _row_inputs(causal, d, t, kv_heads)
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


def measure_registers_row(causal: bool, d: int, t: int, kv_heads: int) -> dict:
    """The backward alone (TFLOP/s) with consumer 1 at each of REGISTER_SPLITS, and cuDNN's."""
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.hopper import hopper_attention_lse
    from flashcourse.engine.hopper_backward import hopper_backward

    q, k, v, do, flops, row = _row_inputs(causal, d, t, kv_heads)
    o, lse = hopper_attention_lse(q, k, v, causal=causal, fallback=False)
    timings = {column: functools.partial(hopper_backward, q, k, v, o, lse, do, causal=causal, fallback=False,
                                         consumer_registers=regs)
               for column, regs in zip(REGISTER_COLUMNS, REGISTER_SPLITS)}
    grads = [fn() for fn in timings.values()]
    row["dk, dv identical"] = all(torch.equal(a, b) for a, b in zip(grads[0][1:], grads[1][1:]))
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    sdpa = _sdpa(SDPBackend.CUDNN_ATTENTION, causal, kv_heads != Q_HEADS)
    timings["SDPA cuDNN"] = functools.partial(torch.autograd.grad, sdpa(qg, kg, vg), (qg, kg, vg), do,
                                              retain_graph=True)
    _time_row(row, timings, 2.5 * flops, rounds=REGISTER_ROUNDS)
    first, second = REGISTER_COLUMNS
    print(f"  {_shape(row)}: " + ", ".join(f"{n} {row[n]:.0f}" for n in timings)
          + f"; {second} / {first} {row[second] / row[first]:.3f}; dk, dv identical {row['dk, dv identical']}",
          flush=True)
    return row


def _forward_backward(attention, q, k, v, do):
    """One training step's attention: the forward, then the gradients of q, k and v for the output's gradient do."""
    return torch.autograd.grad(attention(q, k, v), (q, k, v), do)


def _measure(key: str, rows: list, measure_one):
    """A measure for report_main: measure_one(*row) for each of rows into result[key], saved after each."""
    def measure(args) -> dict:
        result = {"environment": environment(), key: []}
        for row in rows:
            result[key].append(measure_one(*row))
            save_json(result, args.json)
        return result
    return measure


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


def registers_report(result: dict) -> str:
    """--registers' table as markdown."""
    first, second = REGISTER_COLUMNS
    lines = report_opening(
        "# The dK/dV kernel's register split (08, step 8)", result["environment"],
        __doc__.split("\n\n")[3].replace("\n", " "), "## Backward pass alone (TFLOP/s)")
    lines += [f"| shape | {first} | {second} | SDPA cuDNN | {second} / {first} | {first} / cuDNN | {second} / cuDNN "
              "| dk, dv identical |", "|---" * 8 + "|"]
    lines += [f"| {_shape(r)} | {r[first]:.0f} | {r[second]:.0f} | {r['SDPA cuDNN']:.0f} | {r[second] / r[first]:.3f} | "
              f"{r[first] / r['SDPA cuDNN']:.3f} | {r[second] / r['SDPA cuDNN']:.3f} | "
              f"{'yes' if r['dk, dv identical'] else 'no'} |" for r in result["registers"]]
    return "\n".join(lines) + "\n"


def registers_plot(result: dict, path: str | None = None):
    """--registers' figures: each split's TFLOP/s over cuDNN's, per shape."""
    def around_one(ax, plt):
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_ylim(0.8, 1.05)                        # the splits differ by a few percent
        plt.setp(ax.get_xticklabels(), rotation=25, ha="right", fontsize=8)

    rows = result["registers"]
    return _bars(result, [_shape(r) for r in rows],
                 {f"consumer 1 at {regs}": [r[column] / r["SDPA cuDNN"] for r in rows]
                  for column, regs in zip(REGISTER_COLUMNS, REGISTER_SPLITS)},
                 "backward / cuDNN's", "The dK/dV kernel's register split", path, width=12, touch=around_one)


def plot(result: dict, path: str | None = None):
    """The backward's TFLOP/s per shape, one bar per implementation."""
    rows = result["rows"]
    return _bars(result, [_shape(r) for r in rows], {name: [r[f"{name} bwd"] for r in rows] for name in BACKWARD},
                 "backward TFLOP/s", "The backward pass alone, bf16", path,
                 touch=lambda ax, plt: ax.tick_params(axis="x", labelsize=8))


def _bars(result: dict, labels, series: dict, ylabel: str, title: str, path: str | None, touch, width: float = 11):
    """Grouped bars, one group per label and one bar per series, with the run's environment under the title;
    touch(ax, plt) adds a figure's own details; written to path where given."""
    import matplotlib

    if path:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, 4.5))
    grouped_bars(ax, labels, series)
    touch(ax, plt)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{result['environment']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


def main(argv=None) -> int:
    parser = report_parser(__doc__)
    parser.add_argument("--registers", action="store_true", help="time the dK/dV kernel's two register splits")
    args = parser.parse_args(argv)
    if args.registers:
        return report_main(args, _measure("registers", REGISTER_ROWS, measure_registers_row), registers_report,
                           registers_plot)
    return report_main(args, _measure("rows", ROWS, measure_row), report, plot)


if __name__ == "__main__":
    raise SystemExit(main())
