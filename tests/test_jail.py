"""The grading jail's properties, observed from inside it: who the code is, what it sees, what it can do."""

import os
import signal
import subprocess
import time

import pytest
import torch

from autograder import ROOT
from autograder.jail import sandbox as jail
from autograder.jail.inside import wire

pytestmark = pytest.mark.skipif(jail.why_no_jail() is not None, reason=f"no jail here: {jail.why_no_jail()}")


@pytest.fixture(scope="module", params=["bubblewrap", "template"])
def start(request):
    """Starts a kernel: by bubblewrap itself, or forked from a warm template (a root grader's way)."""
    template = None
    if request.param == "template":
        if os.geteuid() != 0:
            pytest.skip("a kernel template needs a root grader")
        template = jail.Template()

    def started() -> jail.Jail:
        kernel = jail.Jail(template=template)
        kernel.start()
        assert (kernel.template is not None) == (template is not None)  # no silent fall back to bubblewrap
        return kernel

    yield started
    if template is not None:
        template.close()


def ask_measured(kernel: jail.Jail, child: int, name: str, *args) -> dict:
    """The answer of the notebook's function `name` called in the measured child, as Remote.limited_call asks."""
    request = {"op": "call", "name": name, "args": wire.encode(list(args), {}), "kwargs": {"dict": []}}
    return kernel.ask_child(child, request, None, time.monotonic() + 60)[0]


def check_a_measured_call(kernel: jail.Jail, name: str, arg, check, refused: bool, refusal: type[Exception],
                          match: str) -> None:
    """The notebook's function `name`(arg), called in a measured child allowed 256 MiB above the kernel's start,
    answers arg; then `check` (one of the kernel's checks) on the child raises `refusal` matching `match` when
    `refused`, and nothing when not."""
    with kernel.measured_child(kernel.start_size + (256 << 20), time.monotonic() + 60) as child:
        answer = ask_measured(kernel, child, name, arg)
        assert answer.get("value") == wire.encode(arg, {}), answer
        if refused:
            with pytest.raises(refusal, match=match):
                check(child)
        else:
            check(child)


@pytest.fixture(scope="module")
def kernel(start):
    started = start()
    yield started
    started.close()


def run(kernel, code: str) -> str:
    """What the code printed in the jail; fails the test if it raised."""
    answer, _ = kernel.ask({"op": "run", "code": code}, None, time.monotonic() + 60)
    assert answer["error"] is None, answer["error"]
    return "".join(o.get("text", "") for o in answer["outputs"])


def test_an_unprivileged_identity_without_capabilities(kernel):
    """The code is neither root nor the grader's user, holds no capability and cannot gain one."""
    status = run(kernel, "print(open('/proc/self/status').read())")
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    uid = int(fields["Uid"].split()[0])
    assert uid != 0
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapPrm"], 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"
    if os.geteuid() == 0:  # seen from outside too: the runner's real uid on this machine is not root
        assert os.stat(f"/proc/{kernel.pid}").st_uid >= jail.JAIL_UID_BASE


def test_its_own_pid_and_network_namespaces(kernel):
    """Only the jail's own processes are visible, the runner is pid 1, and no address outside is reachable."""
    out = run(kernel, "import os, socket\nprint(os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
                      "try:\n    socket.create_connection(('10.0.0.1', 80), timeout=2); print('connected')\n"
                      "except OSError as e: print('refused', e.errno)")
    first, second = out.splitlines()
    assert first.startswith("1 [1")
    assert len(first.split(",")) < 5, first
    assert second.startswith("refused")


def test_nothing_of_the_course_but_what_answers_no_exercise(kernel):
    """source/, the hidden checks, the reference and the engine are absent, whatever the spelling of the import."""
    out = run(kernel, f"import os, importlib\nprint(os.path.exists({str(ROOT / 'source')!r}), "
                      f"os.path.exists({str(ROOT / 'autograder')!r}), os.path.exists({str(ROOT / 'flashcourse')!r}))\n"
                      "for name in ('flashcourse' + '.eng' + 'ine', 'flashcourse.checks.reference', 'flashcourse.checks.recurrence', "
                      "'autograder.hidden'):\n"
                      "    try:\n        importlib.import_module(name); print('imported', name)\n"
                      "    except ImportError as e: print('absent', name)\n"
                      "import flashcourse.runtime, flashcourse.positions; print('kept')")
    assert out.splitlines()[0] == "False False False"
    assert "imported" not in out and out.count("absent") == 4 and out.endswith("kept\n")


def test_the_filesystem_is_read_only_but_a_small_tmp(kernel):
    """System folders and the Python environment cannot be written; /tmp can, within its size."""
    import sys

    out = run(kernel, f"import os\nfor path in ('/usr/x', '/etc/x', {sys.prefix + '/x'!r}, '/x'):\n"
                      "    try:\n        open(path, 'w'); print('wrote', path)\n"
                      "    except OSError: pass\n"
                      "open('/tmp/ok', 'w').write('x'); print('tmp ok')\n"
                      "try:\n    open('/tmp/big', 'wb').write(b'0' * (300 << 20)); print('filled /tmp')\n"
                      "except OSError as e: print('full', e.errno)")
    assert "wrote" not in out and "tmp ok" in out and "full" in out, out


def test_limits_are_set(kernel):
    """Address space, processes, file size, open files and CPU time are limited, hard limits included."""
    out = run(kernel, "import resource as r\nprint([r.getrlimit(k)[1] for k in (r.RLIMIT_AS, r.RLIMIT_NPROC, "
                      "r.RLIMIT_FSIZE, r.RLIMIT_NOFILE, r.RLIMIT_CPU)])")
    limits = jail.Limits()
    processes = jail._process_limit(limits, kernel.accounting is not None).processes  # above its pids.max, if any
    expected = [limits.address_space, processes, limits.file_size, limits.open_files, limits.cpu_seconds]
    assert out.strip() == str(expected)


def test_measured_child_is_limited_from_outside(start):
    """The measured call's process cannot allocate 1 GiB nor start a process, the rest of the jail is
    stopped meanwhile, and afterwards the kernel allocates and forks as before with the notebook's state."""
    import select

    kernel = start()
    run(kernel, "import os, subprocess, torch\nkept = 42\ndef probe(code):\n    exec(code, globals())\n"
                "spinner = subprocess.Popen(['sh', '-c', 'while :; do :; done'])")
    code = ("import torch, os\ntry:\n    torch.ones(1 << 28); print('allocated')\nexcept RuntimeError: print('refused')\n"
            "try:\n    os.fork() or os._exit(0); print('forked')\nexcept OSError: print('no fork')\nprint(kept)")
    spinner = kernel.others()[0]
    with kernel.measured_child(kernel.start_size + (256 << 20), time.monotonic() + 60) as child:
        assert open(f"/proc/{spinner}/stat").read().rsplit(")", 1)[1].split()[0] == "T"   # stopped
        answer = ask_measured(kernel, child, "probe", code)
    assert not select.select([kernel.reader], [], [], 0.2)[0]   # the runner sent nothing of its own
    assert answer.get("stdout", "").split() == ["refused", "no", "fork", "42"], answer
    assert run(kernel, code).split() == ["allocated", "forked", "42"]
    kernel.close()


def test_a_measured_child_that_maps_memory_early_is_refused(start):
    """A notebook that rewrites the runner so the measured call's process maps a large buffer before its
    limits are set (to compute inside it afterwards) gets no measurement."""
    kernel = start()
    run(kernel, "import mmap, os, sys, wire\n"
                "def early(shell, in_fd, out_fd):\n"
                "    if os.fork() == 0:\n"
                "        buffer = mmap.mmap(-1, 600 << 20)\n"
                "        wire.send(out_fd, {'forked': True})\n"
                "        wire.receive(in_fd)\n"
                "        os._exit(0)\n"
                "    os.wait()\n"
                "for module in list(sys.modules.values()):   # the runner: __main__ when cold, 'runner' when forked\n"
                "    if callable(getattr(module, 'measured_call', None)):\n"
                "        module.measured_call = early")
    with pytest.raises(jail.MeasurementRefused, match="already held"):
        with kernel.measured_child(kernel.start_size + (256 << 20), time.monotonic() + 60):
            pass
    assert run(kernel, "print('goes on')").strip() == "goes on"
    kernel.close()


MPROTECT_RESERVATION = """
import ctypes
PROT_NONE, PROT_RW, PRIVATE_ANONYMOUS_NORESERVE = 0, 1 | 2, 0x02 | 0x20 | 0x4000   # Linux's values
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
RESERVED = 1 << 30
reservation = libc.mmap(None, RESERVED, PROT_NONE, PRIVATE_ANONYMOUS_NORESERVE, -1, 0)

def spend(mib):
    '''Inside the measured call: make the reservation usable (no new address space) and fill mib MiB of it.'''
    assert libc.mprotect(ctypes.c_void_p(reservation), RESERVED, PROT_RW) == 0
    ctypes.memset(reservation, 1, mib << 20)
    return mib
"""


@pytest.mark.parametrize("mib, refused", [(512, True), (64, False)])
def test_memory_made_usable_inside_a_reservation_is_counted(start, mib, refused):
    """A process that start-up left with a large PROT_NONE reservation (CUDA maps some 13 GiB at start-up) can
    mprotect it and compute inside it without mapping new address space: the measured call's peak resident
    memory is read too, so 512 MiB spent that way is refused, while 64 MiB within the allowance is not."""
    kernel = start()
    run(kernel, MPROTECT_RESERVATION)
    kernel.start_size = jail.vm_size(kernel.pid)   # as if the runner's start-up had made the reservation
    # Answered either way: the address-space limit lets it through; only its resident peak can refuse it.
    check_a_measured_call(kernel, "spend", mib, kernel.check_resident, refused, jail.MeasurementRefused,
                          "resident at its peak")
    kernel.close()


def test_memory_filled_inside_a_reservation_before_the_call_is_held(start):
    """The same reservation filled by a cell before the measured call, so that the forked process starts with
    300 MiB it may overwrite without its resident memory growing: that is memory already held, and refused
    before the call as a large tensor would be."""
    kernel = start()
    run(kernel, MPROTECT_RESERVATION)
    kernel.start_size = jail.vm_size(kernel.pid)
    run(kernel, "spend(300)")
    assert jail.vm_size(kernel.pid) - kernel.start_size < 64 << 20, "the address space should not show it"
    with pytest.raises(jail.MeasurementRefused, match="already held"):
        with kernel.measured_child(kernel.start_size + (256 << 20), time.monotonic() + 60):
            pass
    kernel.close()


def test_a_kernel_ends_with_the_process_that_asked_for_it():
    """A kernel forked by the template is no child of the grading process that asked for it: when that process
    is killed (a notebook past its time limit) during a cell that never ends, the kernel and whatever the
    notebook started end too."""
    if os.geteuid() != 0:
        pytest.skip("a kernel template needs a root grader")
    template = jail.Template()
    reader, writer = os.pipe()
    requester = os.fork()
    if requester == 0:  # stands for the nbgrader process of one notebook
        kernel = jail.Jail(template=template)
        kernel.start()
        run(kernel, "import os, time\nif os.fork() == 0:\n    time.sleep(600)")
        os.write(writer, " ".join(map(str, [kernel.pid, *kernel.others()])).encode())
        wire.send(kernel.writer, {"op": "run", "code": "time.sleep(600)"})   # a cell that hangs
        time.sleep(600)
    pids = [int(p) for p in os.read(reader, 256).split()]
    assert len(pids) == 2, "the kernel and the process its cell started"
    os.kill(requester, signal.SIGKILL)
    os.waitpid(requester, 0)
    deadline = time.monotonic() + 10
    while any(jail._state(pid) not in ("", "Z", "X") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(jail._state(pid) in ("", "Z", "X") for pid in pids), "the kernel outlived the grading process"
    template.close()


def test_no_user_namespace_can_be_made_but_threads_and_processes_can(kernel):
    """Learner code cannot make a user namespace (capabilities over mounts and devices of its own), whichever
    way its kernel was started; threads and processes start as before (glibc falls back from clone3 to clone)."""
    out = run(kernel, "import ctypes, os, threading\n"
                      "child = os.fork()\n"
                      "if child == 0:   # one thread, as unshare(CLONE_NEWUSER) needs; its exit code is the answer\n"
                      "    libc = ctypes.CDLL(None, use_errno=True)\n"
                      "    os._exit(1 if libc.unshare(0x10000000) == 0 else 0)\n"
                      "done = []\n"
                      "worker = threading.Thread(target=done.append, args=[1]); worker.start(); worker.join()\n"
                      "print('made', os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), 'thread', done)")
    assert out.split() == ["made", "0", "thread", "[1]"], out


READS_A_COLLUDING_SIBLING = """
import ctypes, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
secret = ctypes.create_string_buffer(b"the shards of rank 1" * 1000)
ready_r, ready_w = os.pipe()
sibling = os.fork()
if sibling == 0:   # wants to be read: asks to be dumpable and to let anyone trace it, then waits
    asked = [libc.prctl(4, 1, 0, 0, 0), libc.prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)]
    os.write(ready_w, repr(asked).encode())
    time.sleep(60)
    os._exit(0)
asked = os.read(ready_r, 100).decode()
os.close(ready_r)
os.close(ready_w)
os.kill(sibling, signal.SIGSTOP)   # stopped, as the grader leaves a rank between its turns
time.sleep(0.2)


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def attempt(what):
    try:
        return what()
    except OSError as error:
        return error.errno


def by_mem():
    with open(f"/proc/{sibling}/mem", "rb") as mem:
        mem.seek(ctypes.addressof(secret))
        return mem.read(20)


def by_process_vm_readv():
    out = ctypes.create_string_buffer(20)
    local, remote = IoVec(ctypes.addressof(out), 20), IoVec(ctypes.addressof(secret), 20)
    got = libc.process_vm_readv(sibling, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return out.raw if got == 20 else ctypes.get_errno()


def by_ptrace():
    return libc.ptrace(16, sibling, 0, 0) == 0 or ctypes.get_errno()   # PTRACE_ATTACH


def forget_my_peak():
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return "forgotten"


results = {"asked": asked, "mem": attempt(by_mem), "process_vm_readv": attempt(by_process_vm_readv),
           "ptrace": attempt(by_ptrace), "clear_refs": attempt(forget_my_peak)}
os.kill(sibling, signal.SIGKILL)
os.waitpid(sibling, 0)
print(results)
"""


def test_no_process_reads_another_ones_memory(kernel):
    """Every process of the jail is non-dumpable and cannot undo it (autograder/jail/inside/limits.py, confine): a
    forked sibling that asks to be readable (PR_SET_DUMPABLE, PR_SET_PTRACER) is refused, and its memory stays out
    of reach of /proc/PID/mem, process_vm_readv and ptrace; nor can a process make the kernel forget its memory's
    peak (clear_refs). From outside, the grader sees the runner non-dumpable and a new program dumpable."""
    import ast
    import errno

    results = ast.literal_eval(run(kernel, READS_A_COLLUDING_SIBLING).strip())
    assert results == {"asked": "[-1, -1]", "mem": errno.EACCES, "process_vm_readv": errno.EPERM,
                       "ptrace": errno.EPERM, "clear_refs": errno.EACCES}, results
    assert not jail._dumpable(kernel.pid)
    run(kernel, "import subprocess\nsleeper = subprocess.Popen(['sleep', '4444'])")
    assert [jail._dumpable(pid) for pid in kernel.others()] == [True]   # execve starts a program dumpable
    run(kernel, "sleeper.kill(); sleeper.wait()")


SHORT_RECEIVE = """
import os
import torch
import torch.distributed as dist


def short_receive(x):
    if dist.get_rank() == 0:
        dist.send(torch.ones(7), 1)
    else:
        dist.recv(torch.empty(6), 0)     # 28 bytes arrive for 24: gloo aborts this rank
    return x


def aborts(x):
    if dist.get_rank() == 1:
        os.abort()
    return x


def not_yet(x):
    raise NotImplementedError("not yet")
"""


def call_on_two_ranks(kernel: jail.Jail, name: str) -> dict:
    """The answer of the notebook's function `name` called on two ranks, as Remote.call_on_ranks asks."""
    tensors: dict = {}
    args, kwargs = wire.encode([[(torch.ones(1),), (torch.ones(1),)], {}], tensors)["list"]
    request = {"op": "call", "name": name, "args": args, "kwargs": kwargs,
               "ranks": {"backend": "gloo", "timeout_s": 30, "allowance": None}}
    return kernel.ask(request, tensors, time.monotonic() + 120)[0]


def test_a_rank_that_gloo_aborts_is_named_with_gloo_s_sizes(kernel):
    """A rank whose receive buffer is shorter than the message: gloo aborts it, and the grader says so with the
    sizes gloo wrote in the jail's log, whoever grades (an ordinary user's grader may not read the exit code of a
    jail's process that has ended). A rank aborting later for another reason is not given that call's words."""
    run(kernel, SHORT_RECEIVE)
    assert call_on_two_ranks(kernel, "short_receive") == {"raised": [
        "RuntimeError", "on rank 1 of 2: died without an answer (killed by SIGABRT: gloo aborted it because a message "
                        "of 28 bytes arrived for a receive buffer of 24 bytes)"]}
    raised = call_on_two_ranks(kernel, "aborts")["raised"][1]
    assert raised.startswith("on rank 1 of 2: died without an answer") and "gloo" not in raised, raised


def test_a_function_that_raises_at_once_on_every_rank_says_its_own_error(kernel):
    """No rank calls the function before every rank holds its arguments, so the first rank's error does not come
    while the grader waits for the next rank to take its own (which read as "did not take its arguments")."""
    run(kernel, SHORT_RECEIVE)
    for _ in range(3):
        kind, message = call_on_two_ranks(kernel, "not_yet")["raised"]
        assert kind == "NotImplementedError" and message.endswith(" of 2: not yet"), (kind, message)


HELPER = """
import os, signal, time
helper = os.fork()
if helper == 0:   # waits for work: a process of the kernel that no limit of the measured call binds
    while True:
        time.sleep(0.01)

def wake(seconds):
    '''Inside the measured call: wake the helper the grader stopped, and let it run.'''
    if seconds:
        os.kill(helper, signal.SIGCONT)
        time.sleep(seconds)
    return seconds
"""


@pytest.mark.parametrize("seconds, refused", [(0.5, True), (0, False)])
def test_a_process_woken_during_a_measured_call_is_seen(start, seconds, refused):
    """The measured process can send SIGCONT to a process of the kernel the grader stopped, which then works for
    it without its limits: any CPU time another process uses during the call refuses it; a process that only
    stays there does not."""
    kernel = start()
    run(kernel, HELPER)
    check_a_measured_call(kernel, "wake", seconds, kernel.check_alone, refused, jail.NotAlone,
                          "ran during the measured call")
    kernel.close()


READ_LIBRARY = """
import ctypes
import torch
mapped = []   # torch's largest library, mapped at start-up: (start, end) of each of its mappings
for line in open("/proc/self/maps"):
    where, _, _, _, _, *path = line.split()
    if path and path[0].endswith("libtorch_cpu.so"):
        mapped.append(tuple(int(x, 16) for x in where.split("-")))

def read_library(mib):
    '''Inside the measured call: read a byte of each page of mib MiB of the library, mapping those pages again.'''
    pages = 0
    for first, end in mapped:
        for address in range(first, end, 4096):
            if pages == mib << 8:
                return pages
            ctypes.c_char.from_address(address).value
            pages += 1
    return pages
"""


def test_pages_of_files_a_measured_call_reads_are_not_counted(start):
    """A forked process maps its libraries' pages again as it touches them, more or fewer by chance; they cannot
    hold data, so a call that reads 200 MiB of torch's library within an allowance of 64 MiB is within it."""
    kernel = start()
    run(kernel, READ_LIBRARY)
    with kernel.measured_child(kernel.start_size + (64 << 20), time.monotonic() + 60) as child:
        answer = ask_measured(kernel, child, "read_library", 200)
        assert answer.get("value") == wire.encode(200 << 8, {}), answer
        peak, written = jail._status_bytes(child, "VmHWM"), jail._status_bytes(child, "RssAnon")
        assert peak > written + (200 << 20), "the library's pages should have been resident"
        kernel.check_resident(child)
    kernel.close()


def test_a_measured_call_that_ends_before_it_is_read_is_refused(start):
    """A notebook that rewrites the runner so the measured call's process exits as soon as it has answered
    (before its peak memory can be read) gets no measurement."""
    kernel = start()
    run(kernel, "import os, sys, wire\n"
                "def quick(shell, in_fd, out_fd):\n"
                "    if os.fork() == 0:\n"
                "        wire.send(out_fd, {'forked': True})\n"
                "        wire.receive(in_fd)\n"
                "        wire.send(out_fd, {'value': 1})\n"
                "        os._exit(0)\n"
                "    os.wait()\n"
                "for module in list(sys.modules.values()):\n"
                "    if callable(getattr(module, 'measured_call', None)):\n"
                "        module.measured_call = quick")
    with kernel.measured_child(kernel.start_size + (256 << 20), time.monotonic() + 60) as child:
        answer = ask_measured(kernel, child, "print")
        assert answer == {"value": 1}
        time.sleep(0.5)
        with pytest.raises(jail.MeasurementRefused, match="ended before its memory could be read"):
            kernel.check_resident(child)
    kernel.close()


def test_a_kernel_that_keeps_a_large_tensor_is_not_measured(start):
    """A notebook whose cells keep a large tensor cannot spend it inside a measured call: the call is refused,
    and the message says what to delete."""
    kernel = start()
    run(kernel, "import torch\nkept = torch.ones(300 << 18)   # 300 MiB of float32")
    with pytest.raises(jail.MeasurementRefused, match="delete large tensors that earlier cells keep"):
        with kernel.measured_child(kernel.start_size + (256 << 20), time.monotonic() + 60):
            pass
    assert run(kernel, "print(kept.numel())").strip() == str(300 << 18)
    kernel.close()


def test_a_kernel_that_imported_triton_is_measured(start):
    """A notebook that imports Triton and defines a kernel before a memory probe (some 190 MiB of address space
    when imported first) holds no more than at start-up: the kernel imported it before the notebook ran."""
    kernel = start()
    run(kernel, "from flashcourse import runtime\nruntime.setup()\nimport triton\nimport triton.language as tl\n\n"
                "@triton.jit\ndef copy(x, y):\n    tl.store(y, tl.load(x))\n")
    with kernel.measured_child(kernel.start_size + (192 << 20), time.monotonic() + 60):   # 06's allowance
        pass
    kernel.close()


def test_processes_die_with_the_jail(start):
    """Processes the notebook detached are counted at the end and do not outlive the jail."""
    started = start()
    run(started, "import subprocess\nfor _ in range(3):\n"
                 "    subprocess.Popen(['sleep', '4242'], start_new_session=True)")
    assert started.close() == 3
    time.sleep(0.5)
    assert "sleep 4242" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_only_its_own_descriptors(kernel):
    """The kernel holds no socket or pipe but its two pipes to the grader (a template's control socket
    is closed before the notebook runs)."""
    out = run(kernel, "import os\nfor fd in os.listdir('/proc/self/fd'):\n"
                      "    try: print(os.readlink('/proc/self/fd/' + fd))\n    except OSError: pass")
    held = out.split()
    assert not [h for h in held if h.startswith("socket:")], held
    assert len([h for h in held if h.startswith("pipe:")]) == 2, held


def test_kernels_of_one_template_share_nothing(start):
    """Two kernels forked from one template see neither the other's files nor its processes, and one
    ending leaves the other running."""
    first, second = start(), start()
    run(first, "import subprocess\nopen('/tmp/mine', 'w').write('secret')\n"
               "sleeper = subprocess.Popen(['sleep', '4343'])")
    out = run(second, "import os\nprint(os.path.exists('/tmp/mine'), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    assert out.split(" ", 1)[0] == "False" and out.strip().endswith("[1]"), out
    first.close()
    assert run(second, "print('still here')").strip() == "still here"
    second.close()


def test_a_kernel_that_cannot_start_is_named_in_the_anomalies(monkeypatch):
    """When no kernel starts, the cells say why and the summary's anomalies say it once, so the notebook is
    not reported as graded normally."""
    from autograder.grading import execute

    def refuse(self):
        raise jail.NoJail("the grading kernel did not start: an import failed")

    monkeypatch.setattr(jail.Jail, "start", refuse)
    session = execute.Session(jailed=True, cell_timeout=30, max_restarts=2)
    outputs = [session.run_cell("x = 1", f"cell {i}") for i in range(4)]
    assert all(o[0]["ename"] == "KernelLost" for o in outputs)
    assert session.anomalies == ["the notebook's kernel could not start: the grading kernel did not start: "
                                 "an import failed"]


def test_a_gone_template_falls_back_to_bubblewrap():
    """A kernel whose template has ended is started by bubblewrap instead, with nothing of the attempt left open."""
    if os.geteuid() != 0:
        pytest.skip("a kernel template needs a root grader")
    template = jail.Template()
    template.close()
    before = len(os.listdir("/proc/self/fd"))
    kernel = jail.Jail(template=template)
    kernel.start()
    assert kernel.template is None and run(kernel, "print('cold')").strip() == "cold"
    kernel.close()
    del kernel  # its log file closes with it
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_kernel_graded_on_the_cpu_has_no_gpu(start, monkeypatch):
    """Told to grade on the CPU (as --device auto does for the PyTorch assignments), a kernel sees no GPU device
    and its runtime chooses the CPU, even when its template was started with the machine's GPUs."""
    monkeypatch.setenv("FLASHCOURSE_DEVICE", "cpu")
    kernel = start()
    out = run(kernel, "import glob, os\nprint(glob.glob('/dev/nvidia*'), os.environ.get('FLASHCOURSE_DEVICE'))")
    assert out.strip() == "[] cpu"
    kernel.close()
