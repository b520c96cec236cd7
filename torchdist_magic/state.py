"""RunState: everything known about one run, built from events; the one model that every view
(text, widget, panel) reads.

Events are plain dicts (they may have crossed the channel as JSON):

``log``      rank, stream ("stdout"/"stderr"), line, cr (True for a ``\\r``-terminated line)
``status``   rank, state, host, pid
``progress`` rank, bar, desc, n, total, elapsed, state
``metrics``  rank, step, values {name: number}
``exit``     rank, code, time, failure (dict of ``FailureInfo`` fields, or absent)
``dropped``  rank, count (events the worker could not queue)
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .errors import FailureInfo

RANK_STATES = ("starting", "running", "done", "failed", "cancelled")
RUN_STATES = ("starting", "running", "succeeded", "failed", "cancelled", "timed out")
MAX_POINTS = 10_000
#: what a rank raises when a *peer* died: never the root cause while another failure is known
COLLATERAL = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crashing|Broken pipe"
    r"|NCCL communicator was aborted|ProcessGroupNCCL.*(watchdog|abort)|recvBytes|sendBytes"
    r"|failed to recv, got 0 bytes|The server socket has failed")


def is_collateral(failure: FailureInfo) -> bool:
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
    failure: Optional[FailureInfo] = None

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
        self.failure: Optional[FailureInfo] = None
        self.message = ""
        self.ranks = [RankState(rank=r) for r in range(num_processes)]
        self.version = 0
        self._lock = threading.RLock()
        self._listeners: List[Callable[["RunState"], None]] = []

    # -- writing -------------------------------------------------------------------------
    def apply(self, event: dict) -> None:
        rank = event.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_processes:
            return
        handler = getattr(self, "_on_" + str(event.get("type")), None)
        if handler is None:
            return
        with self._lock:
            handler(self.ranks[rank], event)
            self.version += 1
        self._notify()

    def _on_log(self, rs: RankState, e: dict) -> None:
        rs.logs.append(LogLine(str(e.get("stream", "stdout")), str(e.get("line", "")), bool(e.get("cr"))))

    def _on_status(self, rs: RankState, e: dict) -> None:
        if e.get("host"):
            rs.host = str(e["host"])
        if isinstance(e.get("pid"), int):
            rs.pid = e["pid"]
        new = e.get("state")
        if new == "running" and rs.state == "starting":
            rs.state = "running"
            rs.started = rs.started or time.time()
            if self.state == "starting":
                self.state = "running"

    def _on_progress(self, rs: RankState, e: dict) -> None:
        bar = str(e.get("bar", ""))
        rs.progress[bar] = {k: e.get(k) for k in ("desc", "n", "total", "elapsed", "state")}
        if rs.state == "starting":
            rs.state = "running"

    def _on_metrics(self, rs: RankState, e: dict) -> None:
        step = e.get("step")
        values = e.get("values")
        if not isinstance(values, dict):
            return
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            rs.metrics[name] = float(value)
            points = rs.history.setdefault(name, [])
            points.append((int(step) if isinstance(step, int) else len(points) + 1, float(value)))
            if len(points) > MAX_POINTS:
                del points[-2::-2]  # halve the resolution; keep the first and newest points

    def _on_exit(self, rs: RankState, e: dict) -> None:
        if rs.state in ("done", "failed", "cancelled") and rs.exit_code is not None:
            return
        code = e.get("code")
        rs.exit_code = code if isinstance(code, int) else None
        rs.ended = float(e.get("time") or time.time())
        if isinstance(e.get("host"), str) and e["host"]:
            rs.host = e["host"]
        if self.ended is not None and rs.state == "cancelled":
            return  # a rank stopped by the run's end: its late exit is not a failure of its own
        if e.get("stopped"):
            rs.state = "cancelled"
        elif code == 0:
            rs.state = "done"
        else:
            rs.state = "failed"
            data = dict(e.get("failure") or {})
            data.setdefault("rank", rs.rank)
            data.setdefault("host", rs.host)
            data.setdefault("exit_code", rs.exit_code)
            data.setdefault("time", rs.ended)
            data["rank"] = rs.rank
            data["log_tail"] = [line.text for line in rs.logs[-20:]]
            rs.failure = FailureInfo.from_dict(data)

    def _on_dropped(self, rs: RankState, e: dict) -> None:
        if isinstance(e.get("count"), int):
            rs.dropped += e["count"]

    def finish(self, state: str, failure: Optional[FailureInfo] = None, message: str = "") -> None:
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
        self._notify()

    # -- reading -------------------------------------------------------------------------
    def subscribe(self, listener: Callable[["RunState"], None]) -> None:
        """``listener(state)`` is called after each change, from the thread that made it."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        for listener in list(self._listeners):
            listener(self)

    @property
    def finished(self) -> bool:
        return self.ended is not None

    def elapsed(self) -> float:
        return (self.ended or time.time()) - self.started

    def failures(self) -> List[FailureInfo]:
        """Failed ranks, root cause first: the earliest failure that is not merely a peer
        noticing that another rank went away (clocks of different hosts may disagree)."""
        with self._lock:
            found = [rs.failure for rs in self.ranks if rs.failure is not None]
        return sorted(found, key=lambda f: (is_collateral(f), f.time, f.rank))

    def all_exited_ok(self) -> bool:
        with self._lock:
            return all(rs.exit_code == 0 for rs in self.ranks)

    def logs(self, rank: int) -> str:
        if not 0 <= rank < self.num_processes:
            raise IndexError(f"rank {rank} is not in this run (ranks 0..{self.num_processes - 1})")
        with self._lock:
            return self.ranks[rank].log_text()
