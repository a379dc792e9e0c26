"""Quoted figures stay in step with the results they come from (autograder/building/figures.py)."""

import re

import nbformat
import pytest

from autograder.building import build, figures

NOTEBOOKS = [build.source_notebook(a) for a in build.assignments()]
# Numbers in a markdown text outside code, math and figure markers.
CODE_OR_MATH = re.compile(r"`[^`]*`|\$[^$]*\$")
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.]*<!--fig:)")

NOT_MEASURED = {   # decimal numbers in the prose that no measurement of ours gives, and what they are
    "03_online_attention": {
        "0.998": "question 5's worked answer: softmax of [8, 7, 0, 1] against [1, 1, -1, -1], computed in the text",
        "1.4": "question 3's worked answer: 2 x 4 x 16384^2 x 64 operations, computed in the text",
        "2.7": "question 3's worked answer: twice the line before",
    },
    "05_fast_kernel": {
        "3.9": "FlashAttention-3's exponential throughput on an H100, cited with the paper beside it",
        "3.6": "Triton's version number",
    },
    "06_backward": {
        "2.5": "the backward's matrix work over the forward's, five products against two, counted in the text",
    },
    "07_ring_attention": {
        "1.75": "question 2's worked answer: 2 - 1/P at P = 4",
        "1.00": "question 2's worked answer: zigzag's slowest rank over the mean",
        "0.5": "question 2's worked answer: causal pairs of contiguous rank 0 at T = 4096, P = 4, computed",
        "1.6": "question 2's worked answer: the same for rank 1",
        "2.6": "question 2's worked answer (rank 2's pairs) and the 64-GPU ratio of FLOPs to bytes, computed in the text",
        "3.7": "question 2's worked answer: the same for rank 3",
        "2.1": "question 2's worked answer: zigzag's pairs per rank",
    },
    "08_hopper": {
        "3.6": "Triton's version number",
        "3.9": "Triton's version number",
        "2.5": "the backward's matrix work over the forward's, five products against two, counted in the text",
        "12.8": "the version of ptxas that Triton 3.6 brings",
        "12.9": "a later version of ptxas",
    },
}


def _quoted_everywhere() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in NOTEBOOKS:
        for cell in figures.markdown_cells(path):
            for name, _ in figures.quoted(cell.source):
                found.setdefault(name, []).append(path.parent.name)
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.parent.name)
def test_quoted_figures_match_their_sources(path):
    """Every figure a notebook quotes is known and equals what its source gives today."""
    assert figures.problems(path, f"source/{path.parent.name}") == []


@pytest.mark.parametrize("name", sorted(figures.FIGURES))
def test_every_figure_is_computable_and_quoted(name):
    """Each defined figure reads its source and is quoted somewhere (no figure kept for nothing)."""
    assert figures.FIGURES[name].text()
    assert name in _quoted_everywhere(), f"{name} is defined in autograder/building/figures.py and quoted nowhere"


@pytest.mark.parametrize("assignment", ["03_online_attention", "05_fast_kernel", "06_backward", "07_ring_attention",
                                        "08_hopper"])
def test_no_decimal_figure_without_its_source(assignment):
    """In 03 and 05 to 08, every decimal number in the prose is a quoted figure (code and math aside, and the few
    numbers below that are not measurements), so a measured value cannot be typed in by hand unnoticed."""
    loose = []
    for cell in figures.markdown_cells(build.source_notebook(assignment)):
        prose = CODE_OR_MATH.sub("", cell.source)
        loose += [(cell.get("id"), n) for n in DECIMAL.findall(prose) if n not in NOT_MEASURED[assignment]]
    assert loose == [], f"decimal numbers typed by hand in {assignment} (quote them as figures): {loose}"


@pytest.mark.parametrize("folder, assignment", [(build.RELEASE, "05_fast_kernel"), (build.SOLUTIONS, "05_fast_kernel"),
                                                (build.RELEASE, "08_hopper"), (build.SOLUTIONS, "08_hopper"),
                                                (build.SOLUTIONS, "03_online_attention"), (build.RELEASE, "06_backward"),
                                                (build.SOLUTIONS, "06_backward"), (build.RELEASE, "07_ring_attention"),
                                                (build.SOLUTIONS, "07_ring_attention")])
def test_release_and_solution_carry_the_quoted_values(folder, assignment):
    """The learner's release and the executed solution say what the source says, value for value (03's
    release quotes none: its figures are in the answers, which the release leaves to the learner)."""
    want = [q for c in figures.markdown_cells(build.source_notebook(assignment)) for q in figures.quoted(c.source)]
    path = folder / assignment / f"{assignment}.ipynb"
    got = [q for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"
           for q in figures.quoted(c.source)]
    assert want and got == want, f"{path.relative_to(build.ROOT)} quotes other values than source/; rebuild"


def test_fill_rewrites_a_stale_value_and_drift_names_it(tmp_path):
    """A value that no longer matches its source is rewritten by fill and reported by problems."""
    name = "fast.prefill.tflops_8k"
    right = figures.FIGURES[name].text()
    stale = f"ran at 1<!--fig:{name}--> TFLOP/s, and 2<!--fig:no.such.figure-->"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(stale)])
    path = tmp_path / "stale.ipynb"
    nbformat.write(nb, path)
    found = figures.problems(path, "stale")
    assert any(f"quotes {name} as 1," in p and f"gives {right}" in p for p in found), found
    assert any("unknown figure 'no.such.figure'" in p for p in found), found
    assert figures.fill(f"ran at 1<!--fig:{name}--> TFLOP/s") == f"ran at {right}<!--fig:{name}--> TFLOP/s"
    assert figures.fill(f"ran at <!--fig:{name}-->") == f"ran at {right}<!--fig:{name}-->"


def test_markdown_tables_are_read_by_column():
    report = figures._markdown("# t\n\n| a | b |\n|---|---|\n| 1 | x |\n| 2 | y |\n\ntext\n\n| c |\n|---|\n| 3 |\n")
    assert report.tables == [[{"a": "1", "b": "x"}, {"a": "2", "b": "y"}], [{"c": "3"}]]
