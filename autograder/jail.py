"""The jail a learner's notebook runs in while it is graded, built with bubblewrap.

What the learner's code sees and can do, by construction:
- an unprivileged identity: a fresh uid of its own (JAIL_UID_BASE + the grader's pid) when the
  grader is root, uid 65534 in a user namespace otherwise; no capabilities, no_new_privs;
- its own PID, network (loopback only, down), IPC, UTS and mount namespaces; when its first process
  (the runner) ends, the kernel ends every process it started;
- a filesystem made of read-only system folders (/usr, /etc), the Python environment, and a copy of
  the parts of flashcourse that answer no exercise (`KEPT_MODULES`), plus a small private /tmp.
  source/, the hidden checks, the reference, the finished engine, the gradebook, other submissions
  and the grader's output are not in it at all;
- limits on CPU time, address space, processes, file size and open files (`Limits`).
The grader talks to the runner inside over two pipes (autograder/wire.py) and shares no writable
file with it. Where no jail can be built, `why_no_jail()` says why and how to get one.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from . import ROOT, wire

LIBRARY = "/opt/flashcourse-grading"   # where the jail sees the runner and the kept modules
KEPT_MODULES = ("__init__.py", "runtime.py", "memory.py", "positions.py", "distributed.py")  # answer no exercise
JAIL_UID_BASE = 1_000_000
NOBODY = 65534
START_TIMEOUT_S = 180


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 3600            # per process
    address_space: int = 12 << 30      # per process; CUDA needs more, so it is lifted where a GPU is passed in
    processes: int = 256               # threads included
    file_size: int = 64 << 20
    open_files: int = 1024
    tmp_bytes: int = 256 << 20         # the private /tmp
    threads: int = 2                   # torch's and OpenMP's threads


class NoJail(RuntimeError):
    """No jail can be built on this machine."""


HOW_TO_GET_ONE = ("Install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap) "
                  "on Linux with user namespaces enabled, or grade inside the course's container image "
                  "(docker build -t flashcourse-grader . ; see the README). To grade notebooks you trust without a "
                  "jail (the course's own samples), pass --trusted.")


@lru_cache(maxsize=None)
def why_no_jail() -> str | None:
    """None when a working jail can be built here, else why not and how to get one."""
    if platform.system() != "Linux":
        return f"learners' notebooks are graded in a Linux jail, and this is {platform.system()}. {HOW_TO_GET_ONE}"
    if not shutil.which("bwrap"):
        return f"bubblewrap (bwrap) is not installed. {HOW_TO_GET_ONE}"
    installed = _answers_in_environment()
    if installed:
        return (f"the Python environment holds a copy of the course's answers ({installed}), which the jail would "
                "show to learners: install the course in editable mode (pip install -e .) instead")
    probe = subprocess.run(_bwrap_argv(Path("/nonexistent"), None) + ["/usr/bin/true"], capture_output=True,
                           text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    if probe.returncode:
        return (f"bubblewrap could not build the jail here ({probe.stderr.strip()[:300]}); user namespaces may be "
                f"disabled (sysctl kernel.unprivileged_userns_clone=1, or an AppArmor profile for bwrap). "
                f"{HOW_TO_GET_ONE}")
    return None


def _answers_in_environment() -> str | None:
    """A copy of flashcourse's finished engine inside the Python environment the jail shows, if any."""
    for prefix in {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}:
        for found in prefix.glob("lib/python3*/site-packages/flashcourse/engine"):
            return str(found)
    return None


def _identity() -> list[str]:
    """bwrap's options for who the jail's processes are, and what wraps the command."""
    if os.geteuid() == 0:
        # Root builds the namespaces itself, then setpriv becomes a uid nobody else uses and drops every
        # capability before the runner starts: the learner's code is never root, not even in a namespace.
        return ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--disable-userns"]


def _become_unprivileged() -> list[str]:
    if os.geteuid() != 0:
        return []
    uid = str(JAIL_UID_BASE + os.getpid() % JAIL_UID_BASE)
    return ["/usr/bin/setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--bounding-set=-all",
            "--inh-caps=-all", "--no-new-privs", "--"]


def _bwrap_argv(library: Path, status_fd: int | None, limits: Limits = Limits()) -> list[str]:
    argv = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--new-session", "--as-pid-1",
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "grading", *_identity()]
    for top in ("/usr", "/etc"):
        argv += ["--ro-bind", top, top]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(limits.tmp_bytes),
             "--tmpfs", "/tmp"]
    for gpu in sorted(Path("/dev").glob("nvidia*")):
        argv += ["--dev-bind", str(gpu), str(gpu)]
    if any(Path("/dev").glob("nvidia*")):
        argv += ["--ro-bind", "/sys", "/sys"]
    # The Python environment, after /tmp: a clone under /tmp keeps its environment visible.
    for keep in sorted({Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}):
        if not str(keep).startswith("/usr/"):
            argv += [*_traversable(keep), "--ro-bind", str(keep), str(keep)]
    if library.exists():
        argv += [*_traversable(Path(LIBRARY)), "--ro-bind", str(library), LIBRARY]
    argv += ["--chdir", "/tmp"]
    if status_fd is not None:
        argv += ["--json-status-fd", str(status_fd)]
    return argv + ["--", *_become_unprivileged()]


def _traversable(path: Path) -> list[str]:
    """Options that create path's parents in the jail as folders its uid may pass through (bwrap's own are 0700)."""
    options = []
    for parent in reversed(path.parents[:-1]):
        if str(parent) not in ("/tmp", "/usr", "/etc") and not str(parent).startswith(("/usr/", "/etc/")):
            options += ["--perms", "0755", "--dir", str(parent)]
    return options


def _library(into: Path) -> Path:
    """The runner, the wire format and the kept flashcourse modules, readable by the jail's uid."""
    library = into / "library"
    (library / "flashcourse").mkdir(parents=True)
    for name in ("runner.py", "wire.py"):
        shutil.copy(ROOT / "autograder" / name, library / name)
    for name in KEPT_MODULES:
        shutil.copy(ROOT / "flashcourse" / name, library / "flashcourse" / name)
    for path in [library, *library.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return library


def _withheld_modules() -> list[str]:
    """flashcourse's modules that the jail does not hold (named so their import can say why it fails)."""
    package = ROOT / "flashcourse"
    names = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    return sorted(f"flashcourse.{n}" for n in names - {Path(m).stem for m in KEPT_MODULES})


def _environment(limits: Limits, gpu: bool) -> dict[str, str]:
    threads = str(limits.threads)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
           "PYTHONPATH": LIBRARY, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8",
           "MPLCONFIGDIR": "/tmp/.matplotlib", "TRITON_CACHE_DIR": "/tmp/.triton",
           "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "FLASHCOURSE_WITHHELD": ",".join(["autograder", *_withheld_modules()])}
    if gpu and "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return env


def _set_limits(limits: Limits, gpu: bool):
    def apply() -> None:
        space = resource.RLIM_INFINITY if gpu else limits.address_space
        for kind, value in ((resource.RLIMIT_CPU, limits.cpu_seconds), (resource.RLIMIT_AS, space),
                            (resource.RLIMIT_NPROC, limits.processes), (resource.RLIMIT_FSIZE, limits.file_size),
                            (resource.RLIMIT_NOFILE, limits.open_files), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(kind, (value, value))
    return apply


def _limits_of(pid: int) -> dict | None:
    """pid's address-space and process limits, or None where this process may not use prlimit(2) on it."""
    try:
        return {kind: resource.prlimit(pid, kind) for kind in (resource.RLIMIT_AS, resource.RLIMIT_NPROC)}
    except PermissionError:
        return None


def _lower_limits(pid: int, address_space: int, processes: int, direct: bool) -> None:
    """Lower pid's hard limits. prlimit(2) on another uid's process needs CAP_SYS_RESOURCE, which root
    lacks in some containers; a process of the jail's own uid may always lower them, so root lends one."""
    if direct:
        resource.prlimit(pid, resource.RLIMIT_AS, (address_space, address_space))
        resource.prlimit(pid, resource.RLIMIT_NPROC, (processes, processes))
        return
    uid = str(os.stat(f"/proc/{pid}").st_uid)
    subprocess.run(["/usr/bin/setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--",
                    "/usr/bin/prlimit", "--pid", str(pid), f"--as={address_space}:{address_space}",
                    f"--nproc={processes}:{processes}"], check=True, capture_output=True, timeout=30)


def vm_size(pid: int) -> int:
    """Bytes of address space a process has mapped, as the kernel counts it (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """Every living process below pid (in the jail, orphans are reparented to the runner, pid 1)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Jail:
    """One notebook's kernel in a jail (or, for trusted notebooks where none can be built, without one)."""

    def __init__(self, limits: Limits = Limits(), jailed: bool = True):
        self.limits, self.jailed = limits, jailed
        self.gpu = any(Path("/dev").glob("nvidia*"))
        self.process: subprocess.Popen | None = None
        self.pid = 0            # the runner's pid, as this machine sees it
        self.start_size = 0     # the runner's address space once started, before any notebook code
        self.spent = False      # limits were lowered for a measurement and could not be raised again
        self.folder = Path(tempfile.mkdtemp(prefix="flashcourse-jail-"))

    def start(self) -> None:
        grader_in, jail_out = os.pipe()
        jail_in, grader_out = os.pipe()
        status_in, status_out = os.pipe()
        library = _library(self.folder)
        if self.jailed:
            argv = _bwrap_argv(library, status_out, self.limits)
            runner = f"{LIBRARY}/runner.py"
        else:
            argv, runner = [], str(library / "runner.py")
        env = _environment(self.limits, self.gpu)
        if not self.jailed:
            env["PYTHONPATH"] = str(library)
        self.log = tempfile.TemporaryFile(dir=self.folder)
        self.process = subprocess.Popen(
            [*argv, sys.executable, runner, str(jail_in), str(jail_out)], env=env, cwd="/tmp",
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, pass_fds=(jail_in, jail_out, status_out),
            start_new_session=True, preexec_fn=_set_limits(self.limits, self.gpu))
        for fd in (jail_in, jail_out, status_out):
            os.close(fd)
        self.reader, self.writer = grader_in, grader_out
        self.pid = self._runner_pid(status_in) if self.jailed else self.process.pid
        os.close(status_in)
        try:
            wire.receive(self.reader, time.monotonic() + START_TIMEOUT_S)
        except (wire.Closed, wire.TimedOut, wire.Malformed):
            self.close()
            raise NoJail(f"the grading kernel did not start: {self._log_tail()}") from None
        self.start_size = vm_size(self.pid)

    def _runner_pid(self, status_fd: int) -> int:
        """bwrap reports the pid of the jail's first process (the runner: --as-pid-1) as JSON."""
        text, deadline = b"", time.monotonic() + START_TIMEOUT_S
        while b"}" not in text and time.monotonic() < deadline:
            if select.select([status_fd], [], [], 1.0)[0]:
                chunk = os.read(status_fd, 4096)
                if not chunk:
                    break
                text += chunk
        try:
            return int(json.loads(text[:text.index(b"}") + 1])["child-pid"])
        except (ValueError, KeyError):
            self.close()
            raise NoJail(f"bubblewrap did not start the jail: {self._log_tail()}") from None

    def _log_tail(self) -> str:
        self.log.seek(0, os.SEEK_END)
        self.log.seek(max(0, self.log.tell() - 2000))
        return self.log.read().decode(errors="replace").strip() or "no message"

    def ask(self, request: dict, tensors: dict | None, deadline: float) -> tuple[dict, dict]:
        """Send one request and wait for its answer; wire.TimedOut, Closed or Malformed otherwise."""
        try:
            wire.send(self.writer, request, tensors)
        except (BrokenPipeError, OSError):
            raise wire.Closed() from None
        return wire.receive(self.reader, deadline)

    def others(self) -> list[int]:
        """The jail's processes other than the runner: whatever the notebook started."""
        return descendants(self.pid) if self.pid else []

    @contextmanager
    def memory_limited(self, address_space: int):
        """Within: the runner cannot map more than address_space bytes nor start a process or thread,
        and every other process of the jail is stopped. Set from outside; the notebook cannot lift it.

        Raising a hard limit again needs CAP_SYS_RESOURCE; where the grader lacks it, the limits stay
        and `spent` becomes True: the kernel should then be replaced before more of the notebook runs.
        """
        stopped: set[int] = set()
        old = _limits_of(self.pid)
        _lower_limits(self.pid, address_space, processes=0, direct=old is not None)
        while True:  # until no process escaped the stop by being born during it
            fresh = set(self.others()) - stopped
            if not fresh:
                break
            for pid in fresh:
                with _gone_is_fine():
                    os.kill(pid, signal.SIGSTOP)
            stopped |= fresh
        try:
            yield
        finally:
            try:
                for kind, value in (old or {}).items():
                    resource.prlimit(self.pid, kind, value)
                self.spent = old is None
            except (PermissionError, ProcessLookupError):
                self.spent = True
            for pid in stopped:
                with _gone_is_fine():
                    os.kill(pid, signal.SIGCONT)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def close(self) -> int:
        """Stop the jail and everything in it; the number of processes the notebook had left running."""
        others = self.others() if self.alive() else []
        for fd in ("reader", "writer"):
            with _gone_is_fine():
                os.close(getattr(self, fd))
            setattr(self, fd, -1)
        if self.process is not None:
            with _gone_is_fine():
                os.kill(self.pid, signal.SIGKILL)   # pid 1 of the jail: its namespace ends with it
            with _gone_is_fine():
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if not self.jailed:  # no namespace to end them: each one it had is killed by pid
            for pid in others:
                with _gone_is_fine():
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.folder, ignore_errors=True)
        return len(others)


@contextmanager
def _gone_is_fine():
    try:
        yield
    except (ProcessLookupError, PermissionError, OSError):
        pass
