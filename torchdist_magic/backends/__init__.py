"""Backends start a job's ranks somewhere and report back through the same events.

Every backend implements ``Backend`` and returns a ``BackendRun``; the distributor drives both
the same way (start, watch events, stop, fetch results, close), so the local backend and the
Spark backend pass the same contract tests.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

from .. import events
from ..options import LaunchOptions
from ..rankenv import RunSpec


@dataclass
class LaunchContext:
    """What a backend needs to start one run."""

    spec: RunSpec
    job_bytes: bytes
    emit: Callable[[events.Event], None]       # feed a record into the run's RunState
    to_ranks: Callable[[events.Event], int]    # send a record to every rank's launcher
    #: where records the backend takes for itself (``events.LAUNCHER_TO_DRIVER``) go, by type;
    #: the backend fills it in ``start``
    routes: Dict[type, Callable[[events.Event], None]] = field(default_factory=dict)


class BackendRun(abc.ABC):
    """A started run.  ``Exit`` records (one per rank) arrive through ``LaunchContext.emit``."""

    @abc.abstractmethod
    def stop(self, grace: float) -> None:
        """Stop every rank still running: signal, wait until ``grace`` seconds, then kill."""

    def dump_stacks(self) -> None:
        """Ask every running rank for its threads' stacks; each answers with an
        ``events.Stacks`` record through ``LaunchContext.emit`` (a backend that cannot, none)."""

    @abc.abstractmethod
    def result(self, rank: int) -> Optional[bytes]:
        """The pickled value of ``rank`` (after it exited with 0), or ``None`` if it has none."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything the run holds (processes, ports, files, Spark jobs).  Idempotent."""

    def ranks_alive(self) -> bool:
        """Whether every rank's process is still there (a warm pool asks before each job)."""
        return True


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

    #: whether a run on this backend needs an event channel of its own (a warm pool has one)
    needs_channel = True

    @abc.abstractmethod
    def start(self, ctx: LaunchContext) -> BackendRun:
        """Start every rank.  A failed start releases whatever it had opened before raising."""

    def release(self) -> None:
        """The run that used this backend has ended (whether or not ``start`` was called)."""


NO_SESSION = (
    "backend 'spark' (--spark, local_mode=False) runs on the active SparkSession (classic or "
    "Spark Connect), and this "
    "process has none. Start one first, e.g.:\n"
    "    from pyspark.sql import SparkSession\n"
    "    spark = SparkSession.builder.master(\"local[2]\").getOrCreate()\n"
    "or run on local processes (--local, local_mode=True)")


def make_backend(options: LaunchOptions) -> Backend:
    """The backend for ``options.backend``; ``auto`` picks Spark when a session is active.

    ``spark`` without an active SparkSession is refused (``ValueError``) rather than starting
    one: a session started here would silently take ``local[*]`` and many seconds.
    """
    session = _active_spark_session()
    kind = options.backend
    if kind == "auto":
        kind = "spark" if session is not None else "local"
    if kind == "local":
        from .local import LocalProcessBackend

        return LocalProcessBackend()
    if session is None:
        raise ValueError(NO_SESSION)
    from .spark import SparkBarrierBackend, is_spark_connect

    if is_spark_connect(session):
        from .spark_connect import SparkConnectBackend

        return SparkConnectBackend(session)
    return SparkBarrierBackend(session)


def _active_spark_session():
    """The active classic SparkSession, else the active Spark Connect session, else None."""
    import sys

    if "pyspark" not in sys.modules:  # no session can be active if pyspark was never imported
        return None
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is None and "pyspark.sql.connect.session" in sys.modules:
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        session = ConnectSession.getActiveSession()
    return session
