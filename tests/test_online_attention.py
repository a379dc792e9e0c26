"""The exported engine of 02 and 03 against the reference, the hidden checks on it, and 03's visible tests
on the sample submissions."""

import json
from pathlib import Path

import pytest
import torch

from autograder.building import build
from autograder.hidden import online_attention as hidden03
from autograder.hidden import single_query as hidden02
from flashcourse.checks import core as ac
from flashcourse.engine import online_attention as engine
from flashcourse.engine.single_query import online_attention_single


HIDDEN_03 = {  # hidden check -> the engine function it grades
    "causal_attention": "causal_attention", "causal_attention_positions": "causal_attention",
    "online_attention": "online_attention", "online_attention_edges": "online_attention",
    "online_attention_errors": "online_attention", "online_attention_memory": "online_attention",
    "merge_partials": "merge_partials", "split_attention": "split_attention",
}


@pytest.mark.parametrize("name", HIDDEN_03)
def test_engine_passes_hidden_checks(name):
    getattr(hidden03, f"test_{name}")(getattr(engine, HIDDEN_03[name]))


def test_single_query_engine_passes_hidden_checks():
    hidden02.test_online_attention_single(online_attention_single)
    hidden02.test_online_attention_single_stable(online_attention_single)


def test_online_equals_causal_in_bf16():
    case = ac.standard_cases(torch.bfloat16)[4]
    out = engine.online_attention(case.q, case.k, case.v, tile=5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), engine.causal_attention(case.q, case.k, case.v).float(),
                               rtol=2e-2, atol=2e-2)


def test_value_errors():
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError):
        engine.online_attention(q, k, k)
    q = torch.randn(1, 2, 2, 8)
    with pytest.raises(ValueError):
        engine.online_attention(q, k, k, tile=0)
    with pytest.raises(ValueError):
        engine.online_attention(q, k, k, query_positions=torch.tensor([-1, 3]))


def test_split_matches_online_and_merge_is_associative():
    case = ac.make_case("decode", batch=2, q_heads=4, kv_heads=2, t=1, s=50, seed=3)
    online = engine.online_attention(case.q, case.k, case.v)
    for chunks in (1, 3, 4, 7):
        torch.testing.assert_close(engine.split_attention(case.q, case.k, case.v, chunks=chunks), online,
                                   rtol=1e-5, atol=1e-5)
    p = ac.partial_states(case, [(0, 10), (10, 30), (30, 50)])
    flat = engine.merge_partials(p)
    nested = engine.merge_partials([p[2], engine.merge_partials([p[1], p[0]])])
    torch.testing.assert_close(flat[2] / flat[1], nested[2] / nested[1])


SAMPLES = Path(__file__).resolve().parent.parent / "autograder" / "samples"
EXPECTED_03 = json.loads((SAMPLES / "expected" / "03_online_attention.json").read_text())
# The words of attention_checks that name each planted mistake of 03's samples.
DIAGNOSES_03 = {
    "bug_l_not_rescaled": ac.BUGS["l_not_rescaled"],
    "bug_a_not_rescaled": ac.BUGS["a_not_rescaled"],
    "bug_per_tile_softmax": ac.BUGS["per_tile_softmax"],
    "bug_nan_first_tile": ac.NAN_HINT,
    "bug_mask_off_by_one": ac.BUGS["mask_off_by_one"],
    "bug_offset_ignored": ac.BUGS["offset_ignored"],
    "bug_gqa_modulo": ac.BUGS["gqa_modulo"],
    "bug_scale": ac.BUGS["scale_over_d"],
    "bug_merge_no_rescale": ("added without rescaling each by exp(m_i - m)", ac.BUGS["no_rescale"]),
    "bug_full_scores": "as large as the whole [T, S] = ",
}

# A softmax per tile inside online_state, seen through split_attention's chunks (whose inner tile the
# learner chooses), matches no single recognisable variant there; test_online_attention names it.
NAMED_ELSEWHERE = {("bug_per_tile_softmax", "test_split_attention")}


def _visible_failures(student: str) -> dict[str, str]:
    """Run 03's visible test cells (hidden tests removed) on a sample's functions: grade id -> failure message."""
    given = build.solution_cells("03_online_attention")
    namespace: dict = {}
    for cell in given.cells:                       # the given code of the notebook (imports, resolve_positions)
        if cell.cell_type == "code" and "export" in cell.metadata.get("tags", []):
            exec(cell.source, namespace)           # noqa: S102  (the course's own cells)
    sample = json.loads((SAMPLES / "submitted" / student / "03_online_attention" / "03_online_attention.ipynb")
                        .read_text())
    for cell in sample["cells"]:
        meta = cell["metadata"].get("nbgrader", {})
        if cell["cell_type"] == "code" and meta.get("solution"):
            exec("".join(cell["source"]), namespace)   # noqa: S102  (the course's own samples)
    failures = {}
    for cell in given.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade") and not meta.get("solution"):
            try:
                exec(cell.source, dict(namespace))     # noqa: S102
            except AssertionError as error:
                failures[meta["grade_id"]] = str(error)
    return failures


@pytest.mark.parametrize("student", sorted(DIAGNOSES_03))
def test_visible_tests_diagnose_each_planted_mistake(student):
    """A planted mistake fails, in the visible tests alone, exactly the cells it loses points in when graded
    (the hidden tests add no requirement), and each failure names the mistake in the library's words."""
    failures = _visible_failures(student)
    lost = {question for question, points in EXPECTED_03[student].items() if points == 0}
    assert set(failures) == lost, f"{student}: visible tests fail {sorted(failures)}, grading takes points off {sorted(lost)}"
    words = DIAGNOSES_03[student]
    for question, message in failures.items():
        if (student, question) in NAMED_ELSEWHERE:
            continue
        assert any(w in message for w in ((words,) if isinstance(words, str) else words)), \
            f"{student}, {question}: the message does not name the mistake: {message}"


def test_visible_tests_pass_the_solution():
    assert _visible_failures("alt_correct") == {}


def test_solution_writes_nothing_on_stderr():
    """The executed solution of 03 carries no warnings: its plot labels ticks with plain numbers, not
    mathtext's 2^k, whose fallback STIX fonts printed findfont warnings where the font cache lacked them."""
    solution = json.loads((build.SOLUTIONS / "03_online_attention" / "03_online_attention.ipynb").read_text())
    stderr = [(cell.get("id"), "".join(out.get("text", ""))[:200]) for cell in solution["cells"]
              for out in cell.get("outputs", []) if out.get("name") == "stderr"]
    assert stderr == []
