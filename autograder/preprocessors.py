"""nbgrader preprocessors for feedback: what the learner sees after grading.

The autograded notebook holds the hidden tests (nbgrader restores them before executing) and
full tracebacks that quote them. Feedback keeps the verdict and the check's message only.
"""

from nbgrader.preprocessors import ClearHiddenTests, NbGraderPreprocessor


class HideHiddenTests(ClearHiddenTests):
    """Remove the ### BEGIN/END HIDDEN TESTS region from every cell shown in feedback."""


class PlainErrors(NbGraderPreprocessor):
    """Replace each traceback by its last line: the exception and the check's message."""

    def preprocess_cell(self, cell, resources, index):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                output["traceback"] = [f"{output.get('ename', 'Error')}: {output.get('evalue', '')}"]
        return cell, resources
