"""Building the course from source/: the release (notebooks/), the executed solutions (solutions/), the
exported engine (flashcourse/engine/), the figures they quote, and the samples' classroom.

build      the release, the solutions and the engine, and the check that they match source/
figures    the numbers and pictures in the notebooks' text, from the measurements they name
classroom  synthetic classes of learners made from the samples, to time and check a whole batch
"""
