"""Jobs: what every rank runs, as one self-contained picklable value.

A job is built on the driver (from a function, a script path or a notebook cell) and read
by ``torchdist_magic.rank.worker`` from a file the driver wrote, never from a socket.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import sys
import sysconfig
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .values import Buffers, pickle_for_ranks, pickled_apart


@dataclass
class CellCode:
    """A notebook cell captured for remote execution (see ``capture``)."""

    source: str
    filename: str
    imports: List[Tuple[str, str]] = field(default_factory=list)  # (statement, origin)
    values: bytes = b""  # pickle stream of {name: value}
    #: the large buffers of those values, apart (``values.pickled_apart``)
    buffers: Optional[Buffers] = None
    value_names: List[str] = field(default_factory=list)
    init_process_group: bool = True
    line_offset: int = 1
    silent: bool = False  # trailing ';'
    #: what the ranks compile when the source has IPython syntax: the source translated, line for
    #: line (``capture.translate_cell``); empty when the source is Python as it is
    python: str = ""


@dataclass
class Job:
    """What each rank runs (never how: GPUs, placement and which values come back are the run's
    settings, see ``rankenv``).  ``kind`` is ``"function"``, ``"script"`` or ``"cell"``; build
    one with ``function_job``, ``script_job`` or ``cell_job``.  ``"serve"`` (``serve_job``) is a
    warm pool's rank: it runs the jobs the driver sends it, one after another."""

    kind: str
    name: str
    payload: bytes = b""  # function: pickle stream of (fn, args, kwargs)
    buffers: Optional[Buffers] = None  # the payload's large buffers, apart
    script_path: str = ""
    script_source: str = ""
    script_args: List[str] = field(default_factory=list)
    cell: Optional[CellCode] = None
    sys_path: List[str] = field(default_factory=list)
    cwd: str = ""
    #: source of code that exists only in the driver's memory (notebook cells), so that
    #: tracebacks on the ranks show its lines: {filename: lines}
    sources: Dict[str, List[str]] = field(default_factory=dict)

    def sent_buffers(self) -> Optional[Buffers]:
        """The large buffers this job sends to the ranks apart from its pickle (a cell's notebook
        values', a function's arguments'), or ``None``."""
        return self.cell.buffers if self.cell is not None else self.buffers

    def with_sent_buffers(self, buffers: Buffers) -> "Job":
        """A copy of this job whose ``sent_buffers`` are ``buffers`` (the same buffers in a file)."""
        if self.cell is not None:
            return dataclasses.replace(self, cell=dataclasses.replace(self.cell, buffers=buffers))
        return dataclasses.replace(self, buffers=buffers)


MAX_SHIPPED_SOURCE = 2 * 1024 * 1024


def in_memory_sources() -> Dict[str, List[str]]:
    """``linecache`` entries with no file behind them (IPython's and ipykernel's cells)."""
    out: Dict[str, List[str]] = {}
    size = 0
    # a copy in one step: building a list of the items allocates, which can run the garbage
    # collector, whose finalizers may warn, and a warning adds its source line to this very cache
    for filename, entry in linecache.cache.copy().items():
        if len(entry) != 4 or not isinstance(entry[2], list) or os.path.exists(filename):
            continue
        size += sum(len(line) for line in entry[2])
        if size > MAX_SHIPPED_SOURCE:
            break
        out[filename] = list(entry[2])
    return out


def _installed_roots() -> List[str]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    return [os.path.realpath(r) for r in roots if r]


def _pickled_by_value(module_name: Optional[str]) -> Optional[types.ModuleType]:
    """The caller's own module (a test file, a helper next to the notebook): workers cannot be
    assumed to import it by name, so its functions travel by value."""
    if not module_name or module_name == "__main__":
        return None
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module is None or not path:
        return None
    real = os.path.realpath(path)
    if any(real.startswith(root + os.sep) for root in _installed_roots()):
        return None
    return module


def type_name(value: Any) -> str:
    """The type of ``value`` as messages name it: ``module.Qualname`` (``dict``, not
    ``builtins.dict``)."""
    return f"{type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")


def find_unpicklable(named: List[Tuple[str, Any]], modules: List[types.ModuleType]) -> Optional[str]:
    """Name the first of ``named`` that cannot be pickled, with its type and the reason."""
    for label, value in named:
        try:
            pickle_for_ranks(value, modules)
        except Exception as exc:  # cloudpickle raises TypeError, PicklingError, AttributeError...  # noqa: BLE001
            return f"{label} (a {type_name(value)}) cannot be pickled: {exc}"
    return None


def _function_references(fn: Any) -> List[Tuple[str, Any]]:
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    refs = []
    fn_globals = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in fn_globals and not isinstance(fn_globals[name], types.ModuleType):
            refs.append((f"global {name!r} used by {fn.__qualname__}", fn_globals[name]))
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            refs.append((f"variable {name!r} captured by {fn.__qualname__}", cell.cell_contents))
        except ValueError:
            pass
    return refs


def _where(by_value: Optional[List[types.ModuleType]] = None) -> dict:
    """What every job carries from the driver: its import path, working directory, and the
    source of code the ranks may not be able to read (for tracebacks): code that exists only
    in memory, and the files of the modules whose functions travel by value (a helper next to
    the notebook is not on a Spark executor's disk)."""
    sources = in_memory_sources()
    budget = MAX_SHIPPED_SOURCE - sum(len(line) for lines in sources.values() for line in lines)
    for module in by_value or ():
        filename = getattr(module, "__file__", None) if module is not None else None
        if not filename or filename in sources:
            continue
        lines = linecache.getlines(filename)
        budget -= sum(map(len, lines))
        if lines and budget >= 0:
            sources[filename] = list(lines)
    return {"sys_path": list(sys.path), "cwd": os.getcwd(), "sources": sources}


def function_job(fn: Any, args: tuple, kwargs: dict) -> Job:
    if not callable(fn):
        raise TypeError(f"train_object must be a function or a path to a .py file, got {type(fn).__name__}")
    own = _pickled_by_value(getattr(fn, "__module__", None))
    modules = [own] if own is not None else []
    try:
        payload, buffers = pickled_apart((fn, tuple(args), dict(kwargs)), modules)
    except Exception as exc:
        named = [(f"argument {i} of run()", a) for i, a in enumerate(args)]
        named += [(f"keyword argument {k!r} of run()", v) for k, v in kwargs.items()]
        named += _function_references(fn)
        culprit = find_unpicklable(named, modules)
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(culprit or f"function {name} cannot be pickled: {exc}") from exc
    return Job(
        kind="function", name=getattr(fn, "__name__", "function"), payload=payload, buffers=buffers, **_where(modules)
    )


def script_job(path: str, args: tuple) -> Job:
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ValueError(f"script {path!r} does not exist" + (" (it is a directory)" if os.path.isdir(full) else ""))
    bad = [a for a in args if not isinstance(a, (str, int, float))]
    if bad:
        raise TypeError(f"script arguments must be strings or numbers, got {bad[0]!r}")
    with open(full, encoding="utf-8") as fh:
        source = fh.read()
    return Job(
        kind="script",
        name=os.path.basename(full),
        script_path=full,
        script_source=source,
        script_args=[str(a) for a in args],
        **_where(),
    )


def cell_job(cell: CellCode, name: str) -> Job:
    """The job of a captured notebook cell (see ``capture.capture_cell``)."""
    return Job(kind="cell", name=name, cell=cell, **_where())


def serve_job() -> Job:
    """What a warm pool's ranks start with: serve the jobs the driver sends (``serving.serve``)."""
    return Job(kind="serve", name="warm pool")


def build_job(target: Any, args: tuple, kwargs: dict) -> Job:
    """A ``Job`` from a ``Job``, a function or a script path; bad input raises before anything
    starts."""
    if isinstance(target, Job):
        if args or kwargs:
            raise TypeError("a Job takes no arguments; they belong in the job")
        return target
    if isinstance(target, (str, os.PathLike)):
        if kwargs:
            raise TypeError(
                "keyword arguments cannot be passed to a script; give them as "
                f"command-line strings (got {', '.join(kwargs)})"
            )
        return script_job(os.fspath(target), args)
    return function_job(target, args, kwargs)
