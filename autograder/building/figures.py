"""Figures quoted in the notebooks' text, each computed from a measurement committed to the repository.

An author quotes a figure in a markdown cell of source/ by writing its value followed by its name in an
HTML comment, which Jupyter and nbconvert do not display:

    the fast kernel ran at 541<!--fig:fast.prefill.tflops_8k--> TFLOP/s

FIGURES maps each name to the file it comes from and how the value is computed from that file.
`python -m autograder build` rewrites every quoted value from its source (write_figures), so the
released notebook and the solution say what the results say; `build --check` and tests/test_figures.py
fail when a quoted value differs from its source (drift), when a name is unknown, or when a figure is
defined and never quoted.
"""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import nbformat

from autograder import ROOT

# A value (digits, an optional decimal part) directly before <!--fig:name-->; empty the first time.
MARKER = re.compile(r"(?P<value>\d+(?:\.\d+)?)?<!--fig:(?P<name>[\w.\-]+)-->")

FAST = "flashcourse/bench/measured/fast.json"                       # 05's benchmark, shipped with the package
FAST_REPORT = "benchmarks/results/2026-11-29-h200-fast.md"     # the same run's report, with that day's notes
FLASH_REPORT = "benchmarks/results/2026-11-29-h200.md"         # 04's kernel against SDPA
SWEEP_04 = "solutions/04_triton_flash/sweep.json"              # 04's own sweep on the GPU
LAST_GAP = "flashcourse/bench/measured/fast_last_gap.json"            # 08: causal grid, FP8 errors, grid tail
PROFILE = "flashcourse/bench/measured/fast_profile.json"              # Nsight Compute at T = 1k and 16k, reduced
RING_REPORT = "benchmarks/results/2026-11-30-h200x2-ring-05.md"   # 07's ring on two H200s (bench_ring)
LPT_GROUPS = "flashcourse/bench/measured/fast_lpt_groups.json"        # longest first in L2-sized head groups
LAST_GAP_2 = "flashcourse/bench/measured/fast_last_gap_2.json"        # 05's given steps: the grid with the lse forward, decode
HOPPER = "flashcourse/bench/measured/fast_hopper.json"              # 08: hopper_attention (Gluon) on the prefill grid
HOPPER_REPORT = "benchmarks/results/2026-12-01-h200-hopper-gluon.md"  # 08: the same run, and the versions before it
CONSUMERS = "benchmarks/results/2026-12-05-h100-hopper-consumers.json"  # 08: two consumer warpgroups or three, D = 64
OVERLAP = "benchmarks/results/2026-12-05-h100-hopper-overlap.json"      # 08: items one at a time or overlapped
FUSED = "flashcourse/bench/measured/fast_decode_fused.json"        # 05's given steps: decode in one launch against two
TRAINING_SEEDS = "flashcourse/bench/measured/training_seeds.json"   # 06: the GPT from three seeds, three attentions
BACKWARD = "flashcourse/bench/measured/backward.json"               # 06: the backward kernels against SDPA (bench_backward)
FP8_PREPARE = "benchmarks/results/2026-12-04-h200-fp8-fused-quantize.json"  # 08: one-pass quantize, FP8 end to end
FP8_GLUON = "benchmarks/results/2026-12-05-h200-fp8-gluon.json"    # 08: the same, FP8 in step 5's Gluon schedule
FP8_ROUNDING = "benchmarks/results/2026-12-06-h100-fp8-gpu-rounding.json"  # 08: the same, rounded by the GPU's cvt
FP8_SCHEDULE = "flashcourse/bench/measured/fp8_schedule.json"    # 08: FP8 with persistent, overlap, o by TMA
FP8_SCHEDULE_END = "benchmarks/results/2026-12-06-h100-fp8-schedule-end-to-end.json"  # 08: fp8_attention with it
FP8_NCU = "benchmarks/results/2026-12-06-h100-fp8-ncu.json"   # 08: Nsight Compute, hopper_fp8_forward beside bf16
FP8_Q_IN_KERNEL = "benchmarks/results/2026-12-07-h100-fp8-q-in-kernel.json"  # 08: FP8 with Q quantized in the kernel
FP8_RUN_A = "benchmarks/results/2026-12-07-h100-fp8-end-to-end-run-a.json"  # 08: the same kernels, a later run
FP8_RUN_B = "benchmarks/results/2026-12-07-h100-fp8-end-to-end-run-b.json"  # 08: and the run after it
FP8_SASS = "benchmarks/results/2026-12-07-h100-fp8-sass-stalls.json"  # 08: FP8 and bf16 by SASS opcode
FP8_RELABELLED = "benchmarks/results/2026-12-07-h100-fp8-relabelled-keys.json"  # 08: P's keys relabelled
FP8_LANDED = "benchmarks/results/2026-12-07-h100-fp8-relabelled-landed.json"  # 08: the same in the course's kernel
FP8_LANDED_END = "benchmarks/results/2026-12-07-h100-fp8-end-to-end-relabelled.json"  # 08: fp8_attention with it
TRITON39_PTXAS = "benchmarks/results/2026-12-07-h100-triton39-ptxas.json"  # 08: Triton 3.9's PTX, each ptxas
PV_FIRST_SWAPPED = "benchmarks/results/2026-12-07-h100-fp8-pv-first-backward-swapped-d64.json"  # 08: two variants
KEY_TILES_64 = "benchmarks/results/2026-12-06-h100-forward-d64-key-tiles.json"  # 08: D = 64, tiles of 64 keys
CONSUMERS_SPLIT = "benchmarks/results/2026-12-06-h100-hopper-consumers-after-split.json"  # 08: the same, later
CONSUMERS_SIX = "benchmarks/results/2026-12-06-h100-hopper-consumers-six-rounds.json"  # 08: the same, six rounds
BARRIERS = "benchmarks/results/2026-12-06-h100-forward-barriers.json"  # 08: barrier stalls, Triton's bar.syncs dropped
BACKWARD_PERSISTENT = "benchmarks/results/2026-12-06-h100-backward-persistent.json"  # 08, step 8: persistent dK/dV
HOPPER_BACKWARD = "flashcourse/bench/measured/hopper_backward.json"  # 08, step 8: the Gluon backward (bench.hopper_backward)
HOPPER_BACKWARD_FIRST = "benchmarks/results/2026-12-04-h200-hopper-backward.json"  # 08, step 8: its first version
TRAINING_HOPPER = "flashcourse/bench/measured/training_seeds_hopper.json"  # 08, step 8: the GPT through it, three seeds
ARRANGEMENT = "benchmarks/results/2026-12-06-h100-backward-arrangement.json"  # 08, step 8: S^T or S, ping-pong
TMA_DQ = "benchmarks/results/2026-12-06-h100-backward-tma-dq.json"    # 08, step 8: dQ added by TMA or atomics
DQ_LATER = "benchmarks/results/2026-12-06-h100-backward-dq-later.json"  # 08, step 8: dQ's product a tile later
REGISTERS = "benchmarks/results/2026-12-07-h100-backward-registers.json"  # 08, step 8: the dK/dV kernel's registers
P_COPY = "benchmarks/results/2026-12-07-h100-backward-p16-longest-first.json"  # 08, step 8: dS from P's copy
BACKWARD_NCU = "benchmarks/results/2026-12-06-h100-backward-ncu.json"   # 08, step 8: Nsight Compute, causal D128 8k
FORWARD_NCU = "benchmarks/results/2026-12-06-h100-forward-ncu.json"     # 08: Nsight Compute, the forward at T = 1k, 4k
TMA_STORE = "benchmarks/results/2026-12-06-h100-forward-tma-store.json"  # 08: o written by TMA, a scratch copy
TMA_STORE_GRID = "benchmarks/results/2026-12-06-h100-hopper-tma-store.json"  # 08: the same in hopper_attention
MASK_SPLIT = "benchmarks/results/2026-12-06-h100-mask-split.json"  # 08: tiles without mask code, loops of their own
SAME_KERNEL = "benchmarks/results/2026-12-07-h200-same-kernel-rounds.json"  # 08: one kernel in three columns, rounds
FMA_EXP = "benchmarks/results/2026-12-07-h100-forward-exp2-on-fma.json"  # 08: exponentials on the FMA pipe
PINGPONG_D64 = "benchmarks/results/2026-12-07-h100-forward-d64-pingpong.json"  # 08: the ping-pong at D = 64
TRIALS = "flashcourse/bench/measured/fast_trials.json"                # the lse forward's configs one by one, the decode sweep
SOLUTION_03 = "solutions/03_online_attention/03_online_attention.ipynb"
MEMORY_CELL_03 = "b539a25b"                                    # 03's cell that measures the peaks


@dataclass(frozen=True)
class Figure:
    """One quoted figure: the file it comes from, the value computed from that file, the decimals shown."""

    source: str                            # relative to the repository root
    compute: Callable[[Any], float]        # the loaded source -> the value
    decimals: int = 0

    def text(self) -> str:
        return f"{self.compute(load(self.source)):.{self.decimals}f}"


@dataclass(frozen=True)
class Report:
    """A results file in markdown: its text and its tables, each a list of {column: cell} rows."""

    text: str
    tables: list[list[dict[str, str]]]


def _markdown(text: str) -> Report:
    tables, rows, header = [], None, None
    for line in text.splitlines():
        if not line.startswith("|"):
            rows = header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header, rows = cells, []
            tables.append(rows)
        elif not all(set(c) <= set("-:") for c in cells):
            rows.append(dict(zip(header, cells)))
    return Report(text, tables)


def _notebook_stdout(path: Path) -> dict[str, str]:
    """An executed notebook's printed output, per cell id."""
    nb = nbformat.read(path, as_version=4)
    return {cell.get("id"): "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("name") == "stdout")
            for cell in nb.cells if cell.cell_type == "code"}


def load(source: str):
    """A source file, parsed: JSON as data, markdown as a Report, an executed notebook as its stdout per cell."""
    path = ROOT / source
    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix == ".md":
        return _markdown(path.read_text())
    if path.suffix == ".ipynb":
        return _notebook_stdout(path)
    raise ValueError(f"figures: no reader for {source}")


# --- how each figure is computed from its source -------------------------------------------------------

def _step(data, name: str) -> float:
    return next(s["tflops"] for s in data["steps"] if s["step"].startswith(name))


def _step_gain(before: str, after: str) -> Callable[[Any], float]:
    """The percentage one step of 05's table adds to the step before it."""
    return lambda data: 100 * (_step(data, after) / _step(data, before) - 1)


def _matches(record: dict, fields: dict) -> bool:
    """Whether each of `fields` has the same value in record (a row of a results file, a profiled kernel)."""
    return all(record[key] == value for key, value in fields.items())


def _split_ratios(data, t_from: int = 0, t_below: float = math.inf, **fields) -> list[float]:
    """Consumer 1 at 240 registers over 232 (the --registers run), on its rows with t_from <= T < t_below whose
    fields equal `fields`."""
    from flashcourse.bench.hopper_backward import REGISTER_COLUMNS

    fewer, more = REGISTER_COLUMNS
    return [r[more] / r[fewer] for r in data["registers"] if t_from <= r["t"] < t_below and _matches(r, fields)]


def _chosen_split_of_cudnn(data) -> list[float]:
    """The backward with dkdv_registers' split over cuDNN's, on every row of the --registers run."""
    from flashcourse.bench.hopper_backward import register_column
    from flashcourse.engine.hopper_backward import ONE_KERNEL_FROM_T, dkdv_registers

    return [r[register_column(dkdv_registers(r["d"], r["causal"], r["t"] >= ONE_KERNEL_FROM_T))] / r["SDPA cuDNN"]
            for r in data["registers"]]


def _prefill(data, t_in=None, t_at_most=math.inf, **fields) -> list[dict]:
    """05's prefill rows whose fields equal `fields`, with T in t_in (when given) and T <= t_at_most."""
    return [r for r in data["prefill"] if _matches(r, fields) and r["t"] <= t_at_most
            and (t_in is None or r["t"] in t_in)]


def _ratios(data, over: str, **where) -> list[float]:
    """fast_attention's TFLOP/s over `over`'s on the prefill rows `where` selects (all rows by default)."""
    return [r["fast_attention"] / r[over] for r in _prefill(data, **where)]


def _decode(data, batch: int, s: int, table: str = "decode") -> dict:
    """The row of a decode table (`decode` in 05's runs, `decode_fused` in the one-launch run) at B and S."""
    return next(r for r in data[table] if r["batch"] == batch and r["s"] == s)


def _decode_of_copy(data, batch: int, s_at_least: int = 0) -> list[float]:
    """fast_decode's read bandwidth as a percentage of the plain copy's, at the rows given."""
    return [100 * r["fast_decode"] / data["copy_tbs"] for r in data["decode"]
            if r["batch"] == batch and r["s"] >= s_at_least]


def _over_best_sdpa(data) -> list[float]:
    """fast_decode's read bandwidth over the fastest SDPA backend's, at every decode row."""
    from flashcourse.bench.fast import _best_sdpa     # the benchmark's own choice of backend (imports torch)

    return [r["fast_decode"] / _best_sdpa(r) for r in data["decode"]]


def _flash_04(report: Report, column: str, d: int, t_at_least: int = 0) -> list[float]:
    """A column of 04's table against SDPA, as numbers, at head dim d and T >= t_at_least."""
    return [float(r[column]) for r in report.tables[0] if int(r["D"]) == d and int(r["T"]) >= t_at_least]


def _cudnn_over_04(report: Report) -> list[float]:
    return [float(r["SDPA cuDNN"]) / float(r["flash_attention TFLOP/s"]) for r in report.tables[0]]


def _sweep_sdpa_over_04(data, t_at_least: int) -> float:
    """04's sweep: torch SDPA's TFLOP/s over flash_attention's, averaged over T >= t_at_least."""
    speed = {(r["method"], r["t"]): r["tflops"] for r in data["rows"]}
    ts = sorted(t for method, t in speed if method == "torch SDPA" and t >= t_at_least)
    return sum(speed["torch SDPA", t] / speed["flash_attention (Triton)", t] for t in ts) / len(ts)


def _noted(pattern: str) -> Callable[[Report], float]:
    """A number in a report's notes, found by the words around it."""
    return lambda report: float(re.search(pattern, report.text).group(1))


def _memory_peaks(stdout: dict[str, str], t: int) -> tuple[float, float]:
    """03's measured peaks (causal, online) in MiB at T = t, read from the executed solution's output."""
    found = re.search(rf"T = +{t}: causal +([\d.]+) MiB, online +([\d.]+) MiB", stdout[MEMORY_CELL_03])
    return float(found.group(1)), float(found.group(2))


def _gap(data, t: int, d: int = 128) -> dict:
    """The last-gap row at bf16, H = 32/32, head dim d, T = t."""
    return next(r for r in data["last_gap"] if (r["dtype"], r["d"], r["kv_heads"], r["t"]) == ("bf16", d, 32, t))


def _gap_ratios(data, over: str, under: str = "fast_attention", d: int | None = None) -> list[float]:
    """`over`'s TFLOP/s over `under`'s at every last-gap row (of head dim d, when given)."""
    return [r[over] / r[under] for r in data["last_gap"] if d is None or r["d"] == d]


def _kernel(profile, t: int, name: str) -> dict:
    """Nsight Compute's summary of the kernel whose name starts with `name`, at T = t."""
    return next(k for k in profile["kernels"] if k["t"] == t and k["kernel"].startswith(name))


def _tail(data, t: int, block_m: int, order: str) -> float:
    return 100 * next(r[order] for r in data["tail"] if r["t"] == t and r["block_m"] == block_m)


def _fp8_error(data, inputs: str, method: str, kind: str) -> float:
    return next(r[kind] for r in data["fp8_errors"] if r["inputs"] == inputs and r["method"] == method)


def _fp8_prepare(data, t: int, causal: bool = True) -> dict:
    """The --fp8-prepare row at T = t (bf16, D = 128, H = 32)."""
    return next(r for r in data["fp8_prepare"] if (r["t"], r["causal"]) == (t, causal))


def _end_to_end(data, t: int, causal: bool = True) -> float:
    """fp8_attention from bf16 inputs over hopper_attention, at the --fp8-prepare row at T = t."""
    row = _fp8_prepare(data, t, causal)
    return row["fp8_attention"] / row["hopper_attention"]


def _q_prepared_whole(data, t: int, causal: bool = True) -> float:
    """The Gluon kernel on Q prepared whole plus prepare_fp8's time, over hopper_attention, at the --fp8-prepare row
    at T = t: fp8_attention end to end as it was before Q was left to the kernel, from the same run's medians."""
    row = _fp8_prepare(data, t, causal)
    flops = (2.0 if causal else 4.0) * row["batch"] * row["heads"] * t * t * row["d"]
    ms = flops / row["FP8 Gluon kernel"] / 1e9 + row["prepare_ms"]
    return flops / ms / 1e9 / row["hopper_attention"]


def _over(data, name: str, under: str, rows: str = "fp8_prepare", **match) -> list[float]:
    """`name`'s TFLOP/s over `under`'s, at every row of data[rows] whose fields equal match's (by default the
    --fp8-prepare rows, where "fp8_attention" is end to end, from bf16)."""
    return [r[name] / r[under] for r in data[rows] if _matches(r, match)]


def _assembled_over(data, way: str, under: str) -> list[float]:
    """Per config of TRITON39_PTXAS, the kernel's mean TFLOP/s over its processes assembled `way` over the same
    assembled `under` ("native", "39": CUDA 13.4's ptxas, "39w": CUDA 12.9's)."""
    def mean(config, how):
        return statistics.mean(r["kernel"] for r in data["rows"] if (r["config"], r["assembled"]) == (config, how))
    return [mean(config, way) / mean(config, under) for config in data["configs"]]


def _groups_over_fast(data) -> list[float]:
    """The better of the two L2-grouped longest-first launches over the fast kernel, per T."""
    return [max(r["LPT, L2 groups"], r["persistent LPT, L2 groups"]) / r["fast_attention"] for r in data["lpt_groups"]]



def _lse_over_fast(data) -> list[float]:
    """fast_attention_lse's TFLOP/s over fast_attention's, at every row of the grid."""
    return [r["fast_attention_lse"] / r["fast_attention"] for r in data["prefill"]]


def _hopper_ratios(data, best: bool) -> list[float]:
    """hopper_attention (or the faster of the two course kernels) over cuDNN, every row of the grid."""
    return [(max(r["hopper_attention"], r["fast_attention"]) if best else r["hopper_attention"]) / r["SDPA cuDNN"]
            for r in data["prefill"]]


def _hopper_row(data, t: int, causal: bool = True) -> dict:
    """--hopper's row at bf16, D = 128, H = 32/32, T = t."""
    (row,) = _prefill(data, t_in=(t,), causal=causal, d=128, dtype="bf16", kv_heads=32)
    return row


def _second_over_first(data, choice: str, t_at_least: int = 0, t_at_most: float = math.inf,
                       **fields) -> list[float]:
    """At the rows of a --consumers, --overlap or --tma-store run (`choice`) whose T lies in the range and whose
    other fields match: the second setting's TFLOP/s over the first's (three consumers over two, the overlap over
    one item at a time, o by TMA over the threads' stores)."""
    from flashcourse.bench.fast import HOPPER_CHOICES

    first, second = HOPPER_CHOICES[choice][1]
    return [r[second] / r[first] for r in data[choice]
            if t_at_least <= r["t"] <= t_at_most and _matches(r, fields)]


_three_over_two = functools.partial(_second_over_first, choice="consumers")   # three consumers over two
_overlap_gain = functools.partial(_second_over_first, choice="overlap")       # the overlap over one at a time
_tma_store_gain = functools.partial(_second_over_first, choice="tma_store")   # o by TMA over the threads' stores


def _overlap_repeats(data) -> list[float]:
    """hopper_attention over the column of the same setting, timed just after it, at every --overlap row where that
    run's hopper_attention took two consumers (all but causal D = 64 from T = 4k, its rule then)."""
    from flashcourse.engine.hopper import hopper_overlap

    same = {True: "overlap", False: "one item at a time"}
    return [r["hopper_attention"] / r[same[hopper_overlap(r["t"], r["d"], r["causal"])]]
            for r in data["overlap"] if not (r["causal"] and r["d"] == 64 and r["t"] >= 4096)]


def _consumers_row(data, t: int) -> dict:
    """--consumers' causal row at H = 32/32, T = t."""
    (row,) = [r for r in data["consumers"] if r["causal"] and r["kv_heads"] == 32 and r["t"] == t]
    return row


def _hopper_repeats(data) -> list[float]:
    """hopper_attention over its own schedule's column, every row: the same kernel timed twice in one run. The
    run predates the D = 64 rule of hopper_schedule: its hopper_attention took D = 128's schedule at every D."""
    from flashcourse.bench.fast import HOPPER_SCHEDULES
    from flashcourse.engine.hopper import hopper_schedule

    column = {schedule: name for name, schedule in HOPPER_SCHEDULES.items()}
    return [r["hopper_attention"] / r[column[hopper_schedule(r["t"], 128, r["causal"])]] for r in data["prefill"]]


def _version(report: Report, version: int, column: str, at: int = 0) -> float:
    """The at-th number in a cell of the Gluon report's table of the versions before hopper_attention (1 to 5)."""
    row = next(r for r in report.tables[1] if r["version"].startswith(f"{version}."))
    return float(re.findall(r"\d+(?:\.\d+)?", row[column])[at])


# The columns of the Gluon report's table of the versions, that _version reads.
CAUSAL_16K, CUDNN, FAST_SAME_RUN, OTHER_ROWS = ("causal D=128 T=16k", "cuDNN (same run)", "fast_attention (same run)",
                                                "other rows")


def _version_figures(version: int, **cells: tuple[str, int]) -> dict[str, Figure]:
    """hopper.v<version>.<name> for each name=(column, at): the at-th number in that column of the version's row."""
    return {f"hopper.v{version}.{name}": Figure(HOPPER_REPORT, functools.partial(_version, version=version,
                                                                                  column=column, at=at))
            for name, (column, at) in cells.items()}


def _fused_over_two(data) -> list[float]:
    return [r["fused_decode"] / r["fast_decode"] for r in data["decode_fused"] if r["batch"] == 1]


def _trial(data, key: str, t: int, name: str) -> float:
    """One cell of the trials: `name`'s TFLOP/s at T = t in the process `key` ("pipeline" or "pipeline_ws")."""
    return next(r[name] for r in data[key] if r["t"] == t)


def _backward_ratios(data, column: str, over: str, kind: str = "bwd") -> list[float]:
    """column over `over`, every row of the Gluon backward's benchmark: the backward alone or fwd+bwd."""
    return [r[f"{column} {kind}"] / r[f"{over} {kind}"] for r in data["rows"]]


def _backward_row(data, t: int, causal: bool = True, d: int = 128, kv_heads: int = 32) -> dict:
    return next(r for r in data["rows"] if (r["t"], r["causal"], r["d"], r["kv_heads"]) == (t, causal, d, kv_heads))


def _p_copy_ratios(data, column: str, **match) -> list[float]:
    """A scratch variant of the backward ("hb_p16 232", "hb_lpt rule") over main's kernel at the same registers,
    each row of the P_COPY run whose fields equal match's ("rule": dkdv_registers' choice, the row's "rule")."""
    registers = column.split()[-1]
    return [r["over cuDNN"][column] / r["over cuDNN"][f"hb_main {r['rule'] if registers == 'rule' else registers}"]
            for r in data["rows"] if _matches(r, match)]


def _swapped_over_kernel(data, t_from: int = 0) -> list[float]:
    """The backward's swapped products at their better register split over hopper_backward at its better split, each
    row of the PV_FIRST_SWAPPED run with T >= t_from."""
    def best(row, name):
        return max(v for k, v in row.items() if k.startswith(f"{name}, ") and k.endswith("over cuDNN"))

    return [best(r, "swapped products") / best(r, "hopper_backward") for r in data["swapped_products"]
            if r["t"] >= t_from]


def _per_exponential(data, kernel: int) -> float:
    """Instructions executed per exponential (MUFU) by kernel 0 (FP8) or 1 (bf16) of the FP8_SASS profile."""
    executed = data["kernels"][kernel]["instructions executed"]
    return sum(executed.values()) / executed["MUFU"]


def _relabelled_over(data, column: str) -> list[float]:
    """FP8 with P's keys relabelled, the overlap kept, over `column` ("kernel", "hopper_attention"), each row of each
    of FP8_RELABELLED's runs with the overlap."""
    return [r["relabelled"] / r[column] for run in data["overlap_runs"] for r in run]


def _p_copy_loop(data, variant: str, consumer: int, loop: str) -> dict:
    """One tile loop of the P_COPY run's sm_90 binaries: variant "hb_main" or "hb_p16", loop "diagonal" or
    "unmasked"."""
    return next(x for x in data["sm90_binaries"][variant] if (x["consumer"], x["loop"]) == (consumer, loop))


def _p_copy_more_instructions(data) -> list[int]:
    """Instructions a tile that dS from P's copy adds, each tile loop of the P_COPY run's sm_90 binaries."""
    return [p["instructions"] - m["instructions"]
            for m, p in zip(data["sm90_binaries"]["hb_main"], data["sm90_binaries"]["hb_p16"])]


def _p_copy_error_e3(data, column: str, **match) -> float:
    """column's gradient error (x 1e3) on the P_COPY run's row matching match."""
    return 1e3 * float(next(r for r in data["rows"] if _matches(r, match))["errors"][column])


def _best_ratios(rows, column: str, over: str, **match) -> list[float]:
    """column's best TFLOP/s over `over`'s, each row of rows whose fields equal match's (causal=True, d=64, ...)."""
    return [r["best"][column] / r["best"][over] for r in rows if _matches(r, match)]


# --fp8-prepare: the Gluon kernel with Q left to its consumers over the same on Q prepared whole, and over bf16
_FP8_Q_LEFT_OVER_WHOLE = ("FP8 Gluon kernel, Q in bf16", "FP8 Gluon kernel")
_FP8_Q_LEFT_OVER_BF16 = ("FP8 Gluon kernel, Q in bf16", "hopper_attention")

# --fp8-schedule's default column over step 5's choice, over bf16, over cuDNN (its rows: "fp8_schedule")
_PV_FIRST_OVER_FP8 = ("pv first", "fp8_attention", "pv_first")   # PV_FIRST_SWAPPED: the last P V first
_LANDED_OVER_BEFORE = ("relabelled", "before", "rows")          # FP8_LANDED: the kernel over the one before it
_LANDED_OVER_BF16 = ("relabelled", "hopper_attention", "rows")   # FP8_LANDED: the kernel over bf16 hopper_attention
_FP8_DEFAULT_OVER_STEP_5 = ("+ o by TMA", "FP8, step 5's choice", "fp8_schedule")
_FP8_DEFAULT_OVER_BF16 = ("+ o by TMA", "hopper_attention", "fp8_schedule")
_FP8_DEFAULT_OVER_CUDNN = ("+ o by TMA", "SDPA cuDNN", "fp8_schedule")
_LATER, _AWAITED = "one kernel, dQ a tile later", "one kernel, dQ awaited in its tile"   # DQ_LATER's columns
_T1K_CAUSAL = {"t": 1024, "causal": True}


def _best_over_best(row: dict, column: str, over: str) -> float:
    """column's TFLOP/s over `over`'s in a row that timed each twice (the second as "<name> (2)"), best against best."""
    return max(row[column], row[f"{column} (2)"]) / max(row[over], row[f"{over} (2)"])


def _best_over_best_ratios(rows, column: str, over: str, **match) -> list[float]:
    """_best_over_best of column over `over` in each row of rows whose fields equal match's."""
    return [_best_over_best(r, column, over) for r in rows if _matches(r, match)]


def _mask_split(data, **match) -> list[float]:
    """MASK_SPLIT: the split over one loop, in the forward rows it applies to (all but causal T <= 2k) whose fields
    equal match's, or in the backward rows (dtype="bf16 backward, two kernels")."""
    rows = [r for r in data["rows"] if not (r["causal"] and r["t"] <= 2048 and "backward" not in r["dtype"])]
    return _best_over_best_ratios(rows, "split", "before", **({"dtype": "bf16"} | match))


def _two_loops_over_one(data, dtype: str) -> list[float]:
    """MASK_SPLIT: two loops under the overlap (the Q index passed through the first) over one loop, in each row of
    dtype."""
    return _best_over_best_ratios(data["overlap_two_loops"]["rows"], "two loops", "one loop", dtype=dtype)


def _fma_exp_over_mufu(data) -> list[float]:
    """MASK_SPLIT: FP8 with half of P's exponentials on the FMA pipe over all of them on MUFU, in each row."""
    return _best_over_best_ratios(data["fp8_exponentials_on_fma"]["rows"], "MUFU + FMA", "MUFU")


def _variant_over_split(data, variant: str) -> list[float]:
    """MASK_SPLIT: a scratch variant of the split over the split, in each row that timed it."""
    return _best_over_best_ratios(data["variants"]["rows"], "variant", "split", **{"scratch variant": variant})


def _fp8_ncu(data, dtype: str) -> dict:
    """Step 5's kernel at causal T = 16k under Nsight Compute: profiled in bf16 first, then in FP8."""
    return _ncu_kernel(data, "hopper_fwd_kernel", {"bf16": 0, "fp8": 1}[dtype], t=16384)


def _key_tiles_64(data) -> list[float]:
    """The best setting with tiles of 64 keys over hopper_attention, at every row of the D = 64 comparison."""
    return [max(v for n, v in r["best"].items() if "64 keys" in n) / r["best"]["hopper_attention"]
            for r in data["rows"]]


def _ncu_kernel(data, name: str, nth: int = 0, **match) -> dict:
    """The nth kernel profiled whose name holds `name` and whose fields equal match's (t=1024, causal=True)."""
    return [k for k in data["kernels"] if name in k["kernel"] and _matches(k, match)][nth]


def _parked(issue_rate: float) -> float:
    """Barrier stalls (warps per issued instruction) that three warps waiting at a barrier for a whole kernel add:
    3/4 of a warp per warp scheduler in every cycle, over the instructions a scheduler issues per cycle."""
    return 0.75 / issue_rate


def _one_kernel_parked(data) -> float:
    """BACKWARD_NCU: _parked at the one kernel's issue rate, its share of the issue slots (that profile kept no
    per-scheduler rate)."""
    return _parked(_ncu_kernel(data, "hopper_dkdv", 1)["issue_slots_pct"] / 100)


def _barrier_kernel(data, name: str, t: int = 1024, causal: bool = True, d: int = 128) -> dict:
    """The forward-barriers profile's kernel whose name holds `name` ("cuDNN", "hopper_attention", "loose")."""
    return _ncu_kernel(data, name, t=t, causal=causal, d=d)


def _pipes(data, name: str = "hopper_attention", **shape) -> tuple[float, float]:
    """(tensor pipe %, XU pipe %) of one kernel of the forward-barriers profile (_barrier_kernel's name and shape):
    the shares of the multiprocessors' active cycles in which the products and the exponentials kept their pipes
    busy."""
    kernel = _barrier_kernel(data, name, **shape)
    return kernel["tensor_pipe_pct"], kernel["xu_pipe_pct"]


SAME_KERNEL_COLUMNS = ("own", "forced", "own again")   # hopper_attention three times, one kernel


def _same_kernel(data, statistic, causal, t) -> dict[str, float]:
    """Each column's TFLOP/s over its rounds, taken by `statistic` (max: the best round; statistics.median), in
    the same-kernel run's row (causal, t)."""
    row = next(r for r in data["same_kernel_rounds"] if r["causal"] == causal and r["t"] == t)
    return {name: statistic(rounds) for name, rounds in row["tflops"].items()}


def _fma_exp_at_d64(data, column: str) -> list[float]:
    """FMA_EXP: a column's median over the kernel's own (every exponential on MUFU), each bf16 row at D = 64."""
    return [r["median / emu0"][column] for r in data["rows"] if r["kind"] == "bf16" and r["d"] == 64]


def _pingpong_off_at_d64(data, t: int) -> float:
    """PINGPONG_D64: without the ping-pong over with it, by medians, bf16 D = 64 without a mask at T = t."""
    (row,) = [r for r in data["rows"] if r["inputs"] == "bf16" and r["d"] == 64 and r["t"] == t]
    return row["no ping-pong / ping-pong"]


def _same_kernel_spread(data, statistic, causal=False, t=4096) -> float:
    """How far apart, in %, the same kernel's three columns lay by `statistic`."""
    columns = _same_kernel(data, statistic, causal, t)
    values = [columns[name] for name in SAME_KERNEL_COLUMNS]
    return (max(values) / min(values) - 1) * 100


def _same_kernel_of_cudnn(data, statistic, causal=True, t=1024) -> float:
    """hopper_attention's own column over cuDNN's, both taken by `statistic`."""
    values = _same_kernel(data, statistic, causal, t)
    return values["own"] / values["cuDNN"]


def _xu_over_tensor(data, **kernel) -> float:
    """How long the exponentials' pipe was busy over how long the tensor pipe was, in one kernel (_pipes' fields)."""
    tensor, xu = _pipes(data, **kernel)
    return xu / tensor


def _without_bar_syncs(data) -> list[float]:
    """Each forward row's median TFLOP/s with Triton's warpgroup bar.syncs dropped (both copies) over the kernel's
    as it is, the median of each column's rounds."""
    return [statistics.median(r["tflops"][copy]) / statistics.median(r["tflops"]["main"])
            for r in data["forward"] for copy in ("strict", "loose")]


def _d64_time_over_cudnn(data) -> list[float]:
    """hopper_attention's time over cuDNN's at every D = 64 shape of the forward-barriers profile."""
    return [_barrier_kernel(data, "hopper_attention", k["t"], k["causal"], 64)["duration_us"] / k["duration_us"]
            for k in data["kernels"] if k["kernel"] == "cuDNN" and k["d"] == 64]


def _arrangement(data, column: str, over: str = "transposed") -> list[float]:
    """One dK/dV arrangement's speed over another's, every row of step 8's H100 comparison (cuDNN: "SDPA cuDNN"),
    from the ratios to the transposed kernel that the run printed to three decimals (its TFLOP/s are rounded)."""
    def relative(row, name):   # speed over the transposed kernel's
        if name == "SDPA cuDNN":
            return 1 / row["transposed of cuDNN"]
        return 1.0 if name == "transposed" else row["over transposed"][name]
    return [relative(r, column) / relative(r, over) for r in data["rows"]]


def _tma_dq(data, column: str, over: str = "two kernels", t: int | None = None, t_from: int = 0) -> list[float]:
    """One way of adding dQ over another (or over the two kernels), the rows of step 8's H100 comparison at T = t
    (or from T = t_from), from the ratios to the two kernels that the run printed to three decimals."""
    def relative(row, name):
        return 1.0 if name == "two kernels" else row["over_two_kernels"][name]
    return [relative(r, column) / relative(r, over) for r in data["rows"]
            if (t is None or r["t"] == t) and r["t"] >= t_from]


def _ring(report: Report, t: int, what: str, column: str) -> float:
    """A cell of 07's two-GPU table, as a number: the row of `what` at T = t."""
    return float(next(r[column] for r in report.tables[0] if int(r["T"]) == t and r["what"] == what))


def _ring_column(report: Report, column: str) -> list[float]:
    """A column of 07's headline table (one row per T), as numbers."""
    return [float(r[column]) for r in report.tables[1]]

_GAUSS, _OUTLIERS = "N(0, 1)", "N(0, 1) + outliers"
_BF16_D128 = dict(dtype="bf16", d=128, q_heads=32, kv_heads=32)
_T8K_CAUSAL = dict(_BF16_D128, causal=True, t=8192)

FIGURES: dict[str, Figure] = {
    # 08, step 8: the backward pass in Gluon
    "hbwd.of_cudnn_min": Figure(HOPPER_BACKWARD_FIRST, lambda d: min(_backward_ratios(d, "Gluon", "SDPA cuDNN")), 2),
    "hbwd.of_cudnn_max": Figure(HOPPER_BACKWARD_FIRST, lambda d: max(_backward_ratios(d, "Gluon", "SDPA cuDNN")), 2),
    "hbwd.over_06_min": Figure(HOPPER_BACKWARD_FIRST, lambda d: min(_backward_ratios(d, "Gluon", "06 Triton")), 2),
    "hbwd.over_06_max": Figure(HOPPER_BACKWARD_FIRST, lambda d: max(_backward_ratios(d, "Gluon", "06 Triton")), 2),
    "hbwd.06_of_cudnn_min": Figure(HOPPER_BACKWARD_FIRST, lambda d: min(
        _backward_ratios(d, "06 Triton", "SDPA cuDNN")), 2),
    "hbwd.06_of_cudnn_max": Figure(HOPPER_BACKWARD_FIRST, lambda d: max(
        _backward_ratios(d, "06 Triton", "SDPA cuDNN")), 2),
    "hbwd.atomic_of_gluon_min": Figure(HOPPER_BACKWARD_FIRST, lambda d: min(
        _backward_ratios(d, "Gluon, atomic dQ", "Gluon")), 2),
    "hbwd.atomic_of_gluon_max": Figure(HOPPER_BACKWARD_FIRST, lambda d: max(
        _backward_ratios(d, "Gluon, atomic dQ", "Gluon")), 2),
    "hbwd.train_of_cudnn_min": Figure(HOPPER_BACKWARD_FIRST, lambda d: min(_backward_ratios(
        d, "hopper_attention_train", "SDPA cuDNN", "fwd+bwd")), 2),
    "hbwd.train_of_cudnn_max": Figure(HOPPER_BACKWARD_FIRST, lambda d: max(_backward_ratios(
        d, "hopper_attention_train", "SDPA cuDNN", "fwd+bwd")), 2),
    "hbwd.causal_16k": Figure(HOPPER_BACKWARD_FIRST, lambda d: _backward_row(d, 16384)["Gluon bwd"]),
    "hbwd.cudnn_causal_16k": Figure(HOPPER_BACKWARD_FIRST, lambda d: _backward_row(d, 16384)["SDPA cuDNN bwd"]),
    "hbwd.06_causal_16k": Figure(HOPPER_BACKWARD_FIRST, lambda d: _backward_row(d, 16384)["06 Triton bwd"]),
    "hbwd.gqa_of_cudnn": Figure(HOPPER_BACKWARD_FIRST, lambda d: _backward_row(d, 8192, kv_heads=8)["Gluon bwd"]
                                / _backward_row(d, 8192, kv_heads=8)["SDPA cuDNN bwd"], 2),
    "hbwd.error_max_e3": Figure(HOPPER_BACKWARD_FIRST, lambda d: 1e3 * max(r["Gluon error"] for r in d["rows"]), 0),
    "hbwd.now.one_of_cudnn_min": Figure(HOPPER_BACKWARD, lambda d: min(
        _backward_ratios(d, "Gluon, atomic dQ", "SDPA cuDNN")), 2),
    "hbwd.now.one_of_cudnn_max": Figure(HOPPER_BACKWARD, lambda d: max(
        _backward_ratios(d, "Gluon, atomic dQ", "SDPA cuDNN")), 2),
    "hbwd.now.one_of_cudnn_d64": Figure(HOPPER_BACKWARD, lambda d: _backward_row(d, 8192, d=64)["Gluon, atomic dQ bwd"]
                                        / _backward_row(d, 8192, d=64)["SDPA cuDNN bwd"], 2),
    "hbwd.now.two_of_cudnn_min": Figure(HOPPER_BACKWARD, lambda d: min(_backward_ratios(d, "Gluon", "SDPA cuDNN")), 2),
    "hbwd.now.two_of_cudnn_max": Figure(HOPPER_BACKWARD, lambda d: max(_backward_ratios(d, "Gluon", "SDPA cuDNN")), 2),
    "hbwd.now.one_over_two_1k": Figure(HOPPER_BACKWARD, lambda d: _backward_row(d, 1024)["Gluon, atomic dQ bwd"]
                                       / _backward_row(d, 1024)["Gluon bwd"], 2),
    "hbwd.now.one_over_two_from_4k_min": Figure(HOPPER_BACKWARD, lambda d: min(
        r["Gluon, atomic dQ bwd"] / r["Gluon bwd"] for r in d["rows"] if r["t"] >= 4096), 2),
    "hbwd.now.one_over_two_from_4k_max": Figure(HOPPER_BACKWARD, lambda d: max(
        r["Gluon, atomic dQ bwd"] / r["Gluon bwd"] for r in d["rows"] if r["t"] >= 4096), 2),
    "hbwd.now.over_06_min": Figure(HOPPER_BACKWARD, lambda d: min(
        _backward_ratios(d, "Gluon, atomic dQ", "06 Triton")), 2),
    "hbwd.now.over_06_max": Figure(HOPPER_BACKWARD, lambda d: max(
        _backward_ratios(d, "Gluon, atomic dQ", "06 Triton")), 2),
    "hbwd.now.train_of_cudnn_min": Figure(HOPPER_BACKWARD, lambda d: min(_backward_ratios(
        d, "hopper_attention_train", "SDPA cuDNN", "fwd+bwd")), 2),
    "hbwd.now.train_of_cudnn_max": Figure(HOPPER_BACKWARD, lambda d: max(_backward_ratios(
        d, "hopper_attention_train", "SDPA cuDNN", "fwd+bwd")), 2),
    "hbwd.now.error_max_e3": Figure(HOPPER_BACKWARD, lambda d: 1e3 * max(
        r["Gluon, atomic dQ error"] for r in d["rows"]), 0),
    "hbwd.stand_over_transposed_min": Figure(ARRANGEMENT, lambda d: min(_arrangement(d, "as they stand")), 2),
    "hbwd.stand_over_transposed_max": Figure(ARRANGEMENT, lambda d: max(_arrangement(d, "as they stand")), 2),
    "hbwd.stand_of_cudnn_min": Figure(ARRANGEMENT, lambda d: min(_arrangement(d, "as they stand", "SDPA cuDNN")), 2),
    "hbwd.stand_of_cudnn_max": Figure(ARRANGEMENT, lambda d: max(_arrangement(d, "as they stand", "SDPA cuDNN")), 2),
    "hbwd.pingpong_of_stand_min": Figure(ARRANGEMENT, lambda d: min(_arrangement(
        d, "as they stand, ping-pong", "as they stand")), 2),
    "hbwd.pingpong_of_stand_max": Figure(ARRANGEMENT, lambda d: max(_arrangement(
        d, "as they stand, ping-pong", "as they stand")), 2),
    "hbwd.pingpong_of_transposed_min": Figure(ARRANGEMENT, lambda d: min(_arrangement(d, "transposed, ping-pong")), 2),
    "hbwd.pingpong_of_transposed_max": Figure(ARRANGEMENT, lambda d: max(_arrangement(d, "transposed, ping-pong")), 2),
    "hbwd.stand_atomic_over_transposed_atomic_min": Figure(ARRANGEMENT, lambda d: min(_arrangement(
        d, "as they stand, atomic dQ", "transposed, atomic dQ")), 2),
    "hbwd.stand_atomic_over_transposed_atomic_max": Figure(ARRANGEMENT, lambda d: max(_arrangement(
        d, "as they stand, atomic dQ", "transposed, atomic dQ")), 2),
    "hbwd.stand_atomic_of_stand_min": Figure(ARRANGEMENT, lambda d: min(_arrangement(
        d, "as they stand, atomic dQ", "as they stand")), 2),
    "hbwd.stand_atomic_of_stand_max": Figure(ARRANGEMENT, lambda d: max(_arrangement(
        d, "as they stand, atomic dQ", "as they stand")), 2),
    "hbwd.tma_over_elements_min": Figure(TMA_DQ, lambda d: min(_tma_dq(d, "TMA reduction", "element atomics")), 2),
    "hbwd.tma_over_elements_max": Figure(TMA_DQ, lambda d: max(_tma_dq(d, "TMA reduction", "element atomics")), 2),
    "hbwd.tma_over_two_min": Figure(TMA_DQ, lambda d: min(_tma_dq(d, "TMA reduction")), 2),
    "hbwd.tma_over_two_max": Figure(TMA_DQ, lambda d: max(_tma_dq(d, "TMA reduction")), 2),
    "hbwd.tma_over_two_1k": Figure(TMA_DQ, lambda d: _tma_dq(d, "TMA reduction", t=1024)[0], 2),
    "hbwd.tma_over_two_from_4k_min": Figure(TMA_DQ, lambda d: min(_tma_dq(d, "TMA reduction", t_from=4096)), 2),
    "hbwd.tma_of_cudnn_min": Figure(TMA_DQ, lambda d: min(r["tma_of_cudnn"] for r in d["rows"]), 2),
    "hbwd.tma_of_cudnn_max": Figure(TMA_DQ, lambda d: max(r["tma_of_cudnn"] for r in d["rows"]), 2),
    "hbwd.later.over_awaited_min": Figure(DQ_LATER, lambda d: min(_best_ratios(
        d["rows"], _LATER, _AWAITED, d=64, causal=True)), 2),
    "hbwd.later.over_awaited_max": Figure(DQ_LATER, lambda d: max(_best_ratios(
        d["rows"], _LATER, _AWAITED, d=64, causal=True)), 2),
    "hbwd.later.over_awaited_full": Figure(DQ_LATER, lambda d: _best_ratios(
        d["rows"], _LATER, _AWAITED, d=64, causal=False)[0], 2),
    "hbwd.later.d128_min": Figure(DQ_LATER, lambda d: min(_best_ratios(d["scratch"], "defer", "one", causal=True,
                                                                       d=128)), 2),
    "hbwd.later.d128_max": Figure(DQ_LATER, lambda d: max(_best_ratios(d["scratch"], "defer", "one", causal=True,
                                                                       d=128)), 2),
    "hbwd.regs.full_min": Figure(REGISTERS, lambda d: min(_split_ratios(d, 4096, causal=False, d=128)), 3),
    "hbwd.regs.full_max": Figure(REGISTERS, lambda d: max(_split_ratios(d, 4096, causal=False, d=128)), 3),
    "hbwd.regs.d64_min": Figure(REGISTERS, lambda d: min(_split_ratios(d, 4096, d=64)), 3),
    "hbwd.regs.d64_max": Figure(REGISTERS, lambda d: max(_split_ratios(d, 4096, d=64)), 3),
    "hbwd.regs.causal_min": Figure(REGISTERS, lambda d: min(_split_ratios(d, 4096, causal=True, d=128)), 3),
    "hbwd.regs.causal_max": Figure(REGISTERS, lambda d: max(_split_ratios(d, 4096, causal=True, d=128)), 3),
    "hbwd.regs.two_kernels_min": Figure(REGISTERS, lambda d: min(_split_ratios(d, 0, 4096)), 3),
    "hbwd.regs.two_kernels_max": Figure(REGISTERS, lambda d: max(_split_ratios(d, 0, 4096)), 3),
    "hbwd.regs.identical": Figure(REGISTERS, lambda d: sum(r["dk, dv identical"] for r in d["registers"])),
    "hbwd.regs.rows": Figure(REGISTERS, lambda d: len(d["registers"])),
    "hbwd.regs.of_cudnn_min": Figure(REGISTERS, lambda d: min(_chosen_split_of_cudnn(d)), 2),
    "hbwd.regs.of_cudnn_max": Figure(REGISTERS, lambda d: max(_chosen_split_of_cudnn(d)), 2),
    "hbwd.p16.causal_8k": Figure(P_COPY, lambda d: _p_copy_ratios(d, "hb_p16 232", causal=True, d=128, t=8192,
                                                                  hkv=32)[0], 2),
    "hbwd.p16.spill_loads_main": Figure(P_COPY, lambda d: _p_copy_loop(d, "hb_main", 1, "unmasked")["spill loads"]),
    "hbwd.p16.spill_loads": Figure(P_COPY, lambda d: _p_copy_loop(d, "hb_p16", 1, "unmasked")["spill loads"]),
    "hbwd.p16.more_instructions_min": Figure(P_COPY, lambda d: min(_p_copy_more_instructions(d))),
    "hbwd.p16.more_instructions_max": Figure(P_COPY, lambda d: max(_p_copy_more_instructions(d))),
    "hbwd.p16.slower_rows": Figure(P_COPY, lambda d: sum(x < 1 for x in _p_copy_ratios(d, "hb_p16 232"))),
    "hbwd.p16.rows": Figure(P_COPY, lambda d: len(d["rows"])),
    "hbwd.p16.min": Figure(P_COPY, lambda d: min(_p_copy_ratios(d, "hb_p16 232")), 2),
    "hbwd.p16.error_4k_e3": Figure(P_COPY, lambda d: _p_copy_error_e3(d, "hb_p16 232", causal=True, d=128, t=4096),
                                   1),
    "hbwd.p16.main_error_4k_e3": Figure(P_COPY, lambda d: _p_copy_error_e3(d, "hb_main 232", causal=True, d=128,
                                                                           t=4096), 1),
    "hbwd.lpt.slower_pct": Figure(P_COPY, lambda d: 100 * (1 - min(_p_copy_ratios(d, "hb_lpt rule"))), 1),
    "hbwd.lpt.faster_pct": Figure(P_COPY, lambda d: 100 * (max(_p_copy_ratios(d, "hb_lpt rule")) - 1), 1),
    "hbwd.own.min": Figure(DQ_LATER, lambda d: min(_best_ratios(d["own_keys"]["rows"], "own keys", "one kernel",
                                                                d=128)), 2),
    "hbwd.own.max": Figure(DQ_LATER, lambda d: max(_best_ratios(d["own_keys"]["rows"], "own keys", "one kernel",
                                                                d=128)), 2),
    "hbwd.phases.min": Figure(DQ_LATER, lambda d: min(_best_ratios(d["scratch"], "phase one", "one", causal=True)
                                                     + _best_ratios(d["scratch"], "phase two", "two", causal=True)), 2),
    "hbwd.phases.max": Figure(DQ_LATER, lambda d: max(_best_ratios(d["scratch"], "phase one", "one", causal=True)
                                                     + _best_ratios(d["scratch"], "phase two", "two", causal=True)), 2),
    "hbwd.persistent.two_min": Figure(BACKWARD_PERSISTENT, lambda d: min(_best_ratios(
        d["rows"], "two kernels, persistent", "two kernels")), 2),
    "hbwd.persistent.two_max": Figure(BACKWARD_PERSISTENT, lambda d: max(_best_ratios(
        d["rows"], "two kernels, persistent", "two kernels")), 2),
    "hbwd.persistent.one_min": Figure(BACKWARD_PERSISTENT, lambda d: min(_best_ratios(
        d["rows"], "one kernel, persistent", "one kernel")), 2),
    "hbwd.persistent.one_max": Figure(BACKWARD_PERSISTENT, lambda d: max(_best_ratios(
        d["rows"], "one kernel, persistent", "one kernel")), 2),
    "hbwd.ncu.cudnn_tensor_pct": Figure(BACKWARD_NCU, lambda d: _ncu_kernel(d, "flash_bprop")["tensor_pipe_pct"]),
    "hbwd.ncu.one_tensor_pct": Figure(BACKWARD_NCU, lambda d: _ncu_kernel(d, "hopper_dkdv", 1)["tensor_pipe_pct"]),
    "hbwd.ncu.dkdv_tensor_pct": Figure(BACKWARD_NCU, lambda d: _ncu_kernel(d, "hopper_dkdv")["tensor_pipe_pct"]),
    "hbwd.ncu.dq_tensor_pct": Figure(BACKWARD_NCU, lambda d: _ncu_kernel(d, "hopper_dq")["tensor_pipe_pct"]),
    "hbwd.ncu.one_over_cudnn_time": Figure(BACKWARD_NCU, lambda d: _ncu_kernel(d, "hopper_dkdv", 1)["duration_us"]
                                           / _ncu_kernel(d, "flash_bprop")["duration_us"], 2),
    "hbwd.ncu.cudnn_barrier": Figure(BACKWARD_NCU, lambda d: _ncu_kernel(d, "flash_bprop")["stalls_per_issue"][
        "barrier"], 1),
    "hbwd.ncu.one_barrier": Figure(BACKWARD_NCU, lambda d: _ncu_kernel(d, "hopper_dkdv", 1)["stalls_per_issue"][
        "barrier"], 1),
    "hbwd.ncu.one_parked": Figure(BACKWARD_NCU, _one_kernel_parked, 1),
    "hbwd.ncu.one_own": Figure(BACKWARD_NCU, lambda d: _ncu_kernel(d, "hopper_dkdv", 1)["stalls_per_issue"]["barrier"]
                               - _one_kernel_parked(d), 1),
    "hopper.bars.stall_1k": Figure(BARRIERS, lambda d: _barrier_kernel(d, "hopper_attention")["stall_barrier"], 2),
    "hopper.bars.loose_stall_1k": Figure(BARRIERS, lambda d: _barrier_kernel(d, "loose")["stall_barrier"], 2),
    "hopper.bars.cudnn_stall_1k": Figure(BARRIERS, lambda d: _barrier_kernel(d, "cuDNN")["stall_barrier"], 2),
    "hopper.bars.parked_1k": Figure(BARRIERS, lambda d: _parked(
        _barrier_kernel(d, "hopper_attention")["issue_active_per_cycle"]), 2),
    "hopper.bars.warps": Figure(BARRIERS, lambda d: _barrier_kernel(d, "hopper_attention")["warps_active_per_sm"]),
    "hopper.bars.cudnn_warps": Figure(BARRIERS, lambda d: _barrier_kernel(d, "cuDNN")["warps_active_per_sm"]),
    "hopper.bars.time_over_cudnn_1k": Figure(BARRIERS, lambda d: _barrier_kernel(d, "hopper_attention")[
        "duration_us"] / _barrier_kernel(d, "cuDNN")["duration_us"], 2),
    "hopper.bars.without_min": Figure(BARRIERS, lambda d: min(_without_bar_syncs(d)), 2),
    "hopper.bars.without_max": Figure(BARRIERS, lambda d: max(_without_bar_syncs(d)), 2),
    "hopper.bars.d64_over_cudnn_min": Figure(BARRIERS, lambda d: min(_d64_time_over_cudnn(d)), 2),
    "hopper.bars.d64_over_cudnn_max": Figure(BARRIERS, lambda d: max(_d64_time_over_cudnn(d)), 2),
    "hopper.bars.xu_over_tensor_d64": Figure(BARRIERS, lambda d: _xu_over_tensor(d, causal=False, d=64), 2),
    "hopper.bars.xu_over_tensor_d128": Figure(BARRIERS, lambda d: _xu_over_tensor(d), 2),
    "hopper.bars.pipes_sum_d64": Figure(BARRIERS, lambda d: sum(_pipes(d, causal=False, d=64)), 1),
    "hopper.bars.cudnn_pipes_sum_d64": Figure(BARRIERS, lambda d: sum(_pipes(d, "cuDNN", causal=False, d=64)), 1),
    "hopper.rounds.best_spread_4k": Figure(SAME_KERNEL, lambda d: _same_kernel_spread(d, max), 1),
    "hopper.rounds.median_spread_4k": Figure(SAME_KERNEL, lambda d: _same_kernel_spread(d, statistics.median), 1),
    "hopper.rounds.best_of_cudnn_1k": Figure(SAME_KERNEL, lambda d: _same_kernel_of_cudnn(d, max), 3),
    "hopper.rounds.median_of_cudnn_1k": Figure(SAME_KERNEL, lambda d: _same_kernel_of_cudnn(d, statistics.median), 3),
    "hopper.d64_fma_exp.half_min": Figure(FMA_EXP, lambda d: min(_fma_exp_at_d64(d, "emu2")), 2),
    "hopper.d64_fma_exp.half_max": Figure(FMA_EXP, lambda d: max(_fma_exp_at_d64(d, "emu2")), 2),
    "hopper.d64_fma_exp.quarter_min": Figure(FMA_EXP, lambda d: min(_fma_exp_at_d64(d, "emu4")), 2),
    "hopper.d64_fma_exp.quarter_max": Figure(FMA_EXP, lambda d: max(_fma_exp_at_d64(d, "emu4")), 2),
    "hopper.pingpong_d64.off_over_on_1k": Figure(PINGPONG_D64, lambda d: _pingpong_off_at_d64(d, 1024), 3),
    "hopper.pingpong_d64.off_over_on_2k": Figure(PINGPONG_D64, lambda d: _pingpong_off_at_d64(d, 2048), 3),
    "hopper.tma_store.causal_1k": Figure(TMA_STORE, lambda d: _best_ratios(
        d["rows"], "o by TMA", "main", causal=True, t=1024)[0], 2),
    "hopper.tma_store.causal_1k_of_cudnn": Figure(TMA_STORE, lambda d: _best_ratios(
        d["rows"], "o by TMA", "cuDNN", causal=True, t=1024)[0], 2),
    "hopper.tma_store.full_1k": Figure(TMA_STORE, lambda d: _best_ratios(
        d["rows"], "o by TMA", "main", causal=False, t=1024)[0], 2),
    "hopper.tma_store.causal_4k": Figure(TMA_STORE, lambda d: _best_ratios(
        d["rows"], "o by TMA", "main", causal=True, t=4096)[0], 2),
    "hopper.mask_split.d128_min": Figure(MASK_SPLIT, lambda d: min(_mask_split(d, d=128)), 2),
    "hopper.mask_split.d128_max": Figure(MASK_SPLIT, lambda d: max(_mask_split(d, d=128)), 2),
    "hopper.mask_split.full_d64_1k": Figure(MASK_SPLIT, lambda d: _mask_split(d, d=64, causal=False, t=1024)[0], 2),
    "hopper.mask_split.causal_d64_4k": Figure(MASK_SPLIT, lambda d: _mask_split(d, d=64, causal=True, t=4096)[0], 2),
    "hopper.mask_split.dq_min": Figure(MASK_SPLIT, lambda d: min(_mask_split(d, dtype="bf16 backward, two kernels")), 2),
    "hopper.mask_split.dq_max": Figure(MASK_SPLIT, lambda d: max(_mask_split(d, dtype="bf16 backward, two kernels")), 2),
    "hopper.mask_split.overlap_bf16_min": Figure(MASK_SPLIT, lambda d: min(_two_loops_over_one(d, "bf16")), 2),
    "hopper.mask_split.overlap_bf16_max": Figure(MASK_SPLIT, lambda d: max(_two_loops_over_one(d, "bf16")), 2),
    "hopper.mask_split.overlap_fp8_min": Figure(MASK_SPLIT, lambda d: min(_two_loops_over_one(d, "fp8")), 2),
    "hopper.mask_split.overlap_fp8_max": Figure(MASK_SPLIT, lambda d: max(_two_loops_over_one(d, "fp8")), 2),
    "hopper.mask_split.if_min": Figure(MASK_SPLIT, lambda d: min(_variant_over_split(d, "v_if")), 2),
    "hopper.mask_split.if_max": Figure(MASK_SPLIT, lambda d: max(_variant_over_split(d, "v_if")), 2),
    "hopper.fp8_fma_exp.min": Figure(MASK_SPLIT, lambda d: min(_fma_exp_over_mufu(d)), 2),
    "hopper.fp8_fma_exp.max": Figure(MASK_SPLIT, lambda d: max(_fma_exp_over_mufu(d)), 2),
    "hopper.key64.over_hopper_min": Figure(KEY_TILES_64, lambda d: min(_key_tiles_64(d)), 2),
    "hopper.key64.over_hopper_max": Figure(KEY_TILES_64, lambda d: max(_key_tiles_64(d)), 2),
    "hopper.ncu.time_over_cudnn_1k": Figure(FORWARD_NCU, lambda d: _ncu_kernel(d, "hopper_fwd", **_T1K_CAUSAL)[
        "duration_us"] / _ncu_kernel(d, "cudnn", **_T1K_CAUSAL)["duration_us"], 2),
    "hopper.ncu.tensor_pct_1k": Figure(FORWARD_NCU, lambda d: _ncu_kernel(d, "hopper_fwd", **_T1K_CAUSAL)[
        "tensor_pipe_pct"]),
    "hopper.ncu.cudnn_tensor_pct_1k": Figure(FORWARD_NCU, lambda d: _ncu_kernel(d, "cudnn", **_T1K_CAUSAL)[
        "tensor_pipe_pct"]),
    "hbwd.gpt.course_gap_max": Figure(TRAINING_HOPPER, lambda d: max(abs(g) for g in d["gap_per_seed"]), 3),
    "hbwd.gpt.torch_gap_max": Figure(TRAINING_HOPPER, lambda d: max(abs(g) for g in d["torch_kernels_gap_per_seed"]), 3),
    "hbwd.gpt.sdpa_range": Figure(TRAINING_HOPPER, lambda d: d["sdpa_seed_range"], 2),
    "hbwd.gpt.from_step": Figure(TRAINING_HOPPER, lambda d: d["from_step"]),
    # 05, the steps at bf16, causal, D = 128, T = 8192
    "fast.steps.base_04": Figure(FAST, lambda d: _step(d, "04 flash_attention")),
    "fast.steps.base_fast": Figure(FAST, lambda d: _step(d, "fast kernel, exp")),
    "fast.steps.exp2_pct": Figure(FAST, _step_gain("fast kernel, exp", "+ exp2")),
    "fast.steps.split_pct": Figure(FAST, _step_gain("+ exp2", "+ diagonal split")),
    "fast.steps.tma_pct": Figure(FAST, _step_gain("+ diagonal split", "+ tensor descriptors")),
    "fast.steps.autotune_pct": Figure(FAST, _step_gain("+ tensor descriptors", "+ autotuned")),
    # 05, prefill
    "fast.prefill.tflops_8k": Figure(FAST, lambda d: _prefill(d, **_T8K_CAUSAL)[0]["fast_attention"]),
    "fast.prefill.cudnn_tflops_8k": Figure(FAST, lambda d: _prefill(d, **_T8K_CAUSAL)[0]["SDPA cuDNN"]),
    "fast.prefill.of_cudnn_8k": Figure(FAST, lambda d: _ratios(d, "SDPA cuDNN", **_T8K_CAUSAL)[0], 2),
    "fast.prefill.over_sdpa_8k": Figure(FAST, lambda d: _ratios(d, "SDPA flash", **_T8K_CAUSAL)[0], 2),
    "fast.prefill.over_sdpa_min": Figure(FAST, lambda d: min(_ratios(d, "SDPA flash")), 1),
    "fast.prefill.over_sdpa_max": Figure(FAST, lambda d: max(_ratios(d, "SDPA flash")), 1),
    "fast.prefill.of_cudnn_min": Figure(FAST, lambda d: min(_ratios(d, "SDPA cuDNN")), 2),
    "fast.prefill.of_cudnn_max": Figure(FAST, lambda d: max(_ratios(d, "SDPA cuDNN")), 2),
    "fast.prefill.of_cudnn_long_min": Figure(
        FAST, lambda d: min(_ratios(d, "SDPA cuDNN", causal=True, t_in=(8192, 16384), **_BF16_D128)), 2),
    "fast.prefill.of_cudnn_long_max": Figure(
        FAST, lambda d: max(_ratios(d, "SDPA cuDNN", causal=True, t_in=(8192, 16384), **_BF16_D128)), 2),
    "fast.prefill.of_cudnn_short_min": Figure(
        FAST, lambda d: min(_ratios(d, "SDPA cuDNN", t_at_most=4096, **_BF16_D128)), 2),
    "fast.prefill.of_cudnn_short_max": Figure(
        FAST, lambda d: max(_ratios(d, "SDPA cuDNN", t_at_most=4096, **_BF16_D128)), 2),
    "fast.prefill.in_kernel_descriptors_8k": Figure(
        FAST_REPORT, _noted(r"built inside the kernel .*? it reached ([\d.]+)"), 1),
    # 05, decode
    "fast.decode.copy_tbs": Figure(FAST, lambda d: d["copy_tbs"], 2),
    "fast.decode.copy_tbs_short": Figure(FAST, lambda d: d["copy_tbs"], 1),
    "fast.decode.flash_04_tbs": Figure(FAST, lambda d: _decode(d, 1, 32768)["04 flash_attention"], 2),
    "fast.decode.tbs_32k": Figure(FAST, lambda d: _decode(d, 1, 32768)["fast_decode"], 2),
    "fast.decode.of_copy_32k": Figure(FAST, lambda d: 100 * _decode(d, 1, 32768)["fast_decode"] / d["copy_tbs"]),
    "fast.decode.of_copy_long_min": Figure(FAST, lambda d: min(_decode_of_copy(d, 1, 65536))),
    "fast.decode.of_copy_long_max": Figure(FAST, lambda d: max(_decode_of_copy(d, 1, 65536))),
    "fast.decode.of_copy_b8_min": Figure(FAST, lambda d: min(_decode_of_copy(d, 8))),
    "fast.decode.of_copy_b8_max": Figure(FAST, lambda d: max(_decode_of_copy(d, 8))),
    "fast.decode.of_copy_8k": Figure(FAST, lambda d: 100 * _decode(d, 1, 8192)["fast_decode"] / d["copy_tbs"]),
    "fast.decode.over_best_sdpa_min": Figure(FAST, lambda d: min(_over_best_sdpa(d)), 2),
    "fast.decode.over_best_sdpa_max": Figure(FAST, lambda d: max(_over_best_sdpa(d)), 2),
    # 08, step 1: the causal grid beside cuDNN (one process)
    "gap.of_cudnn_1k": Figure(LAST_GAP, lambda d: _gap(d, 1024)["fast_attention"] / _gap(d, 1024)["SDPA cuDNN"], 2),
    "gap.of_cudnn_16k": Figure(LAST_GAP, lambda d: _gap(d, 16384)["fast_attention"] / _gap(d, 16384)["SDPA cuDNN"], 2),
    "gap.of_cudnn_min": Figure(LAST_GAP, lambda d: min(_gap_ratios(d, "fast_attention", "SDPA cuDNN")), 2),
    "gap.of_cudnn_max": Figure(LAST_GAP, lambda d: max(_gap_ratios(d, "fast_attention", "SDPA cuDNN")), 2),
    "gap.fast_8k": Figure(LAST_GAP, lambda d: _gap(d, 8192)["fast_attention"]),
    "gap.cudnn_8k": Figure(LAST_GAP, lambda d: _gap(d, 8192)["SDPA cuDNN"]),
    # 08, step 1: Nsight Compute (bf16 causal D = 128)
    "gap.ncu.fast_tensor_1k": Figure(PROFILE, lambda p: _kernel(p, 1024, "fast_fwd")["tensor_pipe_pct"]),
    "gap.ncu.cudnn_tensor_1k": Figure(PROFILE, lambda p: _kernel(p, 1024, "cudnn")["tensor_pipe_pct"]),
    "gap.ncu.fast_tensor_16k": Figure(PROFILE, lambda p: _kernel(p, 16384, "fast_fwd")["tensor_pipe_pct"]),
    "gap.ncu.cudnn_tensor_16k": Figure(PROFILE, lambda p: _kernel(p, 16384, "cudnn")["tensor_pipe_pct"]),
    "gap.ncu.fast_occupancy_1k": Figure(PROFILE, lambda p: _kernel(p, 1024, "fast_fwd")["achieved_occupancy_pct"], 1),
    "gap.ncu.cudnn_occupancy_1k": Figure(PROFILE, lambda p: _kernel(p, 1024, "cudnn")["achieved_occupancy_pct"], 1),
    "gap.ncu.fast_issue_1k": Figure(PROFILE, lambda p: _kernel(p, 1024, "fast_fwd")["issue_slots_pct"]),
    "gap.ncu.cudnn_issue_1k": Figure(PROFILE, lambda p: _kernel(p, 1024, "cudnn")["issue_slots_pct"]),
    "gap.ncu.fast_wait_1k": Figure(PROFILE, lambda p: _kernel(p, 1024, "fast_fwd")["stalls_per_issue"]["wait"], 2),
    "gap.ncu.fast_barrier_1k": Figure(PROFILE, lambda p: _kernel(p, 1024, "fast_fwd")["stalls_per_issue"]["barrier"], 2),
    "gap.ncu.fast_memory_1k": Figure(
        PROFILE, lambda p: _kernel(p, 1024, "fast_fwd")["stalls_per_issue"]["long_scoreboard"], 2),
    "gap.ncu.cudnn_memory_1k": Figure(
        PROFILE, lambda p: _kernel(p, 1024, "cudnn")["stalls_per_issue"]["long_scoreboard"], 2),
    "gap.ncu.fast_barrier_16k": Figure(PROFILE, lambda p: _kernel(p, 16384, "fast_fwd")["stalls_per_issue"]["barrier"], 2),
    "gap.ncu.cudnn_barrier_16k": Figure(PROFILE, lambda p: _kernel(p, 16384, "cudnn")["stalls_per_issue"]["barrier"], 2),
    "gap.ncu.cudnn_grid": Figure(PROFILE, lambda p: _kernel(p, 1024, "cudnn")["grid"]),
    "gap.ncu.cudnn_threads": Figure(PROFILE, lambda p: _kernel(p, 1024, "cudnn")["block"]),
    "gap.ncu.fast_grid_1k": Figure(PROFILE, lambda p: _kernel(p, 1024, "fast_fwd")["grid"]),
    "gap.ncu.fast_dram_1k": Figure(PROFILE, lambda p: _kernel(p, 1024, "fast_fwd")["dram_active_pct"]),
    "gap.ncu.lpt_dram_1k": Figure(PROFILE, lambda p: _kernel(p, 1024, "lpt_fwd")["dram_active_pct"]),
    "gap.ncu.fast_dram_16k": Figure(PROFILE, lambda p: _kernel(p, 16384, "fast_fwd")["dram_active_pct"]),
    "gap.ncu.lpt_dram_16k": Figure(PROFILE, lambda p: _kernel(p, 16384, "lpt_fwd")["dram_active_pct"]),
    "gap.ncu.fp8_issue_16k": Figure(PROFILE, lambda p: _kernel(p, 16384, "fp8_fwd")["issue_slots_pct"]),
    "gap.ncu.fp8_tensor_16k": Figure(PROFILE, lambda p: _kernel(p, 16384, "fp8_fwd")["tensor_pipe_pct"]),
    "gap.ncu.fast_issue_16k": Figure(PROFILE, lambda p: _kernel(p, 16384, "fast_fwd")["issue_slots_pct"]),
    # 08, steps 1 to 3: the tail of the causal grid (simulated) and longest first
    "gap.tail.fast_1k": Figure(LAST_GAP, lambda d: _tail(d, 1024, 64, "fast order"), 1),
    "gap.tail.lpt_1k": Figure(LAST_GAP, lambda d: _tail(d, 1024, 64, "LPT order"), 1),
    "gap.tail.fast_16k": Figure(LAST_GAP, lambda d: _tail(d, 16384, 128, "fast order"), 1),
    "gap.lpt.order_1k": Figure(LAST_GAP, lambda d: _gap(d, 1024)["LPT order"]),
    "gap.lpt.fast_1k": Figure(LAST_GAP, lambda d: _gap(d, 1024)["fast_attention"]),
    "gap.lpt.order_over_fast_min": Figure(LAST_GAP, lambda d: min(_gap_ratios(d, "LPT order")), 2),
    "gap.lpt.order_over_fast_max": Figure(LAST_GAP, lambda d: max(_gap_ratios(d, "LPT order")), 2),
    "gap.lpt.persistent_over_fast_min": Figure(LAST_GAP, lambda d: min(_gap_ratios(d, "persistent LPT")), 2),
    "gap.lpt.persistent_over_fast_max": Figure(LAST_GAP, lambda d: max(_gap_ratios(d, "persistent LPT")), 2),
    "gap.lpt.groups_over_fast_min": Figure(LPT_GROUPS, lambda d: min(_groups_over_fast(d)), 2),
    "gap.lpt.groups_over_fast_max": Figure(LPT_GROUPS, lambda d: max(_groups_over_fast(d)), 2),
    "gap.lpt.group_heads_1k": Figure(LPT_GROUPS, lambda d: d["lpt_groups"][0]["head_group"]),
    "gap.lpt.group_heads_16k": Figure(LPT_GROUPS, lambda d: d["lpt_groups"][-1]["head_group"]),
    # 08, step 6: FP8 speed (kernel alone, and end to end with the quantization) and error (RMS in units of 10^-3)
    "gap.fp8.over_fast_d128_min": Figure(LAST_GAP, lambda d: min(_gap_ratios(d, "FP8", d=128)), 2),
    "gap.fp8.over_fast_d128_max": Figure(LAST_GAP, lambda d: max(_gap_ratios(d, "FP8", d=128)), 2),
    "gap.fp8.over_fast_d64_min": Figure(LAST_GAP, lambda d: min(_gap_ratios(d, "FP8", d=64)), 2),
    "gap.fp8.over_fast_d64_max": Figure(LAST_GAP, lambda d: max(_gap_ratios(d, "FP8", d=64)), 2),
    "gap.fp8.tflops_16k": Figure(LAST_GAP, lambda d: _gap(d, 16384)["FP8"]),
    "gap.fp8.prepare_torch_ms": Figure(FP8_PREPARE, lambda d: _fp8_prepare(d, 8192)["prepare_torch_ms"], 1),
    "gap.fp8.prepare_ms": Figure(FP8_PREPARE, lambda d: _fp8_prepare(d, 8192)["prepare_ms"], 2),
    "gap.fp8.torch_quantize_tflops_4k": Figure(FP8_PREPARE,
                                               lambda d: _fp8_prepare(d, 4096)["fp8_attention, PyTorch quantize"]),
    "gap.fp8.torch_quantize_tflops_16k": Figure(FP8_PREPARE,
                                                lambda d: _fp8_prepare(d, 16384)["fp8_attention, PyTorch quantize"]),
    "gap.fp8.end_to_end_tflops_16k": Figure(FP8_PREPARE, lambda d: _fp8_prepare(d, 16384)["fp8_attention"]),
    "gap.fp8.end_to_end_over_hopper_min": Figure(FP8_PREPARE, lambda d: min(_over(d, "fp8_attention", "hopper_attention")), 2),
    "gap.fp8.end_to_end_over_hopper_max": Figure(FP8_PREPARE, lambda d: max(_over(d, "fp8_attention", "hopper_attention")), 2),
    "gap.fp8.end_to_end_over_cudnn_min": Figure(FP8_PREPARE, lambda d: min(_over(d, "fp8_attention", "SDPA cuDNN")), 2),
    "gap.fp8.end_to_end_over_cudnn_max": Figure(FP8_PREPARE, lambda d: max(_over(d, "fp8_attention", "SDPA cuDNN")), 2),
    "gap.fp8.gluon_over_hopper_min": Figure(FP8_GLUON, lambda d: min(_over(d, "FP8 Gluon kernel", "hopper_attention")), 2),
    "gap.fp8.gluon_over_hopper_max": Figure(FP8_GLUON, lambda d: max(_over(d, "FP8 Gluon kernel", "hopper_attention")), 2),
    "gap.fp8.gluon_over_triton_min": Figure(FP8_GLUON, lambda d: min(_over(d, "FP8 Gluon kernel", "FP8 kernel")), 2),
    "gap.fp8.gluon_over_triton_max": Figure(FP8_GLUON, lambda d: max(_over(d, "FP8 Gluon kernel", "FP8 kernel")), 2),
    "gap.fp8.gluon_tflops_16k": Figure(FP8_GLUON, lambda d: _fp8_prepare(d, 16384)["FP8 Gluon kernel"]),
    "gap.fp8.gluon_full_8k": Figure(FP8_GLUON, lambda d: _fp8_prepare(d, 8192, causal=False)["FP8 Gluon kernel"]),
    "gap.fp8.gluon_end_to_end_4k": Figure(FP8_GLUON, lambda d: _end_to_end(d, 4096), 2),
    "gap.fp8.gluon_end_to_end_8k": Figure(FP8_GLUON, lambda d: _end_to_end(d, 8192), 2),
    "gap.fp8.gluon_end_to_end_16k": Figure(FP8_GLUON, lambda d: _end_to_end(d, 16384), 2),
    "gap.fp8.gluon_end_to_end_full_8k": Figure(FP8_GLUON, lambda d: _end_to_end(d, 8192, causal=False), 2),
    "gap.fp8.gluon_end_to_end_over_cudnn_max": Figure(FP8_GLUON, lambda d: max(_over(d, "fp8_attention", "SDPA cuDNN")), 2),
    "gap.fp8.rounding.prepare_ms": Figure(FP8_ROUNDING, lambda d: _fp8_prepare(d, 8192)["prepare_ms"], 2),
    "gap.fp8.rounding.end_to_end_4k": Figure(FP8_ROUNDING, lambda d: _end_to_end(d, 4096), 2),
    "gap.fp8.rounding.end_to_end_8k": Figure(FP8_ROUNDING, lambda d: _end_to_end(d, 8192), 2),
    "gap.fp8.rounding.end_to_end_16k": Figure(FP8_ROUNDING, lambda d: _end_to_end(d, 16384), 2),
    "gap.fp8.rounding.end_to_end_full_8k": Figure(FP8_ROUNDING, lambda d: _end_to_end(d, 8192, causal=False), 2),
    "gap.fp8.rounding.identical": Figure(FP8_ROUNDING, lambda d: sum(r["identical"] and r["identical_rotated"]
                                                                     for r in d["fp8_prepare"])),
    "gap.fp8.rounding.rows": Figure(FP8_ROUNDING, lambda d: len(d["fp8_prepare"])),
    "gap.fp8.qq.prepare_kv_ms": Figure(FP8_Q_IN_KERNEL, lambda d: _fp8_prepare(d, 8192)["prepare_kv_ms"], 2),
    "gap.fp8.qq.prepare_ms": Figure(FP8_Q_IN_KERNEL, lambda d: _fp8_prepare(d, 8192)["prepare_ms"], 2),
    "gap.fp8.qq.kernel_min": Figure(FP8_Q_IN_KERNEL, lambda d: min(_over(d, *_FP8_Q_LEFT_OVER_WHOLE)), 2),
    "gap.fp8.qq.kernel_max": Figure(FP8_Q_IN_KERNEL, lambda d: max(_over(d, *_FP8_Q_LEFT_OVER_WHOLE)), 2),
    "gap.fp8.qq.end_to_end_4k": Figure(FP8_Q_IN_KERNEL, lambda d: _end_to_end(d, 4096), 2),
    "gap.fp8.qq.end_to_end_8k": Figure(FP8_Q_IN_KERNEL, lambda d: _end_to_end(d, 8192), 2),
    "gap.fp8.qq.end_to_end_16k": Figure(FP8_Q_IN_KERNEL, lambda d: _end_to_end(d, 16384), 2),
    "gap.fp8.qq.end_to_end_full_8k": Figure(FP8_Q_IN_KERNEL, lambda d: _end_to_end(d, 8192, causal=False), 2),
    "gap.fp8.qq.whole_4k": Figure(FP8_Q_IN_KERNEL, lambda d: _q_prepared_whole(d, 4096), 2),
    "gap.fp8.qq.whole_8k": Figure(FP8_Q_IN_KERNEL, lambda d: _q_prepared_whole(d, 8192), 2),
    "gap.fp8.qq.rms_4k": Figure(FP8_Q_IN_KERNEL, lambda d: 1e3 * _fp8_prepare(d, 4096)["fp8_attention RMS error"], 2),
    "gap.fp8.qq.rms_whole_4k": Figure(FP8_Q_IN_KERNEL,
                                      lambda d: 1e3 * _fp8_prepare(d, 4096)["FP8 Gluon kernel RMS error"], 2),
    "gap.fp8.qq.rms_lower": Figure(FP8_Q_IN_KERNEL, lambda d: sum(r["fp8_attention RMS error"]
                                                                  < r["FP8 Gluon kernel RMS error"]
                                                                  for r in d["fp8_prepare"])),
    "gap.fp8.qq.rows": Figure(FP8_Q_IN_KERNEL, lambda d: len(d["fp8_prepare"])),
    "gap.fp8.run_a.end_to_end_4k": Figure(FP8_RUN_A, lambda d: _end_to_end(d, 4096), 2),
    "gap.fp8.run_b.end_to_end_4k": Figure(FP8_RUN_B, lambda d: _end_to_end(d, 4096), 2),
    "gap.fp8.run_a.end_to_end_max": Figure(FP8_RUN_A, lambda d: max(_over(d, "fp8_attention", "hopper_attention")), 2),
    "gap.fp8.pv_first.slower_4k": Figure(PV_FIRST_SWAPPED,
                                         lambda d: sum(x < 1 for x in _over(d, *_PV_FIRST_OVER_FP8, t=4096))),
    "gap.fp8.pv_first.runs": Figure(PV_FIRST_SWAPPED, lambda d: len(_over(d, *_PV_FIRST_OVER_FP8, t=4096))),
    "gap.fp8.pv_first.min_4k": Figure(PV_FIRST_SWAPPED, lambda d: min(_over(d, *_PV_FIRST_OVER_FP8, t=4096)), 3),
    "gap.fp8.pv_first.max_4k": Figure(PV_FIRST_SWAPPED, lambda d: max(_over(d, *_PV_FIRST_OVER_FP8, t=4096)), 3),
    "gap.fp8.sass.per_score": Figure(FP8_SASS, lambda d: _per_exponential(d, 0), 2),
    "gap.fp8.sass.bf16_per_score": Figure(FP8_SASS, lambda d: _per_exponential(d, 1), 2),
    "gap.fp8.relabel.runs": Figure(FP8_RELABELLED, lambda d: len(d["overlap_runs"])),
    "gap.fp8.relabel.faster_rows": Figure(FP8_RELABELLED, lambda d: sum(x > 1 for x in _relabelled_over(d, "kernel"))),
    "gap.fp8.relabel.rows": Figure(FP8_RELABELLED, lambda d: len(_relabelled_over(d, "kernel"))),
    "gap.fp8.relabel.min": Figure(FP8_RELABELLED, lambda d: min(_relabelled_over(d, "kernel")), 2),
    "gap.fp8.relabel.max": Figure(FP8_RELABELLED, lambda d: max(_relabelled_over(d, "kernel")), 2),
    "gap.fp8.relabel.over_hopper_min": Figure(FP8_RELABELLED, lambda d: min(_relabelled_over(d, "hopper_attention")), 2),
    "gap.fp8.relabel.over_hopper_max": Figure(FP8_RELABELLED, lambda d: max(_relabelled_over(d, "hopper_attention")), 2),
    "gap.fp8.landed.d128_min": Figure(FP8_LANDED, lambda d: min(_over(d, *_LANDED_OVER_BEFORE, d=128)), 3),
    "gap.fp8.landed.d128_max": Figure(FP8_LANDED, lambda d: max(_over(d, *_LANDED_OVER_BEFORE, d=128)), 2),
    "gap.fp8.landed.d64_min": Figure(FP8_LANDED, lambda d: min(_over(d, *_LANDED_OVER_BEFORE, d=64)), 2),
    "gap.fp8.landed.d64_max": Figure(FP8_LANDED, lambda d: max(_over(d, *_LANDED_OVER_BEFORE, d=64)), 2),
    "gap.fp8.landed.over_hopper_min": Figure(FP8_LANDED, lambda d: min(_over(d, *_LANDED_OVER_BF16, d=128)), 2),
    "gap.fp8.landed.over_hopper_max": Figure(FP8_LANDED, lambda d: max(_over(d, *_LANDED_OVER_BF16, d=128)), 2),
    "gap.fp8.landed.same_bits": Figure(FP8_LANDED, lambda d: sum(c["same bits"] for c in d["checks"])
                                       + sum(r["same_bits"] for r in d["rows"])),
    "gap.fp8.landed_end.end_to_end_4k": Figure(FP8_LANDED_END, lambda d: _end_to_end(d, 4096), 2),
    "gap.fp8.landed_end.end_to_end_max": Figure(FP8_LANDED_END,
                                                lambda d: max(_over(d, "fp8_attention", "hopper_attention")), 2),
    "gap.fp8.landed_end.kernel_min": Figure(FP8_LANDED_END, lambda d: min(_over(d, *_FP8_Q_LEFT_OVER_BF16)), 2),
    "gap.fp8.landed_end.kernel_max": Figure(FP8_LANDED_END, lambda d: max(_over(d, *_FP8_Q_LEFT_OVER_BF16)), 2),
    "hopper.ptxas.serialized_min": Figure(TRITON39_PTXAS, lambda d: min(_assembled_over(d, "39", "39w")), 2),
    "hopper.ptxas.serialized_max": Figure(TRITON39_PTXAS, lambda d: max(_assembled_over(d, "39", "39w")), 2),
    "hopper.ptxas.pinned_of_native_min": Figure(TRITON39_PTXAS, lambda d: min(_assembled_over(d, "39w", "native")), 2),
    "hopper.ptxas.pinned_of_native_max": Figure(TRITON39_PTXAS, lambda d: max(_assembled_over(d, "39w", "native")), 2),
    "hbwd.swap64.min": Figure(PV_FIRST_SWAPPED, lambda d: min(_swapped_over_kernel(d, 4096)), 2),
    "hbwd.swap64.max": Figure(PV_FIRST_SWAPPED, lambda d: max(_swapped_over_kernel(d, 4096)), 2),
    "gap.fp8.schedule.gain_min": Figure(FP8_SCHEDULE, lambda d: min(_over(d, *_FP8_DEFAULT_OVER_STEP_5)), 2),
    "gap.fp8.schedule.gain_max": Figure(FP8_SCHEDULE, lambda d: max(_over(d, *_FP8_DEFAULT_OVER_STEP_5)), 2),
    "gap.fp8.schedule.over_bf16_min": Figure(FP8_SCHEDULE, lambda d: min(_over(d, *_FP8_DEFAULT_OVER_BF16)), 2),
    "gap.fp8.schedule.over_bf16_max": Figure(FP8_SCHEDULE, lambda d: max(_over(d, *_FP8_DEFAULT_OVER_BF16)), 2),
    "gap.fp8.schedule.over_cudnn_max": Figure(FP8_SCHEDULE, lambda d: max(_over(d, *_FP8_DEFAULT_OVER_CUDNN)), 2),
    "gap.fp8.schedule.tflops_16k": Figure(FP8_SCHEDULE, lambda d: next(
        r["+ o by TMA"] for r in d["fp8_schedule"] if r["causal"] and r["t"] == 16384)),
    "gap.fp8.schedule.identical": Figure(FP8_SCHEDULE, lambda d: sum(r["identical"] for r in d["fp8_schedule"])),
    "gap.fp8.schedule.rows": Figure(FP8_SCHEDULE, lambda d: len(d["fp8_schedule"])),
    "gap.fp8.schedule.end_to_end_4k": Figure(FP8_SCHEDULE_END, lambda d: _end_to_end(d, 4096), 2),
    "gap.fp8.schedule.end_to_end_8k": Figure(FP8_SCHEDULE_END, lambda d: _end_to_end(d, 8192), 2),
    "gap.fp8.schedule.end_to_end_16k": Figure(FP8_SCHEDULE_END, lambda d: _end_to_end(d, 16384), 2),
    "gap.fp8.schedule.end_to_end_full_8k": Figure(FP8_SCHEDULE_END, lambda d: _end_to_end(d, 8192, causal=False), 2),
    "gap.fp8.ncu.tensor_16k": Figure(FP8_NCU, lambda d: _fp8_ncu(d, "fp8")["tensor_pipe_pct"]),
    "gap.fp8.ncu.bf16_tensor_16k": Figure(FP8_NCU, lambda d: _fp8_ncu(d, "bf16")["tensor_pipe_pct"]),
    "gap.fp8.ncu.xu_16k": Figure(FP8_NCU, lambda d: _fp8_ncu(d, "fp8")["xu_pipe_pct"]),
    "gap.fp8.ncu.bf16_xu_16k": Figure(FP8_NCU, lambda d: _fp8_ncu(d, "bf16")["xu_pipe_pct"]),
    "gap.fp8.rms_bf16_gauss": Figure(LAST_GAP, lambda d: 1e3 * _fp8_error(d, _GAUSS, "bf16 fast_attention", "rms"), 2),
    "gap.fp8.rms_fp8_gauss": Figure(LAST_GAP, lambda d: 1e3 * _fp8_error(d, _GAUSS, "FP8", "rms"), 2),
    "gap.fp8.rms_rot_gauss": Figure(LAST_GAP, lambda d: 1e3 * _fp8_error(d, _GAUSS, "FP8 + rotation", "rms"), 2),
    "gap.fp8.rms_bf16_outliers": Figure(
        LAST_GAP, lambda d: 1e3 * _fp8_error(d, _OUTLIERS, "bf16 fast_attention", "rms"), 2),
    "gap.fp8.rms_fp8_outliers": Figure(LAST_GAP, lambda d: 1e3 * _fp8_error(d, _OUTLIERS, "FP8", "rms"), 2),
    "gap.fp8.rms_rot_outliers": Figure(LAST_GAP, lambda d: 1e3 * _fp8_error(d, _OUTLIERS, "FP8 + rotation", "rms"), 2),
    "gap.fp8.max_fp8_outliers": Figure(LAST_GAP, lambda d: _fp8_error(d, _OUTLIERS, "FP8", "max"), 2),
    "gap.fp8.max_rot_outliers": Figure(LAST_GAP, lambda d: _fp8_error(d, _OUTLIERS, "FP8 + rotation", "max"), 2),
    "gap.fp8.rotation_gain": Figure(LAST_GAP, lambda d: _fp8_error(d, _OUTLIERS, "FP8", "rms")
                                    / _fp8_error(d, _OUTLIERS, "FP8 + rotation", "rms"), 1),
    # 05's given steps: the lse forward, decode at short caches; 08, steps 4 and 5: Hopper's pipelining options, Gluon
    "gap2.lse.over_fast_min": Figure(LAST_GAP_2, lambda d: min(_lse_over_fast(d)), 2),
    "gap2.lse.over_fast_max": Figure(LAST_GAP_2, lambda d: max(_lse_over_fast(d)), 2),
    "gap2.lse.over_fast_median": Figure(LAST_GAP_2, lambda d: sorted(_lse_over_fast(d))[len(d["prefill"]) // 2], 2),
    "gap2.lse.rows": Figure(LAST_GAP_2, lambda d: len(d["prefill"])),
    "gap2.lse.error_e6": Figure(LAST_GAP_2, lambda d: 1e6 * max(r["lse error"] for r in d["prefill"]), 1),
    "gap2.fast.repeat_4k": Figure(LAST_GAP_2, lambda d: d["prefill"][2]["fast_attention"]),
    "gap2.fast.trial_4k": Figure(TRIALS, lambda d: _trial(d, "pipeline", 4096, "fast_attention")),
    "hopper.of_cudnn_min": Figure(HOPPER, lambda d: min(_hopper_ratios(d, False)), 2),
    "hopper.of_cudnn_max": Figure(HOPPER, lambda d: max(_hopper_ratios(d, False)), 2),
    "hopper.best_of_cudnn_min": Figure(HOPPER, lambda d: min(_hopper_ratios(d, True)), 2),
    "hopper.best_of_cudnn_max": Figure(HOPPER, lambda d: max(_hopper_ratios(d, True)), 2),
    "hopper.rows_at_cudnn": Figure(HOPPER, lambda d: sum(x >= 0.995 for x in _hopper_ratios(d, True))),
    "hopper.rows": Figure(HOPPER, lambda d: len(d["prefill"])),
    "hopper.causal_16k": Figure(HOPPER, lambda d: _hopper_row(d, 16384)["hopper_attention"]),
    "hopper.cudnn_causal_16k": Figure(HOPPER, lambda d: _hopper_row(d, 16384)["SDPA cuDNN"]),
    "hopper.fast_causal_16k": Figure(HOPPER, lambda d: _hopper_row(d, 16384)["fast_attention"]),
    "hopper.causal_1k_of_cudnn": Figure(HOPPER, lambda d: _hopper_row(d, 1024)["hopper_attention"]
                                        / _hopper_row(d, 1024)["SDPA cuDNN"], 2),
    "hopper.full_1k": Figure(HOPPER, lambda d: _hopper_row(d, 1024, causal=False)["hopper_attention"]),
    "hopper.fast_full_1k": Figure(HOPPER, lambda d: _hopper_row(d, 1024, causal=False)["fast_attention"]),
    "hopper.repeat_rows_within_5": Figure(HOPPER, lambda d: sum(abs(x - 1) <= 0.05 for x in _hopper_repeats(d))),
    "hopper.repeat_worst_pct": Figure(HOPPER, lambda d: 100 * max(abs(x - 1) for x in _hopper_repeats(d))),
    "hopper.c3.over_two_min": Figure(CONSUMERS, lambda d: min(_three_over_two(d, causal=True, t_at_least=4096)), 2),
    "hopper.c3.over_two_max": Figure(CONSUMERS, lambda d: max(_three_over_two(d, causal=True, t_at_least=4096)), 2),
    "hopper.c3.over_two_1k": Figure(CONSUMERS, lambda d: _three_over_two(d, causal=True, t_at_most=1024)[0], 2),
    "hopper.c3.full_over_two_min": Figure(CONSUMERS, lambda d: min(_three_over_two(d, causal=False)), 2),
    "hopper.c3.full_over_two_max": Figure(CONSUMERS, lambda d: max(_three_over_two(d, causal=False)), 2),
    "hopper.c3.causal_16k": Figure(CONSUMERS, lambda d: _consumers_row(d, 16384)["3 consumers"]),
    "hopper.c3.two_causal_16k": Figure(CONSUMERS, lambda d: _consumers_row(d, 16384)["2 consumers"]),
    "hopper.c3.cudnn_causal_16k": Figure(CONSUMERS, lambda d: _consumers_row(d, 16384)["SDPA cuDNN"]),
    "hopper.c3.identical": Figure(CONSUMERS, lambda d: sum(r["identical"] for r in d["consumers"])),
    "hopper.c3.rows": Figure(CONSUMERS, lambda d: len(d["consumers"])),
    "hopper.c3.split_4k": Figure(CONSUMERS_SPLIT, lambda d: _three_over_two(
        d, causal=True, t_at_least=4096, t_at_most=4096, kv_heads=32)[0], 2),
    "hopper.c3.six_4k": Figure(CONSUMERS_SIX, lambda d: _three_over_two(
        d, causal=True, t_at_least=4096, t_at_most=4096, kv_heads=32)[0], 2),
    "hopper.c3.six_4k_gqa": Figure(CONSUMERS_SIX, lambda d: _three_over_two(
        d, causal=True, t_at_least=4096, t_at_most=4096, kv_heads=8)[0], 2),
    "hopper.c3.six_from_8k_min": Figure(CONSUMERS_SIX, lambda d: min(_three_over_two(
        d, causal=True, t_at_least=8192)), 2),
    "hopper.c3.six_from_8k_max": Figure(CONSUMERS_SIX, lambda d: max(_three_over_two(
        d, causal=True, t_at_least=8192)), 2),
    "hopper.overlap.short_min": Figure(OVERLAP, lambda d: min(_overlap_gain(d, causal=True, t_at_most=2048)), 2),
    "hopper.overlap.short_max": Figure(OVERLAP, lambda d: max(_overlap_gain(d, causal=True, t_at_most=2048)), 2),
    "hopper.overlap.short_mha_min": Figure(OVERLAP, lambda d: min(_overlap_gain(d, causal=True, t_at_most=2048,
                                                                                dtype="bf16", kv_heads=32)), 2),
    "hopper.overlap.causal_16k": Figure(OVERLAP, lambda d: _overlap_gain(d, causal=True, t=16384)[0], 2),
    "hopper.overlap.three_consumers_4k": Figure(OVERLAP, lambda d: _overlap_gain(d, causal=True, d=64, t=4096)[0], 2),
    "hopper.overlap.repeat_worst_pct": Figure(OVERLAP, lambda d: 100 * max(abs(x - 1) for x in _overlap_repeats(d))),
    "hopper.overlap.identical": Figure(OVERLAP, lambda d: sum(r["identical"] for r in d["overlap"])),
    "hopper.overlap.rows": Figure(OVERLAP, lambda d: len(d["overlap"])),
    "hopper.otma.causal_min": Figure(TMA_STORE_GRID, lambda d: min(_tma_store_gain(d, causal=True)), 2),
    "hopper.otma.causal_max": Figure(TMA_STORE_GRID, lambda d: max(_tma_store_gain(d, causal=True)), 2),
    "hopper.otma.causal_1k": Figure(TMA_STORE_GRID, lambda d: _tma_store_gain(
        d, causal=True, t=1024, d=128, dtype="bf16", kv_heads=32)[0], 2),
    "hopper.otma.full_min": Figure(TMA_STORE_GRID, lambda d: min(_tma_store_gain(d, causal=False)), 2),
    "hopper.otma.full_max": Figure(TMA_STORE_GRID, lambda d: max(_tma_store_gain(d, causal=False)), 2),
    "hopper.otma.of_cudnn_min": Figure(TMA_STORE_GRID, lambda d: min(_over(d, "o by TMA", "SDPA cuDNN",
                                                                                      "tma_store")), 2),
    "hopper.otma.of_cudnn_max": Figure(TMA_STORE_GRID, lambda d: max(_over(d, "o by TMA", "SDPA cuDNN",
                                                                                      "tma_store")), 2),
    # hopper_attention's own column runs the 'o by TMA' kernel wherever T % 64 == 0: the run's repeat spread
    "hopper.otma.repeat_worst_pct": Figure(TMA_STORE_GRID, lambda d: 100 * max(
        abs(r["hopper_attention"] / r["o by TMA"] - 1) for r in d["tma_store"] if r["t"] % 64 == 0)),
    "hopper.otma.identical": Figure(TMA_STORE_GRID, lambda d: sum(r["identical"] for r in d["tma_store"])),
    "hopper.otma.rows": Figure(TMA_STORE_GRID, lambda d: len(d["tma_store"])),
    # 08, step 5: the versions before hopper_attention, bf16 causal D = 128 T = 16k unless named (each its own run)
    **_version_figures(1, causal_16k=(CAUSAL_16K, 0), cudnn_16k=(CUDNN, 0), fast_16k=(FAST_SAME_RUN, 0)),
    **_version_figures(2, causal_16k_2_stages=(CAUSAL_16K, 0), causal_16k_3_stages=(CAUSAL_16K, 2),
                       cudnn_16k=(CUDNN, 0)),
    **_version_figures(3, causal_16k=(CAUSAL_16K, 0), cudnn_16k=(CUDNN, 0), full_16k_pingpong=(OTHER_ROWS, 2),
                       cudnn_full_16k=(OTHER_ROWS, 3)),
    **_version_figures(4, causal_16k=(CAUSAL_16K, 0), one_per_item_16k=(CAUSAL_16K, 1), cudnn_16k=(CUDNN, 0),
                       full_1k=(OTHER_ROWS, 1), one_per_item_full_1k=(OTHER_ROWS, 2), cudnn_full_1k=(OTHER_ROWS, 3)),
    **_version_figures(5, causal_16k=(CAUSAL_16K, 0), one_per_item_16k=(CAUSAL_16K, 1), cudnn_16k=(CUDNN, 0),
                       causal_1k=(OTHER_ROWS, 1), one_per_item_1k=(OTHER_ROWS, 2), cudnn_1k=(OTHER_ROWS, 3),
                       causal_2k=(OTHER_ROWS, 6), one_per_item_2k=(OTHER_ROWS, 7)),
    "training.seeds.from_step": Figure(TRAINING_SEEDS, lambda d: d["from_step"]),
    # 06: how many times slower the backward is with dQ added by atomics than with dQ's own kernel
    "backward.atomic_dq_slower_min": Figure(BACKWARD, lambda d: min(r["dq kernel"] / r["atomic dq"] for r in d["dq"]), 1),
    "backward.atomic_dq_slower_max": Figure(BACKWARD, lambda d: max(r["dq kernel"] / r["atomic dq"] for r in d["dq"]), 1),
    "training.seeds.course_gap_max": Figure(TRAINING_SEEDS, lambda d: max(abs(g) for g in d["gap_per_seed"]), 3),
    "training.seeds.torch_gap_max": Figure(TRAINING_SEEDS,
                                           lambda d: max(abs(g) for g in d["torch_kernels_gap_per_seed"]), 3),
    "training.seeds.sdpa_range": Figure(TRAINING_SEEDS, lambda d: d["sdpa_seed_range"], 2),
    "fused.over_two_min": Figure(FUSED, lambda d: min(_fused_over_two(d)), 2),
    "fused.over_two_max": Figure(FUSED, lambda d: max(_fused_over_two(d)), 2),
    "fused.tbs_8k": Figure(FUSED, lambda d: _decode(d, 1, 8192, "decode_fused")["fused_decode"], 2),
    "fused.two_8k": Figure(FUSED, lambda d: _decode(d, 1, 8192, "decode_fused")["fast_decode"], 2),
    "gap2.stages.s3_128x64_16k": Figure(TRIALS, lambda d: _trial(d, "pipeline", 16384, "128x64 w8 s3")),
    "gap2.stages.s5_128x64_16k": Figure(TRIALS, lambda d: _trial(d, "pipeline", 16384, "128x64 w8 s5")),
    "gap2.stages.s3_128x128_16k": Figure(TRIALS, lambda d: _trial(d, "pipeline", 16384, "128x128 w8 s3")),
    "gap2.stages.s3_64x64_1k": Figure(TRIALS, lambda d: _trial(d, "pipeline", 1024, "64x64 w4 s3")),
    "gap2.stages.s4_64x64_1k": Figure(TRIALS, lambda d: _trial(d, "pipeline", 1024, "64x64 w4 s4")),
    "gap2.ws.best_1k": Figure(TRIALS, lambda d: _trial(d, "pipeline_ws", 1024, "128x128 w8 s3 ws")),
    "gap2.ws.best_4k": Figure(TRIALS, lambda d: _trial(d, "pipeline_ws", 4096, "128x128 w8 s3 ws")),
    "gap2.ws.best_16k": Figure(TRIALS, lambda d: _trial(d, "pipeline_ws", 16384, "128x128 w8 s3 ws")),
    "gap2.ws.tuned_1k": Figure(TRIALS, lambda d: _trial(d, "pipeline_ws", 1024, "fast_attention_lse")),
    "gap2.ws.tuned_4k": Figure(TRIALS, lambda d: _trial(d, "pipeline_ws", 4096, "fast_attention_lse")),
    "gap2.ws.tuned_16k": Figure(TRIALS, lambda d: _trial(d, "pipeline_ws", 16384, "fast_attention_lse")),
    "gap2.ws.chosen_rows": Figure(LAST_GAP_2, lambda d: sum("WARP_SPECIALIZE: True" in r["lse config"]
                                                            for r in d["prefill"])),
    "gap2.decode.copy_tbs": Figure(LAST_GAP_2, lambda d: d["copy_tbs"], 2),
    "gap2.decode.default_1k": Figure(LAST_GAP_2, lambda d: _decode(d, 1, 1024)["fast_decode"], 2),
    "gap2.decode.short_1k": Figure(LAST_GAP_2, lambda d: _decode(d, 1, 1024)["short-cache splits"], 2),
    "gap2.decode.default_2k": Figure(LAST_GAP_2, lambda d: _decode(d, 1, 2048)["fast_decode"], 2),
    "gap2.decode.short_2k": Figure(LAST_GAP_2, lambda d: _decode(d, 1, 2048)["short-cache splits"], 2),
    "gap2.decode.default_4k": Figure(LAST_GAP_2, lambda d: _decode(d, 1, 4096)["fast_decode"], 2),
    "gap2.decode.short_4k": Figure(LAST_GAP_2, lambda d: _decode(d, 1, 4096)["short-cache splits"], 2),
    "gap2.decode.short_8k": Figure(LAST_GAP_2, lambda d: _decode(d, 1, 8192)["short-cache splits"], 2),
    "gap2.decode.short_8k_pct": Figure(LAST_GAP_2, lambda d: 100 * _decode(d, 1, 8192)["short-cache splits"] / d["copy_tbs"]),
    "gap2.decode.short_16k_pct": Figure(LAST_GAP_2, lambda d: 100 * _decode(d, 1, 16384)["short-cache splits"] / d["copy_tbs"]),
    "gap2.decode.short_32k_pct": Figure(LAST_GAP_2, lambda d: 100 * _decode(d, 1, 32768)["short-cache splits"] / d["copy_tbs"]),
    "gap2.decode.copy_8k": Figure(LAST_GAP_2, lambda d: _decode(d, 1, 8192)["copy_same_bytes"], 2),
    "gap2.decode.copy_8k_pct": Figure(LAST_GAP_2, lambda d: 100 * _decode(d, 1, 8192)["copy_same_bytes"] / d["copy_tbs"]),
    "gap2.decode.of_copy_8k_pct": Figure(LAST_GAP_2, lambda d: 100 * _decode(d, 1, 8192)["short-cache splits"]
                                         / _decode(d, 1, 8192)["copy_same_bytes"]),
    "gap2.decode.b8_8k_pct": Figure(LAST_GAP_2, lambda d: 100 * _decode(d, 8, 8192)["short-cache splits"] / d["copy_tbs"]),
    "gap2.decode.over_cudnn_min": Figure(LAST_GAP_2, lambda d: min(r["short-cache splits"] / r["SDPA cuDNN"]
                                                                   for r in d["decode"]), 2),
    "gap2.decode.over_cudnn_max": Figure(LAST_GAP_2, lambda d: max(r["short-cache splits"] / r["SDPA cuDNN"]
                                                                   for r in d["decode"]), 2),
    # 04's kernel against SDPA (benchmarks/results), quoted by 05
    "flash04.over_sdpa_d128_min": Figure(FLASH_REPORT, lambda r: min(_flash_04(r, "flash / SDPA flash", 128)), 2),
    "flash04.over_sdpa_d128_max": Figure(FLASH_REPORT, lambda r: max(_flash_04(r, "flash / SDPA flash", 128)), 2),
    "flash04.over_sdpa_d64_min": Figure(FLASH_REPORT, lambda r: min(_flash_04(r, "flash / SDPA flash", 64, 2048)), 2),
    "flash04.over_sdpa_d64_max": Figure(FLASH_REPORT, lambda r: max(_flash_04(r, "flash / SDPA flash", 64, 2048)), 2),
    "flash04.cudnn_over_min": Figure(FLASH_REPORT, lambda r: min(_cudnn_over_04(r)), 1),
    "flash04.cudnn_over_max": Figure(FLASH_REPORT, lambda r: max(_cudnn_over_04(r)), 1),
    "flash04.sweep_sdpa_over": Figure(SWEEP_04, lambda d: _sweep_sdpa_over_04(d, 2048), 1),
    # 03, the memory measured by the solution (CPU, dispatch tracker; B = 1, 4 heads, D = 64, float32)
    "memory03.causal_4k": Figure(SOLUTION_03, lambda out: _memory_peaks(out, 4096)[0]),
    "memory03.online_4k": Figure(SOLUTION_03, lambda out: _memory_peaks(out, 4096)[1]),
    "memory03.saving_4k": Figure(SOLUTION_03, lambda out: _memory_peaks(out, 4096)[0] - _memory_peaks(out, 4096)[1]),
    "memory03.ratio_4k": Figure(SOLUTION_03, lambda out: _memory_peaks(out, 4096)[0] / _memory_peaks(out, 4096)[1]),
    "memory03.causal_16k_predicted": Figure(SOLUTION_03, lambda out: 16 * _memory_peaks(out, 4096)[0]),
    "memory03.causal_16k_predicted_gib": Figure(SOLUTION_03, lambda out: 16 * _memory_peaks(out, 4096)[0] / 1024, 1),
    "memory03.online_16k_predicted": Figure(SOLUTION_03, lambda out: 4 * _memory_peaks(out, 4096)[1]),
    # 07, the ring on two H200s beside one GPU and torch's context_parallel (bf16 causal, Hq 32 / Hkv 8, D = 128)
    "ring.one_gpu_ms_128k": Figure(RING_REPORT, lambda r: _ring(r, 131072, "course kernel, 1 GPU", "ms")),
    "ring.ms_128k": Figure(RING_REPORT, lambda r: _ring(r, 131072, "ring, zigzag, overlapped", "ms"), 1),
    "ring.speedup_128k": Figure(RING_REPORT, lambda r: _ring(r, 131072, "ring, zigzag, overlapped", "speed-up over 1 GPU"), 2),
    "ring.speedup_256k": Figure(RING_REPORT, lambda r: _ring(r, 262144, "ring, zigzag, overlapped", "speed-up over 1 GPU"), 2),
    "ring.tflops_128k": Figure(RING_REPORT, lambda r: _ring(r, 131072, "ring, zigzag, overlapped", "TFLOP/s per GPU")),
    "ring.cp_cudnn_ms_128k": Figure(RING_REPORT, lambda r: _ring(r, 131072, "context_parallel, SDPA cuDNN", "ms"), 1),
    "ring.cp_cudnn_tflops_128k": Figure(
        RING_REPORT, lambda r: _ring(r, 131072, "context_parallel, SDPA cuDNN", "TFLOP/s per GPU")),
    "ring.of_cp_min": Figure(RING_REPORT, lambda r: min(_ring_column(r, "ring / context_parallel speed")), 2),
    "ring.of_cp_max": Figure(RING_REPORT, lambda r: max(_ring_column(r, "ring / context_parallel speed")), 2),
    "ring.over_cp_flash_128k": Figure(RING_REPORT, lambda r: _ring(r, 131072, "context_parallel, SDPA flash", "ms")
                                      / _ring(r, 131072, "ring, zigzag, overlapped", "ms"), 2),
    "ring.contiguous_over_zigzag_128k": Figure(RING_REPORT, lambda r: _ring(r, 131072, "ring, contiguous, overlapped", "ms")
                                               / _ring(r, 131072, "ring, zigzag, overlapped", "ms"), 2),
    "ring.overlap_gain_256k_pct": Figure(RING_REPORT, lambda r: 100 * (_ring(r, 262144, "ring, zigzag, not overlapped", "ms")
                                                                      / _ring(r, 262144, "ring, zigzag, overlapped", "ms") - 1), 1),
    "ring.max_diff": Figure(RING_REPORT, lambda r: max(float(row["max abs diff"]) for row in r.tables[0]
                                                       if row["what"].startswith("ring")), 5),
}


def quoted(text: str) -> list[tuple[str, str]]:
    """The (name, value as written) of every figure quoted in a markdown text."""
    return [(m["name"], m["value"] or "") for m in MARKER.finditer(text)]


def fill(text: str) -> str:
    """The text with every quoted value rewritten from its source (KeyError for an unknown name)."""
    return MARKER.sub(lambda m: f"{FIGURES[m['name']].text()}<!--fig:{m['name']}-->", text)


def markdown_cells(path: Path) -> list[nbformat.NotebookNode]:
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"]


def problems(path: Path, label: str) -> list[str]:
    """Every quoted figure of a notebook that is unknown or differs from what its source gives."""
    found = []
    for cell in markdown_cells(path):
        for name, value in quoted(cell.source):
            if name not in FIGURES:
                found.append(f"{label}: cell {cell.get('id')} quotes an unknown figure {name!r}")
            elif value != FIGURES[name].text():
                found.append(f"{label}: cell {cell.get('id')} quotes {name} as {value or 'nothing'}, its source "
                             f"{FIGURES[name].source} gives {FIGURES[name].text()}")
    return found


def write_figures(path: Path) -> bool:
    """Rewrite the quoted figures of a source notebook from their sources; True when anything changed."""
    nb = nbformat.read(path, as_version=4)
    changed = False
    for cell in nb.cells:
        if cell.cell_type == "markdown" and MARKER.search(cell.source):
            text = fill(cell.source)
            changed |= text != cell.source
            cell.source = text
    if changed:
        nbformat.write(nb, path)
    return changed
