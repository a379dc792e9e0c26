"""The warm template the grading jail's kernels are forked from, so a notebook's kernel starts in
milliseconds instead of paying torch's and IPython's imports again.

    python forkserver.py CONTROL_FD        (started by autograder/jail/sandbox.py's `Template`, never by hand)

It runs in a jail of its own (bubblewrap's namespaces, read-only system folders, the kept modules)
as root with only the capabilities it needs to build namespaces and drop privileges. It imports
torch, IPython and the runner, and then only ever forks: it runs no notebook and no learner code.
Each request on CONTROL_FD, a SOCK_SEQPACKET socket, is one message of JSON {"uid", "limits",
"gpu"} with four descriptors: a socket for the reply, the kernel's input and output pipes, its log.
The kernel it forks, before anything of the notebook runs:
- enters new mount, PID, network, IPC, UTS and cgroup namespaces, so it is pid 1 of a PID
  namespace of its own and ends every process it started when it ends; it mounts its own /proc
  (with /proc/sys and the like read-only), a private /tmp and /dev/shm of limited size and its own /dev/pts,
  and brings up its own loopback interface, the only one it has;
- sets its resource limits, drops every capability (the bounding set too), becomes `uid`, a uid no
  other kernel has, with no supplementary groups, and sets no_new_privs; it dies with its parent;
- keeps only its two pipes and its log (as stdout and stderr) open, then runs runner.main.
So each notebook's kernel has the same properties as one started by bubblewrap directly, and no two
kernels share a process, a uid, a writable folder or a network. The reply is {"pid": the kernel's pid
as this template sees it} or {"error": why}.
"""

import ctypes
import fcntl
import gc
import glob
import json
import os
import select
import signal
import socket
import struct
import sys

import limits
import runner
import wire  # noqa: F401  (imported once here, as the runner's start-up would)
from flashcourse import DEVICE_ENV

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 24, 38, 47, 4
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
READ_ONLY_PROC = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def _mount(source, target: str, kind, flags: int, data=None) -> None:
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(encode(source), target.encode(), encode(kind), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))


def _drop_privileges(uid: int) -> None:
    """Every capability gone (bounding, ambient, inheritable, permitted, effective), uid and gid `uid`."""
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop a capability from the bounding set")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # clears the permitted and effective sets
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(libc.capset(header, bytes(24)), "clear inheritable capabilities")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")


def _private_tmp(size: int) -> None:
    """A fresh /tmp of `size` bytes over the template's. A Python environment that lives under /tmp (a
    clone there, as bubblewrap's argv in jail.py also allows) is bound again, read-only, over the new one."""
    under_tmp = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)} - {"/tmp"})
    kept = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in under_tmp if path.startswith("/tmp/")]
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
    for path, fd in kept:
        os.makedirs(path, mode=0o755)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)


def _become_kernel(request: dict, in_fd: int, out_fd: int, log_fd: int) -> None:
    """In the new PID namespace, as its pid 1: finish the jail, then serve the notebook. Never returns."""
    code = 1
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        for path in READ_ONLY_PROC:
            if os.path.exists(path):
                _mount(path, path, None, MS_BIND | MS_REC)
                _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        _private_tmp(int(request["limits"]["tmp_bytes"]))
        # and a /dev/shm of its own, of the same size: the template's is one folder every kernel would share
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(request['limits']['tmp_bytes'])},mode=1777")
        _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
        if not request.get("gpu"):  # graded on the CPU: the template's GPUs leave this kernel's world
            for device in glob.glob("/dev/nvidia*"):
                _check(libc.umount2(device.encode(), MNT_DETACH), f"unmount {device}")
            os.environ[DEVICE_ENV] = "cpu"
        _loopback_up()
        limits.apply(request["limits"], bool(request.get("gpu")))
        os.chdir("/tmp")
        _drop_privileges(int(request["uid"]))
        null = os.open("/dev/null", os.O_RDONLY)
        for fd, target in ((null, 0), (log_fd, 1), (log_fd, 2)):
            os.dup2(fd, target)
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in (0, 1, 2, in_fd, out_fd):
                try:
                    os.close(int(name))
                except OSError:
                    pass
        os.set_inheritable(in_fd, False)
        os.set_inheritable(out_fd, False)
        sys.argv = ["runner.py", str(in_fd), str(out_fd)]
        runner.main(in_fd, out_fd)
        code = 0
    except BaseException as error:  # the grader sees no "ready" and reads this in the log
        os.write(2, f"the kernel could not be set up: {error!r}\n".encode())
    finally:
        os._exit(code)


def _fork_kernel(request: dict, reply: socket.socket, in_fd: int, out_fd: int, log_fd: int) -> None:
    """In a child of the template: new namespaces, then the kernel forked into them; reply with its pid."""
    try:
        _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "die with the template")
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP),
               "unshare")
        kernel = os.fork()
        if kernel == 0:
            reply.close()
            _become_kernel(request, in_fd, out_fd, log_fd)
        reply.send(json.dumps({"pid": kernel}).encode())
        ended = os.pidfd_open(kernel)
    except Exception as error:
        reply.send(json.dumps({"error": repr(error)}).encode())
        os._exit(1)
    for fd in (in_fd, out_fd, log_fd):
        os.close(fd)
    # The kernel lives while the process that asked for it holds the other end of `reply`: when that process
    # ends, killed past a notebook's time limit or not, the kernel is killed, and its namespace with it (as
    # pid 1 there it ignores the signal its parent's death would send).
    while ended not in select.select([reply, ended], [], [])[0]:
        if not reply.recv(1):
            signal.pidfd_send_signal(ended, signal.SIGKILL)
            break
    os.waitpid(kernel, 0)
    os._exit(0)


def serve(control: socket.socket) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children it forks are reaped by the kernel
    control.send(b'{"ready": true}')
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
        except InterruptedError:
            continue
        if not message:  # the grader is gone
            return
        try:
            request = json.loads(message)
            if len(fds) != 4:
                raise ValueError("a request needs four descriptors")
        except ValueError:
            for fd in fds:
                os.close(fd)
            continue
        reply = socket.socket(fileno=fds[0])
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the kernel waits for its own children
            control.close()
            _fork_kernel(request, reply, *fds[1:])
        reply.close()
        for fd in fds[1:]:
            os.close(fd)


def main(control_fd: int) -> None:
    import torch  # noqa: F401  (what every kernel would import first)
    from flashcourse import runtime

    runtime.import_triton()  # and what the runner imports before the notebook
    from IPython.core.interactiveshell import InteractiveShell  # noqa: F401

    gc.freeze()  # a kernel's collector never walks the template's objects, so their pages stay shared
    control = socket.socket(fileno=control_fd)
    os.set_inheritable(control_fd, False)
    serve(control)


if __name__ == "__main__":
    main(int(sys.argv[1]))
