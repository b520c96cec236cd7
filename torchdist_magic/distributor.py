"""Runs: validate and resolve the options, pick a backend, start, supervise, collect.

``submit(target, args, kwargs, options)`` starts a run and returns its ``Run`` handle;
``follow(run, observer)`` waits for it in the calling thread, calling the observer (a view)
as it goes.  This module knows nothing of views: callers hand it what to notify.  The Python
API (``Distributor``, call-compatible with TorchDistributor) is in ``api``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from typing import Any, List, Optional, Protocol

from .backends import Backend, BackendRun, LaunchContext, make_backend
from .channel import ChannelServer, new_secret
from .errors import JobTimeout, RankFailure, RunCancelled
from .job import Job, function_job, script_job
from .options import LaunchOptions
from .rankenv import RunSpec
from .state import RunState, is_collateral
from .timing import ROOT_CAUSE_WAIT, STOP_GRACE, SUPERVISE_POLL

_last_run: Optional["Run"] = None
_run_counter = itertools.count(1)


def last_run() -> Optional["Run"]:
    """The handle of the most recent run started in this process (``None`` before the first)."""
    return _last_run


def build_job(target: Any, args: tuple, kwargs: dict) -> Job:
    """A ``Job`` from a ``Job``, a function or a script path; bad input raises before anything
    starts."""
    if isinstance(target, Job):
        if args or kwargs:
            raise TypeError("a Job takes no arguments; they belong in the job")
        return target
    if isinstance(target, (str, os.PathLike)):
        if kwargs:
            raise TypeError("keyword arguments cannot be passed to a script; give them as "
                            f"command-line strings (got {', '.join(kwargs)})")
        return script_job(os.fspath(target), args)
    return function_job(target, args, kwargs)


def submit(target: Any, args: tuple, kwargs: dict, options: LaunchOptions) -> "Run":
    """Start ``target`` (a ``Job``, a function, or a script path) as a run and return its
    handle at once.  Bad input (options, arguments, an unplaceable run) raises
    ``TypeError``/``ValueError`` before anything starts."""
    if not isinstance(options, LaunchOptions):
        raise TypeError(f"options must be a LaunchOptions, got {type(options).__name__}")
    options = options.replace()  # validated again: a LaunchOptions can be changed after it was made
    job = build_job(target, tuple(args), dict(kwargs))
    backend = make_backend(options)
    backend.check(options)
    run = Run(job, options, backend)
    run._start()
    return run


class Run:
    """A run in progress or finished: its ``state`` (a ``RunState``), result, logs, cancel."""

    def __init__(self, job: Job, options: LaunchOptions, backend: Backend):
        import cloudpickle

        self.job = job
        self.options = options
        self.backend = backend
        self.run_id = f"{next(_run_counter)}-{uuid.uuid4().hex[:8]}"
        #: host:port of the run's event channel, once it listens
        self.channel_address: Optional[str] = None
        self.state = RunState(self.run_id, options.num_processes, backend.describe(),
                              options.use_gpu, job.name)
        self._job_bytes = cloudpickle.dumps(job)
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name=f"torchdist-run-{self.run_id}",
                                        daemon=True)

    # -- public API ----------------------------------------------------------------------
    def result(self, timeout: Optional[float] = None) -> Any:
        """Wait for the run; rank 0's value (a list by rank with ``all_ranks``), or raise
        ``RankFailure`` / ``TimeoutError`` (``JobTimeout``) / ``RunCancelled``."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the run is still going after waiting {timeout:g} s "
                               "(it keeps running; call cancel() to stop it)")
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self) -> None:
        """Stop every rank (signal, short deadline, kill); ``result()`` raises ``RunCancelled``."""
        self._cancel.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def logs(self, rank: int = 0) -> str:
        """Everything ``rank`` printed (stdout and stderr, in order), complete."""
        return self.state.logs(rank)

    @property
    def exception(self) -> Optional[BaseException]:
        return self._error

    def __repr__(self) -> str:
        return (f"<torchdist Run {self.run_id} {self.state.state} np={self.options.num_processes} "
                f"on {self.state.backend}>")

    # -- supervision ---------------------------------------------------------------------
    def _start(self) -> None:
        global _last_run
        _last_run = self
        self._thread.start()

    def _supervise(self) -> None:
        channel = None
        backend_run: Optional[BackendRun] = None
        try:
            secret, launcher_secret = new_secret(), new_secret()
            channel = ChannelServer(self.state.apply, self.run_id, host=self.backend.channel_host(),
                                    secret=secret, launcher_secret=launcher_secret)
            host, port = channel.address[:2]
            self.channel_address = f"{host}:{port}"
            spec = RunSpec.resolve(self.options, self.run_id, self.channel_address, secret, launcher_secret)
            ctx = LaunchContext(spec, self._job_bytes, self.state.apply,
                                lambda record: channel.broadcast(record, role="launcher"))
            deadline = (time.monotonic() + self.options.timeout) if self.options.timeout else None
            if self._cancel.is_set():
                raise RunCancelled("the run was cancelled before it started")
            backend_run = self.backend.start(ctx)
            self._watch(backend_run, deadline)
        except BaseException as exc:  # reported through result(), never lost in this thread
            self._error = exc
            if not self.state.finished:
                self.state.finish("failed", message=str(exc))
        finally:
            if backend_run is not None:
                backend_run.close()
            if channel is not None:
                channel.close()
            self._done.set()

    def _watch(self, backend_run: BackendRun, deadline: Optional[float]) -> None:
        first_failure: Optional[float] = None
        while True:
            failures = self.state.failures()
            if failures and first_failure is None:
                first_failure = time.monotonic()
            if failures and is_collateral(failures[0]) and not self.state.all_exited() \
                    and time.monotonic() - first_failure < ROOT_CAUSE_WAIT:
                failures = []  # a peer noticed a failure whose own report is still on its way
            if failures:
                backend_run.stop(STOP_GRACE)
                failures = self.state.failures()  # the root cause may have arrived meanwhile
                self._error = RankFailure(failures[0], failures[1:])
                self.state.finish("failed", failures[0])
                return
            if self.state.all_exited_ok():
                self._value = self._collect(backend_run)
                self.state.finish("succeeded")
                return
            if self._cancel.is_set():
                backend_run.stop(STOP_GRACE)
                self._error = RunCancelled("the run was cancelled; every rank was stopped")
                self.state.finish("cancelled")
                return
            if deadline is not None and time.monotonic() >= deadline:
                backend_run.stop(STOP_GRACE)
                self._error = JobTimeout(self.options.timeout, self._progress_summary())
                self.state.finish("timed out")
                return
            time.sleep(SUPERVISE_POLL)

    def _collect(self, backend_run: BackendRun) -> Any:
        import cloudpickle

        ranks = range(self.options.num_processes) if self.options.all_ranks else [0]
        values: List[Any] = []
        for r in ranks:
            data = backend_run.result(r)
            values.append(None if data is None else cloudpickle.loads(data))
        return values if self.options.all_ranks else values[0]

    def _progress_summary(self) -> str:
        parts = []
        for rs in self.state.ranks:
            bar = rs.current_progress()
            where = f" at {bar['desc'] or 'step'} {bar['n']}/{bar['total'] or '?'}" if bar else ""
            parts.append(f"rank {rs.rank}: {rs.state}{where}")
        return "; ".join(parts)


class Observer(Protocol):
    """What ``follow`` notifies while it waits: a view."""

    def update(self) -> None: ...

    def close(self) -> None: ...


def follow(run: Run, observer: Optional[Observer] = None, interval: float = 0.1) -> Any:
    """Wait for ``run`` in the calling thread, calling ``observer.update()`` every ``interval``
    seconds and ``observer.close()`` at the end; Ctrl-C cancels the run and re-raises.
    Returns rank 0's value or raises the run's error."""
    try:
        while not run.wait(interval):
            if observer is not None:
                observer.update()
    except KeyboardInterrupt:
        run.cancel()
        run.wait()
        if observer is not None:
            observer.close()
        raise
    if observer is not None:
        observer.close()
    return run.result()
