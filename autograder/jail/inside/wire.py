"""What crosses the jail's boundary: framed messages of JSON and tensors, never code or pickles.

The grader and the runner inside the jail (autograder/jail/inside/runner.py) talk over two pipes. A message is
a 16-byte header (two big-endian lengths), a JSON document and a safetensors blob holding the
tensors the document refers to. A value can be a number, string, bool, None, list, tuple, dict,
torch.dtype, torch.device or tensor (meta tensors by shape and dtype); anything else is sent as
{"unsendable": type name}, which the grader treats as a wrong answer.

The grader decodes what the jail sends as untrusted data: lengths are capped, JSON depth and size
are capped, tensors are parsed by safetensors (which executes nothing), and anything malformed
raises `Malformed`. This file is also copied into the jail, so it imports nothing from the course.
"""

from __future__ import annotations

import json
import math
import os
import select
import struct
import time
from typing import Any

HEADER = struct.Struct(">QQ")
MAX_JSON_BYTES = 16 << 20
MAX_BLOB_BYTES = 512 << 20
MAX_DEPTH = 32
MAX_NODES = 200_000


class Malformed(Exception):
    """The other side sent something that is not a well-formed message."""


class TimedOut(Exception):
    """No complete message arrived before the deadline."""


class Closed(Exception):
    """The other side closed its end (in the jail: the notebook's kernel is gone)."""


def encode(value: Any, tensors: dict) -> Any:
    """value as JSON-ready data; its tensors are added to `tensors` (name -> CPU tensor). The same tensor
    passed twice is sent once and arrives as one tensor, as in `f(x, x, x)`."""
    import torch

    seen: dict[int, str] = {}

    def walk(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            if item.device.type == "meta":
                return {"meta": [str(item.dtype).removeprefix("torch."), list(item.shape)]}
            if id(item) not in seen:
                seen[id(item)] = key = f"t{len(tensors)}"
                tensors[key] = item.detach().to("cpu", copy=True).contiguous()  # a copy: no storage is shared
            return {"tensor": seen[id(item)], "device": item.device.type}
        if isinstance(item, torch.dtype):
            return {"dtype": str(item).removeprefix("torch.")}
        if isinstance(item, torch.device):
            return {"device": str(item)}
        if isinstance(item, float) and not math.isfinite(item):
            return {"float": repr(item)}
        if isinstance(item, (bool, int, float, str, type(None))):
            return item
        if isinstance(item, (list, tuple)):
            return {type(item).__name__: [walk(v) for v in item]}
        if isinstance(item, dict):
            return {"dict": [[walk(k), walk(v)] for k, v in item.items()]}
        return {"unsendable": type(item).__name__}

    return walk(value)


class Unsendable(Exception):
    """A value that has no form on the wire (a function, an object of the learner's class, ...)."""


def decode(value: Any, tensors: dict, device_ok=lambda device: True) -> Any:
    """The value `encode` described, rebuilt from untrusted data; Malformed when it is not well formed."""
    budget = [MAX_NODES]

    def walk(node: Any, depth: int) -> Any:
        import torch

        budget[0] -= 1
        if budget[0] < 0 or depth > MAX_DEPTH:
            raise Malformed("the value is nested too deeply or has too many parts")
        if isinstance(node, (bool, int, float, str, type(None))):
            return node
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise Malformed(f"unexpected {type(node).__name__} in a value")
        if "tensor" in node:
            tensor = tensors.get(node["tensor"]) if isinstance(node["tensor"], str) else None
            if tensor is None:
                raise Malformed("a value refers to a tensor that was not sent")
            device = node.get("device")
            return tensor.to(device) if isinstance(device, str) and device != "cpu" and device_ok(device) else tensor
        (kind, inner), = node.items()
        if kind == "meta" and isinstance(inner, list) and len(inner) == 2:
            dtype = _dtype(inner[0])
            if not isinstance(inner[1], list) or not all(isinstance(n, int) and n >= 0 for n in inner[1]):
                raise Malformed("a meta tensor with a malformed shape")
            return torch.empty(inner[1], dtype=dtype, device="meta")
        if kind == "dtype":
            return _dtype(inner)
        if kind == "device" and isinstance(inner, str):
            return torch.device(inner)
        if kind == "float" and inner in ("inf", "-inf", "nan"):
            return float(inner)
        if kind in ("list", "tuple") and isinstance(inner, list):
            items = [walk(v, depth + 1) for v in inner]
            return items if kind == "list" else tuple(items)
        if kind == "dict" and isinstance(inner, list):
            pairs = [p for p in inner if isinstance(p, list) and len(p) == 2]
            if len(pairs) != len(inner):
                raise Malformed("a dict with malformed items")
            try:
                return {walk(k, depth + 1): walk(v, depth + 1) for k, v in pairs}
            except TypeError:
                raise Malformed("a dict with an unhashable key") from None
        if kind == "unsendable" and isinstance(inner, str):
            raise Unsendable(inner[:100])
        raise Malformed(f"unknown value kind {kind!r}"[:200])

    return walk(value, 0)


def _dtype(name: Any):
    import torch

    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise Malformed(f"unknown dtype {str(name)[:50]!r}")
    return dtype


def pack(document: dict, tensors: dict | None = None) -> bytes:
    """One message: header, JSON document, safetensors blob (empty when there are no tensors)."""
    blob = b""
    if tensors:
        from safetensors.torch import save

        blob = save(tensors)
    text = json.dumps(document, allow_nan=False).encode()
    return HEADER.pack(len(text), len(blob)) + text + blob


POLL_S = 0.5  # how often a wait checks that the other side is still there


def _wait(fd: int, writing: bool, deadline: float | None, there) -> None:
    """Until fd is ready; TimedOut past the deadline, Closed once `there()` says the other side is gone."""
    while True:
        wait = None if deadline is None else deadline - time.monotonic()
        if wait is not None and wait <= 0:
            raise TimedOut()
        if there is not None:
            wait = POLL_S if wait is None else min(wait, POLL_S)
        readable, writable, _ = select.select([] if writing else [fd], [fd] if writing else [], [], wait)
        if writable or readable:
            return
        if there is not None and not there():
            raise Closed()


def send(fd: int, document: dict, tensors: dict | None = None, deadline: float | None = None, there=None) -> None:
    """Write one message. With a deadline or `there` (a function saying whether the reader is still alive,
    for a reader that may die while others hold the pipe open), each write waits only that long."""
    data = memoryview(pack(document, tensors))
    if deadline is None and there is None:
        while data:
            data = data[os.write(fd, data):]
        return
    os.set_blocking(fd, False)   # a write never waits longer than _wait allows
    try:
        while data:
            _wait(fd, True, deadline, there)
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:
                pass
    finally:
        os.set_blocking(fd, True)


def _read_exactly(fd: int, size: int, deadline: float | None, there=None) -> bytes:
    chunks, left = [], size
    while left:
        if deadline is not None or there is not None:
            _wait(fd, False, deadline, there)
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise Closed()
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int, deadline: float | None = None, there=None) -> tuple[dict, dict]:
    """(document, tensors) of the next message; Malformed, TimedOut or Closed otherwise (Closed also when
    `there`, if given, says the writer is gone)."""
    text_size, blob_size = HEADER.unpack(_read_exactly(fd, HEADER.size, deadline, there))
    if text_size > MAX_JSON_BYTES or blob_size > MAX_BLOB_BYTES:
        raise Malformed(f"a message of {text_size + blob_size} bytes, over the limit")
    text = _read_exactly(fd, text_size, deadline, there)
    blob = _read_exactly(fd, blob_size, deadline, there)
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        raise Malformed("a message that is not JSON") from None
    if not isinstance(document, dict):
        raise Malformed("a message that is not a JSON object")
    tensors = {}
    if blob:
        from safetensors.torch import load

        try:
            tensors = load(blob)
        except Exception:
            raise Malformed("unreadable tensors") from None
    return document, tensors
