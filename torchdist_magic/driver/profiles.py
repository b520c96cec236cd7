"""A run's profile (``--profile STEPS``, ``profile=``): every rank's ``torch.profiler`` trace of
the same steps (``rankprofile``), merged into one Chrome trace that Perfetto and
``chrome://tracing`` open, one process per rank named ``rank N``.

``ProfileCollector`` takes an attempt's ``events.ProfilePiece`` and ``events.ProfileDone``
records in the channel's thread (a route of its own, not the ``RunState``'s): each piece is
appended to its rank's file in the run's directory.  Once every rank's profile is done,
``profile()`` merges them (once) into ``trace.json`` beside them.  Clocks: each rank's events are
placed on the wall clock of its machine (torch's ``baseTimeNanoseconds`` plus the event's time),
so ranks on one machine line up exactly and ranks on several as well as their clocks agree.  A
rank whose trace was too large to send keeps it on its machine: the summary says where.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

from ..core import events

#: the merged trace's file name, in the profile's directory
TRACE_FILE = "trace.json"


@dataclass
class RankProfile:
    """One rank's profile summary."""

    rank: int
    steps: int
    top: List[events.ProfileOp]
    peak_memory_bytes: float
    peak_gpu_memory_bytes: Optional[float] = None
    #: the rank's step split when its profile was read (``RunState``'s ``step_split``)
    step_split: Optional[Dict[str, float]] = None
    kept_at: str = ""  # where its trace stays, when it was too large to send
    error: str = ""  # why it has no profile

    def text(self) -> str:
        """``rank 1: 5 steps · data 62% compute 35% comm 3% · peak memory 1.2 GiB · top:
        aten::mm 41 ms (12), ...``"""
        if self.error:
            return f"rank {self.rank}: no profile: {self.error}"
        parts = [f"rank {self.rank}: {self.steps} steps"]
        if self.step_split:
            parts.append(" ".join(f"{k} {self.step_split.get(k, 0.0) * 100:.0f}%" for k in ("data", "compute", "comm")))
        memory = f"peak memory {_bytes(self.peak_memory_bytes)}"
        if self.peak_gpu_memory_bytes is not None:
            memory += f", GPU {_bytes(self.peak_gpu_memory_bytes)}"
        parts.append(memory)
        if self.top:
            parts.append(
                "top: " + ", ".join(f"{op.name} {op.self_cpu_s * 1000:.3g} ms ({op.calls})" for op in self.top[:3])
            )
        if self.kept_at:
            parts.append(f"trace too large to send, kept at {self.kept_at}")
        return " · ".join(parts)


@dataclass
class Profile:
    """A run's profile: ``trace_path`` (the merged Chrome trace; "" until every rank's profile
    came), ``summary`` (by rank), ``waiting`` (the ranks whose profile has not come yet)."""

    trace_path: str
    summary: Dict[int, RankProfile]
    waiting: List[int] = field(default_factory=list)

    def lines(self) -> List[str]:
        """What a view shows of it: where the trace is, then a line per rank."""
        if self.trace_path:
            head = f"profile: {self.trace_path} (Perfetto, chrome://tracing)"
        else:
            head = f"profile: waiting for rank{'s' if len(self.waiting) != 1 else ''} " + ", ".join(
                map(str, self.waiting)
            )
        return [head] + [self.summary[r].text() for r in sorted(self.summary)]


class ProfileCollector:
    """One attempt's profiles (see the module's docstring): ``take`` in the channel's thread,
    ``profile`` in any."""

    def __init__(self, directory: Callable[[], str], ranks: Iterable[int]):
        self._directory = directory
        self._ranks = sorted(ranks)
        self._lock = threading.Lock()
        self._done: Dict[int, events.ProfileDone] = {}
        self._files: Dict[int, str] = {}
        self._merged = ""

    def take(self, record: events.Event) -> None:
        with self._lock:
            if isinstance(record, events.ProfilePiece):
                path = self._files.get(record.rank)
                if path is None:
                    path = self._files[record.rank] = os.path.join(self._directory(), f"rank-{record.rank}.json")
                with open(path, "a", encoding="utf-8") as fh:
                    fh.write(record.data)
            elif isinstance(record, events.ProfileDone):
                self._done[record.rank] = record

    def profile(self, splits: Optional[Dict[int, Optional[Dict[str, float]]]] = None) -> Optional[Profile]:
        """The profile so far (None before any rank's is done); ``splits``: each rank's step split."""
        splits = splits or {}
        with self._lock:
            if not self._done:
                return None
            summary = {
                r: RankProfile(
                    r,
                    d.steps,
                    list(d.top),
                    d.peak_memory_bytes,
                    d.peak_gpu_memory_bytes,
                    splits.get(r),
                    d.kept_at,
                    d.error,
                )
                for r, d in self._done.items()
            }
            waiting = [r for r in self._ranks if r not in self._done]
            if not waiting and not self._merged:
                traces = {
                    r: self._files[r]
                    for r, d in sorted(self._done.items())
                    if not d.error and not d.kept_at and r in self._files
                }
                if traces:
                    self._merged = os.path.join(self._directory(), TRACE_FILE)
                    merge_traces(traces, self._merged)
            return Profile(self._merged, summary, waiting)


def merge_traces(traces: Dict[int, str], out: str) -> None:
    """Write one Chrome trace at ``out`` of the rank traces ``{rank: path}``: each rank a process
    named ``rank N`` (sorted by rank), its events on the wall clock (see the module's docstring)."""
    loaded = {}
    for rank, path in traces.items():
        with open(path, encoding="utf-8") as fh:
            loaded[rank] = json.load(fh)
    base = min(int(t.get("baseTimeNanoseconds", 0)) for t in loaded.values())
    merged: List[dict] = []
    for rank, trace in sorted(loaded.items()):
        shift = (int(trace.get("baseTimeNanoseconds", 0)) - base) / 1000.0  # microseconds, as ts
        merged.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        merged.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for event in trace.get("traceEvents", []):
            if event.get("ph") == "M" and event.get("name") in ("process_name", "process_sort_index", "process_labels"):
                continue  # the rank's own names for its process: "rank N" replaces them
            event = dict(event, pid=rank)
            if isinstance(event.get("ts"), (int, float)):
                event["ts"] = event["ts"] + shift
            if "id" in event and event.get("ph") in ("s", "t", "f"):
                event["id"] = f"{rank}:{event['id']}"  # flows of different ranks never join
            merged.append(event)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms", "baseTimeNanoseconds": base}, fh)


def _bytes(value: float) -> str:
    return f"{value / (1 << 20):.0f} MiB" if value < 1 << 30 else f"{value / (1 << 30):.3g} GiB"
