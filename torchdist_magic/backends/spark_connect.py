"""Spark Connect backend: the ranks as one barrier stage of a Spark Connect session.

A Connect session (Databricks shared and serverless clusters, Databricks Connect, Spark 4's
``SparkSession.builder.remote(...)``) has no SparkContext, so the stage is a DataFrame:
``spark.range(n, numPartitions=n).mapInArrow(task, schema, barrier=True)``.  Inside each task
``BarrierTaskContext`` works as in a classic stage, and the task runs its rank exactly as the
classic backend's does (``spark_task.run_arrow_task`` around ``run_barrier_task``): the same
launcher, guard process, channel rendezvous and ``Stop``.

What comes back through the stage itself, so that a run works where the executors cannot reach
the notebook (a laptop on Databricks Connect): each task's ``Exit`` and, when its channel to the
driver was lost, its last lines of output; rank 0's value (every rank's with ``all_ranks``) in
rows of at most ``spark_task.CHUNK`` bytes.  A rank that fails makes its task raise with its encoded
``Exit``: the barrier stage fails at once, Spark kills the other tasks (their guards stop their
ranks), and the driver reads the failing rank's own exception and traceback from the error,
with no timeout involved.

Cancel and timeout: ``Stop`` over the channel when it is there, and the stage's job tag
(``SparkSession.interruptTag``) in any case.
"""

from __future__ import annotations

import functools
import socket
from typing import Callable

from .base import LaunchContext
from .spark_python import InterpreterMismatch, check_connect_python
from .spark_stage import BarrierStageRun, SparkStageBackend, data_stage, sort_rows, spark_failure
from .spark_task import SCHEMA, BarrierTaskSpec, run_arrow_task


def remote_host(spark) -> str:
    """The host of the Connect server (the ``host`` of ``sc://host:port``), or ``""``."""
    try:
        return spark.client.host or ""
    except AttributeError:  # a client without it: assume the server is near
        return ""


def address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (the executors are near the server).

    A UDP socket's ``connect`` only picks the route; nothing is sent.
    """
    if host in ("", "localhost") or host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, 9))
            return sock.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class SparkConnectBackend(SparkStageBackend):
    """Runs the ranks as one barrier stage of ``session``, a Spark Connect session."""

    cluster = "the Spark Connect server's cluster"

    def describe(self) -> str:
        return f"Spark Connect barrier stage on {self.conf('spark.master', '?')}"

    def conf(self, key: str, default: str = "") -> str:
        # no default passed to conf.get: over Connect it would hide the server's own value
        try:
            return self.session.conf.get(key) or default
        except Exception:  # a conf the server does not set or expose to its clients  # noqa: BLE001
            return default

    def channel_host(self) -> str:
        return address_towards(remote_host(self.session))

    def ranks_share_machine(self) -> bool:
        """A server on this machine's loopback with a ``local[...]`` master.  (A loopback that is
        a tunnel to another machine would make the ranks fail to find the values' file, naming
        it; nothing here can tell such a tunnel apart.)"""
        host = remote_host(self.session)
        return (host == "localhost" or host.startswith("127.") or host == "::1") and self.conf(
            "spark.master"
        ).strip().startswith("local")

    def slots(self) -> int:
        """Tasks the cluster runs at once: its default parallelism (what ``spark.range``
        splits into by default) over ``spark.task.cpus``."""
        from pyspark.sql import functions as F

        parts = self.session.range(0, 1 << 20).select(F.spark_partition_id().alias("p")).agg(F.max("p")).first()[0]
        cpus = max(1, int(self.conf("spark.task.cpus", "1")))
        return (parts + 1) // cpus

    def check_python(self, num_processes: int) -> None:
        try:
            check_connect_python(self.session, num_processes)
        except InterpreterMismatch:
            raise
        except Exception as exc:  # the probe stage itself failed: say what Spark said  # noqa: BLE001
            _, failure = spark_failure(exc)
            raise InterpreterMismatch(
                f"the Spark Connect server's executors could not run a Python check: "
                f"{failure.exc_type}: {failure.message}"
            ) from None
        return None

    def stage_run(self, spec: BarrierTaskSpec, ctx: LaunchContext, frame) -> "SparkConnectRun":
        return SparkConnectRun(self.session, spec, ctx, functools.partial(run_arrow_task, spec), frame)


class SparkConnectRun(BarrierStageRun):
    """The barrier stage of a Spark Connect session: ``mapInArrow(barrier=True)`` collected
    under a job tag, interrupted with ``interruptTag``."""

    def __init__(self, spark, spec: BarrierTaskSpec, ctx: LaunchContext, task: Callable, frame=None):
        self._spark = spark
        self._frame = frame  # a data run's DataFrame
        super().__init__(spec, ctx, task)

    def _run_stage(self) -> None:
        n = self._spec.run.num_processes
        spark = self._spark
        spark.addTag(self.job_tag)  # a Connect session's tags belong to the thread that adds them
        try:
            if self._stopping:
                return
            if self._frame is not None:  # a Connect DataFrame has no cheap partition count
                frame = data_stage(self._frame, n, self._task)
            else:
                frame = spark.range(0, n, 1, numPartitions=n).mapInArrow(self._task, SCHEMA, barrier=True)
            rows = sort_rows(r.asDict() for r in frame.collect())
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
            return
        finally:
            spark.removeTag(self.job_tag)
        self._deliver(rows.values, rows.exits, rows.logs, rows.value_files)

    def _interrupt(self) -> None:
        self._spark.interruptTag(self.job_tag)
