"""A notebook kernel's resource limits, set by the process that becomes the kernel: bubblewrap's child
(autograder/jail/sandbox.py) or a kernel forked from the warm template (autograder/jail/inside/forkserver.py). The template
runs inside the jail, which holds this file but not the rest of the grader, so both use it from here;
the runner itself confines its kernel (`confine`: no user namespaces, no process reads another's memory) before it
runs any notebook code, however it was started."""

import ctypes
import errno
import os
import resource
from dataclasses import dataclass


def apply(limits: dict, gpu: bool) -> None:
    """Set every limit, hard ones included, from jail.Limits' fields. A kernel given a GPU has no address-space
    limit: CUDA reserves far more address space than it ever uses."""
    space = resource.RLIM_INFINITY if gpu else int(limits["address_space"])
    for kind, value in ((resource.RLIMIT_CPU, limits["cpu_seconds"]), (resource.RLIMIT_AS, space),
                        (resource.RLIMIT_NPROC, limits["processes"]), (resource.RLIMIT_FSIZE, limits["file_size"]),
                        (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(kind, (int(value), int(value)))


# What keeps a kernel's processes from reading one another's memory, and from making user namespaces: set by the
# runner before any notebook code runs, and inherited by every process the notebook starts (07's ranks included).
#
# A process of the same uid and no capabilities can read another's memory (/proc/PID/mem, process_vm_readv, ptrace)
# exactly when the other is dumpable; a non-dumpable process's memory is readable only with CAP_SYS_PTRACE over its
# user namespace, which nothing in a jail has. So the runner makes itself non-dumpable (its forks inherit it: no rank
# of a ring can read a sibling's shards, even one that wants to be read), and a seccomp filter keeps any of them from
# becoming dumpable again (prctl PR_SET_DUMPABLE 1), from naming a ptracer (PR_SET_PTRACER, for Yama), and from
# ptrace, process_vm_readv/writev and pidfd_getfd at all. Only a new program (execve) starts dumpable, with nothing of
# the old memory; the grader checks from outside that each rank is still non-dumpable once it holds its shards
# (autograder/jail/sandbox.py, Jail.call_on_ranks). Being non-dumpable also gives a process's /proc files to root,
# so it cannot rewrite its own clear_refs to forget a peak of memory the grader measures.
# This works the same for a root grader (a jail uid of its own in the machine's user namespace) and an ordinary one
# (uid 65534 in bubblewrap's user namespace, where the jail has no capability either), and needs no privilege.
# The filter also keeps a kernel from making user namespaces, as bubblewrap's --disable-userns does for kernels it
# starts: a namespace of its own would give learner code capabilities over new mounts and devices, and the host
# kernel's code behind them to attack.
BPF_LD_ABS, BPF_JEQ, BPF_JGE, BPF_JSET, BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 0x7FFF0000, 0x00050000, 22, 2
CLONE_NEWUSER, X32_SYSCALL_BIT = 0x10000000, 0x40000000
PR_SET_DUMPABLE, PR_SET_PTRACER = 4, 0x59616D61


@dataclass(frozen=True)
class _Calls:
    """A machine's audit arch and the numbers of the system calls the filter looks at."""

    arch: int
    clone: int
    unshare: int
    clone3: int
    ptrace: int
    process_vm_readv: int
    process_vm_writev: int
    pidfd_getfd: int
    prctl: int


SYSCALLS = {"x86_64": _Calls(0xC000003E, clone=56, unshare=272, clone3=435, ptrace=101, process_vm_readv=310,
                             process_vm_writev=311, pidfd_getfd=438, prctl=157),
            "aarch64": _Calls(0xC00000B7, clone=220, unshare=97, clone3=435, ptrace=117, process_vm_readv=270,
                              process_vm_writev=271, pidfd_getfd=438, prctl=167)}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def filter_program(calls: _Calls) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) lines. Jumps are written to labels and resolved here: a label is a string
    line, a jump target None goes on to the next line."""
    nosys, eperm = SECCOMP_RET_ERRNO | errno.ENOSYS, SECCOMP_RET_ERRNO | errno.EPERM
    lines = [
        (BPF_LD_ABS, None, None, 4),                             # seccomp_data.arch
        (BPF_JEQ, None, "nosys", calls.arch),                    # another ABI than the machine's (i386's int 0x80)
        (BPF_LD_ABS, None, None, 0),                             # seccomp_data.nr
        (BPF_JGE, "nosys", None, X32_SYSCALL_BIT),               # x32's numbers
        (BPF_JEQ, "nosys", None, calls.clone3),                  # flags a filter cannot read: glibc falls back to clone
        (BPF_JEQ, "flags", None, calls.unshare),
        (BPF_JEQ, "flags", None, calls.clone),
        (BPF_JEQ, "eperm", None, calls.ptrace),
        (BPF_JEQ, "eperm", None, calls.process_vm_readv),
        (BPF_JEQ, "eperm", None, calls.process_vm_writev),
        (BPF_JEQ, "eperm", None, calls.pidfd_getfd),
        (BPF_JEQ, "prctl", "allow", calls.prctl),
        "flags",
        (BPF_LD_ABS, None, None, 16),                            # args[0]'s low half: the clone or unshare flags
        (BPF_JSET, "eperm", "allow", CLONE_NEWUSER),
        "prctl",
        (BPF_LD_ABS, None, None, 16),                            # args[0]'s low half: the option
        (BPF_JEQ, "eperm", None, PR_SET_PTRACER),
        (BPF_JEQ, None, "allow", PR_SET_DUMPABLE),
        (BPF_LD_ABS, None, None, 24),                            # args[1]'s low half: 0 (not dumpable) is allowed
        (BPF_JEQ, "allow", "eperm", 0),                          # (a value with a high half is EINVAL anyway)
        "nosys",
        (BPF_RET, None, None, nosys),
        "eperm",
        (BPF_RET, None, None, eperm),
        "allow",
        (BPF_RET, None, None, SECCOMP_RET_ALLOW),
    ]
    at, count = {}, 0
    for line in lines:
        if isinstance(line, str):
            at[line] = count
        else:
            count += 1
    program, index = [], 0
    for line in lines:
        if isinstance(line, str):
            continue
        code, true, false, k = line
        offset = lambda label: 0 if label is None else at[label] - index - 1  # noqa: E731  (forward only)
        program.append((code, offset(true), offset(false), k))
        index += 1
    assert all(0 <= jt < 256 and 0 <= jf < 256 for _, jt, jf, _ in program)
    return program


def confine() -> None:
    """This process and every one it starts from now on: non-dumpable for good, no ptrace, process_vm_readv/writev
    or pidfd_getfd, no user namespaces (clone and unshare with CLONE_NEWUSER fail with EPERM; clone3, whose flags a
    filter cannot read, and other ABIs than the machine's (i386's int 0x80, x32) fail with ENOSYS, and glibc falls
    back to clone)."""
    if len(os.listdir("/proc/self/task")) != 1:  # a filter binds the thread that installs it and its children
        raise OSError("the kernel must be confined before any other thread starts")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"become non-dumpable: {os.strerror(ctypes.get_errno())}")
    program = filter_program(SYSCALLS[os.uname().machine])
    filters = (_SockFilter * len(program))(*(_SockFilter(*line) for line in program))
    fprog = _SockFprog(len(program), filters)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:  # needs no_new_privs
        raise OSError(ctypes.get_errno(), f"install a seccomp filter: {os.strerror(ctypes.get_errno())}")
