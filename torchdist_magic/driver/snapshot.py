"""What a ``RunState``'s readers get: the run and its ranks as they were at one moment
(``RunSnapshot``, ``RankSnapshot``: copies, safe to read in any thread), its earlier attempts
(``Attempt``) and what its channel refused (``Refusal``); and which of a rank's bars a view shows
(``ShownBars``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Tuple

from ..core import events
from ..core.culprit import Verdict
from ..core.failure import Failure
from ..core.faults import Exclusion, Fault
from .rootcause import root_cause_first
from .stragglers import Straggler

#: the keys of a system sample its history keeps (what the views plot), in this order
SYSTEM_HISTORY_KEYS = ("cpu_percent", "rss_bytes", "gpu_memory_used_bytes", "gpu_util_percent")


class ShownBars:
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


@dataclass(frozen=True)
class RankSnapshot(ShownBars):
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
    log_lines: int  # lines in its log (every attempt's) at that moment
    system: Dict[str, float] = field(default_factory=dict)  # the latest system sample
    step_time: Optional[float] = None  # seconds per step, smoothed
    step_split: Optional[Dict[str, float]] = None  # data/compute/comm shares (``stepsplit``)

    def shown_progress(self) -> List[dict]:
        """``ShownBars.shown_progress``, worked out once per snapshot (a large run's overview
        asks each rank several times, and an unchanged rank's snapshot serves several refreshes)."""
        shown = getattr(self, "_shown", None)
        if shown is None:
            shown = ShownBars.shown_progress(self)
            object.__setattr__(self, "_shown", shown)  # frozen: a cache, not a field
        return shown


@dataclass
class Attempt:
    """One attempt of a run that restarts: when it ran and the failure that ended it."""

    number: int  # 1 for the first start, 2 after the first restart, ...
    started: float
    ended: float
    failure: Optional[Failure]  # the root cause
    failures: List[Failure] = field(default_factory=list)  # every failed rank, root cause first
    first_work: Optional[float] = None  # its first sign of work: code started, a step, a report (``goodput``)
    checkpoint: Optional[float] = None  # when its newest checkpoint arrived
    data_stall_s: float = 0.0  # the longest any of its ranks waited for data
    world_size: int = 0  # how many ranks it ran (``--np MIN:MAX`` may run fewer after a loss)
    fault: Optional[Fault] = None  # its root cause's class (``faults.classify``)


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
    #: the class of the run's root cause once it failed or hung (``faults.Fault``), else None
    fault: Optional[Fault] = None
    #: hosts (executors) the run's restarts left out, and why (``faults.Exclusion``)
    excluded: Tuple[Exclusion, ...] = ()

    @property
    def finished(self) -> bool:
        return self.ended is not None

    def elapsed(self) -> float:
        return (self.ended or time.time()) - self.started

    def failures(self) -> List[Failure]:
        """Failed ranks, root cause first (``RunState.failures``)."""
        return root_cause_first(rs.failure for rs in self.ranks if rs.failure is not None)
