"""nbgrader preprocessors that make grading fair to learners.

Autograde: a warning printed to stderr (torch and Triton print several) is not a failure. nbgrader
scores a test cell zero when it has any stderr output; here only an exception fails a test.

Feedback: the autograded notebook holds the hidden tests (nbgrader restores them before executing)
and full tracebacks that quote them. Feedback keeps the verdict and the check's message only.
"""

from nbgrader.preprocessors import ClearHiddenTests, NbGraderPreprocessor


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
