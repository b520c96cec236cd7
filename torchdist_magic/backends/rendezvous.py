"""The driver's side of the ranks' meeting, for launchers that join the run's channel."""

from __future__ import annotations

import threading
from typing import Dict, Optional

from ..core import events
from .base import LaunchContext


class DriverRendezvous:
    """The driver's side of the launchers' rendezvous (``launch.remote.rendezvous``): collects
    every launcher's ``Joined`` and, once all ranks have joined, sends them all the ``Peers``.
    With ``fallback`` (seconds), when not all join within that time of the first one, tells
    them to meet by their backend's own means (Spark's barrier: ``Site.gather``)."""

    def __init__(self, ctx: LaunchContext, num_processes: int, fallback: Optional[float] = None):
        self._ctx = ctx
        self._fallback = fallback
        self._n = num_processes
        self._lock = threading.Lock()
        self._joined: Dict[int, events.Joined] = {}
        self._placed = False  # Peers were sent (or the barrier chosen)
        self._timer: Optional[threading.Timer] = None
        ctx.routes[events.Joined] = self._on_joined

    def _on_joined(self, record: events.Joined) -> None:
        with self._lock:
            if self._placed or not 0 <= record.rank < self._n:
                return
            self._joined[record.rank] = record
            if len(self._joined) < self._n:
                if self._timer is None and self._fallback is not None:
                    self._timer = threading.Timer(self._fallback, self._use_barrier)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._placed = True
            peers = [self._joined[r] for r in range(self._n)]
        self._ctx.to_ranks(events.Peers(rank=-1, peers=peers))

    def _use_barrier(self) -> None:
        with self._lock:
            if self._placed:
                return
            self._placed = True
        self._ctx.to_ranks(events.Peers(rank=-1, use_barrier=True))

    @property
    def placed(self) -> bool:
        """The tasks were sent their ``Peers`` (or told to use the barrier)."""
        return self._placed

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
