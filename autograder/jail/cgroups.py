"""Each jail's processes and memory counted in a control group of its own (cgroup v2, or v1's memory and pids
hierarchies), so that no jail draws on a pool another jail shares.

Without it, a root grader's jails are apart only by uid (RLIMIT_NPROC counts each jail's uid), and an ordinary
user's jails are not apart at all: RLIMIT_NPROC counts every process of the grader's uid, so a notebook holding
~250 sleeping processes makes fork fail in every jail beside it; and no per-process limit sees memory held in a
memfd or a tmpfs, which no process's address space or resident size need show. A cgroup counts both: pids.max
every task of the jail, memory.max (v1: memory.limit_in_bytes) every page charged to it, memfd and tmpfs pages
included; past it the kernel's OOM killer ends a process of that jail, never one of another.

`place()` finds where this process may make such groups: as root, in the cgroup v2 tree (a `flashcourse` group
below the root, or below its own group) or beside its own group in v1's memory and pids hierarchies; as an
ordinary user, only in a group delegated to it (one it can write, whose controllers it may enable). None where
there is none: the grader then says so and, unless it is root, grades one notebook at a time (autograder/grading/batch.py).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CONTROLLERS = ("memory", "pids")
_names = itertools.count()


@dataclass(frozen=True)
class Place:
    version: int                 # 2, or 1 for v1's separate hierarchies
    parents: tuple[str, ...]     # the folders a jail's groups are made in: one (v2), or memory's and pids' (v1)


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, super options) of every cgroup mount this process sees."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        kind, _, options = (after.split() + ["", "", ""])[:3]
        if kind in ("cgroup", "cgroup2"):
            found.append((before.split()[4].replace("\\040", " "), kind, set(options.split(","))))
    return found


def _own() -> dict[str, str]:
    """This process's group in each hierarchy: {"": v2 path, "memory": v1 path, ...}."""
    groups = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            groups[name] = path
    return groups


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _can_make_groups(parent: Path) -> bool:
    probe = parent / f"flashcourse-probe-{os.getpid()}-{next(_names)}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        probe.rmdir()
    except OSError:
        pass
    return True


def _enable(group: Path) -> bool:
    """Whether the controllers are enabled, or could be, for group's children (cgroup v2)."""
    try:
        if set(CONTROLLERS) <= set((group / "cgroup.subtree_control").read_text().split()):
            return True
        _write(group / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
        return True
    except OSError:
        return False


def move_to_leaf(group: Path, name: str) -> None:
    """Move every process of `group` into its child `name` (made if missing): in cgroup v2 a group with processes
    of its own cannot enable controllers for its children. OSError where the leaf cannot be made."""
    leaf = group / name
    leaf.mkdir(exist_ok=True)
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            _write(leaf / "cgroup.procs", pid)
        except OSError:          # it ended meanwhile, or is a kernel thread
            pass


def _v2(mount: Path, own: str) -> Place | None:
    if not set(CONTROLLERS) <= set((mount / "cgroup.controllers").read_text().split()):
        return None
    mine = mount / own.lstrip("/")
    if os.geteuid() == 0 and _enable(mount):  # beside every other group: nothing of the grader's is moved
        ours = mount / "flashcourse"
        try:
            ours.mkdir(exist_ok=True)
        except OSError:
            pass
        if ours.is_dir() and _enable(ours) and _can_make_groups(ours):
            return Place(2, (str(ours),))
    if not os.access(mine, os.W_OK):
        return None
    if not _enable(mine):
        # A group with processes of its own cannot give its children controllers: where the group is this
        # grader's to manage (delegated to it, or a container's own), its processes move to a leaf first.
        try:
            move_to_leaf(mine, "flashcourse-grader")
        except OSError:
            return None
        if not _enable(mine):
            return None
    return Place(2, (str(mine),)) if _can_make_groups(mine) else None


def _v1(mounts: list[tuple[str, str, set[str]]], own: dict[str, str]) -> Place | None:
    parents = []
    for controller in CONTROLLERS:
        mount = next((Path(m) for m, kind, options in mounts if kind == "cgroup" and controller in options), None)
        if mount is None or controller not in own:
            return None
        parent = mount / own[controller].lstrip("/")
        if not parent.is_dir() or not _can_make_groups(parent):
            return None
        parents.append(str(parent))
    return Place(1, tuple(parents))


PLACE_ENV = "FLASHCOURSE_CGROUPS"  # the place found once by the batch grader, for the processes it starts


def export() -> None:
    """Hand this process's place to the processes it starts, so they neither look again nor move anything."""
    found = place()
    # The uid goes with it: a process of another user that inherits the variable looks for itself.
    os.environ[PLACE_ENV] = ":".join([str(os.geteuid()), *([] if found is None else [str(found.version), *found.parents])])


@lru_cache(maxsize=None)
def place() -> Place | None:
    """Where this process can make a jail's groups, or None."""
    inherited = os.environ.get(PLACE_ENV, "").split(":")  # uid, then the version and the parents, if any
    if inherited[0] == str(os.geteuid()):
        parents = inherited[2:]
        return Place(int(inherited[1]), tuple(parents)) if parents and all(map(os.path.isdir, parents)) else None
    try:
        mounts, own = _mounts(), _own()
        v2 = next((Path(m) for m, kind, _ in mounts if kind == "cgroup2"), None)
        if v2 is not None and "" in own and (v2 / "cgroup.controllers").exists():
            found = _v2(v2, own[""])
            if found:
                return found
        return _v1(mounts, own)
    except (OSError, ValueError):
        return None


def why_not() -> str | None:
    """None where each jail can have its own groups; else why not, in words."""
    if place() is not None:
        return None
    who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    return (f"no cgroup with the memory and pids controllers can be made here by {who} (no cgroup file system "
            "mounted writable, or none delegated to this user)")


class Accounting:
    """One jail's groups: a limit on its tasks (pids.max) and on the memory charged to it (memory.max)."""

    def __init__(self, processes: int, memory: int, where: Place):
        self.where, self.processes, self.memory = where, processes, memory
        # pids may repeat across PID namespaces that share a hierarchy (containers on one host): a random part too
        name = f"flashcourse-{os.getpid()}-{next(_names)}-{os.urandom(4).hex()}"
        self.groups = [Path(parent) / name for parent in where.parents]
        made = []
        try:
            for group in self.groups:
                group.mkdir()
                made.append(group)
            if where.version == 2:
                group = self.groups[0]
                _write(group / "pids.max", str(processes))
                _write(group / "memory.max", str(memory))
                if (group / "memory.swap.max").exists():
                    _write(group / "memory.swap.max", "0")
            else:
                memory_group, pids_group = self.groups
                _write(memory_group / "memory.limit_in_bytes", str(memory))
                if (memory_group / "memory.memsw.limit_in_bytes").exists():
                    try:
                        _write(memory_group / "memory.memsw.limit_in_bytes", str(memory))
                    except OSError:
                        pass
                _write(pids_group / "pids.max", str(processes))
        except OSError:
            for group in made:
                try:
                    group.rmdir()
                except OSError:
                    pass
            raise

    def join(self) -> None:
        """Move the calling process into the groups (bubblewrap's preexec_fn: all the jail is born inside)."""
        self.add(os.getpid())

    def add(self, pid: int) -> None:
        """Move pid, every thread of it, into the groups; its children to come are born there."""
        for group in self.groups:
            _write(group / "cgroup.procs", str(pid))

    def _events(self, group: Path, name: str) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in (line.split() for line in (group / name).read_text().splitlines())}
        except (OSError, ValueError):
            return {}

    def hits(self) -> list[str]:
        """Which of its own limits the jail ran into, in words (empty when none)."""
        if self.where.version == 2:
            pids, memory = self._events(self.groups[0], "pids.events"), self._events(self.groups[0], "memory.events")
        else:
            pids = self._events(self.groups[1], "pids.events")
            memory = self._events(self.groups[0], "memory.oom_control")
        said = []
        if pids.get("max", 0):
            said.append(f"it reached its limit of {self.processes} processes and threads (a new one was refused "
                        f"{pids['max']} time(s))")
        if memory.get("oom_kill", 0) or memory.get("oom", 0):
            said.append(f"it ran out of its {self.memory >> 20} MiB of memory (memfd and /tmp pages included), and "
                        f"the kernel ended {max(memory.get('oom_kill', 0), 1)} of its processes")
        return said

    def _pids(self) -> list[int]:
        found = set()
        for group in self.groups:
            try:
                found |= {int(p) for p in (group / "cgroup.procs").read_text().split()}
            except (OSError, ValueError):
                pass
        return sorted(found)

    def close(self, timeout: float = 5.0) -> None:
        """Kill whatever is left in the groups and remove them."""
        deadline = time.monotonic() + timeout
        while True:
            left = self._pids()
            if not left:
                break
            if self.where.version == 2 and (self.groups[0] / "cgroup.kill").exists():
                try:
                    _write(self.groups[0] / "cgroup.kill", "1")
                except OSError:
                    pass
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        for group in self.groups:
            for _ in range(100):
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # the last process is still being torn down
                    time.sleep(0.02)
