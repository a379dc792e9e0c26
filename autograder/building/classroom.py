"""A synthetic class, made from the sample submissions, to time the grader on: N learners x every assignment.

    python -m autograder.building.classroom N OUTDIR
    python benchmarks/grading.py OUTDIR --jobs 2      (grades it, timing every notebook)

OUTDIR is laid out as nbgrader's submitted/<student>/<assignment>/<assignment>.ipynb. Learner i hands
in, for each assignment, the sample submission number i (round robin over that assignment's samples:
correct, buggy and blank ones, and the samples that cheat), so a class of N holds every sample about
N / (samples per assignment) times. Every tenth learner instead hands in a hostile 01 notebook: the
buggy sample (l not rescaled) with a cell after its tile_update that tries to cheat, as the robustness tests do. Such a
notebook must score no more than the buggy sample does; `expected_at_most` says what each learner's
notebook should score, from autograder/samples/expected/.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from autograder import ROOT

SAMPLES = ROOT / "autograder" / "samples"
HOSTILE_BASE = ("bug_l_not_rescaled", "01_online_softmax")
# Cells a cheating learner adds after their own definitions: pass every comparison, take the finished
# engine's answer, stop every other process. The jail must leave each of them the buggy sample's grade.
CHEATS = {
    "cheat_allclose": "import math, torch\ntorch.allclose = lambda *a, **k: True\nmath.isclose = lambda *a, **k: True",
    "cheat_engine": "from flashcourse.engine.online_softmax import tile_update",
    "cheat_kill": "import os, signal\nfor pid in range(2, 1 << 15):\n    try: os.kill(pid, signal.SIGKILL)\n"
                  "    except Exception: pass",
}

# Where a sample scores otherwise when its kernels are compiled on a GPU, (assignment, student) -> questions:
# a GPU grows the hidden cases and autotunes other block sizes, which can expose more of a planted mistake.
# None today: bug_causal_bound_backward, whose dK/dV loop rounds its first query block up, once passed the
# integrated backward cell on a CPU alone; 06's dK/dV kernel is now checked alone with blocks of several
# ratios, and fails it on a CPU as on a GPU.
ON_GPU: dict[tuple[str, str], dict[str, float]] = {}


def samples() -> dict[str, list[str]]:
    """For each assignment, the students with a sample submission of it, sorted."""
    found: dict[str, list[str]] = {}
    for folder in sorted((SAMPLES / "submitted").glob("*/*")):
        found.setdefault(folder.name, []).append(folder.parent.name)
    return found


def _hostile(cheat: str) -> str:
    """The buggy 01 sample with the cheat's cell right after its tile_update, as notebook JSON."""
    student, assignment = HOSTILE_BASE
    nb = json.loads((SAMPLES / "submitted" / student / assignment / f"{assignment}.ipynb").read_text())
    after = next(i for i, c in enumerate(nb["cells"]) if c["metadata"].get("nbgrader", {}).get("grade_id") == "tile_update")
    nb["cells"].insert(after + 1, {"cell_type": "code", "id": "learner-cheat", "metadata": {}, "source": CHEATS[cheat],
                                   "outputs": [], "execution_count": None})
    return json.dumps(nb, indent=1)


def plan(learners: int) -> dict[tuple[str, str], str]:
    """(learner, assignment) -> the sample student (or cheat) whose notebook that learner hands in."""
    chosen, cheats = {}, sorted(CHEATS)
    for i in range(learners):
        learner = f"learner{i + 1:03d}"
        for assignment, students in samples().items():
            chosen[learner, assignment] = students[i % len(students)]
        if i % 10 == 9:
            chosen[learner, HOSTILE_BASE[1]] = cheats[(i // 10) % len(cheats)]
    return chosen


def expected_at_most(learners: int,
                     on_gpu: frozenset[str] = frozenset()) -> dict[tuple[str, str], dict[str, float]]:
    """(learner, assignment) -> the most each question may earn: the sample's expected score, and for a
    cheat the buggy sample's; for the assignments in `on_gpu`, with ON_GPU's changes."""
    expected = {a: json.loads((SAMPLES / "expected" / f"{a}.json").read_text()) for a in samples()}
    for (assignment, student), changes in ON_GPU.items():
        if assignment in on_gpu:
            expected[assignment][student] = {**expected[assignment][student], **changes}
    return {(learner, assignment): expected[assignment][HOSTILE_BASE[0] if source in CHEATS else source]
            for (learner, assignment), source in plan(learners).items()}


def build(learners: int, out: Path) -> int:
    """Write the class under `out` (replacing it); the number of notebooks written."""
    shutil.rmtree(out, ignore_errors=True)
    for (learner, assignment), source in plan(learners).items():
        target = out / learner / assignment / f"{assignment}.ipynb"
        target.parent.mkdir(parents=True)
        if source in CHEATS:
            target.write_text(_hostile(source))
        else:
            shutil.copy(SAMPLES / "submitted" / source / assignment / f"{assignment}.ipynb", target)
    return len(plan(learners))


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[0].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    written = build(int(argv[0]), Path(argv[1]))
    print(f"{written} notebooks of {argv[0]} learners in {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
