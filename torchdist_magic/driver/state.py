"""RunState: everything known about one run, built from ``events`` records; the one model
that every view (text, widget, panel) reads.

``apply`` takes the records a rank or its launcher sends (``Started``, ``Log``, ``Progress``,
``Metrics``, ``StepSplit``, ``Dropped``, ``Exit``, ``Stacks``, ``Collectives``, ``Preflight``), each through the handler ``HANDLERS`` names for
its type.  A run that restarts (``max_restarts``) has attempts: ``restart`` records how the
current one ended and starts the next with fresh rank states; records of an earlier attempt
that arrive late are ignored.

Logs.  Each rank's lines are a ``LogStore`` (``logstore``), spilling to the run's directory
(``rundir``).  What readers get is ``snapshot``'s; which failure is the root cause,
``rootcause``'s.

Readers.  ``RunState`` alone takes its lock: a view reads copies through its methods (those of
``reading``, a base of it: ``snapshot`` of the run and every rank, with the ranks changed since
a ``version``; ``read_log`` / ``recent_log``; ``metric_history``), and the supervisor collects
stacks with ``begin_stacks`` and ``wait_stacks``, collective records with ``begin_collectives``
and ``wait_collectives``, and keeps what they say with ``set_verdict``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from ..core import events
from ..core.culprit import Verdict
from ..core.failure import Failure
from ..core.faults import Exclusion, Fault
from .goodput import AttemptTimes, goodput
from .logstore import LogLine, LogRead, LogStore, SpillFile, memory_share
from .reading import MetricCursor, rank_snapshot, thinned
from .rootcause import root_cause_first
from .rundir import RunDirectory
from .series import MetricSeries, SeriesRead
from .snapshot import SYSTEM_HISTORY_KEYS, Attempt, Refusal, RunSnapshot, ShownBars
from .stragglers import Pace, Straggler
from .summary import LargeView, large_view

#: a rank's history of one metric keeps at most this many points (past that, every other one)
MAX_POINTS = 10_000
#: ... and a run's, all ranks together, about this many per metric: each rank gets its share
#: (at least ``MIN_POINTS``), so the driver's memory is bounded per run, not only per rank
RUN_POINTS = 400_000
MIN_POINTS = 256
#: a rank's history of system metrics keeps at most this many samples (past that, every other
#: one), and a run's, all ranks together, about ``RUN_SYSTEM_POINTS`` (at least
#: ``MIN_SYSTEM_POINTS`` each): an hour at one sample every 2 s, for a few ranks
MAX_SYSTEM_POINTS = 2048
RUN_SYSTEM_POINTS = 200_000
MIN_SYSTEM_POINTS = 64
#: distinct metric names a run keeps, all ranks together (a name per step would grow the driver
#: without bound); a newer name is not kept, and the rank's log says so once
MAX_METRIC_NAMES = 1024
#: progress bars one rank may have open at once; a newer one is not shown (said once)
MAX_BARS = 256
#: characters of output a run keeps (in memory and spilled to its directory), all ranks together;
#: each rank may keep its share, and at least ``MIN_RANK_LOG_CHARS``: past it, its newer lines
#: are counted (``RankState.log_dropped``), not kept, and its log says so once
MAX_RUN_LOG_CHARS = 16 * 1024**3
MIN_RANK_LOG_CHARS = 64 * 1024**2
#: the file in ``spill_dir`` that every rank's older lines spill to
SPILL_FILE = "logs.spill"
#: the steps a metric's history keeps (``MetricSeries``: 64-bit integers)
_STEP_MIN, _STEP_MAX = -(2**63), 2**63 - 1


@dataclass
class RankState(ShownBars):
    rank: int
    host: str = ""
    pid: Optional[int] = None
    state: str = "starting"
    exit_code: Optional[int] = None
    started: Optional[float] = None
    ended: Optional[float] = None
    progress: Dict[str, dict] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)
    #: its points of each metric (a column of steps, one of values: ``MetricSeries``)
    history: Dict[str, MetricSeries] = field(default_factory=dict)
    logs: LogStore = None  # every attempt's lines (one store per rank, kept across attempts)
    dropped: int = 0
    #: characters of output kept, and lines not kept past the rank's share of ``MAX_RUN_LOG_CHARS``
    log_chars: int = 0
    log_dropped: int = 0
    failure: Optional[Failure] = None
    #: the latest system sample (``sysmetrics``; ``time``: when it was taken), ``{}`` before any
    system: Dict[str, float] = field(default_factory=dict)
    #: seconds per step of its innermost running progress bar, smoothed (None: no such bar)
    step_time: Optional[float] = None
    #: the samples of ``system`` so far: ``(time, *SYSTEM_HISTORY_KEYS)``, None where a sample lacked it
    system_samples: List[Tuple[Optional[float], ...]] = field(default_factory=list)
    #: the shares of its recent steps (``stepsplit``): ``{"data": f, "compute": f, "comm": f}``,
    #: None before its first ``progress()`` loop had run a while
    step_split: Optional[Dict[str, float]] = None
    #: its seconds of steps, of data waits and of collective waits since the job began
    #: (``{"step_s", "data_s", "comm_s"}``), ``{}`` before any
    step_totals: Dict[str, float] = field(default_factory=dict)


class RunState:
    """Thread-safe: channel threads, log readers and the supervisor all ``apply`` events.  It
    is the only owner of its lock: readers in other threads take what they need through its
    methods, which return copies (``snapshot``, ``read_log``, ``recent_log``,
    ``metric_history``, ``failures``, ``logs``); every change bumps ``version``.

    ``spill_dir`` gives the directory where logs spill (made when first needed), every rank's
    to one file (``SPILL_FILE``); by default a directory of this state's own, removed with it.
    ``max_attempts``: 1 plus the run's ``max_restarts``.  ``clock`` (monotonic seconds) times
    the ranks' pace (``stragglers``).
    """

    def __init__(
        self,
        run_id: str,
        num_processes: int,
        backend: str = "",
        use_gpu: bool = False,
        job_name: str = "",
        *,
        max_attempts: int = 1,
        spill_dir: Optional[Callable[[], str]] = None,
        clock: Callable[[], float] = time.monotonic,
        idle: Iterable[int] = (),
    ):
        self.run_id = run_id
        self.num_processes = num_processes
        self.backend = backend
        self.use_gpu = use_gpu
        self.job_name = job_name
        self.state = "starting"
        self.started = time.time()
        self.ended: Optional[float] = None
        self.failure: Optional[Failure] = None
        self.message = ""
        self.attempt = 1
        self.max_attempts = max_attempts
        self.attempt_started = self.started
        self.attempts: List[Attempt] = []  # the attempts before the current one
        #: every rank's stacks, when a hang or a timeout asked for them (the current attempt's)
        self.stacks: Dict[int, events.Stacks] = {}
        #: each rank's latest collective record (``collectives``) of the current attempt
        self.collectives: Dict[int, events.Collectives] = {}
        #: what they said when they were compared (``set_verdict``), else None
        self.verdict: Optional[Verdict] = None
        self._fresh_collectives: set = set()  # ranks whose record came since ``begin_collectives``
        #: each rank's pre-flight report (``--preflight``) of the current attempt
        self.preflight: Dict[int, events.Preflight] = {}
        #: ``time.monotonic()`` of the newest sign of life (output, progress, metrics) of any rank
        self.last_activity = time.monotonic()
        if spill_dir is None:
            own = RunDirectory(f"torchdist-logs-{run_id}-")
            spill_dir = own.path
        share = max(num_processes, 1)
        #: characters of output each rank may keep (its share of ``MAX_RUN_LOG_CHARS``)
        self.max_rank_log_chars = max(MIN_RANK_LOG_CHARS, MAX_RUN_LOG_CHARS // share)
        lines, chars = memory_share(num_processes)
        spill = SpillFile(spill_dir, SPILL_FILE)  # one file for every rank's log
        self._logs = [
            LogStore(spill_dir, f"rank-{r}", max_lines=lines, max_chars=chars, spill=spill)
            for r in range(num_processes)
        ]
        #: points of one metric a rank's history keeps
        self.max_points = min(MAX_POINTS, max(MIN_POINTS, RUN_POINTS // share))
        #: system samples a rank's history keeps
        self.max_system_points = min(MAX_SYSTEM_POINTS, max(MIN_SYSTEM_POINTS, RUN_SYSTEM_POINTS // share))
        self._attempt_lines: List[List[int]] = [[0] for _ in range(num_processes)]
        #: ranks a warm run on some of its pool's ranks leaves out (``LaunchOptions.ranks``): they
        #: stay ``idle`` for the whole run and count as finished
        self.idle_ranks = frozenset(idle)
        self.ranks = [
            RankState(rank=r, logs=self._logs[r], state="idle" if r in self.idle_ranks else "starting")
            for r in range(num_processes)
        ]
        self.version = 0
        self._lock = threading.RLock()
        self._rank_versions = [0] * num_processes  # the version of each rank's latest change
        #: the ranks of the last ``snapshot`` and the version it was taken at: a rank unchanged
        #: since is not copied again
        self._rank_snapshots: Tuple[Optional[tuple], int] = (None, 0)
        self._stacks_came = threading.Condition(self._lock)
        self._unhandled: set = set()  # record types without a handler, named once
        self._metric_names: set = set()  # every rank's, up to MAX_METRIC_NAMES
        self._over_cap: set = set()  # (rank, what) of caps a rank's log has named
        self._pace = Pace(num_processes, clock)  # stragglers, from what arrives when
        self._listeners: List[Callable[[events.Event], None]] = []
        #: set when a rank's exit is taken: the run's watcher (``Run._watch``) wakes at once for
        #: it, and otherwise looks only every ``WATCH_INTERVAL``
        self.exit_seen = threading.Event()
        self._tracking = None
        #: what the run's channel refused, by kind (``malformed``, ``forbidden``,
        #: ``callback_errors``): how many, and the first one's rank and what it was
        self.refusals: Dict[str, Refusal] = {}
        #: the current attempt's first work and newest checkpoint (``time.time()``), for goodput
        self.first_work: Optional[float] = None
        self.last_checkpoint: Optional[float] = None
        #: the step of the current attempt's newest checkpoint (``restarts``: did it get further?)
        self.last_checkpoint_step: Optional[int] = None
        #: seconds lost to a hang: from the last sign of life to the run's end (a run that hung)
        self.hang_lost_s = 0.0
        #: the current attempt's profiles (``profiles.ProfileCollector``, ``--profile``), or None
        self.profiles = None
        #: the class of the run's root cause (``faults.Fault``) once it failed or hung, else None
        self.fault: Optional[Fault] = None
        #: hosts (executors) left out by the run's restarts (``faults.Exclusion``), oldest first
        self.excluded: List[Exclusion] = []

    def refused(self, kind: str, rank: int, detail: str) -> None:
        """The channel refused a record of ``rank`` (``ChannelServer``'s ``on_refusal``)."""
        with self._lock:
            known = self.refusals.get(kind)
            if known is None:
                self.refusals[kind] = Refusal(kind, 1, rank, detail)
            else:
                known.count += 1
            self.version += 1

    @property
    def tracking(self):
        """Where the run is tracked (``tracking.TrackingLink``: its MLflow run), or None."""
        return self._tracking

    def track(self, link) -> None:
        """Say where the run is tracked (``tracking.TrackingLink``): the views and the summary
        name it from now on."""
        with self._lock:
            self._tracking = link
            self.version += 1

    def listen(self, listener: Callable[[events.Event], None]) -> None:
        """Call ``listener(record)`` with every record the state takes from now on (those of
        the current attempt), in the thread that applies it and with the state's lock held: it
        must return at once (``tracking.MlflowLogger.take`` puts points in a bounded buffer)."""
        with self._lock:
            self._listeners.append(listener)

    # -- writing -------------------------------------------------------------------------
    def apply(self, event: events.Event, attempt: Optional[int] = None) -> None:
        """Record one event of attempt ``attempt`` (``None``: the current one); events of ranks
        outside the run, or of an attempt that has ended, are ignored."""
        rank = event.rank
        if not 0 <= rank < self.num_processes:
            return
        handler = self.HANDLERS.get(type(event))
        with self._lock:
            if attempt is not None and attempt != self.attempt:
                return
            if handler is None:  # a record this driver does not know (a newer rank's, a stray one)
                if type(event) in self._unhandled:
                    return
                self._unhandled.add(type(event))
                handler = RunState._on_unhandled
            handler(self, self.ranks[rank], event)
            self._pace.saw(rank, event)
            for listener in self._listeners:
                listener(event)
            self.version += 1
            self._rank_versions[rank] = self.version

    def _alive(self) -> None:
        self.last_activity = time.monotonic()

    def _on_started(self, rs: RankState, e: events.Started) -> None:
        self._alive()
        rs.host = e.host or rs.host
        rs.pid = e.pid or rs.pid
        if rs.state == "starting":
            rs.state = "running"
            rs.started = rs.started or time.time()
            if self.state in ("starting", "restarting"):
                self.state = "running"

    def _on_log(self, rs: RankState, e: events.Log) -> None:
        self._alive()
        self._keep_line(rs, e.stream, e.line, e.cr)
        more = e.more  # the lines that followed on its stream in one flush, in order
        if more:
            chars = sum(map(len, more))
            if rs.log_chars + chars <= self.max_rank_log_chars:  # all of them kept, at once
                rs.log_chars += chars
                rs.logs.extend(e.stream, more)
            else:
                for text in more:
                    self._keep_line(rs, e.stream, text, False)

    def _keep_line(self, rs: RankState, stream: str, text: str, cr: bool) -> None:
        """Keep one line of ``rs``'s output within its share of ``MAX_RUN_LOG_CHARS``; a line that
        ends with ``\\r`` (a bar redrawn) replaces the stream's last one, so it is not counted."""
        if cr:
            return rs.logs.add(stream, text, cr)
        if rs.log_chars + len(text) > self.max_rank_log_chars:
            rs.log_dropped += 1
            return self._over(
                rs,
                "log",
                f"torchdist: rank {rs.rank} printed over its share of what a run keeps of "
                f"its output ({self.max_rank_log_chars / 2**20:.0f} MiB of "
                f"{MAX_RUN_LOG_CHARS / 2**30:.0f} GiB, MAX_RUN_LOG_CHARS); its later "
                f"lines are not kept (counted in run.state.ranks[{rs.rank}].log_dropped)",
            )
        rs.log_chars += len(text)
        rs.logs.add(stream, text, cr)

    def _on_progress(self, rs: RankState, e: events.Progress) -> None:
        self._alive()
        if e.state == "cleared":  # a bar that leaves no trace (tqdm's leave=False)
            rs.progress.pop(e.bar, None)
            return
        if e.bar not in rs.progress and len(rs.progress) >= MAX_BARS:
            return self._over(
                rs,
                "bars",
                f"torchdist: rank {rs.rank} has {MAX_BARS} progress bars open already; "
                f"{e.bar!r:.60} and any newer ones are not shown (close bars when "
                "they are done, or make them with leave=False)",
            )
        if e.n > 0:
            self._worked()
        rs.progress[e.bar] = {
            "desc": e.desc,
            "n": e.n,
            "total": e.total,
            "elapsed": e.elapsed,
            "state": e.state,
            "postfix": e.postfix,
        }
        if rs.state == "starting":
            rs.state = "running"
        self._step_time(rs, e)

    def _step_time(self, rs: RankState, e: events.Progress) -> None:
        """Update ``rs.step_time`` from its innermost running bar: that bar's seconds per step so
        far (its ``elapsed`` over its ``n``: tqdm's average rate, smoothed over the bar, which
        starts again with each epoch's).  Goes to ``stragglers`` too (a rank whose step time is
        well above the median is slow)."""
        running = [bar for bar, b in rs.progress.items() if b["state"] == "running"]
        if not running:
            rs.step_time = None
        elif running[-1] == e.bar and e.n > 0:
            rs.step_time = max(e.elapsed, 0.0) / e.n
        self._pace.step_time(rs.rank, rs.step_time, e.desc or e.bar)

    def _on_system(self, rs: RankState, e: events.SystemMetrics) -> None:
        """A sample of the machine under the rank (its launcher's, or the worker's own keys):
        merged into ``rs.system``; its history keeps the launcher's samples (those with a CPU %)."""
        rs.system.update(e.values)
        rs.system["time"] = e.time
        if "cpu_percent" in e.values:
            rs.system_samples.append((e.time, *(e.values.get(k) for k in SYSTEM_HISTORY_KEYS)))
            if len(rs.system_samples) > self.max_system_points:
                del rs.system_samples[-2::-2]  # halve the resolution; keep the first and newest

    def _worked(self) -> None:
        if self.first_work is None:
            self.first_work = time.time()

    def _on_step_split(self, rs: RankState, e: events.StepSplit) -> None:
        self._alive()
        self._worked()
        rs.step_split = {"data": e.data, "compute": e.compute, "comm": e.comm}
        rs.step_totals = {"step_s": e.step_s, "data_s": e.data_s, "comm_s": e.comm_s}
        self._pace.step_split(rs.rank, rs.step_split)

    def _on_code_started(self, rs: RankState, e: events.CodeStarted) -> None:
        """The rank's job began its own code: a sign of life, and of work (``goodput``)."""
        self._alive()
        self._worked()

    def _on_checkpoint(self, rs: RankState, e: events.Checkpoint) -> None:
        self._alive()
        self.last_checkpoint = time.time()  # the driver's clock, as the attempts' times
        self.last_checkpoint_step = max(e.step, self.last_checkpoint_step or 0)

    def _on_metrics(self, rs: RankState, e: events.Metrics) -> None:
        """The points of one record (a rank's flush), a column at a time: each name is looked
        up once per record, and a column of numbers joins its history's arrays in one ``extend``
        (``MetricSeries``: no pair made per point)."""
        self._alive()
        self._worked()
        steps = e.steps
        for name, column in zip(e.names, e.values):
            if name not in self._metric_names and not self._new_metric_name(rs, name):
                continue
            series = rs.history.get(name)
            new = series is None
            if new:
                series = MetricSeries()
            try:
                newest = series.add(steps, column)
            except OverflowError:  # a history's steps are 64-bit integers
                self._over(
                    rs,
                    "steps",
                    f"torchdist: rank {rs.rank} reported a step beyond a 64-bit integer "
                    f"({max(steps, key=abs)}); its points at such steps are not plotted",
                )
                fitting = [i for i, step in enumerate(steps) if _STEP_MIN <= step <= _STEP_MAX]
                newest = series.add([steps[i] for i in fitting], [column[i] for i in fitting])
            if newest is None:  # no number in the column (texts are shown, not plotted)
                continue
            rs.metrics[name] = newest
            if new:
                rs.history[name] = series
            while len(series) > self.max_points:
                series.halve()  # halve the resolution; keep the first and newest points

    def _new_metric_name(self, rs: RankState, name: str) -> bool:
        """Whether the run keeps ``name``, a name it has not seen: not past ``MAX_METRIC_NAMES``."""
        if len(self._metric_names) >= MAX_METRIC_NAMES:
            self._over(
                rs,
                "metrics",
                f"torchdist: this run has {MAX_METRIC_NAMES} distinct metric names "
                f"already; rank {rs.rank}'s {name!r:.60} and any newer names are not "
                "kept (report() a name per quantity, with the step as step=)",
            )
            return False
        self._metric_names.add(name)
        return True

    def _over(self, rs: RankState, what: str, line: str) -> None:
        """A cap of the run's reached by ``rs``: said once per rank and cap, in its log."""
        if (rs.rank, what) not in self._over_cap:
            self._over_cap.add((rs.rank, what))
            rs.logs.add("stderr", line)

    def _on_dropped(self, rs: RankState, e: events.Dropped) -> None:
        rs.dropped += max(e.count, 0)

    def _on_exit(self, rs: RankState, e: events.Exit) -> None:
        if rs.state in ("done", "failed", "cancelled") and rs.exit_code is not None:
            return  # a repeated exit (the channel and the Spark stage both report it)
        self.exit_seen.set()
        rs.exit_code = e.code
        rs.ended = e.time or time.time()
        rs.host = e.host or rs.host
        if self.ended is not None and rs.state == "cancelled":
            return  # a rank stopped by the run's end: its late exit is not a failure of its own
        if e.stopped:
            rs.state = "cancelled"
        elif e.code == 0:
            rs.state = "done"
        else:
            rs.state = "failed"
            rs.failure = Failure.from_exit(
                rs.rank,
                e.code,
                host=rs.host,
                time=rs.ended,
                reported=e.failure,
                # the rank's lines seen live; else those its task sent back with the failure
                log_tail=[line.text for line in rs.logs[max(len(rs.logs) - 20, self._attempt_lines[rs.rank][-1]) :]],
            )

    def _on_stacks(self, rs: RankState, e: events.Stacks) -> None:
        if rs.state == "idle":  # waiting in its pool's serving loop: the note says more
            return
        self.stacks[rs.rank] = e
        self._stacks_came.notify_all()

    def _on_collectives(self, rs: RankState, e: events.Collectives) -> None:
        self.collectives[rs.rank] = e
        self._fresh_collectives.add(rs.rank)
        self._stacks_came.notify_all()

    def _on_preflight(self, rs: RankState, e: events.Preflight) -> None:
        self.preflight[rs.rank] = e

    def _on_unhandled(self, rs: RankState, e: events.Event) -> None:
        """Said once per record type, in the log of the rank that sent it first."""
        rs.logs.append(
            LogLine(
                "stderr",
                f"torchdist: ignored a record of type {e.type or '?'} "
                f"({type(e).__name__}): this version of the driver has no handler "
                "for it; later ones are ignored silently",
            )
        )

    HANDLERS = {
        events.Started: _on_started,
        events.Log: _on_log,
        events.Progress: _on_progress,
        events.Metrics: _on_metrics,
        events.Dropped: _on_dropped,
        events.Exit: _on_exit,
        events.Stacks: _on_stacks,
        events.SystemMetrics: _on_system,
        events.Collectives: _on_collectives,
        events.Preflight: _on_preflight,
        events.StepSplit: _on_step_split,
        events.Checkpoint: _on_checkpoint,
        events.CodeStarted: _on_code_started,
    }

    def restart(
        self,
        cause: Optional[Failure] = None,
        fault: Optional[Fault] = None,
        num_processes: Optional[int] = None,
        excluded: Iterable[Exclusion] = (),
    ) -> None:
        """End the current attempt (its root cause is ``cause`` when given, a hang's, else the
        first of ``failures()``; of class ``fault``) and start the next: fresh rank states, the
        logs kept; on ``num_processes`` ranks (fewer than before, ``--np MIN:MAX``) when given;
        ``excluded``: the hosts it leaves out for the root cause."""
        with self._lock:
            failures = ([cause] if cause is not None else []) + self.failures()
            now = time.time()
            self.attempts.append(
                Attempt(
                    self.attempt,
                    self.attempt_started,
                    now,
                    failures[0] if failures else None,
                    failures,
                    first_work=self.first_work,
                    checkpoint=self.last_checkpoint,
                    data_stall_s=self._data_stall(),
                    world_size=self.num_processes,
                    fault=fault,
                )
            )
            self.excluded.extend(excluded)
            if num_processes is not None and num_processes < self.num_processes:
                # the ranks beyond the new world keep their logs (``logs``), not a rank state
                self.num_processes = num_processes
                self._rank_versions = self._rank_versions[:num_processes]
                self._rank_snapshots = (None, 0)
            self.first_work = self.last_checkpoint = self.last_checkpoint_step = None
            self.attempt += 1
            self.attempt_started = now
            self.state = "restarting"
            self.stacks = {}
            self.collectives = {}
            self.verdict = None
            self.preflight = {}
            self.last_activity = time.monotonic()
            for r, store in enumerate(self._logs):
                store.seal()
                self._attempt_lines[r].append(len(store))
            self.ranks = [RankState(rank=r, logs=self._logs[r]) for r in range(self.num_processes)]
            self._pace = Pace(self.num_processes, self._pace.clock)
            self._changed_all()

    def finish(
        self, state: str, failure: Optional[Failure] = None, message: str = "", fault: Optional[Fault] = None
    ) -> None:
        with self._lock:
            if self.ended is not None:
                return
            self.state = state
            self.fault = fault
            self.failure = failure
            self.message = message
            self.ended = time.time()
            if state == "hung":
                self.hang_lost_s = time.monotonic() - self.last_activity
            for rs in self.ranks:
                if rs.state in ("starting", "running"):
                    rs.state = "cancelled" if state in ("cancelled", "timed out", "hung", "failed") else rs.state
            self._changed_all()

    def _changed_all(self) -> None:
        self.version += 1
        self._rank_versions = [self.version] * self.num_processes

    # -- stacks ----------------------------------------------------------------------------
    def begin_stacks(self) -> List[int]:
        """Start collecting every rank's stacks (a hang or a timeout): ``stacks`` holds, for
        each rank that has exited, a note saying so; returns the ranks still running, whose
        ``Stacks`` records are awaited (``wait_stacks``)."""
        with self._lock:
            now = time.time()
            self.stacks = {
                rs.rank: events.Stacks(rank=rs.rank, time=now, note=f"had exited with code {rs.exit_code}")
                for rs in self.ranks
                if rs.exit_code is not None
            }
            self.stacks.update(
                {r: events.Stacks(rank=r, time=now, note="idle: not one of the run's --ranks") for r in self.idle_ranks}
            )
            self._changed_all()
            return [rs.rank for rs in self.ranks if rs.exit_code is None and rs.rank not in self.idle_ranks]

    def wait_stacks(self, ranks: Iterable[int], timeout: float) -> Dict[int, events.Stacks]:
        """Wait until every rank of ``ranks`` sent its stacks, or ``timeout`` seconds; returns a
        copy of ``stacks`` as they are then (those that came)."""
        ranks = list(ranks)
        with self._stacks_came:
            self._stacks_came.wait_for(lambda: all(r in self.stacks for r in ranks), timeout)
            return dict(self.stacks)

    def begin_collectives(self) -> None:
        """The driver is about to ask the ranks for their collective records: ``wait_collectives``
        waits for records that come after this (those sent before, by ranks that failed, stay)."""
        with self._lock:
            self._fresh_collectives = set()

    def wait_collectives(self, ranks: Iterable[int], timeout: float) -> Dict[int, events.Collectives]:
        """Wait until every rank of ``ranks`` sent a collective record since ``begin_collectives``,
        or ``timeout`` seconds; a copy of every rank's latest record."""
        ranks = list(ranks)
        with self._stacks_came:
            self._stacks_came.wait_for(lambda: all(r in self._fresh_collectives for r in ranks), timeout)
            return dict(self.collectives)

    def exits(self) -> Dict[int, str]:
        """How each rank that has exited left (``"exited with code 1"``), by rank."""
        with self._lock:
            return {rs.rank: f"exited with code {rs.exit_code}" for rs in self.ranks if rs.exit_code is not None}

    def set_verdict(self, verdict: Verdict) -> None:
        """Keep what the ranks' collective records said (the view and the summary show it)."""
        with self._lock:
            self.verdict = verdict
            self._changed_all()

    # -- the reads: what views, the supervisor and the summary ask, each answer a copy taken
    # under the state's own lock, so that a reader in any thread never holds it longer than the
    # copy takes ---------------------------------------------------------------------------------

    #: CPU seconds that another process spent answering this state's reads (``HostedState``):
    #: none, for a state in this process
    served_cpu = 0.0

    @property
    def hosted(self) -> bool:
        """Whether the reads go to another process (``HostedState``): never, for this one."""
        return False

    @property
    def finished(self) -> bool:
        return self.ended is not None

    def elapsed(self) -> float:
        return (self.ended or time.time()) - self.started

    def idle(self) -> float:
        """Seconds since any rank last sent output, progress or metrics (or the attempt began)."""
        return time.monotonic() - self.last_activity

    def failures(self) -> List[Failure]:
        """Failed ranks, root cause first: the earliest failure that is not merely a peer
        noticing that another rank went away (clocks of different hosts may disagree)."""
        with self._lock:
            found = [rs.failure for rs in self.ranks if rs.failure is not None]
        return root_cause_first(found)

    def profile(self):
        """The current attempt's profile (``profiles.Profile``: ``--profile``), with each rank's
        step split; None without one, or before any rank's profile came."""
        profiles = self.profiles
        if profiles is None:
            return None
        with self._lock:
            splits = {rs.rank: None if rs.step_split is None else dict(rs.step_split) for rs in self.ranks}
        return profiles.profile(splits)

    def _data_stall(self) -> float:
        return max((rs.step_totals.get("data_s", 0.0) for rs in self.ranks), default=0.0)

    def goodput(self) -> Dict[str, float]:
        """Where the run's wall time went so far (``goodput``): ``startup_s``, ``training_s``,
        ``lost_to_restarts_s``, ``lost_to_hangs_s``, ``data_stall_s``, ``wall_s``,
        ``rank_seconds``, and with GPUs ``gpu_hours``."""
        with self._lock:
            end = self.ended or time.time()
            attempts = [
                AttemptTimes(a.started, a.ended, a.first_work, a.checkpoint, a.data_stall_s) for a in self.attempts
            ]
            attempts.append(
                AttemptTimes(self.attempt_started, end, self.first_work, self.last_checkpoint, self._data_stall())
            )
            return goodput(
                self.started,
                end,
                attempts,
                ranks=self.num_processes - len(self.idle_ranks),
                use_gpu=self.use_gpu,
                hang_lost_s=self.hang_lost_s,
            )

    def stragglers(self) -> List[Straggler]:
        """Ranks of the current attempt that step well below the others' pace or fall behind
        them, for several seconds (``stragglers`` names the thresholds): ``(rank, host, why)``
        by rank.  After the run, those that were listed when it ended."""
        with self._lock:
            return self._pace.stragglers([rs.host for rs in self.ranks], check=self.ended is None)

    def running(self) -> List[int]:
        """The ranks of the current attempt that have not exited."""
        with self._lock:
            return [
                rs.rank for rs in self.ranks if rs.exit_code is None and rs.state not in ("done", "failed", "cancelled")
            ]

    def all_exited(self) -> bool:
        with self._lock:
            return all(
                rs.exit_code is not None or rs.state in ("done", "failed", "cancelled", "idle") for rs in self.ranks
            )

    def all_exited_ok(self) -> bool:
        with self._lock:
            return all(rs.exit_code == 0 or rs.state == "idle" for rs in self.ranks)

    def snapshot(self, since: Optional[int] = None) -> RunSnapshot:
        """The run and every rank as they are now, copied at once; ``changed`` names the ranks
        changed after version ``since`` (every rank when ``since`` is None).  A rank unchanged
        since the last snapshot is the same ``RankSnapshot`` (they are frozen): a snapshot copies
        what changed, not every rank."""
        with self._lock:
            kept, kept_at = self._rank_snapshots
            versions = self._rank_versions
            ranks = tuple(
                rank_snapshot(rs) if kept is None or versions[rs.rank] > kept_at else kept[rs.rank] for rs in self.ranks
            )
            self._rank_snapshots = (ranks, self.version)
            changed = frozenset(r for r, v in enumerate(self._rank_versions) if since is None or v > since)
            now = self._pace.clock()
            quiet = tuple(None if seen is None else now - seen for seen in self._pace.last_seen)
            return RunSnapshot(
                version=self.version,
                run_id=self.run_id,
                num_processes=self.num_processes,
                backend=self.backend,
                use_gpu=self.use_gpu,
                job_name=self.job_name,
                state=self.state,
                started=self.started,
                ended=self.ended,
                failure=self.failure,
                message=self.message,
                attempt=self.attempt,
                max_attempts=self.max_attempts,
                attempts=tuple(self.attempts),
                ranks=ranks,
                stacks=dict(self.stacks),
                changed=changed,
                quiet=quiet,
                tracking=self.tracking,
                refusals=tuple(Refusal(r.kind, r.count, r.rank, r.detail) for r in self.refusals.values()),
                verdict=self.verdict,
                preflight=dict(self.preflight),
                goodput=self.goodput(),
                fault=self.fault,
                excluded=tuple(self.excluded),
                stragglers=tuple(self._pace.stragglers([rs.host for rs in self.ranks], check=self.ended is None)),
            )

    def changed_since(self, since: Optional[int] = None) -> Tuple[int, List[int]]:
        """The state's version now, and the ranks changed after version ``since`` (every rank
        when None): what ``snapshot(since).changed`` names, without the snapshot."""
        with self._lock:
            return self.version, [r for r, v in enumerate(self._rank_versions) if since is None or v > since]

    def large_view(
        self, since: Optional[int] = None, host: Optional[str] = None, rank: Optional[int] = None
    ) -> LargeView:
        """What a view of a large run shows (``summary.large_view``): ``snapshot(since)``
        summarised, with the snapshots of the ranks worth a look and of the page of ``host`` or
        ``rank`` only."""
        return large_view(self.snapshot(since), host, rank)

    def read_log(self, rank: int, start: int = 0, limit: Optional[int] = None, newest: bool = False) -> LogRead:
        """``rank``'s lines from index ``start`` to the end of its log, read at once (from memory
        and from its spill file, also while lines arrive and spill): at most ``limit`` of them,
        the first ones, or with ``newest`` the last ones."""
        self._check_rank(rank)
        with self._lock:
            store = self._logs[rank]
            total = len(store)
            start = min(max(start, 0), total)
            stop = total
            if limit is not None:
                if newest:
                    start = max(start, total - limit)
                else:
                    stop = min(total, start + limit)
            return LogRead(rank, start, store[start:stop], total, self.ranks[rank].state)

    def read_logs(
        self, reads: List[Tuple[int, int, Optional[int], bool]], budget: Optional[int] = None
    ) -> List[Optional[LogRead]]:
        """``read_log(rank, start, limit, newest)`` of each of ``reads``, in one go (a view that
        follows many ranks asks once, not once a rank); with ``budget``, once that many lines
        were read the rest are ``None`` (not read: asked again later)."""
        for rank, *_ in reads:
            self._check_rank(rank)
        got: List[Optional[LogRead]] = []
        lines = 0
        for rank, start, limit, newest in reads:
            if budget is not None and lines >= budget:
                got.append(None)
                continue
            read = self.read_log(rank, start, limit, newest)
            lines += len(read.lines)
            got.append(read)
        return got

    def recent_log(self, rank: int, limit: int) -> LogRead:
        """Up to ``limit`` of ``rank``'s newest lines, from memory only (what a view scans)."""
        self._check_rank(rank)
        with self._lock:
            store = self._logs[rank]
            lines = store.recent(limit)
            return LogRead(rank, len(store) - len(lines), lines, len(store), self.ranks[rank].state)

    def metric_history(
        self, points: Optional[int] = None, ranks: Optional[Iterable[int]] = None, names: Optional[Iterable[str]] = None
    ) -> Dict[str, Dict[int, List[Tuple[int, float]]]]:
        """``{metric: {rank: [(step, value), ...]}}`` of the current attempt, copied; metrics in
        order of first report, ranks that reported the metric only.  ``points``: about that many
        of each rank's points, evenly spread, the newest kept (a slice per rank: the lock is held
        for what is copied, not for the whole history); ``ranks``, ``names``: those only."""
        names = None if names is None else set(names)
        with self._lock:
            history: Dict[str, Dict[int, List[Tuple[int, float]]]] = {}
            for rs in self.ranks if ranks is None else [self.ranks[r] for r in ranks]:
                for name, series in rs.history.items():
                    if names is not None and name not in names:
                        continue
                    history.setdefault(name, {})[rs.rank] = series.thinned(points)
            return history

    def metric_points(
        self, cursor: "MetricCursor", points: Optional[int] = None
    ) -> Dict[str, Dict[int, List[Tuple[int, float]]]]:
        """Like ``metric_history``, but only the points each rank's history of each metric got
        since ``cursor`` last read it (all of it the first time, and after a restart), and
        ``cursor`` moves past them: ``points``: about that many of each rank's new points,
        evenly spread, the newest kept.  Where a history was thinned past the point read last
        (``MAX_POINTS``), the new points are those after the newest one that survived."""
        with self._lock:
            new: Dict[str, Dict[int, List[Tuple[int, float]]]] = {}
            for rs in self.ranks:
                read = cursor.read.get(rs.rank)
                if read is None:
                    read = cursor.read[rs.rank] = {}
                for name, series in rs.history.items():
                    seen = read.get(name)
                    if seen is not None and not seen.fresh(series):
                        continue  # nothing new since the point read last
                    if points == 1:
                        fresh = series.pairs(len(series) - 1)
                    else:
                        fresh = series.thinned(points, series.after(seen))
                    by_rank = new.get(name)
                    if by_rank is None:
                        by_rank = new[name] = {}
                    by_rank[rs.rank] = fresh
                    read[name] = SeriesRead(series)
            return new

    def system_history(self, rank: int, points: Optional[int] = None) -> List[Dict[str, float]]:
        """``rank``'s system samples of the current attempt, oldest first, each a dict of
        ``time`` and the plotted keys it had (``SYSTEM_HISTORY_KEYS``); ``points``: about that
        many, evenly spread, the newest kept."""
        self._check_rank(rank)
        with self._lock:
            kept = thinned(self.ranks[rank].system_samples, points)
        keys = ("time",) + SYSTEM_HISTORY_KEYS
        return [{k: v for k, v in zip(keys, sample) if v is not None} for sample in kept]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_processes:
            raise IndexError(f"rank {rank} is not in this run (ranks 0..{self.num_processes - 1})")

    def logs(self, rank: int, attempt: Optional[int] = None) -> str:
        """Everything ``rank`` printed, in order: in every attempt, or in attempt ``attempt``
        (1 for the first).  A rank an earlier attempt had and a smaller world has not (``--np
        MIN:MAX``) keeps its logs."""
        if not 0 <= rank < len(self._logs):
            self._check_rank(rank)
        with self._lock:
            if attempt is None:
                return self._logs[rank].text()
            if not 1 <= attempt <= self.attempt:
                raise IndexError(f"attempt {attempt} is not in this run (attempts 1..{self.attempt})")
            bounds = self._attempt_lines[rank] + [None]
            return self._logs[rank].text(bounds[attempt - 1], bounds[attempt])
