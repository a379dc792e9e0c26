"""The finished implementations, generated from the solution cells of source/ by `make build`.

Each module here is written by autograder/building/build.py from one assignment's cells tagged "export";
later chapters, tests and benchmarks import them. Edit the notebook in source/, never these files.
"""
