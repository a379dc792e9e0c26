"""How much memory a function allocates: on a CPU by watching every tensor it creates, on a GPU
from CUDA's allocator statistics.

A CPU has no allocator statistics like torch.cuda.max_memory_allocated, so `AllocationTracker` is a
torch dispatch mode: every operator called inside it passes through `__torch_dispatch__`, which sees
the tensors each operator returns. A returned tensor whose storage is not one of the operator's
inputs is a new allocation; the tracker records its size, keeps the bytes alive, and subtracts them
when the last tensor using that storage is freed. It reports the largest tensor created and the
peak of live bytes, counting only what was allocated inside the block.

    with AllocationTracker() as tracker:
        out = online_attention(q, k, v, tile=64)
    tracker.peak_bytes, tracker.largest

`measure(fn, *args)` does the same and, for CUDA tensors, reads torch.cuda.max_memory_allocated.

A function that runs in another process, as a notebook's function does while it is graded, cannot
be watched this way, and that process could switch any watcher off. Such a function offers
`fn.limited_call(allowance, *args, **kwargs)` instead: the call runs with its process's address
space limited, from outside, to `allowance` bytes more than it held at start-up, and raises
MemoryError when it fails under that limit (flashcourse.checks.core.check_memory_from_outside uses it).
Reference: PyTorch's __torch_dispatch__ (torch.utils._python_dispatch.TorchDispatchMode).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class Allocation:
    """One tensor created by an operator inside the tracker."""

    op: str                  # the operator, e.g. "aten.bmm.default"
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int              # bytes of the new storage

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class AllocationTracker(TorchDispatchMode):
    """A dispatch mode recording every new tensor storage: `allocations`, `largest`, `peak_bytes`."""

    _stack: list["AllocationTracker"] = []   # the trackers entered and not yet exited, innermost last

    def __init__(self):
        super().__init__()
        self.allocations: list[Allocation] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self._users: dict[int, int] = {}      # storage address -> tracked tensors still using it
        self._sizes: dict[int, int] = {}      # storage address -> bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in _tensors((args, kwargs)) if t.device.type != "meta"}
        for t in _tensors(out):
            if t.device.type == "meta":
                continue
            key = _storage_key(t)
            if key in inputs and key not in self._users:
                continue                      # a view of, or a write into, a tensor made outside
            if key not in self._users:
                nbytes = t.untyped_storage().nbytes()
                if nbytes == 0:
                    continue
                self.allocations.append(Allocation(str(func), tuple(t.shape), t.dtype, nbytes))
                self._users[key], self._sizes[key] = 0, nbytes
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self._users[key] += 1
            weakref.finalize(t, self._release, key)
        return out

    def __enter__(self):
        AllocationTracker._stack.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        AllocationTracker._stack.remove(self)
        return super().__exit__(*exc)

    def note(self, allocations: list[Allocation]) -> None:
        """Add allocations observed elsewhere (a recorded call replayed by the grader) to `allocations`."""
        self.allocations.extend(allocations)

    def _release(self, key: int) -> None:
        self._users[key] -= 1
        if self._users[key] == 0:
            del self._users[key]
            self.live_bytes -= self._sizes.pop(key)

    @property
    def largest(self) -> Allocation | None:
        """The largest tensor created (by bytes), or None if nothing was allocated."""
        return max(self.allocations, key=lambda a: a.nbytes, default=None)

    def created(self, min_numel: int, floating: bool = True) -> list[Allocation]:
        """The allocations of at least `min_numel` elements (floating-point ones only, by default)."""
        return [a for a in self.allocations
                if a.numel >= min_numel and (a.dtype.is_floating_point or not floating)]


def active() -> AllocationTracker | None:
    """The innermost tracker now recording, if any (so a call recorded elsewhere can report into it)."""
    return AllocationTracker._stack[-1] if AllocationTracker._stack else None


@dataclass(frozen=True)
class MemoryReport:
    """What one call allocated beyond its inputs."""

    peak_bytes: int                 # most bytes alive at once during the call
    largest: Allocation | None      # the largest tensor created (None on a GPU, where only totals are known)
    device: str
    how: str                        # "dispatch tracker" or "torch.cuda.max_memory_allocated"

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20


def measure(fn, *args, **kwargs) -> tuple[object, MemoryReport]:
    """Call fn(*args, **kwargs) and report its peak memory: CUDA statistics for CUDA inputs, else the tracker."""
    device = next((t.device for t in _tensors((args, kwargs))), torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn(*args, **kwargs)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        return result, MemoryReport(peak, None, str(device), "torch.cuda.max_memory_allocated")
    with AllocationTracker() as tracker:
        result = fn(*args, **kwargs)
    return result, MemoryReport(tracker.peak_bytes, tracker.largest, str(device), "dispatch tracker")
