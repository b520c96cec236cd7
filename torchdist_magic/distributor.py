"""The Python API: ``Distributor(...).run(train_object, *args)``.

Call-compatible with ``pyspark.ml.torch.distributor.TorchDistributor``: ``num_processes``,
``local_mode``, ``use_gpu``, and ``run`` taking a function (run as ``fn(*args, **kwargs)`` on
every rank) or a path to a ``.py`` file (run as a script with ``args`` as its command line).
Unlike TorchDistributor it always returns rank 0's value, turns any rank's failure into a
``RankFailure`` with that rank's traceback, and never leaves a process behind.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import threading
import time
import uuid
from typing import Any, List, Optional, Union

from .backends import Backend, BackendRun, LaunchContext, make_backend
from .channel import ChannelServer, new_secret
from .errors import JobTimeout, RankFailure, RunCancelled
from .job import Job, function_job, in_memory_sources, script_job
from .options import LaunchOptions
from .state import RunState

SHOW_CHOICES = ("text", "auto", "widget", None)
STOP_GRACE = 2.0       # seconds between SIGTERM and SIGKILL when ranks are stopped
POLL_INTERVAL = 0.02

_last_run: Optional["Run"] = None
_run_counter = itertools.count(1)


def last_run() -> Optional["Run"]:
    """The handle of the most recent run started in this process (``None`` before the first)."""
    return _last_run


def build_job(train_object: Any, args: tuple, kwargs: dict, options: LaunchOptions) -> Job:
    """A ``Job`` from a function or a script path; bad input raises before anything starts."""
    if isinstance(train_object, Job):
        job = dataclasses.replace(train_object, use_gpu=options.use_gpu, all_ranks=options.all_ranks,
                                  sys_path=train_object.sys_path or list(sys.path),
                                  cwd=train_object.cwd or os.getcwd())
    elif isinstance(train_object, (str, os.PathLike)):
        if kwargs:
            raise TypeError("keyword arguments cannot be passed to a script; give them as "
                            f"command-line strings (got {', '.join(kwargs)})")
        job = script_job(os.fspath(train_object), args, options.use_gpu, options.all_ranks)
    else:
        job = function_job(train_object, args, kwargs, options.use_gpu, options.all_ranks)
    job.sources = in_memory_sources()
    return job


class Run:
    """A run in progress or finished: its ``state`` (a ``RunState``), result, logs, cancel."""

    def __init__(self, job: Job, options: LaunchOptions, backend: Backend):
        import cloudpickle

        self.job = job
        self.options = options
        self.backend = backend
        self.run_id = f"{next(_run_counter)}-{uuid.uuid4().hex[:8]}"
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
            channel = ChannelServer(self.state.apply, self.run_id, host=self.backend.channel_host(),
                                    secret=new_secret())
            host, port = channel.address
            ctx = LaunchContext(self.run_id, self.options, self._job_bytes, self.state.apply,
                                f"{host}:{port}", channel.secret)
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
        while True:
            failures = self.state.failures()
            if failures:
                backend_run.stop(STOP_GRACE)
                others = [f for f in self.state.failures() if f is not failures[0] and f.rank != failures[0].rank]
                self._error = RankFailure(failures[0], others)
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
            time.sleep(POLL_INTERVAL)

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


class Distributor:
    """Run a function or a script as ``num_processes`` ranks of distributed PyTorch.

    ``Distributor(num_processes=1, local_mode=True, use_gpu=False, **options)`` where
    ``local_mode=True`` runs local processes on this machine and ``local_mode=False`` runs a
    Spark barrier stage; the other keywords are ``LaunchOptions`` fields (``timeout``, ``env``,
    ``all_ranks``, ``backend``).  ``show`` picks the live view of ``run``: ``"text"`` (default),
    ``"auto"`` (the widget in a Jupyter kernel with ipywidgets, text elsewhere), ``"widget"``, or
    ``None`` for silence.
    """

    def __init__(self, num_processes: int = 1, local_mode: Optional[bool] = True,
                 use_gpu: bool = False, *, show: Optional[str] = "text", **options: Any):
        if "backend" in options and local_mode is not None and local_mode is not True:
            raise ValueError("give either local_mode or backend, not both")
        backend = options.pop("backend", None)
        if backend is None:
            backend = "auto" if local_mode is None else ("local" if local_mode else "spark")
        unknown = set(options) - set(LaunchOptions.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(LaunchOptions.__dataclass_fields__)}")
        if show not in SHOW_CHOICES:
            raise ValueError(f"show must be one of {', '.join(map(repr, SHOW_CHOICES))}, got {show!r}")
        self.options = LaunchOptions(num_processes=num_processes, use_gpu=use_gpu,
                                     backend=backend, **options)
        self.show = show

    @classmethod
    def from_options(cls, options: LaunchOptions, show: Optional[str] = "text") -> "Distributor":
        """A Distributor for an existing ``LaunchOptions`` (what the magic and the panel use)."""
        self = cls.__new__(cls)
        self.options = options
        self.show = show
        return self

    @property
    def num_processes(self) -> int:
        return self.options.num_processes

    @property
    def local_mode(self) -> bool:
        return self.options.backend == "local"

    @property
    def use_gpu(self) -> bool:
        return self.options.use_gpu

    def submit(self, train_object: Union[Any, str], *args: Any, **kwargs: Any) -> Run:
        """Start the run and return its ``Run`` handle at once."""
        job = build_job(train_object, args, kwargs, self.options)
        backend = make_backend(self.options)
        backend.check(self.options)
        run = Run(job, self.options, backend)
        run._start()
        return run

    def run(self, train_object: Union[Any, str], *args: Any, **kwargs: Any) -> Any:
        """Run and wait; rank 0's value.  Ctrl-C stops every rank and re-raises."""
        run = self.submit(train_object, *args, **kwargs)
        return follow(run, self.show)


def follow(run: Run, show: Optional[str] = "text", view=None) -> Any:
    """Wait for ``run`` in the calling thread, rendering it with ``view`` (or a new view of kind
    ``show``); Ctrl-C cancels it."""
    if view is None and show is not None:
        from .view import make_view

        view = make_view(run, show)
    try:
        while not run.wait(0.1):
            if view is not None:
                view.update()
    except KeyboardInterrupt:
        run.cancel()
        run.wait()
        if view is not None:
            view.close()
        raise
    if view is not None:
        view.close()
    return run.result()
