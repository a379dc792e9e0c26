"""nbgrader preprocessors that make grading fair to learners.

Autograde: a warning printed to stderr (torch and Triton print several) is not a failure. nbgrader
scores a test cell zero when it has any stderr output; here only an exception fails a test.

Verdicts: the test cells run in the learner's kernel, where code can patch anything; their grade is
decided afterwards, here, by replaying the recorded calls (RecordGradedCalls, TrustedVerdicts).

Feedback: the autograded notebook holds the hidden tests (nbgrader restores them before executing)
and full tracebacks that quote them. Feedback keeps the verdict and the check's message only.
"""

import ast
import os
import re
import shutil
import tempfile
from pathlib import Path

import nbformat
from nbgrader.preprocessors import ClearHiddenTests, NbGraderPreprocessor

from . import ROOT, record


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


# --- Verdicts decided by the grader (see autograder/record.py) ---

RECORD_MARK = "  # grader: record calls\n"  # ends the line put before each test cell, and finds it again
RECORD_LINE = '__import__("autograder.record").record.wrap(globals(), {cell!r}, {names!r})' + RECORD_MARK
# Learner code that uses the course's finished answers instead of writing its own.
FORBIDDEN_ANYWHERE = re.compile(r"flashcourse\s*\.\s*engine|from\s+flashcourse\s+import\s+[^\n]*\bengine\b|autograder")
FORBIDDEN_IN_SOLUTIONS = re.compile(r"reference\s*\.\s*attention|softmax_weighted_sum|scaled_dot_product_attention")


def _source_notebook(resources) -> nbformat.NotebookNode:
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


class RestoreDeletedTests(NbGraderPreprocessor):
    """Put back, from source/, every test cell the learner deleted or stripped of its metadata."""

    def preprocess(self, nb, resources):
        present = {c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells if is_test_cell(c)}
        previous_id = None
        for cell in _source_notebook(resources).cells:
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


class RecordGradedCalls(NbGraderPreprocessor):
    """Before execution: start every test cell by wrapping the graded functions in recorders."""

    def preprocess(self, nb, resources):
        names = graded_names(_source_notebook(resources))
        folder = tempfile.mkdtemp(prefix="flashcourse-record-")
        os.environ[record.RECORD_DIR_ENV] = folder  # the kernel, started after this, inherits it
        resources["flashcourse_record"] = {"folder": folder, "names": names}
        for cell in nb.cells:
            if is_test_cell(cell):
                cell.source = RECORD_LINE.format(cell=cell.metadata.nbgrader["grade_id"], names=names) + cell.source
        return nb, resources


def _learner_code(nb, source) -> tuple[str, str]:
    """(code of every cell the learner wrote or changed, code of their solution cells)."""
    given = {(c.get("id"), c.source) for c in source.cells}
    written = [c for c in nb.cells if c.cell_type == "code" and (c.get("id"), c.source) not in given
               and not is_test_cell(c)]
    solutions = [c for c in nb.cells if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")]
    return "\n".join(c.source for c in written), "\n".join(c.source for c in solutions)


class TrustedVerdicts(NbGraderPreprocessor):
    """After execution: rerun each test cell here against the recorded calls; its result is the verdict."""

    def preprocess(self, nb, resources):
        info = resources.pop("flashcourse_record")
        folder = Path(info["folder"])
        entries = record.read(folder)
        written, solutions = _learner_code(nb, _source_notebook(resources))
        banned = FORBIDDEN_ANYWHERE.search(written) or FORBIDDEN_IN_SOLUTIONS.search(solutions)
        for cell in nb.cells:
            if not is_test_cell(cell):
                continue
            cell.source = cell.source.split(RECORD_MARK, 1)[-1]
            if banned:
                failure = ("AssertionError", f"the notebook uses the course's finished implementation "
                                             f"({banned.group(0)!r}) instead of its own code")
            else:
                failure = self._replay(cell, info["names"], entries, folder)
            kept = [o for o in cell.outputs if o.output_type not in ("error", "execute_result")]
            if failure:
                kept.append(nbformat.v4.new_output("error", ename=failure[0], evalue=failure[1],
                                                   traceback=[f"{failure[0]}: {failure[1]}"]))
            cell.outputs = kept
        shutil.rmtree(folder, ignore_errors=True)
        return nb, resources

    @staticmethod
    def _replay(cell, names, entries, folder) -> tuple[str, str] | None:
        namespace = {"__name__": "__grader__", **{n: record.Replayer(n, entries, folder) for n in names}}
        record.reset_randomness()
        try:
            exec(compile(cell.source, f"<test cell {cell.metadata.nbgrader['grade_id']}>", "exec"), namespace)
        except Exception as error:
            return type(error).__name__, str(error)
        return None
