"""The tile explorer: watch the online softmax fold a row in, one tile at a time.

Three interactive pictures, each a row of ipywidgets controls over a matplotlib figure:

    tile_explorer()              one row of scalar scores and values (the worked example by default),
                                 optionally run through the learner's own `tile_update`
    attention_row_explorer(q, k, v)
                                 one query row of a real attention head: scores q_i k^T / sqrt(D),
                                 causally masked, values one coordinate of v
    causal_blocks(T, S, block_m, block_n)
                                 which (query block, key block) tiles a causal kernel skips, masks
                                 in part, or runs in full

and one static picture, `state_plot(update=None)`: m, l and a / l after each tile of a longer row,
drawn with the correct recurrence or with the learner's `tile_update` (which may still be the stub).

The numbers behind the pictures are plain functions (`learner_trace`, `attention_row`,
`block_classes`, `state_table`), tested against flashcourse.checks.reference.

Each widget is displayed together with a PNG of its current picture in the same output. A frontend
that runs widgets (JupyterLab, Notebook 7, Colab, VS Code) shows the live widget; one that cannot
(nbconvert without widget state, a repository preview, an untrusted notebook) shows the PNG.
"""

from __future__ import annotations

import base64
import html
import io
import math
import random
from typing import Callable, Sequence

import ipywidgets
import numpy as np
from PIL import Image
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from flashcourse.checks import online_softmax as checks, recurrence, reference

# One palette for every picture.
READ = "#4C72B0"          # tiles already folded in
CURRENT = "#DD8452"       # the tile being folded in now
UNREAD = "#CDD3DB"        # tiles not read yet
MAX_NEW = "#C44E52"       # m_new, and anything that is wrong
MAX_OLD = "#8C8C8C"       # m_old
RESCALED = "#8FAADC"      # a statistic after multiplying by alpha
OUTPUT = "#55A868"        # the partial output a / l
TRUTH = "#222222"         # the true softmax output
SKIP, PARTIAL, FULL = "skip", "partial", "full"
BLOCK_COLORS = {SKIP: "#E4E7EB", PARTIAL: "#F2B66D", FULL: "#4C72B0"}
BLOCK_WORDS = {SKIP: "skipped", PARTIAL: "masked in part", FULL: "run in full"}
BUG_NAMES = {"l_not_rescaled": "l not rescaled", "a_not_rescaled": "a not rescaled",
             "per_tile_softmax": "per-tile softmax"}

WORKED_SCORES = tuple(checks.WORKED_SCORES)
WORKED_VALUES = tuple(checks.WORKED_VALUES)

_DPI = 120                # the PNG's pixels per figure inch
_SHOWN_WIDTH = 860        # CSS pixels the picture is shown at
_VALUES_SHOWN = 12        # rows up to this many scores show each value under its score
_LEARNER = "yours"        # the recurrence selector's value for the learner's own tile_update
_CORRECT = "correct"      # and for the correct recurrence (a Dropdown takes a value of None for no choice)


# ---------------------------------------------------------------------------------------------
# The computations behind the pictures
# ---------------------------------------------------------------------------------------------

def learner_trace(update: Callable, scores: Sequence[float], values: Sequence[float],
                  tile: int) -> list[recurrence.TileStep]:
    """Every tile's step for one row, with the state computed by the learner's `update`.

    `update(m, l, a, scores, values) -> (m, l, a)` is called from the empty state, each tile
    starting from the state the learner's previous call returned, so one mistake carries on as it
    would in their `online_softmax`. alpha and p are what the recurrence prescribes for the
    learner's m_old and m_new: exp(m_old - m_new) and exp(s - m_new), with 0 as the reference
    while m_new is -inf. Whatever `update` raises propagates.
    """
    if tile < 1:
        raise ValueError("tile must be at least 1")
    steps, m, l, a = [], -math.inf, 0.0, 0.0
    for index, start in enumerate(range(0, len(scores), tile)):
        s, v = list(scores[start:start + tile]), list(values[start:start + tile])
        result = update(m, l, a, list(s), list(v))
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            raise TypeError(f"tile_update should return the tuple (m, l, a), got {result!r}")
        m_new, l_new, a_new = (float(x) for x in result)
        base = m_new if m_new != -math.inf else 0.0
        alpha = math.exp(m - base) if not math.isnan(base) else math.nan
        p = tuple(math.exp(x - base) if not math.isnan(base) else math.nan for x in s)
        steps.append(recurrence.TileStep(index, tuple(s), tuple(v), m, l, a, m_new, alpha, p, l_new, a_new))
        m, l, a = m_new, l_new, a_new
    return steps


def attention_row(q, k, v, row: int, batch: int = 0, head: int = 0, column: int = 0,
                  query_offset: int | None = None) -> tuple[list[float], list[float]]:
    """One query row of causal attention as plain floats: (scores, values), both of length S.

    q [B, Hq, T, D] (or [T, D]), k and v [B, Hkv, S, D] (or [S, D]). scores[j] = q_row . k_j /
    sqrt(D) in float64, -inf where key j is not visible: query `row` sits at position
    query_offset + row (query_offset defaults to S - T) and sees keys at positions <= its own.
    Query head `head` reads KV head head // (Hq // Hkv). values[j] = v[j, column], so
    softmax(scores) @ values is coordinate `column` of the attention output for this row.
    """
    q, k, v = (x[None, None] if x.dim() == 2 else x for x in (q, k, v))
    t, d = q.shape[2], q.shape[3]
    s = k.shape[2]
    group = q.shape[1] // k.shape[1]
    offset = s - t if query_offset is None else query_offset
    query = q[batch, head, row].double()                                   # [D]
    keys = k[batch, head // group].double()                                # [S, D]
    raw = (keys @ query / math.sqrt(d)).tolist()
    scores = [x if j <= offset + row else -math.inf for j, x in enumerate(raw)]
    return scores, v[batch, head // group, :, column].double().tolist()


def block_classes(T: int, S: int, block_m: int, block_n: int, offset: int | None = None,
                  window: int | None = None) -> list[list[str]]:
    """Classify every (query block, key block) tile of a causal kernel: "skip", "partial" or "full".

    Query i (0 <= i < T) sits at position offset + i (offset defaults to S - T) and sees key j
    (0 <= j < S) when j <= offset + i, and also j > offset + i - window when a window is given.
    A tile is "skip" when none of its (query, key) pairs is visible (the kernel never loads it),
    "full" when all are (no mask needed for causality), "partial" otherwise. Only pairs inside
    T x S count: the ragged last block still needs its bounds mask in a kernel.
    """
    if min(T, S, block_m, block_n) < 1:
        raise ValueError("T, S and the block sizes must be positive")
    if window is not None and window < 1:
        raise ValueError("window must be at least 1")
    offset = S - T if offset is None else offset
    grid = []
    for i0 in range(0, T, block_m):
        first, last = offset + i0, offset + min(i0 + block_m, T) - 1       # positions of the block's rows
        row = []
        for j0 in range(0, S, block_n):
            j1 = min(j0 + block_n, S) - 1
            # Row positions p see keys in (p - window, p]; over the block's rows that is (first - window, last].
            none = j0 > last or (window is not None and j1 <= first - window)
            every = j1 <= first and (window is None or j0 > last - window)
            row.append(SKIP if none else FULL if every else PARTIAL)
        grid.append(row)
    return grid


def _num(x: float) -> str:
    """A number as the course writes it: 1, 1.3679, −∞, and — for undefined."""
    if x is None or math.isnan(x):
        return "—"
    if math.isinf(x):
        return "−∞" if x < 0 else "∞"
    text = str(int(x)) if x == int(x) and abs(x) < 1e6 else f"{x:.4f}"
    return text.replace("-", "−")


def _short(x: float) -> str:
    """A value under its score: whole numbers as they are, others to two decimals."""
    return _num(x) if not math.isfinite(x) or x == int(x) else f"{x:.2f}".replace("-", "−")


def _nums(xs: Sequence[float]) -> str:
    return "[" + ", ".join(_num(x) for x in xs) + "]"


def _ratio(a: float, l: float) -> float:
    return a / l if l else math.nan


def _differs(x: float, y: float) -> bool:
    if math.isnan(x) or math.isnan(y) or math.isinf(x) or math.isinf(y):
        return not (x == y or (math.isnan(x) and math.isnan(y)))
    return abs(x - y) > 1e-6 + 1e-6 * abs(y)


_PANEL_STYLE = """<style>
.fc-panel { font-size: 13px; line-height: 1.4; color: #222; }
.fc-panel .fc-heading { font-weight: bold; margin: 2px 0 6px 10px; }
.fc-panel table { border-collapse: collapse; }
.fc-panel th { padding: 3px 12px; text-align: right; color: #666; font-weight: normal; border-bottom: 1px solid #ddd; }
.fc-panel td { padding: 3px 12px; text-align: right; font-variant-numeric: tabular-nums; }
.fc-panel td.fc-name { text-align: left; white-space: nowrap; color: #333; }
.fc-panel td.fc-wide { text-align: left; }
.fc-panel td.fc-wrong { color: #C44E52; font-weight: bold; }
.fc-panel .fc-want { color: #2F6F3E; }
.fc-panel tr.fc-result td { border-top: 1px solid #ddd; }
.fc-panel .fc-note { margin: 8px 10px 0; max-width: 640px; color: #444; }
</style>"""


def state_table(step: recurrence.TileStep, n_tiles: int, true_output: float,
                correct: recurrence.TileStep | None = None, note: str = "") -> str:
    """The numeric panel for one tile, as HTML.

    Every value sits in a cell with a stable class: fc-scores, fc-m-old, fc-m, fc-alpha, fc-p, fc-values,
    fc-pv, fc-l-old, fc-l-rescaled, fc-l, fc-a-old, fc-a-rescaled, fc-a, fc-output-old, fc-output and
    fc-true; given the correct recurrence's step, also fc-want-m, fc-want-l, fc-want-a and
    fc-want-output, and the cells that differ from it get fc-wrong.
    """
    compare = correct is not None

    def num(cls: str, x: float, want: float | None = None) -> str:
        wrong = " fc-wrong" if want is not None and _differs(x, want) else ""
        return f'<td class="{cls}{wrong}">{html.escape(_num(x))}</td>'

    def wide(cls: str, text: str) -> str:
        return f'<td class="{cls} fc-wide" colspan="3">{html.escape(text)}</td>' + ("<td></td>" if compare else "")

    def rescaled(cls: str, x: float | None, correct_x: float | None) -> str:
        """The × α column: what the code shown did to the old value; empty where that is not seen."""
        return "<td></td>" if x is None else num(cls, x, correct_x if compare else None)

    def want(cls: str, x: float) -> str:
        return f'<td class="fc-want {cls}">{html.escape(_num(x))}</td>' if compare else ""

    def row(label: str, cells: str, cls: str = "") -> str:
        return f'<tr class="{cls}"><td class="fc-name">{label}</td>{cells}</tr>'

    c = correct or step
    m, s = "<i>m</i>", "<i>s</i>"
    rows = [
        row(f"tile scores {s}", wide("fc-scores", _nums(step.scores))),
        row(f"{m}, the running maximum", num("fc-m-old", step.m_old) + "<td></td>"
            + num("fc-m", step.m_new, c.m_new if compare else None) + want("fc-want-m", c.m_new)),
        row(f"α = exp({m}<sub>old</sub> − {m}<sub>new</sub>)", wide("fc-alpha", _num(step.alpha))),
        row(f"<i>p</i> = exp({s} − {m}<sub>new</sub>)", wide("fc-p", _nums(step.p))),
        row("tile values <i>v</i>", wide("fc-values", _nums(step.values))),
        row("<i>p</i>·<i>v</i>", wide("fc-pv", _nums([pj * vj for pj, vj in zip(step.p, step.values)]))),
        row("<i>l</i> = α·<i>l</i> + Σ<i>p</i>", num("fc-l-old", step.l_old)
            + rescaled("fc-l-rescaled", step.l_rescaled, c.l_rescaled)
            + num("fc-l", step.l_new, c.l_new if compare else None) + want("fc-want-l", c.l_new)),
        row("<i>a</i> = α·<i>a</i> + Σ<i>p</i>·<i>v</i>", num("fc-a-old", step.a_old)
            + rescaled("fc-a-rescaled", step.a_rescaled, c.a_rescaled)
            + num("fc-a", step.a_new, c.a_new if compare else None) + want("fc-want-a", c.a_new)),
        row("partial output <i>a</i> / <i>l</i>", num("fc-output-old", _ratio(step.a_old, step.l_old)) + "<td></td>"
            + num("fc-output", step.output, c.output if compare else None) + want("fc-want-output", c.output),
            "fc-result"),
        row(f"true output softmax({s})·<i>v</i>", wide("fc-true", _num(true_output))),
    ]
    header = ("<tr><th></th><th>before</th><th>× α</th><th>after</th>"
              + ('<th class="fc-want">correct</th>' if compare else "") + "</tr>")
    return (f'{_PANEL_STYLE}<div class="fc-panel"><div class="fc-heading">Tile <span class="fc-tile">{step.index + 1}'
            f'</span> of <span class="fc-tiles">{n_tiles}</span></div><table class="fc-table">{header}{"".join(rows)}'
            f"</table>" + (f'<div class="fc-note">{note}</div>' if note else "") + "</div>")


# ---------------------------------------------------------------------------------------------
# Pictures
# ---------------------------------------------------------------------------------------------

def _png(fig: Figure) -> bytes:
    """The figure as a PNG with a 64-colour palette: these flat-coloured pictures keep their look at a
    quarter of the bytes, which matters for every slider move and for the saved notebook."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba()).convert("RGB")
    image = image.quantize(colors=64, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _style(ax) -> None:
    ax.spines[["top", "right"]].set_visible(False)
    ax.tick_params(labelsize=9)
    ax.grid(axis="y", color="#EEEEEE", linewidth=0.8)
    ax.set_axisbelow(True)


def _state_bars(ax, label: str, step: recurrence.TileStep, old: float, rescaled: float | None, new: float,
                correct_new: float | None) -> None:
    """One statistic around the step, as a waterfall: before, times alpha, plus this tile, after.

    `rescaled` is the old value as the code shown rescaled it (unchanged where a bug skips alpha, so the
    × α bar shows what the buggy code did); None where the inside of the code is not seen (the
    learner's function): then only before and after are drawn. Given the correct value, an after bar
    that differs is red with the correct one outlined over it.
    """
    wrong = correct_new is not None and _differs(new, correct_new)
    if rescaled is None:
        labels, bars = ["before", "after"], [(old, MAX_OLD), (new, MAX_NEW if wrong else READ)]
    else:
        skipped = rescaled == old and step.alpha != 1.0 and old != 0.0
        labels = ["before", "not × α" if skipped else "× α", "+ tile", "after"]
        bars = [(old, MAX_OLD), (rescaled, MAX_NEW if skipped else RESCALED), (new, MAX_NEW if wrong else READ)]
    xs = list(range(len(labels)))
    last = xs[-1]
    for x, (height, colour) in zip([0, 1, last] if rescaled is not None else xs, bars):
        ax.bar([x], [height], color=colour, width=0.62)
        ax.annotate(_num(height), (x, height), xytext=(0, 3 if height >= 0 else -3), textcoords="offset points",
                    ha="center", va="bottom" if height >= 0 else "top", fontsize=8.5)
    if rescaled is not None:
        # The tile's own terms, floating from the rescaled value up (or down) to the new one.
        tile_part = new - rescaled
        ax.bar([2], [tile_part], bottom=[rescaled], color=CURRENT, width=0.62)
        ax.plot([0.69, 1.31], [rescaled, rescaled], color="#999999", linewidth=0.8)
        ax.plot([1.69, 2.31], [new, new], color="#999999", linewidth=0.8)
        top = max(new, rescaled)
        ax.annotate(("+" if tile_part >= 0 else "") + _num(tile_part), (2, top), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8.5)
    if wrong:
        ax.bar([last], [correct_new], width=0.62, fill=False, edgecolor=OUTPUT, linewidth=2, linestyle="--",
               label=f"correct {_num(correct_new)}")
        ax.legend(fontsize=8, frameon=False, loc="upper left")
    ax.set_xticks(xs, labels, fontsize=9)
    for tick, text in zip(ax.get_xticklabels(), labels):
        if text == "not × α":
            tick.set_color(MAX_NEW)
    ax.axhline(0, color="#999999", linewidth=0.8)
    ax.set_title(label, fontsize=10.5)
    heights = [0.0, old, new, rescaled or 0.0, correct_new or 0.0]
    top, bottom = max(heights), min(heights)
    pad = 0.3 * (top - bottom or 1.0)
    ax.set_ylim(bottom - (pad if bottom < 0 else 0), top + pad)
    _style(ax)


def tile_figure(steps: list[recurrence.TileStep], current: int, true_output: float,
                correct: list[recurrence.TileStep] | None = None, title: str = "",
                status: tuple[str, str] = ("correct recurrence", OUTPUT), x_label: str = "score index j") -> Figure:
    """The picture of one step: the row with its tiles, maxima and values, l and a around the step, a / l so far.

    `correct` (the correct recurrence's steps) is drawn beside `steps` when they come from a bug or
    from the learner's tile_update; `status` is one line saying what is drawn, and its colour, shown
    in full under the title.
    """
    step = steps[current]
    tile = len(steps[0].scores)
    scores = [x for s in steps for x in s.scores]
    values = [x for s in steps for x in s.values]
    # Fixed margins rather than a layout engine: a slider redraws this figure, and must be quick.
    fig = Figure(figsize=(8.6, 6.0), dpi=_DPI, facecolor="white")
    fig.text(0.5, 0.935 if title else 0.975, status[0], ha="center", va="top", fontsize=10, fontweight="bold",
             color=status[1])
    top = fig.add_gridspec(1, 1, left=0.075, right=0.80, top=0.845 if title else 0.885, bottom=0.565)
    grid = fig.add_gridspec(1, 3, left=0.075, right=0.985, top=0.365, bottom=0.07, wspace=0.32)
    ax = fig.add_subplot(top[0, 0])

    # The row of scores as stems from 0, coloured by tile: read earlier, this tile, not read yet.
    finite = [x for x in scores if math.isfinite(x)] or [0.0]
    low, high = min(0.0, *finite), max(0.0, *finite)
    span = high - low or 1.0
    masked = []
    for j, x in enumerate(scores):
        colour = READ if j // tile < current else CURRENT if j // tile == current else UNREAD
        if math.isfinite(x):
            ax.vlines(j, 0, x, color=colour, linewidth=2.5)
            ax.scatter([j], [x], color=colour, s=46, zorder=3)
        else:
            masked.append(ax.scatter([j], [low - 0.05 * span], marker="x", color=colour, s=30, zorder=3))
    ax.axhline(0, color="#999999", linewidth=0.8)
    for b in range(1, len(steps)):
        ax.axvline(b * tile - 0.5, color="#B0B0B0", linewidth=0.9, linestyle=":")
    if len(steps) <= 12:
        for b in range(len(steps)):
            centre = b * tile + (len(steps[b].scores) - 1) / 2
            ax.text(centre, high + 0.2 * span, f"tile {b + 1}", ha="center", va="bottom", fontsize=9,
                    color=CURRENT if b == current else "#555555", fontweight="bold" if b == current else "normal")
    if math.isfinite(step.m_old):
        ax.axhline(step.m_old, color=MAX_OLD, linestyle="--", linewidth=1.4)
    if math.isfinite(step.m_new):
        ax.axhline(step.m_new, color=MAX_NEW, linewidth=1.6)
    if len(scores) <= 8:
        for j, (x, p) in enumerate(zip(step.scores, step.p)):
            if math.isfinite(x):
                ax.annotate(f"p = {_num(p)}", (current * tile + j, x), xytext=(7, 0), textcoords="offset points",
                            ha="left", va="center", fontsize=8.5, color="#8A4A1C",
                            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1})
    ax.set_ylim(low - 0.16 * span, high + 0.38 * span)
    ax.set_xlim(-0.6, len(scores) - 0.4)
    if len(scores) <= _VALUES_SHOWN:
        # Each score's value under its index, so that a's "+ tile" bar can be checked by eye: sum of p * v.
        named = len(scores) <= 6                       # room for "v = " before each value
        ax.set_xticks(range(len(scores)), [f"{j}\n{'v = ' if named else ''}{_short(v)}" for j, v in enumerate(values)],
                      fontsize=8.5)
        x_label = f"{x_label}, and its value v" + ("" if named else " under it")
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(x_label, fontsize=9.5)
    ax.set_ylabel("score", fontsize=9.5)
    handles = [Patch(color=READ, label="read earlier"), Patch(color=CURRENT, label="this tile"),
               Patch(color=UNREAD, label="not read yet"),
               Line2D([], [], color=MAX_OLD, linestyle="--", label=f"m_old = {_num(step.m_old)}"),
               Line2D([], [], color=MAX_NEW, label=f"m_new = {_num(step.m_new)}")]
    if masked:
        handles.append(Line2D([], [], marker="x", linestyle="", color="#777777", label="masked (−∞)"))
    ax.legend(handles=handles, fontsize=8.5, loc="upper left", bbox_to_anchor=(1.01, 1.03), frameon=False)
    _style(ax)
    ax.set_title(f"Tile {current + 1} of {len(steps)}:  m {_num(step.m_old)} → {_num(step.m_new)},   "
                 f"α = exp(m_old − m_new) = {_num(step.alpha)}", fontsize=10.5)

    want = correct[current] if correct is not None else None
    _state_bars(fig.add_subplot(grid[0, 0]), "l, the denominator", step, step.l_old, step.l_rescaled, step.l_new,
                want.l_new if want else None)
    _state_bars(fig.add_subplot(grid[0, 1]), "a, the unnormalized output", step, step.a_old, step.a_rescaled,
                step.a_new, want.a_new if want else None)

    # The partial output after each tile, against the true output.
    ax = fig.add_subplot(grid[0, 2])
    tiles = range(1, len(steps) + 1)
    if correct is not None:
        ax.plot(tiles, [s.output for s in correct], "o--", color=OUTPUT, alpha=0.5, markersize=4, label="correct")
    outputs = [s.output for s in steps]
    colour = MAX_NEW if correct is not None and _differs(outputs[-1], correct[-1].output) else OUTPUT
    ax.plot(tiles, outputs, "o-", color=colour, alpha=0.22, markersize=4)
    ax.plot(tiles[:current + 1], outputs[:current + 1], "o-", color=colour, markersize=5, label="a / l so far")
    if math.isfinite(outputs[current]):
        ax.scatter([current + 1], [outputs[current]], s=110, facecolor="none", edgecolor=CURRENT, linewidth=2, zorder=4)
    ax.axhline(true_output, color=TRUTH, linestyle="--", linewidth=1.2, label=f"true {_num(true_output)}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("tiles read", fontsize=9.5)
    ax.set_title("partial output a / l", fontsize=10.5)
    ax.legend(fontsize=8, frameon=False, loc="best")
    _style(ax)
    if title:
        fig.suptitle(title, fontsize=11.5, fontweight="bold", y=0.985)
    return fig


def _state_row() -> tuple[list[float], list[float]]:
    """The longer row of 01's state plot: 48 seeded scores (spread 2) and values (spread 1)."""
    rng = random.Random(0)
    return [rng.gauss(0.0, 2.0) for _ in range(48)], [rng.gauss(0.0, 1.0) for _ in range(48)]


def state_figure(steps: list[recurrence.TileStep], true_output: float,
                 correct: list[recurrence.TileStep] | None = None, title: str = "") -> Figure:
    """The running state after each tile: the maximum m, the denominator l, and a / l against the truth.

    `correct` (the correct recurrence's steps) is drawn dashed beside `steps` when these are the
    learner's; where the two agree the dashed line hides under the solid one.
    """
    fig = Figure(figsize=(13, 3.6 if title else 3.4), dpi=_DPI, facecolor="white")
    grid = fig.add_gridspec(1, 3, left=0.05, right=0.99, top=0.80 if title else 0.88, bottom=0.16, wspace=0.22)
    tiles = list(range(1, len(steps) + 1))
    yours = "your tile_update" if correct is not None else None
    panels = [("running maximum m", lambda s: s.m_new, MAX_NEW),
              ("denominator l (drops when m rises)", lambda s: s.l_new, CURRENT),
              ("partial output a / l", lambda s: s.output, OUTPUT)]
    for column, (label, value, colour) in enumerate(panels):
        ax = fig.add_subplot(grid[0, column])
        if correct is not None:
            ax.step(tiles, [value(s) for s in correct], where="mid", color=TRUTH, linestyle="--", linewidth=1.2,
                    label="correct recurrence")
        ax.step(tiles, [value(s) for s in steps], where="mid", color=colour, linewidth=2, label=yours)
        ax.plot(tiles, [value(s) for s in steps], "o", color=colour, markersize=3.5)
        if column == 2:
            ax.axhline(true_output, color=TRUTH, linestyle=":", linewidth=1.2, label=f"true output {_num(true_output)}")
        if column == 2 or correct is not None:
            ax.legend(fontsize=8, frameon=False, loc="best")
        ax.set_title(label, fontsize=10.5)
        ax.set_xlabel("tiles read", fontsize=9.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _style(ax)
    if title:
        fig.suptitle(title, fontsize=11.5, fontweight="bold", y=0.975)
    return fig


class Picture:
    """A figure that Jupyter shows as a PNG (no pyplot involved); the Figure itself is `.figure`."""

    def __init__(self, figure: Figure, caption: str):
        self.figure, self.caption = figure, caption

    def _repr_png_(self) -> bytes:
        return _png(self.figure)

    def __repr__(self) -> str:
        return f"<picture: {self.caption}>"


NOT_WRITTEN = "write tile_update above to see your own recurrence here"


def state_plot(update: Callable | str | None = None, scores: Sequence[float] | None = None,
               values: Sequence[float] | None = None, tile: int = 6) -> Picture | None:
    """The running state over a longer row, one point per tile: m, l and the partial output a / l.

    The row defaults to 48 seeded scores and values in tiles of 6. Without `update` the correct
    recurrence is drawn. Given the learner's `tile_update` (or its name, "tile_update", looked up in
    the notebook when the picture is drawn, so that the cell also runs before the function's cell
    has), their state is drawn with the correct one dashed beside it and the first tile where they
    part is named in words. While tile_update is not defined yet, or still the exercise's stub (it
    raises NotImplementedError), this prints what to do (NOT_WRITTEN) and draws nothing; any other
    error of the learner's function is printed as well, never raised. Returns what Jupyter shows.
    """
    update = _learner(update)
    if scores is None and values is None:
        scores, values = _state_row()
    scores, values = list(scores), list(values)
    if len(scores) != len(values) or not scores:
        raise ValueError("scores and values must be non-empty and of equal length")
    correct = recurrence.trace(scores, values, tile)
    true_output = reference.softmax_weighted_sum(scores, values)
    if update is None:
        return Picture(state_figure(correct, true_output), "m, l and a / l after each tile")
    try:
        steps = learner_trace(update, scores, values, tile)
    except NotDefinedYet as error:
        print(f"{error} (Exercise 1's cell); then run this cell again.")
        return None
    except NotImplementedError:
        print(NOT_WRITTEN)
        return None
    except Exception as error:  # the learner's code: a failure becomes a message, never a crash
        print(f"your tile_update raised {type(error).__name__}: {error or 'no message'}. "
              "The test below says more; this picture needs it to run.")
        return None
    first, problem = _first_difference(steps)
    if first is None:
        print(f"Your tile_update matches the recurrence on all {len(steps)} tiles of this row.")
    else:
        print(f"Your tile_update leaves the recurrence. {problem}")
    title = f"Your tile_update over {len(scores)} scores in tiles of {tile} (the correct one dashed)"
    return Picture(state_figure(steps, true_output, correct, title), title)


def blocks_figure(T: int, S: int, block_m: int, block_n: int, offset: int | None = None,
                  window: int | None = None) -> Figure:
    """Query blocks by key blocks, each tile coloured by its class; visible pairs drawn darker."""
    offset = S - T if offset is None else offset
    classes = block_classes(T, S, block_m, block_n, offset, window)
    i = np.arange(T)[:, None] + offset
    j = np.arange(S)[None, :]
    visible = (j <= i) & ((j > i - window) if window is not None else True)
    image = np.empty((T, S, 3))
    for bi, row in enumerate(classes):
        for bj, kind in enumerate(row):
            block = (slice(bi * block_m, (bi + 1) * block_m), slice(bj * block_n, (bj + 1) * block_n))
            base = np.array(to_rgb(BLOCK_COLORS[kind]))
            light = base + (1 - base) * (0.55 if kind != SKIP else 0.0)   # masked pairs, drawn lighter
            image[block] = np.where(visible[block][..., None], base * (0.82 if kind == SKIP else 1.0), light)
    aspect = T / S
    fig = Figure(figsize=(min(9.0, 3.2 + 5.6 / max(aspect, 0.6)), min(6.4, 1.7 + 4.6 * min(aspect, 1.2))),
                 dpi=_DPI, facecolor="white", layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(image, interpolation="nearest", extent=(-0.5, S - 0.5, T - 0.5, -0.5), aspect="equal")
    for x in range(block_n, S, block_n):
        ax.axvline(x - 0.5, color="white", linewidth=1.6)
    for y in range(block_m, T, block_m):
        ax.axhline(y - 0.5, color="white", linewidth=1.6)
    ax.set_xlabel("key position j", fontsize=9.5)
    ax.set_ylabel(f"query row i (position {offset} + i)", fontsize=9.5)
    ax.tick_params(labelsize=8.5)
    counts = {kind: sum(row.count(kind) for row in classes) for kind in BLOCK_COLORS}
    amber = np.array(to_rgb(BLOCK_COLORS[PARTIAL]))
    handles = [Patch(color=BLOCK_COLORS[k], label=f"{BLOCK_WORDS[k]} ({counts[k]})") for k in (FULL, PARTIAL, SKIP)]
    handles.append(Patch(color=amber + (1 - amber) * 0.55, label="masked pairs of a\npartial tile"))
    ax.legend(handles=handles,
              fontsize=8.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              title="tiles", title_fontsize=9)
    window_text = f", window {window}" if window is not None else ""
    ax.set_title(f"T={T} queries × S={S} keys, BLOCK_M={block_m}, BLOCK_N={block_n}, offset {offset}{window_text}",
                 fontsize=10.5)
    return fig


# ---------------------------------------------------------------------------------------------
# Widgets
# ---------------------------------------------------------------------------------------------

class Explorer(ipywidgets.VBox):
    """Controls over a picture and a numeric panel, redrawn whenever a control moves.

    `controls` maps names to widgets (the tests set their .value); `picture` is an Image widget
    holding the current PNG (of `figure`) and `panel` an HTML widget. Displayed, it carries the current PNG as
    well, for frontends that cannot run widgets.
    """

    def __init__(self, controls: dict, render: Callable[[], tuple[Figure, str]], extra: Sequence = ()):
        self.controls = controls
        self._render = render
        self._drawing = False          # a control set while drawing (a clamped slider) needs no second redraw
        self.picture = ipywidgets.Image(format="png", layout=ipywidgets.Layout(width=f"{_SHOWN_WIDTH}px",
                                                                               max_width="100%", height="auto"))
        self.panel = ipywidgets.HTML(layout=ipywidgets.Layout(margin="0 0 0 8px"))
        boxes = [ipywidgets.HBox(list(extra) + [c for c in controls.values()],
                                 layout=ipywidgets.Layout(flex_flow="row wrap", align_items="center"))]
        super().__init__(boxes + [self.picture, self.panel])
        self.add_class("fc-explorer")
        for control in controls.values():
            control.observe(self._changed, names="value")
        self.redraw()

    def _changed(self, _change) -> None:
        if not self._drawing:
            self.redraw()

    def redraw(self) -> None:
        self._drawing = True
        try:
            fig, panel = self._render()
        finally:
            self._drawing = False
        self.figure = fig              # the picture as a Figure, for tests and for saving
        self.picture.value = _png(fig)
        self.panel.value = panel

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        data["image/png"] = base64.b64encode(self.picture.value).decode("ascii")
        return data, {"image/png": {"width": _SHOWN_WIDTH}}


def _slider(description: str, value: int, low: int, high: int, width: str = "300px") -> ipywidgets.IntSlider:
    return ipywidgets.IntSlider(value=value, min=low, max=max(low, high), description=description,
                                continuous_update=False, style={"description_width": "initial"},
                                layout=ipywidgets.Layout(width=width))


def _row_explorer(rows: Callable[[int], tuple[list[float], list[float]]], n_rows: int, tile: int,
                  update: Callable | None, title: Callable[[int], str], x_label: str,
                  extra_controls: dict | None = None) -> Explorer:
    """The explorer over rows(row) -> (scores, values); one row unless n_rows > 1."""
    # A function given by name is looked up at every redraw: a slider move picks up a newly run cell.
    again = "move a slider here" if isinstance(update, str) else "run this cell again"
    update = _learner(update)
    length = len(rows(0)[0])
    options = [(f"bug: {BUG_NAMES[bug]} ({recurrence.BUGS[bug]})", bug) if bug else ("correct recurrence", _CORRECT)
               for bug in recurrence.BUGS]
    if update is not None:
        options.insert(0, ("your tile_update", _LEARNER))
    controls = {"row": _slider("query row", n_rows - 1, 0, n_rows - 1)} if n_rows > 1 else {}
    controls.update(extra_controls or {})
    controls["tile_size"] = _slider("tile size", min(tile, length), 1, length)
    controls["tile"] = _slider("after tile", 1, 1, math.ceil(length / controls["tile_size"].value))
    controls["recurrence"] = ipywidgets.Dropdown(options=options, value=options[0][1], description="recurrence",
                                                 style={"description_width": "initial"},
                                                 layout=ipywidgets.Layout(width="420px"))
    play = ipywidgets.Play(min=1, max=controls["tile"].max, interval=1400, description="play the tiles")
    ipywidgets.jslink((play, "value"), (controls["tile"], "value"))
    ipywidgets.jslink((play, "max"), (controls["tile"], "max"))

    def render() -> tuple[Figure, str]:
        row = controls["row"].value if "row" in controls else 0
        scores, values = rows(row)
        size = controls["tile_size"].value
        n_tiles = math.ceil(len(scores) / size)
        controls["tile"].max = n_tiles                 # clamps the current tile when the tiles grow
        current = controls["tile"].value - 1
        choice = controls["recurrence"].value
        correct = recurrence.trace(scores, values, size)
        visible = [(s, v) for s, v in zip(scores, values) if s != -math.inf]
        true_output = reference.softmax_weighted_sum(*zip(*visible)) if visible else math.nan
        heading, note, compare, status = title(row), "", None, ("correct recurrence", OUTPUT)
        if choice == _LEARNER:
            try:
                steps = learner_trace(update, scores, values, size)
            except Exception as error:  # the learner's code: any failure becomes a message, never a crash
                steps, status = correct, (f"{_failure(error)}: showing the correct recurrence", MAX_NEW)
                # The error's own words, where they add to _failure's.
                said = "" if isinstance(error, NotDefinedYet) or not str(error) else f" ({str(error)})"
                note = (f'<b style="color:{MAX_NEW};">{html.escape(_failure(error))}</b>{html.escape(said)}. '
                        f"Write or fix tile_update in Exercise 1, run its cell, then {again}. Meanwhile the "
                        "picture shows the correct recurrence.")
            else:
                first, problem = _first_difference(steps)
                if first is None:
                    # Right to within the checks' tolerance: drawn as the correct recurrence is, with its × α bars.
                    steps, status = correct, ("your tile_update: it matches the recurrence", OUTPUT)
                    note = (f'<b style="color:#2F6F3E;">Your tile_update matches the recurrence</b> on all '
                            f"{n_tiles} tiles of this row ({len(scores)} scores, tiles of {size}).")
                else:
                    compare = correct
                    status = (f"your tile_update: it differs from the recurrence at tile {first + 1}", MAX_NEW)
                    note = (f'<b style="color:{MAX_NEW};">Your tile_update leaves the recurrence.</b> '
                            f"{html.escape(problem)}")
        elif choice != _CORRECT:
            steps, compare = recurrence.trace(scores, values, size, choice), correct
            note = (f'<b style="color:{MAX_NEW};">Injected bug:</b> {html.escape(recurrence.BUGS[choice])}. '
                    "Red numbers differ from the correct recurrence; compare the final a / l with the true output.")
            status = (f"bug: {BUG_NAMES[choice]}", MAX_NEW)
        else:
            steps = correct
        fig = tile_figure(steps, current, true_output, compare, heading, status, x_label)
        return fig, state_table(steps[current], n_tiles, true_output, compare[current] if compare else None, note)

    return Explorer(controls, render, extra=[play])


def _first_difference(steps: list[recurrence.TileStep]) -> tuple[int | None, str]:
    """The first tile where the learner's trace leaves the recurrence, and the checks' words for it."""
    for step in steps:
        problem = checks.explain_state((step.m_new, step.l_new, step.a_new), step.m_old, step.l_old, step.a_old,
                                       step.scores, step.values, f"tile {step.index + 1}")
        if problem:
            return step.index, problem
    return None, ""


def _failure(error: Exception) -> str:
    """What a failing learner's function means, in a few words."""
    if isinstance(error, NotDefinedYet):
        return f"{error.name} is not defined yet (run its cell)"
    if isinstance(error, NotImplementedError):
        return "your tile_update is not written yet"
    return f"your tile_update raised {type(error).__name__}"


class NotDefinedYet(NameError):
    """The notebook has no function of this name yet: the cell that defines it has not run."""


def notebook_function(name: str) -> Callable:
    """A stand-in for the notebook's function `name`, looked up at every call in the notebook's namespace.

    A cell can then hand a learner's function to a widget before the cell that defines it has run
    (calling it raises NotDefinedYet, which the widgets turn into a message), and a widget follows the
    function when its cell is run again after a change.
    """
    def call(*args):
        from IPython import get_ipython

        shell = get_ipython()
        function = shell.user_ns.get(name) if shell is not None else None
        if function is None:
            raise NotDefinedYet(f"{name} is not defined yet: run the cell that defines it", name=name)
        return function(*args)

    call.__name__ = name
    return call


def _learner(update: Callable | str | None) -> Callable | None:
    """A learner's function, given itself or by its name in the notebook."""
    return notebook_function(update) if isinstance(update, str) else update


def tile_explorer(scores: Sequence[float] | None = None, values: Sequence[float] | None = None, tile: int = 2,
                  update: Callable | str | None = None) -> Explorer:
    """Step through the online softmax on one row of scalar scores and values.

    Defaults to 01's worked example (scores [0, 1, 2, -1], values [2, 4, 1, 3], tiles of two).
    Sliders choose the tile size and the tile to look at; the recurrence selector injects the
    classic bugs of recurrence.BUGS, or, given the learner's tile_update(m, l, a, scores, values) ->
    (m, l, a) as `update` (the function, or its name "tile_update", looked up in the notebook at every
    redraw), runs it and marks where it leaves the recurrence; until it is defined and written, the
    explorer says so and shows the correct recurrence.
    """
    scores = list(WORKED_SCORES if scores is None else scores)
    values = list(WORKED_VALUES if values is None else values)
    if len(scores) != len(values) or not scores:
        raise ValueError("scores and values must be non-empty and of equal length")
    label = "the worked example" if scores == list(WORKED_SCORES) and values == list(WORKED_VALUES) else "your row"
    return _row_explorer(lambda _row: (scores, values), 1, tile, update,
                         lambda _row: f"Online softmax, one tile at a time: {label} ({len(scores)} scores)",
                         "score index j")


def attention_row_explorer(q, k, v, tile: int = 8, batch: int = 0, head: int = 0, column: int = 0,
                           query_offset: int | None = None, update: Callable | str | None = None) -> Explorer:
    """Step through the online softmax on one query row of real causal attention.

    q [B, Hq, T, D] (or [T, D]), k and v [B, Hkv, S, D] (or [S, D]), torch tensors. A slider picks
    the query row i: its scores are q_i k^T / sqrt(D) over every key, -inf (drawn as x) where the
    causal mask hides the key (query i sits at position query_offset + i, default S - T). The
    values shown are coordinate `column` of v (a slider picks it), so the true output is
    coordinate `column` of the attention output for row i.
    """
    q4 = q[None, None] if q.dim() == 2 else q
    t, dv = q4.shape[2], v.shape[-1]
    column_slider = _slider("output coordinate", column, 0, dv - 1, width="260px")
    offset = k.shape[-2] - t if query_offset is None else query_offset

    def rows(row: int):
        return attention_row(q, k, v, row, batch, head, column_slider.value, offset)

    def title(row: int) -> str:
        return (f"Attention row {row} (position {offset + row}), batch {batch}, head {head}: "
                f"values v[:, {column_slider.value}], output o[{row}, {column_slider.value}]")

    return _row_explorer(rows, t, tile, update, title, "key position j", {"column": column_slider})


def causal_blocks(T: int, S: int, block_m: int, block_n: int, offset: int | None = None,
                  window: int | None = None) -> Explorer:
    """The causal tile map: query blocks by key blocks, each tile skipped, masked in part, or run in full.

    Query i sits at position offset + i (offset defaults to S - T: the queries are the newest
    tokens) and sees the keys at positions <= its own (and > its own - window, when a window is
    given). Sliders change T, S, the block sizes, the offset and the window (0 for none).
    """
    block_classes(T, S, block_m, block_n, offset, window)          # validates the arguments
    high = max(256, T, S)
    controls = {
        "T": _slider("T (queries)", T, 1, high, "260px"),
        "S": _slider("S (keys)", S, 1, high, "260px"),
        "block_m": _slider("BLOCK_M", block_m, 1, max(128, block_m), "260px"),
        "block_n": _slider("BLOCK_N", block_n, 1, max(128, block_n), "260px"),
        "default_offset": ipywidgets.Checkbox(value=offset is None, description="offset = S − T", indent=False,
                                              layout=ipywidgets.Layout(width="130px")),
        "offset": _slider("offset", S - T if offset is None else offset, -high, high, "320px"),
        "window": _slider("window (0: none)", window or 0, 0, high, "300px"),
    }

    def render() -> tuple[Figure, str]:
        c = {name: control.value for name, control in controls.items()}
        if c["default_offset"]:
            controls["offset"].value = c["S"] - c["T"]
        controls["offset"].disabled = c["default_offset"]
        args = (c["T"], c["S"], c["block_m"], c["block_n"], controls["offset"].value, c["window"] or None)
        classes = block_classes(*args)
        counts = {kind: sum(row.count(kind) for row in classes) for kind in BLOCK_COLORS}
        total = sum(counts.values())
        computed = counts[FULL] + counts[PARTIAL]
        panel = (f'{_PANEL_STYLE}<div class="fc-panel" style="margin:4px 10px;">'
                 f'<span class="fc-full">{counts[FULL]}</span> tiles run in full, '
                 f'<span class="fc-partial">{counts[PARTIAL]}</span> masked in part, '
                 f'<span class="fc-skip">{counts[SKIP]}</span> skipped, of '
                 f'<span class="fc-total">{total}</span> '
                 f"({len(classes)} query blocks × {len(classes[0])} key blocks): the kernel computes "
                 f"{computed} tiles, {100 * computed / total:.0f}% of the score matrix.</div>")
        return blocks_figure(*args), panel

    return Explorer(controls, render)
