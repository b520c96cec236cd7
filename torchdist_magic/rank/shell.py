"""What IPython syntax in a ``%%torchdist`` cell does on a rank, where there is no IPython.

``capture`` translates the cell on the driver with IPython's own input transformers:
``!cmd`` becomes ``get_ipython().system('cmd')``, ``x = !cmd`` ``x = get_ipython().getoutput('cmd')``,
``%time x = f()`` ``get_ipython().run_line_magic('time', 'x = f()')`` and ``%%time``
``get_ipython().run_cell_magic('time', '', body)``.  On the rank, the cell's ``get_ipython()``
is a ``RankShell``, which runs those calls for the forms in ``LINE_MAGICS`` and ``CELL_MAGICS``:

- ``!cmd`` runs ``cmd`` with ``sh`` in the rank's environment and working directory; its output
  is the rank's output.  ``x = !cmd`` gets its output lines (stderr included) as an ``SList``.
  ``$name`` and ``{expression}`` in the command are replaced by the cell's values, as in IPython.
- ``%time``, ``%%time``, ``%timeit``, ``%%timeit`` time the code on this rank and print there.
  ``%timeit`` takes ``-n N -r R -p P -q -o``.  Without ``-n`` the ranks agree on one loop count
  when a process group is up (a statement with collectives must run equally often on every
  rank), so a ``%timeit`` that only some ranks reach needs ``-n``.
- ``%env`` and ``%cd`` act on this rank's environment and working directory.
- ``%pip ARGS`` runs ``python -m pip ARGS`` with the rank's interpreter once per host: the first
  rank of the host to get there runs it while the others wait (on a file lock, so no process
  group is needed), then they go on, or all raise ``PipFailed`` if pip failed.

This module imports neither IPython nor torch (torch only when ``%timeit`` meets a process group).
"""

from __future__ import annotations

import ast
import fcntl
import gc
import hashlib
import importlib
import itertools
import linecache
import math
import os
import re
import resource
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from ..core.names import PRIVATE_TOKEN_ENV, RUN_ID_ENV
from ..core.syntax import EXPANDER, TIME_TAKES_NO_ARGUMENTS, TimeitOptions, parse_timeit, unsupported
from . import runtime
from ..core.privdir import open_private, remove_fallback, usable_user_directory, user_directory

#: ``%timeit`` without ``-n`` raises the loop count tenfold until one measurement takes this long
TIMEIT_AUTORANGE_SECONDS = 0.2


class MagicError(Exception):
    """A magic used in a way a rank cannot run (on the driver this is IPython's ``UsageError``,
    which a rank cannot import)."""


def _meeting_directory() -> str:
    """The private directory of this user's where the ranks of a host meet (``%pip``): the usual
    one in the temporary directory, or where another user made that first, the run's own beside
    it (``PRIVATE_TOKEN_ENV``), said once in this rank's log."""
    token = os.environ.get(PRIVATE_TOKEN_ENV, "")
    if not token:  # a rank started without the run's secret: the usual one, or its refusal
        return user_directory(tempfile.gettempdir())
    return usable_user_directory(
        tempfile.gettempdir(), agreed=token, say=lambda line: print(f"[torchdist] {line}", file=sys.stderr, flush=True)
    )


class PipFailed(RuntimeError):
    """``%pip`` exited with an error on this rank's host."""


class SList(list):
    """The output lines ``x = !cmd`` gets: a list, with IPython's ``.n`` (the lines joined by
    newlines), ``.s`` (joined by spaces) and ``.l`` (the list)."""

    @property
    def n(self) -> str:
        return "\n".join(self)

    @property
    def s(self) -> str:
        return " ".join(self)

    @property
    def l(self) -> "SList":  # noqa: E743 (IPython's name)
        return self


def _expand(text: str, frame) -> str:
    namespace = dict(frame.f_globals)
    namespace.update(frame.f_locals)
    try:
        return EXPANDER.vformat(text, (), namespace)
    except Exception:  # as IPython does, a line that cannot be expanded is used as it is  # noqa: BLE001
        return text


def _shell(command: str, capture: bool = False) -> Tuple[int, str]:
    """Run ``command`` with ``sh``: its exit code and, with ``capture``, its output (stderr
    included).  Otherwise its output goes straight to this rank's stdout and stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    common: Dict[str, Any] = dict(shell=True, stdin=subprocess.DEVNULL)
    if not capture:
        try:
            streams = dict(stdout=sys.stdout.fileno(), stderr=sys.stderr.fileno())
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
            streams = {}
        if streams:
            return subprocess.run(command, **common, **streams).returncode, ""
    done = subprocess.run(command, **common, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = done.stdout.decode("utf-8", "replace")
    if not capture:  # the cell redirected sys.stdout: what it prints goes there, so this does too
        sys.stdout.write(output)
        output = ""
    return done.returncode, output


# -- %timeit ------------------------------------------------------------------------------------


def _format_time(seconds: float, precision: int = 3) -> str:
    """A duration as IPython's timing magics print it (``1.5 ms``, ``2min 3s``)."""
    if seconds >= 60.0:
        parts = []
        left = seconds
        for suffix, length in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
            value = int(left / length)
            if value > 0:
                left = left % length
                parts.append(f"{value}{suffix}")
            if left < 1:
                break
        return " ".join(parts)
    micro = "µs"
    try:
        micro.encode(getattr(sys.stdout, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        micro = "us"
    order = min(-int(math.floor(math.log10(seconds)) // 3), 3) if seconds > 0 else 3
    return "%.*g %s" % (precision, seconds * (1, 1e3, 1e6, 1e9)[order], ("s", "ms", micro, "ns")[order])


class TimeitResult:
    """What ``%timeit -o`` returns: ``loops`` per measurement, ``repeat`` measurements,
    ``all_runs`` (seconds per measurement), ``timings`` (seconds per loop), ``best``, ``worst``,
    ``average``, ``stdev``; ``str()`` is the line ``%timeit`` prints."""

    def __init__(self, loops: int, repeat: int, all_runs: List[float], precision: int = 3):
        self.loops = loops
        self.repeat = repeat
        self.all_runs = all_runs
        self.timings = [run / loops for run in all_runs]
        self.best = min(self.timings)
        self.worst = max(self.timings)
        self._precision = precision

    @property
    def average(self) -> float:
        return math.fsum(self.timings) / len(self.timings)

    @property
    def stdev(self) -> float:
        mean = self.average
        return (math.fsum((t - mean) ** 2 for t in self.timings) / len(self.timings)) ** 0.5

    def __str__(self) -> str:
        return (
            f"{_format_time(self.average, self._precision)} ± {_format_time(self.stdev, self._precision)} "
            f"per loop (mean ± std. dev. of {self.repeat} run{'' if self.repeat == 1 else 's'}, "
            f"{self.loops:,} loop{'' if self.loops == 1 else 's'} each)"
        )

    __repr__ = __str__


def _slowest_rank(seconds: float) -> float:
    """The longest of every rank's ``seconds`` when a process group is up (so that all ranks take
    the same decision), else ``seconds``."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return seconds
    import torch

    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    measured = torch.tensor([seconds], dtype=torch.float64, device=on)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    return float(measured.item())


def _timed_loop(inner, number: int) -> float:
    collecting = gc.isenabled()
    gc.disable()  # as timeit does: a collection in the middle would be noise
    try:
        return inner(itertools.repeat(None, number), time.perf_counter)
    finally:
        if collecting:
            gc.enable()


_TIMEIT_TEMPLATE = """
def inner(_it, _timer):
    _t0 = _timer()
    for _i in _it:
        pass
    return _timer() - _t0
"""


# -- the shell ----------------------------------------------------------------------------------
def _parse_at(code: str, filename: str, first_line: int) -> ast.Module:
    """``code`` parsed so that its line 1 is ``first_line`` of ``filename``, and on that line at
    the column where the cell has it (``%time x = f()``: after ``%time``), so that a traceback
    shows the cell's own line and marks the right part of it."""
    tree = ast.parse("\n" * (first_line - 1) + code, filename)
    typed = linecache.getline(filename, first_line)
    start = typed.find(code.split("\n", 1)[0]) if code.strip() else -1
    shift = len(typed[:start].encode()) if start > 0 else 0  # AST columns count UTF-8 bytes
    for node in ast.walk(tree) if shift else ():
        if getattr(node, "lineno", None) == first_line:
            node.col_offset += shift
        if getattr(node, "end_lineno", None) == first_line:
            node.end_col_offset += shift
    return tree


def _rank() -> str:
    return os.environ.get("RANK", "0")


class RankShell:
    """The ``get_ipython()`` of a cell on a rank: ``system``, ``getoutput``, ``run_line_magic``
    and ``run_cell_magic``, for the forms this module's docstring lists.  One per cell run."""

    def __init__(self) -> None:
        self._previous_dir: Optional[str] = None
        self._pip_calls: Dict[Tuple[str, int, str], int] = {}

    def get_ipython(self) -> "RankShell":
        """What the cell's ``get_ipython()`` returns: this shell."""
        return self

    # IPython's names and signatures, which the translated cell calls
    def system(self, cmd: str) -> None:
        """``!cmd``: run ``cmd`` with ``sh``; its output is this rank's output; its exit code
        goes to the cell's ``_exit_code``."""
        frame = sys._getframe(1)
        code, _ = _shell(_expand(cmd, frame))
        frame.f_globals["_exit_code"] = code

    def getoutput(self, cmd: str, split: bool = True, depth: int = 0):
        """``x = !cmd``: the output of ``cmd`` (stdout and stderr), as an ``SList`` of lines
        (a string with ``split=False``)."""
        frame = sys._getframe(depth + 1)
        code, output = _shell(_expand(cmd, frame), capture=True)
        frame.f_globals["_exit_code"] = code
        return SList(output.splitlines()) if split else output

    def run_line_magic(self, magic_name: str, line: str, _stack_depth: int = 1) -> Any:
        """``%name line``, for the names in ``LINE_MAGICS``."""
        frame = sys._getframe(_stack_depth)
        if magic_name == "time":
            return self._time(line, frame, frame.f_lineno)
        if magic_name == "timeit":
            options, start = self._timeit_options(line)
            return self._timeit(options, "", frame.f_lineno, line[start:], frame.f_lineno, frame)
        if magic_name == "env":
            return self._env(_expand(line, frame))
        if magic_name == "cd":
            return self._cd(_expand(line, frame))
        if magic_name == "pip":
            return self._pip(_expand(line, frame), frame)
        raise MagicError(unsupported("%" + magic_name))

    def run_cell_magic(self, magic_name: str, line: str, cell: str) -> Any:
        """``%%name line`` over ``cell``, for the names in ``CELL_MAGICS``; the cell starts on
        the line after the call's."""
        frame = sys._getframe(1)
        first = frame.f_lineno + 1
        if magic_name == "time":
            if line.strip():
                raise MagicError(f"%%time {line}: {TIME_TAKES_NO_ARGUMENTS}")
            return self._time(cell, frame, first)
        if magic_name == "timeit":
            options, start = self._timeit_options(line)
            return self._timeit(options, line[start:], frame.f_lineno, cell, first, frame)
        raise MagicError(unsupported("%%" + magic_name))

    # the magics
    @staticmethod
    def _timeit_options(line: str) -> Tuple[TimeitOptions, int]:
        try:
            return parse_timeit(line)
        except ValueError as exc:
            raise MagicError(str(exc)) from None

    @staticmethod
    def _time(code: str, frame, first_line: int) -> Any:
        """Run ``code`` once, print its CPU and wall time; the value of its last line when that is
        an expression.  The times are printed even when the code raises."""
        filename = frame.f_code.co_filename
        tree = _parse_at(code, filename, first_line)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        body = compile(tree, filename, "exec")
        value = compile(ast.Expression(last.value), filename, "eval") if last else None
        glob, loc = frame.f_globals, frame.f_locals
        cpu, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        try:
            exec(body, glob, loc)
            return eval(value, glob, loc) if value else None
        finally:
            wall = time.perf_counter() - wall
            end = resource.getrusage(resource.RUSAGE_SELF)
            user, system = end.ru_utime - cpu.ru_utime, end.ru_stime - cpu.ru_stime
            print(
                f"CPU times: user {_format_time(user)}, sys: {_format_time(system)}, "
                f"total: {_format_time(user + system)}"
            )
            print(f"Wall time: {_format_time(wall)}")

    @staticmethod
    def _timeit(
        options: TimeitOptions, setup: str, setup_line: int, stmt: str, stmt_line: int, frame
    ) -> Optional[TimeitResult]:
        if not stmt.strip():
            return None
        filename = frame.f_code.co_filename
        inner = ast.parse(_TIMEIT_TEMPLATE).body[0]
        loop = inner.body[1]
        loop.body = _parse_at(stmt, filename, stmt_line).body or [ast.Pass()]
        inner.body[:0] = _parse_at(setup, filename, setup_line).body
        glob, loc = frame.f_globals, frame.f_locals
        if loc is not glob:  # in a function: its variables are the statement's too
            glob = dict(glob, **loc)
        defined: Dict[str, Any] = {}
        exec(compile(ast.fix_missing_locations(ast.Module([inner], [])), filename, "exec"), glob, defined)
        number = options.number
        if not number:
            for power in range(10):
                number = 10**power
                if _slowest_rank(_timed_loop(defined["inner"], number)) >= TIMEIT_AUTORANGE_SECONDS:
                    break
        result = TimeitResult(
            number,
            options.repeat,
            [_timed_loop(defined["inner"], number) for _ in range(options.repeat)],
            options.precision,
        )
        if not options.quiet:
            print(result)
        return result if options.result else None

    @staticmethod
    def _env(line: str) -> Any:
        """``%env``: every variable (secrets hidden); ``%env NAME``: its value;
        ``%env NAME=value`` or ``%env NAME value``: set it."""
        line = line.strip()
        if not line:
            return {
                k: "<hidden>" if any(s in k.lower() for s in ("key", "token", "secret")) else v
                for k, v in os.environ.items()
            }
        name, sep, value = line.partition("=" if "=" in line else " ")
        name, value = name.strip(), value.strip()
        if not sep:
            if name not in os.environ:
                raise MagicError(f"%env {name}: rank {_rank()} has no environment variable {name}")
            return os.environ[name]
        if re.search(r"\s", name):
            raise MagicError(
                f"%env {line}: an environment variable name has no spaces ({name!r}); write %env NAME=value"
            )
        os.environ[name] = value
        print(f"env: {name}={value}")
        return None

    def _cd(self, line: str) -> None:
        """``%cd [-q] [DIR | -]``: change this rank's working directory (home without DIR, the
        previous one with ``-``) and print it (not with ``-q``)."""
        words = shlex.split(line)
        quiet = "-q" in words
        words = [w for w in words if w != "-q"]
        if len(words) > 1:
            raise MagicError(f"%cd {line}: give one directory (quote a name with spaces)")
        target = words[0] if words else "~"
        if target == "-":
            target = self._previous_dir or os.getcwd()
        before = os.getcwd()
        os.chdir(os.path.expanduser(target))
        self._previous_dir = before
        if not quiet:
            print(os.getcwd())

    def _pip(self, line: str, frame) -> None:
        """``%pip ARGS``: ``python -m pip ARGS`` with this rank's interpreter, once per host.

        The ranks of a host that reach the same ``%pip`` (same run, cell line, text and count)
        meet at a lock file, in this user's private directory (``privdir``: a name another user
        could guess is never opened; where another user made it first, the run's own beside it,
        named by the run's secret, ``PRIVATE_TOKEN_ENV``, said once in the rank's log): the first
        runs pip and writes its exit code there, the others wait for it, then read it.  The last
        rank of the host removes the file (and the run's own directory)."""
        site = (frame.f_code.co_filename, frame.f_lineno, line)
        self._pip_calls[site] = count = self._pip_calls.get(site, 0) + 1
        key = "\0".join(map(str, (os.environ.get(RUN_ID_ENV, ""), *site, count)))
        name = f"torchdist-pip-{hashlib.sha256(key.encode()).hexdigest()[:24]}"
        while True:
            directory = _meeting_directory()
            try:
                fd = open_private(os.path.join(directory, name), os.O_RDWR | os.O_CREAT | os.O_APPEND)
                break
            except FileNotFoundError:  # the run's own directory, removed by the last rank of an earlier %pip
                continue
        path = os.path.join(directory, name)
        with open(fd, "a+", encoding="utf-8") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            fh.seek(0)
            head, _, passed = fh.read().partition("\n")
            if head:
                code, by = head.split()
                print(f"%pip {line}: pip ran once for this host, on rank {by}")
            else:
                code, _ = _shell(f"{shlex.quote(sys.executable)} -m pip {line}")
                code, by = str(code), _rank()
                importlib.invalidate_caches()  # what pip installed is importable from this cell on
                fh.write(f"{code} {by}\n")
            fh.write("+")
            fh.flush()
            if len(passed) + 1 >= len(runtime.host_ranks()):  # every rank of this host has been
                os.unlink(path)
                remove_fallback(directory)
        if code != "0":
            where = "above" if by == _rank() else f"in rank {by}'s log"
            raise PipFailed(
                f"%pip {line} failed on {socket.gethostname()}: pip exited with code {code} (its output is {where})"
            )
