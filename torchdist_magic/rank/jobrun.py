"""One job run in a rank's process, and how it ended: ``execute`` runs it (stoppable by SIGTERM,
``RankStopped``; a breakpoint's quit and ``SystemExit`` said as such), ``run_job`` writes its
value or its failure where the launcher reads them (``worker``'s docstring), and the failure's
traceback starts in the user's code (``_format_exception``).  Both a cold rank (``worker``) and a
warm one (``serving``) run their jobs here."""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import signal
import socket
import sys
import threading
import traceback
from typing import Any, Optional, Tuple

from torchdist_magic.core import events
from ..core.names import ERROR_FILE, PREFLIGHT_ENV, RESULT_FILE, RETURN_VALUE_ENV, USE_GPU_ENV, VALUE_FILE_ENV
from .runners import RUNNERS, run_cell


def _write_failure(result_dir: str, failure: events.Failure) -> None:
    path = os.path.join(result_dir, ERROR_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(events.failure_to_json(failure), fh)
    os.replace(tmp, path)


def _format_exception(exc: BaseException) -> str:
    """The traceback without this module's own frames, nor those of ``runners`` (what runs the
    job) or ``rank_shell`` (between a ``%time`` line and the code it runs): it starts at, and
    stays in, the user's code."""
    from torchdist_magic.rank import runners, shell as rank_shell

    te = traceback.TracebackException.from_exception(exc)
    ours = {
        os.path.abspath(__file__),
        os.path.abspath(runners.__file__),
        os.path.abspath(rank_shell.__file__),
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "serving.py"),  # a warm rank's loop
    }
    frames = [f for f in te.stack if os.path.abspath(f.filename) not in ours]
    te.stack = traceback.StackSummary.from_list(frames)
    return "".join(te.format())


def _failure(
    exc: BaseException,
    exc_type: str,
    message: str,
    exit_code: Optional[int] = None,
    traceback_text: Optional[str] = None,
) -> events.Failure:
    from torchdist_magic.rank import runtime

    return events.Failure.from_exception(
        runtime.rank(),
        exc,
        host=socket.gethostname(),
        exit_code=exit_code,
        exc_type=exc_type,
        message=message,
        traceback_text=_format_exception(exc) if traceback_text is None else traceback_text,
    )


def execute(job, namespace: Optional[dict] = None) -> Tuple[int, Any, Optional[events.Failure]]:
    """Run ``job`` in this process: ``(exit code, value, failure)``.  A cell runs in
    ``namespace`` when given (a warm rank's)."""
    for filename, lines in job.sources.items():
        linecache.cache.setdefault(filename, (sum(map(len, lines)), None, lines, filename))
    try:
        for p in job.sys_path:
            if p not in sys.path and (p == "" or os.path.isdir(p)):
                sys.path.append(p)
        if job.cwd and os.path.isdir(job.cwd):
            os.chdir(job.cwd)
        with _stoppable():
            if os.environ.get(PREFLIGHT_ENV) == "1":
                _preflight()
            value = run_cell(job, namespace) if job.kind == "cell" else RUNNERS[job.kind](job)
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return 0, None, None
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        return code, None, _failure(exc, "SystemExit", f"exit code {code}", exit_code=code)
    except BaseException as exc:  # noqa: BLE001
        from bdb import BdbQuit

        from torchdist_magic.rank import debugger as rank_debugger

        if isinstance(exc, BdbQuit):  # q (or an interrupt) in a breakpoint() session on this rank
            return (
                1,
                None,
                _failure(
                    exc, "BdbQuit", f"the debugger on rank {os.environ.get('RANK', '0')} was quit, which stops the run"
                ),
            )
        failure = _failure(exc, type(exc).__qualname__, str(exc))
        _report_collectives()
        rank_debugger.post_mortem(exc, failure.time)  # with --pdb: held here until the user is done
        return 1, None, failure
    return 0, value, None


def _preflight() -> None:
    """The pre-flight check with every other rank (``preflight``), before the job; raises
    ``PreflightRefused`` when the ranks' reports refuse the run."""
    from torchdist_magic.core import preflight
    from torchdist_magic.rank import runtime

    health = preflight.open_health() if os.environ.get(USE_GPU_ENV) == "1" else None
    preflight.run(runtime._emit, health, preflight.driver_version(health))


def _report_collectives() -> None:
    """Send where this failing rank is in each process group (``collectives``) before it exits:
    its record goes with it, and the driver compares it with its peers' (a collective timeout
    here may be a peer's doing).  Only the Flight Recorder's: the stack, here, is the handler's."""
    from torchdist_magic.rank import collectives, runtime

    if "torch.distributed" in sys.modules:
        with contextlib.suppress(Exception):  # the failure itself is what must get out
            record = collectives.record(runtime.rank())
            if record.source == "flight recorder":
                runtime._emit(record)


def _unpicklable(value: Any, exc: Exception) -> events.Failure:
    from torchdist_magic.rank import runtime

    return _failure(
        exc,
        "TypeError",
        f"the value of rank {runtime.rank()} (a {type(value).__qualname__}) cannot be pickled: {exc}",
        traceback_text="",
    )


def _pickled_value(value: Any) -> Tuple[Optional[bytes], Optional[events.Failure]]:
    """``value`` as one blob (``values.dumps``), or why it cannot be pickled."""
    from torchdist_magic.core import values

    try:
        return values.dumps(value), None
    except Exception as exc:  # noqa: BLE001
        return None, _unpicklable(value, exc)


def run_job(job, result_dir: str) -> int:
    """Run ``job`` in this process; write its value (when this rank's value is wanted) or its
    failure into ``result_dir``; the exit code.  The value goes to ``TORCHDIST_VALUE_FILE``
    where the launcher names one (shared memory, on the driver's machine), else into
    ``result_dir``, written straight from the value's memory (``values.dump``)."""
    from torchdist_magic.core import values

    code, value, failure = execute(job)
    if failure is None and os.environ.get(RETURN_VALUE_ENV, "1") == "1":
        paths = [p for p in (os.environ.get(VALUE_FILE_ENV), os.path.join(result_dir, RESULT_FILE)) if p]
        for path in paths:
            tmp = path + ".tmp"
            try:
                values.dump(value, tmp)
            except OSError as exc:  # shared memory full: the result dir, on disk, takes it instead
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                if path != paths[-1]:
                    continue
                failure, code = (
                    _failure(
                        exc,
                        "OSError",
                        f"the value of rank {os.environ.get('RANK', '0')} could not be written to {path}: {exc}",
                        traceback_text="",
                    ),
                    1,
                )
            except Exception as exc:  # noqa: BLE001
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                failure, code = _unpicklable(value, exc), 1
            else:
                os.replace(tmp, path)
            break
    if failure is not None:
        _write_failure(result_dir, failure)
    return code


@contextlib.contextmanager
def _stoppable():
    """While the job runs (in the main thread), SIGTERM raises ``RankStopped`` in it; once the
    job has returned or raised, SIGTERM waits for the kill: writing the job's value or failure
    must not be cut short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _raise_rank_stopped)
    try:
        yield
    finally:  # a warm rank's job ends inside its serving loop, which stays stoppable
        signal.signal(signal.SIGTERM, previous if previous is _raise_rank_stopped else _ignore_signal)


def _raise_rank_stopped(signum, frame) -> None:
    from torchdist_magic.rank.runtime import RankStopped

    signal.signal(signal.SIGTERM, _ignore_signal)  # once: a second SIGTERM must not cut the cleanup short
    raise RankStopped("the run stopped this rank (SIGTERM)")


def _ignore_signal(signum, frame) -> None:
    """A handler that does nothing (unlike SIG_IGN, it is not inherited by programs the rank starts)."""
