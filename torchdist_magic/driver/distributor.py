"""Runs: validate and resolve the options, pick a backend, start, supervise, collect.

``submit(target, args, kwargs, options)`` starts a run and returns its ``Run`` handle;
``follow(run, observer)`` waits for it in the calling thread, calling the observer (a view)
as it goes.  This module knows nothing of views: callers hand it what to notify.  The Python
API (``Distributor``, call-compatible with TorchDistributor) is in ``api``.

Supervision.  A run is one or more attempts: each starts every rank (a new process group: its
own channel, port and Spark stage) and ends when every rank succeeded, or one failed, or the run
was cancelled, passed its ``timeout``, or hung (no output, progress or metrics from any rank for
``hang_timeout``).  A failure stops every rank and, while ``max_restarts`` allow, starts the next
attempt, unless ``restarts`` says it would only fail again or ``restart_on`` does not ask for it;
anything else ends the run.  A hang does what ``on_hang`` says: ``fail`` ends the run,
``observe`` shows where every rank is and leaves them running (the user stops the run),
``restart`` is a failure of the culprit rank.  Before a timeout or a hang stops the ranks, every
rank's stacks and collective records are captured: the error and the view say where each rank was,
and which rank held the others up (``culprit``: behind, exited, mismatched).  The same happens
when the first failure is a collective timeout (or a peer noticing one): if another rank is
behind, that rank is the root cause and the timeouts are collateral.  Under ``--pdb`` a failing
rank holds its frames in a post-mortem session (``debugger``): the other ranks are stopped at
once, the held one when its session ends, and it stays the root cause.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys
import threading
import time
import uuid
import warnings
from typing import Any, Callable, Dict, List, Optional

from ..backends import Backend, BackendRun, LaunchContext, LaunchPlan, make_backend
from ..backends.channels import open_channel
from ..wire.server import ChannelServer
from ..core.fdlimit import make_room
from .console import NO_STDIN_PDB, Console, rank_env
from ..core import culprit, faults
from ..core.errors import HangTimeout, JobTimeout, NotAvailable, RankFailure, ResultTimeout, RunCancelled
from ..core.failure import Failure
from ..core.events import DebugOutput, DumpCollectives, Log, ProfileDone, ProfilePiece, Stacks, StartProfile
from ..core.job import Job, build_job
from ..core.options import LaunchOptions
from ..core import values
from ..core.rankenv import RunSpec
from . import elastic, hangs, restarts
from .handle import StateAnswers
from .history import RecordKeeper
from .profiles import ProfileCollector
from .sent import SentValues
from .rootcause import is_collateral
from .rundir import RunDirectory
from .state import RunState
from ..core.timing import ROOT_CAUSE_WAIT, STOP_GRACE, SUPERVISE_POLL, WATCH_INTERVAL
from .tracking import MlflowLogger

_last_run: Optional["Run"] = None
_run_counter = itertools.count(1)


def last_run() -> Optional["Run"]:
    """The handle of the most recent run started in this process (``None`` before the first).

    Example:

    ```python
    from torchdist_magic import last_run

    # after a %%torchdist cell
    run = last_run()
    print(run.run_id, run.state.state, run.logs(rank=0))
    ```
    """
    return _last_run


def submit(
    target: Any,
    args: tuple,
    kwargs: dict,
    options: LaunchOptions,
    data: Any = None,
    columns: Optional[List[str]] = None,
    debug_input: bool = False,
    run_id: Optional[str] = None,
    listener: Optional[Callable[[Any], None]] = None,
    value_as_bytes: bool = False,
) -> "Run":
    """Start ``target`` (a ``Job``, a function, or a script path) as a run and return its
    handle at once.  Bad input (options, arguments, an unplaceable run, a DataFrame ``data``
    that cannot be trained on) raises ``TypeError``/``ValueError`` before anything starts.

    With ``data`` (a Spark DataFrame on Spark, a pandas DataFrame on local processes; its
    ``columns``, all by default) every rank reads its share with ``torchdist_magic.shard``.

    ``debug_input``: the caller will ``follow`` the run where a person answers ``input()``
    (``debugger.stdin_available``), so a rank's debugger may wait for them; otherwise
    ``breakpoint()`` on a rank is skipped and ``--pdb`` holds no rank (it says so).

    ``run_id``: the run's id (a detached run's, chosen by the kernel that started it); by default
    a new one.  ``listener``: called with every record the run's state takes, from its start
    (``RunState.listen``).  ``value_as_bytes``: ``result()`` gives the value as the ranks made it,
    one blob never decoded here (``values.kept``): a detached run's supervising process writes it
    into the run's record for the kernel that takes it, and needs none of its classes."""
    if not isinstance(options, LaunchOptions):
        raise TypeError(f"options must be a LaunchOptions, got {type(options).__name__}")
    options = options.replace()  # validated again: a LaunchOptions can be changed after it was made
    job = build_job(target, tuple(args), dict(kwargs))
    if options.warm:
        if data is not None:
            raise ValueError(
                "a warm run cannot train on a DataFrame: the pool's ranks were started "
                "before the data was given; run it without --warm/warm=True"
            )
        if options.profile:
            raise ValueError(
                "a warm run cannot be profiled (--profile): the pool's ranks were started "
                "without a profiler; run it without --warm/warm=True"
            )
        from ..backends.pool import warm_backend

        backend = warm_backend(options)  # checks the placement when it starts a pool
    else:
        backend = make_backend(options)
        from ..backends.pool import check_cold_run

        check_cold_run(options, backend)  # a warm pool may hold the Spark task slots
    try:
        options = elastic.first_world(options, backend)
        plan = backend.check(options)
        make_room(options.num_processes, local=backend.ranks_share_machine())
        prepared = None
        if data is not None:
            prepared = backend.prepare_data(data, options.num_processes, columns)
        elif columns is not None:
            raise ValueError("columns name columns of the data to train on, and no data was given")
        run = Run(job, options, backend, plan, prepared, debug_input=debug_input, run_id=run_id)
        run.value_as_bytes = value_as_bytes
        if listener is not None:
            run.state.listen(listener)
    except BaseException:
        backend.release()
        raise
    if options.pdb and not debug_input:
        print(NO_STDIN_PDB, file=sys.stderr, flush=True)
    run._start()
    try:  # the ranks start while the values they map are written; the caller may change them after
        run._sent.wait()
    except BaseException:  # interrupted: the run goes with it
        run.cancel()
        raise
    return run


def _subdirectory(directory: RunDirectory, name: str) -> str:
    path = os.path.join(directory.path(), name)
    os.makedirs(path, exist_ok=True)
    return path


class Run(StateAnswers):
    """A run in progress or finished: its ``state`` (a ``RunState``), result, logs, cancel; with
    ``mlflow=True`` its MLflow run's logger, ``tracking`` (``tracking.run_id``).

    ``directory`` holds what the run keeps on the driver's disk (spilled logs, checkpoints when
    no ``checkpoint_dir`` was given); it is made when first needed and removed when the ``Run``
    (and its ``state``) are garbage-collected, or when the process exits.

    Example:

    ```python
    from torchdist_magic import Distributor

    run = Distributor(num_processes=2).submit(train)   # returns at once
    run.wait(timeout=60)           # True once it ended
    print(run.logs(rank=1))        # what rank 1 printed
    value = run.result()           # rank 0's value, or the run's exception raised here
    ```
    """

    def __init__(
        self,
        job: Job,
        options: LaunchOptions,
        backend: Backend,
        plan: LaunchPlan,
        data: Any = None,
        debug_input: bool = False,
        run_id: Optional[str] = None,
    ):
        self.job = job
        self.options = options
        self.backend = backend
        self.plan = plan  # what ``backend.check(options)`` resolved
        self.data = data  # a ``backends.frames.PreparedData``, or None
        self.run_id = run_id or f"{next(_run_counter)}-{uuid.uuid4().hex[:8]}"
        #: host:port of the current attempt's event channel, once it listens
        self.channel_address: Optional[str] = None
        #: the TLS certificate (PEM) of that channel, which its ranks pin; "" when it is not
        #: encrypted (or the run is a warm pool's, whose channel is the pool's)
        self.channel_certificate = ""
        self.directory = RunDirectory(f"torchdist-run-{self.run_id}-")
        self.state = RunState(
            self.run_id,
            options.num_processes,
            backend.describe(),
            options.use_gpu,
            job.name,
            max_attempts=options.max_restarts + 1,
            spill_dir=functools.partial(_subdirectory, self.directory, "logs"),
            idle=set(range(options.num_processes)) - set(options.ranks or ()) if options.ranks else (),
        )
        #: this run's large values out to the ranks (``_job_bytes`` names their file)
        self._sent = SentValues(self.run_id, backend)
        self._job_bytes = self._sent.pickle(job)
        self._value: Any = None
        #: ``result()`` gives the ranks' blob undecoded (``submit``'s ``value_as_bytes``)
        self.value_as_bytes = False
        self._error: Optional[BaseException] = None
        self._cancel = threading.Event()
        #: whether a failed attempt starts again (``restarts``), and a hang's failure that ended
        #: the current attempt (``--on-hang restart``), which the next attempt's record keeps
        self._restarts = restarts.RestartDecision(options.restart_on)
        self._hang_cause: Optional[Failure] = None
        #: the current attempt's channel (None: a warm run's, on its pool's channel) and its
        #: started ranks (None between attempts); one capture of stacks and records at a time
        self._channel: Optional[ChannelServer] = None
        self._backend_run: Optional[BackendRun] = None
        self._capturing = threading.Lock()
        #: the class of the current attempt's root cause, once it failed (``faults.classify``)
        self._fault: Optional[faults.Fault] = None
        self._cancelled_by = "cancel()"
        self._done = threading.Event()
        #: the ranks' debugger sessions, which ``follow`` serves (``debugger``)
        self.debugger = Console()
        #: the current attempt's routes of records (a profile's go to its collector), and what
        #: sends a record to a rank's worker (None until the channel listens)
        self._profile_routes: dict = {}
        self._to_rank: Optional[Callable[[int, Any], bool]] = None
        self._profile_lock = threading.Lock()
        self._profile_requests = 0
        # a warm pool's channel is its own: its ranks' sessions could not be served (not yet)
        self._debug_env = rank_env(options, debug_input and not options.warm)
        self._thread = threading.Thread(target=self._supervise, name=f"torchdist-run-{self.run_id}", daemon=True)
        #: the run's MLflow run (``mlflow=True``), made here in the caller's thread: it nests under
        #: that thread's active MLflow run
        self.tracking: Optional[MlflowLogger] = None
        self._tracking_warning = ""
        if options.mlflow:
            try:
                self.tracking = MlflowLogger(self.state, options, job.name)
            except BaseException:  # no MLflow run, no run: nothing of it stays behind
                self._sent.remove()
                raise

    # -- public API ----------------------------------------------------------------------
    def result(self, timeout: Optional[float] = None) -> Any:
        """Wait for the run; rank 0's value (a list by rank with ``all_ranks``), or raise
        ``RankFailure`` / ``JobTimeout`` / ``HangTimeout`` / ``RunCancelled``.  When ``timeout``
        seconds pass first, raises ``ResultTimeout`` (a ``TimeoutError``, as ``JobTimeout`` is):
        the run itself goes on."""
        if not self._done.wait(timeout):
            raise ResultTimeout(timeout)
        if self._tracking_warning:  # said once, in the thread that asked for the result
            warning, self._tracking_warning = self._tracking_warning, ""
            warnings.warn(warning, RuntimeWarning, stacklevel=2)
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self, by: str = "cancel()") -> None:
        """Stop every rank (signal, short deadline, kill); ``result()`` raises ``RunCancelled``.
        ``by`` says who stopped it (the view's outcome line: ``stopped by the Stop button``)."""
        if not self._cancel.is_set():
            self._cancelled_by = by
        self._cancel.set()
        self.state.exit_seen.set()  # the watcher looks now

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def logs(self, rank: int = 0, attempt: Optional[int] = None) -> str:
        """Everything ``rank`` printed (stdout and stderr, in order), complete: in every attempt,
        or in attempt ``attempt`` only (1 for the first)."""
        return self.state.logs(rank, attempt)

    @property
    def channel_encrypted(self) -> bool:
        """Whether the run's event channel (a warm run's: its pool's) is TLS-encrypted: by
        default on Spark, not on local processes (``LaunchOptions.tls``)."""
        return self.plan.tls

    @property
    def attempt(self) -> int:
        """The current (or, once finished, the last) attempt: 1 until the first restart."""
        return self.state.attempt

    @property
    def can_profile(self) -> bool:
        """Whether ``start_profile`` may profile the ranks: not a warm pool's run."""
        return not self.options.warm

    def start_profile(self, steps: int) -> None:
        """Profile every rank's next ``steps`` steps (of its innermost ``progress()`` loop) now,
        as ``profile=STEPS`` does from the first (the view's Profile button); ``profile`` then
        has it.  A rank whose profile is under way goes on with that one."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"start_profile: steps must be a whole number of at least 1, got {steps!r}")
        if self.options.warm:
            raise NotAvailable(
                "a warm run cannot be profiled: the pool's ranks were started without a "
                "profiler; run it without --warm/warm=True"
            )
        with self._profile_lock:
            if self.done() or self._to_rank is None:
                raise RuntimeError(
                    f"run {self.run_id} is {'over' if self.done() else 'not running yet'}: "
                    "there are no steps to profile"
                )
            self._profile_requests += 1
            self._collect_profile(f"-{self._profile_requests}")
            for rank in self.options.ranks or range(self.options.num_processes):
                self._to_rank(rank, StartProfile(rank=rank, steps=steps))

    def _collect_profile(self, suffix: str) -> None:
        """Take the ranks' profile records from now on into a new ``ProfileCollector``."""
        profiles = ProfileCollector(
            functools.partial(
                _subdirectory, self.directory, os.path.join("profile", f"attempt-{self.state.attempt}{suffix}")
            ),
            self.options.ranks or range(self.options.num_processes),
        )
        self._profile_routes[ProfilePiece] = self._profile_routes[ProfileDone] = profiles.take
        self.state.profiles = profiles

    def culprit(self) -> "culprit.Verdict":
        """Ask every running rank where it is, now, while the run goes on (a run that seems
        stuck): their stacks (``stacks``) and collective records, compared (``culprit``).  The
        verdict names the ranks behind, exited or mismatched (``suspects``; none when the ranks
        are in step); it is also the state's, which the view shows."""
        backend_run = self._backend_run
        if backend_run is not None and not self._done.is_set():
            self._capture_stacks(backend_run)
        return self.last_verdict()

    @property
    def exception(self) -> Optional[BaseException]:
        return self._error

    def __repr__(self) -> str:
        return (
            f"<torchdist Run {self.run_id} {self.state.state} np={self.options.num_processes} on {self.state.backend}>"
        )

    # -- supervision ---------------------------------------------------------------------
    def _start(self) -> None:
        global _last_run
        _last_run = self
        #: the run's record in the history of runs (``history``)
        self.record = RecordKeeper(self)
        self.record.begin()
        self._thread.start()

    def _supervise(self) -> None:
        try:
            deadline = (time.monotonic() + self.options.timeout) if self.options.timeout else None
            checkpoints = ""
            if self.options.max_restarts and not self.options.checkpoint_dir:
                checkpoints = _subdirectory(self.directory, "checkpoints")
            while self._attempt(deadline, checkpoints):
                if not self._next_attempt():
                    break
        except BaseException as exc:  # reported through result(), never lost in this thread  # noqa: BLE001
            self._error = exc
            if not self.state.finished:
                self.state.finish("failed", message=str(exc))
        finally:
            if self.data is not None:
                self.data.remove_files()  # the ranks' copies of a pandas DataFrame
            self._sent.remove()
            self.backend.release()
            try:
                if self.tracking is not None:  # ended before result() returns: a reader finds it complete
                    self._tracking_warning = self.tracking.close()  # what it could not log, said by result()
            finally:
                self.record.end()  # before result() returns: the history has the run's end
                self._done.set()

    def _next_attempt(self) -> bool:
        """Start the next attempt after a failure: its host left out where the backend can, on
        fewer ranks where ``--np MIN:MAX`` allows (``elastic``); False when it cannot go on (the
        run has failed, saying why)."""
        failures = self.state.failures()
        hang_cause, self._hang_cause = self._hang_cause, None  # a hang restarted (--on-hang restart)
        if hang_cause is not None:
            failures = [hang_cause] + failures
        cause = failures[0] if failures else None
        ranks = self.state.snapshot().ranks
        host = (ranks[cause.rank].host or "") if cause is not None and cause.rank < len(ranks) else ""
        plan = elastic.next_world(self.options, self.backend, cause, self._fault, self.state.attempt, host)
        if plan.refusal:
            self._error = RankFailure(
                cause, failures[1:], [a.failure for a in self.state.attempts], reason=plan.refusal
            )
            self.state.finish("failed", cause, message=plan.refusal, fault=self._fault)
            return False
        if plan.num_processes != self.options.num_processes:
            self.options = self.options.replace(num_processes=plan.num_processes)
            self.plan = self.backend.check(self.options)
        self.state.restart(hang_cause, self._fault, num_processes=plan.num_processes, excluded=plan.excluded)
        return True

    def _attempt(self, deadline: Optional[float], checkpoints: str) -> bool:
        """Run the current attempt to its end; True when the job is to start again."""
        if self._cancel.is_set():
            first = self.state.attempt == 1
            self._error = RunCancelled(
                "the run was cancelled before it started" if first else "the run was cancelled; every rank was stopped"
            )
            self.state.finish("cancelled", message=str(self._error))
            return False
        if deadline is not None and time.monotonic() >= deadline:  # spent by the earlier attempts
            self._timed_out({})
            return False
        channel = None
        backend_run: Optional[BackendRun] = None
        # records of an attempt that ended (late exits, output) must not reach the next one
        emit = functools.partial(self.state.apply, attempt=self.state.attempt)
        routes: dict = {}  # records the backend takes for itself (see LaunchContext.routes)

        def deliver(record) -> None:
            routes.get(type(record), emit)(record)

        try:
            secret = launcher_secret = certificate = ""
            if self.backend.needs_channel:  # a warm pool has its channel already
                # secrets and a TLS key per attempt, which never leave this process
                opened = open_channel(
                    deliver,
                    self.run_id,
                    self.backend,
                    self.plan,
                    self.options.num_processes,
                    self.state.refused,
                    files=self._sent.served,
                )
                channel = self._channel = opened.server
                secret, launcher_secret, certificate = opened.secret, opened.launcher_secret, opened.certificate
                self.channel_address = opened.address
                self.channel_certificate = certificate
            data_files = ()
            if self.data is not None:  # a DataFrame split on this machine (a Spark one: none)
                data_files = self.data.write_rank_files(
                    f"torchdist-run-{self.run_id}-data-", self.options.num_processes
                )
            spec = RunSpec.resolve(
                self.options,
                self.run_id,
                self.channel_address or "",
                secret,
                launcher_secret,
                attempt=self.state.attempt - 1,
                checkpoint_dir=checkpoints,
                data_files=data_files,
                channel_cert=certificate,
            )
            spec = dataclasses.replace(
                spec, env={**self._debug_env, **spec.env}, host_relay=self.plan.host_relay, **self._sent.fetch
            )
            routes[DebugOutput] = self.debugger.on_output
            self._profile_routes = routes
            if self.options.profile:  # each attempt profiles its steps afresh
                self._collect_profile("")
            if channel is not None:
                self._to_rank = functools.partial(_to_worker, channel)
            if channel is not None:
                self.debugger.attach(functools.partial(_to_worker, channel))
            ctx = LaunchContext(
                self.plan,
                spec,
                self._job_bytes,
                emit,
                lambda record: channel.broadcast(record, role="launcher") if channel else 0,
                data=self.data,
                routes=routes,
                to_rank=lambda rank, record: bool(channel and channel.send(rank, record)),
                receive_values=channel.receive_values if channel is not None else lambda paths: None,
                refused=self.state.refused,
            )
            backend_run = self._backend_run = self.backend.start(ctx)
            return self._watch(backend_run, deadline)
        finally:
            self._backend_run = None
            if backend_run is not None:
                backend_run.close()
            if channel is not None:
                channel.close()

    def _watch(self, backend_run: BackendRun, deadline: Optional[float]) -> bool:
        """Supervise one attempt; True when it failed and restarts remain."""
        first_failure: Optional[float] = None
        hang = self.options.hang_timeout
        debug = self.debugger
        bystanders_stopped: set = set()
        observed: Optional[float] = None  # when a hang was last observed (--on-hang observe)
        said: List[str] = []  # and what its notice said of where the ranks were
        while True:
            self.state.exit_seen.clear()  # before looking: an exit from now on wakes the next wait
            failures = self.state.failures()
            if failures:
                debug.ranks_gone({f.rank for f in failures})
            held = debug.held_ranks()
            if held and not self._cancel.is_set():
                # a rank holds the failure's frames for the user (--pdb): the other ranks are
                # stopped as after any failure, the held one is not, nor timed out or declared
                # hung, until its session ends
                bystanders_stopped |= self._stop_bystanders(backend_run, held, bystanders_stopped)
                time.sleep(SUPERVISE_POLL)
                continue
            if failures and first_failure is None:
                first_failure = time.monotonic()
            if (
                failures
                and is_collateral(failures[0])
                and not self.state.all_exited()
                and time.monotonic() - first_failure < ROOT_CAUSE_WAIT
            ):
                failures = []  # a peer noticed a failure whose own report is still on its way
            if failures:
                verdict, stacks = None, {}
                if culprit.is_collective_timeout(failures[0]) or is_collateral(failures[0]):
                    # a peer's doing, perhaps: before they are stopped, where is every rank?
                    stacks = self._capture_stacks(backend_run)
                    verdict = self.state.verdict
                backend_run.stop(STOP_GRACE)
                failures = self.state.failures()  # the root cause may have arrived meanwhile
                if (
                    verdict
                    and failures[0].rank not in verdict.suspects
                    and (culprit.is_collective_timeout(failures[0]) or is_collateral(failures[0]))
                ):
                    failures = [hangs.suspect_failure(self.state, verdict, stacks, failures[0].time)] + failures
                self._fault = faults.classify(failures[0], preflight=self.state.preflight.get(failures[0].rank))
                reason = self._no_restart(failures[0])
                if reason is None:
                    return True
                self._error = RankFailure(
                    failures[0],
                    failures[1:],
                    [a.failure for a in self.state.attempts],
                    verdict=verdict or None,
                    reason=reason,
                )
                self.state.finish("failed", failures[0], message=reason, fault=self._fault)
                return False
            if self.state.all_exited_ok():
                self._value = self._collect(backend_run)
                self.state.finish("succeeded")
                return False
            if self._cancel.is_set():
                backend_run.stop(STOP_GRACE)
                self._error = RunCancelled("the run was cancelled; every rank was stopped")
                self.state.finish("cancelled", message=f"stopped by {self._cancelled_by}; every rank was stopped")
                return False
            if deadline is not None and time.monotonic() >= deadline and not debug.active():
                stacks = self._capture_stacks(backend_run)
                backend_run.stop(STOP_GRACE)
                self._timed_out(stacks)
                return False
            if hang is not None and min(self.state.idle(), debug.idle()) >= hang:
                if self.options.on_hang == "observe":
                    # asked again each hang_timeout of silence; said when where they are changed
                    if observed is None or time.monotonic() - observed >= hang:
                        observed = time.monotonic()
                        said = self._observe_hang(backend_run, hang, said)
                    time.sleep(SUPERVISE_POLL)
                    continue
                running = self.state.running()
                stacks = self._capture_stacks(backend_run)
                backend_run.stop(STOP_GRACE)
                reason = ""
                if self.options.on_hang == "restart":
                    cause = hangs.hang_failure(self.state, self.state.verdict, stacks, running, hang)
                    reason = self._no_restart(cause)
                    if reason is None:
                        self._hang_cause = cause
                        self._fault = faults.classify(None, hung=True)
                        return True
                hint = "; ".join(
                    filter(None, [hangs.hang_hint(self.options.ranks), reason and f"not restarted: {reason}"])
                )
                self._error = HangTimeout(
                    hang,
                    stacks,
                    self.options.num_processes,
                    hint=hint,
                    verdict=self.state.verdict or None,
                )
                self.state.finish("hung", message=self._error.headline, fault=faults.classify(None, hung=True))
                return False
            # nothing to do: until a rank exits or the run is cancelled (at once), or until the
            # clocks (deadline, hang timeout) or a debugger session may have moved
            self.state.exit_seen.wait(WATCH_INTERVAL)

    def _no_restart(self, failure: Failure) -> Optional[str]:
        """None when the attempt that ``failure`` ended starts again; else why not: ``""`` when no
        restart remains (or the run was cancelled), the sentence of ``restarts`` otherwise."""
        if self.state.attempt > self.options.max_restarts or self._cancel.is_set():
            return ""
        ending = restarts.Ending.of(
            self.state.attempt,
            failure,
            restarts.failing_step(self.state, failure.rank),
            self.state.last_checkpoint_step,
        )
        return self._restarts.decide(ending, self.options.max_restarts - self.state.attempt + 1)

    def _observe_hang(self, backend_run: BackendRun, seconds: float, said: List[str]) -> List[str]:
        """``--on-hang observe``: every rank's stacks and collective records (the view shows
        them), and, unless the notice would say what ``said`` said, in the culprit's log what they
        say and how to stop the run; the ranks go on.  What the notice said of them."""
        stacks = self._capture_stacks(backend_run)
        verdict = self.state.verdict
        lines = hangs.observed_notice(self.state, stacks, verdict, seconds, self.options.num_processes)
        if lines[:-1] == said:
            return said
        rank = verdict.suspects[0] if verdict and verdict.suspects else min(self.state.running() or [0])
        self.state.apply(Log(rank=rank, stream="stderr", line=lines[0], more=lines[1:]), attempt=self.state.attempt)
        return lines[:-1]

    def _stop_bystanders(self, backend_run: BackendRun, held: List[int], stopped: set) -> set:
        """Stop the running ranks that hold no post-mortem session (``held``: root cause first)
        and were not told to yet; each stopped rank's log says why.  The ranks reached."""
        reached = backend_run.stop_ranks(sorted(set(self.state.running()) - set(held) - stopped), STOP_GRACE)
        for rank in sorted(reached):
            self.state.apply(
                Log(
                    rank=rank,
                    stream="stderr",
                    line=(
                        f"[torchdist] rank {rank} was stopped: rank {held[0]}'s failure is held for the "
                        "debugger (--pdb)"
                    ),
                ),
                attempt=self.state.attempt,
            )
        return reached

    def _timed_out(self, stacks: Dict[int, Stacks]) -> None:
        self._error = JobTimeout(
            self.options.timeout,
            hangs.progress_summary(self.state),
            stacks,
            self.options.num_processes,
            verdict=self.state.verdict if stacks else None,
        )
        self.state.finish("timed out", message=self._error.headline)

    def _capture_stacks(self, backend_run: BackendRun) -> Dict[int, Stacks]:
        """Every running rank's stacks (all threads) and collective record, as far as they come
        within ``STACKS_COLLECT_WAIT``; the stacks are also the state's ``stacks``, and what the
        records say its ``verdict`` (the view shows both)."""
        with self._capturing:
            return self._capture(backend_run)

    def _capture(self, backend_run: BackendRun) -> Dict[int, Stacks]:
        collectives = (
            (lambda: self._channel.broadcast(DumpCollectives(rank=-1), role="worker"))
            if self._channel is not None
            else backend_run.dump_collectives
        )
        return hangs.capture(
            self.state, backend_run.dump_stacks, collectives, self.options.ranks or range(self.options.num_processes)
        )

    def _collect(self, backend_run: BackendRun) -> Any:
        """Rank 0's value; a list by rank with ``all_ranks``.  On some ranks of a warm pool
        (``ranks``): the lowest chosen rank's value; with ``all_ranks`` a dict by chosen rank."""
        chosen = self.options.ranks or range(self.options.num_processes)
        ranks = chosen if self.options.all_ranks else chosen[:1]
        blobs = {r: backend_run.result(r) for r in ranks}
        if self.value_as_bytes:
            return values.kept(blobs, self.options.all_ranks, by_rank=bool(self.options.ranks))
        decoded = {r: None if blob is None else values.loads(blob) for r, blob in blobs.items()}
        if not self.options.all_ranks:
            return decoded[ranks[0]]
        return decoded if self.options.ranks else list(decoded.values())


def _to_worker(channel: ChannelServer, rank: int, record) -> bool:
    return channel.send(rank, record, role="worker")
