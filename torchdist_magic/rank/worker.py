"""The entry point every rank runs, locally or inside a Spark task.

    python -m torchdist_magic.rank.worker JOB_FILE RESULT_DIR

The launcher sets the environment (``rankenv.rank_environment``: ``RANK``, ``MASTER_ADDR``, ...,
the channel, ``TORCHDIST_USE_GPU`` and ``TORCHDIST_RETURN_VALUE``), reads this process's
stdout/stderr, and after it exits reads ``RESULT_DIR/result.pkl`` (the rank's value, when it is
wanted) or ``RESULT_DIR/error.json`` (an ``events.Failure``).  The job itself runs in
``jobrun``; a warm pool's rank serves job after job in ``serving``.  The worker imports neither
IPython nor ipywidgets.

Stopping and hangs.  While the job runs, SIGTERM raises ``runtime.RankStopped`` in the main
thread, so that the job's ``finally`` blocks and (at exit) its ``atexit`` handlers run within
the stop's grace period.  ``STACKS_SIGNAL`` makes ``faulthandler`` append every thread's stack
to ``RESULT_DIR/stacks.txt`` (also while the main thread is blocked in a C call); its first line
names the main thread.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Any, Dict, Optional

from torchdist_magic.core import events, procs
from torchdist_magic.core.rankenv import ENV_BEFORE
from torchdist_magic.core.timing import ATEXIT_WAIT, PARENT_WATCH_INTERVAL, STOP_GRACE, SYSTEM_METRICS_INTERVAL
from ..core.names import STACKS_FILE, STACKS_SIGNAL, STACKS_HEADER
from .jobrun import run_job
from .serving import JobInbox, serve
from ..core.names import (
    CLEANUP_ENV,
    LAUNCHER_PID_ENV,
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


def _listen_for_stack_requests(result_dir: str) -> None:
    """``STACKS_SIGNAL`` appends every thread's stack to ``STACKS_FILE``; the header line, written
    once the handler is in place, tells the launcher both that it may send the signal and which
    thread is the main one."""
    stacks = open(os.path.join(result_dir, STACKS_FILE), "a", encoding="utf-8")  # kept open: faulthandler writes to it
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True, chain=False)
    stacks.write(f"{STACKS_HEADER}{threading.main_thread().ident}\n")
    stacks.flush()


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
