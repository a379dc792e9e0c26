# The course's grading image: the jail (bubblewrap) and everything the grader needs, on Linux.
#   docker build -t flashcourse-grader .
#   docker run --rm --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
#       -v "$PWD/submitted:/submitted:ro" -v "$PWD/build:/course/build" \
#       flashcourse-grader python -m autograder grade /submitted
# or, as one grading worker of a Dask cluster (README: Grading on several machines):
#   docker run -d --network host --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
#       flashcourse-grader dask worker tcp://HOST:8786 --nthreads 4
# bubblewrap creates a user namespace inside the container, which Docker's default seccomp and
# AppArmor profiles forbid: hence the two options (or run the grader on a Linux host with bubblewrap).
# Each jail gets a cgroup of its own where the container's /sys/fs/cgroup is writable (Podman:
# --security-opt unmask=/sys/fs/cgroup; Docker only with --privileged): the entrypoint delegates one to
# the grader. Elsewhere the grader grades one notebook at a time, and its summary says why.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap util-linux make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /course
COPY . .
RUN python -m venv .venv \
    && .venv/bin/pip install --no-cache-dir "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
    && .venv/bin/pip install --no-cache-dir -e ".[dev]" \
    && touch .venv/bin/.installed
# The grader runs as an ordinary user: the jail is then built in a user namespace, and the
# learner's code is uid 65534 there, with no capability. The entrypoint starts as root only to
# delegate a cgroup to that user (autograder/jail/delegate.py), then drops to it.
RUN useradd --create-home grader && mkdir -p build && chown grader build
ENV PATH=/course/.venv/bin:$PATH
# A grading worker (`dask worker tcp://HOST:8786`, README) imports the grader from here wherever it starts.
ENV PYTHONPATH=/course
ENTRYPOINT ["python", "-m", "autograder.jail.delegate", "--user", "grader", "--"]
CMD ["python", "-m", "autograder", "--help"]
