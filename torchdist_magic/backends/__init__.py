"""Backends start a job's ranks somewhere and report back through the same events.

Every backend implements ``Backend`` and returns a ``BackendRun``; the distributor drives both
the same way (start, watch events, stop, fetch results, close), so the local backend and the
Spark backend pass the same contract tests.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Optional

from ..options import LaunchOptions


@dataclass
class LaunchContext:
    """What a backend needs to start one run."""

    run_id: str
    options: LaunchOptions
    job_bytes: bytes
    emit: Callable[[dict], None]      # feed an event into the run's RunState
    channel_address: str              # host:port of the driver's event channel
    secret: str


class BackendRun(abc.ABC):
    """A started run.  ``exit`` events (one per rank) arrive through ``LaunchContext.emit``."""

    @abc.abstractmethod
    def stop(self, grace: float) -> None:
        """Stop every rank still running: signal, wait until ``grace`` seconds, then kill."""

    @abc.abstractmethod
    def result(self, rank: int) -> Optional[bytes]:
        """The pickled value of ``rank`` (after it exited with 0), or ``None`` if it has none."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything the run holds (processes, ports, files, Spark jobs).  Idempotent."""


class Backend(abc.ABC):
    name = "backend"

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the run header, e.g. ``local processes on host``."""

    def channel_host(self) -> str:
        """Address the driver's event channel listens on, reachable from the ranks."""
        return "127.0.0.1"

    def check(self, options: LaunchOptions) -> None:
        """Raise ``ValueError`` before anything starts if the run cannot be placed."""

    @abc.abstractmethod
    def start(self, ctx: LaunchContext) -> BackendRun:
        """Start every rank.  A failed start releases whatever it had opened before raising."""


def make_backend(options: LaunchOptions) -> Backend:
    """The backend for ``options.backend``; ``auto`` picks Spark when a session is active."""
    kind = options.backend
    if kind == "auto":
        kind = "spark" if _active_spark_session() is not None else "local"
    if kind == "local":
        from .local import LocalProcessBackend

        return LocalProcessBackend()
    from .spark import SparkBarrierBackend

    return SparkBarrierBackend()


def _active_spark_session():
    import sys

    if "pyspark" not in sys.modules:  # no session can be active if pyspark was never imported
        return None
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession()
