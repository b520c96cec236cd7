"""RunState: everything known about one run, built from ``events`` records; the one model
that every view (text, widget, panel) reads.

``apply`` takes the records a rank or its launcher sends (``Started``, ``Log``, ``Progress``,
``Metrics``, ``StepSplit``, ``Dropped``, ``Exit``, ``Stacks``, ``Collectives``, ``Preflight``), each through the handler ``HANDLERS`` names for
its type.  A run that restarts (``max_restarts``) has attempts: ``restart`` records how the
current one ended and starts the next with fresh rank states; records of an earlier attempt
that arrive late are ignored.

Logs.  Each rank's lines are a ``LogStore``: complete and in order across attempts, the newest
lines in memory and older ones spilled to a file in the run's directory, so that the driver's
memory stays flat however much a rank prints.  A line that ends with ``\\r`` (a redrawn progress
line) is replaced by the next line of its stream, as on a terminal, so redraws do not pile up.

Readers.  ``RunState`` alone takes its lock: a view reads copies through its methods
(``snapshot`` of the run and every rank, with the ranks changed since a ``version``;
``read_log`` / ``recent_log``; ``metric_history``), and the supervisor collects stacks with
``begin_stacks`` and ``wait_stacks``, collective records with ``begin_collectives`` and
``wait_collectives``, and keeps what they say with ``set_verdict``.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Iterable, Iterator, List, Optional, Tuple, Union

from ..core import events
from ..core.culprit import Verdict
from ..core.events import Failure
from .goodput import AttemptTimes, goodput
from .stragglers import Pace, Straggler

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
#: the keys of a system sample its history keeps (what the views plot), in this order
SYSTEM_HISTORY_KEYS = ("cpu_percent", "rss_bytes", "gpu_memory_used_bytes", "gpu_util_percent")
#: a rank's log keeps at most this many lines (and ``LOG_MEMORY_CHARS`` characters) in memory;
#: past that the older half goes to the rank's file
LOG_MEMORY_LINES = 20_000
LOG_MEMORY_CHARS = 8 * 1024 * 1024
#: ... and a run's, all ranks together, about this many lines (and characters): each rank gets
#: its share (at least ``MIN_LOG_LINES`` and ``MIN_LOG_CHARS``)
RUN_LOG_MEMORY_LINES = 400_000
RUN_LOG_MEMORY_CHARS = 64 * 1024 * 1024
MIN_LOG_LINES = 256
MIN_LOG_CHARS = 64 * 1024
#: distinct metric names a run keeps, all ranks together (a name per step would grow the driver
#: without bound); a newer name is not kept, and the rank's log says so once
MAX_METRIC_NAMES = 1024
#: progress bars one rank may have open at once; a newer one is not shown (said once)
MAX_BARS = 256
#: characters of output a run keeps (in memory and spilled to its directory), all ranks together;
#: each rank may keep its share, and at least ``MIN_RANK_LOG_CHARS``: past it, its newer lines
#: are counted (``RankState.log_dropped``), not kept, and its log says so once
MAX_RUN_LOG_CHARS = 16 * 1024 ** 3
MIN_RANK_LOG_CHARS = 64 * 1024 ** 2
#: a spilled line's file offset is remembered for every this many lines (to read a range)
SPILL_INDEX_EVERY = 1024
#: what a rank raises when a *peer* died: never the root cause while another failure is known
COLLATERAL = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crashing|Broken pipe"
    r"|NCCL communicator was aborted|ProcessGroupNCCL.*(watchdog|abort)|recvBytes|sendBytes"
    r"|failed to recv, got 0 bytes|The server socket has failed")


def is_collateral(failure: Failure) -> bool:
    return bool(failure.exc_type) and bool(COLLATERAL.search(failure.message))


def root_cause_first(failures: Iterable[Failure]) -> List[Failure]:
    """``failures`` ordered root cause first: the earliest failure that is not merely a peer
    noticing that another rank went away (clocks of different hosts may disagree)."""
    return sorted(failures, key=lambda f: (is_collateral(f), f.time, f.rank))


@dataclass
class LogLine:
    stream: str
    text: str
    cr: bool = False


class RunDirectory:
    """A run's directory (spilled logs, default checkpoints): made on first use, removed when its
    owner is garbage-collected or the process exits."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._path: Optional[str] = None
        self._lock = threading.Lock()

    def path(self) -> str:
        with self._lock:
            if self._path is None:
                self._path = tempfile.mkdtemp(prefix=self.prefix)
                weakref.finalize(self, shutil.rmtree, self._path, True)
            return self._path


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


_ESCAPED = re.compile(r"\\(.)")
_UNESCAPE = {"n": "\n", "r": "\r", "\\": "\\"}


def _unescape(text: str) -> str:
    return _ESCAPED.sub(lambda m: _UNESCAPE.get(m.group(1), m.group(1)), text) if "\\" in text else text


class LogStore:
    """One rank's output lines in order, as a read-only sequence of ``LogLine`` (``len``,
    indexing, slicing, iteration).  Recent lines are in memory; older ones are in a file under
    ``directory()`` (called on the first spill), read back when asked for.

    ``append`` replaces the stream's last line instead when that line ended with ``\\r`` (also
    when the other stream wrote in between): only a bar's latest state is kept.  A reader that
    keeps a cursor should read a trailing ``\\r``-line again later (``model.LogCursor`` does).

    In memory a line is a plain ``(stream, text, cr)`` tuple, made a ``LogLine`` when read: the
    garbage collector stops tracking such tuples, so that the hundreds of thousands of lines a
    large run keeps do not make every full collection of the driver's process longer (at 1024
    ranks they were four tenths of the driver's CPU time).
    """

    def __init__(self, directory: Callable[[], str], name: str, *, max_lines: Optional[int] = None,
                 max_chars: Optional[int] = None):
        self._directory = directory
        self._name = name
        # lines and characters in memory at most; past that the older half spills (a RunState
        # gives each rank its share of the run's)
        self._max_lines = LOG_MEMORY_LINES if max_lines is None else max_lines
        self._max_chars = LOG_MEMORY_CHARS if max_chars is None else max_chars
        self._memory: List[Tuple[str, str, bool]] = []
        self._first = 0                  # index of _memory[0]
        self._chars = 0                  # characters of the lines in memory
        self._file = None
        self._path: Optional[str] = None
        self._offsets: List[int] = []    # file offset of spilled line k * SPILL_INDEX_EVERY
        self._file_size = 0
        self._sealed = False
        self._open_cr: Dict[str, int] = {}  # per stream: its last line's index, when it ended with \r

    def __len__(self) -> int:
        return self._first + len(self._memory)

    @property
    def spilled(self) -> int:
        """Lines that are in the file, not in memory."""
        return self._first

    def append(self, line: LogLine) -> None:
        self.add(line.stream, line.text, line.cr)

    def add(self, stream: str, text: str, cr: bool = False) -> None:
        """``append`` of the line ``(stream, text, cr)``."""
        at = self._open_cr.pop(stream, None)
        if at is not None and at >= self._first and not self._sealed:
            # the stream's redrawn line takes this line, also when another stream wrote between
            last = self._memory[at - self._first]
            self._memory[at - self._first] = (stream, text, cr)
            self._chars += len(text) - len(last[1])
            if cr:
                self._open_cr[stream] = at
            return
        if self._sealed:
            self._open_cr.clear()
        self._sealed = False
        if cr:
            self._open_cr[stream] = len(self)
        self._memory.append((stream, text, cr))
        self._chars += len(text)
        if len(self._memory) > self._max_lines or self._chars > self._max_chars:
            self._spill()

    def seal(self) -> None:
        """The next line starts afresh (a new attempt): it never replaces the last one."""
        self._sealed = True

    def _spill(self) -> None:
        """Move the older half of the lines in memory (by count and size) to the file."""
        count = 0
        chars = 0
        while count < len(self._memory) - 1 and (count < len(self._memory) // 2 or
                                                  self._chars - chars > self._max_chars // 2):
            chars += len(self._memory[count][1])
            count += 1
        if self._file is None:
            self._path = os.path.join(self._directory(), f"{self._name}.log")
            self._file = open(self._path, "ab")
        parts = []
        for i, (stream, text, cr) in enumerate(self._memory[:count], start=self._first):
            if i % SPILL_INDEX_EVERY == 0:
                self._offsets.append(self._file_size)
            data = f"{'r' if cr else 'n'}{stream.replace(chr(9), ' ')}\t{_escape(text)}\n".encode(
                "utf-8", "surrogatepass")
            self._file_size += len(data)
            parts.append(data)
        self._file.write(b"".join(parts))
        del self._memory[:count]
        self._first += count
        self._chars -= chars

    def _read_spilled(self, start: int, stop: int) -> Iterator[Tuple[str, str, bool]]:
        """``(stream, text, cr)`` of the spilled lines ``start <= i < stop``."""
        stop = min(stop, self._first)
        if start >= stop:
            return
        self._file.flush()
        chunk = start // SPILL_INDEX_EVERY
        with open(self._path, "rb") as fh:
            fh.seek(self._offsets[chunk])
            i = chunk * SPILL_INDEX_EVERY
            for raw in fh:
                if i >= stop:
                    break
                if i >= start:
                    line = raw.decode("utf-8", "surrogatepass")
                    stream, _, body = line[1:-1].partition("\t")
                    yield stream, _unescape(body), line[0] == "r"
                i += 1

    def __getitem__(self, key: Union[int, slice]):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("a log is sliced with step 1 only")
            out = [LogLine(*fields) for fields in self._read_spilled(start, stop)]
            out += [LogLine(*fields) for fields in self._memory[max(start - self._first, 0):max(stop - self._first, 0)]]
            return out
        index = key + len(self) if key < 0 else key
        if not 0 <= index < len(self):
            raise IndexError("log line index out of range")
        if index >= self._first:
            return LogLine(*self._memory[index - self._first])
        return LogLine(*next(self._read_spilled(index, index + 1)))

    def __iter__(self) -> Iterator[LogLine]:
        return iter(self[:])

    def recent(self, limit: int) -> List[LogLine]:
        """Up to ``limit`` of the newest lines, from memory only (what a view scans)."""
        return [LogLine(*fields) for fields in self._memory[-limit:]] if limit > 0 else []

    def text(self, start: int = 0, stop: Optional[int] = None) -> str:
        """Lines ``start:stop`` as the rank wrote them (``\\n`` or ``\\r`` after each)."""
        start, stop, _ = slice(start, stop).indices(len(self))
        chunks: List[str] = []
        part: List[str] = []
        for _stream, text, cr in self._read_spilled(start, stop):
            part += (text, "\r" if cr else "\n")
            if len(part) >= 2 * SPILL_INDEX_EVERY:  # joined as it goes: a spilled log can be large
                chunks.append("".join(part))
                part = []
        chunks.append("".join(part))
        chunks += [text + ("\r" if cr else "\n")
                   for _stream, text, cr in self._memory[max(start - self._first, 0):max(stop - self._first, 0)]]
        return "".join(chunks)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class _Bars:
    """What a rank's ``progress`` (its bars by id, in the order they started) shows."""

    progress: Dict[str, dict]

    def shown_progress(self) -> List[dict]:
        """The bars a view shows: while loops run, the outermost and the innermost running one
        (``epoch`` and ``batch``: bars are kept in the order they started); afterwards the
        first one (the outer loop)."""
        bars = list(self.progress.values())
        running = [b for b in bars if b.get("state") == "running"]
        if not running:
            return bars[:1]
        return running[:1] if len(running) == 1 else [running[0], running[-1]]

    def current_progress(self) -> Optional[dict]:
        """The bar to show: the newest one still running, else the newest one."""
        bars = list(self.progress.values())
        running = [b for b in bars if b.get("state") == "running"]
        return (running or bars or [None])[-1]


@dataclass
class RankState(_Bars):
    rank: int
    host: str = ""
    pid: Optional[int] = None
    state: str = "starting"
    exit_code: Optional[int] = None
    started: Optional[float] = None
    ended: Optional[float] = None
    progress: Dict[str, dict] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)
    history: Dict[str, List[Tuple[int, float]]] = field(default_factory=dict)
    logs: LogStore = None            # every attempt's lines (one store per rank, kept across attempts)
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


@dataclass(frozen=True)
class RankSnapshot(_Bars):
    """One rank as it was at one moment (``RunState.snapshot``): copies, safe to read in any
    thread.  Its log and its metric history stay on the state (``read_log``, ``metric_history``)."""

    rank: int
    host: str
    pid: Optional[int]
    state: str
    exit_code: Optional[int]
    started: Optional[float]
    ended: Optional[float]
    progress: Dict[str, dict]
    metrics: Dict[str, float]
    dropped: int
    failure: Optional[Failure]
    log_lines: int                 # lines in its log (every attempt's) at that moment
    system: Dict[str, float] = field(default_factory=dict)   # the latest system sample
    step_time: Optional[float] = None                          # seconds per step, smoothed
    step_split: Optional[Dict[str, float]] = None              # data/compute/comm shares (``stepsplit``)


@dataclass(frozen=True)
class LogRead:
    """Lines of one rank's log read at one moment: ``lines`` are those from index ``start`` on;
    the log held ``total`` lines then and the rank was in ``state``."""

    rank: int
    start: int
    lines: List["LogLine"]
    total: int
    state: str

    @property
    def stop(self) -> int:
        """The index after the last line read."""
        return self.start + len(self.lines)


@dataclass
class Attempt:
    """One attempt of a run that restarts: when it ran and the failure that ended it."""

    number: int                    # 1 for the first start, 2 after the first restart, ...
    started: float
    ended: float
    failure: Optional[Failure]     # the root cause
    failures: List[Failure] = field(default_factory=list)   # every failed rank, root cause first
    first_work: Optional[float] = None   # its first progress step, report or step split (``goodput``)
    checkpoint: Optional[float] = None   # when its newest checkpoint arrived
    data_stall_s: float = 0.0            # the longest any of its ranks waited for data


@dataclass
class Refusal:
    """Records of one kind that the run's channel refused: how many, and the first one."""

    kind: str
    count: int
    rank: int
    detail: str

    def text(self) -> str:
        more = f" and {self.count - 1} more" if self.count > 1 else ""
        return f"{self.detail}, from rank {self.rank}{more}"


@dataclass(frozen=True)
class RunSnapshot:
    """The run as it was at one moment (``RunState.snapshot``): a consistent copy that every
    view reads in any thread while records arrive.  ``changed``: the ranks that got a record (or
    that the run's start, restart or end changed) after the version the snapshot was asked
    ``since``."""

    version: int
    run_id: str
    num_processes: int
    backend: str
    use_gpu: bool
    job_name: str
    state: str
    started: float
    ended: Optional[float]
    failure: Optional[Failure]
    message: str
    attempt: int
    max_attempts: int
    attempts: Tuple[Attempt, ...]
    ranks: Tuple[RankSnapshot, ...]
    stacks: Dict[int, events.Stacks]
    changed: FrozenSet[int]
    #: what the ranks' collective records say (``culprit.Verdict``) when a hang, a timeout or a
    #: collective timeout had them compared; None before
    verdict: Optional[Verdict] = None
    #: each rank's pre-flight report (``--preflight``), by rank; empty without one
    preflight: Dict[int, events.Preflight] = field(default_factory=dict)
    stragglers: Tuple[Straggler, ...] = ()
    #: per rank, seconds since its last record (None: not heard from in this attempt)
    quiet: Tuple[Optional[float], ...] = ()
    #: where the run is tracked (``tracking.TrackingLink``), or None
    tracking: Optional[object] = None
    #: what the run's channel refused (``RunState.refusals``)
    refusals: Tuple[Refusal, ...] = ()
    #: where its wall time went so far (``RunState.goodput``)
    goodput: Dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.ended is not None

    def elapsed(self) -> float:
        return (self.ended or time.time()) - self.started

    def failures(self) -> List[Failure]:
        """Failed ranks, root cause first (``RunState.failures``)."""
        return root_cause_first(rs.failure for rs in self.ranks if rs.failure is not None)


class RunState:
    """Thread-safe: channel threads, log readers and the supervisor all ``apply`` events.  It
    is the only owner of its lock: readers in other threads take what they need through its
    methods, which return copies (``snapshot``, ``read_log``, ``recent_log``,
    ``metric_history``, ``failures``, ``logs``); every change bumps ``version``.

    ``spill_dir`` gives the directory where logs spill (made when first needed); by default a
    directory of this state's own, removed with it.  ``max_attempts``: 1 plus the run's
    ``max_restarts``.  ``clock`` (monotonic seconds) times the ranks' pace (``stragglers``).
    """

    def __init__(self, run_id: str, num_processes: int, backend: str = "", use_gpu: bool = False,
                 job_name: str = "", *, max_attempts: int = 1, spill_dir: Optional[Callable[[], str]] = None,
                 clock: Callable[[], float] = time.monotonic, idle: Iterable[int] = ()):
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
        self.attempts: List[Attempt] = []            # the attempts before the current one
        #: every rank's stacks, when a hang or a timeout asked for them (the current attempt's)
        self.stacks: Dict[int, events.Stacks] = {}
        #: each rank's latest collective record (``collectives``) of the current attempt
        self.collectives: Dict[int, events.Collectives] = {}
        #: what they said when they were compared (``set_verdict``), else None
        self.verdict: Optional[Verdict] = None
        self._fresh_collectives: set = set()   # ranks whose record came since ``begin_collectives``
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
        lines = min(LOG_MEMORY_LINES, max(MIN_LOG_LINES, RUN_LOG_MEMORY_LINES // share))
        chars = min(LOG_MEMORY_CHARS, max(MIN_LOG_CHARS, RUN_LOG_MEMORY_CHARS // share))
        self._logs = [LogStore(spill_dir, f"rank-{r}", max_lines=lines, max_chars=chars)
                      for r in range(num_processes)]
        #: points of one metric a rank's history keeps
        self.max_points = min(MAX_POINTS, max(MIN_POINTS, RUN_POINTS // share))
        #: system samples a rank's history keeps
        self.max_system_points = min(MAX_SYSTEM_POINTS, max(MIN_SYSTEM_POINTS, RUN_SYSTEM_POINTS // share))
        self._attempt_lines: List[List[int]] = [[0] for _ in range(num_processes)]
        #: ranks a warm run on some of its pool's ranks leaves out (``LaunchOptions.ranks``): they
        #: stay ``idle`` for the whole run and count as finished
        self.idle_ranks = frozenset(idle)
        self.ranks = [RankState(rank=r, logs=self._logs[r], state="idle" if r in self.idle_ranks else "starting")
                      for r in range(num_processes)]
        self.version = 0
        self._lock = threading.RLock()
        self._rank_versions = [0] * num_processes   # the version of each rank's latest change
        self._stacks_came = threading.Condition(self._lock)
        self._unhandled: set = set()                # record types without a handler, named once
        self._metric_names: set = set()             # every rank's, up to MAX_METRIC_NAMES
        self._over_cap: set = set()                 # (rank, what) of caps a rank's log has named
        self._pace = Pace(num_processes, clock)      # stragglers, from what arrives when
        self._listeners: List[Callable[[events.Event], None]] = []
        #: where the run is tracked (``tracking.TrackingLink``: its MLflow run), or None
        self.tracking = None
        #: what the run's channel refused, by kind (``malformed``, ``forbidden``,
        #: ``callback_errors``): how many, and the first one's rank and what it was
        self.refusals: Dict[str, Refusal] = {}
        #: the current attempt's first work and newest checkpoint (``time.time()``), for goodput
        self.first_work: Optional[float] = None
        self.last_checkpoint: Optional[float] = None
        #: seconds lost to a hang: from the last sign of life to the run's end (a run that hung)
        self.hang_lost_s = 0.0
        #: the current attempt's profiles (``profiles.ProfileCollector``, ``--profile``), or None
        self.profiles = None

    def refused(self, kind: str, rank: int, detail: str) -> None:
        """The channel refused a record of ``rank`` (``ChannelServer``'s ``on_refusal``)."""
        with self._lock:
            known = self.refusals.get(kind)
            if known is None:
                self.refusals[kind] = Refusal(kind, 1, rank, detail)
            else:
                known.count += 1
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
        for more in e.more:  # the lines of one flush, in order
            self._keep_line(rs, more.stream, more.line, more.cr)

    def _keep_line(self, rs: RankState, stream: str, text: str, cr: bool) -> None:
        """Keep one line of ``rs``'s output within its share of ``MAX_RUN_LOG_CHARS``; a line that
        ends with ``\\r`` (a bar redrawn) replaces the stream's last one, so it is not counted."""
        if cr:
            return rs.logs.add(stream, text, cr)
        if rs.log_chars + len(text) > self.max_rank_log_chars:
            rs.log_dropped += 1
            return self._over(rs, "log", f"torchdist: rank {rs.rank} printed over its share of what a run keeps of "
                                         f"its output ({self.max_rank_log_chars / 2 ** 20:.0f} MiB of "
                                         f"{MAX_RUN_LOG_CHARS / 2 ** 30:.0f} GiB, MAX_RUN_LOG_CHARS); its later "
                                         f"lines are not kept (counted in run.state.ranks[{rs.rank}].log_dropped)")
        rs.log_chars += len(text)
        rs.logs.add(stream, text, cr)

    def _on_progress(self, rs: RankState, e: events.Progress) -> None:
        self._alive()
        if e.state == "cleared":  # a bar that leaves no trace (tqdm's leave=False)
            rs.progress.pop(e.bar, None)
            return
        if e.bar not in rs.progress and len(rs.progress) >= MAX_BARS:
            return self._over(rs, "bars", f"torchdist: rank {rs.rank} has {MAX_BARS} progress bars open already; "
                                          f"{e.bar!r:.60} and any newer ones are not shown (close bars when "
                                          "they are done, or make them with leave=False)")
        if e.n > 0:
            self._worked()
        rs.progress[e.bar] = {"desc": e.desc, "n": e.n, "total": e.total, "elapsed": e.elapsed,
                              "state": e.state, "postfix": e.postfix}
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

    def _on_checkpoint(self, rs: RankState, e: events.Checkpoint) -> None:
        self._alive()
        self.last_checkpoint = time.time()  # the driver's clock, as the attempts' times

    def _on_metrics(self, rs: RankState, e: events.Metrics) -> None:
        self._alive()
        self._worked()
        self._metric_point(rs, e.step, e.values)
        for point in e.more:  # the points of one flush, in order
            self._metric_point(rs, point.step, point.values)

    def _metric_point(self, rs: RankState, step: int, values: Dict[str, Union[float, str]]) -> None:
        for name, value in values.items():
            if name not in self._metric_names:
                if len(self._metric_names) >= MAX_METRIC_NAMES:
                    self._over(rs, "metrics", f"torchdist: this run has {MAX_METRIC_NAMES} distinct metric names "
                                              f"already; rank {rs.rank}'s {name!r:.60} and any newer names are not "
                                              "kept (report() a name per quantity, with the step as step=)")
                    continue
                self._metric_names.add(name)
            if isinstance(value, str):  # a non-finite value: shown, not plotted
                continue
            rs.metrics[name] = value
            points = rs.history.get(name)
            if points is None:
                points = rs.history[name] = []
            points.append((step, value))
            if len(points) > self.max_points:
                del points[-2::-2]  # halve the resolution; keep the first and newest points

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
                rs.rank, e.code, host=rs.host, time=rs.ended, reported=e.failure,
                # the rank's lines seen live; else those its task sent back with the failure
                log_tail=[line.text for line in rs.logs[max(len(rs.logs) - 20, self._attempt_lines[rs.rank][-1]):]])

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
        rs.logs.append(LogLine("stderr", f"torchdist: ignored a record of type {e.type or '?'} "
                                         f"({type(e).__name__}): this version of the driver has no handler "
                                         "for it; later ones are ignored silently"))

    HANDLERS = {
        events.Started: _on_started, events.Log: _on_log, events.Progress: _on_progress,
        events.Metrics: _on_metrics, events.Dropped: _on_dropped, events.Exit: _on_exit,
        events.Stacks: _on_stacks, events.SystemMetrics: _on_system, events.Collectives: _on_collectives,
        events.Preflight: _on_preflight,
        events.Stacks: _on_stacks, events.SystemMetrics: _on_system, events.StepSplit: _on_step_split,
        events.Checkpoint: _on_checkpoint,
    }

    def restart(self) -> None:
        """End the current attempt (its root cause is the first of ``failures()``) and start the
        next: fresh rank states, the logs kept."""
        with self._lock:
            failures = self.failures()
            now = time.time()
            self.attempts.append(Attempt(self.attempt, self.attempt_started, now,
                                         failures[0] if failures else None, failures,
                                         first_work=self.first_work, checkpoint=self.last_checkpoint,
                                         data_stall_s=self._data_stall()))
            self.first_work = self.last_checkpoint = None
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

    def finish(self, state: str, failure: Optional[Failure] = None, message: str = "") -> None:
        with self._lock:
            if self.ended is not None:
                return
            self.state = state
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
            self.stacks = {rs.rank: events.Stacks(rank=rs.rank, time=now, note=f"had exited with code {rs.exit_code}")
                           for rs in self.ranks if rs.exit_code is not None}
            self.stacks.update({r: events.Stacks(rank=r, time=now, note="idle: not one of the run's --ranks")
                                for r in self.idle_ranks})
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

    # -- reading -------------------------------------------------------------------------
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
            attempts = [AttemptTimes(a.started, a.ended, a.first_work, a.checkpoint, a.data_stall_s)
                        for a in self.attempts]
            attempts.append(AttemptTimes(self.attempt_started, end, self.first_work, self.last_checkpoint,
                                         self._data_stall()))
            return goodput(self.started, end, attempts, ranks=self.num_processes - len(self.idle_ranks),
                           use_gpu=self.use_gpu, hang_lost_s=self.hang_lost_s)

    def stragglers(self) -> List[Straggler]:
        """Ranks of the current attempt that step well below the others' pace or fall behind
        them, for several seconds (``stragglers`` names the thresholds): ``(rank, host, why)``
        by rank.  After the run, those that were listed when it ended."""
        with self._lock:
            return self._pace.stragglers([rs.host for rs in self.ranks], check=self.ended is None)

    def running(self) -> List[int]:
        """The ranks of the current attempt that have not exited."""
        with self._lock:
            return [rs.rank for rs in self.ranks
                    if rs.exit_code is None and rs.state not in ("done", "failed", "cancelled")]

    def all_exited(self) -> bool:
        with self._lock:
            return all(rs.exit_code is not None or rs.state in ("done", "failed", "cancelled", "idle")
                       for rs in self.ranks)

    def all_exited_ok(self) -> bool:
        with self._lock:
            return all(rs.exit_code == 0 or rs.state == "idle" for rs in self.ranks)

    def snapshot(self, since: Optional[int] = None) -> RunSnapshot:
        """The run and every rank as they are now, copied at once; ``changed`` names the ranks
        changed after version ``since`` (every rank when ``since`` is None)."""
        with self._lock:
            ranks = tuple(RankSnapshot(
                rank=rs.rank, host=rs.host, pid=rs.pid, state=rs.state, exit_code=rs.exit_code,
                started=rs.started, ended=rs.ended, progress={k: dict(b) for k, b in rs.progress.items()},
                metrics=dict(rs.metrics), dropped=rs.dropped, failure=rs.failure, log_lines=len(rs.logs),
                system=dict(rs.system), step_time=rs.step_time,
                step_split=None if rs.step_split is None else dict(rs.step_split))
                for rs in self.ranks)
            changed = frozenset(r for r, v in enumerate(self._rank_versions) if since is None or v > since)
            now = self._pace.clock()
            quiet = tuple(None if seen is None else now - seen for seen in self._pace.last_seen)
            return RunSnapshot(
                version=self.version, run_id=self.run_id, num_processes=self.num_processes, backend=self.backend,
                use_gpu=self.use_gpu, job_name=self.job_name, state=self.state, started=self.started,
                ended=self.ended, failure=self.failure, message=self.message, attempt=self.attempt,
                max_attempts=self.max_attempts, attempts=tuple(self.attempts), ranks=ranks,
                stacks=dict(self.stacks), changed=changed, quiet=quiet, tracking=self.tracking,
                refusals=tuple(Refusal(r.kind, r.count, r.rank, r.detail) for r in self.refusals.values()),
                verdict=self.verdict, preflight=dict(self.preflight),
                goodput=self.goodput(),
                stragglers=tuple(self._pace.stragglers([rs.host for rs in self.ranks], check=self.ended is None)))

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

    def recent_log(self, rank: int, limit: int) -> LogRead:
        """Up to ``limit`` of ``rank``'s newest lines, from memory only (what a view scans)."""
        self._check_rank(rank)
        with self._lock:
            store = self._logs[rank]
            lines = store.recent(limit)
            return LogRead(rank, len(store) - len(lines), lines, len(store), self.ranks[rank].state)

    def metric_history(self, points: Optional[int] = None, ranks: Optional[Iterable[int]] = None,
                       names: Optional[Iterable[str]] = None) -> Dict[str, Dict[int, List[Tuple[int, float]]]]:
        """``{metric: {rank: [(step, value), ...]}}`` of the current attempt, copied; metrics in
        order of first report, ranks that reported the metric only.  ``points``: about that many
        of each rank's points, evenly spread, the newest kept (a slice per rank: the lock is held
        for what is copied, not for the whole history); ``ranks``, ``names``: those only."""
        names = None if names is None else set(names)
        with self._lock:
            history: Dict[str, Dict[int, List[Tuple[int, float]]]] = {}
            for rs in (self.ranks if ranks is None else [self.ranks[r] for r in ranks]):
                for name, kept in rs.history.items():
                    if names is not None and name not in names:
                        continue
                    if points is not None and len(kept) > points:
                        last = kept[-1]
                        kept = kept[::-(-len(kept) // points)]
                        if kept[-1] is not last:
                            kept.append(last)
                    history.setdefault(name, {})[rs.rank] = list(kept)
            return history

    def system_history(self, rank: int, points: Optional[int] = None) -> List[Dict[str, float]]:
        """``rank``'s system samples of the current attempt, oldest first, each a dict of
        ``time`` and the plotted keys it had (``SYSTEM_HISTORY_KEYS``); ``points``: about that
        many, evenly spread, the newest kept."""
        self._check_rank(rank)
        with self._lock:
            kept = self.ranks[rank].system_samples
            if points is not None and len(kept) > points:
                last = kept[-1]
                kept = kept[::-(-len(kept) // points)]
                if kept[-1] is not last:
                    kept.append(last)
            kept = list(kept)
        keys = ("time",) + SYSTEM_HISTORY_KEYS
        return [{k: v for k, v in zip(keys, sample) if v is not None} for sample in kept]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_processes:
            raise IndexError(f"rank {rank} is not in this run (ranks 0..{self.num_processes - 1})")

    def logs(self, rank: int, attempt: Optional[int] = None) -> str:
        """Everything ``rank`` printed, in order: in every attempt, or in attempt ``attempt``
        (1 for the first)."""
        self._check_rank(rank)
        with self._lock:
            if attempt is None:
                return self._logs[rank].text()
            if not 1 <= attempt <= self.attempt:
                raise IndexError(f"attempt {attempt} is not in this run (attempts 1..{self.attempt})")
            bounds = self._attempt_lines[rank] + [None]
            return self._logs[rank].text(bounds[attempt - 1], bounds[attempt])
