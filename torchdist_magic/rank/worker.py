"""The entry point every rank runs, locally or inside a Spark task.

    python -m torchdist_magic.rank.worker JOB_FILE RESULT_DIR

The launcher sets the environment (``rankenv.rank_environment``: ``RANK``, ``MASTER_ADDR``, ...,
the channel, ``TORCHDIST_USE_GPU`` and ``TORCHDIST_RETURN_VALUE``), reads this process's
stdout/stderr, and after it exits reads ``RESULT_DIR/result.pkl`` (the rank's value, when it is
wanted) or ``RESULT_DIR/error.json`` (an ``events.Failure``).  The worker imports neither
IPython nor ipywidgets.

Stopping and hangs.  While the job runs, SIGTERM raises ``runtime.RankStopped`` in the main
thread, so that the job's ``finally`` blocks and (at exit) its ``atexit`` handlers run within
the stop's grace period.  ``STACKS_SIGNAL`` makes ``faulthandler`` append every thread's stack
to ``RESULT_DIR/stacks.txt`` (also while the main thread is blocked in a C call); its first line
names the main thread.
"""

from __future__ import annotations

import base64
import contextlib
import faulthandler
import json
import linecache
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

from torchdist_magic.core import events, procs
from torchdist_magic.core.rankenv import ENV_BEFORE
from torchdist_magic.core.timing import ATEXIT_WAIT, PARENT_WATCH_INTERVAL, STOP_GRACE, SYSTEM_METRICS_INTERVAL
from ..core.names import RESULT_FILE, VALUE_FILE_ENV, ERROR_FILE, STACKS_FILE, STACKS_SIGNAL, STACKS_HEADER
from .runners import RUNNERS, cell_namespace, run_cell, start_process_group
from ..core.names import (
    CLEANUP_ENV,
    LAUNCHER_PID_ENV,
    PREFLIGHT_ENV,
    RETURN_VALUE_ENV,
    SECRET_ENV,
    SYSTEM_METRICS_ENV,
    USE_GPU_ENV,
)


class LauncherWatch:
    """This rank's launcher (its parent process), and what the rank does once it is gone: the
    run's files that the dead launcher can no longer remove (``TORCHDIST_CLEANUP``) are removed,
    and what the rank started goes with it (``end_orphan``).  A rank notices it while it runs
    (``watch``, a thread) and as it exits (``exiting``): a rank whose job ends first, as when a
    killed kernel broke the pipe of its output, must not leave the run's files behind."""

    def __init__(self) -> None:
        # the launcher's own word: a launcher killed while this process started is its parent no more
        self.parent = int(os.environ.pop(LAUNCHER_PID_ENV, "") or os.getppid())
        self.cleanup = [p for p in os.environ.pop(CLEANUP_ENV, "").split(os.pathsep) if p]
        self.mark = os.environ.get(procs.MARK_VARIABLE, "")

    def gone(self) -> bool:
        return os.getppid() != self.parent

    def watch(self) -> None:
        while True:
            time.sleep(PARENT_WATCH_INTERVAL)
            if self.gone():
                self.end_orphan()

    def exiting(self) -> None:
        """Called as the rank exits, whatever ended it: an orphan ends as one (never returns)."""
        if self.gone():
            self.end_orphan()

    def end_orphan(self) -> None:
        """Remove the run's files, then stop this process's group (the worker leads it), which
        takes the rank's own children (a ``subprocess``, DataLoader workers) along with it, and
        what the rank started in a session of its own (found by its launcher's mark,
        ``procs.MARK_VARIABLE``); never returns."""
        try:
            for path in self.cleanup:
                shutil.rmtree(path, ignore_errors=True)
            if os.getpgrp() == os.getpid():
                for pid in _others_in_my_group():  # they get their chance to clean up
                    with contextlib.suppress(OSError):  # it may have just exited
                        os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + STOP_GRACE
                while _others_in_my_group() and time.monotonic() < deadline:
                    time.sleep(0.05)
            procs.end_marked_processes(self.mark, STOP_GRACE)
            if os.getpgrp() == os.getpid():
                os.killpg(os.getpid(), signal.SIGKILL)  # this process included
        finally:
            os._exit(70)  # whatever failed above, the rank itself must not stay


#: this process's ``LauncherWatch`` once ``main`` runs
_launcher: Optional[LauncherWatch] = None


def _others_in_my_group() -> list:
    """Live processes other than this one in this process's group (off Linux none are found,
    and the group's SIGKILL still reaches them)."""
    me = os.getpid()
    return [pid for pid in procs.group_members(me) if pid != me]


def torch_memory(cuda: Any = None) -> Dict[str, float]:
    """What only the rank's own process knows of its GPU memory: torch's peak allocated bytes
    over its devices (``torch_max_allocated_bytes``), once the job initialised CUDA; ``{}``
    before (asking would initialise CUDA itself, or import torch).  ``cuda``: where to ask
    (``torch.cuda`` by default; a fake one in tests, on a machine without a GPU)."""
    if cuda is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return {}
        cuda = torch.cuda
    if not cuda.is_initialized():
        return {}
    peak = sum(cuda.max_memory_allocated(i) for i in range(cuda.device_count()))
    return {"torch_max_allocated_bytes": float(peak)}


def _report_torch_memory(client) -> None:
    """Send ``torch_memory()`` every ``SYSTEM_METRICS_INTERVAL`` when it changed (a thread of
    its own: the job's thread is never interrupted for it)."""
    sent: Dict[str, float] = {}
    while True:
        time.sleep(SYSTEM_METRICS_INTERVAL)
        try:
            values = torch_memory()
        except Exception:  # CUDA in a bad state: the job will say so itself  # noqa: BLE001
            continue
        if values and values != sent:
            client.send(events.SystemMetrics(rank=int(os.environ.get("RANK", "0")), values=values, time=time.time()))
            sent = values


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
    ours = {os.path.abspath(__file__), os.path.abspath(runners.__file__), os.path.abspath(rank_shell.__file__)}
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


# -- a warm pool's rank -------------------------------------------------------------------------

#: bytes of a warm rank's value per ``JobValue`` record (base64 makes it a third larger, well
#: under the channel's frame limit)
VALUE_PIECE = 1024 * 1024


class JobInbox:
    """The jobs the driver sends a warm rank (``RunJob`` pieces, put together in order)."""

    def __init__(self):
        import queue

        self._parts: Dict[str, List[str]] = {}
        self.jobs: "queue.Queue" = queue.Queue()

    def on_message(self, record: events.Event) -> None:
        if not isinstance(record, events.RunJob):
            return
        self._parts.setdefault(record.job_id, []).append(record.data)
        if record.last:
            data = base64.b64decode("".join(self._parts.pop(record.job_id)))
            self.jobs.put((record, data))


def _keep_process_group(dist) -> None:
    """In a warm pool the process group outlives each job: code that destroys the default
    group (a function written for TorchDistributor, Lightning) leaves it up, and the next
    ``init_process_group`` gets it again (``runners._init_once``)."""
    original = dist.destroy_process_group

    def destroy_process_group(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return None
        return original(group)

    destroy_process_group.__doc__ = original.__doc__
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group


def _end_output(job_id: str) -> None:
    """Mark the end of the job's output on both streams (``events.OUTPUT_END_MARK``): written to
    the file descriptors themselves, after everything the job printed."""
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        with contextlib.suppress(Exception):
            stream.flush()
        with contextlib.suppress(OSError):
            os.write(fd, f"{events.OUTPUT_END_MARK}{job_id}\n".encode())


def _set_environment(values: Dict[str, Optional[str]]) -> Dict[str, Optional[str]]:
    """Set each variable of ``values`` in this process's environment (``None``: unset it);
    what they were before, to set back the same way."""
    before = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return before


def serve(client, inbox: JobInbox, startup_env: Optional[Dict[str, Optional[str]]] = None) -> int:
    """A warm pool's rank: set up the process group once, then run each job the driver sends
    (cells in one namespace that lives as long as the rank) and report it with ``JobValue``
    pieces and ``JobDone``; return when the channel to the driver is gone, or on SIGTERM.
    ``startup_env``: what the env of the run that started the pool changed, with the values the
    variables have without it (``rankenv.ENV_BEFORE``)."""
    import queue

    import cloudpickle

    from torchdist_magic.rank import runtime

    start_process_group()
    import torch.distributed as dist

    _keep_process_group(dist)
    # The ranks started with the env of the run that started the pool (what is read only at
    # start-up, OMP_NUM_THREADS or NCCL's, keeps it); between jobs they have no run's env: each
    # job's own is set for the job and undone after it (its names get their earlier values back,
    # or are unset again), so a later run without it does not see it.  Variables a job's code
    # sets itself (os.environ, a library's) stay, like the names it defines: the rank's state is
    # the user's.
    _set_environment(startup_env or {})
    namespace = cell_namespace()
    with _stoppable(), contextlib.suppress(runtime.RankStopped):  # SIGTERM between jobs: the pool stops
        while True:
            try:
                record, data = inbox.jobs.get(timeout=0.2)
            except queue.Empty:
                if client.lost:
                    return 0
                continue
            runtime._new_job()
            undo = _set_environment(record.env)
            try:
                job = cloudpickle.loads(data)
            except Exception as exc:  # noqa: BLE001
                code, value, failure = 1, None, _failure(exc, type(exc).__qualname__, str(exc))
            else:
                code, value, failure = execute(job, namespace)
            _set_environment(undo)
            has_value = False
            if failure is None and (record.all_ranks or runtime.rank() == 0):
                pickled, failure = _pickled_value(value)
                if pickled is not None:
                    text = base64.b64encode(pickled).decode("ascii")
                    piece = 4 * VALUE_PIECE // 3
                    for i in range(0, len(text), piece):
                        client.send(
                            events.JobValue(rank=runtime.rank(), job_id=record.job_id, data=text[i : i + piece])
                        )
                    has_value = True
                else:
                    code = 1
            runtime.flush_reports()  # the job's report() points go before its end
            _end_output(record.job_id)
            client.send(
                events.JobDone(
                    rank=runtime.rank(),
                    job_id=record.job_id,
                    code=code,
                    time=time.time(),
                    has_value=has_value,
                    failure=failure,
                )
            )
            if failure is not None and failure.exc_type == "RankStopped":
                return 1
    return 1


def _listen_for_stack_requests(result_dir: str) -> None:
    """``STACKS_SIGNAL`` appends every thread's stack to ``STACKS_FILE``; the header line, written
    once the handler is in place, tells the launcher both that it may send the signal and which
    thread is the main one."""
    stacks = open(os.path.join(result_dir, STACKS_FILE), "a", encoding="utf-8")  # kept open: faulthandler writes to it
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True, chain=False)
    stacks.write(f"{STACKS_HEADER}{threading.main_thread().ident}\n")
    stacks.flush()


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


def _run_atexit_handlers(code: int) -> None:
    """The job's ``atexit`` handlers, then the exit: ``os._exit`` skips the interpreter's teardown
    (a user thread must not hang it), so they are run here, for at most ``ATEXIT_WAIT``."""
    import atexit

    ender = threading.Timer(ATEXIT_WAIT, os._exit, (code,))
    ender.daemon = True
    ender.start()
    atexit._run_exitfuncs()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m torchdist_magic.rank.worker JOB_FILE RESULT_DIR", file=sys.stderr)
        return 2
    job_file, result_dir = argv
    faulthandler.enable()
    global _launcher
    _launcher = LauncherWatch()
    threading.Thread(target=_launcher.watch, name="torchdist-launcher-watch", daemon=True).start()

    import cloudpickle

    from torchdist_magic.wire.client import client_from_env
    from torchdist_magic.rank import collectives, debugger as rank_debugger, runtime

    collectives.enable_flight_recorder()  # before the job's first process group

    with open(job_file, "rb") as fh:
        job = cloudpickle.load(fh)
    inbox = JobInbox() if job.kind == "serve" else None

    def on_message(record: events.Event) -> None:
        if isinstance(record, events.DumpCollectives):
            collectives.send_record(client.send, runtime.rank())
        if isinstance(record, events.StartProfile):
            runtime._start_profile(record.steps)
            return
        if inbox is not None:
            inbox.on_message(record)
        if debug is not None:  # no session can be open before it is
            debug.on_message(record)

    debug = None
    client = client_from_env(on_message)
    debug = rank_debugger.install(client)
    os.environ.pop(SECRET_ENV, None)
    startup_env = json.loads(os.environ.pop(ENV_BEFORE, "") or "{}")
    runtime._install_sink(client)
    if client is not None:
        client.send(events.Started(rank=runtime.rank(), host=socket.gethostname(), pid=os.getpid(), time=time.time()))
    _listen_for_stack_requests(result_dir)
    if client is not None and os.environ.get(USE_GPU_ENV) == "1" and os.environ.get(SYSTEM_METRICS_ENV, "1") == "1":
        threading.Thread(
            target=_report_torch_memory, args=(client,), name="torchdist-torch-memory", daemon=True
        ).start()
    if inbox is not None:
        if client is None:
            print("a warm pool's rank needs the driver's event channel (TORCHDIST_CHANNEL)", file=sys.stderr)
            return 2
        code = serve(client, inbox, startup_env)
    else:
        code = run_job(job, result_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    runtime.flush_reports()
    if client is not None:
        client.close()
    return code


if __name__ == "__main__":
    try:
        code = main()
        _run_atexit_handlers(code)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:  # the launcher may have died first (its pipe broke the job or the flush)
        if _launcher is not None:
            _launcher.exiting()
    # Skip interpreter teardown: user threads or a half-closed process group must not hang exit.
    os._exit(code)
