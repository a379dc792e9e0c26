"""Does a graded wrapper launch a Triton kernel that the learner wrote in the notebook?

Assignments 04 and 05 give their kernel points for wrappers (flash_attention; fast_attention,
fast_decode) that run the learner's own kernel. The numbers alone cannot tell a wrapper that
launches the learner's kernel from one that computes attention with PyTorch or launches the
finished engine's kernel, so this module reads the learner's code, parsed with Python's `ast`,
and decides it from the structure:

- a *kernel* is a top-level function defined in the cells whose decorators include Triton's jit
  (`@triton.jit`, `@jit` imported from triton, `@triton.jit(...)`, under `@triton.autotune(...)` or
  `@triton.heuristics(...)`), or a top-level name assigned from such a wrapping of a function of
  the cells (`k = triton.jit(f)`, `tuned = triton.autotune(...)(kernel)`);
- a *launch* is a call whose callee is a subscript of a kernel, `kernel[grid](...)`, also through
  a local alias (`fn = a if cond else b; fn[grid](...)`, `run = kernel[grid]; run(...)`, a
  parameter whose default is the kernel);
- a function launches if its body (nested functions included) launches, if it calls by name a
  top-level function that launches, or if it passes a kernel to a top-level function that
  launches one of its own parameters (`_launch(kernel, grid, ...)`).

`kernel_defs` gives the kernels so read (what autograder/grading/kernel_world.py takes of a notebook), and
`launching_functions` and `missing_launches` the wrappers that launch them.

Cells count in order, as the notebook runs them: a later definition of a name replaces an earlier
one, and a function body sees the names as they are at the end. Decorators are read as they are when
the function is defined.

Limits: this is a static reading, not a proof. It does not say the kernel is correct (the tests
do), nor that the launching line is reached at run time. Methods of classes, kernels kept in
containers or attributes, kernels handed on through more than one level of parameters, and names
brought in by `from module import *` are not followed. A wrapper's own decorators are taken to keep
the function. Cells that do not parse, even after IPython's syntax (%magics, !shell, `?`) is turned
into Python, are skipped; the bodies of %%time and %%capture cells count, since they run in the
notebook's namespace.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from IPython.core.inputtransformer2 import TransformerManager

# Cell magics that run their body in the notebook's namespace: its definitions stay.
NAMESPACE_CELL_MAGICS = {"time", "capture"}
# Triton decorators that may wrap a kernel, as `triton.NAME(...)(kernel)` or stacked over @triton.jit.
KERNEL_WRAPPERS = {"jit", "autotune", "heuristics"}


@dataclass(frozen=True)
class _Binding:
    """What a top-level name holds: a function, a kernel, the triton module or one of its attributes."""

    kind: str  # "function", "kernel", "module", "triton_attr" or "other"
    node: ast.AST | None = None  # the def of a function or kernel
    detail: str = ""  # the module's dotted path, or the triton attribute's name


_OTHER = _Binding("other")


def cell_trees(sources: list[str]) -> list[ast.Module]:
    """Parse each code cell, IPython syntax turned into Python first; a cell that does not parse is skipped."""
    transformer = TransformerManager()
    trees = []
    for source in sources:
        tree = _parse_cell(source, transformer)
        if tree is not None:
            trees.append(tree)
    return trees


def _parse_cell(source: str, transformer: TransformerManager, depth: int = 0) -> ast.Module | None:
    try:
        tree = ast.parse(transformer.transform_cell(source))
    except Exception:  # learner's text: any failure to read it means the cell is skipped, never a crash
        return None
    body = _namespace_magic_body(tree)
    if body is not None and depth < 4:  # %%time over %%capture is fine; deeper is not a notebook
        return _parse_cell(body, transformer, depth + 1)
    return tree


def _namespace_magic_body(tree: ast.Module) -> str | None:
    """The body of a cell that is one `get_ipython().run_cell_magic('time', line, body)`, else None."""
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return None
    call = tree.body[0].value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr == "run_cell_magic" and len(call.args) == 3):
        return None
    name, _, body = call.args
    if (isinstance(name, ast.Constant) and name.value in NAMESPACE_CELL_MAGICS
            and isinstance(body, ast.Constant) and isinstance(body.value, str)):
        return body.value
    return None


class _Namespace:
    """The top-level names after running the cells' statements in order (definitions, imports, assignments)."""

    def __init__(self, trees: list[ast.Module]):
        self.names: dict[str, _Binding] = {}
        for tree in trees:
            self._run(tree.body)

    def _run(self, statements: list[ast.stmt]) -> None:
        for statement in statements:
            self._statement(statement)

    def _statement(self, node: ast.stmt) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind = "kernel" if self._is_kernel_def(node) else "function"
            self.names[node.name] = _Binding(kind, node)
        elif isinstance(node, ast.ClassDef):
            self.names[node.name] = _OTHER
        elif isinstance(node, ast.Import):
            for alias in node.names:
                # `import triton.language` binds `triton`; `import triton.language as tl` binds tl to the submodule
                path = alias.name if alias.asname else alias.name.split(".")[0]
                self.names[alias.asname or path] = _Binding("module", detail=path)
        elif isinstance(node, ast.ImportFrom):
            from_triton = node.level == 0 and _is_triton_path(node.module or "")
            for alias in node.names:
                if alias.name != "*":  # a star import's names are unknown: not followed
                    held = _Binding("triton_attr", detail=alias.name) if from_triton else _OTHER
                    self.names[alias.asname or alias.name] = held
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind(target, node.value)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            self._bind(node.target, node.value)
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                self._bind(target, None)
        else:
            # Compound statements at top level (if, try, with, for, while, match): their targets
            # hold values unknown here; their bodies run in order, every branch read.
            for name in _bound_names(node, descend=False):
                self.names[name] = _OTHER
            for handler in getattr(node, "handlers", []):
                if handler.name:  # `except E as e` binds e
                    self.names[handler.name] = _OTHER
            for block in _statement_blocks(node):
                self._run(block)

    def _bind(self, target: ast.expr, value: ast.expr | None) -> None:
        if isinstance(target, ast.Name):
            self.names[target.id] = _OTHER if value is None else self.value(value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            parts = value.elts if isinstance(value, (ast.Tuple, ast.List)) else None
            if parts is not None and len(parts) == len(target.elts):
                for part_target, part in zip(target.elts, parts):
                    self._bind(part_target, part)
            else:
                for name in _target_names(target):
                    self.names[name] = _OTHER
        elif isinstance(target, ast.Starred):
            self._bind(target.value, None)
        # attribute and subscript targets bind no top-level name

    def value(self, node: ast.expr) -> _Binding:
        """What a top-level expression evaluates to, as far as kernels are concerned."""
        if isinstance(node, ast.Name):
            return self.names.get(node.id, _OTHER)
        attr = self.triton_attr(node)
        if attr is not None:
            return _Binding("triton_attr", detail=attr)
        if isinstance(node, ast.IfExp):  # either branch may be the one taken
            for branch in (node.body, node.orelse):
                if self.value(branch).kind == "kernel":
                    return self.value(branch)
            return _OTHER
        wrapped = self.wrapped_kernel(node)
        return wrapped if wrapped is not None else _OTHER

    def wrapped_kernel(self, node: ast.expr) -> _Binding | None:
        """`triton.jit(f)` of a function of the cells, or `triton.autotune(...)(kernel)`: a kernel, else None."""
        if not isinstance(node, ast.Call) or len(node.args) != 1:
            return None
        inner = self.value(node.args[0])
        factory = isinstance(node.func, ast.Call)  # a decorator factory applied: triton.autotune(configs=...)(k)
        wrapper = self.triton_attr(node.func.func if factory else node.func)
        if wrapper == "jit" and inner.kind in ("function", "kernel"):
            return _Binding("kernel", inner.node)
        if wrapper in KERNEL_WRAPPERS and factory and inner.kind == "kernel":
            return inner
        return None

    def triton_attr(self, node: ast.expr) -> str | None:
        """The name of the triton attribute that `node` refers to (`triton.jit`, `jit` from triton), else None."""
        if isinstance(node, ast.Name):
            held = self.names.get(node.id)
            return held.detail if held is not None and held.kind == "triton_attr" else None
        if isinstance(node, ast.Attribute) and _is_triton_path(self._module_path(node.value) or ""):
            return node.attr
        return None

    def _module_path(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            held = self.names.get(node.id)
            if held is None:  # the import may sit in a cell that does not parse: `triton` is still triton
                return "triton" if node.id == "triton" else None
            return held.detail if held.kind == "module" else None
        if isinstance(node, ast.Attribute):
            base = self._module_path(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def _is_kernel_def(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        # Every decorator must be Triton's (one of them jit): any other could replace the kernel with anything.
        names = [self.triton_attr(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
        return "jit" in names and None not in names


def _is_triton_path(path: str) -> bool:
    return path == "triton" or path.startswith("triton.")


def _statement_blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists directly inside a compound statement, in the order they would run."""
    blocks = [getattr(node, name) for name in ("body", "orelse", "finalbody")
              if isinstance(getattr(node, name, None), list)]
    blocks += [handler.body for handler in getattr(node, "handlers", [])]
    blocks += [case.body for case in getattr(node, "cases", [])]
    return blocks


def _target_names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _bound_names(node: ast.AST, descend: bool = True) -> set[str]:
    """Names a statement binds: with descend, everywhere inside it (a function's locals); else its own targets."""
    nodes = ast.walk(node) if descend else [node]
    names: set[str] = set()
    for n in nodes:
        if isinstance(n, ast.Assign):
            for target in n.targets:
                names |= _target_names(target)
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr, ast.For, ast.AsyncFor, ast.comprehension)):
            names |= _target_names(n.target)
        elif isinstance(n, (ast.With, ast.AsyncWith)):
            for item in n.items:
                if item.optional_vars is not None:
                    names |= _target_names(item.optional_vars)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in n.names if a.name != "*"}
        elif descend and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif descend and isinstance(n, ast.arg):
            names.add(n.arg)
    return names


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = node.args
    every = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    return {a.arg for a in every}


@dataclass
class _Facts:
    """What one top-level function does with kernels, read from its body (nested functions included)."""

    kernels: set[str] = field(default_factory=set)  # kernels it launches itself
    calls: set[str] = field(default_factory=set)  # top-level functions it calls by name
    passes_kernel_to: set[str] = field(default_factory=set)  # top-level functions it hands a kernel to
    launches_parameter: bool = False  # it launches `p[grid](...)` for one of its parameters p
    foreign: set[str] = field(default_factory=set)  # what it launches that is not a kernel of the cells


class _FunctionReader:
    """Reads one function against the final top-level names; its own local names shadow them."""

    def __init__(self, node: ast.FunctionDef | ast.AsyncFunctionDef, namespace: _Namespace):
        self.namespace = namespace
        self.parameters = _parameters(node)
        declared_global = {name for n in ast.walk(node) if isinstance(n, ast.Global) for name in n.names}
        self.locals = _bound_names(node) - {node.name} - declared_global
        self.aliases: dict[str, set[str]] = {}  # local name -> the kernels it may hold
        self.launchers: dict[str, set[str]] = {}  # local name -> kernels it holds launched on a grid
        self._read_aliases(node)
        self.facts = self._read_calls(node)

    def kernel_refs(self, node: ast.expr) -> set[str]:
        """The kernels of the cells that an expression may evaluate to, by name."""
        if isinstance(node, ast.Name):
            if node.id in self.locals:
                return self.aliases.get(node.id, set())
            return {node.id} if self.namespace.names.get(node.id, _OTHER).kind == "kernel" else set()
        if isinstance(node, ast.IfExp):
            return self.kernel_refs(node.body) | self.kernel_refs(node.orelse)
        if isinstance(node, ast.BoolOp):  # `kernel_a or kernel_b`
            return set().union(*(self.kernel_refs(v) for v in node.values))
        if isinstance(node, ast.NamedExpr):
            return self.kernel_refs(node.value)
        if isinstance(node, ast.Call) and len(node.args) == 1:  # triton.jit(f) or triton.autotune(...)(kernel)
            argument = node.args[0]
            factory = isinstance(node.func, ast.Call)
            wrapper = self.namespace.triton_attr(node.func.func if factory else node.func)
            if (wrapper == "jit" and isinstance(argument, ast.Name) and argument.id not in self.locals
                    and self.namespace.names.get(argument.id, _OTHER).kind == "function"):
                return {argument.id}
            if wrapper == "jit" or (wrapper in KERNEL_WRAPPERS and factory):
                return self.kernel_refs(argument)
        return set()

    def _read_aliases(self, node: ast.AST) -> None:
        pairs = []  # (local name, value) for every simple binding in the body, parameter defaults included
        for n in ast.walk(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                positional = n.args.posonlyargs + n.args.args
                pairs += zip((a.arg for a in positional[len(positional) - len(n.args.defaults):]), n.args.defaults)
                pairs += [(a.arg, d) for a, d in zip(n.args.kwonlyargs, n.args.kw_defaults) if d is not None]
            elif isinstance(n, ast.Assign):
                for target in n.targets:
                    pairs += _name_value_pairs(target, n.value)
            elif isinstance(n, (ast.AnnAssign, ast.NamedExpr)) and n.value is not None:
                pairs += _name_value_pairs(n.target, n.value)
        changed = True
        while changed:  # aliases of aliases: repeat until nothing new is learnt (the sets only grow)
            changed = False
            for name, value in pairs:
                if name not in self.locals:
                    continue
                if isinstance(value, ast.Subscript):  # `run = kernel[grid]`: calling run launches
                    found, table = self.kernel_refs(value.value), self.launchers
                else:
                    found, table = self.kernel_refs(value), self.aliases
                if not found <= table.get(name, set()):
                    table[name] = table.get(name, set()) | found
                    changed = True

    def _read_calls(self, node: ast.AST) -> _Facts:
        facts = _Facts()
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            callee = call.func
            if isinstance(callee, ast.Subscript):
                found = self.kernel_refs(callee.value)
                facts.kernels |= found
                if not found:
                    if isinstance(callee.value, ast.Name) and callee.value.id in self.parameters:
                        facts.launches_parameter = True
                    else:
                        facts.foreign.add(ast.unparse(callee.value))
            elif isinstance(callee, ast.Name) and callee.id in self.locals:
                facts.kernels |= self.launchers.get(callee.id, set())
            elif isinstance(callee, ast.Name) and self.namespace.names.get(callee.id, _OTHER).kind == "function":
                facts.calls.add(callee.id)
                arguments = call.args + [k.value for k in call.keywords]
                if any(self.kernel_refs(a.value if isinstance(a, ast.Starred) else a) for a in arguments):
                    facts.passes_kernel_to.add(callee.id)
        return facts


def _name_value_pairs(target: ast.expr, value: ast.expr) -> list[tuple[str, ast.expr]]:
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
            and len(target.elts) == len(value.elts):
        return [pair for t, v in zip(target.elts, value.elts) for pair in _name_value_pairs(t, v)]
    return []


def _functions(namespace: _Namespace) -> dict[str, _Facts]:
    """Facts for every top-level name that holds a plain function."""
    return {name: _FunctionReader(held.node, namespace).facts
            for name, held in namespace.names.items() if held.kind == "function"}


def _launching(facts: dict[str, _Facts]) -> set[str]:
    launching = {name for name, f in facts.items() if f.kernels}
    changed = True
    while changed:  # follow calls transitively: a caller of a launching function launches
        changed = False
        for name, f in facts.items():
            if name in launching:
                continue
            if f.calls & launching or any(facts[callee].launches_parameter for callee in f.passes_kernel_to):
                launching.add(name)
                changed = True
    return launching


def kernel_defs(trees: list[ast.Module]) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every top-level name that holds a kernel once the cells (parsed by `cell_trees`) have run, with the def of
    the function it runs: a kernel defined under Triton's jit, or a name assigned from such a wrapping of a
    function of the cells (`k = triton.jit(f)` gives k the def of f, so the def's own name may differ)."""
    return {name: held.node for name, held in _Namespace(trees).names.items() if held.kind == "kernel"}


def launching_functions(sources: list[str]) -> set[str]:
    """Top-level functions of the cells that launch a kernel of the cells, themselves or through what they call."""
    return _launching(_functions(_Namespace(cell_trees(sources))))


def missing_launches(learner_sources: list[str], required: set[str]) -> dict[str, str]:
    """For each required wrapper that is not defined or launches no kernel of the notebook: why, in one sentence."""
    namespace = _Namespace(cell_trees(learner_sources))
    facts = _functions(namespace)
    launching = _launching(facts)
    missing = {}
    for name in sorted(required):
        if name not in facts:
            missing[name] = (f"{name} is not defined as a function in the notebook: the kernel points need your "
                             f"{name} to launch your @triton.jit kernel (kernel[grid](...))")
        elif name not in launching:
            foreign = sorted(_reachable_foreign(name, facts))
            if foreign:
                which = "which is not a @triton.jit kernel" if len(foreign) == 1 else \
                    "which are not @triton.jit kernels"
                missing[name] = (f"{name} launches {', '.join(foreign)}, {which} defined in the notebook: the "
                                 f"kernel points need the wrapper to launch a kernel you wrote here "
                                 f"(kernel[grid](...)), not an imported one")
            else:
                missing[name] = (f"{name} launches no @triton.jit kernel defined in the notebook: the kernel points "
                                 f"need the wrapper to launch your kernel (kernel[grid](...)), not to compute "
                                 f"attention with PyTorch")
    return missing


def _reachable_foreign(name: str, facts: dict[str, _Facts]) -> set[str]:
    """What `name` and the functions it calls launch that is not a kernel of the cells."""
    seen, todo, foreign = set(), [name], set()
    while todo:
        current = todo.pop()
        if current in seen or current not in facts:
            continue
        seen.add(current)
        foreign |= facts[current].foreign
        todo += facts[current].calls
    return foreign
