"""The driver's side of a Spark barrier stage, shared by the classic and the Connect backend.

``SparkStageBackend`` checks a run (GPUs assigned to tasks, enough task slots for a barrier
stage, the executors' interpreter) and starts it as a ``BarrierStageRun``: the stage runs in a
thread of its own under a job tag, the tasks (``spark_task``) meet through the driver
(``DriverRendezvous``), what comes back through the stage is handed to the run's state, and
stopping sends ``Stop`` over the channel, then interrupts the job tag until the stage is gone.

Placement.  Each task tells the others, through the rendezvous, its own host identity (its host
name, and its executor's bind address ``SPARK_LOCAL_IP`` when set: executors that stand for
different hosts on one machine are told apart), its address and its GPUs;
``rankenv.place_spark_tasks`` makes each task a node of one process, as TorchDistributor does
(``LOCAL_RANK`` 0, ``NODE_RANK`` its rank), seeing its host's GPUs with its own first; rank 0's
address is ``MASTER_ADDR``.

A stage that fails outside any rank (the task's Python code itself, a killed task, a lost
executor) is not retried by Spark (a barrier result stage cannot be); the run fails with the
Python exception, or Spark's reason, of the failed task instead of a Py4JJavaError
(``spark_failure``).
"""

from __future__ import annotations

import abc
import logging
import os
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Collection, Dict, List, Optional, Set, Tuple

from ..core import events
from ..core.options import LaunchOptions
from ..core.rankenv import uses_relay
from ..core.values import map_value
from ..core.rankenv import RunSpec
from ..core.names import VALUES_FETCH_ENV
from ..core.timing import SPARK_CANCEL_RETRY, SPARK_CANCEL_WAIT, SPARK_RENDEZVOUS_WAIT, SPARK_STAGE_END_WAIT, STOP_GRACE
from .base import Backend, BackendRun, LaunchContext, LaunchPlan
from .frames import PreparedData, prepare_spark
from ..launch.remote import marked_value_directory
from .rendezvous import DriverRendezvous
from .spark_task import FAILURE_MARK, SCHEMA, BarrierTaskSpec

GPU_AMOUNT_CONF = "spark.task.resource.gpu.amount"
#: the cluster asks for encryption in transit
SSL_CONF = "spark.ssl.enabled"
#: what lets TorchDistributor (and ``tls=False`` here) run unencrypted on such a cluster anyway
IGNORE_SSL_CONF = "pytorch.spark.distributor.ignoreSsl"

log = logging.getLogger("torchdist_magic")


def is_spark_connect(spark) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")


@dataclass(frozen=True)
class SparkPlan(LaunchPlan):
    """A Spark run's plan: also the interpreter the executors run the ranks on."""

    #: ``None``: the cluster's own (``spark_python``)
    python: Optional[str] = None


class SparkStageBackend(Backend):
    """Runs the ranks as one barrier stage on ``session``; the classic and the Connect backend
    differ in how they count slots, check the interpreter and run the stage."""

    name = "spark"
    #: how the refusals name the cluster, e.g. "this Spark cluster"
    cluster = "this Spark cluster"
    fetches_values = True

    def __init__(self, session):
        self.session = session

    def slot_owner(self):
        return self.session

    def prepare_data(self, data, num_processes: int, columns) -> PreparedData:
        return prepare_spark(data, num_processes, self.session, columns)

    @abc.abstractmethod
    def slots(self) -> int:
        """Tasks of one barrier stage this cluster runs at once."""

    def conf(self, key: str, default: str = "") -> str:
        """The session's setting ``key``, or ``default`` where it has none."""
        return self.session.conf.get(key, default) or default

    def gpu_refusal(self) -> str:
        """Why ``use_gpu`` cannot run here (``GPU_AMOUNT_CONF`` is not set)."""
        return f"{GPU_AMOUNT_CONF} is not set on {self.cluster}"

    def slot_detail(self) -> str:
        """What the slot refusal adds after the count, e.g. the master and spark.task.cpus."""
        return ""

    def wait_for_slots(self, n: int) -> int:
        """The cluster's slots, once it has ``n`` or no more executors are expected."""
        return self.slots()

    @abc.abstractmethod
    def check_python(self, num_processes: int) -> Optional[str]:
        """The interpreter the tasks run on (``None``: the cluster's own); ``ValueError`` when
        the executors cannot run the ranks."""

    def check(self, options: LaunchOptions) -> SparkPlan:
        if options.use_gpu and not self.conf(GPU_AMOUNT_CONF):
            raise ValueError(f"use_gpu/--gpu needs GPUs assigned to Spark tasks, but {self.gpu_refusal()}")
        n = options.num_processes
        slots = self.wait_for_slots(n)
        if slots < n:
            raise ValueError(
                f"{n} ranks need {n} Spark task slots at once (a barrier stage starts all its "
                f"tasks together), but {self.cluster} has {slots}{self.slot_detail()}; use {slots} "
                "or fewer ranks, or add executors"
            )
        tls = self.channel_tls(options)
        return SparkPlan(n, python=self.check_python(n), tls=tls, host_relay=uses_relay(n))

    def channel_tls(self, options: LaunchOptions) -> bool:
        """On unless ``tls=False``: the ranks reach the driver over the cluster's network.  A
        cluster with ``spark.ssl.enabled`` refuses ``tls=False`` (as TorchDistributor refuses to
        run there) unless ``pytorch.spark.distributor.ignoreSsl`` is true too; then it runs
        unencrypted, with one warning."""
        if options.tls is not False:
            return True
        if self.conf_true(SSL_CONF):
            if not self.conf_true(IGNORE_SSL_CONF):
                raise ValueError(
                    f"tls=False/--no-tls was asked for, but {self.cluster} has TLS encryption enabled "
                    f"({SSL_CONF}=true), and the event channel would carry every rank's logs, metrics "
                    "and rank 0's value across the network unencrypted. Leave TLS on (the default on "
                    f"Spark), or, to run unencrypted anyway, set '{IGNORE_SSL_CONF}' to 'true' in the "
                    "Spark configuration"
                )
            # a warning, not the package's log (which goes nowhere unless the application says)
            warnings.warn(
                f"{self.cluster} has TLS encryption enabled ({SSL_CONF}=true), but with "
                f"tls=False/--no-tls and {IGNORE_SSL_CONF}=true this run's event channel is not "
                "encrypted: anyone who can watch the cluster's network reads every rank's logs and "
                "metrics, the notebook values sent to the ranks and rank 0's value (the trained "
                "model), and can tell a rank from the driver by its traffic. Every record is still "
                "authenticated: nobody without the run's secrets can change one, or make a rank or "
                "the driver take one of theirs",
                UserWarning,
                stacklevel=2,
            )
        return False

    def conf_true(self, key: str) -> bool:
        """Whether the setting ``key`` is ``true`` (in any case), as the session sees it now."""
        return self.runtime_conf(key, "false").strip().lower() == "true"

    def runtime_conf(self, key: str, default: str = "") -> str:
        """The setting ``key`` as the session sees it now: what ``spark.conf.set`` changed in it,
        else the cluster's; the way TorchDistributor reads its settings."""
        return self.conf(key, default)

    def start(self, ctx: LaunchContext) -> "BarrierStageRun":
        data = ctx.data
        value_dir = marked_value_directory(ctx.spec)
        spec = BarrierTaskSpec(
            run=ctx.spec,
            job_bytes=ctx.job_bytes,
            data_schema=data.schema if data is not None else None,
            value_dir=value_dir,
            values_sent=os.environ.get(VALUES_FETCH_ENV) == "1",
        )
        ctx.receive_values(
            {rank: spec.value_path(rank) for rank in range(ctx.spec.num_processes) if ctx.spec.returns_value(rank)}
        )
        try:
            run = self.stage_run(spec, ctx, data.frame if data is not None else None)
            run.launch()
        except BaseException:
            shutil.rmtree(value_dir, ignore_errors=True)
            raise
        return run

    @abc.abstractmethod
    def stage_run(self, spec: BarrierTaskSpec, ctx: LaunchContext, frame) -> "BarrierStageRun":
        """The run of this flavour's stage (not launched yet); ``frame``: a data run's DataFrame."""


_MARKED_EXIT = re.compile(re.escape(FAILURE_MARK) + r"(\{.*\})")


def marked_exit(exc: BaseException) -> Optional[events.Exit]:
    """The ``Exit`` a failed rank's task raised with (``FAILURE_MARK``), from the stage's error."""
    m = _MARKED_EXIT.search(str(exc))
    if m is None:
        return None
    try:
        record = events.loads(m.group(1))
    except events.MalformedEvent:
        return None
    return record if isinstance(record, events.Exit) else None


def no_live_view(run: RunSpec) -> str:
    """The line a rank's log gets when its task could not reach the notebook."""
    return (
        f"[torchdist] no live view of this rank: its task could not reach this notebook's "
        f"event channel at {run.channel_address} (a firewall, or a notebook outside the "
        "cluster); its exit and last lines came back with the stage"
    )


class BarrierStageRun(BackendRun):
    """What the classic and the Spark Connect barrier stage share.

    The stage runs in a thread of its own (``_run_stage``) under a job tag, one per attempt;
    the tasks meet through the driver (``DriverRendezvous``); what comes back through the stage
    is handed over by ``_deliver``; stopping sends ``Stop`` over the channel, then interrupts
    the job tag (``_interrupt``) until the stage is gone.
    """

    def __init__(self, spec: BarrierTaskSpec, ctx: LaunchContext, task: Callable):
        self._spec = spec
        self._ctx = ctx
        self._task = task
        self.job_tag = f"torchdist-{spec.run.run_id}-attempt{spec.run.attempt}"  # each attempt is a stage of its own
        self._lock = threading.Lock()
        self._stopping = False
        self._closed = False
        self._values: Dict[int, bytes] = {}
        self._value_files: Dict[int, str] = {}  # values the tasks wrote into spec.value_dir
        self._error: Optional[BaseException] = None
        self._rendezvous: Optional[DriverRendezvous] = None
        self._thread = self._make_thread(self._run_stage, f"torchdist-stage-{spec.run.run_id}")

    def _make_thread(self, target: Callable, name: str) -> threading.Thread:
        return threading.Thread(target=target, name=name, daemon=True)

    def launch(self) -> None:
        self._rendezvous = DriverRendezvous(self._ctx, self._spec.run.num_processes, fallback=SPARK_RENDEZVOUS_WAIT)
        self._thread.start()

    @abc.abstractmethod
    def _run_stage(self) -> None:
        """Run the stage to its end; ``_deliver`` its outcome or ``_report_stage_failure``."""

    @abc.abstractmethod
    def _interrupt(self) -> None:
        """Cancel the stage's job tag (called again until the stage has ended)."""

    def _deliver(
        self,
        values: Dict[int, bytes],
        exits: Dict[int, events.Exit],
        lost_logs: Dict[int, List[str]],
        value_files: Dict[int, str],
    ) -> None:
        """The stage's outcome: the values (or where the tasks wrote them), and every rank's
        exit, after the last lines of the ranks the channel did not carry (a repeated exit is
        ignored by the run's state)."""
        self._values = values
        self._value_files = value_files
        for rank in range(self._spec.run.num_processes):
            if rank in lost_logs:
                self._ctx.emit(events.Log(rank=rank, stream="stderr", line=no_live_view(self._spec.run)))
            for line in lost_logs.get(rank, ()):
                self._ctx.emit(events.Log(rank=rank, stream="stderr", line=line))
            if rank in exits:
                self._ctx.emit(exits[rank])

    def _failed(self, exc: BaseException) -> None:
        """The stage raised ``exc``: the run's failure, unless the run was being stopped."""
        self._error = exc
        if not self._stopping:
            self._report_stage_failure(exc)

    def _report_stage_failure(self, exc: BaseException) -> None:
        """The failing rank's own ``Exit`` when its task raised with it; else Spark's reason as
        one rank's failure.  The other ranks were stopped with the stage."""
        n = self._spec.run.num_processes
        now = time.time()
        failed = marked_exit(exc)
        if failed is None:
            rank, failure = spark_failure(exc)
            rank = min(max(rank or 0, 0), n - 1)
            failed = events.Exit(
                rank=rank, code=1, time=now, host=failure.host, failure=failure.for_rank(rank, exit_code=1, time=now)
            )
        if failed.failure is not None and failed.failure.log_tail:
            self._ctx.emit(events.Log(rank=failed.rank, stream="stderr", line=no_live_view(self._spec.run)))
            for line in failed.failure.log_tail:
                self._ctx.emit(events.Log(rank=failed.rank, stream="stderr", line=line))
        self._ctx.emit(failed)
        for rank in range(n):
            if rank != failed.rank:
                self._ctx.emit(events.Exit(rank=rank, code=None, time=now, stopped=True))

    def stop(self, grace: float) -> None:
        """Tell every task to stop its rank and wait for the stage to end; interrupt it if that
        is not enough (a task not started yet, stuck before its rank started, or unable to
        reach the driver).

        ``Stop`` is sent again while waiting: a task that connects to the channel late still
        gets it.  An interrupted task is killed only after ``spark.python.task.killTimeout``,
        with SIGKILL; its guard then stops the worker.
        """
        with self._lock:
            self._stopping = True
        stop = events.Stop(rank=-1, grace=grace)
        deadline = time.monotonic() + max(grace, 0.0) + SPARK_STAGE_END_WAIT
        while self._thread.is_alive() and time.monotonic() < deadline:
            if self._ctx.to_ranks(stop) == 0 and self._rendezvous is not None and self._rendezvous.placed:
                break  # the tasks met and none of them hears the driver: only an interrupt helps
            self._thread.join(SPARK_CANCEL_RETRY)
        deadline = time.monotonic() + SPARK_CANCEL_WAIT
        try:
            while self._thread.is_alive() and time.monotonic() < deadline:
                log.info("run %s: interrupting Spark job tag %s", self._spec.run.run_id, self.job_tag)
                self._interrupt()
                self._thread.join(SPARK_CANCEL_RETRY)
        except Exception as exc:  # the session is gone, and with it the stage  # noqa: BLE001
            log.info(
                "run %s: could not interrupt job tag %s (%s: %s); the session is gone",
                self._spec.run.run_id,
                self.job_tag,
                type(exc).__name__,
                exc,
            )
        if self._thread.is_alive():
            log.warning(
                "run %s: the stage of job tag %s was still running %g s after it was interrupted",
                self._spec.run.run_id,
                self.job_tag,
                SPARK_CANCEL_WAIT,
            )

    def stop_ranks(self, ranks: Collection[int], grace: float) -> Set[int]:
        """``Stop`` to each of those ranks' tasks alone: each stops its rank and returns its
        outcome (a stopped rank's task ends without failing the barrier stage, which would take
        the other tasks with it), while the stage goes on.  The job tag is left alone."""
        return {r for r in ranks if self._ctx.to_rank(r, events.Stop(rank=r, grace=grace))}

    def dump_stacks(self) -> None:
        """Each task's launcher signals its worker and sends the ``Stacks`` back over the channel."""
        self._ctx.to_ranks(events.DumpStacks(rank=-1))

    def result(self, rank: int) -> Optional[bytes]:
        self._thread.join()
        if rank in self._values:
            return self._values[rank]
        if rank in self._value_files:
            return map_value(self._value_files[rank], self._spec.value_dir)
        if self._error is not None:
            # the stage failed after the rank had finished (its ``Exit`` came over the channel):
            # a value its rank wrote, or its task sent, into the driver's directory is whole there
            path = self._spec.value_path(rank)
            if os.path.exists(path):
                return map_value(path, self._spec.value_dir)
            _, reason = spark_failure(self._error)
            raise RuntimeError(
                f"rank {rank} finished, but Spark could not return its value: {reason.exc_type}: {reason.message}"
            )
        return None

    def where(self) -> str:
        return f"Spark job tag {self.job_tag}"

    def ranks_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._rendezvous is not None:
            self._rendezvous.close()
        if self._thread.is_alive():
            self.stop(STOP_GRACE)
        shutil.rmtree(self._spec.value_dir, ignore_errors=True)


@dataclass
class _Rows:
    """A stage's result rows, sorted out by rank."""

    exits: Dict[int, events.Exit]
    values: Dict[int, bytes]
    logs: Dict[int, List[str]]
    value_files: Dict[int, str]


def sort_rows(rows) -> _Rows:
    exits: Dict[int, events.Exit] = {}
    pieces: Dict[int, List[bytes]] = {}
    logs: Dict[int, List[str]] = {}
    value_files: Dict[int, str] = {}
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
        elif kind == "value_file":
            value_files[rank] = chunk.decode()
    return _Rows(exits, {r: b"".join(p) for r, p in pieces.items()}, logs, value_files)


def data_stage(frame, n: int, task: Callable, partitions: Optional[int] = None):
    """The barrier stage of a data run (classic or Connect): one partition of ``frame`` per
    rank (no repartition when it has ``partitions == n`` already), each read by its rank's
    task (``task``, a ``spark_task.run_arrow_task``)."""
    if partitions != n:
        frame = frame.repartition(n)
    return frame.mapInArrow(task, SCHEMA, barrier=True)


_PY_TRACEBACK = "Traceback (most recent call last):"
_EXC_LINE = re.compile(r"([A-Za-z_][\w.$]*): (.*)", re.S)
_TASK_RANK = (re.compile(r"barrier task ResultTask\(\d+, (\d+)\)"), re.compile(r"Lost task (\d+)\.\d+ in stage"))
_TASK_HOST = re.compile(r"Lost task \d+\.\d+ in stage \S+ \(TID \d+\) \(([^\s)]+) executor")
_TASK_REASON = (
    re.compile(r"finished unsuccessfully\.\n(.+)"),
    re.compile(r"Lost task \d+\.\d+ in stage \S+ \(TID \d+\) \([^)]*\): (.+)"),
)


def spark_failure(exc: BaseException) -> Tuple[Optional[int], events.Failure]:
    """What a user needs from a failed stage's error (a Py4JJavaError of a few hundred lines):
    the Python exception raised in the task (type, message, traceback) when there is one, else
    the task's failure reason from Spark; and the task's rank (``None`` when Spark does not name
    it) and host."""
    text = str(exc)
    java = getattr(exc, "java_exception", None)
    if java is not None:
        try:
            text = str(java.toString()) + "\n" + text
        except Exception:  # the JVM is gone; str(exc) is all there is  # noqa: BLE001
            pass
    rank: Optional[int] = None
    for pattern in _TASK_RANK:
        m = pattern.search(text)
        if m:
            rank = int(m.group(1))
            break
    m = _TASK_HOST.search(text)
    host = m.group(1) if m else ""
    start = text.find(_PY_TRACEBACK)
    if start >= 0:
        block = text[start:].split("\n\tat ", 1)[0]
        lines = [line for line in block.splitlines() if not line.startswith(" SQLSTATE")]
        # the exception is what follows the last indented (frame) line
        last_frame = max(i for i, line in enumerate(lines) if i == 0 or line.startswith(" "))
        exc_line = "\n".join(lines[last_frame + 1 :]).strip()
        traceback_text = "\n".join(lines).rstrip() + "\n"
    else:
        reasons = [m.group(1) for m in (p.search(text) for p in _TASK_REASON) if m]
        exc_line = (reasons or text.strip().splitlines() or [type(exc).__name__])[0].strip()
        traceback_text = ""
    typed = _EXC_LINE.match(exc_line)  # "pkg.SomeError: message"; anything else is a message
    return rank, events.Failure.from_exception(
        rank or 0,
        exc,
        host=host,
        exc_type=typed.group(1).rsplit(".", 1)[-1] if typed else type(exc).__name__,
        message=typed.group(2).strip() if typed else exc_line,
        traceback_text=traceback_text,
    )
