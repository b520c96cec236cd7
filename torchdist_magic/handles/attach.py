"""A detached run seen from any kernel of its machine: ``attach(run_id)`` gives its handle,
``stop(run_id)`` stops it.

The handle (``AttachedRun``) has the ``Run`` API a notebook uses: ``state`` (what every view
reads), ``result(timeout)``, ``logs(rank)``, ``cancel()``, ``done()``, ``wait(timeout)``.  While
the supervising process runs, its ``state`` is a ``feed.HostedState``: each read a round trip to
that process, which holds the run's state, so the kernel gets what its view shows and never
every record.  Once that process has gone, the state is rebuilt from the run's journal
(``supervisor``; records decoded as ``events`` records, typed and validated; in the user's
private record directory), once, when something reads it.  The value is read from the same
directory when the run has ended.  A run supervised on another host (a home shared across
hosts) is followed by its record's files alone, as this host's processes say nothing of it,
and is stopped from its own host.

Detaching is the end of a handle, never of the run: an interrupted ``%torchdist attach`` (or a
kernel that dies) leaves the run going.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import weakref
from typing import Any, List, Optional

from ..core import events
from ..core.culprit import Verdict
from ..core.errors import HangTimeout, JobTimeout, NotAvailable, RankFailure, ResultTimeout, RunCancelled
from ..backends.spark import active_spark_session
from ..core.options import PROCESS_CHANNEL_RANKS, LaunchOptions
from ..core.job import build_job
from ..driver.handle import StateAnswers
from ..driver.history import RunRecord, clear_dead_run, process_alive, read_record, take_value
from ..driver.layout import (
    DONE_FILE,
    FULL_LOGS_DIR,
    JOURNAL_FILE,
    JOURNAL_FULL_FILE,
    NO_JOURNAL_FILE,
    READY_FILE,
    TOKEN_FILE,
)
from ..driver.state import RunState
from ..supervise.feed import peer_uid
from ..supervise.supervisor import START_WAIT, check_detachable, read_full_logs, start_detached
from .feed import HostedState

#: how often the handle looks whether the run has ended
FOLLOW_INTERVAL = 0.05
#: how long a replay of an ended run waits for the follower to read the run's end from its record
REPLAY_END_WAIT = 10.0
#: this process's handles by run id, while something holds them
_handles: "weakref.WeakValueDictionary[str, AttachedRun]" = weakref.WeakValueDictionary()
_handles_lock = threading.Lock()


class RunLost(RuntimeError):
    """A detached run's supervising process ended before the run did (it was killed): its ranks
    ended with it."""


def _detached_record(run_id: str) -> RunRecord:
    record = read_record(run_id)
    if not record.detached:
        raise ValueError(
            f"run {run_id} was not detached: it ran in the kernel (pid {record.pid}) that "
            "started it, which alone can show it; its record is in torchdist_magic.runs() "
            "(state, failure, each rank's log when it ended)"
        )
    return record


def supervised(options: LaunchOptions, data: Any = None) -> bool:
    """Whether a run with ``options`` runs under a supervising process of its own: detached
    (``detach``), ``channel="process"``, or ``channel="auto"`` from ``PROCESS_CHANNEL_RANKS``
    ranks where nothing keeps it in the kernel (a DataFrame, a warm pool, a rank's debugger, a
    ``restart_on`` function, a classic Spark session that only the notebook can use)."""
    if options.detach or options.channel == "process":
        return True
    if options.channel != "auto" or options.num_processes < PROCESS_CHANNEL_RANKS:
        return False
    if options.warm or options.pdb or data is not None or callable(options.restart_on):
        return False
    try:
        check_detachable(options, active_spark_session(), data)
    except ValueError:
        return False
    return True


def submit_detached(target: Any, args: tuple, kwargs: dict, options: LaunchOptions, data: Any = None) -> "AttachedRun":
    """Start ``target`` (a ``Job``, a function, a script path) as a detached run
    (``options.detach``) and return its handle once it started; what cannot be detached here
    raises ``ValueError`` before anything starts."""
    spark = check_detachable(options, active_spark_session(), data)
    job = build_job(target, tuple(args), dict(kwargs))
    run_id = ""
    try:
        run_id = start_detached(job, options, spark, journal=options.detach)
        handle = AttachedRun(run_id)
    except KeyboardInterrupt as interrupt:  # Ctrl-C before the handle was given: the run stops
        run_id = run_id or getattr(interrupt, "run_id", "")  # supervisor.StartInterrupted's
        if run_id:
            stop_started(run_id, by="Ctrl-C")
        raise KeyboardInterrupt from None
    if not options.detach:  # the kernel's own run: the ranks' complete logs are this handle's
        weakref.finalize(handle, shutil.rmtree, os.path.join(handle.directory, FULL_LOGS_DIR), True)
    with _handles_lock:
        _handles[handle.run_id] = handle
    return handle


def stop_started(run_id: str, by: str, wait: float = START_WAIT) -> None:
    """Stop run ``run_id``, whose start was interrupted before its handle was given: once its
    supervising process takes requests (``READY_FILE``), ask it to stop every rank, and wait for
    the run's end (``DONE_FILE``) or that process's, within ``wait`` seconds each."""
    record = read_record(run_id)
    deadline = time.monotonic() + wait
    while not os.path.exists(os.path.join(record.directory, READY_FILE)):
        if not process_alive(record.pid) or time.monotonic() > deadline:
            return  # it never started the run, or started nothing that answers
        time.sleep(0.01)
    if not stop(run_id, by=by):
        return
    deadline = time.monotonic() + wait
    while not os.path.exists(os.path.join(record.directory, DONE_FILE)) and process_alive(record.pid):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def attach(run_id: str) -> "AttachedRun":
    """The handle of detached run ``run_id`` (``KeyError`` when there is no such run,
    ``ValueError`` when it was not detached): this process's own while it holds one (it may
    have taken rank 0's value out of the run's record already), else a new one.

    Example:

    ```python
    from torchdist_magic import attach, runs

    run = attach(runs()[0].run_id)   # the newest run, started with --detach
    print(run.result())              # waits for rank 0's value
    ```
    """
    with _handles_lock:
        handle = _handles.get(run_id)
        if handle is None or handle.detached:
            handle = _handles[run_id] = AttachedRun(run_id)
        return handle


def stop(run_id: str, by: str = "stop()") -> bool:
    """Stop detached run ``run_id`` (every rank); True when its supervising process took the
    request, False when the run had ended already.  ``by`` says who stopped it.  The run's token
    goes only to a process of this user (``SO_PEERCRED``, as the feed checks): another user's
    socket at the record's control path gets nothing, and ``PermissionError`` says so.

    Example:

    ```python
    from torchdist_magic import runs, stop

    stop(runs()[0].run_id)   # True: its supervising process is stopping every rank
    ```
    """
    record = _detached_record(run_id)
    if record.state != "running":
        return False
    if record.elsewhere:
        raise ValueError(
            f"run {run_id} is supervised on host {record.host}, and its control socket is there: "
            f"stop it from a kernel or terminal on {record.host}"
        )
    with open(os.path.join(record.directory, TOKEN_FILE), encoding="utf-8") as fh:
        token = fh.read().strip()
    request = events.dumps(events.StopRun(rank=-1, token=token, by=by)) + "\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10.0)
        try:
            conn.connect(record.control)
        except (FileNotFoundError, ConnectionRefusedError):
            return False  # it ended meanwhile
        holder = peer_uid(conn)
        if holder != os.geteuid():
            raise PermissionError(
                f"run {run_id}'s control socket {record.control} is held by a process of uid {holder}, "
                f"not of this user (uid {os.geteuid()}): the run's token was not sent to it, and "
                "the run was not stopped"
            )
        conn.sendall(request.encode())
        answer = conn.recv(64)
    if answer != b"ok\n":
        raise PermissionError(
            f"the supervising process of run {run_id} refused the request to stop it "
            f"({answer.decode(errors='replace').strip() or 'no answer'})"
        )
    return True


def follow_attached(
    run: "AttachedRun", observer: Any = None, interval: float = 0.1, own: bool = False, make_observer: Any = None
) -> Any:
    """Wait for ``run`` here, calling ``observer.update()`` every ``interval`` seconds and
    ``observer.close()`` at the end; rank 0's value, or the run's error.  Ctrl-C (the kernel's
    interrupt) stops following, not the run: it says so and re-raises; with ``own`` (a run this
    cell started with its channel in a process of its own, ``--channel process``) it stops the
    run, as for a run in the kernel, and re-raises once the run has ended.  ``make_observer``
    (instead of ``observer``): made here, so that a Ctrl-C while it is made is one of these."""
    try:
        if make_observer is not None:
            observer = make_observer()
        while not run.wait(interval):
            if observer is not None:
                observer.update()
    except KeyboardInterrupt:
        if own:
            return _stop_followed(run, observer)
        run.detach()
        if observer is not None:
            observer.close()
        run.release()
        print(
            f"torchdist: stopped following run {run.run_id}, which goes on "
            f"(%torchdist attach {run.run_id} follows it again, %torchdist stop {run.run_id} stops it)"
        )
        raise
    if observer is not None:
        observer.close()
    run.release()
    for note in run.notes:
        print(f"torchdist: {note}")
    return run.result()


def _stop_followed(run: "AttachedRun", observer: Any) -> Any:
    """Ctrl-C in a cell that follows its own run: stop every rank, show the end, re-raise."""
    run.cancel(by="Ctrl-C")
    try:
        while not run.wait(0.1):
            if observer is not None:
                observer.update()
    finally:
        if observer is not None:
            observer.close()
        run.release()
    raise KeyboardInterrupt


def follow_in_thread(run: "AttachedRun", observer: Any, interval: float = 0.1) -> threading.Thread:
    """Update ``observer`` from a thread of its own until ``run`` ends (or is detached), then
    close it: a detached run's live view while the kernel stays free."""

    def loop() -> None:
        try:
            while not run.wait(interval) and not run.detached:
                observer.update()
        finally:
            observer.close()
            run.release()

    thread = threading.Thread(target=loop, name=f"torchdist-view-{run.run_id}", daemon=True)
    thread.start()
    return thread


class AttachedRun(StateAnswers):
    """A detached run's handle in this kernel (see the module's docstring): a ``RunHandle``, as
    ``Run`` is, with ``detach``, ``detached`` and ``release`` besides."""

    def __init__(self, run_id: str):
        self.record = _detached_record(run_id)
        self.run_id = run_id
        self.options = self.record.options
        self.directory = self.record.directory
        try:
            with open(os.path.join(self.directory, TOKEN_FILE), encoding="utf-8") as fh:
                token = fh.read().strip()
        except FileNotFoundError:  # a record without one: its journal alone tells its state
            token = ""
        control = self.record.control if token and not self.record.elsewhere else None
        self.state = HostedState(control, token, self.record.num_processes, self._replay)
        self._ending: Optional[tuple] = None  # (outcome, root cause, message) once it ended
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._value: Any = None
        self._value_read = False
        self._taking = threading.Lock()
        self._stopping = threading.Event()
        self.notes: List[str] = []  # what the journal could not hold, said once by the view
        self._thread = threading.Thread(target=self._follow, name=f"torchdist-attach-{run_id}", daemon=True)
        self._thread.start()

    # -- the Run API -----------------------------------------------------------------------
    def result(self, timeout: Optional[float] = None) -> Any:
        """Wait for the run; rank 0's value, or raise its error (``RankFailure``, ``RunCancelled``,
        ``JobTimeout``, ``HangTimeout``, ``RunLost``); ``ResultTimeout`` when ``timeout`` seconds
        pass first (the run goes on)."""
        if not self._done.wait(timeout):
            raise ResultTimeout(timeout)
        if self._error is not None:
            raise self._error
        with self._taking:
            if not self._value_read:  # taken out of the record: this handle keeps it
                self._value = take_value(self.directory, self.run_id)
                self._value_read = True
        return self._value

    @property
    def exception(self) -> Optional[BaseException]:
        """The run's error once it has ended (``Run.exception``): None while it runs, and when
        it succeeded."""
        return self._error if self._done.is_set() else None

    def cancel(self, by: str = "cancel()") -> None:
        """Stop the run (every rank), from this kernel."""
        stop(self.run_id, by=by)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def logs(self, rank: int = 0, attempt: Optional[int] = None) -> str:
        """Everything ``rank`` printed so far (stdout and stderr, in order): from the supervising
        process while it runs; afterwards from the run's journal, or for a run that kept none
        (``--channel process``) from the complete logs that process left (its record alone keeps
        each rank's newest lines)."""
        if self.state.hosted:
            text = self.state.logs(rank, attempt)
            if self.state.hosted:  # answered by the supervising process, not by the fallback
                return text
        full = read_full_logs(self.directory, rank, attempt)
        return full if full is not None else self.state.logs(rank, attempt)

    def detach(self) -> None:
        """Stop following the run here (the run goes on): the views that follow it stop; the
        handle still says when the run ends (``wait``, ``result``)."""
        self._stopping.set()

    def release(self) -> None:
        """Close this kernel's feed from the supervising process (a view took its last look);
        a later read opens it again while that process runs."""
        self.state.close()

    @property
    def detached(self) -> bool:
        """Whether this handle stopped following the run (``detach``)."""
        return self._stopping.is_set()

    @property
    def can_profile(self) -> bool:
        """False: only the supervising process reaches the ranks."""
        return False

    def culprit(self) -> Verdict:
        """The run's verdict as its supervising process last worked it out (at a hang or a
        timeout): a kernel attached to the run does not reach its ranks to ask them anew."""
        return self.last_verdict()

    def start_profile(self, steps: int) -> None:
        """Refused (``NotAvailable``): only the supervising process reaches the ranks (the
        view's Profile button)."""
        raise NotAvailable(
            f"run {self.run_id} is detached: its ranks can be profiled from the start only "
            "(--profile STEPS when it is started), not from a kernel attached to it"
        )

    def __repr__(self) -> str:
        state = self.record.state if self.done() else "running"
        return (
            f"<torchdist detached Run {self.run_id} {state} np={self.record.num_processes} "
            f"on {self.record.backend}: %torchdist attach {self.run_id} follows it, "
            f"%torchdist stop {self.run_id} stops it>"
        )

    # -- the run's end, and its state once its supervising process has gone -----------------
    def _replay(self) -> RunState:
        """The run's state rebuilt from its journal, as it ended when it has."""
        state = RunState(
            self.run_id,
            self.record.num_processes,
            self.record.backend or "local processes",
            bool(self.options.get("use_gpu")),
            self.record.job_name,
        )
        state.started = self.record.started
        if os.path.exists(os.path.join(self.directory, NO_JOURNAL_FILE)):
            self._from_record(state)
            return state
        pending = b""
        try:
            with open(os.path.join(self.directory, JOURNAL_FILE), "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    lines = (pending + chunk).split(b"\n")
                    pending = lines.pop()
                    for line in lines:
                        record = events.loads(line)
                        if isinstance(record, events.AttemptBegan):
                            state.restart()
                        else:
                            state.apply(record)
        except FileNotFoundError:
            pass
        if self._ending is None and os.path.exists(os.path.join(self.directory, DONE_FILE)):
            # the run has ended: the follower reads its end from the record at its next look
            self._done.wait(REPLAY_END_WAIT)
        if self._ending is not None:
            outcome, cause, message = self._ending
            state.finish(outcome, cause, message)
            state.ended = self.record.ended or state.ended  # when it ended, not when it was replayed
        return state

    def _from_record(self, state: RunState) -> None:
        """``state`` as the run's record kept it when the run ended (a run with no journal)."""
        self.record = read_record(self.run_id)
        _apply_record(state, self.record)

    def _follow(self) -> None:
        done = os.path.join(self.directory, DONE_FILE)
        try:
            while True:  # a look at two files: cheap enough to go on after ``detach``
                if os.path.exists(done):
                    return self._finish()
                if not self.record.elsewhere and not process_alive(self.record.pid):
                    if os.path.exists(done):  # it ended between the two looks
                        return self._finish()
                    return self._lost()
                time.sleep(FOLLOW_INTERVAL)
        except BaseException as exc:  # reported through result(), never lost in this thread  # noqa: BLE001
            self._error = exc
            self._ending = ("failed", None, f"could not follow the run: {exc}")
            self._done.set()

    def _finish(self) -> None:
        if os.path.exists(os.path.join(self.directory, JOURNAL_FULL_FILE)):
            self.notes.append(
                "the run's journal was full: this view lacks its later records; the record "
                "has its end and the tails of its logs"
            )
        record = self.record = read_record(self.run_id)
        outcome = record.outcome or record.state
        self._ending = (outcome, record.root_cause, record.failure)
        if outcome == "failed" and record.root_cause is not None:
            self._error = RankFailure(record.root_cause)
        elif outcome == "cancelled":
            self._error = RunCancelled(record.failure or "the run was cancelled; every rank was stopped")
        elif outcome == "timed out":
            self._error = JobTimeout(record.options.get("timeout") or 0.0, record.failure)
        elif outcome == "hung":
            self._error = HangTimeout(record.options.get("hang_timeout") or 0.0, {}, record.num_processes)
        elif outcome != "succeeded" or not record.has_value:
            self._error = RuntimeError(record.failure or f"the run ended {outcome}")
        self._done.set()

    def _lost(self) -> None:
        message = (
            f"the supervising process of detached run {self.run_id} (pid {self.record.pid}) ended "
            "before the run did: it was killed, and the run's ranks ended with it"
        )
        self._error = RunLost(message)
        self._ending = ("failed", None, message)
        clear_dead_run(self.record)  # its control socket: nobody else removes it
        self._done.set()


def _apply_lines(state: RunState, rank: int, lines: List[str]) -> None:
    """``lines`` (none of them redrawn) as ``rank``'s output, in one record."""
    if lines:
        state.apply(events.Log(rank=rank, line=lines[0], more=lines[1:]))


def recorded_state(record: RunRecord) -> RunState:
    """The state of run ``record`` (detached or not) as its record kept it: its end, root cause,
    each rank's last lines and its metric histories; while the run goes on, only what the record
    says so far (a run in another kernel shows itself there)."""
    state = RunState(
        record.run_id, record.num_processes, record.backend, bool(record.options.get("use_gpu")), record.job_name
    )
    state.started = record.started
    if record.state == "running":  # in the process that started it, which alone knows more
        state.state = "running"
        return state
    cause = record.root_cause
    for rank in range(record.num_processes):  # how each rank ended, as far as the record says
        if record.state == "succeeded":
            state.apply(events.Exit(rank=rank, code=0, time=record.ended or 0.0))
        elif cause is not None and rank == cause.rank:
            code = 1 if cause.exit_code is None else cause.exit_code
            state.apply(events.Exit(rank=rank, code=code, time=cause.time, host=cause.host, failure=cause))
    _apply_record(state, record)
    state.ended = record.ended or state.ended
    return state


def _apply_record(state: RunState, record: RunRecord) -> None:
    """``state`` as ``record`` kept the run when it ended: each rank's last lines, its metric
    histories, its end."""
    for rank in range(state.num_processes):
        plain: List[str] = []  # lines in a row that end with a newline: one record for them all
        for line in record.log(rank).splitlines(keepends=True):
            if line.endswith("\r"):
                _apply_lines(state, rank, plain)
                plain = []
                state.apply(events.Log(rank=rank, line=line[:-1], cr=True))
            else:
                plain.append(line.rstrip("\r\n"))
        _apply_lines(state, rank, plain)
    for name, by_rank in record.metrics().get("metrics", {}).items():
        for rank, points in by_rank.items():  # one record a metric and rank: every point as a column
            steps = [step for step, _ in points]
            state.apply(
                events.Metrics(
                    rank=int(rank),
                    names=[name],
                    steps=steps,
                    times=[0.0] * len(steps),
                    values=[[v for _, v in points]],
                )
            )
    outcome = record.outcome or record.state
    state.finish(outcome, record.root_cause, record.failure)
