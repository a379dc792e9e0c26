"""The programs copied into a jail (autograder/jail/sandbox.py, `_library`), where each is a top-level module.
The grader imports wire (and limits) from here to speak the same format."""
