"""Run a function on P local processes joined in a torch.distributed process group.

    outputs = distributed.run(fn, world_size=2)      # [fn(0, 2), fn(1, 2)], each on its own rank, gloo
    outputs = distributed.call_on_ranks(ring_attention, [(q0, k0, v0), (q1, k1, v1)], causal=True)
    outputs = distributed.call_on_ranks(ring_attention, [(q0, k0, v0), (q1, k1, v1)], group_ranks=[1, 2],
                                        world_size=4)   # ranks 1 and 2 of 4 get group=new_group([1, 2])

With gloo each rank is a forked copy of the calling process, so a function defined in a notebook cell
runs as it is, with every tensor the notebook holds. The ranks meet through a FileStore in a fresh
temporary folder; gloo talks over the loopback interface, so no network is needed. The answers come back in rank
order. A rank that raises makes `run` raise the same kind of exception (a RuntimeError for kinds that
are not Python's own) with the rank and its traceback in the message; a group that has not finished
within timeout_s (a send that nobody receives waits forever) is killed and `run` raises RanksTimedOut. On
Linux a gloo group is also stopped sooner, once its ranks have all but left the CPU for STALL_S seconds:
every rank is then waiting for another, which is a deadlock, and waiting longer cannot end it.
A rank that dies (gloo aborts a rank whose receive buffer is shorter than the message it gets) is the cause of the
other ranks' errors (a peer that vanished), so it is the one `run` reports, with what gloo said, when it said it.
No process outlives the call: every rank is killed and reaped before `run` returns or raises.

With NCCL (backend="nccl", rank r on GPU r) the ranks are started fresh ("spawn"): CUDA cannot be used
in a forked copy of a process that has touched it, and merely asking whether a GPU is there touches it.
fn and its arguments are then pickled, so fn must be importable (defined in a module, not a cell).

This module answers no exercise: graded notebooks may use it, and the grading jail holds it.
"""

from __future__ import annotations

import builtins
import ctypes
import io
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from functools import partial
from multiprocessing.connection import wait

import torch

DEFAULT_TIMEOUT_S = 60.0
LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"   # gloo's interface: loopback only
BACKENDS = ("gloo", "nccl")
TRACEBACK_CHARS = 1500                                     # of a failed rank's traceback, kept in the message
FAILURE_GRACE_S = 2.0                                      # after a rank fails, how long the others may take to report
STALL_S = 5.0          # a gloo group whose ranks all wait this long for each other is deadlocked...
STALL_CPU_SHARE = 0.05 # ...when together they used less than this share of one core meanwhile (gloo's own
                       # threads wake now and then; a rank at work, even on a crowded machine, uses far more)
GROUP_TIMEOUT_MARGIN_S = 15.0  # gloo's own timeout comes this long after the caller's: a deadlock is named by the
                               # launcher (RanksTimedOut), not by gloo on whichever rank has waited longest
LAST_WORDS_CHARS = 1 << 16     # of what a rank that died wrote on its stderr, read back for gloo's message
# gloo's message when a message is longer than the buffer its receive was given (gloo/transport/tcp/pair.cc),
# which it raises in its own thread, so the rank aborts (SIGABRT) instead of raising in Python
GLOO_TOO_LONG = re.compile(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)")
TOO_LONG = re.compile(r"a message of (\d+) bytes arrived for a receive buffer of (\d+) bytes")  # _exit_text's words


class RanksTimedOut(RuntimeError):
    """The process group did not finish in time; its processes were killed."""


def run(fn, world_size: int, *, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    """[fn(rank, world_size) for every rank], each called on its own process of a fresh process group.

    torch.distributed is initialised on every rank before fn runs (so fn may call dist.isend, dist.irecv,
    dist.get_rank(), ...) and destroyed after. Values come back through torch.save, tensors on the CPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"nccl needs one GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPU(s)")
    context = mp.get_context("spawn" if backend == "nccl" else "fork")
    folder = tempfile.mkdtemp(prefix="flashcourse-ranks-")
    said = [os.path.join(folder, f"rank-{rank}.stderr") for rank in range(world_size)]
    ranks, pipes = [], []
    try:
        with warnings.catch_warnings():  # forking a process that runs threads: the child only runs fn
            warnings.simplefilter("ignore", DeprecationWarning)
            for rank in range(world_size):
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(target=_rank_main, daemon=True, name=f"rank {rank}",
                                          args=(fn, rank, world_size, backend, os.path.join(folder, "store"),
                                                timeout_s, sender, said[rank]))
                process.start()
                sender.close()
                ranks.append(process)
                pipes.append(receiver)
        return _gather(ranks, pipes, timeout_s, stall_s=STALL_S if backend == "gloo" else None,
                       last_words=partial(_last_words, said))
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join()
        for receiver in pipes:
            receiver.close()
        _pass_on(said)
        shutil.rmtree(folder, ignore_errors=True)


def call_on_ranks(fn, rank_args, *, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
                  allowance: int | None = None, group_ranks=None, world_size: int | None = None, **kwargs) -> list:
    """[fn(*rank_args[r], **kwargs) for every rank r], on a fresh group of len(rank_args) processes.

    With group_ranks (global ranks, in the order that numbers the group), the world has world_size ranks (by
    default as many as the group), every rank makes `dist.new_group(group_ranks, sort_ranks=False)`, and group
    rank r (global rank group_ranks[r]) calls fn(*rank_args[r], group=that group, **kwargs); the other ranks take
    no part. The answers are the group's, in group order.

    A stand-in for a function that lives in another process (the grader's view of a learner's function)
    has its own call_on_ranks, which starts the ranks over there; it is used when present. There each
    rank receives only its own arguments and, given an allowance (bytes), a rank whose peak memory passed
    it fails the call (autograder/jail/sandbox.py, Jail.call_on_ranks). Here, where the ranks are forked from this
    process and so hold what it holds, the allowance is not measured.
    """
    if group_ranks is not None:
        group_ranks = check_group(group_ranks, world_size, len(rank_args))
        world_size = world_size or len(group_ranks)
    elsewhere = getattr(fn, "call_on_ranks", None)
    if callable(elsewhere):
        grouped = {} if group_ranks is None else {"group_ranks": group_ranks, "world_size": world_size}
        return elsewhere(rank_args, backend=backend, timeout_s=timeout_s, allowance=allowance, **grouped, **kwargs)
    if group_ranks is None:
        return run(partial(_call_with, fn, list(rank_args), kwargs), len(rank_args), backend=backend,
                   timeout_s=timeout_s)
    values = run(partial(_call_in_group, fn, list(rank_args), kwargs, group_ranks), world_size, backend=backend,
                 timeout_s=timeout_s)
    return [values[rank] for rank in group_ranks]


def check_group(group_ranks, world_size: int | None, members: int) -> list[int]:
    """group_ranks as a list of distinct global ranks of a world of world_size (default: the group's size), one per
    tuple of arguments; ValueError otherwise."""
    group_ranks = [int(rank) for rank in group_ranks]
    world_size = len(group_ranks) if world_size is None else int(world_size)
    if len(group_ranks) != members or len(set(group_ranks)) != len(group_ranks) or \
            not all(0 <= rank < world_size for rank in group_ranks):
        raise ValueError(f"group_ranks must be {members} distinct ranks of a world of {world_size}, one per tuple of "
                         f"arguments, got {group_ranks}")
    return group_ranks


def _call_with(fn, rank_args: list, kwargs: dict, rank: int, world_size: int):
    return fn(*rank_args[rank], **kwargs)


def _call_in_group(fn, rank_args: list, kwargs: dict, group_ranks: list, rank: int, world_size: int):
    """fn on group_ranks' group, by its members; every rank waits for all of them on a group of its own (turns), so
    that no rank outside the group leaves, or joins a collective of the default group, while they work."""
    import torch.distributed as dist

    group = dist.new_group(group_ranks, sort_ranks=False)
    turns = dist.new_group(list(range(world_size)))
    value = fn(*rank_args[group_ranks.index(rank)], group=group, **kwargs) if rank in group_ranks else None
    dist.barrier(turns)
    return value


def _gather(ranks: list, pipes: list, timeout_s: float, stall_s: float | None = None, last_words=None) -> list:
    """Every rank's value in rank order. When ranks fail, a rank that died is raised, else the one that failed
    first: the others' errors usually follow from it (a peer that vanished). The deadline raises RanksTimedOut,
    and so does a stall: stall_s seconds in which the unfinished ranks together used less than STALL_CPU_SHARE of
    a core (stall_s None: no such check). last_words(rank): what a rank that died wrote on its stderr, if known."""
    values: dict[int, object] = {}
    failures: list[tuple[bool, float, int, str, str, str]] = []   # (not died, when, rank, kind, message, traceback)
    deadline = time.monotonic() + timeout_s
    waiting = {pipe: rank for rank, pipe in enumerate(pipes)}
    stalled = None if stall_s is None else _Stall(stall_s)
    while waiting:
        poll = deadline - time.monotonic() if stall_s is None else min(deadline - time.monotonic(), stall_s / 5)
        ready = wait(list(waiting), timeout=max(poll, 0))
        if not ready:
            stuck = sorted(waiting.values())
            if time.monotonic() >= deadline:
                if failures:
                    break
                raise RanksTimedOut(f"rank(s) {stuck} of {len(ranks)} did not finish within {timeout_s:g} s and "
                                    f"were killed: {_DEADLOCK}")
            if stalled is not None and not failures and stalled.seen([ranks[rank].pid for rank in stuck]):
                raise RanksTimedOut(f"rank(s) {stuck} of {len(ranks)} all waited {stall_s:g} s without using the "
                                    f"CPU and were killed: {_DEADLOCK}")
            continue
        for pipe in ready:
            rank = waiting.pop(pipe)
            try:
                answer = pipe.recv()
            except EOFError:  # the process ended without answering: killed by a signal, or os._exit
                ranks[rank].join(5)
                said = last_words(rank) if last_words is not None else ""
                failures.append((False, time.monotonic(), rank, "RuntimeError", "died without an answer "
                                 f"({_exit_text(ranks[rank].exitcode, said)})", ""))
                continue
            if answer[0] == "raised":
                failures.append((True, answer[4], rank, *answer[1:4]))
            else:
                values[rank] = torch.load(io.BytesIO(answer[1]), map_location="cpu", weights_only=False)
        if failures:   # give the other ranks a moment to report, then stop waiting for them
            deadline = min(deadline, min(failure[1] for failure in failures) + FAILURE_GRACE_S)
    if failures:
        _, _, rank, kind, message, trace = min(failures)
        error = getattr(builtins, kind, None)
        if not (isinstance(error, type) and issubclass(error, Exception)):
            error, message = RuntimeError, f"{kind}: {message}"
        where = f"on rank {rank} of {len(ranks)}: {message}"
        raise error(where + (f"\nrank {rank}'s traceback (last lines):\n{trace[-TRACEBACK_CHARS:]}" if trace else ""))
    return [values[rank] for rank in range(len(ranks))]


_DEADLOCK = ("a send or receive whose partner never comes (two ranks waiting on each other, or a message sent to the "
             "wrong rank) waits forever")


class _Stall:
    """Whether the same processes have, together, all but left the CPU for the last stall_s seconds."""

    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self.pids: list[int] = []
        self.samples: list[tuple[float, float]] = []   # (when, their CPU seconds by then), oldest first

    def seen(self, pids: list[int]) -> bool:
        used, now = _cpu_seconds(pids), time.monotonic()
        if pids != self.pids or used is None:   # other processes, or none to read: start again
            self.pids, self.samples = pids, []
        if used is None:
            return False
        self.samples.append((now, used))
        old = [sample for sample in self.samples if sample[0] <= now - self.stall_s]
        if not old:
            return False
        self.samples = self.samples[len(old) - 1:]   # the newest sample at least stall_s old, and the later ones
        return used - old[-1][1] < STALL_CPU_SHARE * self.stall_s


def _cpu_seconds(pids) -> float | None:
    """The CPU time these processes have used so far, every thread's (None where /proc cannot tell)."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            return None
        ticks += int(fields[11]) + int(fields[12])   # utime and stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _exit_text(code, said: str = "") -> str:
    """How a rank ended, in words. code: multiprocessing's exitcode (-signal), None where it cannot be read; said:
    the end of what it wrote on its stderr, where gloo says why it aborted (gloo aborts with SIGABRT)."""
    sizes = GLOO_TOO_LONG.findall(said)
    if sizes and (code is None or code == -signal.SIGABRT):
        return (f"killed by SIGABRT: gloo aborted it because a message of {sizes[-1][0]} bytes arrived for a "
                f"receive buffer of {sizes[-1][1]} bytes")
    if code is None:
        return "how it ended could not be read"
    if code >= 0:
        return f"exit code {code}"
    if -code == signal.SIGABRT:
        return "killed by SIGABRT: the process aborted itself"
    return f"killed by {signal.Signals(-code).name}"


def group_timeout(timeout_s: float) -> timedelta:
    """The process group's own timeout for a call given timeout_s: later than the caller's deadline."""
    return timedelta(seconds=timeout_s + GROUP_TIMEOUT_MARGIN_S)


def _last_words(paths: list[str], rank: int) -> str:
    """The end of what rank wrote on its stderr."""
    try:
        with open(paths[rank], "rb") as said:
            said.seek(max(0, os.fstat(said.fileno()).st_size - LAST_WORDS_CHARS))
            return said.read().decode(errors="replace")
    except OSError:
        return ""


def _pass_on(paths: list[str]) -> None:
    """What the ranks wrote on their stderr, onto this process's, once they are gone."""
    for path in paths:
        try:
            with open(path, "rb") as said, open(2, "wb", closefd=False) as stderr:
                shutil.copyfileobj(said, stderr)
        except OSError:
            pass


def _rank_main(fn, rank: int, world_size: int, backend: str, store_path: str, timeout_s: float, sender,
               said: str | None = None) -> None:
    """One rank: join the group, call fn, send back ("value", bytes) or _failure's answer. Its stderr goes to the
    file `said`, which the caller reads if it dies and passes on once the group is gone."""
    import torch.distributed as dist

    answer = None
    try:
        if said is not None:
            with open(said, "wb") as stderr:
                os.dup2(stderr.fileno(), 2)
        _die_with_parent()
        torch.set_num_threads(1)     # P ranks share the machine's cores; a forked OpenMP pool is not reused
        os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=group_timeout(timeout_s))
        try:
            value = fn(rank, world_size)
        except BaseException as error:  # noqa: BLE001  (timed now, before the group is torn down)
            answer = _failure(error)
        dist.destroy_process_group()
        if answer is None:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            answer = ("value", buffer.getvalue())
    except BaseException as error:  # noqa: BLE001  (everything a rank raises goes back to the caller)
        answer = answer or _failure(error)
    sender.send(answer)
    sender.close()


def _failure(error: BaseException) -> tuple:
    """("raised", kind, message, traceback, when): when is time.monotonic(), the same clock in every process."""
    return ("raised", type(error).__name__, str(error), traceback.format_exc(), time.monotonic())


def _die_with_parent() -> None:
    """On Linux, the kernel kills this rank if the process that started it dies first."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
