"""nbgrader configuration: the repository root is the course directory.

source/ holds the instructor's notebooks, notebooks/ is the release folder learners open, and
submitted/, autograded/ and feedback/ (gitignored) are where an instructor's class lands, so the
usual `nbgrader generate_assignment 01_online_softmax` and `nbgrader autograde 01_online_softmax`
work from here. `make demo` and `python -m autograder grade` point the same configuration at
other folders.
"""

import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
# Hidden checks live in autograder/, which learners do not install: make it importable here and
# in the grading kernels, which inherit this environment.
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

from nbgrader.converters import GenerateAssignment  # noqa: E402

from autograder.grading import execute, feedback_page, links, preprocessors  # noqa: E402  (needs ROOT on sys.path)

# A student whose submitted/ or autograded/ folder holds a symbolic link is refused before nbgrader copies or
# runs anything of it (autograder/grading/links.py): nbgrader would follow the link.
links.install()

c = get_config()  # noqa: F821  (provided by traitlets when it loads this file)

c.CourseDirectory.root = ROOT
c.CourseDirectory.course_id = "flashattention"
c.CourseDirectory.source_directory = "source"
c.CourseDirectory.release_directory = "notebooks"
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(ROOT, "gradebook.db")

# The whole notebook is graded, including the set-up cell: a slow CPU and Triton's interpreter
# need more than nbgrader's 30 s default for one cell; a cell past its limit stops its kernel, and
# a fresh one takes over for the later cells (autograder/grading/execute.py).
c.JailedExecute.timeout = 300

# nbgrader's own list, then a stamp saying the release is generated from source/.
c.GenerateAssignment.preprocessors = [*GenerateAssignment.class_traits()["preprocessors"].make_dynamic_default(),
                                      preprocessors.MarkGenerated]

# A duplicated grade cell is dropped, and one source/ does not know becomes a plain cell, instead of
# aborting the notebook.
c.Autograde.sanitize_preprocessors = [
    "nbgrader.preprocessors.ClearOutput",
    preprocessors.ForgetUnknownCells,
    preprocessors.DropDuplicateCells,
    "nbgrader.preprocessors.DeduplicateIds",
    "nbgrader.preprocessors.OverwriteKernelspec",
    "nbgrader.preprocessors.OverwriteCells",
    "nbgrader.preprocessors.CheckCellMetadata",
]

# The learner's cells run in a jail; the test cells run in this process, calling the learner's
# functions in the jail with data in and data out (autograder/grading/execute.py). Without a working jail
# nothing is run, unless --JailedExecute.trusted=True says the notebooks are trusted (the samples).
# Only an exception fails a test: warnings on stderr (torch and Triton print some) cost nothing.
c.Autograde.autograde_preprocessors = [
    preprocessors.RestoreDeletedTests,
    execute.JailedExecute,
    preprocessors.StderrIsNotFailure,
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]

# Feedback shows what a learner may see: no hidden test source, and errors as one plain message.
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    preprocessors.HideHiddenTests,
    preprocessors.PlainErrors,
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
]
# The rendered page is sanitized and carries a Content-Security-Policy: nothing the learner wrote or printed
# runs or loads anything in whoever opens it (autograder/grading/feedback_page.py).
c.GenerateFeedback.exporter_class = feedback_page.FeedbackPage
