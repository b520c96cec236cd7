"""Cell -> Job: what makes a notebook cell runnable on every rank without refactoring.

``capture_cell`` reads the cell's AST and its scopes, finds the names it takes from the
notebook, replays the notebook's import statements (from history) and sends every other value
it uses by value with cloudpickle.  Names the cell assigns before using are not sent, and
nothing the cell does not use is sent.  It launches nothing.

IPython syntax in the cell (``!cmd``, ``%time``, ``%%time``, ``%pip``...) is translated by
``translate_cell`` with IPython's own input transformers, line for line, into calls that the
ranks' ``get_ipython()`` (``rank_shell``) runs; a magic the ranks cannot run is refused here.
"""

from __future__ import annotations

import ast
import io
import symtable
import tokenize
import types
import warnings
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

from .core import syntax
from .core.job import CellCode, type_name
from .core.values import pickle_for_ranks, pickled_apart
from .core.names import CELL_PROVIDED

#: notebook names that never travel (IPython's own machinery)
NOT_SENT = {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_ih", "_oh", "_dh"}
DEFAULT_WARN_BYTES = 100 * 1024 * 1024


class CaptureError(ValueError):
    """The cell cannot be turned into a job (syntax error, unpicklable value...)."""


def _position(node: ast.AST) -> Tuple[int, int]:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))


class _TopLevelOrder(ast.NodeVisitor):
    """First load and first store of each name in the cell's own (module) scope.

    Bodies of functions, lambdas and classes run later (or in their own scope), so a name they
    read is "used later": it is local to the cell when the cell binds it anywhere at top level.
    """

    def __init__(self) -> None:
        self.first_load: Dict[str, Tuple[int, int]] = {}
        self.first_store: Dict[str, Tuple[int, int]] = {}

    def _load(self, name: str, node: ast.AST) -> None:
        self.first_load.setdefault(name, _position(node))

    def _store(self, name: str, node: ast.AST) -> None:
        self.first_store.setdefault(name, _position(node))

    def visit_Name(self, node: ast.Name) -> None:
        (self._load if isinstance(node.ctx, ast.Load) else self._store)(node.id, node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if isinstance(node.target, ast.Name):
            self._load(node.target.id, node.target)
            self._store(node.target.id, node.target)
        else:
            self.visit(node.target)

    def _deferred(self, node, name: Optional[str]) -> None:
        for deco in getattr(node, "decorator_list", []):
            self.visit(deco)
        args = getattr(node, "args", None)
        if isinstance(args, ast.arguments):
            for default in args.defaults + [d for d in args.kw_defaults if d is not None]:
                self.visit(default)
        for base in getattr(node, "bases", []):
            self.visit(base)
        if name:
            self._store(name, node)

    def visit_FunctionDef(self, node) -> None:
        self._deferred(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node) -> None:
        self._deferred(node, node.name)

    def visit_Lambda(self, node) -> None:
        self._deferred(node, None)

    def visit_ListComp(self, node) -> None:
        """A comprehension is a scope: its targets are its own; its first iterable is ours."""
        self.visit(node.generators[0].iter)
        targets = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        parts = [getattr(node, "elt", None), getattr(node, "key", None), getattr(node, "value", None)]
        parts += [g.iter for g in node.generators[1:]] + [c for g in node.generators for c in g.ifs]
        for part in parts:
            for n in ast.walk(part) if part is not None else ():
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in targets:
                    self._load(n.id, n)

    visit_SetComp = visit_GeneratorExp = visit_DictComp = visit_ListComp

    def visit_Import(self, node) -> None:
        for alias in node.names:
            self._store((alias.asname or alias.name).split(".")[0], node)

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node) -> None:
        if node.name:
            self._store(node.name, node)
        self.generic_visit(node)


def _needed_names(tree_source: str, filename: str) -> Set[str]:
    """Every global name the cell or anything defined in it reads."""
    table = symtable.symtable(tree_source, filename, "exec")
    names = {s.get_name() for s in table.get_symbols() if s.is_referenced()}

    def walk(t) -> None:
        for child in t.get_children():
            names.update(s.get_name() for s in child.get_symbols() if s.is_global() and s.is_referenced())
            walk(child)

    walk(table)
    return names


def free_names(source: str, filename: str = "<cell>") -> List[str]:
    """Names the cell reads from outside itself, in a stable order.

    A name the cell binds at top level before it first reads it (or reads only inside
    functions/classes it defines) is the cell's own and is not listed.
    """
    tree = ast.parse(source, filename)
    order = _TopLevelOrder()
    for stmt in tree.body:
        order.visit(stmt)
    needed = _needed_names(source, filename) | set(order.first_load)  # symtable misses `x += 1`
    out = []
    for name in sorted(needed):
        store = order.first_store.get(name)
        load = order.first_load.get(name)
        if store is not None and (load is None or store < load):
            continue
        out.append(name)
    return out


def _import_names(node: ast.AST) -> List[str]:
    """Names an import statement binds (``import a.b`` binds ``a``)."""
    if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
        return []
    return [
        (a.asname or a.name).split(".")[0] if isinstance(node, ast.Import) else (a.asname or a.name) for a in node.names
    ]


def notebook_imports(history: Iterable[str], namespace: dict) -> List[Tuple[str, str]]:
    """Top-level import statements from earlier cells that ran successfully, in order, once each.

    An import whose bound names are not in the namespace (it failed, or was deleted) is left out.
    """
    seen: Set[str] = set()
    out: List[Tuple[str, str]] = []
    for index, source in enumerate(history):
        if not source or ("import" not in source):
            continue
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in tree.body:
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom) and (node.level or node.module == "__future__"):
                continue
            names = _import_names(node)
            if any(n not in namespace for n in names):
                continue
            statement = ast.unparse(node)
            if statement not in seen:
                seen.add(statement)
                out.append((statement, f"In[{index}]"))
    return out


def _module_import(name: str, module: types.ModuleType) -> Optional[str]:
    modname = getattr(module, "__name__", None)
    if not modname or modname == "__main__":
        return None
    return f"import {modname}" if modname == name else f"import {modname} as {name}"


def _bound_by(statements: Sequence[Tuple[str, str]]) -> Set[str]:
    bound: Set[str] = set()
    for statement, _ in statements:
        for node in ast.parse(statement).body:
            bound.update(_import_names(node))
    return bound


def _ends_with_semicolon(source: str) -> bool:
    last = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type not in (
                tokenize.NEWLINE,
                tokenize.NL,
                tokenize.COMMENT,
                tokenize.ENDMARKER,
                tokenize.DEDENT,
                tokenize.INDENT,
            ):
                last = tok
    except (tokenize.TokenError, SyntaxError):
        return False
    return last is not None and last.type == tokenize.OP and last.string == ";"


def _calls_init_process_group(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name == "init_process_group":
                return True
    return False


# -- IPython syntax ----------------------------------------------------------------------------
#: the ``get_ipython()`` methods that IPython's translation calls
SHELL_METHODS = ("system", "getoutput", "run_line_magic", "run_cell_magic")


@dataclass
class Translation:
    """A cell as the ranks run it.

    ``python``: the cell as Python, line for line (what the user typed on line n runs on line n);
    ``analysis``: the same code with each magic's call replaced by the code the magic runs
    (``%time x = f()`` by ``x = f()``) or by the expressions its ``{...}``/``$name`` expansions
    read, for name analysis.
    """

    python: str
    analysis: ast.Module


def translate_cell(source: str, line_offset: int = 0) -> Translation:
    """``source`` with its IPython syntax translated by IPython's own input transformers
    (imported only for a cell that is not Python as it is).

    ``CaptureError`` for a syntax error or a magic the ranks cannot run, naming the notebook's
    line (``line_offset`` lines precede the source).
    """
    translator = _Translator(source, line_offset)
    python, statements = translator.code(source, line_offset + 1)
    return Translation(python=python, analysis=ast.Module(body=statements, type_ignores=[]))


def _from_ipython(text: str) -> str:
    """IPython's translation of ``text`` to Python, with the lines it drops or joins put back as
    blank lines, so that line n of the result runs what was typed on line n."""
    from IPython.core.inputtransformer2 import TransformerManager

    typed = text.splitlines()
    # IPython drops leading blank lines, and joins a line continued with a backslash into one
    # call (``!ls \\`` + `` -l``); a plain Python line keeps its backslash
    lead = next((i for i, line in enumerate(typed) if line and not line.isspace()), len(typed))
    out = [""] * lead
    at = lead
    for line in TransformerManager().transform_cell("\n".join(typed[lead:])).splitlines():
        out.append(line)
        joined = 0
        while not line.endswith("\\") and at + joined + 1 < len(typed) and typed[at + joined].endswith("\\"):
            joined += 1
        out.extend([""] * joined)
        at += joined + 1
    out.extend([""] * (len(typed) - len(out)))  # a cell magic's body, now inside its call
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def _shell_call(node: ast.Call) -> Optional[Tuple[str, Optional[List[str]]]]:
    """``(method, arguments)`` of a ``get_ipython().<method>(...)`` call; the arguments are
    ``None`` unless they are strings, as IPython's translation writes them.  ``None`` for any
    other call."""
    func = node.func
    if not (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Call)
        and isinstance(func.value.func, ast.Name)
        and func.value.func.id == "get_ipython"
        and not func.value.args
    ):
        return None
    literal = not node.keywords and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)
    return func.attr, [a.value for a in node.args] if literal else None


class _Translator:
    """Translates a cell, then checks every ``get_ipython()`` call in it against what a rank
    runs, translating the code that ``%time``/``%timeit`` run in turn."""

    def __init__(self, source: str, line_offset: int):
        self.typed = ("\n" * line_offset + source).splitlines()

    def code(self, text: str, first: int) -> Tuple[str, List[ast.stmt]]:
        """``text``, whose first line is the notebook's line ``first``, as Python (line for line)
        and its statements for name analysis."""
        python = text
        try:
            tree = ast.parse("\n" * (first - 1) + python)
        except SyntaxError:
            python = _from_ipython(text)
            try:
                tree = ast.parse("\n" * (first - 1) + python)
            except SyntaxError as exc:
                raise CaptureError(self._syntax_message(exc)) from None
        lines = python.split("\n")
        tree = _Inliner(self, lines, first).visit(tree)
        return "\n".join(lines), tree.body

    def where(self, line: int) -> str:
        return f"line {line}, `{self.typed[line - 1].strip()}`"

    def _syntax_message(self, exc: SyntaxError) -> str:
        typed = self.typed[exc.lineno - 1] if exc.lineno and 0 < exc.lineno <= len(self.typed) else None
        if typed is not None and (exc.text or "").rstrip("\n") != typed:
            # the line was translated: show what was typed, without a column
            exc = SyntaxError(exc.msg, (exc.filename, exc.lineno, None, typed))
        return _syntax_message(exc)

    def inline(self, method: str, args: List[str], line: int) -> Tuple[List[ast.stmt], ast.expr, List[str]]:
        """What the call of ``method`` with ``args`` on the notebook's ``line`` runs, for
        analysis: ``(statements, expression)``; and the arguments the ranks get (the code of a
        ``%time``/``%timeit`` translated)."""
        if method in ("system", "getoutput"):
            return [], self._expansions(args[0]), args
        if len(args) != (3 if method == "run_cell_magic" else 2):
            return [], ast.Constant(None), args  # not IPython's translation: the rank says what is wrong
        name, arg = args[0], args[1]
        if method == "run_line_magic":
            if name.startswith("%"):  # IPython reads %%name past the first line as a line magic %name
                raise CaptureError(
                    f"{self.where(line)}: a cell magic (%{name}) must be the first line of "
                    "the code, and applies to all of it"
                )
            if name not in syntax.LINE_MAGICS:
                raise CaptureError(f"{self.where(line)}: {syntax.unsupported('%' + name)}")
            if name == "time":
                python, statements = self.code(arg, line)
                return (*_value_of(statements), [name, python])
            if name == "timeit":
                start = self._timeit_start(arg, line)
                python, statements = self.code(arg[start:], line)
                return statements, ast.Constant(None), [name, arg[:start] + python]
            return [], self._expansions(arg), args
        if name not in syntax.CELL_MAGICS:
            raise CaptureError(f"{self.where(line)}: {syntax.unsupported('%%' + name)}")
        if name == "time" and arg.strip():
            raise CaptureError(f"{self.where(line)}: {syntax.TIME_TAKES_NO_ARGUMENTS}")
        body, statements = self.code(args[2], line + 1)
        if name == "time":
            return (*_value_of(statements), [name, arg, body])
        start = self._timeit_start(arg, line)
        setup, setup_statements = self.code(arg[start:], line)
        return setup_statements + statements, ast.Constant(None), [name, arg[:start] + setup, body]

    def _timeit_start(self, line_text: str, line: int) -> int:
        try:
            return syntax.parse_timeit(line_text)[1]
        except ValueError as exc:
            raise CaptureError(f"{self.where(line)}: {exc}") from None

    @staticmethod
    def _expansions(text: str) -> ast.expr:
        """The expressions that the ranks evaluate to expand ``text`` (a ``{model_dir}`` must reach
        them), as one tuple."""
        found = []
        for expression in syntax.expansions(text):
            try:
                found.append(ast.parse(expression.strip(), mode="eval").body)
            except SyntaxError:  # the rank cannot expand it either, and runs the line as it is
                continue
        return ast.Tuple(elts=found, ctx=ast.Load())


def _value_of(statements: List[ast.stmt]) -> Tuple[List[ast.stmt], ast.expr]:
    """``%time`` code as statements and the expression whose value it returns (its last line's,
    when that is an expression)."""
    if statements and isinstance(statements[-1], ast.Expr):
        return statements[:-1], statements[-1].value
    return statements, ast.Constant(None)


class _Inliner(ast.NodeTransformer):
    """Replaces each ``get_ipython()`` call by what it runs (for analysis); the code of a magic
    becomes statements placed before the statement that holds the call.  Rewrites a call whose
    arguments ``_Translator.inline`` translated in ``lines`` (the text the ranks compile)."""

    def __init__(self, translator: _Translator, lines: List[str], first: int):
        self.translator = translator
        self.lines = lines
        self.first = first
        self.before: List[ast.stmt] = []

    def visit(self, node: ast.AST) -> Union[ast.AST, List[ast.AST]]:
        if not isinstance(node, ast.stmt):
            return super().visit(node)
        outer, self.before = self.before, []
        node = super().visit(node)
        before, self.before = self.before, outer
        return before + [node] if before else node

    def visit_Call(self, node: ast.Call) -> ast.expr:
        self.generic_visit(node)
        call = _shell_call(node)
        if call is None:
            return node
        method, args = call
        if method not in SHELL_METHODS:  # ``?`` alone is get_ipython().show_usage()
            raise CaptureError(f"{self.translator.where(node.lineno)}: {syntax.unsupported(f'get_ipython().{method}')}")
        if args is None:
            return node  # computed at run time: the rank's get_ipython() checks it then
        statements, value, sent = self.translator.inline(method, args, node.lineno)
        if sent != args and node.lineno == node.end_lineno:
            index = node.lineno - self.first
            raw = self.lines[index].encode()
            rewritten = f"get_ipython().{method}({', '.join(map(repr, sent))})".encode()
            self.lines[index] = (raw[: node.col_offset] + rewritten + raw[node.end_col_offset :]).decode()
        self.before.extend(statements)
        return value


def capture_cell(
    source: str,
    namespace: dict,
    history: Iterable[str] = (),
    *,
    filename: str = "<torchdist cell>",
    line_offset: int = 1,
    warn_bytes: int = DEFAULT_WARN_BYTES,
) -> CellCode:
    """Turn a cell into a self-contained ``CellCode``; nothing is launched.

    ``line_offset`` is how many notebook lines precede the cell body (1 for the ``%%torchdist``
    line), so line numbers in errors and tracebacks are the notebook's.
    """
    translation = translate_cell(source, line_offset)
    history = list(history)
    imports = notebook_imports(history, namespace)
    imported = _bound_by(imports)
    values: Dict[str, object] = {}
    for name in free_names(ast.unparse(translation.analysis), filename):
        if name in CELL_PROVIDED or name in NOT_SENT or name not in namespace:
            continue
        value = namespace[name]
        if isinstance(value, types.ModuleType):
            if name not in imported:
                statement = _module_import(name, value)
                if statement:
                    imports.append((statement, f"the notebook's {name!r}"))
            continue
        if name in imported:
            continue
        values[name] = value
    stream, buffers = b"", None
    try:
        if values:  # tensors' and arrays' bytes apart, not copied (see values.Buffers)
            stream, buffers = pickled_apart(values)
    except Exception as exc:  # noqa: BLE001
        raise CaptureError(_unpicklable_message(values, exc)) from None
    total = len(stream) + (buffers.nbytes if buffers is not None else 0)
    if total > warn_bytes:
        sizes = {k: _pickled_size(v) for k, v in values.items()}
        largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
        warnings.warn(
            f"the cell sends {total / 2**20:.0f} MB of notebook values to every rank; largest: "
            + ", ".join(f"{k} ({v / 2**20:.0f} MB)" for k, v in largest)
            + ". Load large data inside the cell (per rank) instead.",
            stacklevel=3,
        )
    cell = CellCode(
        source=source,
        filename=filename,
        imports=imports,
        values=stream,
        buffers=buffers,
        value_names=sorted(values),
        init_process_group=not _calls_init_process_group(translation.analysis),
        line_offset=line_offset,
        silent=_ends_with_semicolon(source),
        python="" if translation.python == source else translation.python,
    )
    return cell


def _pickled_size(value: object) -> int:
    stream, buffers = pickled_apart(value)
    return len(stream) + buffers.nbytes


def _syntax_message(exc: SyntaxError) -> str:
    text = (exc.text or "").rstrip("\n")
    lines = [f"SyntaxError in the cell, line {exc.lineno}: {exc.msg}"]
    if text:
        lines.append(f"    {text.strip()}")
        if exc.offset:
            indent = len(text) - len(text.lstrip())
            lines.append("    " + " " * max(exc.offset - 1 - indent, 0) + "^")
    return "\n".join(lines)


def _unpicklable_message(values: Dict[str, object], exc: Exception) -> str:
    for name, value in values.items():
        try:
            pickle_for_ranks(value)
        except Exception as inner:  # noqa: BLE001
            return (
                f"the cell uses {name!r} (a {type_name(value)}) from the notebook, which cannot be "
                f"sent to the ranks: {inner}. Create it inside the cell instead."
            )
    return f"the cell's notebook values cannot be sent to the ranks: {exc}"
