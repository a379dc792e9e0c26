"""The synthetic class the grader is timed on (autograder/building/classroom.py): every sample handed in, cheats
among them, and what each learner's notebook should score."""

import nbformat

from autograder import ROOT
from autograder.building import build, classroom
from autograder.grading import batch as grade
from conftest import expected_scores


def test_every_sample_of_every_assignment_is_handed_in(tmp_path):
    """A class as large as the most samples of one assignment hands in each sample at least once."""
    samples = classroom.samples()
    learners = max(len(students) for students in samples.values())
    written = classroom.build(learners, tmp_path)
    assert written == learners * len(samples) == len(list(tmp_path.glob("*/*/*.ipynb")))
    handed_in = {(a, source) for (_, a), source in classroom.plan(learners).items()}
    for assignment, students in samples.items():
        missing = {s for s in students if (assignment, s) not in handed_in}
        # only 01's samples make way for the cheats, one learner in ten
        assert not missing or (assignment == classroom.HOSTILE_BASE[1] and len(missing) <= learners // 10), missing


def test_cheats_are_valid_notebooks_that_cheat_after_tile_update(tmp_path):
    """Each cheat is handed in once in a class of 30: the buggy 01 sample with the cheat's cell right after
    its tile_update, a valid notebook, expected to score no more than the buggy sample."""
    plan = classroom.plan(30)
    cheats = {source: key for key, source in plan.items() if source in classroom.CHEATS}
    assert set(cheats) == set(classroom.CHEATS)
    classroom.build(30, tmp_path)
    limits = classroom.expected_at_most(30)
    buggy = expected_scores()[classroom.HOSTILE_BASE[1]][classroom.HOSTILE_BASE[0]]
    for cheat, (learner, assignment) in cheats.items():
        path = tmp_path / learner / assignment / f"{assignment}.ipynb"
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        ids = [c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells]
        at = next(i for i, c in enumerate(nb.cells) if c.source == classroom.CHEATS[cheat])
        assert ids[at - 1] == "tile_update"
        assert limits[learner, assignment] == buggy


def test_honest_learners_expect_their_samples_scores():
    """A learner who hands in a sample is expected to score exactly that sample's expected points."""
    expected, limits = expected_scores(), classroom.expected_at_most(12)
    for (learner, assignment), source in classroom.plan(12).items():
        if source not in classroom.CHEATS:
            assert limits[learner, assignment] == expected[assignment][source]


def test_on_a_gpu_the_compiled_assignments_expect_their_gpu_scores():
    """Graded on a GPU, a sample in ON_GPU expects its changed points in the assignments graded there, and
    only there; every change names a question the sample's expected scores have. With none in ON_GPU, every
    learner expects on a GPU what they expect on a CPU."""
    expected = expected_scores()
    for (a, s), change in classroom.ON_GPU.items():
        assert set(change) <= set(expected[a][s]), f"{a}/{s}: {set(change) - set(expected[a][s])} are no questions"
    if not classroom.ON_GPU:
        learners = max(len(students) for students in classroom.samples().values())
        compiled = frozenset({"04_triton_flash", "05_fast_kernel", "06_backward"})
        assert classroom.expected_at_most(learners, compiled) == classroom.expected_at_most(learners)
        return
    (assignment, student), changes = next(iter(classroom.ON_GPU.items()))
    learners = len(classroom.samples()[assignment])
    learner = next(key for key, source in classroom.plan(learners).items()
                   if key[1] == assignment and source == student)
    on_gpu = classroom.expected_at_most(learners, frozenset({assignment}))
    assert on_gpu[learner] == {**expected[assignment][student], **changes} != expected[assignment][student]
    elsewhere = classroom.expected_at_most(learners, frozenset({"04_triton_flash"}))
    assert elsewhere[learner] == expected[assignment][student]


def test_the_command_line_says_how_to_use_it(capsys):
    """Without N and OUTDIR it prints its usage and exits 2."""
    assert classroom.main([]) == 2
    assert "python -m autograder.building.classroom N OUTDIR" in capsys.readouterr().err


def test_a_class_is_handed_out_longest_first(tmp_path):
    """The grader hands out every graded assignment of the course in LONGEST_FIRST's order (06 first, 01 last),
    learners in order within each, and an assignment it has no rank for after them."""
    assert sorted(grade.LONGEST_FIRST) == build.graded_assignments()
    classroom.build(3, tmp_path)
    jobs, unreadable = grade.find_jobs(tmp_path)
    assert not unreadable
    order = [(assignment, student) for student, assignment, _ in jobs]
    assert order == [(a, f"learner00{i}") for a in grade.LONGEST_FIRST for i in (1, 2, 3)]
    assert grade.longest_first(("learner001", "08_new", tmp_path)) > grade.longest_first(jobs[-1])


def test_a_notebook_without_graded_cells_is_not_handed_out(tmp_path):
    """08 has no graded cell: a submission of it is reported as not graded, and nothing of it is run."""
    ungraded = sorted(set(build.assignments()) - set(build.graded_assignments()))
    assert ungraded == ["08_hopper"]
    folder = tmp_path / "learner001" / ungraded[0]
    folder.mkdir(parents=True)
    (folder / f"{ungraded[0]}.ipynb").write_text((build.RELEASE / ungraded[0] / f"{ungraded[0]}.ipynb").read_text())
    jobs, unreadable = grade.find_jobs(tmp_path)
    assert jobs == [] and [(o.student, o.assignment) for o in unreadable] == [("learner001", ungraded[0])]
    assert "not graded" in unreadable[0].problem and unreadable[0].scores == []


def test_samples_hand_in_the_given_code_of_today():
    """Every sample keeps all of the release's given cells as they are now (a learner edits only the solution
    cells), so the grader is timed and tested on what learners hand in; a cell the release lacks is a learner's own."""
    stale = []
    for assignment, students in classroom.samples().items():
        release = nbformat.read(ROOT / "notebooks" / assignment / f"{assignment}.ipynb", as_version=4)
        given = {c.id: c.source for c in release.cells if c.cell_type == "code"
                 and not (c.metadata.get("nbgrader", {}).get("solution") or c.metadata.get("nbgrader", {}).get("grade"))}
        for student in students:
            path = classroom.SAMPLES / "submitted" / student / assignment / f"{assignment}.ipynb"
            cells = nbformat.read(path, as_version=4).cells
            stale += [f"{student}/{assignment} cell {c.id}" for c in cells
                      if c.cell_type == "code" and c.id in given and c.source != given[c.id]]
            stale += [f"{student}/{assignment} lacks cell {i}" for i in sorted(set(given) - {c.id for c in cells})]
    assert not stale, f"samples whose given cells differ from the release's (copy the release's cells in): {stale}"
