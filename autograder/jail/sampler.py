"""Where a measured call's process spends its time, sampled from outside it: the program that samples.

    python -I -S sampler.py PID MEAN_INTERVAL_S LIBRARY NUMPY_PARENT   (started by autograder/jail/watch.py only)

NUMPY_PARENT is the folder the grader imports numpy from; nothing else of its site-packages is read.
It reads one line of JSON from its standard input, {"watched": [[start, end], ...]}: ranges of offsets in the
file named LIBRARY (a basename, libtorch_cpu.so), the code of the functions whose return addresses it looks
for. It attaches to every thread of PID with ptrace (PTRACE_SEIZE), stops them once and clears, in the part
of each thread's stack below its stack pointer (which no function is using: what earlier calls left behind),
the words that point into those ranges where LIBRARY is mapped, so that only calls made from now on can put
such words on the stack (one it cannot clear is not counted where it lies). It writes one line
{"ready": true} (or {"failed": why} and ends), then, at intervals drawn at random (exponentially, of mean
MEAN_INTERVAL_S, from os.urandom: the process cannot foresee the next one), stops every thread, reads its
instruction pointer, the CODE_BYTES bytes of code there and STACK_BYTES of its stack from its stack pointer
up (process_vm_readv), and lets it go on. Of the stack it keeps the words that point into the watched
ranges, the nearest MOST_RETURNS: among them are the return addresses of the watched functions the thread
is inside of. When its standard input has a line or closes, it stops the threads once more, reads
/proc/PID/maps, detaches and writes one line of JSON: {"samples": [[ip, "hex of the code there", [words]],
...], "maps": [the maps when it attached, the maps at the end], "stopped_s": how long the threads spent
stopped for it, "threads": n, "cleared": the words it cleared, "left": those it could not clear, "cpu_s":
its own CPU time}.

It runs outside the jail, with the grader's identity, and uses only the standard library and numpy: nothing
of the process it watches reaches it but that process's registers, memory and maps, read as data. A thread
that gets a signal has it delivered as if nothing watched. ptrace is per thread: every request here comes
from this process's one thread.
"""

import ctypes
import json
import math
import os
import random
import select
import signal
import sys
import time

if __name__ == "__main__":
    sys.path.append(sys.argv[4])
import numpy as np  # noqa: E402

PTRACE_CONT, PTRACE_DETACH, PTRACE_GETREGSET = 7, 17, 0x4204
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
PTRACE_EVENT_STOP = 128
NT_PRSTATUS = 1
WALL = 0x40000000
STOP_TIMEOUT_S = 2.0       # a thread that does not stop within this is left alone (it is not running code)
CODE_BYTES = 32
STACK_BYTES = 256 << 10    # how far up from the stack pointer words are read (MKL's GEMMs keep buffers there)
MOST_RETURNS = 16          # and how many of those that point into the watched ranges (the nearest) are kept
CLEARED_BYTES = 8 << 20    # how much of a stack below its pointer is cleared when it attaches
RED_ZONE = 128             # below the stack pointer, what a function may still use (the x86-64 ABI's red zone)
# machine -> (index of the instruction pointer, of the stack pointer, among the 8-byte words of NT_PRSTATUS's
# registers, and their count)
REGISTERS = {"x86_64": (16, 19, 27), "aarch64": (32, 31, 34)}

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class Failed(Exception):
    pass


def _ptrace(request: int, tid: int, addr: int = 0, data: int = 0) -> None:
    if libc.ptrace(request, tid, ctypes.c_void_p(addr), ctypes.c_void_p(data)) == -1:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


libc.process_vm_readv.restype = libc.process_vm_writev.restype = ctypes.c_ssize_t


def _read(pid: int, address: int, size: int) -> bytes:
    """Up to size bytes of pid's memory from address: as many as are mapped from there (process_vm_readv, which
    asks what ptrace asks, where /proc/PID/mem would also ask who owns that file)."""
    buffer = ctypes.create_string_buffer(size)
    local, remote = _Iovec(ctypes.cast(buffer, ctypes.c_void_p), size), _Iovec(address, size)
    got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return buffer.raw[:got]


def _write(pid: int, address: int, data: bytes) -> None:
    buffer = ctypes.create_string_buffer(data, len(data))
    local, remote = _Iovec(ctypes.cast(buffer, ctypes.c_void_p), len(data)), _Iovec(address, len(data))
    if libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != len(data):
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def _threads(pid: int) -> set:
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except OSError:
        return set()


def _maps(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read(64 << 20)
    except OSError:
        return ""


def _regions(maps: str, library: str, watched: list) -> tuple:
    """(the watched ranges where LIBRARY's code is mapped, every mapping) of a maps text, each as sorted
    (start, end) address pairs."""
    where, every = [], []
    for line in maps.splitlines():
        parts = line.split(None, 5)
        try:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            offset = int(parts[2], 16)
        except (ValueError, IndexError):
            continue
        every.append((start, end))
        if len(parts) == 6 and "x" in parts[1] and os.path.basename(parts[5]) == library:
            for low, high in watched:
                low, high = max(low, offset), min(high, offset + end - start)
                if low < high:
                    where.append((start + low - offset, start + high - offset))
    return merged_ranges(where), sorted(every)


def merged_ranges(ranges: list) -> list:
    """[(start, end), ...] sorted, overlapping ranges joined (watch.py reads ranges the same way)."""
    out: list = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _pointers(data: bytes, base: int, starts, ends) -> list:
    """(address, word) of each 8-byte aligned little-endian word of data (read from address base, a multiple of
    8) within one of the ranges [starts[i], ends[i]) (numpy arrays, sorted, apart), by address."""
    if not len(starts):
        return []
    words = np.frombuffer(data, dtype="<u8", count=len(data) // 8)
    near = np.flatnonzero((words >= starts[0]) & (words < ends[-1]))
    at = np.searchsorted(starts, words[near], side="right") - 1
    inside = near[(at >= 0) & (words[near] < ends[np.maximum(at, 0)])]
    return [(base + 8 * int(i), int(words[i])) for i in inside]


class Watched:
    """The threads of one process, attached with PTRACE_SEIZE."""

    def __init__(self, pid: int, library: str, watched: list):
        self.pid = pid
        self.ip_index, self.sp_index, words = REGISTERS[os.uname().machine]
        self.regs = (ctypes.c_uint64 * words)()
        self.iov = _Iovec(ctypes.cast(self.regs, ctypes.c_void_p), ctypes.sizeof(self.regs))
        self.tids: set = set()
        self.dropped: set = set()   # threads that did not stop when asked: left alone
        self.stopped_s = 0.0
        self.attach()
        if self.refused or not self.tids:
            raise Failed(f"ptrace could not attach to process {pid}: {self.refused or 'it has no thread'}")
        self.maps = _maps(pid)
        where, self.every = _regions(self.maps, library, watched)
        self.starts = np.array([low for low, _ in where], dtype=np.uint64)
        self.ends = np.array([high for _, high in where], dtype=np.uint64)
        self.cleared = 0
        self.left: set = set()   # (address, word) it could not clear: not counted when found again
        stopped = self.stop_all()
        for tid in stopped:
            ip_sp = self._registers(tid)
            region = next(((s, e) for s, e in self.every if s <= ip_sp[1] < e), None) if ip_sp else None
            if region is not None:
                low, high = max(region[0], ip_sp[1] - CLEARED_BYTES), ip_sp[1] - RED_ZONE
                for address, word in self._pointers(low, high - low) if low < high else []:
                    try:
                        _write(pid, address, bytes(8))
                        self.cleared += 1
                    except OSError:
                        self.left.add((address, word))
        self.go_on(stopped)

    def attach(self) -> None:
        """Attach to the threads not attached yet (none may be born during a measured call, but any would be
        followed from the next sample on)."""
        self.refused = ""
        for tid in sorted(_threads(self.pid) - self.tids - self.dropped):
            try:
                _ptrace(PTRACE_SEIZE, tid)
                self.tids.add(tid)
            except OSError as error:
                self.refused = f"thread {tid}: {error.strerror}"

    def _registers(self, tid: int):
        try:
            _ptrace(PTRACE_GETREGSET, tid, NT_PRSTATUS, ctypes.addressof(self.iov))
        except OSError:
            return None
        return int(self.regs[self.ip_index]), int(self.regs[self.sp_index])

    def _pointers(self, start: int, size: int) -> list:
        """(address, word) of each aligned word in [start, start + size) of the process's memory that points
        into LIBRARY's code, nearest first."""
        start -= start % 8
        try:
            data = _read(self.pid, start, size - size % 8)
        except OSError:
            return []
        return _pointers(data, start, self.starts, self.ends)

    def _wait_stopped(self, tid: int) -> bool:
        """Wait until tid is in the stop PTRACE_INTERRUPT asked for; False once it has ended. A signal that
        stops it first is delivered at once, as if nothing watched; a thread it starts is let go on."""
        while True:
            signal.setitimer(signal.ITIMER_REAL, STOP_TIMEOUT_S)
            try:
                _, status = os.waitpid(tid, WALL)
            except (ChildProcessError, TimeoutError):
                return False
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                return False
            if not os.WIFSTOPPED(status):
                continue
            event = status >> 16
            if event == PTRACE_EVENT_STOP:
                return True
            # A signal to deliver (event 0): delivered; another event (a thread started): let go on. The
            # interrupt asked for stays pending, and stops it next.
            try:
                _ptrace(PTRACE_CONT, tid, 0, os.WSTOPSIG(status) if event == 0 else 0)
            except OSError:
                return False

    def stop_all(self) -> list:
        """Interrupt every thread and wait for each to stop: those stopped."""
        for tid in list(self.tids):
            try:
                _ptrace(PTRACE_INTERRUPT, tid)
            except OSError:
                self.tids.discard(tid)
        stopped = {tid for tid in self.tids if self._wait_stopped(tid)}
        self.dropped |= (self.tids - stopped) & _threads(self.pid)
        self.tids = stopped
        return sorted(stopped)

    def go_on(self, tids: list) -> None:
        for tid in tids:
            try:
                _ptrace(PTRACE_CONT, tid)
            except OSError:
                self.tids.discard(tid)

    def sample(self, into: list) -> None:
        self.attach()
        began = time.monotonic()
        stopped = self.stop_all()
        seen = []
        for tid in stopped:
            ip_sp = self._registers(tid)
            if ip_sp is None:
                continue
            ip, sp = ip_sp
            try:
                code = _read(self.pid, ip, CODE_BYTES)
            except OSError:
                code = b""
            try:
                stack = _read(self.pid, sp - sp % 8, STACK_BYTES)
            except OSError:
                stack = b""
            seen.append((ip, code, sp - sp % 8, stack))
        self.go_on(stopped)
        self.stopped_s += time.monotonic() - began
        for ip, code, sp, stack in seen:   # read while they were stopped, sorted out while they run
            returns = [w for a, w in _pointers(stack, sp, self.starts, self.ends)
                       if (a, w) not in self.left][:MOST_RETURNS]
            into.append([ip, code.hex(), returns])

    def detach(self) -> str:
        """Stop every thread, read the maps while none runs, let them go: the maps."""
        stopped = self.stop_all()
        maps = _maps(self.pid)
        for tid in stopped:
            try:
                _ptrace(PTRACE_DETACH, tid)
            except OSError:
                pass
        return maps


def _late(*_) -> None:
    raise TimeoutError()


def main(pid: int, mean_s: float, library: str) -> None:
    signal.signal(signal.SIGALRM, _late)
    out = sys.stdout
    try:
        ranges = json.loads(sys.stdin.readline())["watched"]
        ranges = sorted((int(low), int(high)) for low, high in ranges)
        watched = Watched(pid, library, ranges)
    except (Failed, OSError, ValueError, KeyError, TypeError) as error:
        out.write(json.dumps({"failed": str(error)}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    draw = random.Random(os.urandom(16))
    samples: list = []
    control = sys.stdin.fileno()
    while watched.tids:
        wait = -mean_s * math.log(1.0 - draw.random())
        if select.select([control], [], [], wait)[0]:
            break
        watched.sample(samples)
    threads = len(watched.tids)
    last = watched.detach()
    out.write(json.dumps({"samples": samples, "maps": [watched.maps, last], "stopped_s": watched.stopped_s,
                          "threads": threads, "cleared": watched.cleared, "left": len(watched.left),
                          "cpu_s": time.process_time()}) + "\n")
    out.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
