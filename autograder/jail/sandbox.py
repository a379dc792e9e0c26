"""The jail a learner's notebook runs in while it is graded, built with bubblewrap.

What the learner's code sees and can do, by construction:
- an unprivileged identity: a fresh uid of its own (JAIL_UID_BASE + the grader's pid) when the
  grader is root, uid 65534 in a user namespace otherwise; no capabilities, no_new_privs;
- its own PID, network (loopback only, down), IPC, UTS and mount namespaces; when its first process
  (the runner) ends, the kernel ends every process it started;
- a filesystem made of read-only system folders (/usr, /etc), the Python environment, and a copy of
  the learner's library (flashcourse's own modules, which answer no exercise: `kept_modules()`), plus a
  small private /tmp.
  source/, the hidden checks, the reference, the finished engine, the gradebook, other submissions
  and the grader's output are not in it at all;
- limits on CPU time, address space, processes, file size and open files (`Limits`), and, where a control
  group can be made for it (autograder/jail/cgroups.py), a group of its own that caps its tasks and the memory
  charged to it (memfd and tmpfs pages included), so that no jail draws on a pool another jail shares.
The grader talks to the runner inside over two pipes (autograder/jail/inside/wire.py) and shares no writable
file with it. Where no jail can be built, `why_no_jail()` says why and how to get one.

A kernel starts in one of two ways with the same properties: bubblewrap starts a fresh interpreter
(about 1.5 s of imports), or, where the grader is root, a warm `Template` (autograder/jail/inside/forkserver.py,
jailed itself) forks it with torch and IPython already imported, and the fork builds its own
namespaces, mounts, limits and identity before the notebook runs (about 0.1 s).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache, partial
from pathlib import Path

from flashcourse import DEVICE_ENV

from autograder import ROOT
from autograder.jail import cgroups
from autograder.jail.inside import wire
from autograder.jail.inside import limits as kernel_limits

LIBRARY = "/opt/flashcourse-grading"   # where the jail sees the runner and the kept modules
ANOMALIES_ENV = "FLASHCOURSE_ANOMALIES"  # a file the batch grader reads the anomalies from
INSIDE = Path(__file__).resolve().parent / "inside"   # the programs that run in the jail, copied into it whole
JAIL_UID_BASE = 1_000_000
NOBODY = 65534
START_TIMEOUT_S = 180
MEMORY_ENV = "FLASHCOURSE_JAIL_MEMORY"  # each jail's memory (its cgroup's memory.max), in bytes, if not the default
PROCESS_MARGIN = 64  # as root, RLIMIT_NPROC above pids.max: the jail's own group is what refuses, and says so


def _memory_default() -> int:
    try:
        return int(os.environ.get(MEMORY_ENV) or 0) or (6 << 30)
    except ValueError:
        return 6 << 30


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 3600            # per process
    address_space: int = 12 << 30      # per process; CUDA needs more, so it is lifted where a GPU is passed in
    processes: int = 256               # threads included: the jail's pids.max, else RLIMIT_NPROC
    file_size: int = 64 << 20
    open_files: int = 1024
    tmp_bytes: int = 256 << 20         # the private /tmp
    threads: int = 1                   # torch's and OpenMP's threads: notebooks are graded side by side, one per core
    memory: int = field(default_factory=_memory_default)  # all the jail's charged pages, where it has a cgroup


class NoJail(RuntimeError):
    """No jail can be built on this machine."""


# Resident memory a measured call may add beyond its allowance, for the allocator's slack: freed blocks it keeps
# and the heap it grows in steps. Pages of files (the libraries a forked process maps again as it touches them,
# some 70 MiB in 06's probe) are not counted at all: they cannot hold the learner's data.
RESIDENT_MARGIN = 64 << 20


class MeasurementRefused(RuntimeError):
    """The jail's processes did not follow the protocol of a measured call."""


class NotAlone(MeasurementRefused):
    """Another process of the jail ran during a measured call: what it measured says nothing of memory."""


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
        # capability, the bounding set too (which CAP_SETPCAP allows), before the runner starts: the
        # learner's code is never root, not even in a namespace.
        return ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    return ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--disable-userns"]


def _jail_uid() -> int:
    """The uid of the kernels this process starts as root: one no other grading process uses."""
    return JAIL_UID_BASE + os.getpid() % JAIL_UID_BASE


def _become_unprivileged() -> list[str]:
    if os.geteuid() != 0:
        return []
    uid = str(_jail_uid())
    return ["/usr/bin/setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--bounding-set=-all",
            "--inh-caps=-all", "--no-new-privs", "--"]


# What the kernel template keeps of root's power: building namespaces and mounts, bringing up a loopback
# interface, dropping capabilities and identity in each kernel it forks, and killing a kernel whose grading
# process is gone (autograder/jail/inside/forkserver.py).
TEMPLATE_CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_KILL")


def gpus() -> list[Path]:
    """The GPU device files a kernel is given: none when grading is told to run on the CPU."""
    return [] if os.environ.get(DEVICE_ENV) == "cpu" else sorted(Path("/dev").glob("nvidia*"))


def _bwrap_argv(library: Path, status_fd: int | None, limits: Limits = Limits(), template: bool = False) -> list[str]:
    identity = ["--cap-drop", "ALL", *(x for cap in TEMPLATE_CAPABILITIES for x in ("--cap-add", cap))] \
        if template else _identity()
    argv = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--new-session", "--as-pid-1",
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "grading", *identity]
    for top in ("/usr", "/etc"):
        argv += ["--ro-bind", top, top]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(limits.tmp_bytes),
             "--tmpfs", "/tmp", "--perms", "1777", "--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm"]
    devices = gpus()
    for gpu in devices:
        argv += ["--dev-bind", str(gpu), str(gpu)]
    if devices:
        argv += ["--ro-bind", "/sys", "/sys"]
    # The Python environment, after /tmp: a clone under /tmp keeps its environment visible.
    for keep in sorted({Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}):
        if not str(keep).startswith("/usr/"):
            argv += [*_traversable(keep), "--ro-bind", str(keep), str(keep)]
    if library.exists():
        argv += [*_traversable(Path(LIBRARY)), "--ro-bind", str(library), LIBRARY]
    # bubblewrap builds the root and /dev on tmpfs of its own, of no size limit, which an ordinary user's jail
    # owns: read-only, so that only /tmp and /dev/shm, within their sizes, take writes.
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]
    if status_fd is not None:
        argv += ["--json-status-fd", str(status_fd)]
    return argv + ["--", *([] if template else _become_unprivileged())]


def _traversable(path: Path) -> list[str]:
    """Options that create path's parents in the jail as folders its uid may pass through (bwrap's own are 0700)."""
    options = []
    for parent in reversed(path.parents[:-1]):
        if str(parent) not in ("/tmp", "/usr", "/etc") and not str(parent).startswith(("/usr/", "/etc/")):
            options += ["--perms", "0755", "--dir", str(parent)]
    return options


def kept_modules() -> list[Path]:
    """The learner's library: flashcourse's own modules. Its subpackages (the checks, the engine, the
    benchmarks, the explorers, which draw the right answer) serve others and stay out of the jail."""
    return sorted((ROOT / "flashcourse").glob("*.py"))


def _library(into: Path) -> Path:
    """The programs of autograder/jail/inside and the learner's library, readable by the jail's uid."""
    library = into / "library"
    (library / "flashcourse").mkdir(parents=True)
    for path in INSIDE.glob("*.py"):
        shutil.copy(path, library / path.name)
    for path in kept_modules():
        shutil.copy(path, library / "flashcourse" / path.name)
    for path in [library, *library.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return library


def _withheld_modules() -> list[str]:
    """flashcourse's modules that the jail does not hold (named so their import can say why it fails)."""
    package = ROOT / "flashcourse"
    return sorted(f"flashcourse.{p.name}" for p in package.iterdir() if (p / "__init__.py").exists())


def _environment(limits: Limits, gpu: bool) -> dict[str, str]:
    threads = str(limits.threads)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
           "PYTHONPATH": LIBRARY, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8",
           "MPLCONFIGDIR": "/tmp/.matplotlib",
           "MPLBACKEND": "module://inline_plots", "TRITON_CACHE_DIR": "/tmp/.triton",
           "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           # torch's CPU tensors of 2 MiB and more in huge pages: a measured call unmaps each block it frees
           # (runner.measured_call), so each new one is faulted in again, 2 MiB at a time instead of 4 KiB
           "THP_MEM_ALLOC_ENABLE": "1",
           "FLASHCOURSE_WITHHELD": ",".join(["autograder", *_withheld_modules()])}
    if gpu and "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    if DEVICE_ENV in os.environ:  # the kernel grades on the device the grader was told to use
        env[DEVICE_ENV] = os.environ[DEVICE_ENV]
    return env


def _set_limits(limits: Limits, gpu: bool, accounting: "cgroups.Accounting | None" = None):
    """bubblewrap's preexec_fn: into the jail's own groups, if it has some, then the kernel's limits, set before
    it becomes the kernel."""
    apply = partial(kernel_limits.apply, asdict(limits), gpu)
    if accounting is None:
        return apply

    def join_then_apply() -> None:
        accounting.join()
        apply()
    return join_then_apply


def _process_limit(limits: Limits, accounted: bool) -> Limits:
    """The limits with the RLIMIT_NPROC a kernel gets. RLIMIT_NPROC counts every process of a uid: as root each
    jail has a uid of its own, but an ordinary user's jails all count against the grader's uid, one pool. Where
    the jail has its own group, pids.max is its limit; RLIMIT_NPROC is then a margin above it (root) or the
    grader's own (a user), so that no jail's processes count against another's."""
    if not accounted:
        return limits
    if os.geteuid() == 0:
        return replace(limits, processes=limits.processes + PROCESS_MARGIN)
    return replace(limits, processes=resource.getrlimit(resource.RLIMIT_NPROC)[1])


def isolation() -> str | None:
    """None where jails graded side by side share no pool of processes or memory: each has its own cgroup, or
    the grader is root (a uid per jail counts its processes). Otherwise why not: grade one at a time."""
    why = cgroups.why_not()
    if why is None or os.geteuid() == 0:
        return None
    return (f"{why}, so every jail's processes count against the grader's one RLIMIT_NPROC and memory held in "
            "memfds is counted nowhere")


def _report(hits: list[str]) -> None:
    """Name the limits a notebook ran into: in the batch grader's anomalies file, else on stderr."""
    lines = [f"the notebook hit its own limit: {hit}" for hit in hits]
    if os.environ.get(ANOMALIES_ENV):
        with open(os.environ[ANOMALIES_ENV], "a") as f:
            f.writelines(f"{line}\n" for line in lines)
    else:
        sys.stderr.writelines(f"{line}\n" for line in lines)


def _lower_limits(pid: int, address_space: int, processes: int) -> None:
    """Lower pid's hard limits. prlimit(2) on another uid's process needs CAP_SYS_RESOURCE, which root
    lacks in some containers; a process of the jail's own uid may always lower them, so root lends one."""
    try:
        resource.prlimit(pid, resource.RLIMIT_AS, (address_space, address_space))
        resource.prlimit(pid, resource.RLIMIT_NPROC, (processes, processes))
        return
    except PermissionError:
        pass
    uid = str(os.stat(f"/proc/{pid}").st_uid)
    subprocess.run(["/usr/bin/setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--",
                    "/usr/bin/prlimit", "--pid", str(pid), f"--as={address_space}:{address_space}",
                    f"--nproc={processes}:{processes}"], check=True, capture_output=True, timeout=30)


def _writable_resident(pid: int) -> int:
    """Bytes of PID's resident pages that can hold data (anonymous and shared memory; not files' pages)."""
    return _status_bytes(pid, "RssAnon") + _status_bytes(pid, "RssShmem")


def _status_bytes(pid: int, field: str) -> int:
    """A size from /proc/PID/status ("VmSize", "VmHWM", "RssAnon"...), in bytes; 0 once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def vm_size(pid: int) -> int:
    """Bytes of address space a process has mapped, as the kernel counts it (0 once it is gone)."""
    return _status_bytes(pid, "VmSize")


def _cpu_used(pid: int) -> dict[int, int]:
    """Nanoseconds on a CPU of each living thread of pid, by thread id (the scheduler's own count, exact where
    clock ticks would hide short work); {} once it is gone."""
    used = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            used[int(stat.parent.name)] = int(stat.read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return used


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


def _first_pid(status_fd: int) -> int | None:
    """The pid of a jail's first process (--as-pid-1), from bubblewrap's JSON status; None if none came."""
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
        return None


TEMPLATE_ENV = "FLASHCOURSE_KERNEL_TEMPLATE"  # "control fd,pid" of a Template, for the processes it was started for


class TemplateGone(Exception):
    """The kernel template cannot start a kernel (it has ended, or it answered with an error)."""


class Template:
    """A warm template of notebook kernels in a jail of its own (autograder/jail/inside/forkserver.py): `spawn` forks a
    kernel with torch and IPython already imported, in namespaces and under a uid of its own. Only a
    root grader can have one: bubblewrap keeps capabilities only for root. It ends with the process that
    started it; processes forked after `export` (the warm server's commands) find it in TEMPLATE_ENV."""

    def __init__(self, limits: Limits = Limits()):
        if os.geteuid() != 0:
            raise NoJail("a kernel template needs a root grader")
        self.folder = Path(tempfile.mkdtemp(prefix="flashcourse-template-"))
        control, inside = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        status_in, status_out = os.pipe()
        self.log = tempfile.TemporaryFile(dir=self.folder)
        self.process = subprocess.Popen(
            [*_bwrap_argv(_library(self.folder), status_out, limits, template=True), sys.executable,
             f"{LIBRARY}/forkserver.py", str(inside.fileno())],
            env=_environment(limits, bool(gpus())), cwd="/tmp", stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=self.log, pass_fds=(inside.fileno(), status_out), start_new_session=True)
        inside.close()
        os.close(status_out)
        self.pid = _first_pid(status_in) or 0
        os.close(status_in)
        self.control = control
        control.settimeout(START_TIMEOUT_S)
        try:
            ready = control.recv(4096)
        except OSError:
            ready = b""
        control.settimeout(None)
        if ready != b'{"ready": true}' or not self.pid:
            self.close()
            self.log.seek(0)
            raise NoJail(f"the kernel template did not start: {self.log.read()[-2000:].decode(errors='replace')}")

    @staticmethod
    def inherited() -> "Template | None":
        """The template this process was given through TEMPLATE_ENV, if any (one object per process)."""
        return _template_from(os.environ.get(TEMPLATE_ENV, ""))

    def export(self) -> None:
        """Let the processes this one forks from now on start their kernels from this template."""
        os.environ[TEMPLATE_ENV] = f"{self.control.fileno()},{self.pid}"

    def spawn(self, limits: Limits, gpu: bool, in_fd: int, out_fd: int, log_fd: int) -> tuple[int, socket.socket]:
        """Fork a kernel reading in_fd and writing out_fd: its pid as this machine sees it, and its lifeline, a
        socket whose closing ends the kernel (as it closes when this process dies, killed or not)."""
        request = {"uid": _jail_uid(), "limits": asdict(limits), "gpu": gpu}
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                socket.send_fds(self.control, [json.dumps(request).encode()], [theirs.fileno(), in_fd, out_fd, log_fd])
            except OSError as error:
                raise TemplateGone(f"the kernel template is gone ({error})") from None
            finally:
                theirs.close()
            mine.settimeout(START_TIMEOUT_S)
            try:
                answer = json.loads(mine.recv(4096) or b"{}")
            except (OSError, ValueError):
                answer = {}
            if not isinstance(answer.get("pid"), int):
                raise TemplateGone(f"the kernel template did not fork a kernel: {answer.get('error', 'no answer')}")
            for pid in descendants(self.pid):  # its pid in the template's namespace, as this machine numbers it
                try:
                    spaces = next(line.split()[1:] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                                  if line.startswith("NSpid:"))
                except (OSError, StopIteration):
                    continue
                if len(spaces) >= 2 and int(spaces[1]) == answer["pid"]:
                    return pid, mine
            raise TemplateGone("the kernel the template forked could not be found")
        except BaseException:
            mine.close()
            raise

    def close(self) -> None:
        self.control.close()
        if self.process is not None:
            with _gone_is_fine():
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            shutil.rmtree(self.folder, ignore_errors=True)


@lru_cache(maxsize=None)
def _template_from(exported: str) -> Template | None:
    """The Template that `export` described as "control fd,pid", or None if there is none."""
    try:
        fd, pid = (int(x) for x in exported.split(","))
        os.fstat(fd)
    except (ValueError, OSError):
        return None
    template = Template.__new__(Template)
    template.control, template.pid, template.process = socket.socket(fileno=os.dup(fd)), pid, None
    return template


class Jail:
    """One notebook's kernel in a jail (or, for trusted notebooks where none can be built, without one)."""

    def __init__(self, limits: Limits = Limits(), jailed: bool = True, template: Template | None = None):
        self.limits, self.jailed = limits, jailed
        self.template = (template or Template.inherited()) if jailed else None
        self.gpu = bool(gpus())
        self.process: subprocess.Popen | None = None   # bubblewrap, for a kernel it started
        self.pidfd = -1         # the runner's, for a kernel forked by the template
        self.lifeline: socket.socket | None = None  # and the socket whose closing ends that kernel
        self.pid = 0            # the runner's pid, as this machine sees it
        self.start_size = 0     # the runner's address space once started, before any notebook code
        self.start_resident = 0  # and its resident memory that can hold data (_writable_resident)
        self.resident_limit = 0  # the most a measured call's process may have resident at its peak
        self.stopped_cpu: dict[int, dict[int, int]] = {}  # the jail's other processes' threads during that call
        self.said_from = 0      # where in the log a call on ranks began
        self.folder = Path(tempfile.mkdtemp(prefix="flashcourse-jail-"))
        self.log = None         # what the kernel printed outside the protocol (start-up errors)
        self.accounting: cgroups.Accounting | None = None  # the jail's own cgroups, where some can be made
        self.hits: list[str] = []  # the limits of its own it ran into, once closed

    def _account(self) -> None:
        """The jail's own groups, where this machine lets the grader make them; NoJail if making them failed."""
        where = cgroups.place() if self.jailed else None
        if where is None:
            return
        try:
            self.accounting = cgroups.Accounting(self.limits.processes, self.limits.memory, where)
        except OSError as error:
            raise NoJail(f"the jail's own cgroup could not be made: {error}") from None

    def start(self) -> None:
        self._account()
        if self.template is not None:
            try:
                return self._start_from_template()
            except TemplateGone:
                self.template = None  # bubblewrap then starts a kernel the slow way, with the same properties
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
            start_new_session=True,
            preexec_fn=_set_limits(_process_limit(self.limits, self.accounting is not None), self.gpu, self.accounting))
        for fd in (jail_in, jail_out, status_out):
            os.close(fd)
        self.reader, self.writer = grader_in, grader_out
        self.pid = (_first_pid(status_in) or 0) if self.jailed else self.process.pid
        os.close(status_in)
        if not self.pid:
            tail = self._log_tail()
            self.close()
            raise NoJail(f"bubblewrap did not start the jail: {tail}")
        self._wait_until_ready()

    def _start_from_template(self) -> None:
        grader_in, jail_out = os.pipe()
        jail_in, grader_out = os.pipe()
        self.log = tempfile.TemporaryFile(dir=self.folder)
        self.reader, self.writer = grader_in, grader_out
        try:
            try:
                self.pid, self.lifeline = self.template.spawn(
                    _process_limit(self.limits, self.accounting is not None), self.gpu, jail_in, jail_out,
                    self.log.fileno())
                self.pidfd = os.pidfd_open(self.pid)  # signals reach this kernel, never a later process given its pid
            except ProcessLookupError:
                raise TemplateGone("the kernel the template forked has already ended") from None
        except TemplateGone:  # nothing was started: the caller starts a kernel the slow way
            for fd in (grader_in, grader_out):
                os.close(fd)
            self.log.close()
            self.log, self.pid = None, 0
            raise
        finally:
            os.close(jail_in)
            os.close(jail_out)
        if self.accounting is not None:  # into its own groups before its first request: no notebook code ran yet
            try:
                self.accounting.add(self.pid)
            except OSError as error:
                self.close()
                raise NoJail(f"the kernel could not be moved into its own cgroup: {error}") from None
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        try:
            wire.receive(self.reader, time.monotonic() + START_TIMEOUT_S)
        except (wire.Closed, wire.TimedOut, wire.Malformed):
            tail = self._log_tail()
            self.close()
            raise NoJail(f"the grading kernel did not start: {tail}") from None
        self.start_size, self.start_resident = vm_size(self.pid), _writable_resident(self.pid)

    def _log_tail(self) -> str:
        self.log.seek(0, os.SEEK_END)
        self.log.seek(max(0, self.log.tell() - 2000))
        return self.log.read().decode(errors="replace").strip() or "no message"

    def ask(self, request: dict, tensors: dict | None, deadline: float) -> tuple[dict, dict]:
        """Send one request and wait for its answer; wire.TimedOut, Closed or Malformed otherwise. A call
        with "ranks" runs on a process group whose ranks each receive only their own arguments (call_on_ranks)."""
        if request.get("op") == "call" and isinstance(request.get("ranks"), dict):
            return self.call_on_ranks(request, tensors or {}, deadline)
        try:
            wire.send(self.writer, request, tensors)
        except (BrokenPipeError, OSError):
            raise wire.Closed() from None
        return wire.receive(self.reader, deadline)

    def others(self) -> list[int]:
        """The jail's processes other than the runner: whatever the notebook started."""
        return descendants(self.pid) if self.pid else []

    def _stop_others(self, stopped: set[int]) -> None:
        """SIGSTOP every process of the jail but the runner, until none escaped by being born meanwhile."""
        while True:
            fresh = set(self.others()) - stopped
            if not fresh:
                return
            _signal_and_wait(fresh, signal.SIGSTOP)
            stopped |= fresh

    @contextmanager
    def measured_child(self, address_space: int, deadline: float):
        """Within: a child the runner forks for one measured call is the only process of the jail that runs,
        and it cannot map more than address_space bytes nor start a process or thread. Everything else is
        stopped and the limits are set from outside before the child is sent the call; on leaving, the child
        is killed and the rest go on, the runner with its own limits untouched. Yields the child's pid;
        raises MeasurementRefused when the jail's processes do not behave as the runner's protocol says.
        """
        stopped: set[int] = set()
        children: set[int] = set()
        try:
            self._stop_others(stopped)
            answer, _ = self.ask({"op": "fork"}, None, deadline)
            _signal_and_wait({self.pid}, signal.SIGSTOP)
            stopped.add(self.pid)
            self.stopped_cpu = {pid: _cpu_used(pid) for pid in stopped}
            children = set(self.others()) - stopped
            if answer != {"forked": True} or len(children) != 1:
                raise MeasurementRefused("the kernel did not start exactly one process for the measured call")
            child = next(iter(children))
            _lower_limits(child, address_space, processes=0)
            children |= set(self.others()) - stopped
            if children != {child}:  # it started another before its limits were set
                raise MeasurementRefused("the kernel started other processes for the measured call")
            # What it mapped or filled before its limits were set stays usable: as for the runner, at most half
            # of the allowance may be held already, in address space and in resident memory (pages filled
            # inside what start-up had mapped, which the address space does not show).
            allowed = address_space - self.start_size
            held = max(vm_size(child) - self.start_size, _writable_resident(child) - self.start_resident)
            if held > allowed // 2:
                raise MeasurementRefused(f"before the call the notebook's kernel already held {held >> 20} MiB more "
                                         f"than at start-up, and the check allows {allowed >> 20} MiB: delete large "
                                         "tensors that earlier cells keep")
            # The address-space limit does not see memory made usable inside what is already mapped (an
            # mprotect of what start-up reserved, as CUDA maps some 13 GiB): what it makes resident is read too,
            # against the same bound, counted from start-up.
            self.resident_limit = self.start_resident + allowed + RESIDENT_MARGIN
            yield child
        finally:
            _signal_and_wait(children, signal.SIGKILL)  # gone before anything else reads the runner's pipe
            for pid in stopped:
                with _gone_is_fine():
                    os.kill(pid, signal.SIGCONT)

    def call_on_ranks(self, request: dict, tensors: dict, deadline: float) -> tuple[dict, dict]:
        """The learner's function on every rank of a process group started in the jail, each rank fed only its
        own arguments and measured from outside: the answer {"value": [rank 0's, ...]} or {"raised": [...]}.

        Every other process of the jail is stopped. The runner forks a child that starts the ranks (runner.py,
        ranks_call); once all have joined the group, they are stopped too and may start no process or
        thread. Then each rank in turn runs alone while its arguments are written to the jail's pipe, so
        only it can read them, and is refused if it then holds them in memory other processes could read
        (`_dumpable`: every process of the jail is non-dumpable and cannot undo it, limits.confine), so no
        process of the jail ever holds or reads another rank's shards, unless a rank sends them. The ranks then
        run together and answer one after another, and each one's peak resident memory (files' pages aside)
        beyond what it held once it had joined is read before it is killed: with ranks["allowance"] (bytes), a
        rank that held more fails the call with an AssertionError that says so. The kernel starts a forked
        process's peak at what it holds when forked, and the ranks are forked before they join the group and
        hold the most then (measured: the peak equals what they hold), so that is the peak since the arguments
        came; a rank cannot make the kernel forget its peak (its clear_refs, like its other /proc files, is root's).
        With ranks["group_ranks"], the world has ranks["world_size"] ranks, the group's members take the arguments
        in group order and are called with group= it (runner.py, rank_main), and the answer is theirs, in that order.
        """
        from flashcourse import distributed

        ranks = request["ranks"]
        rank_args = wire.decode(request.get("args", {"list": []}), tensors)
        kwargs = wire.decode(request.get("kwargs", {"dict": []}), tensors)
        members = ranks.get("group_ranks")   # a group of ranks["world_size"] ranks: the others take no arguments
        if members is not None:
            try:
                members = distributed.check_group(members, ranks.get("world_size"), len(rank_args))
                rank_args = [rank_args[members.index(rank)] if rank in members else ()
                             for rank in range(int(ranks.get("world_size") or len(members)))]
            except (TypeError, ValueError) as error:
                return {"raised": ["ValueError", str(error)]}, {}
        world_size = len(rank_args)
        timeout_s = float(ranks.get("timeout_s", 60))
        allowance = ranks.get("allowance")
        deadline = min(deadline, time.monotonic() + timeout_s + START_TIMEOUT_S)
        stopped: set[int] = set()
        group: set[int] = set()
        self.said_from = os.fstat(self.log.fileno()).st_size if self.log is not None else 0
        try:
            self._stop_others(stopped)
            kw_tensors: dict = {}
            wire.send(self.writer, {"op": "ranks", "name": request.get("name"), "world_size": world_size,
                                    "backend": str(ranks.get("backend", "gloo")), "timeout_s": timeout_s,
                                    "kwargs": wire.encode(kwargs, kw_tensors), "group": members}, kw_tensors)
            if kw_tensors:
                return {"raised": ["TypeError", "keyword arguments of a call on ranks cannot be tensors"]}, {}
            pids: dict[int, int] = {}   # rank -> pid, as this machine sees it
            while len(pids) < world_size:
                document, _ = wire.receive(self.reader, deadline)
                if "ready" not in document:   # the function is missing, or a rank failed to join
                    return _rank_failure(document, world_size), {}
                pid = _host_pid(self.pid, document.get("pid"))
                if document["ready"] not in range(world_size) or document["ready"] in pids or pid is None:
                    raise MeasurementRefused("the ranks did not say who they are as the protocol says")
                pids[document["ready"]] = pid
            _signal_and_wait({self.pid}, signal.SIGSTOP)
            stopped.add(self.pid)
            group = set(self.others()) - stopped
            _signal_and_wait(group, signal.SIGSTOP)
            group |= set(self.others()) - stopped
            if len(group) != world_size + 1 or not set(pids.values()) < group:
                raise MeasurementRefused(f"the kernel started {len(group)} processes for {world_size} ranks, "
                                         f"want {world_size + 1} (one that starts them, and the ranks)")
            start = {}
            for pid in group:
                _lower_limits(pid, _address_space_limit(pid), processes=0)
            for rank in range(world_size):
                pid = pids[rank]
                start[rank] = _writable_resident(pid)
                there = partial(_running, pid)
                os.kill(pid, signal.SIGCONT)
                encoded: dict = {}
                wire.send(self.writer, {"args": wire.encode(list(rank_args[rank]), encoded)}, encoded, deadline, there)
                if wire.receive(self.reader, deadline, there)[0] != {"got": rank} or _unread(self.writer):
                    raise MeasurementRefused(f"rank {rank} did not take its arguments as the protocol says")
                _signal_and_wait({pid}, signal.SIGSTOP)
                if _dumpable(pid):
                    raise MeasurementRefused(f"rank {rank} holds its arguments in memory that the other ranks could "
                                             "read (it became dumpable: a new program?); a rank's shards reach "
                                             "another rank only if it sends them")
            for pid in pids.values():      # the process that started them stays stopped

                os.kill(pid, signal.SIGCONT)
            answer = self._rank_answers(pids, timeout_s, deadline)
            if "value" in answer and allowance is not None:
                held = {rank: _status_bytes(pid, "VmHWM") - _status_bytes(pid, "RssFile") - start[rank]
                        for rank, pid in pids.items()}
                for rank, pid in pids.items():
                    if not _running(pid) or held[rank] <= 0:
                        return {"raised": ["AssertionError", f"rank {rank} of {world_size} ended before its memory "
                                                             "could be read"]}, {}
                most = max(held, key=held.get)
                if held[most] > int(allowance):
                    return {"raised": ["AssertionError", RING_HELD.format(
                        rank=most, world_size=world_size, held=held[most] / 2**20, allowance=int(allowance) / 2**20,
                        every=", ".join(f"{held[r] / 2**20:.0f}" for r in sorted(held)))]}, {}
            out: dict = {}
            if "value" in answer:
                values = answer["value"] if members is None else [answer["value"][rank] for rank in members]
                answer = {"value": wire.encode(values, out)}
            return answer, out
        except MeasurementRefused as refused:
            return {"raised": ["AssertionError", str(refused)]}, {}
        finally:
            _signal_and_wait(set(self.others()) - stopped, signal.SIGKILL)
            _drain(self.reader)
            for pid in stopped:
                with _gone_is_fine():
                    os.kill(pid, signal.SIGCONT)
            if _unread(self.writer):   # a rank left part of its arguments in the pipe: the runner cannot read on
                raise wire.Malformed("a rank did not read all of its arguments")

    def _rank_answers(self, pids: dict[int, int], timeout_s: float, deadline: float) -> dict:
        """{"value": [each rank's value]}, or {"raised": [...]} for a rank that died (whose death the others'
        errors follow from), else the rank that failed first, a deadline passed or a stall (flashcourse.distributed's
        rules). After a rank fails, the others have distributed.FAILURE_GRACE_S to die or answer."""
        from flashcourse import distributed

        world_size = len(pids)
        values: dict[int, object] = {}
        failed, answered = None, set()   # the first failure, and the ranks that answered or failed
        end = min(deadline, time.monotonic() + timeout_s)
        stall = distributed._Stall(distributed.STALL_S)
        while len(values) < world_size:
            now = time.monotonic()
            if failed is not None and (now >= end or len(answered) == world_size):
                return _rank_failure(failed, world_size)
            if now >= end:
                left = sorted(set(range(world_size)) - set(values))
                return {"raised": ["RanksTimedOut", f"rank(s) {left} of {world_size} did not finish within "
                                                    f"{timeout_s:g} s and were killed: {distributed._DEADLOCK}"]}
            if select.select([self.reader], [], [], min(0.2, end - now))[0]:
                try:
                    document, tensors = wire.receive(self.reader, end, partial(_any_running, list(pids.values())))
                except (wire.Closed, wire.TimedOut):
                    continue
                rank = document.get("rank")
                if rank not in range(world_size) or rank in answered:
                    return {"raised": ["RuntimeError", "the ranks answered out of protocol"]}
                answered.add(rank)
                if "raised" in document:
                    if failed is None:
                        failed, end = document, min(end, time.monotonic() + distributed.FAILURE_GRACE_S)
                    continue
                try:
                    values[rank] = wire.decode(document.get("value"), tensors, device_ok=_cuda_ok)
                except (wire.Malformed, wire.Unsendable) as error:
                    return {"raised": ["RuntimeError", f"rank {rank}'s answer could not be read: {error}"]}
                continue
            for rank, pid in pids.items():
                if rank not in answered and not _running(pid):
                    said = distributed._exit_text(_exit_code(pid), self._said())
                    return {"raised": ["RuntimeError", f"on rank {rank} of {world_size}: died without an answer "
                                                       f"({said})"]}
            stuck = [pid for rank, pid in sorted(pids.items()) if rank not in values]
            if failed is None and stall.seen(stuck):
                left = sorted(set(range(world_size)) - set(values))
                return {"raised": ["RanksTimedOut", f"rank(s) {left} of {world_size} all waited {stall.stall_s:g} s "
                                                    f"without using the CPU and were killed: {distributed._DEADLOCK}"]}
        return {"value": [values[rank] for rank in range(world_size)]}

    def _said(self) -> str:
        """The end of what the jail's processes wrote on their stdout and stderr since the call on ranks began
        (where a rank that gloo aborted says why), read without moving the offset they write at."""
        if self.log is None:
            return ""
        from flashcourse import distributed

        size = os.fstat(self.log.fileno()).st_size
        start = max(0, self.said_from, size - distributed.LAST_WORDS_CHARS)
        return os.pread(self.log.fileno(), size - start, start).decode(errors="replace")

    def check_alone(self, child: int) -> None:
        """After the measured call has answered: NotAlone unless every other process of the jail
        stayed stopped throughout: no process or thread was born or ended, and none ran a nanosecond.
        Signals cannot be kept from the child, which may wake what was stopped; this sees whether it did."""
        if {self.pid, *self.others()} != {*self.stopped_cpu, child} or \
                any(_cpu_used(pid) != used for pid, used in self.stopped_cpu.items()):
            raise NotAlone("another process of the notebook's kernel ran during the measured call: the measured "
                           "function must do its work in the process that calls it")

    def check_resident(self, child: int) -> None:
        """After the measured call has answered: MeasurementRefused unless its process is still there (the
        runner's child waits to be killed) and its peak resident memory, less the file pages it has mapped by
        the end, stayed within resident_limit.

        The kernel keeps only the peak of all resident pages (VmHWM). File pages are mapped again as the
        forked process touches its libraries, more or fewer by chance, and are only added during the call
        (unless the machine runs so short of memory that it drops some), so the peak less those at the end
        is at most what the call held in anonymous and shared memory at its peak: an honest call is never
        refused for the pages of libraries it read.
        """
        peak = _status_bytes(child, "VmHWM") - _status_bytes(child, "RssFile")
        if child not in self.others() or peak <= 0:
            raise MeasurementRefused("the process of the measured call ended before its memory could be read")
        if peak > self.resident_limit:
            raise MeasurementRefused(f"the measured call's process had {peak >> 20} MiB resident at its peak (files' "
                                     f"pages aside), more than the {self.resident_limit >> 20} MiB its allowance "
                                     "permits")

    def ask_child(self, child: int, request: dict, tensors: dict | None, deadline: float) -> tuple[dict, dict]:
        """ask, answered by the measured child: wire.Closed as soon as the child is gone without an answer
        (the runner, stopped, still holds the pipes open)."""
        def there() -> bool:
            return child in self.others()

        try:
            wire.send(self.writer, request, tensors, deadline, there)
        except (BrokenPipeError, OSError):
            raise wire.Closed() from None
        return wire.receive(self.reader, deadline, there)

    def alive(self) -> bool:
        if self.pidfd >= 0:  # forked by the template: the descriptor becomes readable when it ends
            return not select.select([self.pidfd], [], [], 0)[0]
        return self.process is not None and self.process.poll() is None

    def close(self) -> int:
        """Stop the jail and everything in it; the number of processes the notebook had left running."""
        others = self.others() if self.alive() else []
        for fd in ("reader", "writer"):
            with _gone_is_fine():
                os.close(getattr(self, fd))
            setattr(self, fd, -1)
        if self.pidfd >= 0:  # pid 1 of the jail: its namespace ends with it
            with _gone_is_fine():
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            select.select([self.pidfd], [], [], 10)
            os.close(self.pidfd)
            self.pidfd = -1
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None
        if self.process is not None:
            with _gone_is_fine():
                os.kill(self.pid, signal.SIGKILL)
            with _gone_is_fine():
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if not self.jailed:  # no namespace to end them: each one it had is killed by pid
            for pid in others:
                with _gone_is_fine():
                    os.kill(pid, signal.SIGKILL)
        if self.accounting is not None:
            self.hits = self.accounting.hits()
            self.accounting.close()
            self.accounting = None
            if self.hits:
                _report(self.hits)
        if self.log is not None:
            self.log.close()
            self.log = None
        shutil.rmtree(self.folder, ignore_errors=True)
        return len(others)


RING_HELD = ("rank {rank} of {world_size} held {held:.0f} MiB at its peak (the ranks: {every} MiB), more than a ring "
             "needs: the check allows "
             "{allowance:.0f} MiB, room for the rank's own shards, two more of K and V in flight and the work of one "
             "step, never every rank's K and V at once (as all_gather or reading other ranks' shards would)")


def _rank_failure(document: dict, world_size: int) -> dict:
    """{"raised": [kind, "on rank r of P: message"]} from a rank's (or the starter's) failure message."""
    raised = document.get("raised")
    if not (isinstance(raised, list) and len(raised) == 2 and all(isinstance(x, str) for x in raised)):
        return {"raised": ["RuntimeError", "the ranks answered out of protocol"]}
    rank = document.get("rank")
    where = f"on rank {rank} of {world_size}: " if rank in range(world_size) else ""
    return {"raised": [raised[0][:100], where + raised[1][:2000]]}


def _host_pid(jail_pid: int, inner) -> int | None:
    """The pid this machine gives the process of the jail whose own pid (in the jail's namespace) is `inner`."""
    if not isinstance(inner, int):
        return None
    for pid in descendants(jail_pid):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("NSpid:") and int(line.split()[-1]) == inner:
                    return pid
        except (OSError, ValueError):
            pass
    return None


def _address_space_limit(pid: int) -> int:
    """pid's hard limit on its address space, from /proc (prlimit(2) may not read another uid's)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max address space"):
            hard = line.split()[4]
            return resource.RLIM_INFINITY if hard == "unlimited" else int(hard)
    raise MeasurementRefused("the limits of a rank could not be read")


def _dumpable(pid: int) -> bool:
    """Whether processes of pid's own uid may read its memory. The jail's processes are non-dumpable from the runner's
    start (autograder/jail/inside/limits.py, confine), and the kernel gives a non-dumpable process's /proc files (not
    its folder) to root, of its user namespace or of the machine's: a file owned by the process's own uid says it is
    dumpable, which only a new program (execve) is there. True too when it cannot be told (the process is gone)."""
    try:
        return os.stat(f"/proc/{pid}/mem").st_uid == os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return True


def _running(pid: int) -> bool:
    return _state(pid) not in ("", "Z", "X")


def _any_running(pids: list[int]) -> bool:
    return any(_running(pid) for pid in pids)


def _exit_code(pid: int) -> int | None:
    """How a process that has ended and not been reaped ended, as multiprocessing says it (-signal or code); None
    where it cannot be read. The kernel shows an ended process's exit code, and its wchan as 1, only to whom may
    ptrace it, and shows both as 0 to others: an ordinary user's grader may not ptrace a jail's non-dumpable
    process once it has ended (root may, with CAP_SYS_PTRACE)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status, shown = int(fields[49]), fields[0] in ("Z", "X") and fields[32] == "1"
    except (OSError, IndexError, ValueError):
        return None
    if not shown:
        return None
    return -(status & 0x7F) if status & 0x7F else status >> 8


def _unread(fd: int) -> int:
    """Bytes written to a pipe and not read yet."""
    import fcntl
    import termios

    size = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, size)
    return int.from_bytes(size, sys.byteorder)


def _drain(fd: int) -> None:
    """Read and drop whatever is waiting in a pipe, without waiting."""
    while select.select([fd], [], [], 0)[0]:
        try:
            if not os.read(fd, 1 << 20):
                return
        except OSError:
            return


def _cuda_ok(device: str) -> bool:
    import torch

    return device.startswith("cuda") and torch.cuda.is_available()


def _state(pid: int) -> str:
    """The process's state letter (R, S, T, Z...), or "" once it is gone: "T" only once every thread has
    stopped (a signal stops the threads one by one)."""
    states = set()
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.add(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            pass
    running = states - {"T", "t", "Z", "X"}
    if running:
        return min(running)
    return "" if not states else "T" if states <= {"T", "t"} else "Z"


def _signal_and_wait(pids: set[int], sent: int, timeout: float = 10.0) -> None:
    """Send a stop or kill signal and return once each process is stopped (or dead), since signals are
    delivered after os.kill returns; MeasurementRefused if one is still running after `timeout`."""
    for pid in pids:
        with _gone_is_fine():
            os.kill(pid, sent)
    settled = ("", "Z", "X") if sent == signal.SIGKILL else ("", "Z", "X", "T", "t")
    deadline = time.monotonic() + timeout
    while any(_state(pid) not in settled for pid in pids):
        if time.monotonic() > deadline:
            raise MeasurementRefused("a process of the jail did not stop when told to")
        time.sleep(0.001)


@contextmanager
def _gone_is_fine():
    try:
        yield
    except (ProcessLookupError, PermissionError, OSError):
        pass
