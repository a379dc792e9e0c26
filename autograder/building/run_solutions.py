"""Execute solution notebooks on another machine, such as the course's GPU, which needs no nbgrader.

    python -m autograder build --solutions-to-run DIR           here: the solutions that are out of date,
                                                                unexecuted, one DIR/<assignment>.ipynb each
    python -m autograder.building.run_solutions DIR OUT         there, in a checkout of the same commit:
                                                                each executed top to bottom into OUT
    python -m autograder build --executed-from OUT              here: OUT's notebooks become solutions/,
                                                                as if `build` had executed them itself

There, this module needs only nbformat, nbclient and ipykernel (and the course's own requirements); it
imports nothing else of the course, so a GPU machine without nbgrader or Jupyter's server can run it.
Each notebook runs with solutions/<assignment>/ of that checkout as its working folder, as `build` does.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(folder: Path, out: Path, timeout: int = 1800, solutions: Path = ROOT / "solutions") -> int:
    """Execute every notebook of `folder` into `out`, each in solutions/<its name>/; 1 if any failed."""
    import nbformat
    from nbclient import NotebookClient

    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for path in sorted(folder.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        cwd = solutions / path.stem
        cwd.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        print(f"run_solutions: {path.stem} ...", flush=True)
        try:
            NotebookClient(nb, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": str(cwd)}}).execute()
        except Exception as error:  # the others still run; this one is not written
            failed += 1
            print(f"run_solutions: {path.stem} FAILED after {time.monotonic() - start:.0f} s: {error}", flush=True)
            continue
        nbformat.write(nb, out / path.name)
        print(f"run_solutions: {path.stem} executed in {time.monotonic() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    raise SystemExit(run(Path(sys.argv[1]), Path(sys.argv[2])))
