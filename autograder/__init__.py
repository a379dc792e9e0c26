"""The grading side of the course: building the notebooks, hidden checks, batch grading.

Nothing here is shipped to learners: `pip install flashcourse` installs only flashcourse/.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
