"""The history of runs: one bounded record per run (detached or not) under a private per-user
directory, which ``torchdist_magic.runs()`` and ``%torchdist runs`` list.

Where.  ``TORCHDIST_HOME`` (default ``~/.torchdist``), mode 0700 and checked as ``privdir``
checks any directory a run keeps files in; each run is ``runs/<run_id>/`` in it:

- ``record.json``: the options, what ran (a cell's source, a function's or script's name), the
  state, the times, the root cause of a failure, the pid of the process that supervises the run
  (the notebook's kernel, or for a detached run a supervising process of its own);
- ``logs/rank-<r>.log``: each rank's output when the run ended (the newest ``LOG_KEEP_LINES``
  lines, at most ``LOG_KEEP_CHARS``, and for many ranks their share of ``RUN_LOG_KEEP_CHARS``);
- ``metrics.json``: every rank's metric history (at most ``METRIC_KEEP_POINTS`` points a metric
  and rank) and system history, when the run ended;
- for a detached run also its journal, its value and its control socket's token (``supervisor``).

Rank 0's value.  A detached run's record keeps it until a kernel takes it (``take_value``: the
first ``attach(run_id).result()``; the kernel that took it keeps it in that handle) or it
expires, ``TORCHDIST_VALUE_DAYS`` (default 7) after the run ended; a record then says which, and
when, to whoever asks for the value again (``ValueGone``).

Bounds.  When a run starts, the records of finished runs beyond the newest
``TORCHDIST_HISTORY_RUNS`` (default 100) or older than ``TORCHDIST_HISTORY_DAYS`` (default 30)
are removed; a record whose run is still going is never removed.

A record that says ``running`` while its supervising process is gone (a kernel that died with a
run that was not detached) reads as ``failed``, saying so; whoever reads it so removes what a
dead supervising process left (``clear_dead_run``).  That is judged on the record's own host
only: a record of another host (a home shared across hosts) stays as it says, shown as ``on
host X, unknown from here``, and is never pruned from here while it says ``running``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..core import values
from ..core.events import Failure, failure_from_json, failure_to_json
from ..core.options import masked_env
from ..core.procs import process_exited
from .layout import RECORD_FILE, TOKEN_FILE, VALUE_EXPIRED_FILE, VALUE_FILE, VALUE_TAKEN_FILE
from ..core.privdir import (
    UnsafePath,
    check_ancestors,
    check_private,
    open_private,
    private_directory,
    read_own,
    remove_fallback,
)
from ..core.version import __version__

HOME_ENV = "TORCHDIST_HOME"
RUNS_ENV = "TORCHDIST_HISTORY_RUNS"
DAYS_ENV = "TORCHDIST_HISTORY_DAYS"
VALUE_DAYS_ENV = "TORCHDIST_VALUE_DAYS"
DEFAULT_RUNS = 100
DEFAULT_DAYS = 30.0
DEFAULT_VALUE_DAYS = 7.0
#: a rank's output a record keeps (its newest lines, and of those the newest characters), and a
#: run's, all ranks together: each rank keeps its share, at least ``MIN_LOG_KEEP_CHARS``
LOG_KEEP_LINES = 20_000
LOG_KEEP_CHARS = 1024 * 1024
RUN_LOG_KEEP_CHARS = 64 * 1024 * 1024
MIN_LOG_KEEP_CHARS = 16 * 1024
#: points of one metric of one rank a record keeps (downsampled from the run's history)
METRIC_KEEP_POINTS = 500
#: the states a record reports; a run's other ends (timed out, hung) are ``failed`` with why
STATES = ("running", "succeeded", "failed", "cancelled")


def home() -> str:
    """This user's torchdist directory (``TORCHDIST_HOME``, default ``~/.torchdist``), made
    private (0700) where missing; ``UnsafePath`` when it is not this user's own, or when a
    directory above it is not safe from other users (``privdir.check_ancestors``: else the home
    could be swapped for theirs after this check)."""
    path = os.environ.get(HOME_ENV) or os.path.join(os.path.expanduser("~"), ".torchdist")
    try:
        checked = check_ancestors(os.path.abspath(path))
    except UnsafePath as exc:
        raise UnsafePath(f"{exc}. {HOME_ENV} says where the history of runs is kept") from None
    return private_directory(checked)


def runs_directory() -> str:
    """Where the records are (``home()/runs``), made private where missing."""
    return private_directory(os.path.join(home(), "runs"))


def record_directory(run_id: str) -> str:
    """The private directory of run ``run_id``'s record, made where missing."""
    if not run_id or os.sep in run_id or run_id in (".", ".."):
        raise ValueError(f"not a run id: {run_id!r}")
    return private_directory(os.path.join(runs_directory(), run_id))


def _limit(name: str, default: float, kind: type) -> float:
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = -1
    if value <= 0:
        raise ValueError(f"{name} must be a positive {'whole ' if kind is int else ''}number, got {text!r}")
    return value


def bounds() -> tuple:
    """``(runs, days)``: how many finished records are kept, and for how long."""
    return _limit(RUNS_ENV, DEFAULT_RUNS, int), _limit(DAYS_ENV, DEFAULT_DAYS, float)


@dataclass
class RunRecord:
    """What the history knows of one run.  ``state`` is one of ``STATES``; ``failure`` says why
    a run failed or was cancelled (the root cause's summary), ``root_cause`` is that rank's
    ``Failure`` when a rank failed; ``started``/``ended`` are ``time.time()`` seconds."""

    run_id: str
    state: str = "running"
    started: float = 0.0
    ended: Optional[float] = None
    failure: str = ""
    root_cause: Optional[Failure] = None
    #: the run's own end: ``succeeded``, ``failed``, ``cancelled``, ``timed out`` or ``hung``
    outcome: str = ""
    job_name: str = ""
    source: str = ""
    options: Dict[str, Any] = field(default_factory=dict)
    backend: str = ""
    num_processes: int = 1
    detached: bool = False
    #: the process that supervises the run, and where it runs
    pid: int = 0
    host: str = ""
    #: a detached run's control socket (``supervisor``), and whether its value is kept
    control: str = ""
    has_value: bool = False
    #: the release of torchdist_magic that ran it (a record written before releases were recorded: "")
    version: str = __version__
    directory: str = ""
    #: the class of the root cause (``faults.Fault``: "machine: an NCCL error"), "" for none
    fault: str = ""
    #: the hosts (executors) its restarts left out, and why (``faults.Exclusion.sentence``)
    excluded: List[str] = field(default_factory=list)
    #: each attempt's number of ranks, the first attempt's first (``--np MIN:MAX``)
    world_sizes: List[int] = field(default_factory=list)

    @property
    def path(self) -> str:
        return os.path.join(self.directory, RECORD_FILE)

    @property
    def elsewhere(self) -> bool:
        """Whether the process that supervises the run is on another host than this one (a home
        shared across hosts): this host's processes say nothing of it."""
        return bool(self.host) and self.host != os.uname().nodename

    def log(self, rank: int) -> str:
        """Rank ``rank``'s output as kept when the run ended ("" while it runs, or without one)."""
        try:
            with open(os.path.join(self.directory, "logs", f"rank-{rank}.log"), encoding="utf-8") as fh:
                return fh.read()
        except FileNotFoundError:
            return ""

    def metrics(self) -> Dict[str, Any]:
        """The metric and system histories kept when the run ended (``{}`` before)."""
        try:
            with open(os.path.join(self.directory, "metrics.json"), encoding="utf-8") as fh:
                return json.load(fh)
        except FileNotFoundError:
            return {}

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["root_cause"] = failure_to_json(self.root_cause) if self.root_cause is not None else None
        del data["directory"]
        return data

    @classmethod
    def from_json(cls, data: dict, directory: str) -> "RunRecord":
        names = {f.name for f in dataclasses.fields(cls)} - {"directory"}
        known = {k: v for k, v in data.items() if k in names}
        known.setdefault("version", "")
        if known.get("root_cause") is not None:
            known["root_cause"] = failure_from_json(known["root_cause"])
        return cls(directory=directory, **known)

    def save(self) -> None:
        """Write the record (atomically: a reader sees the old one or this one)."""
        write_private(self.path, json.dumps(self.to_json(), indent=1, allow_nan=False, default=str))

    def row(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        took = f"{(self.ended or time.time()) - self.started:8.1f}s"
        what = "detached" if self.detached else ""
        state, why = self.state, self.failure
        if state == "running" and self.elsewhere:
            state, why = "unknown", f"on host {self.host}, unknown from here"
        return (
            f"{self.run_id:<22} {state:<10} {started}  {took}  np={self.num_processes:<4} "
            f"{self.backend:<24.24} {what:<8} {self.job_name:<18.18} {why:.60}"
        ).rstrip()

    def __repr__(self) -> str:
        return f"<torchdist RunRecord {self.run_id} {self.state}{' (detached)' if self.detached else ''}>"


HEADER = f"{'run id':<22} {'state':<10} {'started':<19}  {'took':>9}  {'np':<7} {'backend':<24} {'':<8} {'job':<18} why"


def write_private(path: str, text: str) -> None:
    """``text`` into ``path`` (0600, never through a link), replacing it atomically."""
    temporary = f"{path}.{os.getpid()}.tmp"
    fd = open_private(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(temporary, path)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process of this user's: not exited (a zombie has,
    ``procs.process_exited``), and not a pid another user's process has taken since (ours is
    gone then)."""
    if pid <= 0 or process_exited(pid):
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone since, or another user's
        return False
    return True


def read_record(run_id: str) -> RunRecord:
    """Run ``run_id``'s record; ``KeyError`` naming what is there when there is none."""
    directory = os.path.join(runs_directory(), run_id)
    record = _read(directory) if run_id and os.sep not in run_id else None
    if record is None:
        known = [r.run_id for r in runs()[:5]]
        raise KeyError(
            f"no run {run_id!r} in {runs_directory()}"
            + (f"; the newest are {', '.join(known)}" if known else "; no run was recorded yet")
        )
    return record


def _read(directory: str) -> Optional[RunRecord]:
    try:
        check_private(directory)
        with open(os.path.join(directory, RECORD_FILE), encoding="utf-8") as fh:
            record = RunRecord.from_json(json.load(fh), directory)
    except (OSError, ValueError, TypeError):
        return None  # a record being made, or not one of ours
    if record.elsewhere:  # its pid is another host's: nothing here says whether it runs
        return record
    if record.state == "running" and not process_alive(record.pid):
        record.state = "failed"
        who = "its supervising process" if record.detached else "the kernel (or process) that ran it"
        record.failure = record.failure or f"{who} (pid {record.pid}) ended before the run did"
    clear_dead_run(record)
    return record


def clear_dead_run(record: RunRecord) -> None:
    """Once the supervising process of ``record``'s detached run (on this host) has gone, what it
    kept for the run's life only: its control socket (``record.control``, in a private directory
    of the temporary directory) and the socket's token.  A process killed with SIGKILL removes
    nothing itself, so whoever finds it dead does (``runs()``, ``read_record``, the next
    ``prune``, the run's handle).  A socket is removed only where it is one of this user's,
    named for the run, in a private directory of this user's; with it the fallback directory it was
    in, where one was made in place of a refused one (``privdir.remove_fallback``)."""
    token = os.path.join(record.directory, TOKEN_FILE)
    control = record.control
    if not record.detached or record.elsewhere:
        return
    if not (os.path.lexists(token) or (control and os.path.lexists(control))) or process_alive(record.pid):
        return
    if control and os.path.basename(control) == f"ctl-{record.run_id}.sock":
        try:
            check_private(os.path.dirname(control))
            info = os.lstat(control)
            if stat.S_ISSOCK(info.st_mode) and info.st_uid == os.geteuid():
                os.unlink(control)
            remove_fallback(os.path.dirname(control))  # a private directory made in place of a refused one
        except (FileNotFoundError, UnsafePath):
            pass
    try:
        os.unlink(token)
    except FileNotFoundError:
        pass


def runs() -> List[RunRecord]:
    """Every recorded run of this user, the newest first.

    Example:

    ```python
    from torchdist_magic import runs

    for record in runs()[:5]:
        print(record.run_id, record.state, record.outcome, record.failure)
    ```
    """
    base = runs_directory()
    found = [_read(os.path.join(base, name)) for name in os.listdir(base)]
    return sorted((r for r in found if r is not None), key=lambda r: r.started, reverse=True)


def runs_table(records: Optional[List[RunRecord]] = None) -> str:
    """The records as a table (``%torchdist runs``)."""
    records = runs() if records is None else records
    if not records:
        return f"no run recorded in {runs_directory()}"
    return "\n".join([HEADER] + [r.row() for r in records])


def prune(now: Optional[float] = None) -> List[str]:
    """Remove the finished records beyond ``bounds()``, and the values older than
    ``TORCHDIST_VALUE_DAYS`` from the others; the ids of the records removed."""
    keep, days = bounds()
    value_days = _limit(VALUE_DAYS_ENV, DEFAULT_VALUE_DAYS, float)
    now = time.time() if now is None else now
    removed = []
    finished = [r for r in runs() if r.state != "running"]
    for index, record in enumerate(finished):
        age = now - (record.ended or record.started)
        if index >= keep or age > days * 86400:
            shutil.rmtree(record.directory, ignore_errors=True)
            removed.append(record.run_id)
        elif age > value_days * 86400 and os.path.exists(os.path.join(record.directory, VALUE_FILE)):
            _mark_value_gone(record.directory, VALUE_EXPIRED_FILE, now)
            try:
                os.unlink(os.path.join(record.directory, VALUE_FILE))
            except FileNotFoundError:  # taken meanwhile
                os.unlink(os.path.join(record.directory, VALUE_EXPIRED_FILE))
    return removed


class ValueGone(RuntimeError):
    """Rank 0's value of a detached run is no longer in its record: taken by a kernel, or expired."""


def take_value(directory: str, run_id: str) -> Any:
    """Rank 0's value of the detached run recorded in ``directory``, taken out of the record:
    the first caller gets it, every later one ``ValueGone`` saying when it was taken (or that it
    expired).  A value that cannot be read stays for the next caller."""
    path = os.path.join(directory, VALUE_FILE)
    taking = f"{path}.taking-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(path, taking)  # atomic: of two kernels taking it at once, one gets it
    except FileNotFoundError:
        raise ValueGone(value_gone(directory, run_id)) from None
    try:  # checked on the open file: a file another user put in its place is never unpickled
        value = values.loads_kept(read_own(taking))
    except BaseException:
        os.rename(taking, path)
        raise
    _mark_value_gone(directory, VALUE_TAKEN_FILE, time.time())
    os.unlink(taking)
    return value


def _mark_value_gone(directory: str, marker: str, when: float) -> None:
    write_private(os.path.join(directory, marker), json.dumps({"time": when, "pid": os.getpid()}))


def value_gone(directory: str, run_id: str) -> str:
    """Why the record in ``directory`` holds no value of rank 0."""
    for marker, how in (
        (
            VALUE_TAKEN_FILE,
            "was taken by process {pid} at {when} (a record keeps it until a "
            "kernel takes it; that kernel's handle has it)",
        ),
        (VALUE_EXPIRED_FILE, f"expired at {{when}}, {VALUE_DAYS_ENV} after the run ended"),
    ):
        try:
            with open(os.path.join(directory, marker), encoding="utf-8") as fh:
                said = json.load(fh)
        except (OSError, ValueError):
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(said.get("time", 0)))
        return f"rank 0's value of run {run_id} " + how.format(pid=said.get("pid", "?"), when=when)
    return f"run {run_id}'s record holds no value of rank 0"


def job_source(job: Any) -> str:
    """What a record says ran: a cell's source, a script's path, a function's name."""
    if getattr(job, "cell", None) is not None:
        return job.cell.source
    if getattr(job, "script_path", ""):
        return " ".join([job.script_path] + list(job.script_args))
    return job.name


def options_json(options: Any) -> Dict[str, Any]:
    """``LaunchOptions`` as JSON values (``ranks`` a list), as a record keeps them: ``env``'s
    names only, each value ``***`` (``core.options.masked_env``: a value may be a secret)."""
    data = dataclasses.asdict(options)
    if data.get("ranks") is not None:
        data["ranks"] = list(data["ranks"])
    data["env"] = masked_env(data.get("env") or {})
    if callable(data.get("restart_on")):  # a policy function: its name (it stays in the kernel)
        data["restart_on"] = getattr(options.restart_on, "__name__", "a function")
    return data


def outcome_of(state: str) -> str:
    """A run's end as a record's ``state``: ``timed out`` and ``hung`` are failures."""
    return state if state in STATES else "failed"


class RecordKeeper:
    """The record of one run, kept by the process that supervises it: ``begin`` when it starts,
    ``end`` when it has ended.  Writing a record never fails a run: what could not be written is
    said once, as a warning."""

    def __init__(self, run: Any):
        self.run = run
        self.record: Optional[RunRecord] = None
        self._warned = False

    def begin(self) -> None:
        run = self.run
        try:
            prune()
            directory = record_directory(run.run_id)
            self.record = RunRecord(
                run_id=run.run_id,
                state="running",
                started=run.state.started,
                job_name=run.job.name,
                source=job_source(run.job),
                options=options_json(run.options),
                backend=run.state.backend,
                num_processes=run.options.num_processes,
                pid=os.getpid(),
                host=os.uname().nodename,
                directory=directory,
            )
            existing = _read(directory)
            if existing is not None:  # a detached run's record, made by the kernel that started it
                self.record.detached, self.record.control = existing.detached, existing.control
            self.record.save()
        except (OSError, ValueError) as exc:
            self._warn(exc)

    def end(self, has_value: bool = False) -> None:
        """Write the run's end: state, failure, each rank's logs, the metric histories."""
        if self.record is None:
            return
        state = self.run.state
        record = self.record
        try:
            snapshot = state.snapshot()
            record.outcome = snapshot.state
            record.state = outcome_of(snapshot.state)
            record.ended = snapshot.ended or time.time()
            record.root_cause = snapshot.failure
            record.fault = f"{snapshot.fault.kind}: {snapshot.fault.why}" if snapshot.fault else ""
            record.excluded = [e.sentence() for e in snapshot.excluded]
            record.world_sizes = [a.world_size for a in snapshot.attempts] + [snapshot.num_processes]
            record.failure = (
                snapshot.failure.summary()
                if snapshot.failure is not None
                else (snapshot.message if record.state != "succeeded" else "")
            )
            record.has_value = has_value
            self._write_logs(state)
            self._write_metrics(state)
            record.save()
        except (OSError, ValueError) as exc:
            self._warn(exc)

    def _write_logs(self, state: Any) -> None:
        logs = os.path.join(self.record.directory, "logs")
        os.makedirs(logs, mode=0o700, exist_ok=True)
        keep = min(LOG_KEEP_CHARS, max(MIN_LOG_KEEP_CHARS, RUN_LOG_KEEP_CHARS // max(state.num_processes, 1)))
        for rank in range(state.num_processes):
            read = state.read_log(rank, limit=LOG_KEEP_LINES, newest=True)
            text = "".join(line.text + ("\r" if line.cr else "\n") for line in read.lines)
            if read.start:
                text = f"[torchdist] the record keeps the last {len(read.lines)} lines of this log\n" + text
            if len(text) > keep:
                text = f"[torchdist] the record keeps the last {keep} characters of this log\n" + text[-keep:]
            write_private(os.path.join(logs, f"rank-{rank}.log"), text)

    def _write_metrics(self, state: Any) -> None:
        history = state.metric_history(points=METRIC_KEEP_POINTS)
        system = {rank: state.system_history(rank, points=METRIC_KEEP_POINTS) for rank in range(state.num_processes)}
        write_private(
            os.path.join(self.record.directory, "metrics.json"),
            json.dumps({"metrics": history, "system": system}, default=str),
        )

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"run {self.run.run_id} could not be recorded in the history of runs "
                f"({type(exc).__name__}: {exc}); the run itself goes on",
                RuntimeWarning,
                stacklevel=2,
            )
