"""Record and replay the learner's graded functions, so that verdicts are decided by the grader.

In the learner's kernel, every autograded cell starts by wrapping the graded functions in
`Recorder`s: each call's inputs are reduced to a digest and its output (or exception) is written
to a record folder, call by call. Nothing there decides a grade.

In the grader's own process, after the notebook has run, the same test cell (its instructor-written
source, hidden tests included) runs again with each graded function replaced by a `Replayer`, which
returns what the learner's function returned for the same inputs. Checks there use the grader's own
torch, checks and reference, which no learner code has touched. A call the notebook never recorded
(the kernel died, a cell was rewritten, time ran out) fails.

Outputs are stored as JSON and safetensors, never pickle: a record can hold numbers, strings,
lists, tuples, dicts, None and tensors, nothing executable.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

RECORD_DIR_ENV = "FLASHCOURSE_RECORD_DIR"
RECORDS = "calls.jsonl"
MAX_ALLOCATIONS = 64  # the largest tensors a recorded call created, for memory checks
# Exceptions a replay may raise as themselves; any other becomes a RuntimeError with its name.
REPLAYABLE_ERRORS = {e.__name__: e for e in (ValueError, TypeError, NotImplementedError, AssertionError,
                                             RuntimeError, ZeroDivisionError, IndexError, KeyError,
                                             OverflowError, ArithmeticError)}


def _digest_parts(value: Any, parts: list) -> None:
    """Append a canonical, type-tagged description of `value` (tensors by content) to parts."""
    import torch

    if isinstance(value, torch.Tensor) and value.device.type == "meta":  # no data: shape and dtype only
        parts.append(("meta tensor", str(value.dtype), tuple(value.shape)))
    elif isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        raw = data.view(torch.int16) if data.dtype in (torch.bfloat16, torch.float16) else data
        parts.append(("tensor", str(value.dtype), tuple(value.shape), str(value.device.type),
                      hashlib.sha256(raw.numpy().tobytes()).hexdigest()))
    elif isinstance(value, float):
        parts.append(("float", repr(value)))
    elif isinstance(value, (bool, int, str, type(None))):
        parts.append((type(value).__name__, repr(value)))
    elif isinstance(value, (list, tuple)):
        parts.append((type(value).__name__, len(value)))
        for item in value:
            _digest_parts(item, parts)
    elif isinstance(value, dict):
        parts.append(("dict", len(value)))
        for key in sorted(value, key=repr):
            _digest_parts(key, parts)
            _digest_parts(value[key], parts)
    else:
        parts.append(("other", type(value).__name__, repr(value)))


def digest(name: str, args: tuple, kwargs: dict) -> str:
    parts: list = [("call", name)]
    _digest_parts(args, parts)
    _digest_parts(kwargs, parts)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _encode(value: Any, tensors: dict) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().cpu().contiguous()
        return {"tensor": key, "device": value.device.type}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [_encode(v, tensors) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    return {"unrecordable": type(value).__name__}


def _decode(value: Any, tensors: dict) -> Any:
    import torch

    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        tensor = tensors[value["tensor"]]
        return tensor.to(value["device"]) if value["device"] != "cpu" and torch.cuda.is_available() else tensor
    if "float" in value:
        return float(value["float"])
    if "list" in value:
        return [_decode(v, tensors) for v in value["list"]]
    if "tuple" in value:
        return tuple(_decode(v, tensors) for v in value["tuple"])
    if "dict" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["dict"]}
    raise AssertionError(f"the function returned a {value.get('unrecordable')}, which the grader cannot check")


class Recorder:
    """Calls the learner's function and writes each call's digest and result to the record folder."""

    def __init__(self, function, name: str, cell: str, folder: Path):
        self.function, self.name, self.cell, self.folder = function, name, cell, folder
        self.__wrapped__ = function

    def __call__(self, *args, **kwargs):
        from flashcourse import memory

        key = digest(self.name, args, kwargs)
        entry: dict[str, Any] = {"cell": self.cell, "name": self.name, "key": key}
        tracker = memory.active()     # a memory check is watching this call: keep what it sees
        seen = len(tracker.allocations) if tracker else 0
        try:
            result = self.function(*args, **kwargs)
        except Exception as error:
            entry["error"] = [type(error).__name__, str(error)[:2000]]
            self._write(entry, {})
            raise
        finally:
            if tracker:
                largest = sorted(tracker.allocations[seen:], key=lambda a: -a.nbytes)[:MAX_ALLOCATIONS]
                entry["allocations"] = [[a.op, list(a.shape), str(a.dtype), a.nbytes] for a in largest]
        tensors: dict = {}
        entry["output"] = _encode(result, tensors)
        self._write(entry, tensors)
        return result

    def _write(self, entry: dict, tensors: dict) -> None:
        if tensors:
            from safetensors.torch import save_file

            entry["tensors"] = f"{entry['key']}.safetensors"
            save_file(tensors, str(self.folder / entry["tensors"]))
        with (self.folder / RECORDS).open("a") as f:
            f.write(json.dumps(entry, allow_nan=True) + "\n")


def reset_randomness() -> None:
    """Seed Python's and torch's global generators, on both sides, so that a test cell drawing unseeded
    random inputs draws the same ones in the kernel and in the replay, whatever ran before it."""
    import random

    import torch

    random.seed(0)
    torch.manual_seed(0)


def wrap(namespace: dict, cell: str, names: list[str]) -> None:
    """Kernel side, at the start of a graded cell: wrap the graded functions defined in namespace."""
    folder = os.environ.get(RECORD_DIR_ENV)
    if not folder:
        return  # not being graded: the learner is running the notebook
    reset_randomness()
    Path(folder).mkdir(parents=True, exist_ok=True)
    for name in names:
        function = namespace.get(name)
        if isinstance(function, Recorder):
            function = function.function
        if callable(function):
            namespace[name] = Recorder(function, name, cell, Path(folder))


def read(folder: Path) -> dict[str, dict]:
    """Grader side: key -> the first recorded entry with that key (a malformed line is skipped)."""
    entries: dict[str, dict] = {}
    path = folder / RECORDS
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("key"), str):
                entries.setdefault(entry["key"], entry)
    return entries


class Replayer:
    """Stands in for a graded function in the grader's process: returns what was recorded."""

    def __init__(self, name: str, entries: dict[str, dict], folder: Path):
        self.name, self.entries, self.folder = name, entries, folder

    def __call__(self, *args, **kwargs):
        entry = self.entries.get(digest(self.name, args, kwargs))
        if entry is None:
            raise AssertionError(f"{self.name} has no recorded answer for one of the test's inputs: the test did "
                                 "not run to the end in the notebook (the kernel stopped, ran out of time, or "
                                 "the cell was changed)")
        self._report_allocations(entry)
        if "error" in entry:
            kind, message = entry["error"]
            raise REPLAYABLE_ERRORS.get(kind, RuntimeError)(message if kind in REPLAYABLE_ERRORS
                                                            else f"{kind}: {message}")
        tensors: dict = {}
        if entry.get("tensors"):
            from safetensors.torch import load_file

            path = (self.folder / Path(entry["tensors"]).name)
            try:
                tensors = load_file(str(path))
            except Exception:
                raise AssertionError(f"the recorded answer of {self.name} is unreadable") from None
        return _decode(entry.get("output"), tensors)

    @staticmethod
    def _report_allocations(entry: dict) -> None:
        """Tell a memory check watching the replay what the learner's call allocated in the notebook."""
        import torch

        from flashcourse import memory

        tracker = memory.active()
        if tracker is None:
            return
        allocations = []
        for op, shape, dtype, nbytes in entry.get("allocations") or []:
            kind = getattr(torch, str(dtype).removeprefix("torch."), None)
            if isinstance(kind, torch.dtype):
                allocations.append(memory.Allocation(str(op), tuple(int(n) for n in shape), kind, int(nbytes)))
        tracker.note(allocations)
