"""Backends start a job's ranks somewhere and report back through the same events.

Every backend implements ``base.Backend`` and returns a ``base.BackendRun``; the distributor
drives both the same way (check, start, watch events, stop, fetch results, close), so the local
backend and the Spark backends pass the same contract tests.  The modules, bottom first (each
imports only those above it in this list):

- ``base``: the interface (``Backend``, ``BackendRun``, ``LaunchPlan``, ``LaunchContext``)
- ``local``: N worker processes on this machine
- ``spark_task``: what runs inside a Spark executor (the barrier task, its guard, the Arrow task)
- ``spark_stage``: the driver's side of a barrier stage, shared by classic Spark and Connect
- ``spark_python``: which interpreter the executors run the ranks on
- ``spark_classic``, ``spark_connect``: the two Spark flavours, thin on top of ``spark_stage``
- this module: ``make_backend``, the factory
"""

from __future__ import annotations

import sys

from ..core.options import LaunchOptions
from .base import Backend, BackendRun, LaunchContext, LaunchPlan
from .local import LocalProcessBackend
from .spark_classic import SparkBarrierBackend
from .spark_connect import SparkConnectBackend
from .spark_stage import is_spark_connect

__all__ = ["Backend", "BackendRun", "LaunchContext", "LaunchPlan", "make_backend", "active_spark_session"]

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
    session = active_spark_session()
    kind = options.backend
    if kind == "auto":
        kind = "spark" if session is not None else "local"
    if kind == "local":
        return LocalProcessBackend()
    if session is None:
        raise ValueError(NO_SESSION)
    if is_spark_connect(session):
        return SparkConnectBackend(session)
    return SparkBarrierBackend(session)


def active_spark_session():
    """The active classic SparkSession, else the active Spark Connect session, else None."""
    if "pyspark" not in sys.modules:  # no session can be active if pyspark was never imported
        return None
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is None and "pyspark.sql.connect.session" in sys.modules:
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        session = ConnectSession.getActiveSession()
    return session
