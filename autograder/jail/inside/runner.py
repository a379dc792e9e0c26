"""The learner's kernel inside the grading jail: runs the notebook's cells and calls its functions.

    python runner.py IN_FD OUT_FD        (started by autograder/jail/sandbox.py, never by hand)

It reads requests from IN_FD and answers on OUT_FD, in autograder/jail/inside/wire.py's format:
    {"op": "run", "code": ...}                      -> {"outputs": [...], "error": [name, message] | None}
    {"op": "call", "name": ..., "args": ..., "kwargs": ...} -> {"value": ...} | {"raised": [name, message]}
    {"op": "ranks", "name": ..., "world_size": P, "backend": ..., "timeout_s": ..., "kwargs": ..., "group": None |
    [global ranks]}: a child of this process starts P ranks of a process group and waits to be killed, while this
    process waits for it to end (ranks_call). Each rank joins the group, says {"ready": rank, "pid": ...}, then
    reads its own arguments {"args": ...} (sent while the grader lets that rank alone run, so no other process of
    the jail ever holds them), says {"got": rank}, waits for every rank to have said so, calls the function and
    answers {"rank": ..., "value": ...}
    or {"rank": ..., "raised": [...]}, the ranks one after another, then waits to be killed: the grader
    reads each rank's peak memory first (autograder/jail/sandbox.py, Jail.call_on_ranks). With a group, every
    rank makes it, and only its ranks call the function, with group= it.
    {"op": "fork"}: a child of this process answers {"forked": true}, then reads one "call" request,
    answers it and waits to be killed, while this process waits for it to end. The grader stops every
    other process of the jail and limits the child's memory from outside before it sends that request,
    and reads the child's peak memory after the answer (a measured call).
Everything here runs beside the learner's code, which can change any of it: the grader trusts none
of what comes back beyond its format. Test code and expected answers never come here, only the
inputs the grader's tests call the learner's functions with.
"""

import ctypes
import gc
import os
import signal
import sys
import traceback

import limits
import wire
from flashcourse import DEVICE_ENV

M_MMAP_THRESHOLD = -3      # glibc's mallopt parameter
MAX_TEXT = 100_000          # characters of printed output kept per cell or call
KEPT_MIME = ("text/plain", "image/png")


class Withheld:
    """Import hook, last on sys.meta_path: a course module that grading withholds (no file provides it
    here) fails to import with a message that says so, in every spelling of the import."""

    WITHHELD = tuple(os.environ.get("FLASHCOURSE_WITHHELD", "").split(","))  # set by the grader

    def find_spec(self, name, path=None, target=None):
        if not any(name == w or name.startswith(w + ".") for w in self.WITHHELD if w):
            return None
        from importlib.machinery import ModuleSpec

        return ModuleSpec(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        # An ImportError, not ModuleNotFoundError: `from flashcourse import x` would swallow the latter.
        raise ImportError(f"{module.__name__} is not available while grading: graded code must not use the "
                          "course's reference, checks or finished implementations", name=module.__name__)


def start_shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.showtraceback = lambda *args, **kwargs: None   # the error goes back as data, not as printed text
    return shell


def outputs_of(captured) -> list:
    """nbformat-like outputs: printed text and displayed text or PNG."""
    outputs = []
    for name, text in (("stdout", captured.stdout), ("stderr", captured.stderr)):
        if text:
            outputs.append({"output_type": "stream", "name": name, "text": text[:MAX_TEXT]})
    for shown in captured.outputs:
        data = {k: v for k, v in shown.data.items() if k in KEPT_MIME and isinstance(v, str)}
        if data:
            outputs.append({"output_type": "display_data", "data": data})
    return outputs


def run(shell, code: str) -> dict:
    from IPython.utils.capture import capture_output

    with capture_output() as captured:
        result = shell.run_cell(code, store_history=True)
        if "matplotlib.pyplot" in sys.modules:  # figures come back as PNG outputs, as in Jupyter
            try:
                import inline_plots

                inline_plots.display_open_figures()
            except Exception:
                pass
    error = result.error_before_exec or result.error_in_exec
    return {"outputs": outputs_of(captured),
            "error": [type(error).__name__, str(error)[:2000]] if error is not None else None}


def call(shell, request: dict, tensors: dict) -> tuple[dict, dict]:
    from IPython.utils.capture import capture_output

    name = request.get("name")
    function = shell.user_ns.get(name)
    if not callable(function):
        return {"raised": ["NameError", f"{name} is not defined in the notebook: run the cell that defines it"]}, {}
    args = wire.decode(request.get("args", {"list": []}), tensors)
    kwargs = wire.decode(request.get("kwargs", {"dict": []}), tensors)
    with capture_output() as captured:
        try:
            value = function(*args, **kwargs)
        except Exception as error:
            return {"raised": [type(error).__name__, str(error)[:2000]], "stdout": captured.stdout[:MAX_TEXT]}, {}
    out: dict = {}
    return {"value": wire.encode(value, out), "stdout": captured.stdout[:MAX_TEXT]}, out


def answer(shell, request: dict, tensors: dict, out_fd: int) -> None:
    try:
        if request.get("op") == "run":
            document, out = run(shell, str(request.get("code", ""))), {}
        else:
            document, out = call(shell, request, tensors)
    except Exception as error:  # the runner itself failed (e.g. an unsendable value): say so
        document, out = {"failed": [type(error).__name__, str(error)[:2000] or traceback.format_exc()[-2000:]]}, {}
    try:
        wire.send(out_fd, document, out)
    except Exception as error:
        wire.send(out_fd, {"failed": [type(error).__name__, str(error)[:2000]]})


def measured_call(shell, in_fd: int, out_fd: int) -> None:
    """A child answers one call under the limits the grader sets from outside; this process waits for it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # GPU memory the allocator only caches is mapped here: not the learner's to count
    child = os.fork()
    if child == 0:
        try:
            import torch

            torch.set_num_threads(1)  # no thread may start once the limits are set; this one does the work
            # Blocks of 128 KiB and more mapped for themselves and unmapped when freed: what the call holds
            # resident is then what it uses, not what the heap's layout happened to keep.
            ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 << 10)
            wire.send(out_fd, {"forked": True})
            request, tensors = wire.receive(in_fd)
            if request.get("op") == "call":
                answer(shell, request, tensors, out_fd)
                os.read(in_fd, 1)  # wait to be killed: the grader reads this process's peak memory first
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def ranks_call(shell, request: dict, in_fd: int, out_fd: int) -> None:
    """op "ranks": a child starts the ranks (rank_main) and waits to be killed; this process waits for it."""
    child = os.fork()
    if child == 0:
        try:
            import multiprocessing
            import tempfile

            function = shell.user_ns.get(request.get("name"))
            if not callable(function):
                wire.send(out_fd, {"raised": ["NameError", f"{request.get('name')} is not defined in the notebook: "
                                                           "run the cell that defines it"]})
            else:
                kwargs = wire.decode(request.get("kwargs", {"dict": []}), {})
                store = os.path.join(tempfile.mkdtemp(prefix="flashcourse-ranks-"), "store")
                gc.collect()   # garbage freed here, not in a rank: a rank's memory is measured from its peak at fork
                context = multiprocessing.get_context("fork")
                for rank in range(int(request.get("world_size", 1))):
                    context.Process(target=rank_main, daemon=True, args=(
                        function, rank, int(request["world_size"]), kwargs, str(request.get("backend", "gloo")),
                        store, float(request.get("timeout_s", 60)), in_fd, out_fd, request.get("group"))).start()
            while True:
                signal.pause()
        except BaseException as error:
            wire.send(out_fd, {"raised": [type(error).__name__, str(error)[:2000]]})
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def rank_main(function, rank: int, world_size: int, kwargs: dict, backend: str, store_path: str, timeout_s: float,
              in_fd: int, out_fd: int, group_ranks: list | None = None) -> None:
    """One rank: join the group, read this rank's arguments, call, answer in turn, wait to be killed. With
    group_ranks, every rank makes that group (numbered in that order) and a group of all ranks for the answers'
    turns, and only the group's members call the function, with group= it; the others answer None."""
    import torch
    import torch.distributed as dist
    from flashcourse import distributed

    try:
        distributed._die_with_parent()
        torch.set_num_threads(1)
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 << 10)   # freed blocks go back: resident = what is held
        os.environ["GLOO_SOCKET_IFNAME"] = distributed.LOOPBACK
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, timeout=distributed.group_timeout(timeout_s))
        group = turns = None
        if group_ranks is not None:
            group = dist.new_group(list(group_ranks), sort_ranks=False)
            turns = dist.new_group(list(range(world_size)))   # the answers' turns: not the default group's collectives
        dist.barrier(turns)   # its buffers made now, before the grader reads what the rank holds at its start
        wire.send(out_fd, {"ready": rank, "pid": os.getpid()})
        request, tensors = wire.receive(in_fd)
        args = wire.decode(request.get("args", {"list": []}), tensors)
        del request, tensors
        wire.send(out_fd, {"got": rank})
        dist.barrier(turns)   # every rank holds its arguments: no rank's answer comes before the last "got"
        try:
            if group_ranks is None:
                value = function(*args, **kwargs)
            else:
                value = function(*args, group=group, **kwargs) if rank in group_ranks else None
        except Exception as error:
            wire.send(out_fd, {"rank": rank, "raised": [type(error).__name__, str(error)[:1500]]})
            raise SystemExit from None
        del args
        out: dict = {}
        answer = {"rank": rank, "value": wire.encode(value, out)}
        dist.barrier(turns)                 # every rank has its answer: they are sent one after another
        for turn in range(world_size):
            if turn == rank:
                wire.send(out_fd, answer, out)
            dist.barrier(turns)
    except SystemExit:
        pass
    except BaseException as error:  # noqa: BLE001
        wire.send(out_fd, {"rank": rank, "raised": [type(error).__name__, str(error)[:1500]]})
    finally:
        while True:
            signal.pause()


def main(in_fd: int, out_fd: int) -> None:
    if "NoNewPrivs:\t1" in open("/proc/self/status").read():  # in a jail (each way of starting one sets it),
        limits.confine()                                        # not a trusted kernel run without one
    sys.meta_path.append(Withheld())
    import torch  # noqa: F401  (imported before the notebook: part of the start-up the grader measures)
    # Triton too, which maps some 190 MiB of address space: a notebook that imports it before a memory probe then
    # holds no more than one that does not.
    from flashcourse import runtime

    runtime.import_triton()

    torch.ones(64, 64) @ torch.ones(64, 64)  # start torch's thread pool now, not inside a measured call
    if os.environ.get(DEVICE_ENV) != "cpu" and torch.cuda.is_available():
        # The CUDA context and cuBLAS now: the driver maps some 13 GiB of address space for them, which
        # belongs to the start-up the grader measures from, not to the first measured call after a GPU cell.
        torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
    shell = start_shell()
    wire.send(out_fd, {"ready": True})
    while True:
        try:
            request, tensors = wire.receive(in_fd)
        except wire.Closed:
            return
        if request.get("op") in ("run", "call"):
            answer(shell, request, tensors, out_fd)
        elif request.get("op") == "fork":
            measured_call(shell, in_fd, out_fd)
        elif request.get("op") == "ranks":
            ranks_call(shell, request, in_fd, out_fd)
        else:
            return


if __name__ == "__main__":
    in_fd, out_fd = int(sys.argv[1]), int(sys.argv[2])
    os.set_inheritable(in_fd, False)
    os.set_inheritable(out_fd, False)
    main(in_fd, out_fd)
