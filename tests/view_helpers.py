"""What the view tests share: a fake run and short ways to feed its ``RunState`` events."""

from __future__ import annotations

import time

from torchdist_magic import events
from torchdist_magic.state import RunState


class FakeRun:
    """What a view needs of a ``Run``: its state and ``cancel()`` (counted)."""

    def __init__(self, num_processes=2):
        self.run_id = "7-cafe"
        self.state = RunState(self.run_id, num_processes, backend="local processes on testhost",
                              job_name="cell In[3]")
        self.cancelled = 0
        self.cancelled_by = ""

    def cancel(self, by="cancel()"):
        self.cancelled += 1
        self.cancelled_by = by


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def feed(state, *records):
    for record in records:
        state.apply(record)


def running(state, rank, host="node-a"):
    feed(state, events.Started(rank=rank, host=host, pid=100 + rank))


def bar(state, rank, n, total, desc="epoch", bar_id=None, state_="running", elapsed=2.0):
    feed(state, events.Progress(rank=rank, bar=bar_id or f"{desc}#0", desc=desc, n=n, total=total,
                                elapsed=elapsed, state=state_))


def metrics(state, rank, step, **values):
    feed(state, events.Metrics(rank=rank, step=step, values=values))


def log(state, rank, text, cr=False, stream="stdout"):
    feed(state, events.Log(rank=rank, stream=stream, line=text, cr=cr))


def exit_(state, rank, code, exc_type="", message="", stopped=False):
    failure = events.Failure(exc_type=exc_type, message=message) if exc_type else None
    feed(state, events.Exit(rank=rank, code=code, time=time.time(), stopped=stopped, failure=failure))
