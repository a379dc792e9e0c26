"""Colab: every notebook's set-up cell installs the course from the one place pyproject.toml names,
and a notebook run the way Colab runs it (a fresh environment without the package, the set-up cell
installing it) passes its visible tests."""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import nbformat
import pytest
from packaging.requirements import Requirement

from autograder.building import build
from conftest import ROOT

ASSIGNMENTS = build.assignments()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _notebooks(assignment):
    """The set-up cell's three homes: source/, the release and the executed solution."""
    name = f"{assignment}.ipynb"
    return {"source": build.source_notebook(assignment), "notebooks": build.RELEASE / assignment / name,
            "solutions": build.SOLUTIONS / assignment / name}


def test_setup_cell_installs_the_release_from_the_repository():
    """The set-up cell pip-installs [project.urls] Repository at the tag of pyproject's version, on Colab only, or the
    release's wheel where one was uploaded beside the notebook."""
    repository = PROJECT["urls"]["Repository"]
    assert re.fullmatch(r"https://\S+", repository), f"[project.urls] Repository is not an https URL: {repository!r}"
    requirement = f"{PROJECT['name']} @ git+{repository.rstrip('/')}@v{PROJECT['version']}"
    assert build.course_requirement() == requirement
    cell = build.setup_cell_source()
    assert f'    course = wheels[-1] if wheels else "{requirement}"' in cell.splitlines()
    assert f'    wheels = sorted(glob.glob("flashcourse-{PROJECT["version"]}-*.whl"))' in cell.splitlines()
    assert '    %pip install -q "$course"' in cell.splitlines()
    assert cell.index('if "google.colab" in sys.modules:') < cell.index("%pip") < cell.index("runtime.setup()")


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_setup_cells_are_generated_not_copied(assignment):
    """source/, notebooks/ and solutions/ hold the set-up cell generated from pyproject.toml, word for word."""
    for where, path in _notebooks(assignment).items():
        cell = build.setup_cell(nbformat.read(path, as_version=4), f"{where}/{assignment}")
        assert cell.source == build.setup_cell_source(), (
            f"{where}/{assignment}: the set-up cell differs from the one generated from pyproject.toml; "
            "run `python -m autograder build` (04 and 05: `build A --no-execute`) and commit")


def test_a_fork_changes_one_place(tmp_path, monkeypatch):
    """Another repository URL or version in pyproject.toml reaches the set-up cell of source/ at the next build."""
    assignment = ASSIGNMENTS[0]
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text((ROOT / "pyproject.toml").read_text()
                         .replace(PROJECT["urls"]["Repository"], "https://example.org/a-fork/course")
                         .replace(f'version = "{PROJECT["version"]}"', 'version = "2.1.0"'))
    shutil.copytree(build.source_notebook(assignment).parent, tmp_path / "source" / assignment)
    monkeypatch.setattr(build, "PYPROJECT", pyproject)
    monkeypatch.setattr(build, "SOURCE", tmp_path / "source")
    assert build.course_requirement() == "flashcourse @ git+https://example.org/a-fork/course@v2.1.0"
    assert build.write_setup_cell(assignment) and not build.write_setup_cell(assignment)
    cell = build.setup_cell(nbformat.read(build.source_notebook(assignment), as_version=4), assignment)
    assert cell.source == build.setup_cell_source()
    assert 'else "flashcourse @ git+https://example.org/a-fork/course@v2.1.0"' in cell.source
    assert 'glob.glob("flashcourse-2.1.0-*.whl")' in cell.source


def test_a_regenerated_setup_cell_keeps_its_outputs(tmp_path, monkeypatch):
    """build --no-execute carries a regenerated set-up cell into an executed solution with its outputs (made
    on a GPU, say): outside Colab the cell runs as before. Any other change to it drops them: it needs executing."""
    assignment = ASSIGNMENTS[0]
    shutil.copytree(build.source_notebook(assignment).parent, tmp_path / "source" / assignment)
    monkeypatch.setattr(build, "SOURCE", tmp_path / "source")
    monkeypatch.setattr(build, "SOLUTIONS", tmp_path / "solutions")
    executed = build.solution_cells(assignment)
    setup = build.setup_cell(executed, assignment)
    setup.source = setup.source.replace(build.course_requirement(), "flashcourse @ git+https://example.org/old")
    setup.outputs = [nbformat.v4.new_output("stream", name="stdout", text="flashcourse: GPU NVIDIA H200\n")]
    solution = tmp_path / "solutions" / assignment / f"{assignment}.ipynb"
    solution.parent.mkdir(parents=True)
    nbformat.write(executed, solution)

    assert build.carry_text(assignment) == []
    after = build.setup_cell(nbformat.read(solution, as_version=4), assignment)
    assert after.source == build.setup_cell_source() and after.outputs == setup.outputs
    assert "not_executed" not in nbformat.read(solution, as_version=4).metadata["flashcourse"]

    nb = nbformat.read(build.source_notebook(assignment), as_version=4)
    build.setup_cell(nb, assignment).source += "\nprint(rt)"
    nbformat.write(nb, build.source_notebook(assignment))
    setup_id = build.setup_cell(nb, assignment).id
    assert build.carry_text(assignment) == [setup_id]
    assert build.setup_cell(nbformat.read(solution, as_version=4), assignment).outputs == []


def _reads_beside_the_package(code: str) -> bool:
    return re.search(r"[\"']solutions\b|__file__\)(\.resolve\(\))?\.parent\.parent", code) is not None


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_notebooks_read_nothing_beside_the_installed_package(assignment):
    """A pip-installed flashcourse has no solutions/ beside it: notebooks read package data (bench.measured)."""
    nb = nbformat.read(build.source_notebook(assignment), as_version=4)
    readers = [c.id for c in nb.cells if c.cell_type == "code" and _reads_beside_the_package(c.source)]
    assert not readers, f"{assignment}: cells {readers} read files beside the package, which Colab does not have"


def test_measured_results_are_found_or_said_missing(capsys):
    """bench.measured: the path of what the package ships; None and a line that says so for what it lacks."""
    from flashcourse import bench

    for name in ("fast.json", "fast.png"):
        assert bench.measured(name) == bench.MEASURED / name
    assert "steps" in json.loads(bench.measured("fast.json").read_text())
    assert bench.measured("nothing.json") is None
    assert "nothing.json is not installed" in capsys.readouterr().out


# --- Colab, simulated -------------------------------------------------------------------------------
#
# Colab's runtime has torch, triton, matplotlib, ipywidgets, nbclient and IPython's kernel installed,
# imports google.colab when its kernel starts, and runs notebooks in /content. The simulation builds a
# fresh virtual environment without flashcourse whose only other packages are those (flashcourse's
# dependencies and the kernel's, with everything they need, taken from this environment's site-packages:
# no network), a google.colab stand-in imported at the kernel's start, and a wheel of flashcourse built
# from this checkout. The notebook's set-up cell, unchanged but for the requirement it installs (the
# wheel instead of the git tag), installs the package with pip; then every cell must run.


def _closure(names):
    """The installed distributions `names` need, recursively (extras and other platforms' markers left out)."""
    seen, todo = {}, list(names)
    while todo:
        name = metadata.distribution(todo.pop()).metadata["Name"]
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        dist = seen[key] = metadata.distribution(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                try:
                    metadata.distribution(req.name)
                except metadata.PackageNotFoundError:
                    continue
                todo.append(req.name)
    return seen.values()


def _preinstalled(folder: Path) -> Path:
    """A folder of links to the files of flashcourse's dependencies and IPython's kernel: what Colab has."""
    roots = [Requirement(r).name for r in PROJECT["dependencies"]] + ["ipykernel"]
    folder.mkdir()
    for dist in _closure(roots):
        site = Path(dist.locate_file(""))
        for top in {file.parts[0] for file in dist.files or []}:
            if top != ".." and not top.endswith(".pth") and (site / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(site / top)
    assert not list(folder.glob("flashcourse*")), "flashcourse is no dependency of itself"
    return folder


def _wheel(out: Path) -> Path:
    """flashcourse as pip would build it from the repository at the release's tag: from this checkout."""
    tree = out / "checkout"
    shutil.copytree(ROOT / "flashcourse", tree / "flashcourse", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--wheel-dir", str(out / "dist"), str(tree)], check=True, cwd=out)
    (wheel,) = (out / "dist").glob("flashcourse-*.whl")
    return wheel


@pytest.fixture(scope="module")
def colab_parts(tmp_path_factory):
    """What every simulated Colab session shares: the preinstalled packages and the course's wheel."""
    out = tmp_path_factory.mktemp("colab")
    return _preinstalled(out / "preinstalled"), _wheel(out)


def _colab_runtime(root: Path, preinstalled: Path) -> dict:
    """A fresh virtual environment as Colab's runtime: returns the kernel's environment variables."""
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    # venv's own setuptools (Python 3.11 adds an old one) would hide the preinstalled one torch needs.
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", "setuptools"], check=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "colab_preinstalled.pth").write_text(f"{preinstalled}\n")
    colab = site / "google" / "colab"          # a namespace package `google`, as Colab's
    colab.mkdir(parents=True)
    (colab / "__init__.py").write_text('"""A stand-in for Colab\'s google.colab."""\n')
    (colab / "output.py").write_text("enabled = []\n\n\ndef enable_custom_widget_manager():\n    enabled.append(True)\n")
    startup = root / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-colab.py").write_text("import google.colab  # Colab's kernel imports it as it starts\n")
    kernels = root / "jupyter" / "kernels" / "colab"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Colab, simulated", "language": "python"}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MPLBACKEND")}
    env.update(IPYTHONDIR=str(root / "ipython"), COLAB_RELEASE_TAG="simulated", PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    absent = subprocess.run([str(python), "-c", "import flashcourse"], cwd=root, env=env, capture_output=True)
    assert absent.returncode != 0, "the fresh environment already has flashcourse: the simulation proves nothing"
    return env


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_a_notebook_runs_on_colab(assignment, colab_parts, tmp_path, monkeypatch):
    """On a fresh Colab-like runtime the set-up cell installs the course (pip, from a local build of the
    package) and the notebook's solution runs top to bottom: every visible test passes."""
    from nbclient import NotebookClient

    preinstalled, wheel = colab_parts
    env = _colab_runtime(tmp_path, preinstalled)
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join([str(tmp_path / "jupyter"), os.environ.get("JUPYTER_PATH", "")]))
    nb = nbformat.read(build.SOLUTIONS / assignment / f"{assignment}.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    setup = build.setup_cell(nb, f"solutions/{assignment}")
    assert setup.source == build.setup_cell_source()
    assert setup.source.count(build.course_requirement()) == 1
    setup.source = setup.source.replace(build.course_requirement(), str(wheel))   # the tag's build, made here
    nb.cells.append(nbformat.v4.new_code_cell(
        "import json, flashcourse, google.colab.output\n"
        "from flashcourse import bench\n"
        "print(json.dumps({'file': flashcourse.__file__, 'colab': rt.colab,\n"
        "                  'widget_manager': google.colab.output.enabled,\n"
        "                  'measured': [str(bench.measured(n)) for n in ('fast.json', 'fast.png')]}))"))
    content = tmp_path / "content"
    content.mkdir()
    NotebookClient(nb, timeout=600, kernel_name="colab", resources={"metadata": {"path": str(content)}}).execute(env=env)

    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("name") == "stdout")
    report = json.loads(printed.strip().splitlines()[-1])   # the stream may arrive in several messages
    installed = (tmp_path / "venv" / "lib").resolve()
    assert Path(report["file"]).resolve().is_relative_to(installed), f"flashcourse imported from {report['file']}"
    assert report["colab"] and report["widget_manager"] == [True], "runtime.setup() did not see Colab"
    assert all(Path(p).is_file() and Path(p).resolve().is_relative_to(installed) for p in report["measured"]), \
        f"the installed package lacks its measurements (package data): {report['measured']}"


def _setup_on_colab(tmp_path, monkeypatch, colab_parts, upload: bool) -> nbformat.NotebookNode:
    """The set-up cell run on a simulated Colab whose repository cannot be reached (an install that fails), with
    the course's wheel uploaded beside the notebook or not; then a cell that says where flashcourse came from."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    preinstalled, wheel = colab_parts
    env = _colab_runtime(tmp_path, preinstalled)
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join([str(tmp_path / "jupyter"), os.environ.get("JUPYTER_PATH", "")]))
    content = tmp_path / "content"
    content.mkdir()
    if upload:
        shutil.copy(wheel, content / wheel.name)
    unreachable = f"flashcourse @ file://{tmp_path}/no-such-repository"
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(build.setup_cell_source().replace(build.course_requirement(), unreachable)),
        nbformat.v4.new_code_cell("import flashcourse\nprint(flashcourse.__file__)")])
    try:
        NotebookClient(nb, timeout=600, kernel_name="colab", resources={"metadata": {"path": str(content)}}).execute(env=env)
    except CellExecutionError:
        pass  # the cells' outputs say what happened
    return nb


@pytest.mark.slow
def test_colab_installs_an_uploaded_wheel_when_the_repository_cannot_be_reached(colab_parts, tmp_path, monkeypatch):
    """With the release's wheel uploaded beside the notebook, the set-up cell installs it, and the repository is
    never needed: the package is imported from the runtime's own site-packages."""
    nb = _setup_on_colab(tmp_path, monkeypatch, colab_parts, upload=True)
    printed = nb.cells[-1].outputs[-1]["text"].strip()
    assert Path(printed).resolve().is_relative_to((tmp_path / "venv" / "lib").resolve()), printed


@pytest.mark.slow
def test_colab_says_what_to_do_when_nothing_installs(colab_parts, tmp_path, monkeypatch):
    """With no wheel and no repository, the set-up cell stops with a message that says how to go on (upload the
    release's wheel), not with a bare ModuleNotFoundError."""
    nb = _setup_on_colab(tmp_path, monkeypatch, colab_parts, upload=False)
    error = next(o for o in nb.cells[0].outputs if o["output_type"] == "error")
    version = PROJECT["version"]
    assert error["ename"] == "ModuleNotFoundError" and f"flashcourse-{version}-py3-none-any.whl" in error["evalue"]
    assert "make wheel" in error["evalue"]
