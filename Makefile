# The course's commands. Each creates the virtual environment it needs when it is missing.
#   make demo    grade the sample submissions, print the table (grades.csv and feedback in build/demo); it grades
#                against source/ and writes nothing in notebooks/, solutions/ or the engine
#   make test    the whole test suite (what CI runs)
#   make build   regenerate notebooks/, solutions/ and flashcourse/engine/ from source/; a notebook edited in
#                notebooks/ is never replaced (python -m autograder build --force does)
#   make lab     open the learner's JupyterLab on notebooks/ (nbgrader's instructor tools switched off)
#   make instructor-lab   open JupyterLab on the course root, with nbgrader's formgrader and Create Assignment
#   make grade SUBMISSIONS=dir   grade a folder laid out as submitted/<student>/<assignment>/
#   make wheel   build dist/flashcourse-<version>-py3-none-any.whl, which a notebook's set-up cell installs on
#                Colab when it is uploaded beside the notebook (no repository needed)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch: an unpinned torch would pull a CUDA build of several GB.
TORCH := torch==2.13.0
SUBMISSIONS ?= submitted

# The learner's JupyterLab: jupyter/learner turns nbgrader's server and lab extensions off (formgrader,
# Create Assignment, the Nbgrader menu). JUPYTER_CONFIG_PATH puts it before the environment's own
# configuration, for that command only; nothing is uninstalled, and instructor-lab keeps them.
LEARNER_LAB := JUPYTER_CONFIG_PATH=$(CURDIR)/jupyter/learner
# Jupyter refuses to run as root unless told to; in a container root is often the only user there is.
AS_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: install demo test build lab instructor-lab grade wheel clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(BIN)/.installed

# The demo needs no build: the grader generates each assignment's release from source/ in a folder of its own.
demo: $(BIN)/.installed
	$(BIN)/python -m autograder demo

# Two processes, each taking whole files (tests/conftest.py keeps the ordinary user's files on one); the slowest
# tests are listed at the end, to keep the suite's time in view.
test: $(BIN)/.installed
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=30

build: $(BIN)/.installed
	$(BIN)/python -m autograder build

lab: $(BIN)/.installed
	$(LEARNER_LAB) $(BIN)/jupyter lab $(AS_ROOT) notebooks/

instructor-lab: $(BIN)/.installed
	$(BIN)/jupyter lab $(AS_ROOT)

grade: $(BIN)/.installed
	$(BIN)/python -m autograder grade $(SUBMISSIONS)

wheel: $(BIN)/.installed
	$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir dist .

clean:
	rm -rf build gradebook.db autograded feedback dist
