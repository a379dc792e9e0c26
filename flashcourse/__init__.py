"""flashcourse: the library behind the FlashAttention course notebooks.

The package's own modules are the learner's library: what a notebook imports that answers no exercise.
The grading jail holds exactly these files (autograder/jail/sandbox.py, `kept_modules`).

runtime      decides once between a GPU and the Triton interpreter (every notebook starts with it)
positions    the absolute positions of queries and keys, and the checks of a kernel's inputs
memory       an allocation tracker, to show what the unfused and tiled versions keep alive
distributed  runs a function on P local ranks of a torch.distributed group
selfcheck    `python -m flashcourse.selfcheck NOTEBOOK`: run a notebook's visible tests
gpt          a small GPT whose attention is a parameter (06 trains its miniature with the learner's kernels)

Its subpackages serve others, and the jail holds none of them:

checks       the recognisers of mistakes, one module per assignment over a shared core, and the
             reference they compare with (what the test cells call)
explore      the tile explorer and the causal block picture (they draw the right answer beside yours)
engine       the finished implementations, one module per kernel family, generated from source/
bench        what the notebooks show of the course's GPU: measured results and the sweeps that made them

The instructor's benchmarks of the backward and the ring, and the GPT's measured run on the GPU, are in
instructor/ at the course's root, outside what learners install.
"""

import importlib

__version__ = "0.1.0"
DEVICE_ENV = "FLASHCOURSE_DEVICE"  # "cpu" or "cuda" overrides runtime's choice of device ("auto", or unset, does not)

# Where modules of the previous release went, so that a notebook saved with the old imports still runs.
# One release only: the next one drops this table.
MOVED = {"attention_checks": "flashcourse.checks.core", "kernel_checks": "flashcourse.checks.triton_flash",
         "warmup_checks": "flashcourse.checks.triton_warmup", "backward_checks": "flashcourse.checks.backward",
         "ring_checks": "flashcourse.checks.ring_attention", "reference": "flashcourse.checks.reference",
         "recurrence": "flashcourse.checks.recurrence", "widgets": "flashcourse.explore.widgets",
         "bench_fast": "flashcourse.bench.fast"}


def __getattr__(name: str):
    if name in MOVED:
        return importlib.import_module(MOVED[name])
    raise AttributeError(f"module 'flashcourse' has no attribute {name!r}")
