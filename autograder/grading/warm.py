"""A warm `python -m nbgrader`: start-up paid once per grading process, not once per command.

Every nbgrader command of a batch (generate_assignment, autograde, generate_feedback) used to start
a fresh interpreter that imported nbgrader, nbconvert, torch, the course's configuration and the
hidden checks again: several seconds per notebook before any of its work. Here one long-lived
server process (`python -m autograder.grading.warm`) imports all of that once, then forks a fresh child for
each command. The child runs the command exactly as `python -m nbgrader ARGS` would, in its own
process group, under the grading memory limit, writing its log to a file of the caller's choosing,
and ends with the command; the next command gets a new child. So no two commands, and no two
students, share a process: each child starts from the same template, which runs no notebook and no
learner code at all (the learner's cells run in the jail, started by the child: autograder/jail/sandbox.py).
The template starts no thread and touches no GPU before it forks. Where the grader is root, it also
starts a warm template of the notebooks' kernels (jail.Template), so each jailed kernel is forked
with torch already imported instead of starting a fresh interpreter.

The caller's side, `Server`, is created lazily, shared by the threads of one process, restarted if
it dies, and stopped at exit (its children are then killed with it).

Protocol, one JSON object per line: requests {"id", "argv", "env", "log", "memory"} on the server's
stdin; answers {"id", "pid"} once the child is forked and {"id", "code"} once it has ended (the
exit status, or minus the signal that ended it) on its stdout.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import pkgutil
import resource
import select
import signal
import subprocess
import sys
import threading
import traceback

from autograder import ROOT
from autograder.building.build import nbgrader_environment

PRELOADED = ("torch", "nbformat", "nbconvert.exporters.html", "nbgrader.apps.nbgraderapp", "autograder.grading.execute",
             "autograder.grading.preprocessors")
LOST = -1000  # the code of a command whose server died under it


def _preload() -> None:
    """Import what every command needs, and each assignment's hidden checks (a module that fails to import
    here fails in the command that uses it, with its own message)."""
    for name in PRELOADED:
        importlib.import_module(name)
    from autograder import hidden

    for module in pkgutil.iter_modules(hidden.__path__):
        try:
            importlib.import_module(f"autograder.hidden.{module.name}")
        except Exception:
            pass
    _read_the_gradebook_revision()
    _render_a_feedback_page()


def _read_the_gradebook_revision() -> None:
    """nbgrader stamps each gradebook it creates (one per assignment a batch registers) with the head revision of
    its alembic migrations, which it asks of the `alembic` command in a subprocess: about 3 s each time. The same
    head is read here once, in this process, from the same migration scripts, and every command forked from here
    is given it."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory
    from nbgrader import api, dbutil

    with dbutil._temp_alembic_ini("sqlite:////tmp/gradebook.db") as ini:   # the URL nbgrader's own question uses
        head = ScriptDirectory.from_config(Config(ini)).get_current_head()
    api.get_alembic_version = lambda: head


def _render_a_feedback_page() -> None:
    """Render a small feedback page once, so the regular expressions, lexers and parsers that every
    feedback page builds on first use (about half a second) are built here, before any command forks."""
    from nbconvert.exporters import HTMLExporter
    from nbformat import v4
    from nbgrader.converters import GenerateFeedback
    from nbgrader.coursedir import CourseDirectory

    graded = {"grade": True, "grade_id": "check", "points": 1, "score": 0, "solution": False, "task": False,
              "comment": None}
    notebook = v4.new_notebook(metadata={"language_info": {"name": "python", "pygments_lexer": "ipython3"}})
    notebook.cells = [
        v4.new_markdown_cell("# A title\n\nText with $x^2$, a [link](https://example.org) and `code`.\n\n- one\n- two"),
        v4.new_code_cell("import torch\nx = torch.ones(3)  # a comment\nprint(x)", metadata={"nbgrader": graded},
                         outputs=[v4.new_output("stream", name="stdout", text="tensor([1., 1., 1.])\n"),
                                  v4.new_output("error", ename="AssertionError", evalue="off",
                                                traceback=["\x1b[0;31mAssertionError\x1b[0m: off"])])]
    resources = {"nbgrader": {"score": 0, "max_score": 1, "late_penalty": 0, "notebook": "warm-up"}}
    HTMLExporter(config=GenerateFeedback(coursedir=CourseDirectory()).config).from_notebook_node(notebook, resources)


def _run_command(request: dict, closing: list[int]) -> int:
    """In the forked child: become the command, run it, and return its exit status."""
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    memory = int(request.get("memory") or 0)
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (log, 1), (log, 2)):  # the server's pipes on 0 and 1 are replaced
        os.dup2(fd, target)
    for fd in {log, null, *closing} - {0, 1, 2}:
        os.close(fd)
    os.environ.update(request.get("env") or {})
    argv = [str(a) for a in request["argv"]]
    sys.argv = ["nbgrader", *argv]
    try:
        from nbgrader.apps.nbgraderapp import NbGraderApp

        NbGraderApp.launch_instance(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _start_kernel_template():
    """Where the grader is root and can build a jail, a warm template for the notebooks' kernels, which the
    commands forked from here find (autograder/jail/sandbox.py `Template`); elsewhere None: each kernel starts cold."""
    from autograder.jail import sandbox as jail

    if os.geteuid() != 0 or jail.why_no_jail() is not None:
        return None
    try:
        template = jail.Template()
    except jail.NoJail:
        return None
    template.export()
    return template


def serve(requests_fd: int = 0, answers_fd: int = 1) -> None:
    """Serve until the grading process is gone; the kernel template, where there is one, ends with the server."""
    _preload()
    template = _start_kernel_template()  # lives as long as the server; closed (its folder removed) when it ends
    try:
        _serve(requests_fd, answers_fd)
    finally:
        if template is not None:
            template.close()


def _serve(requests_fd: int, answers_fd: int) -> None:
    """The server's loop: fork a child per request, report its pid and, once reaped, its exit status."""
    gc.freeze()  # a command's collector never walks what the server built, so those pages stay shared
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD wakes the loop through wake_write
    children: dict[int, str] = {}
    pending = b""

    def answer(message: dict) -> None:
        os.write(answers_fd, (json.dumps(message) + "\n").encode())

    while True:
        try:
            ready, _, _ = select.select([requests_fd, wake_read], [], [])
        except InterruptedError:
            continue
        if wake_read in ready:
            os.read(wake_read, 4096)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            if pid in children:  # not the kernel template, which is a child too
                answer({"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)})
        if requests_fd not in ready:
            continue
        chunk = os.read(requests_fd, 1 << 16)
        if not chunk:  # the grading process is gone: so are its commands
            for pid in children:
                _kill_group(pid)
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _run_command(request, [requests_fd, answers_fd, wake_read, wake_write])
                finally:
                    os._exit(code)
            try:
                os.setpgid(pid, pid)  # also here, so the group exists before the caller can kill it
            except OSError:
                pass
            children[pid] = request["id"]
            answer({"id": request["id"], "pid": pid})


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


class _Command:
    def __init__(self) -> None:
        self.pid = 0
        self.code: int | None = None
        self.forked = threading.Event()
        self.ended = threading.Event()


class Server:
    """The caller's side: run nbgrader commands in children of one warm server process."""

    def __init__(self) -> None:
        # One torch thread per command: a batch grades notebooks side by side, and on a machine of 16 cores a
        # dozen commands of 16 threads each would spend their time waiting for each other.
        self.process = subprocess.Popen([sys.executable, "-m", "autograder.grading.warm"], cwd=ROOT,
                                        env=nbgrader_environment({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        self.lock = threading.Lock()
        self.commands: dict[str, _Command] = {}
        self.count = 0
        self.listener = threading.Thread(target=self._listen, daemon=True)
        self.listener.start()

    def _listen(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            with self.lock:
                command = self.commands.get(message["id"])
            if command is None:
                continue
            if "pid" in message:
                command.pid = int(message["pid"])
                command.forked.set()
            else:
                command.code = int(message["code"])
                command.ended.set()
        with self.lock:  # the server is gone: every command still waiting is lost
            lost = list(self.commands.values())
        for command in lost:
            if command.code is None:
                command.code = LOST
            command.forked.set()
            command.ended.set()

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, argv: list[str], log: str, timeout: float, env: dict[str, str] | None = None,
            memory: int = 0) -> int | None:
        """Run `nbgrader ARGV` in a fresh child, its output in the file `log`; its exit status, LOST when the
        server died under it, or None when it ran past `timeout` seconds (its process group is then killed)."""
        command = _Command()
        with self.lock:
            self.count += 1
            key = str(self.count)
            self.commands[key] = command
            request = {"id": key, "argv": argv, "env": env or {}, "log": log, "memory": memory}
            try:
                self.process.stdin.write((json.dumps(request) + "\n").encode())
                self.process.stdin.flush()
            except (BrokenPipeError, OSError):
                del self.commands[key]
                return LOST
        try:
            if not command.ended.wait(timeout):
                command.forked.wait()
                if command.pid:
                    _kill_group(command.pid)
                command.ended.wait()
                return None
            return command.code
        finally:
            with self.lock:
                self.commands.pop(key, None)

    def close(self) -> None:
        """Stop the server; it kills the children still running."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_server: Server | None = None
_server_lock = threading.Lock()


def server() -> Server:
    """This process's warm server, started on first use and again if it has died."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            if _server is None:
                atexit.register(_close)
            _server = Server()
        return _server


def _close() -> None:
    with _server_lock:
        if _server is not None:
            _server.close()


if __name__ == "__main__":
    serve()
