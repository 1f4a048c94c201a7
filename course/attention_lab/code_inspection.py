"""Reading an answer's own code: what it calls, which operators it uses, whether it loops.

Some exercises exist to make the student *write* a thing: a matrix product as explicit sums,
a numerically stable softmax. Calling the library function that does it passes every
numerical test, so a check has to look at the code itself. Watching calls at run time
(an array subclass that refuses ``@``, a torch function mode) misses an answer that first
converts its input (``np.asarray(x) @ W``) or calls a library written in NumPy
(``scipy.special.softmax``); reading the code does not.

How the code is read:

* **From its source**, with :func:`inspect.getsource` and :mod:`ast` (this works for functions
  defined in notebook cells too: IPython keeps every cell's source). Names are resolved the
  way Python resolves them when the answer runs: imports inside the function, then its
  closure, its module's globals (a notebook's namespace), the builtins. So ``np.dot``,
  ``numpy.dot``, ``from numpy import dot as d; d(...)`` and ``mm = np.matmul`` at top level are
  all recognised as ``numpy.dot`` / ``numpy.matmul``.
* **From its bytecode** when the source is unavailable (code built with ``exec``, a lambda
  whose line holds other code, a source file edited since): the same facts, read from
  :func:`dis.get_instructions`.

Helpers are followed: a function the answer calls that was defined in the same namespace (a
notebook helper) is read too, a few levels deep, so moving the shortcut into a helper does
not hide it.

Example::

    uses = find_uses(answer, functions=("numpy.dot", "numpy.matmul"), methods=("dot",), operators=("@",))
    if uses:
        raise CheckFailure(f"... but it uses {uses[0].describe()} ...")
"""

from __future__ import annotations

import ast
import builtins
import dis
import functools
import importlib
import inspect
import sys
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from attention_lab.bridge import checker_side
from attention_lab.bridge.probes import Probe

__all__ = ["Use", "find_uses", "has_loop", "answer_functions", "source_available", "SubmittedCode",
           "forbidden_in_source"]

# Short names students use for modules; used only when a name cannot be resolved at all.
_COMMON_ALIASES = {"np": "numpy", "sp": "scipy", "F": "torch.nn.functional", "nn": "torch.nn"}
# How deep helpers are followed (the answer itself is depth 0).
_HELPER_DEPTH = 3


@dataclass(frozen=True)
class Use:
    """One place where the answer uses something a check looks for."""

    written: str  # as the code writes it: "np.dot", "@", "x_row.dot", "softmax"
    target: str  # what it is: "numpy.dot", "@", ".dot"
    function: str  # the function of the answer (or its helper) it is in
    line: int | None  # line number (in the notebook cell or file that defines the function), if known

    def describe(self) -> str:
        """``np.dot (in row_times_matrix, line 4)``, or ``sm (scipy.special.softmax, in f, line 2)``
        when the code calls it by another name -- how a message names it."""
        where = f"in {self.function}, line {self.line}" if self.line else f"in {self.function}"
        alias = self.written not in (self.target, self.target.lstrip(".")) and not self.target.startswith(".") \
            and not _textual_match(self.written, self.target)
        return f"{self.written} ({self.target}, {where})" if alias else f"{self.written} ({where})"


@dataclass
class _Facts:
    """What one function's code does, read from its source or its bytecode."""

    function: str
    references: list[tuple[str, Any, int | None]] = field(default_factory=list)  # (written, object or _UNRESOLVED, line)
    methods: list[tuple[str, str, int | None]] = field(default_factory=list)  # (written, attribute, line)
    operators: list[tuple[str, int | None]] = field(default_factory=list)  # ("@", line)
    loops: int = 0


_UNRESOLVED = object()


# --------------------------------------------------------------------------------------
# Which functions make up an answer
# --------------------------------------------------------------------------------------


def _unwrap(answer: Any) -> Any:
    while True:
        if isinstance(answer, functools.partial):
            answer = answer.func
        elif isinstance(answer, (types.MethodType, staticmethod, classmethod)):
            answer = answer.__func__
        elif hasattr(answer, "__wrapped__") and isinstance(answer, types.FunctionType):
            answer = answer.__wrapped__
        else:
            return answer


def _own_functions(answer: Any) -> list[types.FunctionType]:
    """The Python functions an answer object consists of: itself, or a class's own methods."""
    answer = _unwrap(answer)
    if isinstance(answer, types.FunctionType):
        return [answer]
    cls = answer if isinstance(answer, type) else type(answer)
    functions = []
    for klass in cls.__mro__:
        if (getattr(klass, "__module__", None) or "builtins").split(".")[0] in _LIBRARY_ROOTS:
            continue  # object, nn.Module, ndarray ...: not the student's code
        for member in vars(klass).values():
            member = _unwrap(member)
            if isinstance(member, property):
                member = member.fget
            if isinstance(member, types.FunctionType):
                functions.append(member)
    return functions


_LIBRARY_ROOTS = {"builtins", "numpy", "torch", "scipy", "functools", "einops", "typing", "abc"}


def answer_functions(answer: Any, *, follow_helpers: bool = True) -> list[types.FunctionType]:
    """The answer's functions, then (with ``follow_helpers``) the helpers they call that live in
    the same namespace (notebook helpers), a few levels deep, each once."""
    return [function for function, _facts in _walk(answer, follow_helpers)]


def _facts_of(function: types.FunctionType) -> _Facts:
    """What the function does, from its source if possible, else from its bytecode. Reading code
    never fails a check: anything unexpected reads as "nothing found" (checks that need more, such
    as a loop, only ask after the answer ran)."""
    try:
        facts = _facts_from_source(function)
    except Exception:
        facts = None
    if facts is None:
        try:
            facts = _facts_from_bytecode(function)
        except Exception:
            facts = _Facts(getattr(function, "__name__", "?"))
    return facts


def _walk(answer: Any, follow_helpers: bool) -> Iterator[tuple[types.FunctionType, _Facts]]:
    todo = [(function, 0) for function in _own_functions(answer)]
    namespaces = {id(function.__globals__) for function, _ in todo}
    seen: set[int] = set()
    while todo:
        function, depth = todo.pop(0)
        if id(function) in seen:
            continue
        seen.add(id(function))
        facts = _facts_of(function)
        yield function, facts
        if not follow_helpers or depth >= _HELPER_DEPTH:
            continue
        for _written, obj, _line in facts.references:
            for helper in _own_functions(obj) if _is_helper(obj, namespaces) else ():
                todo.append((helper, depth + 1))


def _is_helper(obj: Any, namespaces: set[int]) -> bool:
    """A function or class the student defined next to the answer (same global namespace)."""
    obj = _unwrap(obj)
    if isinstance(obj, types.FunctionType):
        return id(obj.__globals__) in namespaces
    if isinstance(obj, type):
        return any(id(f.__globals__) in namespaces for f in _own_functions(obj))
    return False


# --------------------------------------------------------------------------------------
# Resolving names the way Python does when the answer runs
# --------------------------------------------------------------------------------------


def _import(path: str) -> Any:
    """The object a dotted path names (``numpy.linalg.norm``), or _UNRESOLVED."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        for part in parts[cut:]:
            try:
                obj = getattr(obj, part)
            except AttributeError:
                return _UNRESOLVED
        return obj
    return _UNRESOLVED


class _Scope:
    """Where a function's names come from: local imports, locals, closure, globals, builtins."""

    def __init__(self, function: types.FunctionType, local_imports: dict[str, str]):
        self.function = function
        self.local_imports = local_imports
        code = function.__code__
        self.locals = set(code.co_varnames) | set(code.co_cellvars)
        self.closure = {}
        if function.__closure__:
            for name, cell in zip(code.co_freevars, function.__closure__):
                try:
                    self.closure[name] = cell.cell_contents
                except ValueError:  # an empty cell
                    pass

    def resolve(self, chain: list[str]) -> Any:
        root, attributes = chain[0], chain[1:]
        if root in self.local_imports:
            obj = _import(self.local_imports[root])
        elif root in self.locals:
            return _UNRESOLVED
        elif root in self.closure:
            obj = self.closure[root]
        elif root in self.function.__globals__:
            obj = self.function.__globals__[root]
        elif hasattr(builtins, root):
            obj = getattr(builtins, root)
        else:
            return _UNRESOLVED
        for attribute in attributes:
            try:
                obj = getattr(obj, attribute)
            except Exception:
                return _UNRESOLVED
        return obj

    def is_local(self, root: str) -> bool:
        return root not in self.local_imports and (root in self.locals or root not in self.closure
                                                   and root not in self.function.__globals__
                                                   and not hasattr(builtins, root))


def _record(facts: _Facts, scope: _Scope, chain: list[str], line: int | None) -> None:
    written = ".".join(chain)
    obj = scope.resolve(chain)
    if obj is not _UNRESOLVED:
        facts.references.append((written, obj, line))
        return
    if len(chain) > 1 and scope.is_local(chain[0]):  # x_row.dot: a method of a local value
        facts.methods.append((written, chain[-1], line))
    if len(chain) > 1:  # a module under a name we cannot see: keep the written text
        facts.references.append((written, _UNRESOLVED, line))


# --------------------------------------------------------------------------------------
# Reading the source
# --------------------------------------------------------------------------------------


def _source_tree(function: types.FunctionType) -> tuple[ast.AST, int] | None:
    """The function's def node and the line offset to add to its line numbers, or None."""
    if function.__name__ == "<lambda>":
        return None  # a lambda's line may hold other code: the bytecode is unambiguous
    try:
        source = textwrap.dedent(inspect.getsource(function))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function.__name__:
            return node, function.__code__.co_firstlineno - 1
    return None


def _chain(node: ast.AST) -> list[str] | None:
    """``np.linalg.norm`` -> ["np", "linalg", "norm"]; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _facts_from_source(function: types.FunctionType) -> _Facts | None:
    found = _source_tree(function)
    if found is None:
        return None
    tree, offset = found
    local_imports: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    local_imports[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    local_imports[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                local_imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    scope = _Scope(function, local_imports)
    facts = _Facts(function.__name__)
    inner_attributes: set[int] = set()  # Attribute nodes that are part of a longer chain
    for node in ast.walk(tree):
        line = getattr(node, "lineno", None)
        line = None if line is None else line + offset
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner_attributes.add(id(node.value))
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.MatMult):
            facts.operators.append(("@", line))
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp,
                             ast.GeneratorExp)):
            facts.loops += 1
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner_attributes and isinstance(node.ctx, ast.Load):
            chain = _chain(node)
            if chain is not None:
                _record(facts, scope, chain, node.lineno + offset)
            else:  # x[0].dot(...), f().dot: a method of a computed value
                facts.methods.append((f"….{node.attr}", node.attr, node.lineno + offset))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            obj = scope.resolve([node.id])
            if obj is not _UNRESOLVED:
                facts.references.append((node.id, obj, node.lineno + offset))
    facts.loops += sum(1 for _w, obj, _l in facts.references if obj is map or obj is functools.reduce)
    return facts


# --------------------------------------------------------------------------------------
# Reading the bytecode (when there is no source)
# --------------------------------------------------------------------------------------

_ROOT_LOADS = {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_FAST", "LOAD_CLASSDEREF", "LOAD_FAST_CHECK",
               "LOAD_FAST_AND_CLEAR", "LOAD_FAST_BORROW"}
_ATTRIBUTE_LOADS = {"LOAD_ATTR", "LOAD_METHOD"}
_STORES = {"STORE_FAST", "STORE_NAME", "STORE_DEREF", "STORE_GLOBAL"}


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _instructions_with_lines(code: types.CodeType) -> Iterator[tuple[dis.Instruction, int | None]]:
    line = None
    for instruction in dis.get_instructions(code):
        positions = getattr(instruction, "positions", None)
        if positions is not None and positions.lineno is not None:
            line = positions.lineno
        elif instruction.starts_line not in (None, False, True):
            line = instruction.starts_line
        yield instruction, line


def _facts_from_bytecode(function: types.FunctionType) -> _Facts:
    facts = _Facts(function.__name__)
    codes = list(_code_objects(function.__code__))
    # Imports inside the function: `import numpy as np`, `from scipy.special import softmax`.
    local_imports: dict[str, str] = {}
    for code in codes:
        constant, module, from_list, pending = None, None, None, None
        for instruction in dis.get_instructions(code):
            opname = instruction.opname
            if opname == "LOAD_CONST":
                constant = instruction.argval
                continue
            if opname == "IMPORT_NAME":
                module, from_list, pending = instruction.argval, constant, instruction.argval
            elif opname == "IMPORT_FROM" and module:
                # `from a import b` reads a.b; `import a.b as c` walks down to a.b the same way.
                pending = f"{module}.{instruction.argval}" if from_list else module
            elif opname in _STORES and pending:
                name, top = instruction.argval, module.split(".")[0]
                local_imports[name] = top if (pending == module and not from_list and name == top) else pending
                pending = None
            elif opname not in ("POP_TOP", "SWAP", "COPY", "NOP", "CACHE", "ROT_TWO"):
                module, pending = None, None
            constant = None
    scope = _Scope(function, local_imports)
    for code in codes:
        chain: list[str] = []
        chain_line = None
        start_offsets = []
        for instruction, line in _instructions_with_lines(code):
            opname = instruction.opname
            if opname in _ATTRIBUTE_LOADS and chain:
                chain.append(str(instruction.argval))
                continue
            if chain:
                _record(facts, scope, chain, chain_line)
                chain = []
            if opname in _ROOT_LOADS and isinstance(instruction.argval, str):
                root = instruction.argval
                if code is not function.__code__ and opname in ("LOAD_FAST", "LOAD_DEREF") and root not in scope.locals:
                    scope.locals.add(root)  # a comprehension's own variable
                chain, chain_line = [root], line
            if opname in ("BINARY_MATRIX_MULTIPLY", "INPLACE_MATRIX_MULTIPLY") or (
                    opname == "BINARY_OP" and instruction.argrepr in ("@", "@=")):
                facts.operators.append(("@", line))
            if opname == "FOR_ITER":
                facts.loops += 1
            elif "JUMP" in opname and isinstance(instruction.argval, int) and instruction.argval < instruction.offset:
                start_offsets.append(instruction.argval)  # a jump back: the end of a loop's body
        if chain:
            _record(facts, scope, chain, chain_line)
        if start_offsets and not any(i.opname == "FOR_ITER" for i in dis.get_instructions(code)):
            facts.loops += 1  # a while loop
    facts.loops += sum(1 for _w, obj, _l in facts.references if obj is map or obj is functools.reduce)
    return facts


# --------------------------------------------------------------------------------------
# What checks ask
# --------------------------------------------------------------------------------------


def _loaded(path: str) -> Any:
    """The object a dotted path names if its module is already imported, else _UNRESOLVED.

    Never imports: code that uses a library has imported it (or will, by a local import that
    reading its code resolves), so a library nobody imported cannot be in use -- and a check
    should not pay for importing scipy to learn that.
    """
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        obj = module
        for part in parts[cut:]:
            obj = getattr(obj, part, _UNRESOLVED)
            if obj is _UNRESOLVED:
                return _UNRESOLVED
        return obj
    return _UNRESOLVED


def _targets(functions: Iterable[str]) -> list[tuple[str, Any]]:
    return [(name, _loaded(name)) for name in functions]


def _textual_match(written: str, target: str) -> bool:
    root, _, rest = written.partition(".")
    expanded = f"{_COMMON_ALIASES.get(root, root)}.{rest}" if rest else written
    return expanded == target


def _same(obj: Any, target: Any) -> bool:
    if target is _UNRESOLVED:
        return False
    return obj is target


class CodeFacts(Probe):
    """What :func:`find_uses` and :func:`has_loop` read from an answer's code, read where the
    answer lives: in grading, the student's kernel (the answer's functions, their namespace and
    their bytecode are there). The findings are data: the uses found and whether it loops."""

    def __init__(self, functions: Iterable[str] = (), methods: Iterable[str] = (), operators: Iterable[str] = (),
                 follow_helpers: bool = True):
        super().__init__(functions=list(functions), methods=list(methods), operators=list(operators),
                         follow_helpers=follow_helpers)
        self.uses: list[Use] = []
        self.loops = False

    def measure(self, answer: Any) -> dict:
        parameters = self.parameters
        uses = find_uses(answer, functions=parameters["functions"], methods=parameters["methods"],
                         operators=parameters["operators"], follow_helpers=parameters["follow_helpers"])
        return {"uses": [[u.written, u.target, u.function, u.line] for u in uses],
                "loops": has_loop(answer, follow_helpers=parameters["follow_helpers"])}

    def accept(self, findings: Any) -> None:
        uses = findings.get("uses") if isinstance(findings, dict) else None
        targets = {*self.parameters["functions"], *(f".{m}" for m in self.parameters["methods"]),
                   *self.parameters["operators"]}
        self.uses = [Use(str(u[0])[:200], u[1], str(u[2])[:200], u[3] if type(u[3]) is int else None)
                     for u in (uses if isinstance(uses, list) else [])
                     if isinstance(u, list) and len(u) == 4 and u[1] in targets]
        self.loops = bool(findings.get("loops")) if isinstance(findings, dict) else False


def find_uses(answer: Any, *, functions: Iterable[str] = (), methods: Iterable[str] = (),
              operators: Iterable[str] = (), follow_helpers: bool = True) -> list[Use]:
    """Every place where the answer (and its helpers) uses one of the things named.

    ``functions``: dotted paths of callables (``"numpy.dot"``, ``"scipy.special.softmax"``),
    matched by identity after resolving the code's names, so any alias counts.
    ``methods``: attribute names called on values (``"dot"`` finds ``x_row.dot(W)``).
    ``operators``: ``"@"`` (the matrix-multiplication operator, also ``@=``).

    The answer itself may be one of ``functions`` (``np_softmax = scipy.special.softmax``).
    Uses are listed in the order the code is read, the answer's own code first. In grading
    the answer's code is read in the student's kernel (:class:`CodeFacts`).
    """
    if checker_side.is_remote(answer):
        facts = checker_side.measure(answer, CodeFacts(functions, methods, operators, follow_helpers), "the answer's code")
        source = checker_side.submitted_code(answer)
        if source is None:  # the cells do not define it (code built at run time): the kernel's word
            return facts.uses
        code, name = source
        read = code.uses(name, functions, methods, operators, depth=_HELPER_DEPTH if follow_helpers else 0)
        if read and not facts.uses:
            checker_side.contradiction(answer, f"{name}: the kernel read no {read[0].target} in its code, but the "
                                               f"submitted code uses {read[0].describe()}")
        return _unique([*read, *facts.uses])
    walked = list(_walk(answer, follow_helpers))  # first: reading may import what the code imports
    targets = _targets(functions)
    methods, operators = set(methods), set(operators)
    uses: list[Use] = []
    bare = _unwrap(answer)
    name = getattr(bare, "__name__", type(bare).__name__)
    for path, target in targets:
        if _same(bare, target):
            uses.append(Use(name, path, name, None))
    for function, facts in walked:
        where = function.__name__
        for written, obj, line in facts.references:
            for path, target in targets:
                if (_same(obj, target) if obj is not _UNRESOLVED else _textual_match(written, path)):
                    uses.append(Use(written, path, where, line))
        for written, attribute, line in facts.methods:
            if attribute in methods:
                uses.append(Use(written, f".{attribute}", where, line))
        for operator, line in facts.operators:
            if operator in operators:
                uses.append(Use(operator, operator, where, line))
    return _unique(uses)


def _unique(uses: Iterable[Use]) -> list[Use]:
    """Each place once (a use found twice, by two readings, is one)."""
    unique, seen = [], set()
    for use in uses:
        if (use.target, use.function, use.line) not in seen:
            seen.add((use.target, use.function, use.line))
            unique.append(use)
    return unique


def has_loop(answer: Any, *, follow_helpers: bool = True) -> bool:
    """Whether the answer (or a helper it calls) loops: ``for``, ``while``, a comprehension or
    generator, ``map`` or ``functools.reduce``. An answer with no Python code at all (a
    builtin) does not. (In grading, the kernel's reading counts too: a helper reached through an
    object, which the cells' text does not show, may hold the loop; where the two disagree the
    report says so.)"""
    if checker_side.is_remote(answer):
        loops = checker_side.measure(answer, CodeFacts(follow_helpers=follow_helpers), "the answer's code").loops
        source = checker_side.submitted_code(answer)
        if source is not None and loops and not source[0].loops(source[1], depth=_HELPER_DEPTH if follow_helpers else 0):
            checker_side.contradiction(answer, f"{source[1]}: the kernel read a loop in its code, but the submitted "
                                               "code has none")
        return loops
    return any(facts.loops for _function, facts in _walk(answer, follow_helpers))


def forbidden_in_source(answer: Any, forbidden: Iterable[str] = (), numpy_only: bool = False) -> list[Use] | None:
    """In grading, where the submitted code of ``answer`` (a proxy) and its helpers names a built-in it may
    not call (see :meth:`SubmittedCode.forbidden`); None when the checker has no such code to read."""
    source = checker_side.submitted_code(answer)
    return None if source is None else source[0].forbidden(source[1], forbidden, numpy_only)


def source_available(function: Callable) -> bool:
    """Whether :func:`find_uses` reads this function from its source (else from bytecode)."""
    function = _unwrap(function)
    return isinstance(function, types.FunctionType) and _source_tree(function) is not None


# --------------------------------------------------------------------------------------
# Reading the submitted notebook's cells (grading: what the checker reads itself)
# --------------------------------------------------------------------------------------

# The module forms of the built-ins a "from scratch" exercise forbids: nn.MultiheadAttention runs
# multi_head_attention_forward, nn.RMSNorm runs rms_norm.
MODULE_FORMS = {"multi_head_attention_forward": ("MultiheadAttention",), "rms_norm": ("RMSNorm",)}
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@functools.lru_cache(maxsize=1024)  # the checker reads the same cells again for each test cell of a notebook
def _cell_tree(source: str) -> ast.Module | None:
    """A cell's code as Python's parser reads it once IPython has rewritten its magics; None if it is not Python."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        source = TransformerManager().transform_cell(source)
    except Exception:  # no IPython, or a cell it cannot rewrite: read as it is
        pass
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return None


def _top_level(statements: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A cell's statements, with those inside top-level if/try/with/for blocks (never inside a def or class)."""
    for statement in statements:
        yield statement
        if isinstance(statement, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            for block in ("body", "orelse", "finalbody"):
                yield from _top_level(getattr(statement, block, []) or [])
            for handler in getattr(statement, "handlers", []):
                yield from _top_level(handler.body)


def _imported(node: ast.Import | ast.ImportFrom) -> dict[str, str]:
    """{name bound: dotted path} of an import statement."""
    bound = {}
    if isinstance(node, ast.Import):
        for alias in node.names:
            bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
    elif node.module and not node.level:
        for alias in node.names:
            bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


class SubmittedCode:
    """The code of a submitted notebook's cells, read as data (never run): what the checker knows of an
    answer's code whatever the student's kernel says of it.

    A name's definition is its last top-level binding in the cells (``def``, ``class``, ``name = lambda``,
    ``name = other_name``, ``name = functools.partial(f, ...)``); names are resolved through the cells'
    imports and aliases (``import numpy as np``, ``mm = np.matmul``) and each function's own imports.
    An answer that the cells do not define (built with ``exec``, imported from a file it wrote) reads
    as unknown (None): its checks then have only the kernel's word.
    """

    def __init__(self, cells: Sequence[str]):
        self.cells = list(cells)
        self._definitions: dict[str, ast.AST] | None = None

    def _read(self) -> None:
        """Read the cells, once, when a check first asks (most tests never do)."""
        self._definitions = {}  # name -> its def, class or lambda (or the one of the name it aliases)
        self._aliases: dict[str, str] = {}  # name -> the dotted path it names (imports, `mm = np.matmul`)
        for source in self.cells:
            tree = _cell_tree(source)
            for statement in _top_level(tree.body if tree is not None else []):
                self._bind(statement)

    @property
    def definitions(self) -> dict[str, ast.AST]:
        if self._definitions is None:
            self._read()
        return self._definitions

    @property
    def aliases(self) -> dict[str, str]:
        if self._definitions is None:
            self._read()
        return self._aliases

    def _bind(self, statement: ast.stmt) -> None:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.definitions[statement.name] = statement
            self.aliases.pop(statement.name, None)
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            for name, path in _imported(statement).items():
                self.aliases[name] = path
                self.definitions.pop(name, None)
        elif isinstance(statement, ast.Assign) and len(statement.targets) == 1 \
                and isinstance(statement.targets[0], ast.Name):
            name, value = statement.targets[0].id, statement.value
            if isinstance(value, ast.Call) and _chain(value.func) and _chain(value.func)[-1] == "partial" and value.args:
                value = value.args[0]  # functools.partial(f, ...) is f
            chain = _chain(value)
            if isinstance(value, ast.Lambda):
                self.definitions[name] = value
                self.aliases.pop(name, None)
            elif chain is not None and chain[0] in self.definitions and len(chain) == 1:
                self.definitions[name] = self.definitions[chain[0]]
                self.aliases.pop(name, None)
            elif chain is not None and chain[0] in self.aliases:
                self.aliases[name] = ".".join([self.aliases[chain[0]], *chain[1:]])
                self.definitions.pop(name, None)
            else:
                self.definitions.pop(name, None)
                self.aliases.pop(name, None)

    def knows(self, name: str) -> bool:
        """Whether the cells define ``name`` (a def, class, lambda, or a name for a library function)."""
        return name in self.definitions or name in self.aliases

    def functions(self, name: str, depth: int = _HELPER_DEPTH) -> list[tuple[str, ast.AST]]:
        """(name, node) of the answer's own code (a function, a lambda, a class's methods) and of the
        helpers it names that the cells define, a few levels deep, each once."""
        found, todo, seen = [], [(name, 0)], set()
        while todo:
            current, level = todo.pop(0)
            node = self.definitions.get(current)
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            found.append((current, node))
            if level >= depth:
                continue
            for child in ast.walk(node):
                if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Load) and child.id in self.definitions:
                    todo.append((child.id, level + 1))
        return found

    def _resolve(self, chain: list[str], local_imports: dict[str, str], local_names: set[str]) -> str | None:
        """The dotted path a chain of names names, when it starts at a module or library name."""
        root = chain[0]
        if root in local_imports:
            base = local_imports[root]
        elif root in local_names:
            return None
        elif root in self.aliases:
            base = self.aliases[root]
        elif root in _COMMON_ALIASES and root not in self.definitions:
            base = _COMMON_ALIASES[root]
        else:
            return None
        return ".".join([base, *chain[1:]])

    def _scan(self, name: str, depth: int = _HELPER_DEPTH) -> Iterator[tuple[str, str, ast.AST, str | None]]:
        """(written, function, node, dotted path or None) of every name, attribute chain and operator the
        answer's code (and its helpers') uses; an operator's path is its symbol."""
        for function, node in self.functions(name, depth):
            local_imports: dict[str, str] = {}
            local_names: set[str] = set()
            for child in ast.walk(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    local_imports.update(_imported(child))
                elif isinstance(child, ast.Name) and isinstance(child.ctx, (ast.Store, ast.Del)):
                    local_names.add(child.id)
                elif isinstance(child, ast.arg):
                    local_names.add(child.arg)
            inner = {id(child.value) for child in ast.walk(node)  # the parts of a longer chain: read with it
                     if isinstance(child, ast.Attribute) and isinstance(child.value, (ast.Attribute, ast.Name))}
            for child in ast.walk(node):
                if isinstance(child, (ast.BinOp, ast.AugAssign)) and isinstance(child.op, ast.MatMult):
                    yield "@", function, child, "@"
                elif isinstance(child, ast.Attribute) and id(child) not in inner and isinstance(child.ctx, ast.Load):
                    chain = _chain(child) or ["…", child.attr]
                    yield ".".join(chain), function, child, self._resolve(chain, local_imports, local_names) \
                        if chain[0] != "…" else None
                elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Load) and id(child) not in inner:
                    yield child.id, function, child, self._resolve([child.id], local_imports, local_names)
                elif isinstance(child, ast.Call) and _chain(child.func) in (["getattr"], ["builtins", "getattr"]) \
                        and len(child.args) >= 2 and isinstance(child.args[1], ast.Constant) \
                        and isinstance(child.args[1].value, str):
                    target = _chain(child.args[0])
                    path = self._resolve(target, local_imports, local_names) if target else None
                    yield f"getattr(…, {child.args[1].value!r})", function, child, \
                        f"{path or '…'}.{child.args[1].value}"

    def uses(self, name: str, functions: Iterable[str] = (), methods: Iterable[str] = (),
             operators: Iterable[str] = (), depth: int = _HELPER_DEPTH) -> list[Use]:
        """What :func:`find_uses` finds, read from the cells: the answer itself when it names one of
        ``functions``, then each use in its code and its helpers'."""
        functions, methods, operators = set(functions), set(methods), set(operators)
        uses = [Use(name, self.aliases[name], name, None)] if self.aliases.get(name) in functions else []
        for written, function, node, path in self._scan(name, depth):
            line = getattr(node, "lineno", None)
            if path in operators and written == path:
                uses.append(Use(written, path, function, line))
            elif path in functions:
                uses.append(Use(written, path, function, line))
            elif path is None and isinstance(node, ast.Attribute) and node.attr in methods \
                    and not (isinstance(node.value, ast.Name) and node.value.id in self.aliases):
                uses.append(Use(written, f".{node.attr}", function, line))
        return _unique(uses)

    def loops(self, name: str, depth: int = _HELPER_DEPTH) -> bool:
        """What :func:`has_loop` says, read from the cells."""
        for _function, node in self.functions(name, depth):
            if any(isinstance(child, (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp,
                                      ast.GeneratorExp)) for child in ast.walk(node)):
                return True
        return any(path in ("map", "builtins.map", "functools.reduce") or written in ("map", "reduce")
                   for written, _function, _node, path in self._scan(name, depth) if isinstance(_node, ast.Name))

    def forbidden(self, name: str, forbidden: Iterable[str] = (), numpy_only: bool = False) -> list[Use]:
        """Where the answer's code (and its helpers') names a built-in it may not call: one of ``forbidden``
        (``F.scaled_dot_product_attention``, the module forms of :data:`MODULE_FORMS`, ``getattr(F,
        "scaled_dot_product_attention")``, an imported alias of one), or, ``numpy_only``, anything of torch."""
        names = {short for short in forbidden} | {form for short in forbidden for form in MODULE_FORMS.get(short, ())}
        found = []
        for written, function, node, path in self._scan(name):
            last = (path or written).rsplit(".", 1)[-1]
            library = path is not None and path.split(".")[0] in ("torch", "…")
            if numpy_only and path is not None and path.split(".")[0] == "torch":
                found.append(Use(written, path, function, getattr(node, "lineno", None)))
            elif last in names and (library or isinstance(node, (ast.Attribute, ast.Call))) \
                    and not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                             and node.value.id == "self"):
                found.append(Use(written, path or written, function, getattr(node, "lineno", None)))
        return found
