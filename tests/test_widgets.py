"""The tile explorer: the numbers behind its pictures, and the widgets built without a frontend."""

import base64
import itertools
import math
import random
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch
from matplotlib.figure import Figure

from flashcourse.checks import recurrence, reference
from flashcourse.explore import widgets
from flashcourse.engine import online_softmax as engine

WORKED = ([0.0, 1.0, 2.0, -1.0], [2.0, 4.0, 1.0, 3.0])


class _Cells(HTMLParser):
    """The text of every element carrying an fc-* class, by class."""

    def __init__(self):
        super().__init__()
        self.text, self._open = {}, []

    def handle_starttag(self, tag, attrs):
        classes = [c for c in (dict(attrs).get("class") or "").split() if c.startswith("fc-")]
        self._open.append(classes)
        for c in classes:
            self.text.setdefault(c, "")

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        for classes in self._open:
            for c in classes:
                self.text[c] += data


def panel(explorer) -> dict[str, str]:
    parser = _Cells()
    parser.feed(explorer.panel.value)
    return parser.text


def number(text: str) -> float:
    """A number as the panel writes it (with a typographic minus) as a float."""
    return float(text.replace("−", "-"))


def _random_row(rng, n):
    return [rng.gauss(0.0, 3.0) for _ in range(n)], [rng.gauss(0.0, 1.0) for _ in range(n)]


# ---- the plain functions ------------------------------------------------------------------------

def test_worked_example_numbers():
    steps = recurrence.trace(*WORKED, 2)
    assert (steps[0].m_new, round(steps[0].l_new, 4), round(steps[0].a_new, 4)) == (1.0, 1.3679, 4.7358)
    assert round(steps[1].alpha, 4) == 0.3679
    assert (round(steps[1].l_new, 4), round(steps[1].a_new, 4), round(steps[1].output, 4)) == (1.5530, 2.8915, 1.8619)


@pytest.mark.parametrize("n, tile", [(1, 1), (4, 2), (7, 3), (16, 5), (33, 33), (9, 20)])
def test_learner_trace_of_the_solution_is_the_recurrence(n, tile):
    scores, values = _random_row(random.Random(n * 100 + tile), n)
    ours = widgets.learner_trace(engine.tile_update, scores, values, tile)
    want = recurrence.trace(scores, values, tile)
    assert len(ours) == len(want)
    for s, w in zip(ours, want):
        for field in ("m_old", "l_old", "a_old", "m_new", "alpha", "l_new", "a_new"):
            assert getattr(s, field) == pytest.approx(getattr(w, field), rel=1e-12, abs=1e-15), field
        assert s.p == pytest.approx(w.p, rel=1e-12)
    assert ours[-1].output == pytest.approx(reference.softmax_weighted_sum(scores, values), rel=1e-12)


def test_learner_trace_with_masked_tiles_matches_reference():
    scores, values = _random_row(random.Random(5), 10)
    scores[:3] = [-math.inf] * 3
    scores[7] = -math.inf
    steps = widgets.learner_trace(engine.tile_update, scores, values, 3)
    assert (steps[0].m_new, steps[0].l_new, steps[0].a_new) == (-math.inf, 0.0, 0.0)
    assert steps[-1].output == pytest.approx(reference.softmax_weighted_sum(scores, values), rel=1e-12)


@pytest.mark.parametrize("bug", [b for b in recurrence.BUGS if b])
def test_learner_trace_carries_the_learners_mistake(bug):
    def buggy(m, l, a, scores, values):
        s = recurrence.step(m, l, a, scores, values, bug)
        return s.m_new, s.l_new, s.a_new

    scores, values = WORKED
    got = widgets.learner_trace(buggy, scores, values, 2)
    want = recurrence.trace(scores, values, 2, bug)
    assert [x for s in got for x in (s.l_new, s.a_new)] == pytest.approx([x for s in want for x in (s.l_new, s.a_new)])
    assert not math.isclose(got[-1].output, reference.softmax_weighted_sum(scores, values), rel_tol=1e-6)


def test_learner_trace_rejects_a_non_state():
    with pytest.raises(TypeError, match=r"\(m, l, a\)"):
        widgets.learner_trace(lambda m, l, a, s, v: None, *WORKED, 2)


@pytest.mark.parametrize("t, s, hq, hkv, offset", [(6, 6, 1, 1, None), (5, 12, 4, 2, None), (8, 8, 2, 1, 3)])
def test_attention_row_matches_reference_attention(t, s, hq, hkv, offset):
    g = torch.Generator().manual_seed(t * s + hq)
    q, k, v = (torch.randn(2, h, n, 16, generator=g) for h, n in ((hq, t), (hkv, s), (hkv, s)))
    positions = None if offset is None else torch.arange(t) + offset
    want = reference.attention(q, k, v, query_positions=positions)                   # [B, Hq, T, D]
    for batch, head, row, column in itertools.product((0, 1), range(hq), range(t), (0, 7)):
        scores, values = widgets.attention_row(q, k, v, row, batch, head, column, offset)
        visible = (s - t if offset is None else offset) + row + 1
        assert all(x == -math.inf for x in scores[visible:]) and all(math.isfinite(x) for x in scores[:visible])
        got = recurrence.trace(scores, values, 4)[-1].output
        assert got == pytest.approx(want[batch, head, row, column].item(), rel=1e-9, abs=1e-12)


def test_attention_row_accepts_two_dimensional_tensors():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    want = reference.attention(q[None, None], k[None, None], v[None, None])[0, 0]
    scores, values = widgets.attention_row(q, k, v, 1, column=3)
    assert recurrence.trace(scores, values, 2)[-1].output == pytest.approx(want[1, 3].item(), rel=1e-9)


CASES = [(t, s, bm, bn, offset, window)
         for t, s in ((1, 1), (7, 7), (5, 13), (16, 16), (12, 40), (9, 4))
         for bm, bn in ((1, 1), (2, 3), (4, 4), (8, 16), (64, 64))
         for offset in (None, 0, 3, -2)
         for window in (None, 1, 5)]


@pytest.mark.parametrize("t, s, bm, bn, offset, window", CASES)
def test_block_classes_match_visible_mask(t, s, bm, bn, offset, window):
    q, k = torch.zeros(1, 1, t, 1), torch.zeros(1, 1, s, 1)
    positions = None if offset is None else torch.arange(t) + offset
    mask = reference.visible_mask(q, k, query_positions=positions, window=window)[0, 0]   # [T, S]
    classes = widgets.block_classes(t, s, bm, bn, offset, window)
    assert len(classes) == math.ceil(t / bm) and all(len(row) == math.ceil(s / bn) for row in classes)
    for bi, row in enumerate(classes):
        for bj, kind in enumerate(row):
            tile = mask[bi * bm:(bi + 1) * bm, bj * bn:(bj + 1) * bn]
            expected = "skip" if not tile.any() else "full" if tile.all() else "partial"
            assert kind == expected, f"block ({bi}, {bj}) of {(t, s, bm, bn, offset, window)}"


def test_block_classes_of_a_square_causal_matrix():
    assert widgets.block_classes(4, 4, 2, 2) == [["partial", "skip"], ["full", "partial"]]
    with pytest.raises(ValueError):
        widgets.block_classes(4, 4, 0, 2)
    with pytest.raises(ValueError):
        widgets.block_classes(4, 4, 2, 2, window=0)


# ---- the widgets, built in this process with no frontend ---------------------------------------

def test_tile_explorer_shows_the_worked_example_and_follows_the_slider():
    explorer = widgets.tile_explorer()
    cells = panel(explorer)
    assert (cells["fc-tile"], cells["fc-tiles"]) == ("1", "2")
    assert (cells["fc-m-old"], cells["fc-m"], cells["fc-l"], cells["fc-a"]) == ("−∞", "1", "1.3679", "4.7358")
    assert cells["fc-scores"] == "[0, 1]" and cells["fc-true"] == "1.8619"

    explorer.controls["tile"].value = 2
    cells = panel(explorer)
    assert cells["fc-tile"] == "2" and cells["fc-alpha"] == "0.3679" and cells["fc-p"] == "[1, 0.0498]"
    assert (cells["fc-m-old"], cells["fc-l-old"], cells["fc-a-old"]) == ("1", "1.3679", "4.7358")
    assert (cells["fc-l-rescaled"], cells["fc-a-rescaled"]) == ("0.5032", "1.7422")
    assert (cells["fc-m"], cells["fc-l"], cells["fc-a"], cells["fc-output"]) == ("2", "1.5530", "2.8915", "1.8619")
    assert "fc-wrong" not in cells
    # The values beside the scores: a's tile part 1.1494 is the sum of p * v = 1 * 1 + 0.0498 * 3.
    assert (cells["fc-values"], cells["fc-pv"]) == ("[1, 3]", "[1, 0.1494]")
    ticks = [t.get_text() for t in explorer.figure.axes[0].get_xticklabels()]
    assert ticks == ["0\nv = 2", "1\nv = 4", "2\nv = 1", "3\nv = 3"]


def test_tile_explorer_tile_size_slider_clamps_the_current_tile():
    explorer = widgets.tile_explorer()
    explorer.controls["tile_size"].value = 1
    assert explorer.controls["tile"].max == 4
    explorer.controls["tile"].value = 4
    explorer.controls["tile_size"].value = 3
    assert (explorer.controls["tile"].max, explorer.controls["tile"].value) == (2, 2)
    cells = panel(explorer)
    assert cells["fc-tiles"] == "2" and cells["fc-scores"] == "[−1]" and cells["fc-output"] == "1.8619"


@pytest.mark.parametrize("bug", [b for b in recurrence.BUGS if b])
def test_tile_explorer_bug_selector_shows_the_wrong_numbers(bug):
    explorer = widgets.tile_explorer()
    explorer.controls["tile"].value = 2
    explorer.controls["recurrence"].value = bug
    cells = panel(explorer)
    wrong = recurrence.trace(*WORKED, 2, bug)[-1]
    assert number(cells["fc-output"]) == pytest.approx(wrong.output, abs=5e-5)
    assert cells["fc-want-output"] == "1.8619" and "fc-wrong" in cells
    assert recurrence.BUGS[bug] in cells["fc-note"]
    # The × α column and bars show what the buggy code did to the old l and a, not the correct rescale.
    assert number(cells["fc-l-rescaled"]) == pytest.approx(wrong.l_rescaled, abs=5e-5)
    assert number(cells["fc-a-rescaled"]) == pytest.approx(wrong.a_rescaled, abs=5e-5)
    l_bars, a_bars = explorer.figure.axes[1:3]
    skipped = {"l_not_rescaled": ["l"], "a_not_rescaled": ["a"], "per_tile_softmax": ["l", "a"]}[bug]
    for name, bars, old, rescaled in (("l", l_bars, wrong.l_old, wrong.l_rescaled), ("a", a_bars, wrong.a_old, wrong.a_rescaled)):
        assert bars.patches[1].get_height() == pytest.approx(rescaled)
        assert (f'class="fc-{name}-rescaled fc-wrong"' in explorer.panel.value) == (name in skipped)
        assert (bars.get_xticklabels()[1].get_text() == "not × α") == (name in skipped)
        assert (rescaled == old) == (name in skipped)


def test_tile_explorer_runs_the_learners_update():
    def l_not_rescaled(m, l, a, scores, values):
        s = recurrence.step(m, l, a, scores, values, "l_not_rescaled")
        return s.m_new, s.l_new, s.a_new

    explorer = widgets.tile_explorer(update=l_not_rescaled)
    assert explorer.controls["recurrence"].value == "yours"
    explorer.controls["tile"].value = 2
    cells = panel(explorer)
    assert cells["fc-l"] == "2.4177" and cells["fc-want-l"] == "1.5530"
    assert "tile 2" in cells["fc-note"] and "l is not multiplied by alpha" in cells["fc-note"]

    right = widgets.tile_explorer(update=engine.tile_update)
    right.controls["tile"].value = 2
    assert panel(right)["fc-output"] == "1.8619" and "matches the recurrence" in panel(right)["fc-note"]


def _stub(m, l, a, scores, values):
    raise NotImplementedError()


def _status(explorer) -> str:
    """The line under the explorer's title that says what the picture shows."""
    return explorer.figure.texts[0].get_text()


@pytest.mark.parametrize("update, status", [
    (_stub, "your tile_update is not written yet: showing the correct recurrence"),
    (lambda m, l, a, s, v: 1 / 0, "your tile_update raised ZeroDivisionError: showing the correct recurrence"),
    (lambda m, l, a, s, v: None, "your tile_update raised TypeError: showing the correct recurrence")])
def test_tile_explorer_survives_an_unfinished_update(update, status):
    explorer = widgets.tile_explorer(update=update)
    cells = panel(explorer)
    assert _status(explorer) == status and status.split(":")[0] in cells["fc-note"]
    assert "Exercise 1" in cells["fc-note"] and "run this cell again" in cells["fc-note"]
    assert cells["fc-l"] == "1.3679"                          # the correct recurrence is shown meanwhile


def test_tile_explorer_status_names_the_first_tile_that_differs():
    def a_wrong_from_tile_3(m, l, a, scores, values):
        s = recurrence.step(m, l, a, scores, values, "a_not_rescaled" if scores[0] > 1.5 else None)
        return s.m_new, s.l_new, s.a_new

    explorer = widgets.tile_explorer([0.0, 1.0, 1.2, 0.5, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], tile=2,
                                     update=a_wrong_from_tile_3)
    assert _status(explorer) == "your tile_update: it differs from the recurrence at tile 3"
    right = widgets.tile_explorer(update=engine.tile_update)
    assert _status(right) == "your tile_update: it matches the recurrence"
    assert widgets.tile_explorer().figure.texts[0].get_text() == "correct recurrence"


class _Notebook:
    """Stands in for IPython's shell: a namespace the widgets look learner's functions up in."""

    def __init__(self):
        self.user_ns = {}


def test_tile_explorer_finds_tile_update_by_name_before_and_after_its_cell_ran(monkeypatch):
    import IPython

    notebook = _Notebook()
    monkeypatch.setattr(IPython, "get_ipython", lambda: notebook)
    explorer = widgets.tile_explorer(update="tile_update")      # the cell of tile_update has not run
    assert _status(explorer) == "tile_update is not defined yet (run its cell): showing the correct recurrence"
    assert "move a slider here" in panel(explorer)["fc-note"]
    notebook.user_ns["tile_update"] = _stub
    explorer.controls["tile"].value = 2
    assert _status(explorer).startswith("your tile_update is not written yet")
    notebook.user_ns["tile_update"] = engine.tile_update        # written, its cell run again: no re-run here
    explorer.controls["tile"].value = 1
    assert _status(explorer) == "your tile_update: it matches the recurrence"


def test_state_plot_finds_tile_update_by_name(monkeypatch, capsys):
    import IPython

    notebook = _Notebook()
    monkeypatch.setattr(IPython, "get_ipython", lambda: notebook)
    assert widgets.state_plot(update="tile_update") is None
    assert "tile_update is not defined yet" in capsys.readouterr().out
    notebook.user_ns["tile_update"] = engine.tile_update
    assert widgets.state_plot(update="tile_update") is not None
    assert "matches the recurrence" in capsys.readouterr().out


def _overflow(fig) -> list[float]:
    """How far, in inches, what a figure draws (titles, labels, legends, annotations) passes each of its
    edges (left, bottom, right, top); all zero or less when everything fits."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    drawn = fig.get_tightbbox(FigureCanvasAgg(fig).get_renderer())
    width, height = fig.get_size_inches()
    return [round(x, 3) for x in (-drawn.x0, -drawn.y0, drawn.x1 - width, drawn.y1 - height)]


def test_values_under_the_scores_do_not_overlap():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 6, generator=g), torch.randn(10, 6, generator=g), torch.randn(10, 6, generator=g) * 3
    scores, _ = _random_row(random.Random(4), widgets._VALUES_SHOWN)
    for explorer, n in ((widgets.attention_row_explorer(q, k, v, tile=3), 10),
                        (widgets.tile_explorer(scores, [-88.88] * len(scores)), widgets._VALUES_SHOWN)):
        fig = explorer.figure
        renderer = FigureCanvasAgg(fig).get_renderer()
        ticks = [t for t in fig.axes[0].get_xticklabels() if t.get_text()]
        assert len(ticks) == n and all("\n" in t.get_text() for t in ticks)     # index, then value
        boxes = [t.get_window_extent(renderer) for t in ticks]
        assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in ticks]


@pytest.mark.parametrize("update, choice", [(None, "correct"), (None, "l_not_rescaled"), (None, "per_tile_softmax"),
                                            (_stub, "yours"), ("tile_update", "yours"),
                                            (lambda m, l, a, s, v: 1 / 0, "yours")])
def test_tile_explorer_texts_are_fully_visible(update, choice):
    cut = Figure(figsize=(4, 3))
    cut.text(0.9, 0.5, "a legend title that runs past the edge")
    assert _overflow(cut)[2] > 1                                  # the measure sees a cut-off text
    explorer = widgets.tile_explorer(update=update)
    explorer.controls["recurrence"].value = choice
    for tile in (1, 2):
        explorer.controls["tile"].value = tile
        assert max(_overflow(explorer.figure)) <= 0.01, _overflow(explorer.figure)


def test_tile_explorer_on_another_row():
    scores, values = _random_row(random.Random(3), 11)
    explorer = widgets.tile_explorer(scores, values, tile=4)
    explorer.controls["tile"].value = 3
    cells = panel(explorer)
    assert number(cells["fc-output"]) == pytest.approx(reference.softmax_weighted_sum(scores, values), abs=5e-5)
    with pytest.raises(ValueError):
        widgets.tile_explorer([1.0, 2.0], [1.0])


def test_display_carries_a_static_png():
    explorer = widgets.tile_explorer()
    data, metadata = explorer._repr_mimebundle_()
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == explorer.model_id
    assert base64.b64decode(data["image/png"]).startswith(b"\x89PNG\r\n\x1a\n")
    assert metadata["image/png"]["width"] > 0
    png = explorer.picture.value
    explorer.controls["tile"].value = 2
    assert explorer.picture.value != png and base64.b64decode(explorer._repr_mimebundle_()[0]["image/png"]) == explorer.picture.value


def test_attention_row_explorer_row_slider():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 1, 10, 8, generator=g), torch.randn(1, 1, 10, 8, generator=g)
    want = reference.attention(q, k, v)
    explorer = widgets.attention_row_explorer(q, k, v, tile=3, head=1, column=2)
    assert explorer.controls["row"].value == 5
    for row in (0, 3):
        explorer.controls["row"].value = row
        explorer.controls["tile"].value = explorer.controls["tile"].max
        assert number(panel(explorer)["fc-true"]) == pytest.approx(want[0, 1, row, 2].item(), abs=5e-5)
        assert number(panel(explorer)["fc-output"]) == pytest.approx(want[0, 1, row, 2].item(), abs=5e-5)
    explorer.controls["column"].value = 0
    assert number(panel(explorer)["fc-true"]) == pytest.approx(want[0, 1, 3, 0].item(), abs=5e-5)


def test_causal_blocks_widget_counts_and_sliders():
    explorer = widgets.causal_blocks(96, 128, 32, 32)
    cells = panel(explorer)
    assert (cells["fc-full"], cells["fc-partial"], cells["fc-skip"], cells["fc-total"]) == ("6", "3", "3", "12")
    explorer.controls["T"].value = 128
    assert explorer.controls["offset"].value == 0 and explorer.controls["offset"].disabled
    assert (panel(explorer)["fc-partial"], panel(explorer)["fc-skip"]) == ("4", "6")
    explorer.controls["default_offset"].value = False
    explorer.controls["offset"].value = 64
    classes = widgets.block_classes(128, 128, 32, 32, 64)
    assert panel(explorer)["fc-skip"] == str(sum(row.count("skip") for row in classes))
    explorer.controls["window"].value = 16
    classes = widgets.block_classes(128, 128, 32, 32, 64, 16)
    assert panel(explorer)["fc-skip"] == str(sum(row.count("skip") for row in classes))


def test_widgets_build_in_a_plain_python_process():
    code = ("from flashcourse import widgets\n"
            "e = widgets.tile_explorer(); e.controls['tile'].value = 2\n"
            "assert 'class=\"fc-l\">1.5530<' in e.panel.value, e.panel.value\n"
            "widgets.causal_blocks(64, 64, 16, 16)\n"
            "import matplotlib.pyplot\n"
            "assert not matplotlib.pyplot.get_fignums(), 'no pyplot figure should be left open'\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# ---- the state plot of 01: the correct recurrence first, then the learner's ------------------

def test_state_plot_draws_the_correct_recurrence_without_an_update():
    picture = widgets.state_plot()
    assert picture._repr_png_().startswith(b"\x89PNG\r\n\x1a\n")
    axes = picture.figure.axes
    assert [ax.get_title() for ax in axes] == ["running maximum m", "denominator l (drops when m rises)",
                                               "partial output a / l"]
    scores, values = widgets._state_row()
    want = recurrence.trace(scores, values, 6)
    assert list(axes[2].lines[0].get_ydata()) == pytest.approx([s.output for s in want])


def test_state_plot_says_so_while_tile_update_is_the_stub(capsys):
    assert widgets.state_plot(update=_stub) is None
    assert capsys.readouterr().out.strip() == widgets.NOT_WRITTEN == "write tile_update above to see your own recurrence here"


@pytest.mark.parametrize("update, words", [(lambda m, l, a, s, v: 1 / 0, "ZeroDivisionError"),
                                           (lambda m, l, a, s, v: None, "(m, l, a)")])
def test_state_plot_prints_other_errors_instead_of_raising(capsys, update, words):
    assert widgets.state_plot(update=update) is None
    assert words in capsys.readouterr().out


def test_state_plot_names_the_learners_mistake(capsys):
    def l_not_rescaled(m, l, a, scores, values):
        s = recurrence.step(m, l, a, scores, values, "l_not_rescaled")
        return s.m_new, s.l_new, s.a_new

    picture = widgets.state_plot(update=l_not_rescaled)
    assert "l is not multiplied by alpha" in capsys.readouterr().out
    assert picture.figure.axes[1].get_legend() is not None           # yours and the correct one, labelled
    widgets.state_plot(update=engine.tile_update)
    assert "matches the recurrence on all 8 tiles" in capsys.readouterr().out
