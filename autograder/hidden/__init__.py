"""Hidden checks: the cases the grader tries beyond the visible tests, one module per assignment.

Each `test_*` function takes the learner's function and raises AssertionError, with a message from
flashcourse.checks.online_softmax, at the first case it gets wrong. Cases are seeded, so grading is repeatable.
"""
