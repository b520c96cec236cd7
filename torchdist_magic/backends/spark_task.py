"""What runs inside a Spark executor: one barrier task per rank (classic, Connect and data runs).

Every Spark flavour's task is a rank's launcher (``launch.remote.run_launcher``, the launcher
every backend's ranks run under), with a ``SparkSite``: the task's rank is its partition, its
address the one Spark knows its executor by, its GPUs those Spark assigned it, its fallback way
to meet the other ranks Spark's barrier ``allGather``, and in a data run its rows the stage's
partition.  A Connect stage and any data run's stage are ``mapInArrow`` functions
(``run_arrow_task``): the same task, its outcome as Arrow rows, and a failed rank raised with
``FAILURE_MARK`` so that the barrier stage fails at once.  A ``Stop`` that reaches one task alone
(``--pdb``) makes its rows or outcome say "stopped", which ends the task without failing the
barrier stage.

Nothing here imports pyspark at module level, and nothing here is driver code: the driver's side
of the stage is ``spark_stage``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

from ..core import events
from ..launch.remote import RemoteSpec, Site, TaskOutcome, run_launcher

#: how a failed rank's task marks its ``Exit`` in the exception its stage fails with
FAILURE_MARK = "torchdist-rank-exit:"
#: bytes of a value per result row of an Arrow stage: well under Spark Connect's default gRPC
#: message limit (``spark.connect.grpc.maxInboundMessageSize``, 128 MiB) and its Arrow batch size
CHUNK = 4 * 1024 * 1024
#: the rows an Arrow stage's task yields
SCHEMA = "rank int, kind string, chunk binary"


class RankExited(Exception):
    """Raised by an Arrow task whose rank failed: its message carries the rank's ``Exit`` as JSON."""


@dataclass
class BarrierTaskSpec(RemoteSpec):
    """Everything a barrier task needs; travels to the executors inside the stage's closure."""

    #: a data run's Arrow schema (serialized), for a task whose partition is empty; else None
    data_schema: Optional[bytes] = None


class SparkSite(Site):
    """Where a barrier task runs, as Spark tells it."""

    def __init__(self, context, batches=None, schema: Optional[bytes] = None):
        super().__init__(context.partitionId())
        self.context = context
        self.batches = batches
        self.schema = schema

    def host(self) -> str:
        """Its host name, and the address its executor binds (``SPARK_LOCAL_IP``) when one is
        set: executors that stand for different hosts on one machine are told apart."""
        bind = os.environ.get("SPARK_LOCAL_IP", "")
        return f"{super().host()}/{bind}" if bind else super().host()

    def address(self) -> str:
        """Its executor's bind address when set, else the address Spark knows the executor by."""
        return os.environ.get("SPARK_LOCAL_IP") or self.context.getTaskInfos()[self.rank].address.rpartition(":")[0]

    def gpus(self) -> Optional[str]:
        resource = self.context.resources().get("gpu")
        return ",".join(resource.addresses) if resource is not None else None

    def gather(self, mine: events.Joined) -> List[events.Joined]:
        return [events.loads(text) for text in self.context.allGather(events.dumps(mine))]

    def data_file(self, workdir: str, stopped: Callable[[], bool]) -> str:
        if self.schema is None:
            return ""
        from ..launch.partitions import write_batches

        path = os.path.join(workdir, "data.arrow")
        write_batches(path, self.batches, self.schema, stopped)
        return path


def run_barrier_task(spec: BarrierTaskSpec, partition) -> List[TaskOutcome]:
    """One barrier task: run one rank, report it live over the channel, and return its outcome.
    A data run's ``partition`` (Arrow batches) is the rank's rows; otherwise it is ignored."""
    from pyspark import BarrierTaskContext

    site = SparkSite(BarrierTaskContext.get(), partition, spec.data_schema)
    return [run_launcher(spec, site)]


def run_arrow_task(spec: BarrierTaskSpec, batches: Iterator) -> Iterator:
    """One barrier task of a ``mapInArrow`` stage (a Connect run, or any data run): run one rank
    and yield its exit, its output's last lines when the driver could not hear them, and its
    value in ``CHUNK``-sized rows.  The input rows are the rank's data in a data run."""
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
    if outcome.value_file:
        rows.append((rank, "value_file", outcome.value_file.encode()))
    if value is not None:
        rows += [(rank, "value", value[i : i + CHUNK]) for i in range(0, len(value), CHUNK)] or [(rank, "value", b"")]
    for rank_, kind, chunk in rows:
        yield pa.RecordBatch.from_pydict(
            {"rank": [rank_], "kind": [kind], "chunk": [chunk]},
            schema=pa.schema([("rank", pa.int32()), ("kind", pa.string()), ("chunk", pa.binary())]),
        )
