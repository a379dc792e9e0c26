"""Broken and hostile submissions: none scores more than a wrong answer, and the batch goes on.

Each submission is made at test time from a sample of 01 with one change. Hostile ones start from
the sample whose tile_update forgets to rescale l (a wrong answer worth 2 of 8 points), so any cheat
that worked would show up as more than 2 points. Broken-but-honest ones start from a correct sample.
"""

import copy
import csv
import hashlib
import json
import re
import shutil
import time
from pathlib import Path

import pytest

from autograder import ROOT
from autograder.grading import batch as grade
from conftest import SAMPLES

pytestmark = pytest.mark.slow
ASSIGNMENT = "01_online_softmax"
NOTEBOOK = f"{ASSIGNMENT}.ipynb"
FULL = json.loads((SAMPLES / "expected" / f"{ASSIGNMENT}.json").read_text())["alt_correct"]
WRONG = json.loads((SAMPLES / "expected" / f"{ASSIGNMENT}.json").read_text())["bug_l_not_rescaled"]  # l not rescaled
ZERO = dict.fromkeys(FULL, 0)
# Each cell's time limit in this batch: loops_forever loses four calls to it and shows_hidden_tests' search one, so
# the batch costs five times this in CPU; the slowest honest cell (infects_the_grader's walk of /proc) takes ~5 s.
CELL_TIMEOUT_S = 15


def _sample(student: str) -> dict:
    return json.loads((SAMPLES / "submitted" / student / ASSIGNMENT / NOTEBOOK).read_text())


CORRECT, BUGGY = _sample("alt_correct"), _sample("bug_l_not_rescaled")
# A correct notebook begun from an earlier release: it still holds two question cells since moved to
# other notebooks, whose grade ids source/ no longer knows.
OLDER_RELEASE = copy.deepcopy(CORRECT)
OLDER_RELEASE["cells"].insert(len(CORRECT["cells"]) - 1, {
    "cell_type": "markdown", "id": "moved-question", "source": "An answer to a question that moved.",
    "metadata": {"nbgrader": {"grade": True, "solution": True, "locked": False, "grade_id": "q4_decode",
                              "points": 1, "schema_version": 3}}})


def _cell(nb: dict, grade_id: str) -> dict:
    return next(c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == grade_id)


def with_cell(base: dict, code: str, at: int = 2) -> dict:
    """base with a learner-written code cell inserted (after the set-up cell by default)."""
    nb = copy.deepcopy(base)
    nb["cells"].insert(at, {"cell_type": "code", "id": f"learner-{at}", "metadata": {}, "source": code,
                            "outputs": [], "execution_count": None})
    return nb


def in_tile_update(base: dict, line: str) -> dict:
    """base with one line added at the top of tile_update's body."""
    nb = copy.deepcopy(base)
    cell = _cell(nb, "tile_update")
    marker = "    # exp2 form"
    source = "".join(cell["source"])
    assert marker in source
    cell["source"] = source.replace(marker, f"    {line}\n{marker}")
    return nb


def edited(base: dict, change) -> dict:
    nb = copy.deepcopy(base)
    change(nb)
    return nb


def _drop_test(nb):
    nb["cells"].remove(_cell(nb, "test_tile_update"))


def _duplicate_test(nb):
    cell = _cell(nb, "test_merge_states")
    nb["cells"].insert(nb["cells"].index(cell), copy.deepcopy(cell))


def _empty_tests(nb):
    for grade_id in FULL:
        _cell(nb, grade_id)["source"] = '"""emptied"""\npass'


def _strip_metadata(nb):
    for grade_id in FULL:
        _cell(nb, grade_id)["metadata"] = {}


def _more_points(nb):
    _cell(nb, "test_merge_states")["metadata"]["nbgrader"]["points"] = 100


PATCH_CHECKS = "import flashcourse.checks.online_softmax as c\nfor n in dir(c):\n    if n.startswith('check_'):\n        setattr(c, n, lambda *a, **k: None)"
PATCH_ALLCLOSE = "import math, torch, numpy\ntorch.allclose = numpy.allclose = lambda *a, **k: True\nmath.isclose = lambda *a, **k: True"
TRANSFORMER = "get_ipython().input_transformers_post.append(lambda lines: ['pass\\n'])"
CUSTOM_EXC = "get_ipython().set_custom_exc((BaseException,), lambda *a, **k: None)"
READ_SOURCE = ("import pathlib\nfor p in pathlib.Path('/').glob('**/source/01_online_softmax/*.ipynb'):\n"
               "    exec(compile(p.read_text(), 'x', 'exec'))")
WRITE_GRADER = ("import pathlib, os\nfor d in ('../../..', os.path.expanduser('~'), '/work', '/tmp'):\n"
                "    try:\n        (pathlib.Path(d) / 'grades.csv').write_text('alt_correct,999')\n"
                "    except OSError as e:\n        print(e)")
# Code appended to course modules the grader imports later: it would run in the grader.
INFECT_GRADER = ("import flashcourse, pathlib\nroot = pathlib.Path(flashcourse.__file__).parent\n"
                 "for name in ('checks.py', 'attention_checks.py', '__init__.py'):\n"
                 "    try:\n        (root / name).open('a').write('\\nraise SystemExit(0)\\n')\n"
                 "    except OSError as e: print(e)\n"
                 "for path in pathlib.Path('/proc').glob('*/root/**/autograder/grading/execute.py'):\n"
                 "    try:\n        path.open('a').write('\\nraise SystemExit(0)\\n')\n"
                 "    except OSError as e: print(e)")
# Processes that outlive the notebook and rewrite whatever they find of other students and of grades.
DAEMON = ("import subprocess, sys\n"
          "code = 'import glob, time\\nfor _ in range(600):\\n"
          "    for p in glob.glob(\"/**/grades.csv\", recursive=True) + glob.glob(\"/**/*.ipynb\", recursive=True):\\n"
          "        try: open(p, \"a\").write(\"forged\")\\n        except OSError: pass\\n    time.sleep(0.1)'\n"
          "for _ in range(3):\n    subprocess.Popen([sys.executable, '-c', code], start_new_session=True)")
KILL_EVERYONE = ("import os, signal\nfor pid in range(2, 1 << 16):\n    try: os.kill(pid, signal.SIGKILL)\n"
                 "    except OSError: pass\ntry: os.kill(-1, signal.SIGKILL)\nexcept OSError: pass")
FORK_BOMB = ("import os, time\nborn = 0\nfor _ in range(2000):\n    try:\n        if os.fork() == 0:\n"
             "            time.sleep(600); os._exit(0)\n        born += 1\n    except OSError:\n        break\n"
             "print('children:', born)")
FILL_DISK = ("for path in ('/tmp/fill', '/fill'):\n    try:\n        with open(path, 'wb') as f:\n"
             "            for _ in range(4096): f.write(b'0' * (1 << 20))\n    except OSError as e: print(path, e)")
SHOW_HIDDEN = ("import glob\nprint(In)\nfor p in glob.glob('/**/hidden/*.py', recursive=True):\n"
               "    print(open(p).read())")
USE_ENGINE = ("import importlib\nm = importlib.import_module('flashcourse' + '.eng' + 'ine.online_softmax')\n"
              "tile_update, online_softmax, merge_states = m.tile_update, m.online_softmax, m.merge_states")
USE_REFERENCE = ("from flashcourse.checks.reference import softmax_weighted_sum as exact\n"
                 "def online_softmax(scores, values, tile):\n    return exact(scores, values)")
USE_RECURRENCE = "from flashcourse import recurrence\ntile_update = getattr(recurrence, 'step')"
# Bytes written straight to the runner's answer pipe: a header announcing an enormous message.
FORGE_MESSAGE = "import os, sys\nos.write(int(sys.argv[2]), b'\\x00' * 7 + b'\\xff' * 9 + b'garbage')"
HONEST_MENTIONS = ("# Checked with `python -m autograder check`; flashcourse.engine and autograder.hidden are the\n"
                   "# course's, not mine. from flashcourse.checks.reference import attention  <- not used\n"
                   "notes = 'importlib.import_module(\"flashcourse.engine\") is what a cheat would write'")
# Cells dressed up as test cells: if the grader ran them as its own, the marker would appear on this machine.
MARKER = Path("/tmp/flashcourse-ran-in-the-grader")
IN_THE_GRADER = f"open({str(MARKER)!r}, 'w').write('learner code ran in the grader')"


def _dressed_as_test(base: dict, grade_id: str, before: str | None = None) -> dict:
    """base with a learner cell carrying test-cell metadata (a new id, or a real test's id placed before it)."""
    nb = copy.deepcopy(base)
    cell = {"cell_type": "code", "id": f"dressed-{grade_id}", "execution_count": None, "outputs": [],
            "source": IN_THE_GRADER, "metadata": {"nbgrader": {"grade": True, "solution": False, "locked": False,
                                                                "grade_id": grade_id, "points": 8,
                                                                "schema_version": 3}}}
    at = nb["cells"].index(_cell(nb, before)) if before else 2
    nb["cells"].insert(at, cell)
    return nb


SCRIPT = "<script>document.title = 'owned'</script><img src=x onerror=\"document.title='owned'\">"


def _with_markdown(base: dict, text: str) -> dict:
    nb = copy.deepcopy(base)
    nb["cells"].insert(2, {"cell_type": "markdown", "id": "learner-markdown", "metadata": {}, "source": text})
    return nb


LAST = len(BUGGY["cells"]) - 1  # after the learner's own definitions, so a cheat would replace them

# student -> (files in submitted/<student>/01_online_softmax/, expected points, words the summary must hold)
CASES = {
    # honest but broken
    "warns_on_stderr": ({NOTEBOOK: in_tile_update(CORRECT, 'import warnings; warnings.warn("a harmless warning")')},
                        FULL, None),
    "loops_forever": ({NOTEBOOK: in_tile_update(CORRECT, "while True: pass")},
                      WRONG, "time limit"),             # every cell that calls tile_update loses its points
    "asks_for_input": ({NOTEBOOK: with_cell(CORRECT, "name = input('your name? ')")}, FULL, None),
    "huge_output": ({NOTEBOOK: with_cell(CORRECT, "print('x' * 50_000_000)")}, FULL, None),
    "allocates_64_gib": ({NOTEBOOK: with_cell(CORRECT, "import torch\nblock = torch.ones(64 << 30, dtype=torch.uint8)")},
                         FULL, None),
    "exits_the_kernel": ({NOTEBOOK: with_cell(CORRECT, "import os\nos._exit(0)")}, FULL, "kernel died"),
    "sys_exit": ({NOTEBOOK: with_cell(BUGGY, "import sys\nsys.exit(0)")}, WRONG, None),
    "wrong_name": ({"online_softmax.ipynb": CORRECT}, ZERO, "must keep their name"),
    "empty_file": ({NOTEBOOK: ""}, ZERO, "not a readable notebook"),
    "malformed_json": ({NOTEBOOK: json.dumps(CORRECT)[:-200]}, ZERO, "not a readable notebook"),
    "missing_notebook": ({}, ZERO, "no 01_online_softmax.ipynb was submitted"),
    "correct_neighbour": ({NOTEBOOK: CORRECT}, FULL, None),
    "mentions_any_word": ({NOTEBOOK: with_cell(CORRECT, HONEST_MENTIONS)}, FULL, None),
    # hostile, on a wrong answer: never more than its merge_states points
    "patches_checks": ({NOTEBOOK: with_cell(BUGGY, PATCH_CHECKS)}, WRONG, None),
    "patches_allclose": ({NOTEBOOK: with_cell(BUGGY, PATCH_ALLCLOSE)}, WRONG, None),
    "input_transformer": ({NOTEBOOK: with_cell(BUGGY, TRANSFORMER)}, ZERO, None),
    "custom_exception_handler": ({NOTEBOOK: with_cell(BUGGY, CUSTOM_EXC)}, WRONG, None),
    "reads_the_source": ({NOTEBOOK: with_cell(BUGGY, READ_SOURCE)}, WRONG, None),
    "writes_grader_files": ({NOTEBOOK: with_cell(BUGGY, WRITE_GRADER)}, WRONG, None),
    "infects_the_grader": ({NOTEBOOK: with_cell(BUGGY, INFECT_GRADER)}, WRONG, None),
    "leaves_daemons": ({NOTEBOOK: with_cell(BUGGY, DAEMON)}, WRONG, "left 3 process(es) running"),
    "kills_everyone": ({NOTEBOOK: with_cell(BUGGY, KILL_EVERYONE)}, WRONG, None),
    "fork_bomb": ({NOTEBOOK: with_cell(BUGGY, FORK_BOMB)}, WRONG, "process(es) running"),
    "fills_the_disk": ({NOTEBOOK: with_cell(BUGGY, FILL_DISK)}, WRONG, None),
    "shows_hidden_tests": ({NOTEBOOK: with_cell(BUGGY, SHOW_HIDDEN)}, WRONG, None),
    "imports_the_engine": ({NOTEBOOK: with_cell(BUGGY, "from flashcourse.engine.online_softmax import *", at=LAST)},
                           WRONG, None),
    "imports_the_engine_by_parts": ({NOTEBOOK: with_cell(BUGGY, USE_ENGINE, at=LAST)}, WRONG, None),
    "uses_the_reference": ({NOTEBOOK: with_cell(BUGGY, USE_REFERENCE, at=LAST)}, WRONG, None),
    "uses_the_recurrence": ({NOTEBOOK: with_cell(BUGGY, USE_RECURRENCE, at=LAST)}, WRONG, None),
    "fakes_a_test_cell": ({NOTEBOOK: _dressed_as_test(BUGGY, "my_own_test")}, WRONG, None),
    "from_an_older_release": ({NOTEBOOK: OLDER_RELEASE}, FULL, None),
    "shadows_a_test_cell": ({NOTEBOOK: _dressed_as_test(BUGGY, "test_tile_update", before="tile_update")},
                            WRONG, None),
    "scripts_the_feedback": ({NOTEBOOK: _with_markdown(with_cell(BUGGY, f"from IPython.display import HTML\n"
                                                                     f"display(HTML({SCRIPT!r}))"), SCRIPT)},
                             WRONG, None),
    "forges_a_message": ({NOTEBOOK: with_cell(BUGGY, FORGE_MESSAGE)}, WRONG, "malformed"),
    "deletes_a_test": ({NOTEBOOK: edited(BUGGY, _drop_test)}, WRONG, None),
    "duplicates_a_test": ({NOTEBOOK: edited(BUGGY, _duplicate_test)}, WRONG, None),
    "empties_the_tests": ({NOTEBOOK: edited(BUGGY, _empty_tests)}, WRONG, None),
    "strips_test_metadata": ({NOTEBOOK: edited(BUGGY, _strip_metadata)}, WRONG, None),
    "edits_points": ({NOTEBOOK: edited(BUGGY, _more_points)}, WRONG, None),
    # links planted in the submission itself
    "links_to_the_source": ({NOTEBOOK: ROOT / "source" / ASSIGNMENT / NOTEBOOK}, ZERO, "symbolic link"),
    "links_to_a_neighbour": ({NOTEBOOK: Path("../../correct_neighbour") / ASSIGNMENT / NOTEBOOK}, ZERO, "symbolic link"),
}


def _write(folder: Path, name: str, content) -> None:
    if isinstance(content, Path):
        (folder / name).symlink_to(content)
    else:
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))


def _fingerprint(root: Path) -> dict[str, str]:
    """Content hashes of the grader's own files: course code, instructor notebooks, hidden checks."""
    files = [p for d in ("autograder", "flashcourse", "source") for p in (root / d).rglob("*")
             if p.is_file() and "samples" not in p.parts and "__pycache__" not in p.parts]
    files.append(root / "nbgrader_config.py")
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("robustness")
    for student, (files, _, _) in CASES.items():
        folder = root / "submitted" / student / ASSIGNMENT
        folder.mkdir(parents=True)
        for name, content in files.items():
            _write(folder, name, content)
    before = _fingerprint(ROOT)
    outcomes = grade.grade(root / "submitted", root / "out", jobs=2, progress=False, cell_timeout=CELL_TIMEOUT_S)
    time.sleep(2)  # anything left running would have time to tamper with what the batch wrote
    return {o.student: o for o in outcomes}, root / "out", before


@pytest.mark.parametrize("student", CASES)
def test_score_and_summary(graded, student):
    """Each submission scores as asserted (never above a wrong answer for a cheat) and the summary explains."""
    outcomes, out, _ = graded
    _, points, words = CASES[student]
    outcome = outcomes[student]
    got = {s.question: s.points for s in outcome.scores if s.kind == "auto"}
    assert got == points, f"{student}: {got}; problem: {outcome.problem!r}; anomalies: {outcome.anomalies}"
    assert all(s.max_points == FULL[s.question] for s in outcome.scores if s.kind == "auto"), "points were edited"
    said = [outcome.problem, *outcome.anomalies]
    if words:
        assert any(words in line for line in said), said
        assert f"{student}, {ASSIGNMENT}: " in (out / "summary.txt").read_text()


def test_the_grader_and_the_batch_are_untouched(graded):
    """No course file changed, grades.csv matches the outcomes line for line, and no forged line exists."""
    outcomes, out, before = graded
    assert _fingerprint(ROOT) == before
    assert not MARKER.exists(), MARKER.read_text()
    rows = list(csv.DictReader((out / "grades.csv").open()))
    expected = [(s.student, s.question, f"{s.points:g}") for o in outcomes.values() for s in o.scores]
    assert sorted((r["student"], r["question"], r["points"]) for r in rows) == sorted(expected)
    assert "forged" not in (out / "grades.csv").read_text() and "999" not in (out / "grades.csv").read_text()


def test_the_summary_names_every_anomaly(graded):
    """Every student whose grading saw a problem or anomaly has a line in the summary; the head counts them."""
    outcomes, out, _ = graded
    text = (out / "summary.txt").read_text()
    troubled = [o for o in outcomes.values() if o.problem or o.anomalies]
    assert troubled and f"{len(outcomes) - len(troubled)} of {len(outcomes)} notebooks graded normally" in text
    for o in troubled:
        assert f"- {o.student}, {ASSIGNMENT}: " in text


def test_feedback_never_shows_hidden_tests(graded):
    """Even a notebook that prints IPython's history and searches for the hidden checks shows none of them."""
    _, out, _ = graded
    hidden = (ROOT / "autograder" / "hidden" / "online_softmax.py").read_text()
    secrets = [line for line in hidden.splitlines() if line.startswith("def test_") or "seed" in line]
    secrets += ["from autograder.hidden import", "HIDDEN TESTS"]
    pages = list((out / "feedback").rglob("*.html"))
    assert any("shows_hidden_tests" in str(p) for p in pages)
    for page in pages:
        text = page.read_text()
        assert not [s for s in secrets if s in text], page


def test_feedback_runs_no_learner_script(graded):
    """A learner's <script> or event handler, in markdown or in an output, is not in the feedback page."""
    _, out, _ = graded
    page = next((out / "feedback" / "scripts_the_feedback").rglob("*.html")).read_text()
    assert "<script>document.title" not in page  # shown as text (&lt;script&gt;) is fine
    assert not re.findall(r"<[^>]*onerror[^>]*>", page)


def test_grading_again_gives_the_same_grades(graded, tmp_path):
    """Grades are repeatable: regrading reproduces them exactly."""
    outcomes, _, _ = graded
    shutil.copytree(SAMPLES / "submitted" / "alt_correct" / ASSIGNMENT,
                    tmp_path / "submitted" / "correct_neighbour" / ASSIGNMENT)
    again = grade.grade(tmp_path / "submitted", tmp_path / "out", progress=False)
    assert [(s.question, s.points) for s in again[0].scores] == \
           [(s.question, s.points) for s in outcomes["correct_neighbour"].scores]


def test_a_gpu_grader_says_what_the_memory_points_do_not_see(tmp_path, monkeypatch):
    """Graded with --device cuda, summary.txt says that the memory probes watch the CPU process only."""
    from flashcourse import DEVICE_ENV

    (tmp_path / "submitted").mkdir()
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    grade.grade(tmp_path / "submitted", tmp_path / "out", progress=False)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert f"Note: {grade.ON_A_GPU}." in summary and "memory held on the GPU" in summary, summary
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    grade.grade(tmp_path / "submitted", tmp_path / "out", progress=False)
    assert "graded on a GPU" not in (tmp_path / "out" / "summary.txt").read_text()
