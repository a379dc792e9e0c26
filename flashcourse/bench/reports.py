"""What the benchmarks' command lines share (flashcourse.bench.fast, instructor/bench_backward.py): the opening of
a markdown report, the measurements saved to --json and the report shown and written to --out, a plot's panel
against T, and a main (its arguments too) that measures on a GPU or reads an earlier --json."""

from __future__ import annotations

import argparse
import json

import torch

from flashcourse.bench import GPU_NEEDED


def report_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by `doc`'s first paragraph, with the arguments report_main reads: --out, --json, --png and
    --from-json."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", help="write the markdown report to this file")
    parser.add_argument("--json", help="write the measurements as JSON to this file (after every row)")
    parser.add_argument("--png", help="write the plot to this file")
    parser.add_argument("--from-json", help="measure nothing: write the report and plot of this earlier --json")
    return parser


def report_opening(title: str, environment: str, *paragraphs: str) -> list[str]:
    """A markdown report's first lines: its title, where it was measured, then each paragraph, each followed by a
    blank line."""
    lines = [title, "", f"Measured {environment}.", ""]
    for paragraph in paragraphs:
        lines += [paragraph, ""]
    return lines


def save_json(result: dict, path: str | None) -> None:
    """Write the measurements so far to `path` (--json), if one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def show_report(text: str, path: str | None) -> None:
    """Print the markdown report and write it to `path` (--out), if one was given."""
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)


def label_panel(ax, xlabel: str, ylabel: str, title: str) -> None:
    """A panel of curves against lengths: the x axis in powers of two, its labels, its title and its legend."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()


def grouped_bars(ax, groups: list[str], series: dict[str, list[float]]) -> None:
    """One group of bars per entry of `groups`, one bar in each group per series (its label -> one value a group),
    the group's label centred under its bars."""
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], values, width, label=label)
    ax.set_xticks(range(len(groups)), groups)


def report_main(args, measure, report, plot) -> int:
    """The measurements of --from-json, else measure(args)'s, which needs a GPU (without one: GPU_NEEDED, and 1);
    then report(result) shown and written to --out, plot(result, path) to --png."""
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
    elif not torch.cuda.is_available():
        print(GPU_NEEDED)
        return 1
    else:
        result = measure(args)
    show_report(report(result), args.out)
    if args.png:
        plot(result, args.png)
    return 0
