"""Grading: from a folder of submitted notebooks to grades.csv, feedback and a summary.

batch          the batch: every (student, assignment), several at once, longest first; the csv and the summary
submission     one submission: read safely, autograded and given feedback by nbgrader in a scratch course
cluster        the same batch on Dask workers, each grading in a jail of its own
warm           the warm server every nbgrader command is forked from
execute        nbgrader's execution through the jail: learner cells inside, test cells here
preprocessors  the release's nbgrader preprocessors and how a test cell is recognised
launches       which functions of a notebook launch Triton kernels, read from its structure
kernel_world   the learner's kernels, rebuilt alone and launched by the instructor's wrappers in a fresh jail
links          plain `nbgrader autograde` refuses symbolic links under a submission
feedback_page  the feedback page sanitized after rendering, with a policy that runs and loads nothing
"""
