"""Build the course from source/: the learners' release, the executed solutions, the engine.

    python -m autograder build [A ...]    regenerate notebooks/, solutions/ and flashcourse/engine/
    python -m autograder build --check    fail if any of them is out of date with source/
    python -m autograder build --force    also replace release notebooks a learner has edited

source/<assignment>/<assignment>.ipynb is the single hand-written notebook of each assignment:
- notebooks/ is `nbgrader generate_assignment` of it (solutions replaced by stubs, hidden tests removed).
  It is also where a learner works (`make lab` opens it), so the release is generated into a temporary
  folder and copied in file by file, and a file is written only where it changed. A file that differs from
  the one build last wrote there (its sha256 is kept in notebooks/.built-sha256.json) is a learner's work:
  it is never replaced, only reported when the release itself changed, unless --force (install_release);
- solutions/ is it with the solution markers and hidden tests removed, executed, outputs kept. A
  solution is re-executed only when its source changed, so outputs made on a GPU are kept; with
  --no-execute a changed source's text is carried into the executed solution instead (carry_text);
- flashcourse/engine/<name>.py collects the solution cells tagged "export", for later chapters.

One cell of source/ is generated too: the set-up cell every notebook starts with (tagged "setup"). On
Colab it installs the course's package from the one place pyproject.toml names, [project.urls]
Repository, pinned to the tag of the release the notebook belongs to (v<version>); `build` writes it
into source/ (setup_cell_source), and `build --check` fails when a notebook's differs.

The figures the text quotes are generated as well: `build` rewrites each value quoted as
`541<!--fig:name-->` in source/ from the measurement it names (autograder/building/figures.py), before the release
and again after a solution is executed (03 quotes its own measured memory), and `build --check` fails
when a quoted value differs from its source.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import nbformat

from autograder import ROOT
from autograder.building.figures import problems as figure_problems
from autograder.building.figures import write_figures
from autograder.grading.preprocessors import generated_note

SOURCE = ROOT / "source"
RELEASE = ROOT / "notebooks"
BUILT = ".built-sha256.json"    # in RELEASE: the sha256 of each file build last wrote there
SOLUTIONS = ROOT / "solutions"
ENGINE = ROOT / "flashcourse" / "engine"
EXPORT_TAG = "export"
SOLUTION_MARKERS = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$")
HIDDEN_TESTS = re.compile(r"^\s*### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS\s*$\n?", re.S | re.M)
PYPROJECT = ROOT / "pyproject.toml"
SETUP_TAG = "setup"
SETUP_CELL = """\
# Set-up: run this cell first. On Colab it installs the course's package, release {version}, the one this
# notebook belongs to; everywhere it decides between a GPU (compiled Triton kernels) and the CPU
# (Triton's interpreter) and says which.
import sys

if "google.colab" in sys.modules:
    %pip install -q "{requirement}"

from flashcourse import runtime

rt = runtime.setup()"""


def assignments() -> list[str]:
    """Every assignment in source/, in course order."""
    return sorted(p.name for p in SOURCE.iterdir() if p.is_dir() and not p.name.startswith("."))


def source_notebook(assignment: str) -> Path:
    return SOURCE / assignment / f"{assignment}.ipynb"


def engine_module(assignment: str) -> str:
    """01_online_softmax -> online_softmax: the engine module a notebook exports to."""
    return assignment.split("_", 1)[1]


def course_requirement() -> str:
    """What the set-up cell has pip install on Colab: the package from pyproject.toml's [project.urls]
    Repository, at the git tag of its version, e.g. `flashcourse @ git+https://github.com/o/r@v0.1.0`."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    return f"{project['name']} @ git+{project['urls']['Repository'].rstrip('/')}@v{project['version']}"


def setup_cell_source() -> str:
    """The text of every notebook's set-up cell, generated from pyproject.toml."""
    version = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    return SETUP_CELL.format(version=version, requirement=course_requirement())


def setup_cell(nb: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """The notebook's set-up cell: its one code cell tagged "setup"."""
    cells = [c for c in nb.cells if c.cell_type == "code" and SETUP_TAG in c.metadata.get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"{name} has {len(cells)} code cells tagged {SETUP_TAG!r}; it needs one, its set-up cell")
    return cells[0]


def write_setup_cell(assignment: str) -> bool:
    """Give source/<assignment>'s set-up cell the generated text; True when it changed."""
    path = source_notebook(assignment)
    nb = nbformat.read(path, as_version=4)
    cell = setup_cell(nb, f"source/{assignment}")
    if cell.source == setup_cell_source():
        return False
    cell.source = setup_cell_source()
    nbformat.write(nb, path)
    return True


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def nbgrader_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for an nbgrader command, plus `extra`."""
    # nbgrader runs `alembic` by name: put this interpreter's scripts first on PATH.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, **(extra or {})}


def nbgrader(*args: str, db: Path) -> None:
    """Run an nbgrader command from the course root against a gradebook of our choosing."""
    cmd = [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.db_url=sqlite:///{db}", "--log-level=WARN"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=nbgrader_environment())
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed:\n{done.stdout}\n{done.stderr}")


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def built_hashes() -> dict[str, str]:
    """What build last wrote into notebooks/: path relative to it -> sha256 of the bytes written."""
    path = RELEASE / BUILT
    return json.loads(path.read_text())["files"] if path.exists() else {}


def _write_built_hashes(hashes: dict[str, str]) -> None:
    about = ("The sha256 of each file `python -m autograder build` last wrote into notebooks/. A file that "
             "differs from it was edited (a learner's work): build does not replace it unless --force.")
    text = json.dumps({"about": about, "files": dict(sorted(hashes.items()))}, indent=1) + "\n"
    if not (RELEASE / BUILT).exists() or (RELEASE / BUILT).read_text() != text:
        (RELEASE / BUILT).write_text(text)


def install_release(fresh: Path, assignment: str, force: bool = False) -> list[str]:
    """Copy the release generated in fresh/<assignment>/ into notebooks/<assignment>/, keeping a learner's work.

    Each file is written only where it changed: where none is there yet, where the one there is what build
    last wrote (its sha256 in notebooks/.built-sha256.json), or with `force`. A file edited since (or of
    unknown origin) is kept: silently when the release has not changed since build last wrote it (a
    learner's copy of the current release), otherwise with a line saying so and how to proceed, returned in
    the list. Files of notebooks/<assignment>/ that the release does not hold (a learner's own) are left alone.
    """
    hashes, refused = built_hashes(), []
    for new in sorted(p for p in (fresh / assignment).rglob("*") if p.is_file()):
        rel = new.relative_to(fresh).as_posix()
        dest, data = RELEASE / rel, new.read_bytes()
        recorded, wanted = hashes.get(rel), _sha256_bytes(data)
        here = dest.read_bytes() if dest.is_file() else None
        if here is None or here == data or _sha256_bytes(here) == recorded or force:
            if here != data:
                if here is not None and _sha256_bytes(here) != recorded:
                    print(f"build: --force: replaced notebooks/{rel}, which had been edited", flush=True)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
            hashes[rel] = wanted
        elif recorded == wanted:
            print(f"build: kept notebooks/{rel}: it has been edited (a learner's work?) and its release has not "
                  "changed", flush=True)
        else:
            refused.append(
                f"build: did not replace notebooks/{rel}: it differs from the release build last wrote there "
                f"(a learner's work?), and the release generated from source/{assignment} has changed since. "
                f"To keep that work, move it out of the way (e.g. `mv notebooks/{rel} my_{new.name}`) and build "
                f"again, then copy your answers into the new release; to replace it and lose the edits, run "
                f"`python -m autograder build {assignment} --force`.")
            print(refused[-1], flush=True)
    _write_built_hashes(hashes)
    return refused


def release(assignment: str, out: Path, db: Path) -> Path:
    """The learner's notebook, generated by nbgrader into out/<assignment>/."""
    nbgrader("generate_assignment", assignment, "--force", f"--CourseDirectory.release_directory={out}", db=db)
    return out / assignment / f"{assignment}.ipynb"     # stamped as generated by preprocessors.MarkGenerated


def solution_cells(assignment: str) -> nbformat.NotebookNode:
    """The source notebook with solution markers and hidden tests removed (not executed)."""
    nb = nbformat.read(source_notebook(assignment), as_version=4)
    for cell in nb.cells:
        text = HIDDEN_TESTS.sub("", cell.source)
        cell.source = "\n".join(line for line in text.split("\n") if not SOLUTION_MARKERS.match(line)).strip("\n")
    nb.metadata["flashcourse"] = {**generated_note(assignment, "the executed solution"),
                                  "source_sha256": _sha256(source_notebook(assignment))}
    return nb


def execute(nb: nbformat.NotebookNode, cwd: Path, timeout: int = 1800) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel; raises on the first failing cell."""
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def engine_source(assignment: str) -> str:
    """The text of flashcourse/engine/<name>.py: the exported solution cells, markers removed."""
    cells = [c.source for c in solution_cells(assignment).cells
             if c.cell_type == "code" and EXPORT_TAG in c.metadata.get("tags", [])]
    header = (f'"""Generated by `make build` from source/{assignment}/{assignment}.ipynb (cells tagged '
              f'"{EXPORT_TAG}").\n\nDo not edit: change the notebook and rebuild."""\n')
    return header + "".join(f"\n\n{c.strip()}\n" for c in cells) if cells else ""


def _not_executed(assignment: str) -> list[str]:
    """The code cells of the committed solution that --no-execute carried in without running them."""
    path = SOLUTIONS / assignment / f"{assignment}.ipynb"
    meta = nbformat.read(path, as_version=4).metadata.get("flashcourse", {}) if path.exists() else {}
    return meta.get("not_executed", [])


def _solution_is_current(assignment: str) -> bool:
    path = SOLUTIONS / assignment / f"{assignment}.ipynb"
    if not path.exists():
        return False
    meta = nbformat.read(path, as_version=4).metadata.get("flashcourse", {})
    return meta.get("source_sha256") == _sha256(source_notebook(assignment))


def carry_text(assignment: str) -> list[str]:
    """Bring the committed, executed solution up to date with source/ without executing anything.

    Each cell takes the source's new text. A markdown cell, or a code cell whose text did not change,
    keeps its outputs, so outputs made on a GPU survive a change of prose. A code cell whose text
    changed loses its outputs (they were the old text's), a cell new to source/ comes in without
    outputs, a cell gone from it goes. Markdown cells may move; refused (ValueError) when the code cells
    both have were reordered or a cell changed type.
    Code cells whose text changed or that are new are listed under the notebook's metadata
    "not_executed" (ids) until the next execution; they are returned too. The set-up cell is the exception: a set-up cell that becomes the
    generated one keeps its outputs, since only its Colab line differs and that line runs on Colab alone.
    """
    path = SOLUTIONS / assignment / f"{assignment}.ipynb"
    executed = nbformat.read(path, as_version=4)
    fresh = solution_cells(assignment)
    fresh_ids = {c.get("id") for c in fresh.cells}
    kept = {c.get("id"): c for c in executed.cells if c.get("id") in fresh_ids}
    # Prose may move (a question beside its material); code cells run in order, so theirs must stay.
    if [c.get("id") for c in executed.cells if c.get("id") in kept and c.cell_type == "code"] != \
            [c.get("id") for c in fresh.cells if c.get("id") in kept and c.cell_type == "code"] or \
            any(kept[c.get("id")].cell_type != c.cell_type for c in fresh.cells if c.get("id") in kept):
        raise ValueError(f"solutions/{assignment}: code cells were reordered or a cell changed type; "
                         "execute the solution")
    changed = []
    for new in fresh.cells:
        cell = kept.get(new.get("id"))
        if cell is None:  # new in source/: nothing executed yet
            if new.cell_type == "code":
                changed.append(new.get("id"))
            continue
        if cell.source == new.source:
            continue
        if cell.cell_type == "code" and new.source == setup_cell_source() and "runtime.setup()" in cell.source:
            # A set-up cell regenerated: outside Colab it does what it did (runtime.setup()), so its
            # output stands.
            cell.metadata.update(new.metadata)
        elif cell.cell_type == "code":
            cell.outputs = []  # what the old text printed would be shown under the new one
            changed.append(new.get("id"))
        cell.source = new.source
    executed.cells = [kept.get(new.get("id"), new) for new in fresh.cells]
    meta = dict(fresh.metadata["flashcourse"])
    not_executed = sorted({*executed.metadata.get("flashcourse", {}).get("not_executed", []), *changed})
    if not_executed:
        meta["not_executed"] = not_executed
    executed.metadata["flashcourse"] = meta
    nbformat.write(executed, path)
    return changed


def executed_elsewhere(assignment: str, folder: Path) -> nbformat.NotebookNode:
    """The solution of `assignment` as executed on another machine (autograder/building/run_solutions.py):
    refused (ValueError) unless its cells are today's solution cells, so no output stands under other text."""
    path = folder / f"{assignment}.ipynb"
    if not path.exists():
        raise ValueError(f"{path} is missing: run the solution there first")
    executed, fresh = nbformat.read(path, as_version=4), solution_cells(assignment)
    if [(c.get("id"), c.source) for c in executed.cells] != [(c.get("id"), c.source) for c in fresh.cells]:
        raise ValueError(f"{path} was executed from other cells than today's source/{assignment}")
    executed.metadata["flashcourse"] = fresh.metadata["flashcourse"]
    return executed


def solutions_to_run(only: list[str] | None, folder: Path) -> list[str]:
    """Write the unexecuted solution of every assignment whose executed solution is out of date, or has
    cells carried in without running (--no-execute), into `folder`, to be run elsewhere; the assignments
    written."""
    folder.mkdir(parents=True, exist_ok=True)
    stale = [a for a in only or assignments() if not _solution_is_current(a) or _not_executed(a)]
    for assignment in stale:
        nbformat.write(solution_cells(assignment), folder / f"{assignment}.ipynb")
    return stale


def build(only: list[str] | None = None, execute_solutions: bool = True, force: bool = False,
          executed_from: Path | None = None) -> list[str]:
    """Regenerate everything generated from source/ (or from the assignments named in `only`). With
    `executed_from`, a solution out of date is taken from that folder, executed elsewhere, not run here.

    Returns a line for each release notebook kept because a learner edited it and the release changed
    (install_release); everything else is built all the same."""
    refused = []
    with tempfile.TemporaryDirectory() as tmp:
        for assignment in only or assignments():
            print(f"build: {assignment}", flush=True)
            if write_setup_cell(assignment):
                print(f"build: wrote the set-up cell generated from pyproject.toml into source/{assignment}", flush=True)
            if write_figures(source_notebook(assignment)):
                print(f"build: wrote the quoted figures of source/{assignment} from their results", flush=True)
            fresh = Path(tmp) / "release"
            release(assignment, fresh, Path(tmp) / "gradebook.db")
            kept = install_release(fresh, assignment, force)
            text = engine_source(assignment)
            module = ENGINE / f"{engine_module(assignment)}.py"
            if text and (not module.exists() or module.read_text() != text):
                module.write_text(text)
            if _solution_is_current(assignment) and not (executed_from and _not_executed(assignment)):
                refused += kept
                continue
            out = SOLUTIONS / assignment
            if execute_solutions:
                out.mkdir(parents=True, exist_ok=True)
                if executed_from:
                    print(f"build: taking the solution of {assignment} executed elsewhere", flush=True)
                    executed = executed_elsewhere(assignment, executed_from)
                else:
                    print(f"build: executing the solution of {assignment}", flush=True)
                    executed = execute(solution_cells(assignment), out)
                nbformat.write(executed, out / f"{assignment}.ipynb")
                if write_figures(source_notebook(assignment)):
                    # Figures the solution has just measured: only markdown changed, so its outputs stand.
                    release(assignment, fresh, Path(tmp) / "gradebook.db")
                    kept = install_release(fresh, assignment, force)
                    carry_text(assignment)
                    print(f"build: rewrote the figures {assignment} measures into its text", flush=True)
            elif (out / f"{assignment}.ipynb").exists():
                changed = carry_text(assignment)
                print(f"build: carried the new text into the executed solution of {assignment}, outputs kept"
                      + (f"; code cells not re-executed: {', '.join(changed)}" if changed else ""), flush=True)
            refused += kept
    return refused


def drift(only: list[str] | None = None) -> list[str]:
    """What is out of date with source/: empty when the committed build is current."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for assignment in only or assignments():
            if setup_cell(nbformat.read(source_notebook(assignment), as_version=4),
                          f"source/{assignment}").source != setup_cell_source():
                problems.append(f"source/{assignment}: the set-up cell differs from the one generated from "
                                "pyproject.toml ([project.urls] Repository, version)")
            problems += figure_problems(source_notebook(assignment), f"source/{assignment}")
            fresh = release(assignment, Path(tmp) / "release", Path(tmp) / "gradebook.db")
            committed = RELEASE / assignment / fresh.name
            if not committed.exists() or committed.read_text() != fresh.read_text():
                diff = difflib.unified_diff(committed.read_text().splitlines() if committed.exists() else [],
                                            fresh.read_text().splitlines(), lineterm="", n=1)
                problems.append(f"notebooks/{assignment} differs from a fresh release:\n" + "\n".join(list(diff)[:40]))
            hashes = built_hashes()
            for new in sorted(p for p in fresh.parent.rglob("*") if p.is_file()):
                rel = new.relative_to(fresh.parent.parent).as_posix()
                if hashes.get(rel) != _sha256_bytes(new.read_bytes()):
                    problems.append(f"notebooks/{BUILT} does not record the sha256 of a fresh release of {rel}")
            text = engine_source(assignment)
            module = ENGINE / f"{engine_module(assignment)}.py"
            if text and (not module.exists() or module.read_text() != text):
                problems.append(f"flashcourse/engine/{module.name} differs from the export of {assignment}")
            if not _solution_is_current(assignment):
                problems.append(f"solutions/{assignment} was not executed from the current source")
    return problems


def main(only: list[str], check: bool = False, execute_solutions: bool = True, force: bool = False,
         executed_from: Path | None = None, solutions_to_run_in: Path | None = None) -> int:
    unknown = sorted(set(only) - set(assignments()))
    if unknown:
        print(f"build: no such assignment in source/: {', '.join(unknown)}")
        return 2
    if check:
        problems = drift(only)
        print("\n\n".join(problems) if problems else "build: notebooks/, solutions/ and the engine are current")
        return 1 if problems else 0
    if solutions_to_run_in:
        stale = solutions_to_run(only, solutions_to_run_in)
        print(f"build: {len(stale)} solutions to run elsewhere in {solutions_to_run_in}: {', '.join(stale) or 'none'}")
        return 0
    refused = build(only, execute_solutions, force, executed_from)
    if refused:
        print("\n" + "\n".join(refused), file=sys.stderr)
        return 1
    return 0
