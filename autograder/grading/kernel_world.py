"""The world of a kernel run: the learner's Triton kernels and the grader's own launch code, nothing else.

A kernel point is earned by the learner's kernel computing the answer. So the grader takes from the
learner's parsed notebook only the kernels the exercise asks for (the @triton.jit functions of the
source's solution cells), the @triton.jit helpers and constexpr globals they use, and the triton
imports they need; it launches them with the instructor's wrappers from source/ in a fresh jail that
holds none of the learner's other code (autograder/jail/inside/kernel_host.py runs there). What a learner's
wrapper computes, or whether it launches anything at all, cannot change what that run returns.

What is taken from the learner is taken by the structure of the notebook, never by its text: a kernel
is a top-level function under Triton's jit (as autograder/grading/launches.py reads it), rebuilt here under a
plain `@triton.jit` (autotune and heuristics are the launch code's business: the grader's wrappers pass
the block sizes). So that building the module runs none of the learner's Python, a kernel's default
values must be constants and its annotations names (`tl.constexpr`), and a global is taken only when
its value is a constant (`BLOCK = tl.constexpr(64)`, `LOG2E = 1.4426950408889634`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from autograder.grading import launches
from autograder.grading.preprocessors import is_test_cell

HOST = Path(__file__).resolve().parents[1] / "jail" / "inside" / "kernel_host.py"
MODULE_PATH = "/tmp/flashcourse-kernel-run/learner_kernels.py"  # the jail's own private /tmp
KERNEL_MODULES = ("triton", "math")                              # imports a kernel module may hold


@dataclass
class KernelWorld:
    """The program that sets up a kernel run, and what of the learner's could not be taken."""

    program: str
    wrappers: list[str]                                     # the graded functions whose kernels it runs
    kernels: list[str]                                      # the learner's kernels the wrappers launch
    missing: dict[str, str] = field(default_factory=dict)   # wrapper -> why its kernels were not all taken


def _top_level(trees: list[ast.Module]) -> dict[str, tuple[int, ast.stmt]]:
    """name -> (order, the last top-level statement that binds it), over the cells in order."""
    bound: dict[str, tuple[int, ast.stmt]] = {}
    order = 0
    for tree in trees:
        for statement in tree.body:
            order += 1
            for name in _binds(statement):
                bound[name] = (order, statement)
    return bound


def _binds(statement: ast.stmt) -> list[str]:
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [statement.name]
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return [a.asname or a.name.split(".")[0] for a in statement.names if a.name != "*"]
    if isinstance(statement, ast.Assign):
        return [t.id for t in statement.targets if isinstance(t, ast.Name)]
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.value:
        return [statement.target.id]
    if isinstance(statement, (ast.Try, ast.If)):  # `try: from x import y except ImportError: y = None`
        blocks = [statement.body, statement.orelse, *(getattr(statement, "finalbody", []),),
                  *(h.body for h in getattr(statement, "handlers", []))]
        return sorted({name for block in blocks for inner in block for name in _binds(inner)})
    return []


def loaded_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _free_names(statement: ast.stmt) -> set[str]:
    """Names a top-level statement reads from the module (a function's own parameters and locals left out)."""
    loaded = loaded_names(statement)
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = statement.args
        local = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        local |= {a.arg for a in (args.vararg, args.kwarg) if a}
        local |= {n.id for n in ast.walk(statement) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        globals_ = {name for n in ast.walk(statement) if isinstance(n, ast.Global) for name in n.names}
        return (loaded - local) | globals_
    return loaded


def _constant(node: ast.expr | None) -> bool:
    try:
        ast.literal_eval(node)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _dotted(node: ast.expr) -> bool:
    """A name or a chain of attributes of one (`tl.constexpr`): reading it runs no code of the notebook."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _constexpr_value(value: ast.expr) -> ast.expr | None:
    """The constant of `C`, `tl.constexpr(C)` or `triton.language.constexpr(C)`; None for anything else."""
    if isinstance(value, ast.Call) and _dotted(value.func) and len(value.args) == 1 and not value.keywords and \
            (value.func.attr if isinstance(value.func, ast.Attribute) else value.func.id) == "constexpr":
        value = value.args[0]
    return value if _constant(value) else None


class _LearnerKernels:
    """The kernel module's part taken from the learner's cells: kernels, their jit helpers, constants, imports."""

    def __init__(self, sources: list[str]):
        trees = launches.cell_trees(sources)
        self.kernels = launches.kernel_defs(trees)
        self.bound = _top_level(trees)
        self.lines: dict[int, str] = {}   # order -> source, so the module keeps the notebook's order
        self.missing: dict[str, str] = {}
        self.done: set[str] = set()

    def take(self, name: str, wanted_by: str | None = None) -> None:
        if name in self.done:
            return
        self.done.add(name)
        if name in self.kernels:
            self._take_kernel(name, self.kernels[name])
            return
        if name not in self.bound:
            if wanted_by is None:
                self.missing[name] = f"your notebook defines no @triton.jit kernel named {name}"
            return  # a builtin or a name of tl's: the compiler says so if it is neither
        order, statement = self.bound[name]
        if wanted_by is None:
            self.missing[name] = f"{name} in your notebook is not a @triton.jit kernel"
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            self._take_import(order, statement, name)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign)) and _constexpr_value(statement.value) is not None:
            self.lines[order] = f"{name} = triton.language.constexpr({ast.unparse(_constexpr_value(statement.value))})"

    def _take_kernel(self, name: str, node: ast.FunctionDef) -> None:
        args = node.args
        defaults = [d for d in args.defaults + args.kw_defaults if d is not None]
        annotations = [a.annotation for a in args.posonlyargs + args.args + args.kwonlyargs if a.annotation]
        if not all(_constant(d) or isinstance(d, ast.Name) for d in defaults) or \
                not all(_dotted(a) for a in annotations) or node.returns is not None:
            self.missing[name] = (f"{node.name}'s parameters have default values that are not constants, or "
                                  "annotations other than tl.constexpr: the grader cannot take it on its own")
            return
        kernel = ast.FunctionDef(name=node.name, args=args, body=node.body, decorator_list=[], returns=None,
                                 type_comment=None, type_params=[])
        order = self.bound.get(node.name, self.bound.get(name, (0,)))[0]
        text = "@triton.jit\n" + ast.unparse(ast.fix_missing_locations(kernel))
        if node.name != name:
            text += f"\n{name} = {node.name}"
        self.lines[order] = text
        for used in sorted(_free_names(node) | {d.id for d in defaults if isinstance(d, ast.Name)}):
            self.take(used, wanted_by=name)

    def _take_import(self, order: int, statement: ast.stmt, name: str) -> None:
        for alias in statement.names:
            if (alias.asname or alias.name.split(".")[0]) != name:
                continue
            module = statement.module if isinstance(statement, ast.ImportFrom) else alias.name
            if isinstance(statement, ast.ImportFrom) and statement.level:
                return
            if (module or "").split(".")[0] in KERNEL_MODULES:
                single = type(statement)(**{**statement.__dict__, "names": [alias]})
                self.lines[order] = ast.unparse(single)


class _LaunchCode:
    """The instructor's code that the graded wrappers need, from source/'s cells other than tests."""

    def __init__(self, source: nbformat.NotebookNode):
        cells = [(c, launches.cell_trees([c.source])) for c in source.cells if c.cell_type == "code" and not is_test_cell(c)]
        self.trees = [tree for _, trees in cells for tree in trees]
        self.bound = _top_level(self.trees)
        self.kernels = launches.kernel_defs(self.trees)
        # The learner's kernels: the jit functions their solution cells define (a wrapping such as
        # `tuned = triton.autotune(...)(kernel)` is launch code, and stays the instructor's).
        self.solution_kernels = {s.name for cell, trees in cells if cell.metadata.get("nbgrader", {}).get("solution")
                                 for tree in trees for s in tree.body
                                 if isinstance(s, ast.FunctionDef) and self._is_kernel(s)}

    def _is_kernel(self, node: ast.FunctionDef) -> bool:
        return self.kernels.get(node.name) is node

    def closure(self, roots: set[str]) -> tuple[list[tuple[int, ast.stmt]], set[str], set[str]]:
        """The statements the roots need, in order; the learner's kernels and the given kernels they use."""
        statements, learners, given, seen = {}, set(), set(), set()
        todo = list(roots)
        while todo:
            name = todo.pop()
            if name in seen or name not in self.bound:
                continue
            seen.add(name)
            if name in self.solution_kernels:
                learners.add(name)
                continue
            order, statement = self.bound[name]
            if name in self.kernels and isinstance(statement, ast.FunctionDef):
                given.add(name)   # the kernel module takes it, with what it uses
                continue
            statements[order] = statement
            todo.extend(_free_names(statement))
        return sorted(statements.items()), learners, given


def build(learner_sources: list[str], source: nbformat.NotebookNode, wrappers: set[str]) -> KernelWorld:
    """The program that defines the learner's kernels and the instructor's `wrappers` in a fresh jail."""
    code = _LaunchCode(source)
    statements, learner_names, given = code.closure(set(wrappers))
    learner = _LearnerKernels(learner_sources)
    for name in sorted(learner_names):
        learner.take(name)
    # The instructor's given kernels (and their own helpers) go in the same module, after the learner's:
    # a given kernel calls the learner's helpers by name, and the given code is the instructor's.
    given_lines, given_seen, todo = {}, set(), sorted(given)
    while todo:
        name = todo.pop()
        if name in given_seen or name in code.solution_kernels or name not in code.bound:
            if name in code.solution_kernels:
                learner.take(name)
            continue
        given_seen.add(name)
        order, statement = code.bound[name]
        given_lines[order] = ast.unparse(statement)
        todo.extend(_free_names(statement))
    module = "\n\n".join(["import triton", "import triton.language as tl",
                          *(learner.lines[k] for k in sorted(learner.lines)),
                          *(given_lines[k] for k in sorted(given_lines))]) + "\n"
    kernels = sorted((learner_names | given) - set(learner.missing))
    missing = {}
    for wrapper in sorted(wrappers):  # a wrapper is refused only for the kernels it needs itself
        needs = code.closure({wrapper})[1]
        why = [learner.missing[k] for k in sorted(needs) if k in learner.missing]
        if why:
            missing[wrapper] = "; ".join(why)
    program = "\n".join([
        "from flashcourse import runtime",
        "runtime.setup(quiet=True)",
        HOST.read_text(),
        "import os as _os",
        f"_os.makedirs({str(Path(MODULE_PATH).parent)!r}, exist_ok=True)",
        f"with open({MODULE_PATH!r}, 'w') as _module:",
        f"    _module.write({module!r})",
        f"globals().update(load({MODULE_PATH!r}, {kernels!r}, runtime.current().interpret))",
        *(ast.unparse(s) for _, s in statements if not _binds_only(s, given | learner_names)),
    ])
    return KernelWorld(program, sorted(wrappers), sorted(learner_names), missing)


def _binds_only(statement: ast.stmt, names: set[str]) -> bool:
    """An import of a kernel module's names only (they come from the kernel module instead)."""
    bound = _binds(statement)
    return bool(bound) and set(bound) <= names


def given_definitions(source: nbformat.NotebookNode, names: list[str]) -> str:
    """The instructor's code of the graded names that source/ gives whole (a function in a solution cell
    with no solution region in it, such as 06's train_step_gradients): test cells call these, never the
    notebook's copy, which a learner may have rewritten."""
    given = []
    for cell in source.cells:
        if cell.cell_type != "code" or not cell.metadata.get("nbgrader", {}).get("solution"):
            continue
        regions, start = [], None   # the solution regions' line numbers, 1-based
        for number, line in enumerate(cell.source.splitlines(), 1):
            if line.strip() == "### BEGIN SOLUTION":
                start = number
            elif line.strip() == "### END SOLUTION" and start is not None:
                regions.append((start, number))
                start = None
        for tree in launches.cell_trees([cell.source]):
            for statement in tree.body:
                first = min([statement.lineno, *(d.lineno for d in getattr(statement, "decorator_list", []))])
                if isinstance(statement, ast.FunctionDef) and statement.name in names and \
                        not any(a <= statement.end_lineno and first <= b for a, b in regions):
                    given.append(ast.unparse(statement))
    return "\n\n".join(given)
