"""nbgrader preprocessors that make grading fair to learners.

Autograde: a warning printed to stderr (torch and Triton print several) is not a failure. nbgrader
scores a test cell zero when it has any stderr output; here only an exception fails a test.

Verdicts: the test cells run in the grader, never in the learner's kernel (autograder/grading/execute.py);
a test cell the learner deleted is put back from source/ first (RestoreDeletedTests).

Feedback: the autograded notebook holds the hidden tests (nbgrader restores them before executing)
and full tracebacks that quote them. Feedback keeps the verdict and the check's message only.
"""

import ast

import nbformat
from nbgrader.preprocessors import ClearHiddenTests, NbGraderPreprocessor

from autograder import ROOT


def generated_note(assignment: str, what: str) -> dict:
    """The notebook metadata that says a file is generated from source/ and must not be edited."""
    return {"generated": f"{what} of source/{assignment}/{assignment}.ipynb by `make build`; edit the source, not this"}


class MarkGenerated(NbGraderPreprocessor):
    """generate_assignment's last step: the release says it is generated, whether `make build` or plain nbgrader ran."""

    def preprocess(self, nb, resources):
        nb.metadata["flashcourse"] = generated_note(resources["nbgrader"]["assignment"], "the release")
        return nb, resources


class StderrIsNotFailure(NbGraderPreprocessor):
    """Turn stderr output of graded cells into stdout, prefixed, so warnings cost no points."""

    def preprocess_cell(self, cell, resources, index):
        if cell.metadata.get("nbgrader", {}).get("grade"):
            for output in cell.get("outputs", []):
                if output.get("output_type") == "stream" and output.get("name") == "stderr":
                    output["name"] = "stdout"
                    output["text"] = "".join(f"[stderr] {line}" for line in output["text"].splitlines(True))
        return cell, resources


class HideHiddenTests(ClearHiddenTests):
    """Remove the ### BEGIN/END HIDDEN TESTS region from every cell shown in feedback."""


class PlainErrors(NbGraderPreprocessor):
    """Replace each traceback by its last line: the exception and the check's message."""

    def preprocess_cell(self, cell, resources, index):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                output["traceback"] = [f"{output.get('ename', 'Error')}: {output.get('evalue', '')}"]
        return cell, resources


# --- What the grader needs to know of the instructor's notebook ---


def source_notebook_of(resources) -> nbformat.NotebookNode:
    """The instructor's notebook (source/) of the notebook being graded: hidden tests and solutions."""
    info = resources["nbgrader"]
    return nbformat.read(ROOT / "source" / info["assignment"] / f"{info['notebook']}.ipynb", as_version=4)


def graded_names(source: nbformat.NotebookNode) -> list[str]:
    """The functions the learner writes: top-level definitions in the source's solution cells."""
    names = []
    for cell in source.cells:
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("solution"):
            for node in ast.parse(cell.source).body:
                # Kernels (@triton.jit) are launched by the graded wrapper, never called by a test.
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        not any("jit" in ast.unparse(d) for d in node.decorator_list):
                    names.append(node.name)
    return names


def is_test_cell(cell) -> bool:
    meta = cell.metadata.get("nbgrader", {})
    return cell.cell_type == "code" and meta.get("grade") and not meta.get("solution")


class DropDuplicateCells(NbGraderPreprocessor):
    """Keep the first cell of each grade id and drop later copies (nbgrader would abort the notebook)."""

    def preprocess(self, nb, resources):
        seen, kept = set(), []
        for cell in nb.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if grade_id in seen:
                self.log.warning("dropped a duplicate of cell %s", grade_id)
                continue
            if grade_id:
                seen.add(grade_id)
            kept.append(cell)
        nb.cells = kept
        return nb, resources


class ForgetUnknownCells(NbGraderPreprocessor):
    """Make a cell whose grade id source/ does not know a plain cell (nbgrader would reject the whole
    notebook): a question moved since the learner's release, or a cell dressed up as a grade cell."""

    def preprocess(self, nb, resources):
        known = {c.metadata.get("nbgrader", {}).get("grade_id") for c in source_notebook_of(resources).cells}
        for cell in nb.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if "nbgrader" in cell.metadata and grade_id not in known:
                del cell.metadata["nbgrader"]
                self.log.warning("cell %s is not in source/: graded as a plain cell", grade_id)
        return nb, resources


class RestoreDeletedTests(NbGraderPreprocessor):
    """Put back, from source/, every test cell the learner deleted or stripped of its metadata."""

    def preprocess(self, nb, resources):
        present = {c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells if is_test_cell(c)}
        previous_id = None
        for cell in source_notebook_of(resources).cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if is_test_cell(cell) and grade_id not in present:
                ids = [c.get("id") for c in nb.cells]
                at = ids.index(previous_id) + 1 if previous_id in ids else len(nb.cells)
                restored = nbformat.v4.new_code_cell(cell.source, metadata=cell.metadata)
                restored["id"] = f"restored-{grade_id}"
                nb.cells.insert(at, restored)
                self.log.warning("restored the deleted test cell %s", grade_id)
            previous_id = cell.get("id")
        return nb, resources
