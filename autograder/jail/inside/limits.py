"""A notebook kernel's resource limits, set by the process that becomes the kernel: bubblewrap's child
(autograder/jail/sandbox.py) or a kernel forked from the warm template (autograder/jail/inside/forkserver.py). The template
runs inside the jail, which holds this file but not the rest of the grader, so both use it from here;
the runner itself forbids user namespaces before it runs any notebook code, however it was started."""

import ctypes
import errno
import os
import resource


def apply(limits: dict, gpu: bool) -> None:
    """Set every limit, hard ones included, from jail.Limits' fields. A kernel given a GPU has no address-space
    limit: CUDA reserves far more address space than it ever uses."""
    space = resource.RLIM_INFINITY if gpu else int(limits["address_space"])
    for kind, value in ((resource.RLIMIT_CPU, limits["cpu_seconds"]), (resource.RLIMIT_AS, space),
                        (resource.RLIMIT_NPROC, limits["processes"]), (resource.RLIMIT_FSIZE, limits["file_size"]),
                        (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(kind, (int(value), int(value)))


# A seccomp filter (classic BPF over struct seccomp_data) that keeps a kernel from making user namespaces, as
# bubblewrap's --disable-userns does for kernels it starts: a namespace of its own would give learner code
# capabilities over new mounts and devices, and the host kernel's code behind them to attack.
BPF_LD_ABS, BPF_JEQ, BPF_JGE, BPF_JSET, BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 0x7FFF0000, 0x00050000, 22, 2
CLONE_NEWUSER, X32_SYSCALL_BIT = 0x10000000, 0x40000000
# machine -> (its audit arch, clone, unshare, clone3)
SYSCALLS = {"x86_64": (0xC000003E, 56, 272, 435), "aarch64": (0xC00000B7, 220, 97, 435)}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def forbid_user_namespaces() -> None:
    """clone and unshare with CLONE_NEWUSER fail with EPERM; clone3, whose flags a filter cannot read, and
    other ABIs than the machine's (i386's int 0x80, x32) fail with ENOSYS, and glibc falls back to clone."""
    if len(os.listdir("/proc/self/task")) != 1:  # a filter binds the thread that installs it and its children
        raise OSError("user namespaces must be forbidden before any other thread starts")
    arch, clone, unshare, clone3 = SYSCALLS[os.uname().machine]
    program = [
        (BPF_LD_ABS, 0, 0, 4),                                   # 0: seccomp_data.arch
        (BPF_JEQ, 1, 0, arch),                                   # 1: the machine's own ABI: on to 3
        (BPF_RET, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS),       # 2
        (BPF_LD_ABS, 0, 0, 0),                                   # 3: seccomp_data.nr
        (BPF_JGE, 0, 1, X32_SYSCALL_BIT),                        # 4: x32's numbers
        (BPF_RET, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS),       # 5
        (BPF_JEQ, 0, 1, clone3),                                 # 6
        (BPF_RET, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS),       # 7
        (BPF_JEQ, 1, 0, unshare),                                # 8: to 10
        (BPF_JEQ, 0, 3, clone),                                  # 9: to 10, else to 13
        (BPF_LD_ABS, 0, 0, 16),                                  # 10: the flags, args[0]'s low half
        (BPF_JSET, 0, 1, CLONE_NEWUSER),                         # 11
        (BPF_RET, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM),        # 12
        (BPF_RET, 0, 0, SECCOMP_RET_ALLOW),                      # 13
    ]
    filters = (_SockFilter * len(program))(*(_SockFilter(*line) for line in program))
    fprog = _SockFprog(len(program), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:  # needs no_new_privs
        raise OSError(ctypes.get_errno(), f"install a seccomp filter: {os.strerror(ctypes.get_errno())}")
