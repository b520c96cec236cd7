"""RunState: everything known about one run, built from ``events`` records; the one model
that every view (text, widget, panel) reads.

``apply`` takes the records a rank or its launcher sends (``Started``, ``Log``, ``Progress``,
``Metrics``, ``Dropped``, ``Exit``), each through the handler ``HANDLERS`` names for its type.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from . import events
from .events import Failure

MAX_POINTS = 10_000
#: what a rank raises when a *peer* died: never the root cause while another failure is known
COLLATERAL = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crashing|Broken pipe"
    r"|NCCL communicator was aborted|ProcessGroupNCCL.*(watchdog|abort)|recvBytes|sendBytes"
    r"|failed to recv, got 0 bytes|The server socket has failed")


def is_collateral(failure: Failure) -> bool:
    return bool(failure.exc_type) and bool(COLLATERAL.search(failure.message))


@dataclass
class LogLine:
    stream: str
    text: str
    cr: bool = False


@dataclass
class RankState:
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
    logs: List[LogLine] = field(default_factory=list)
    dropped: int = 0
    failure: Optional[Failure] = None

    def log_text(self) -> str:
        return "".join(line.text + ("\r" if line.cr else "\n") for line in self.logs)

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


class RunState:
    """Thread-safe: channel threads, log readers and the supervisor all ``apply`` events."""

    def __init__(self, run_id: str, num_processes: int, backend: str = "", use_gpu: bool = False,
                 job_name: str = ""):
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
        self.ranks = [RankState(rank=r) for r in range(num_processes)]
        self.version = 0
        self._lock = threading.RLock()

    # -- writing -------------------------------------------------------------------------
    def apply(self, event: events.Event) -> None:
        """Record one event; events of ranks outside the run are ignored."""
        rank = event.rank
        if not 0 <= rank < self.num_processes:
            return
        handler = self.HANDLERS[type(event)]
        with self._lock:
            handler(self, self.ranks[rank], event)
            self.version += 1

    def _on_started(self, rs: RankState, e: events.Started) -> None:
        rs.host = e.host or rs.host
        rs.pid = e.pid or rs.pid
        if rs.state == "starting":
            rs.state = "running"
            rs.started = rs.started or time.time()
            if self.state == "starting":
                self.state = "running"

    def _on_log(self, rs: RankState, e: events.Log) -> None:
        rs.logs.append(LogLine(e.stream, e.line, e.cr))

    def _on_progress(self, rs: RankState, e: events.Progress) -> None:
        rs.progress[e.bar] = {"desc": e.desc, "n": e.n, "total": e.total, "elapsed": e.elapsed,
                              "state": e.state}
        if rs.state == "starting":
            rs.state = "running"

    def _on_metrics(self, rs: RankState, e: events.Metrics) -> None:
        for name, value in e.values.items():
            if isinstance(value, str):  # a non-finite value: shown, not plotted
                continue
            rs.metrics[name] = value
            points = rs.history.setdefault(name, [])
            points.append((e.step, value))
            if len(points) > MAX_POINTS:
                del points[-2::-2]  # halve the resolution; keep the first and newest points

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
            failure = e.failure or Failure(exit_code=e.code)
            rs.failure = dataclasses.replace(
                failure, rank=rs.rank, host=failure.host or rs.host,
                exit_code=failure.exit_code if failure.exit_code is not None else e.code,
                time=failure.time or rs.ended, log_tail=[line.text for line in rs.logs[-20:]])

    HANDLERS = {
        events.Started: _on_started, events.Log: _on_log, events.Progress: _on_progress,
        events.Metrics: _on_metrics, events.Dropped: _on_dropped, events.Exit: _on_exit,
    }

    def finish(self, state: str, failure: Optional[Failure] = None, message: str = "") -> None:
        with self._lock:
            if self.ended is not None:
                return
            self.state = state
            self.failure = failure
            self.message = message
            self.ended = time.time()
            for rs in self.ranks:
                if rs.state in ("starting", "running"):
                    rs.state = "cancelled" if state in ("cancelled", "timed out", "failed") else rs.state
            self.version += 1

    # -- reading -------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.ended is not None

    def elapsed(self) -> float:
        return (self.ended or time.time()) - self.started

    def failures(self) -> List[Failure]:
        """Failed ranks, root cause first: the earliest failure that is not merely a peer
        noticing that another rank went away (clocks of different hosts may disagree)."""
        with self._lock:
            found = [rs.failure for rs in self.ranks if rs.failure is not None]
        return sorted(found, key=lambda f: (is_collateral(f), f.time, f.rank))

    def all_exited(self) -> bool:
        with self._lock:
            return all(rs.exit_code is not None or rs.state in ("done", "failed", "cancelled")
                       for rs in self.ranks)

    def all_exited_ok(self) -> bool:
        with self._lock:
            return all(rs.exit_code == 0 for rs in self.ranks)

    def logs(self, rank: int) -> str:
        if not 0 <= rank < self.num_processes:
            raise IndexError(f"rank {rank} is not in this run (ranks 0..{self.num_processes - 1})")
        with self._lock:
            return self.ranks[rank].log_text()
