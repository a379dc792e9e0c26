"""Grading one notebook: the learner's cells run in the jail, the test cells run here.

nbgrader's Execute would run every cell, hidden tests included, in the learner's kernel. Instead,
`JailedExecute` sends each of the learner's code cells (and the given ones) to the runner in the
jail (autograder/jail/sandbox.py), and runs each test cell in this process, the grader's, with every graded
function replaced by a `Remote`: calling it sends the inputs to the jail, where the learner's
function runs, and brings back its answer as data (autograder/jail/inside/wire.py). Test code, seeds and
expected answers never enter the jail; checks run on this side's torch and reference, which no
learner code has touched. Measurements that grade are taken here too: memory by limiting, from
outside, the address space of a process the runner forks for the call while the rest of the jail is
stopped (`Remote.limited_call`), so the notebook's kernel goes on afterwards with its own limits; the
launch of a Triton kernel by the structure of the learner's code (autograder/grading/launches.py).

A kernel that dies or runs past a cell's time limit is replaced by a fresh jail, into which the
learner's cells that had run are run again, so one bad cell costs only its own tests. What went
wrong is kept as anomalies, which the batch grader puts in its summary.
"""

from __future__ import annotations

import ast
import base64
import binascii
import io
import os
import random
import time
from contextlib import redirect_stderr, redirect_stdout

import nbformat
from nbgrader.preprocessors import NbGraderPreprocessor
from traitlets import Bool, Integer

from autograder.jail import sandbox as jail
from autograder.jail import watch
from autograder.grading import kernel_world, launches
from autograder.jail.inside import wire
from autograder.grading.preprocessors import graded_names, is_test_cell, source_notebook_of

MAX_TEXT = 100_000                       # characters of output kept per stream
MAX_IMAGES = 8                           # PNGs kept per cell
MAX_IMAGE_BYTES = 4 << 20
MAX_NOTEBOOK_OUTPUT = 32 << 20           # bytes of output kept for the whole notebook
# A given cell tagged DEMO only shows something (a plot, a measurement) and defines nothing later cells
# use: grading leaves it out while its code is the one handed out, and says so in its output.
DEMO = "demo"
NOT_RUN = "[not run while grading: this cell only demonstrates, and no test depends on it]\n"
# Why a measured call that ran torch's fused attention earns no memory point (autograder/jail/watch.py).
FUSED_REFUSED = ("The memory point is for your own loop over key tiles: that kernel holds no [T, S] matrix either, "
                 "so a call that spends its time in it says nothing of yours.")
# Exceptions the learner's function may raise as themselves; any other becomes a RuntimeError with its name.
PASSED_THROUGH = {e.__name__: e for e in (ValueError, TypeError, NotImplementedError, AssertionError, RuntimeError,
                                          ZeroDivisionError, IndexError, KeyError, OverflowError, ArithmeticError)}


def reset_randomness() -> None:
    """Seed Python's and torch's global generators, so a test cell drawing unseeded inputs draws the same
    ones whatever ran before it: grading is repeatable."""
    import torch

    random.seed(0)
    torch.manual_seed(0)


def _outputs(raw, label: str, anomalies: list[str]) -> list:
    """nbformat outputs from what the jail sent: text streams and PNG or plain-text displays, capped."""
    outputs, images = [], 0
    for item in raw if isinstance(raw, list) else []:
        if not isinstance(item, dict):
            continue
        if item.get("output_type") == "stream" and isinstance(item.get("text"), str):
            name = "stderr" if item.get("name") == "stderr" else "stdout"
            outputs.append(nbformat.v4.new_output("stream", name=name, text=item["text"][:MAX_TEXT]))
        elif item.get("output_type") == "display_data" and isinstance(item.get("data"), dict):
            data = {}
            text = item["data"].get("text/plain")
            if isinstance(text, str):
                data["text/plain"] = text[:MAX_TEXT]
            png = item["data"].get("image/png")
            if isinstance(png, str) and len(png) <= MAX_IMAGE_BYTES and images < MAX_IMAGES:
                try:
                    base64.b64decode(png, validate=True)
                    data["image/png"] = png
                    images += 1
                except (binascii.Error, ValueError):
                    anomalies.append(f"{label}: an image output that is not base64 was dropped")
            if data:
                outputs.append(nbformat.v4.new_output("display_data", data=data))
    return outputs


def _error(name: str, message: str):
    return nbformat.v4.new_output("error", ename=name, evalue=message, traceback=[f"{name}: {message}"])


class KernelLost(Exception):
    """The jail's kernel died, ran out of time or answered out of protocol; it has been stopped."""


class Session:
    """One notebook's kernel in the jail, replaced by a fresh one when it is lost."""

    def __init__(self, jailed: bool, cell_timeout: int, max_restarts: int):
        self.jailed, self.cell_timeout, self.max_restarts = jailed, cell_timeout, max_restarts
        self.kernel: jail.Jail | None = None
        self.restarts = 0
        self.completed: list[str] = []   # learner cells that ran to their end, in order: run again after a restart
        self.anomalies: list[str] = []
        self.deadline = 0.0
        self.output_left = MAX_NOTEBOOK_OUTPUT

    def kernel_now(self) -> jail.Jail:
        """The notebook's kernel, started (and brought up to date) when there is none."""
        if self.kernel is not None:
            return self.kernel
        if self.restarts > self.max_restarts:
            raise KernelLost(f"the notebook's kernel was lost {self.restarts} times, so it was not started again")
        kernel = jail.Jail(jailed=self.jailed)
        try:
            kernel.start()
        except jail.NoJail as failed:
            self.restarts += 1
            why = f"the notebook's kernel could not start: {failed}"
            if why not in self.anomalies:  # the summary says so once, not for every cell that found no kernel
                self.anomalies.append(why)
            raise KernelLost(str(failed)) from None
        self.kernel = kernel
        for code in self.completed:  # a fresh kernel: bring it to where the lost one was
            try:
                self._ask({"op": "run", "code": code}, None, time.monotonic() + self.cell_timeout, "re-running")
            except KernelLost:
                raise KernelLost("the notebook's kernel was lost again while its earlier cells were re-run") from None
        return kernel

    def _lose(self, why: str) -> None:
        left = self.kernel.close() if self.kernel else 0
        self.kernel = None
        self.restarts += 1
        self.anomalies.append(why + (f"; it had left {left} process(es) running" if left else ""))

    def _ask(self, request: dict, tensors: dict | None, deadline: float, what: str,
             address_space: int | None = None) -> tuple[dict, dict]:
        kernel = self.kernel_now()
        try:
            if address_space is None:
                return kernel.ask(request, tensors, deadline)
            return self._measured(kernel, request, tensors, deadline, address_space)
        except wire.TimedOut:
            self._lose(f"{what} ran past its time limit ({self.cell_timeout} s); the kernel was stopped and restarted")
            raise KernelLost(f"it ran past the time limit of {self.cell_timeout} s (an endless loop?)") from None
        except wire.Closed:
            self._lose(f"the kernel died during {what} (it exited, crashed or hit a limit) and was restarted")
            raise KernelLost("the notebook's kernel died (the code exited, crashed or hit a resource limit)") from None
        except wire.Malformed as error:
            self._lose(f"the kernel answered {what} with a malformed message ({error}); it was restarted")
            raise KernelLost(f"the kernel's answer was malformed: {error}") from None

    @staticmethod
    def _measured(kernel: jail.Jail, request: dict, tensors: dict | None, deadline: float,
                  address_space: int) -> tuple[dict, dict]:
        """The call answered by a child of the runner under `address_space` (jail.Jail.measured_child), its
        process watched from outside meanwhile (autograder/jail/watch.py). A child that ends without an answer
        failed under the limit: that is the call's answer, not a lost kernel. A call that ran torch's fused
        attention answers {"fused": where its time went}; what the grader could not watch, and why, goes to
        the answer's "notes", for the summary."""
        notes: list[str] = []
        try:
            with kernel.measured_child(address_space, deadline) as child:
                try:
                    watching = watch.Watch(child)
                except watch.Unwatched as failed:
                    if failed.learner:
                        return {"unmeasured": f"its process was already traced by another process of the notebook's "
                                              f"kernel, so where it spent its time could not be seen ({failed})"}, {}
                    watching = None
                    notes.append(f"it could not be watched ({failed}), so whether it ran torch's fused attention "
                                 "was not checked")
                try:
                    try:
                        answer = kernel.ask_child(child, request, tensors, deadline)
                    except wire.Closed:
                        return {"raised": ["MemoryError", "its process ended without an answer (killed or crashed "
                                                          "under the limit)"]}, {}
                    report = None
                    if watching is not None:
                        try:
                            report = watching.finish()
                        except watch.Unwatched as failed:
                            notes.append(f"watching it failed ({failed}), so whether it ran torch's fused attention "
                                         "was not checked")
                finally:
                    if watching is not None:
                        watching.close()
                kernel.check_alone(child)
                kernel.check_resident(child)
                document, out = answer
                if report is not None and report.ran_fused() and "value" in document:
                    return {"fused": report.text(), "stdout": document.get("stdout")}, {}
                if report is not None and report.mostly_own():
                    notes.append(report.own_text())
                return {**document, "notes": notes}, out
        except jail.NotAlone as refused:  # not a failure under the limit: said as it is
            return {"unmeasured": str(refused), "notes": notes}, {}
        except jail.MeasurementRefused as refused:
            return {"raised": ["MemoryError", str(refused)], "notes": notes}, {}

    def run_cell(self, code: str, label: str) -> list:
        """Run a learner cell in the jail; its outputs as nbformat outputs."""
        try:
            answer, _ = self._ask({"op": "run", "code": code}, None, time.monotonic() + self.cell_timeout, label)
        except KernelLost as lost:
            return [_error("KernelLost", f"this cell was stopped: {lost}")]
        self.completed.append(code)
        outputs = self._within_budget(_outputs(answer.get("outputs"), label, self.anomalies), label)
        error = answer.get("error")
        if isinstance(error, list) and len(error) == 2 and all(isinstance(e, str) for e in error):
            outputs.append(_error(error[0][:100], error[1][:2000]))
        return outputs

    def _within_budget(self, outputs: list, label: str) -> list:
        size = sum(len(str(o)) for o in outputs)
        if size <= self.output_left:
            self.output_left -= size
            return outputs
        if self.output_left > 0:
            self.anomalies.append(f"{label}: the notebook's output passed {MAX_NOTEBOOK_OUTPUT >> 20} MiB; "
                                  "later output was dropped")
        self.output_left = 0
        return [nbformat.v4.new_output("stream", name="stdout", text="[output dropped: the notebook printed too much]\n")]

    def call(self, name: str, args: tuple, kwargs: dict, address_space: int | None = None, ranks: dict | None = None):
        """The learner's `name`(*args, **kwargs), run in the jail; its value, or its exception raised here.
        With ranks ({"backend", "timeout_s"}), args holds one tuple of arguments per rank and the function
        runs on every rank of a process group in the jail (flashcourse.distributed); the ranks' answers."""
        tensors: dict = {}
        encoded = wire.encode([list(args), dict(kwargs)], tensors)["list"]
        request = {"op": "call", "name": name, "args": encoded[0], "kwargs": encoded[1]}
        if ranks is not None:
            request["ranks"] = ranks
        try:
            answer, out = self._ask(request, tensors, self.deadline, f"a call of {name}", address_space)
        except KernelLost as lost:
            raise AssertionError(f"{name} could not be graded on this input: {lost}") from None
        if isinstance(answer.get("stdout"), str) and answer["stdout"]:
            print(answer["stdout"][:MAX_TEXT], end="")
        if address_space is not None:
            for note in answer.get("notes") or []:   # the grader's own, about what it could not watch
                self.anomalies.append(f"a measured call of {name}: {note}")
        if "unmeasured" in answer and address_space is not None:
            raise AssertionError(f"{name} was not measured: {str(answer['unmeasured'])[:2000]}")
        if "fused" in answer and address_space is not None:
            self.anomalies.append(f"a measured call of {name} ran torch's fused attention, so its memory point was "
                                  f"refused: {answer['fused']}")
            raise AssertionError(f"{name} ran torch's fused attention: {answer['fused']}. " + FUSED_REFUSED)
        if "raised" in answer:
            kind, message = (answer["raised"] + ["", ""])[:2] if isinstance(answer["raised"], list) else ("", "")
            kind, message = str(kind)[:100], str(message)[:2000]
            if address_space is not None:
                raise MemoryError(f"{kind}: {message}")
            raise PASSED_THROUGH[kind](message) if kind in PASSED_THROUGH else RuntimeError(f"{kind}: {message}")
        if "failed" in answer:
            raise AssertionError(f"the answer of {name} could not be sent back to the grader: {answer['failed']}")
        try:
            return wire.decode(answer.get("value"), out, device_ok=_device_ok)
        except wire.Unsendable as kind:
            raise AssertionError(f"{name} returned a {kind}, which the grader cannot check") from None
        except wire.Malformed as error:
            self.anomalies.append(f"a call of {name} answered with a malformed value ({error})")
            raise AssertionError(f"the answer of {name} was malformed: {error}") from None

    def close(self) -> None:
        if self.kernel is not None:
            left = self.kernel.close()
            if left:
                self.anomalies.append(f"the notebook left {left} process(es) running; they were stopped with its jail")
            self.kernel = None


def _device_ok(device: str) -> bool:
    import torch

    return device.startswith("cuda") and torch.cuda.is_available()


class Remote:
    """Stands in for a graded function in a test cell: each call runs the learner's function in the jail."""

    def __init__(self, name: str, session: Session):
        self.__name__ = self.name = name
        self.session = session

    def __call__(self, *args, **kwargs):
        return self.session.call(self.name, args, kwargs)

    def limited_call(self, allowance: int, *args, **kwargs):
        """The call, in a process whose address space is limited to `allowance` bytes more than the runner
        had at start-up, with no new process or thread allowed (flashcourse.memory's protocol for measuring
        from outside). MemoryError when the kernel already holds half of it (jail.Jail.measured_child), or the
        call failed under the limit; AssertionError when another process of the jail ran meanwhile."""
        kernel = self.session.kernel_now()
        return self.session.call(self.name, args, kwargs, address_space=kernel.start_size + allowance)

    def call_on_ranks(self, rank_args, *, backend: str = "gloo", timeout_s: float = 60.0, allowance: int | None = None,
                      group_ranks=None, world_size: int | None = None, **kwargs):
        """flashcourse.distributed.call_on_ranks for the learner's function: the process group is started in
        the jail, rank r calls it with rank_args[r] (and only rank r receives them) and **kwargs; the ranks'
        answers, in rank order. With an allowance (bytes), each rank's peak memory is measured from outside
        (jail.Jail.call_on_ranks) and a rank that held more fails the call. With group_ranks, the group's ranks
        of a world of world_size are called with group= it, in group order."""
        ranks = {"backend": backend, "timeout_s": timeout_s, "allowance": allowance}
        if group_ranks is not None:
            ranks.update(group_ranks=[int(r) for r in group_ranks], world_size=world_size)
        return self.session.call(self.name, tuple(tuple(a) for a in rank_args), kwargs, ranks=ranks)


class Refused:
    """Stands in for a graded function whose code cannot earn points (it launches no kernel of its own)."""

    def __init__(self, name: str, why: str):
        self.__name__, self.why = name, why

    def __call__(self, *args, **kwargs):
        raise AssertionError(self.why)


class JailedExecute(NbGraderPreprocessor):
    """Run the learner's cells in the jail and the test cells in the grader (replaces nbgrader's Execute)."""

    timeout = Integer(300, help="seconds one cell (or one test cell's calls) may run").tag(config=True)
    # 01 has four test cells that call tile_update: a tile_update that hangs loses each of them a kernel,
    # and merge_states, graded after them, must still find one.
    max_restarts = Integer(6, help="fresh kernels started after the notebook's kernel is lost").tag(config=True)
    trusted = Bool(False, help="grade without a jail where none can be built: only for notebooks you trust, such "
                               "as the course's samples").tag(config=True)

    def preprocess(self, nb, resources):
        source = source_notebook_of(resources)
        names = graded_names(source)
        # What runs here is the instructor's code for each test cell, chosen by its id: a cell the
        # learner dressed up as a test cell runs in the jail like any other of theirs.
        tests = {c.metadata.nbgrader["grade_id"]: c.source for c in source.cells if is_test_cell(c)}
        learner_code = [c.source for c in nb.cells if c.cell_type == "code"
                        and c.metadata.get("nbgrader", {}).get("grade_id") not in tests]
        solution_code = [c.source for c in source.cells if c.cell_type == "code" and not is_test_cell(c)]
        launchers = launches.launching_functions(solution_code) & set(names)
        refused = launches.missing_launches(learner_code, launchers)
        no_jail = jail.why_no_jail()
        if no_jail and not self.trusted:
            raise jail.NoJail(f"refusing to run this notebook without a jail: {no_jail}")
        session = Session(jailed=not no_jail, cell_timeout=self.timeout, max_restarts=self.max_restarts)
        if no_jail:
            session.anomalies.append(f"graded WITHOUT a jail (trusted notebook): {no_jail.split('. ')[0]}")
        stand_ins = {n: Refused(n, refused[n]) if n in refused else Remote(n, session) for n in names}
        kernel_run = KernelRun(kernel_world.build(learner_code, source, launchers), session) if launchers else None
        self.given = kernel_world.given_definitions(source, names)
        demos = {c.get("id"): c.source for c in source.cells if c.cell_type == "code" and DEMO in c.metadata.get("tags", [])}
        try:
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
                if grade_id in tests:
                    cell.source = tests.pop(grade_id)
                    cell.outputs = self._run_test(grade_id, cell.source, stand_ins, session, kernel_run)
                elif cell.get("id") in demos and cell.source == demos[cell.get("id")]:
                    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=NOT_RUN)]
                else:
                    cell.outputs = session.run_cell(cell.source, f"cell {index + 1}")
                cell.execution_count = None
        finally:
            session.close()
            if kernel_run is not None:
                session.anomalies.extend(kernel_run.close())
        for anomaly in session.anomalies:
            self.log.warning("%s", anomaly)
        if os.environ.get(jail.ANOMALIES_ENV):
            with open(os.environ[jail.ANOMALIES_ENV], "a") as f:
                f.writelines(f"{a}\n" for a in session.anomalies)
        return nb, resources

    def _run_test(self, grade_id: str, source: str, stand_ins: dict, session: Session,
                  kernel_run: KernelRun | None) -> list:
        """The instructor's test cell, run here; what the hidden part of it prints stays out of the feedback.
        Where it calls a wrapper that launches the learner's kernels, it runs a second time with the
        grader's own wrapper launching those kernels (KernelRun), and passes only if both runs pass."""
        if self.given:  # the given helpers the test calls are the instructor's, not the notebook's copy
            session.run_cell(self.given, "the given helpers")
        printed = io.StringIO()
        error = self._exec_test(grade_id, source, stand_ins, [session], printed)
        used = _names_in(source) & set(kernel_run.stand_ins) if kernel_run else set()
        if error is None and used:
            error = self._exec_test(grade_id, source, {**stand_ins, **kernel_run.stand_ins},
                                    [session, kernel_run.session], io.StringIO())
            if error is not None:
                error = _error(error.ename, f"your kernels, launched by the grader's own {', '.join(sorted(used))} "
                                            f"(the launch code given in the notebook) on the same inputs: "
                                            f"{error.evalue}")
        text = printed.getvalue()[:MAX_TEXT]
        return [*([nbformat.v4.new_output("stream", name="stdout", text=text)] if text else []),
                *([error] if error else [])]

    def _exec_test(self, grade_id: str, source: str, stand_ins: dict, sessions: list[Session],
                   printed: io.StringIO):
        """Run the test cell's parts in order, the visible ones printing into `printed`; the error output, or None."""
        for each in sessions:
            each.deadline = time.monotonic() + self.timeout
        reset_randomness()
        namespace = {"__name__": "__grader__", **stand_ins}
        for part, visible in _test_parts(source):
            with redirect_stdout(printed if visible else io.StringIO()), \
                    redirect_stderr(printed if visible else io.StringIO()):
                try:
                    exec(compile(part, f"<test cell {grade_id}>", "exec"), namespace)
                except Exception as failure:
                    return _error(type(failure).__name__, str(failure))
        return None


HIDDEN_BEGIN, HIDDEN_END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"


def _test_parts(source: str) -> list[tuple[str, bool]]:
    """The test cell cut at its hidden-test markers: (code, visible) in order. Each part keeps its line
    numbers; a cell whose parts do not compile on their own is one hidden part."""
    parts, lines, visible, start = [], source.splitlines(keepends=True), True, 0
    for number, line in enumerate(lines):
        marker = line.strip()
        if marker in (HIDDEN_BEGIN, HIDDEN_END) and marker == (HIDDEN_BEGIN if visible else HIDDEN_END):
            parts.append(("\n" * start + "".join(lines[start:number]), visible))
            visible, start = not visible, number + 1
    parts.append(("\n" * start + "".join(lines[start:]), visible))
    try:
        for part, _ in parts:
            compile(part, "<test cell>", "exec")
    except SyntaxError:
        return [(source, len(parts) == 1)]
    return parts


def _names_in(source: str) -> set[str]:
    """The names a test cell reads (kernel_world's reading of a statement); none if it does not parse."""
    try:
        return kernel_world.loaded_names(ast.parse(source))
    except SyntaxError:
        return set()


class KernelRun:
    """The learner's kernels launched by the instructor's wrappers, in a jail of their own
    (autograder/grading/kernel_world.py): a stand-in per wrapper, set up on the first call."""

    def __init__(self, world: kernel_world.KernelWorld, notebook: Session):
        self.world = world
        self.session = Session(jailed=notebook.jailed, cell_timeout=notebook.cell_timeout,
                               max_restarts=notebook.max_restarts)
        self.failed: str | None = None
        self.stand_ins = {}
        for name in world.wrappers:
            if name in world.missing:
                self.stand_ins[name] = Refused(name, world.missing[name])
            else:
                self.stand_ins[name] = _SetUpFirst(name, self)

    def set_up(self) -> None:
        """Run the kernel world's program once; AssertionError, saying why, if it cannot be set up."""
        if not self.session.completed and self.failed is None:
            outputs = self.session.run_cell(self.world.program, "the kernel run's set-up")
            errors = [o for o in outputs if o.output_type == "error"]
            if errors:
                self.failed = f"{errors[0].ename}: {errors[0].evalue}"
        if self.failed is not None:
            raise AssertionError(f"your kernels could not be set up to run on their own: {self.failed}")


    def close(self) -> list[str]:
        """Stop the kernel run's jail (its compiler process with it); what went wrong there, for the summary."""
        if self.session.kernel is not None:
            self.session.kernel.close()
            self.session.kernel = None
        return [f"the kernel run: {anomaly}" for anomaly in self.session.anomalies]


class _SetUpFirst(Remote):
    def __init__(self, name: str, run: KernelRun):
        super().__init__(name, run.session)
        self.run = run

    def __call__(self, *args, **kwargs):
        self.run.set_up()
        return super().__call__(*args, **kwargs)
