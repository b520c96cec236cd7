"""Spark Connect backend: the ranks as one barrier stage of a Spark Connect session.

A Connect session (Databricks shared and serverless clusters, Databricks Connect, Spark 4's
``SparkSession.builder.remote(...)``) has no SparkContext, so the stage is a DataFrame:
``spark.range(n, numPartitions=n).mapInArrow(task, schema, barrier=True)``.  Inside each task
``BarrierTaskContext`` works as in a classic stage, and the task runs its rank exactly as the
classic backend's does (``spark.run_barrier_task``): the same launcher, guard process, channel
rendezvous and ``Stop``.

What comes back through the stage itself, so that a run works where the executors cannot reach
the notebook (a laptop on Databricks Connect): each task's ``Exit`` and, when its channel to the
driver was lost, its last lines of output; rank 0's value (every rank's with ``all_ranks``) in
rows of at most ``CHUNK`` bytes.  A rank that fails makes its task raise with its encoded
``Exit``: the barrier stage fails at once, Spark kills the other tasks (their guards stop their
ranks), and the driver reads the failing rank's own exception and traceback from the error,
with no timeout involved.

Cancel and timeout: ``Stop`` over the channel when it is there, and the stage's job tag
(``SparkSession.interruptTag``) in any case.
"""

from __future__ import annotations

import functools
import socket
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

from .. import events
from ..options import LaunchOptions
from . import Backend, LaunchContext
from .spark import FAILURE_MARK, BarrierStageRun, BarrierTaskSpec, run_barrier_task, spark_failure
from .spark_python import InterpreterMismatch, check_connect_python

#: bytes of a value per result row: well under Spark Connect's default gRPC message limit
#: (``spark.connect.grpc.maxInboundMessageSize``, 128 MiB) and its Arrow batch size
CHUNK = 4 * 1024 * 1024
SCHEMA = "rank int, kind string, chunk binary"


class RankExited(Exception):
    """Raised by a task whose rank failed: its message carries the rank's ``Exit`` as JSON."""


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


class SparkConnectBackend(Backend):
    """Runs the ranks as one barrier stage of ``spark``, a Spark Connect session."""

    name = "spark"
    #: the run's DataFrame (a ``data.PreparedData``), set before ``start`` for a data run
    data = None

    def __init__(self, spark):
        self.spark = spark

    def describe(self) -> str:
        return f"Spark Connect barrier stage on {self._conf('spark.master', '?')}"

    def _conf(self, key: str, default: str) -> str:
        # no default passed to conf.get: over Connect it would hide the server's own value
        try:
            return self.spark.conf.get(key) or default
        except Exception:  # a conf the server does not set or expose to its clients
            return default

    def channel_host(self) -> str:
        return address_towards(remote_host(self.spark))

    def slots(self) -> int:
        """Tasks the cluster runs at once: its default parallelism (what ``spark.range``
        splits into by default) over ``spark.task.cpus``."""
        from pyspark.sql import functions as F

        parts = self.spark.range(0, 1 << 20).select(F.spark_partition_id().alias("p")).agg(F.max("p")).first()[0]
        cpus = max(1, int(self._conf("spark.task.cpus", "1")))
        return (parts + 1) // cpus

    def check(self, options: LaunchOptions) -> None:
        if options.use_gpu and not self._conf("spark.task.resource.gpu.amount", ""):
            raise ValueError(
                "use_gpu/--gpu needs GPUs assigned to Spark tasks, but spark.task.resource.gpu.amount "
                "is not set on the Spark Connect server's cluster")
        n = options.num_processes
        slots = self.slots()
        if slots < n:
            raise ValueError(
                f"{n} ranks need {n} Spark task slots at once (a barrier stage starts all its "
                f"tasks together), but the Spark Connect server's cluster has {slots}; use {slots} "
                "or fewer ranks, or add executors")
        try:
            check_connect_python(self.spark, n)
        except InterpreterMismatch:
            raise
        except Exception as exc:  # the probe stage itself failed: say what Spark said
            _, failure = spark_failure(exc)
            raise InterpreterMismatch(
                f"the Spark Connect server's executors could not run a Python check: "
                f"{failure.exc_type}: {failure.message}") from None

    def start(self, ctx: LaunchContext) -> "SparkConnectRun":
        spec = BarrierTaskSpec(run=ctx.spec, job_bytes=ctx.job_bytes,
                               data_schema=self.data.schema if self.data is not None else None)
        run = SparkConnectRun(self.spark, spec, ctx, functools.partial(run_connect_task, spec),
                              self.data.frame if self.data is not None else None)
        run.launch()
        return run


@dataclass
class _Rows:
    """A stage's result rows, sorted out by rank."""

    exits: Dict[int, events.Exit]
    values: Dict[int, bytes]
    logs: Dict[int, List[str]]


def sort_rows(rows) -> _Rows:
    exits: Dict[int, events.Exit] = {}
    pieces: Dict[int, List[bytes]] = {}
    logs: Dict[int, List[str]] = {}
    for row in rows:
        rank, kind, chunk = row["rank"], row["kind"], bytes(row["chunk"])
        if kind == "exit":
            record = events.loads(chunk)
            if isinstance(record, events.Exit):
                exits[rank] = record
        elif kind == "value":
            pieces.setdefault(rank, []).append(chunk)
        elif kind == "log":
            logs.setdefault(rank, []).append(chunk.decode("utf-8", "replace"))
    return _Rows(exits, {r: b"".join(p) for r, p in pieces.items()}, logs)


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
        except Exception as exc:
            self._failed(exc)
            return
        finally:
            spark.removeTag(self.job_tag)
        self._deliver(rows.values, rows.exits, rows.logs)

    def _interrupt(self) -> None:
        self._spark.interruptTag(self.job_tag)


def data_stage(frame, n: int, task: Callable, partitions: Optional[int] = None):
    """The barrier stage of a data run (classic or Connect): one partition of ``frame`` per
    rank (no repartition when it has ``partitions == n`` already), each read by its rank's
    task (``task``, a ``run_connect_task``)."""
    if partitions != n:
        frame = frame.repartition(n)
    return frame.mapInArrow(task, SCHEMA, barrier=True)


# -- task side --------------------------------------------------------------------------------

def run_connect_task(spec: BarrierTaskSpec, batches: Iterator) -> Iterator:
    """One barrier task of a Connect stage, or of any data run's stage (a ``mapInArrow``
    function): run one rank and yield its exit, its output's last lines when the driver could
    not hear them, and its value.  The input rows are the rank's data in a data run."""
    import pyarrow as pa

    if spec.data_schema is None:
        for _ in batches:  # the input rows only make one task per rank
            pass
    outcome = run_barrier_task(spec, batches)[0]
    rank, value, exit_json = outcome.rank, outcome.value, outcome.exit_json
    exit_record = events.decode(exit_json)
    if exit_record.code not in (0, None) and not exit_record.stopped:
        raise RankExited(FAILURE_MARK + events.dumps(exit_record))
    rows = [(rank, "exit", events.dumps(exit_record).encode())]
    if outcome.channel_lost:
        rows += [(rank, "log", line.encode()) for line in outcome.log_tail]
    if value is not None:
        rows += [(rank, "value", value[i:i + CHUNK]) for i in range(0, len(value), CHUNK)] or [(rank, "value", b"")]
    for rank_, kind, chunk in rows:
        yield pa.RecordBatch.from_pydict({"rank": [rank_], "kind": [kind], "chunk": [chunk]},
                                         schema=pa.schema([("rank", pa.int32()), ("kind", pa.string()),
                                                           ("chunk", pa.binary())]))
