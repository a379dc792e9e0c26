"""The build: source/ is clean, and notebooks/, solutions/ and the engine are current with it."""

import re

import nbformat
import pytest

from autograder.building import build

ASSIGNMENTS = build.assignments()
SETUP_MARKERS = ('if "google.colab" in sys.modules:', "%pip install", "from flashcourse import runtime",
                 "runtime.setup()")


def _source(assignment):
    return nbformat.read(build.source_notebook(assignment), as_version=4)


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_source_notebooks_carry_no_outputs(assignment):
    """Notebooks in source/ are stored without outputs or execution counts."""
    for i, cell in enumerate(_source(assignment).cells):
        if cell.cell_type == "code":
            assert not cell.outputs, f"{assignment} cell {i} has outputs: clear them before committing"
            assert cell.execution_count is None, f"{assignment} cell {i} has an execution count"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_every_notebook_starts_with_the_runtime_setup(assignment):
    """The first code cell installs the package on Colab and calls runtime.setup()."""
    first = next(c for c in _source(assignment).cells if c.cell_type == "code")
    for marker in SETUP_MARKERS:
        assert marker in first.source, f"{assignment}: the set-up cell lacks {marker!r}"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_test_cells_are_thin_and_documented(assignment):
    """Every autograded test cell starts with a one-line docstring and keeps a visible assertion."""
    for cell in _source(assignment).cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade"):
            first_line = cell.source.split("\n", 1)[0]
            visible = build.HIDDEN_TESTS.sub("", cell.source)
            assert first_line.startswith('"""') and first_line.endswith('"""') and len(first_line) > 6, \
                f"{assignment}/{meta['grade_id']}: first line must be a one-line docstring"
            assert "assert " in visible, f"{assignment}/{meta['grade_id']}: keep at least one visible assertion"


@pytest.mark.slow
def test_committed_build_is_current():
    """notebooks/ equals a fresh release, the engine equals the export, solutions match their source."""
    problems = build.drift()
    assert not problems, "\n\n".join(problems) + "\n\nRun `make build` and commit the result."


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_hides_solutions_and_hidden_tests(assignment):
    """The learner's notebook has stubs that raise NotImplementedError (where source/ has exercises; 08 has none)
    and no hidden test."""
    text = (build.RELEASE / assignment / f"{assignment}.ipynb").read_text()
    exercises = any(c.cell_type == "code" and build.SOLUTION_MARKERS.match(line)
                    for c in _source(assignment).cells for line in c.source.splitlines())
    assert ("raise NotImplementedError()" in text) == exercises
    assert exercises == (assignment in build.graded_assignments())
    for leak in ("BEGIN SOLUTION", "HIDDEN TESTS", "autograder.hidden", "Rubric"):
        assert leak not in text, f"notebooks/{assignment} leaks {leak!r}"


def _bound_names(code: str) -> set[str]:
    """Names a cell binds at its top level (imports, assignments, definitions)."""
    import symtable

    return {s.get_name() for s in symtable.symtable(code, "<cell>", "exec").get_symbols()
            if s.is_assigned() or s.is_imported()}


def _free_names(code: str) -> set[str]:
    """Names a cell reads but never binds itself (imports, assignments, definitions), nested scopes included."""
    import builtins
    import symtable

    top = symtable.symtable(code, "<cell>", "exec")
    free, tables = set(), [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table is top or symbol.is_global()) and \
                    not symbol.is_assigned() and not symbol.is_imported():
                free.add(symbol.get_name())
    return free - _bound_names(code) - set(dir(builtins))


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_test_cells_are_self_contained(assignment):
    """A test cell uses only its own imports and the graded functions: the grader reruns it on its own."""
    from autograder.grading.preprocessors import graded_names, is_test_cell

    source = _source(assignment)
    graded = set(graded_names(source))
    for cell in source.cells:
        meta = cell.metadata.get("nbgrader", {})
        if is_test_cell(cell):
            free = _free_names(cell.source) - graded
            assert not free, (f"{assignment}/{meta['grade_id']} uses {sorted(free)} from earlier cells: "
                              "import or define them in the test cell itself")


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_demo_cells_define_nothing_later_cells_use(assignment):
    """Grading leaves out the cells tagged demo: no later cell may read a name that a demo cell bound last."""
    from IPython.core.inputtransformer2 import TransformerManager

    from autograder.grading.execute import DEMO

    as_python = TransformerManager().transform_cell    # %pip and friends become plain calls
    from_demo: dict[str, str] = {}   # name -> id of the demo cell that bound it last
    for cell in _source(assignment).cells:
        if cell.cell_type != "code":
            continue
        if DEMO in cell.metadata.get("tags", []):
            from_demo.update(dict.fromkeys(_bound_names(as_python(cell.source)), cell.get("id")))
            continue
        code = as_python(cell.source)
        used = {name: from_demo[name] for name in _free_names(code) if name in from_demo}
        assert not used, (f"{assignment} cell {cell.get('id')} reads {used} (name: demo cell), which grading "
                          "does not run: bind them in a cell that is not tagged demo")
        for name in _bound_names(code):
            from_demo.pop(name, None)



def _executed_solution(assignment, tmp_path, monkeypatch):
    """A copy of source/<assignment> and an "executed" solution of it under tmp_path, one of whose code cells
    carries an output standing for one made on a GPU: (the solution, that cell's index, the solution's path)."""
    import shutil

    shutil.copytree(build.source_notebook(assignment).parent, tmp_path / "source" / assignment)
    monkeypatch.setattr(build, "SOURCE", tmp_path / "source")
    monkeypatch.setattr(build, "SOLUTIONS", tmp_path / "solutions")
    executed = build.solution_cells(assignment)
    shown = next(i for i, c in enumerate(executed.cells) if c.cell_type == "code" and "grade" not in
                 c.metadata.get("nbgrader", {}))
    executed.cells[shown].outputs = [nbformat.v4.new_output("stream", name="stdout", text="made on a GPU\n")]
    solution = tmp_path / "solutions" / assignment / f"{assignment}.ipynb"
    solution.parent.mkdir(parents=True)
    nbformat.write(executed, solution)
    return executed, shown, solution


def test_carry_text_keeps_outputs_and_drops_a_changed_cells_outputs(tmp_path, monkeypatch):
    """--no-execute: new prose and test-cell text reach the executed solution, its outputs stay, and the
    solution counts as current; a changed code cell loses its outputs and is listed as not executed."""
    assignment = "01_online_softmax"
    executed, shown, solution = _executed_solution(assignment, tmp_path, monkeypatch)

    nb = _source(assignment)
    prose = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown")
    test = next(i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade")
                and c.cell_type == "code")
    nb.cells[prose].source += "\n\nA new sentence."
    nb.cells[test].source += "\nassert True"
    nbformat.write(nb, build.source_notebook(assignment))
    assert not build._solution_is_current(assignment)

    assert build.carry_text(assignment) == [nb.cells[test].id]
    after = nbformat.read(solution, as_version=4)
    assert build._solution_is_current(assignment)
    assert after.cells[prose].source.endswith("A new sentence.")
    assert after.cells[test].source.endswith("assert True")
    assert after.cells[shown].outputs == executed.cells[shown].outputs
    assert after.metadata["flashcourse"]["not_executed"] == [nb.cells[test].id]

    nb.cells[shown].source += "\nx = 1"
    nbformat.write(nb, build.source_notebook(assignment))
    assert build.carry_text(assignment) == [nb.cells[shown].id]
    after = nbformat.read(solution, as_version=4)
    assert executed.cells[shown].outputs and after.cells[shown].outputs == []
    assert after.metadata["flashcourse"]["not_executed"] == sorted([nb.cells[test].id, nb.cells[shown].id])


def test_carry_text_takes_new_cells_without_outputs(tmp_path, monkeypatch):
    """--no-execute: a cell added to source/ comes into the executed solution without outputs and is listed as
    not executed; a removed cell goes; the outputs of the cells both have stay."""
    assignment = "01_online_softmax"
    executed, shown, solution = _executed_solution(assignment, tmp_path, monkeypatch)

    nb = _source(assignment)
    added = nbformat.v4.new_code_cell("print('new')")
    removed = next(c.id for c in nb.cells[shown + 1:] if c.cell_type == "markdown")
    nb.cells = [c for c in nb.cells if c.id != removed]
    nb.cells.insert(shown + 1, added)
    nbformat.write(nb, build.source_notebook(assignment))

    assert build.carry_text(assignment) == [added.id]
    after = nbformat.read(solution, as_version=4)
    assert [c.id for c in after.cells] == [c.id for c in nb.cells]
    assert after.cells[shown].outputs == executed.cells[shown].outputs
    assert after.cells[shown + 1].outputs == [] and after.metadata["flashcourse"]["not_executed"] == [added.id]
    assert build._solution_is_current(assignment)

    nb.cells[shown], nb.cells[shown + 1] = nb.cells[shown + 1], nb.cells[shown]
    nbformat.write(nb, build.source_notebook(assignment))
    with pytest.raises(ValueError, match="reordered"):
        build.carry_text(assignment)


def test_build_keeps_a_learners_edited_release(tmp_path, monkeypatch, capsys):
    """A release notebook a learner edited survives `build`: kept while its release is unchanged, refused by name
    when the release changed (main exits 1 saying how to proceed), replaced only with --force; a learner's own
    file beside it stays, and an untouched release notebook is replaced as before."""
    import shutil

    assignment = "01_online_softmax"
    name = f"{assignment}/{assignment}.ipynb"
    for folder in (build.RELEASE, build.SOLUTIONS):
        shutil.copytree(folder / assignment, tmp_path / folder.name / assignment)
    shutil.copy(build.RELEASE / build.BUILT, tmp_path / "notebooks" / build.BUILT)
    shutil.copytree(build.ENGINE, tmp_path / "engine")
    monkeypatch.setattr(build, "RELEASE", tmp_path / "notebooks")
    monkeypatch.setattr(build, "SOLUTIONS", tmp_path / "solutions")
    monkeypatch.setattr(build, "ENGINE", tmp_path / "engine")
    notebook = tmp_path / "notebooks" / name
    own = notebook.parent / "my_scratch.ipynb"
    own.write_text("{}")

    nb = nbformat.read(notebook, as_version=4)
    stub = next(c for c in nb.cells if c.cell_type == "code" and "def tile_update" in c.source)
    stub.source = stub.source.replace("raise NotImplementedError()", "return m, l, a  # the learner's work")
    nbformat.write(nb, notebook)
    edited = notebook.read_bytes()

    assert build.build([assignment], execute_solutions=False) == []   # what `make build` does: the release is current
    assert notebook.read_bytes() == edited
    assert f"kept notebooks/{name}" in capsys.readouterr().out

    real_release = build.release

    def changed_release(assignment, out, db, paragraph="A paragraph new in source/."):
        path = real_release(assignment, out, db)
        fresh = nbformat.read(path, as_version=4)
        fresh.cells.append(nbformat.v4.new_markdown_cell(paragraph))
        nbformat.write(fresh, path)
        return path

    monkeypatch.setattr(build, "release", changed_release)
    assert build.main([assignment], execute_solutions=False) == 1
    message = capsys.readouterr().err
    assert f"did not replace notebooks/{name}" in message and "--force" in message and "mv notebooks/" in message
    assert notebook.read_bytes() == edited

    assert build.build([assignment], execute_solutions=False, force=True) == []
    replaced = notebook.read_text()
    assert "A paragraph new in source/." in replaced and "the learner's work" not in replaced
    assert own.read_text() == "{}"
    assert build.built_hashes()[name] == build._sha256_bytes(notebook.read_bytes())

    monkeypatch.setattr(build, "release", lambda *a: changed_release(*a, paragraph="Another new paragraph."))
    assert build.build([assignment], execute_solutions=False) == []   # untouched since written: replaced
    assert "Another new paragraph." in notebook.read_text()


def test_demo_and_lab_write_no_release():
    """`make demo` and `make lab` never regenerate notebooks/: the demo grades against a release the grader
    generates from source/ in a folder of its own, and the lab only opens notebooks/."""
    import subprocess

    plan = subprocess.run(["make", "-n", "demo", "lab"], cwd=build.ROOT, capture_output=True, text=True,
                          check=True).stdout
    assert "-m autograder demo" in plan and re.search(r"jupyter lab (--allow-root )?notebooks/", plan)
    assert "autograder build" not in plan and "generate_assignment" not in plan


def test_solutions_executed_elsewhere_come_back_only_as_todays_cells(tmp_path, monkeypatch):
    """--solutions-to-run writes the out-of-date solutions unexecuted; run_solutions executes them; --executed-from
    takes them back only when their cells are today's solution cells."""
    from autograder.building import run_solutions

    assignment = "01_online_softmax"
    executed, shown, solution = _executed_solution(assignment, tmp_path, monkeypatch)
    assert build.solutions_to_run([assignment], tmp_path / "none") == []  # current: nothing to run

    nb = _source(assignment)
    nb.cells[shown].source += "\nx = 1"
    nbformat.write(nb, build.source_notebook(assignment))
    assert build.solutions_to_run([assignment], tmp_path / "torun") == [assignment]
    there = nbformat.read(tmp_path / "torun" / f"{assignment}.ipynb", as_version=4)
    assert there.cells[shown].source.endswith("x = 1") and not there.cells[shown].outputs

    there.cells[shown].outputs = [nbformat.v4.new_output("stream", name="stdout", text="made there\n")]
    nbformat.write(there, tmp_path / "torun" / f"{assignment}.ipynb")
    back = build.executed_elsewhere(assignment, tmp_path / "torun")
    assert back.cells[shown].outputs[0].text == "made there\n"
    assert back.metadata["flashcourse"]["source_sha256"] == build.solution_cells(assignment).metadata["flashcourse"]["source_sha256"]

    there.cells[shown].source += "\ny = 2"
    nbformat.write(there, tmp_path / "torun" / f"{assignment}.ipynb")
    with pytest.raises(ValueError, match="other cells"):
        build.executed_elsewhere(assignment, tmp_path / "torun")

    tiny = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import os; print(os.path.basename(os.getcwd()))")])
    (tmp_path / "small").mkdir()
    nbformat.write(tiny, tmp_path / "small" / "tiny.ipynb")
    assert run_solutions.run(tmp_path / "small", tmp_path / "ran", solutions=tmp_path / "sol") == 0
    ran = nbformat.read(tmp_path / "ran" / "tiny.ipynb", as_version=4)
    assert ran.cells[0].outputs[0].text == "tiny\n"  # run in solutions/<its name>/, as build runs it


def test_carry_text_lets_prose_move_but_not_code(tmp_path, monkeypatch):
    """--no-execute: a markdown cell moved elsewhere (a question beside its material) is carried with every output
    kept; code cells moved are refused, since their outputs depend on the order they ran in."""
    assignment = "01_online_softmax"
    executed, shown, solution = _executed_solution(assignment, tmp_path, monkeypatch)
    nb = _source(assignment)
    prose = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and i > shown)
    nb.cells.insert(1, nb.cells.pop(prose))
    nbformat.write(nb, build.source_notebook(assignment))
    assert build.carry_text(assignment) == []
    after = nbformat.read(solution, as_version=4)
    assert [c.id for c in after.cells] == [c.id for c in nb.cells]
    assert next(c for c in after.cells if c.id == executed.cells[shown].id).outputs == executed.cells[shown].outputs


def test_engine_is_one_module_per_kernel_family():
    """05's cells tagged "export:<module>" make three modules, each saying where it came from; a cell tagged for
    several (the kernels' imports) opens each; what a module uses of another is imported from it by name."""
    sources = build.engine_sources("05_fast_kernel")
    assert set(sources) == {"fast_attention", "decode", "fast_lse"}
    for module, text in sources.items():
        assert text.startswith('"""Generated by `make build` from source/05_fast_kernel/05_fast_kernel.ipynb '
                               f'(cells tagged "export:{module}")')
        assert "runtime.setup(quiet=True)" in text and "import triton.language as tl" in text
    assert "from flashcourse.engine.fast_attention import LOG2E\n" in sources["decode"]
    assert ("from flashcourse.engine.fast_attention import LOG2E, TensorDescriptor, _attend_tile, _fit_descriptors, "
            "tma_supported\n") in sources["fast_lse"]
    assert "from flashcourse.engine" not in sources["fast_attention"]
    assert set(build.engine_sources("08_hopper")) == {"hopper", "longest_first", "fp8", "any_input",
                                                      "hopper_backward"}   # plain "export": 08's own
    assert build.exported_modules()["hopper"] == "08_hopper"


def _notebook_with(tmp_path, monkeypatch, *cells):
    """A one-notebook source/ under tmp_path holding these code cells (source, tags), and an empty engine."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(text, metadata={"tags": tags}) for text, tags in cells])
    path = tmp_path / "source" / "09_family" / "09_family.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)
    (tmp_path / "engine").mkdir()
    monkeypatch.setattr(build, "SOURCE", tmp_path / "source")
    monkeypatch.setattr(build, "ENGINE", tmp_path / "engine")


def test_a_module_reading_a_name_no_module_binds_is_refused(tmp_path, monkeypatch):
    """A family module that reads a name bound by no exported cell (or by two modules) would fail when imported:
    the build refuses it and says what to do."""
    _notebook_with(tmp_path, monkeypatch, ("X = 1", ["export"]), ("Y = X + Z", ["export:other"]))
    with pytest.raises(ValueError, match="reads 'Z', and no exported cell of it binds it"):
        build.engine_sources("09_family")
    _notebook_with(tmp_path / "two", monkeypatch, ("X = 1", ["export"]), ("X = 2", ["export:b"]), ("Y = X", ["export:c"]))
    with pytest.raises(ValueError, match="reads 'X', and modules family, b all bind it"):
        build.engine_sources("09_family")


def test_stale_modules_are_found(tmp_path, monkeypatch):
    """A generated module that no notebook exports any more is stale: `build --check` names every such file of the
    engine (one never generated too), and `build A` removes only those generated from A's notebook."""
    _notebook_with(tmp_path, monkeypatch, ("X = 1", ["export"]))
    engine = tmp_path / "engine"
    (engine / "family.py").write_text(build.engine_sources("09_family")["family"])
    (engine / "gone.py").write_text('"""Generated by `make build` from source/09_family/09_family.ipynb (cells tagged '
                                    '"export:gone").\n\nDo not edit: change the notebook and rebuild."""\nX = 1\n')
    (engine / "other.py").write_text('"""Generated by `make build` from source/03_other/03_other.ipynb."""\n')
    (engine / "by_hand.py").write_text("X = 1\n")
    (engine / "__init__.py").write_text("")
    assert build.stale_modules(["09_family"]) == [engine / "gone.py"]
    assert build.stale_modules() == [engine / "by_hand.py", engine / "gone.py", engine / "other.py"]


def test_a_new_assignment_gets_its_solution_without_executing(tmp_path, monkeypatch):
    """--no-execute on an assignment never executed: its solution is written from source/ without outputs, every
    code cell listed as not executed (to be run on the GPU later), and it counts as current with its source."""
    import shutil

    assignment = "08_hopper"
    shutil.copytree(build.source_notebook(assignment).parent, tmp_path / "source" / assignment)
    monkeypatch.setattr(build, "SOURCE", tmp_path / "source")
    monkeypatch.setattr(build, "SOLUTIONS", tmp_path / "solutions")
    code = [c.id for c in _source(assignment).cells if c.cell_type == "code"]
    assert sorted(build.carry_text(assignment)) == sorted(code)
    written = nbformat.read(tmp_path / "solutions" / assignment / f"{assignment}.ipynb", as_version=4)
    assert written.metadata["flashcourse"]["not_executed"] == sorted(code)
    assert all(not c.outputs for c in written.cells if c.cell_type == "code")
    assert build._solution_is_current(assignment) and build._not_executed(assignment) == sorted(code)
