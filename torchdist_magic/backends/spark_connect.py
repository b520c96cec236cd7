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
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

from .. import events
from ..options import LaunchOptions
from ..timing import SPARK_CANCEL_RETRY, SPARK_CANCEL_WAIT, SPARK_STAGE_END_WAIT, STOP_GRACE
from . import Backend, BackendRun, LaunchContext
from .spark import BarrierTaskSpec, DriverRendezvous, run_barrier_task, spark_failure
from .spark_python import InterpreterMismatch, check_connect_python

#: bytes of a value per result row: well under Spark Connect's default gRPC message limit
#: (``spark.connect.grpc.maxInboundMessageSize``, 128 MiB) and its Arrow batch size
CHUNK = 4 * 1024 * 1024
SCHEMA = "rank int, kind string, chunk binary"
#: how a failed rank's task marks its ``Exit`` in the exception the stage fails with
FAILURE_MARK = "torchdist-rank-exit:"
_FAILURE = re.compile(re.escape(FAILURE_MARK) + r"(\{.*\})")


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
        spec = BarrierTaskSpec(run=ctx.spec, job_bytes=ctx.job_bytes)
        run = SparkConnectRun(self.spark, spec, ctx, functools.partial(run_connect_task, spec))
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


def failure_in(exc: BaseException) -> Optional[events.Exit]:
    """The ``Exit`` a failed rank's task raised with, found in the stage's error text."""
    m = _FAILURE.search(str(exc))
    if m is None:
        return None
    try:
        record = events.loads(m.group(1))
    except events.MalformedEvent:
        return None
    return record if isinstance(record, events.Exit) else None


class SparkConnectRun(BackendRun):
    """The barrier stage of one run: ``collect`` in a thread of its own, under a job tag."""

    def __init__(self, spark, spec: BarrierTaskSpec, ctx: LaunchContext, task: Callable):
        self._spark = spark
        self._spec = spec
        self._ctx = ctx
        self._task = task
        self.job_tag = f"torchdist-{spec.run.run_id}"
        self._lock = threading.Lock()
        self._stopping = False
        self._closed = False
        self._values: Dict[int, bytes] = {}
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run_stage, name=f"torchdist-connect-{spec.run.run_id}",
                                        daemon=True)

    def launch(self) -> None:
        self._rendezvous = DriverRendezvous(self._ctx, self._spec.run.num_processes)
        self._thread.start()

    def _run_stage(self) -> None:
        n = self._spec.run.num_processes
        spark = self._spark
        spark.addTag(self.job_tag)  # a Connect session's tags belong to the thread that adds them
        try:
            if self._stopping:
                return
            frame = spark.range(0, n, 1, numPartitions=n).mapInArrow(self._task, SCHEMA, barrier=True)
            rows = sort_rows(r.asDict() for r in frame.collect())
        except Exception as exc:
            self._error = exc
            if not self._stopping:
                self._report_stage_failure(exc)
            return
        finally:
            spark.removeTag(self.job_tag)
        self._values = rows.values
        for rank in range(n):
            for line in rows.logs.get(rank, ()):
                self._ctx.emit(events.Log(rank=rank, stream="stderr", line=line))
            if rank in rows.exits:
                self._ctx.emit(rows.exits[rank])

    def _report_stage_failure(self, exc: BaseException) -> None:
        """The failing rank's own ``Exit`` when its task raised with it; else Spark's reason as
        one rank's failure.  The other ranks were stopped with the stage."""
        n = self._spec.run.num_processes
        now = time.time()
        failed = failure_in(exc)
        if failed is None:
            rank, failure = spark_failure(exc)
            rank = min(max(rank or 0, 0), n - 1)
            failed = events.Exit(rank=rank, code=1, time=now, host=failure.host,
                                 failure=events.Failure(rank=rank, exit_code=1, time=now, host=failure.host,
                                                        exc_type=failure.exc_type, message=failure.message,
                                                        traceback=failure.traceback))
        if failed.failure is not None:
            for line in failed.failure.log_tail:
                self._ctx.emit(events.Log(rank=failed.rank, stream="stderr", line=line))
        self._ctx.emit(failed)
        for rank in range(n):
            if rank != failed.rank:
                self._ctx.emit(events.Exit(rank=rank, code=None, time=now, stopped=True))

    def dump_stacks(self) -> None:
        """Each task that hears the driver signals its worker and sends the ``Stacks`` back."""
        self._ctx.to_ranks(events.DumpStacks(rank=-1))

    def stop(self, grace: float) -> None:
        """``Stop`` to every task that can hear the driver, then the job tag's interrupt for
        whatever is left (a task that cannot reach the driver, or has not started its rank)."""
        with self._lock:
            self._stopping = True
        stop = events.Stop(rank=-1, grace=grace)
        deadline = time.monotonic() + max(grace, 0.0) + SPARK_STAGE_END_WAIT
        while self._thread.is_alive() and time.monotonic() < deadline:
            if self._ctx.to_ranks(stop) == 0:
                break  # no task hears the driver: interrupting the stage is the only way
            self._thread.join(SPARK_CANCEL_RETRY)
        deadline = time.monotonic() + SPARK_CANCEL_WAIT
        try:
            while self._thread.is_alive() and time.monotonic() < deadline:
                self._spark.interruptTag(self.job_tag)
                self._thread.join(SPARK_CANCEL_RETRY)
        except Exception:  # the session is gone, and with it the stage
            pass

    def result(self, rank: int) -> Optional[bytes]:
        self._thread.join()
        if rank in self._values:
            return self._values[rank]
        if self._error is not None:
            _, reason = spark_failure(self._error)
            raise RuntimeError(f"rank {rank} finished, but Spark could not return its value: "
                               f"{reason.exc_type}: {reason.message}")
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._rendezvous.close()
        if self._thread.is_alive():
            self.stop(STOP_GRACE)


# -- task side --------------------------------------------------------------------------------

def run_connect_task(spec: BarrierTaskSpec, batches: Iterator) -> Iterator:
    """One barrier task of a Connect stage (a ``mapInArrow`` function): run one rank and yield
    its exit, its output's last lines when the driver could not hear them, and its value."""
    import pyarrow as pa

    for _ in batches:  # the input rows only make one task per rank
        pass
    outcome = run_barrier_task(spec, None)[0]
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
