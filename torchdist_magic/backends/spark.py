"""Spark backend: one barrier stage of N tasks; each task is one rank and starts one worker.

The tasks agree on rank 0's address and port through ``BarrierTaskContext.allGather``, start
the worker with the same launcher as the local backend (``RankProcess``) and forward its logs
and its ``exit`` over the run's event channel, so the driver sees a rank fail as soon as it
does.  Rank 0's value (every rank's with ``all_ranks``) comes back through the stage's
``collect``.

Interpreter.  Before the stage, ``spark_python.choose_python`` checks that the executors' Python
matches this notebook's (or uses the notebook's own where it is there), so that a mismatch is a
clear error before any training, not a ``ModuleNotFoundError`` from inside Spark.

Placement.  Each task tells the others, through the barrier, its own host identity (its host
name, and its executor's bind address ``SPARK_LOCAL_IP`` when set: executors that stand for
different hosts on one machine are told apart) and its address; ``rankenv.place_ranks`` turns
them into torchrun's ``LOCAL_RANK``, ``GROUP_RANK``... and rank 0's address is ``MASTER_ADDR``.

Stopping.  Each task holds a launcher connection on the run's event channel; when the driver
sends ``events.Stop`` over it, the task gives its worker SIGTERM, the grace, then SIGKILL,
reports the exit and returns.  A task can also be killed
outright (Spark kills the Python process of a cancelled or failed stage's task with SIGKILL
after ``spark.python.task.killTimeout``), and then no ``finally`` runs: so each task also starts
a small guard process in a session of its own, which notices the task's end and, unless the
task said "done", stops the worker's process group and removes the task's files.

A stage that fails outside any rank (the task's Python code itself, a killed task, a lost
executor) is not retried by Spark (a barrier result stage cannot be); the run fails with the
Python exception, or Spark's reason, of the failed task instead of a Py4JJavaError.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import functools
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .. import events
from ..channel import ChannelClient
from ..launcher import RankProcess, read_result, reserve_port, stop_all
from ..options import LaunchOptions
from ..rankenv import RunSpec, place_ranks, rank_environment
from ..timing import (SPARK_CANCEL_RETRY, SPARK_CANCEL_WAIT, SPARK_RENDEZVOUS_WAIT, SPARK_SLOT_WAIT,
                      SPARK_STAGE_END_WAIT, STOP_GRACE)
from . import Backend, BackendRun, LaunchContext
from .spark_python import build_with_python, choose_python, python_exec

GPU_AMOUNT_CONF = "spark.task.resource.gpu.amount"
#: lines of a rank's output a task keeps, for when its channel to the driver is lost
LOG_TAIL = 20

_LOCAL_CLUSTER = re.compile(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]")

# The guard: reads lines from the task on stdin (the worker's process group id, then "done"
# once the task has cleaned up itself).  End of input without "done" means the task was killed:
# SIGTERM the worker's group, wait up to the grace for the worker to exit (an orphan may stay a
# zombie for a while: that counts as exited), SIGKILL what is left of the group, remove the files.
_GUARD_SOURCE = r"""
import os, shutil, signal, sys, time
workdir, grace = sys.argv[1], float(sys.argv[2])
groups = []
for line in sys.stdin:
    if line.strip() == "done":
        sys.exit(0)
    groups.append(int(line))
def signal_all(sig):
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
def exited(pid):
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return True
        return False
signal_all(signal.SIGTERM)
deadline = time.monotonic() + grace
while time.monotonic() < deadline and not all(exited(pgid) for pgid in groups):
    time.sleep(0.05)
signal_all(signal.SIGKILL)
shutil.rmtree(workdir, ignore_errors=True)
"""


# -- driver side ------------------------------------------------------------------------------

def is_spark_connect(spark) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")


def max_concurrent_tasks(sc) -> int:
    """Tasks the registered executors can run at once: the number Spark's own barrier check uses."""
    jsc = sc._jsc.sc()
    try:
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # py4j cannot reach the internal API: estimate from the parallelism
        return sc.defaultParallelism // max(1, int(sc.getConf().get("spark.task.cpus", "1")))


def task_slots(sc) -> int:
    """How many tasks of one barrier stage can run at the same time on this cluster."""
    slots = max_concurrent_tasks(sc)
    m = _LOCAL_CLUSTER.fullmatch(sc.master.strip())
    if m:  # the executors of a local cluster may still be registering; they will all come
        cpus = max(1, int(sc.getConf().get("spark.task.cpus", "1")))
        slots = max(slots, int(m.group(1)) * (int(m.group(2)) // cpus))
    return slots


class SparkBarrierBackend(Backend):
    """Runs the ranks as one barrier stage on ``spark``, a classic SparkSession."""

    name = "spark"
    #: the run's DataFrame (a ``data.PreparedData``), set before ``start`` for a data run
    data = None

    def __init__(self, spark):
        if is_spark_connect(spark):
            raise ValueError("this SparkSession is a Spark Connect session: its runs go to "
                             "spark_connect.SparkConnectBackend")
        self.spark = spark
        self.python: Optional[str] = None  # the executors' interpreter, once check() chose it

    def describe(self) -> str:
        return f"Spark barrier stage on {self.spark.sparkContext.master}"

    def channel_host(self) -> str:
        # the driver's address as Spark knows it: what executors already use to reach the driver
        return self.spark.sparkContext.getConf().get("spark.driver.host", socket.gethostname())

    def slots(self) -> int:
        """Tasks of one barrier stage this cluster runs at once."""
        return task_slots(self.spark.sparkContext)

    def check(self, options: LaunchOptions) -> None:
        sc = self.spark.sparkContext
        if options.use_gpu and not sc.getConf().get(GPU_AMOUNT_CONF, ""):
            raise ValueError(
                f"use_gpu/--gpu needs GPUs assigned to Spark tasks, but {GPU_AMOUNT_CONF} is not "
                f"set on this SparkSession; start it with {GPU_AMOUNT_CONF}=1 and executor GPU "
                "resources (spark.executor.resource.gpu.amount, a discovery script)")
        n = options.num_processes
        slots = task_slots(sc)
        deadline = time.monotonic() + SPARK_SLOT_WAIT
        while slots < n and not sc.master.startswith("local") and time.monotonic() < deadline:
            time.sleep(0.5)  # executors of a cluster that just started may still be registering
            slots = task_slots(sc)
        if slots < n:
            cpus = sc.getConf().get("spark.task.cpus", "1")
            raise ValueError(
                f"{n} ranks need {n} Spark task slots at once (a barrier stage starts all its "
                f"tasks together), but this Spark cluster has {slots} (master {sc.master}, "
                f"spark.task.cpus={cpus}); use {slots} or fewer ranks, or add executors")
        self.python = choose_python(sc, n)

    def start(self, ctx: LaunchContext) -> "SparkRun":
        spec = BarrierTaskSpec(run=ctx.spec, job_bytes=ctx.job_bytes,
                               data_schema=self.data.schema if self.data is not None else None)
        run = SparkRun(self.spark.sparkContext, spec, ctx, self.task_function(spec),
                       self.python or self.spark.sparkContext.pythonExec,
                       self.data.frame if self.data is not None else None)
        run.launch()
        return run

    def task_function(self, spec: "BarrierTaskSpec") -> Callable:
        """What each barrier task runs: the ``mapPartitions`` function, or for a data run the
        ``mapInArrow`` function of the DataFrame's stage."""
        if spec.data_schema is not None:
            from .spark_connect import run_connect_task

            return functools.partial(run_connect_task, spec)
        return functools.partial(run_barrier_task, spec)


class DriverRendezvous:
    """The driver's side of the tasks' rendezvous (see ``rendezvous``): collects every task's
    ``Joined`` and, once all ranks have joined, sends them all the ``Peers``; when not all join
    within ``SPARK_RENDEZVOUS_WAIT`` of the first one, tells them to use Spark's barrier."""

    def __init__(self, ctx: LaunchContext, num_processes: int):
        self._ctx = ctx
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
                if self._timer is None:
                    self._timer = threading.Timer(SPARK_RENDEZVOUS_WAIT, self._use_barrier)
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


#: how a failed rank's task may mark its ``Exit`` in the exception its stage fails with
FAILURE_MARK = "torchdist-rank-exit:"
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
    return (f"[torchdist] no live view of this rank: its task could not reach this notebook's "
            f"event channel at {run.channel_address} (a firewall, or a notebook outside the "
            "cluster); its exit and last lines came back with the stage")


class BarrierStageRun(BackendRun):
    """What the classic and the Spark Connect barrier stage share.

    The stage runs in a thread of its own (``_run_stage``) under a job tag, one per attempt;
    the tasks meet through the driver (``DriverRendezvous``); what comes back through the stage
    is handed over by ``_deliver``; stopping sends ``Stop`` over the channel, then interrupts
    the job tag (``_interrupt``) until the stage is gone.
    """

    def __init__(self, spec: "BarrierTaskSpec", ctx: LaunchContext, task: Callable):
        self._spec = spec
        self._ctx = ctx
        self._task = task
        self.job_tag = f"torchdist-{spec.run.run_id}-attempt{spec.run.attempt}"  # each attempt is a stage of its own
        self._lock = threading.Lock()
        self._stopping = False
        self._closed = False
        self._values: Dict[int, bytes] = {}
        self._error: Optional[BaseException] = None
        self._rendezvous: Optional[DriverRendezvous] = None
        self._thread = self._make_thread(self._run_stage, f"torchdist-stage-{spec.run.run_id}")

    def _make_thread(self, target: Callable, name: str) -> threading.Thread:
        return threading.Thread(target=target, name=name, daemon=True)

    def launch(self) -> None:
        self._rendezvous = DriverRendezvous(self._ctx, self._spec.run.num_processes)
        self._thread.start()

    @abc.abstractmethod
    def _run_stage(self) -> None:
        """Run the stage to its end; ``_deliver`` its outcome or ``_report_stage_failure``."""

    @abc.abstractmethod
    def _interrupt(self) -> None:
        """Cancel the stage's job tag (called again until the stage has ended)."""

    def _deliver(self, values: Dict[int, bytes], exits: Dict[int, events.Exit],
                 lost_logs: Dict[int, List[str]]) -> None:
        """The stage's outcome: the values, and every rank's exit, after the last lines of the
        ranks the channel did not carry (a repeated exit is ignored by the run's state)."""
        self._values = values
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
            failed = events.Exit(rank=rank, code=1, time=now, host=failure.host,
                                 failure=dataclasses.replace(failure, rank=rank, exit_code=1, time=now))
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
                self._interrupt()
                self._thread.join(SPARK_CANCEL_RETRY)
        except Exception:  # the session is gone, and with it the stage
            pass

    def dump_stacks(self) -> None:
        """Each task's launcher signals its worker and sends the ``Stacks`` back over the channel."""
        self._ctx.to_ranks(events.DumpStacks(rank=-1))

    def result(self, rank: int) -> Optional[bytes]:
        self._thread.join()
        if rank in self._values:
            return self._values[rank]
        if self._error is not None:
            _, reason = spark_failure(self._error)
            raise RuntimeError(f"rank {rank} finished, but Spark could not return its value: "
                               f"{reason.exc_type}: {reason.message}")
        return None

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


class SparkRun(BarrierStageRun):
    """The classic barrier stage: an RDD's ``mapPartitions`` collected under a job tag; for a
    data run, the DataFrame's ``mapInArrow(barrier=True)`` stage (``spark_connect.data_stage``)."""

    def __init__(self, sc, spec: "BarrierTaskSpec", ctx: LaunchContext, task: Callable, python: str,
                 frame=None):
        self._sc = sc
        self._python = python
        self._frame = frame
        super().__init__(spec, ctx, task)

    def _make_thread(self, target: Callable, name: str) -> threading.Thread:
        from pyspark import InheritableThread  # the job tag and local properties go with it

        return InheritableThread(target=target, name=name, daemon=True)

    def _barrier_rdd(self):
        """The stage's RDD, its Python function bound to the tasks' interpreter."""
        sc, n = self._sc, self._spec.run.num_processes
        rdd = sc.parallelize(range(n), n).barrier().mapPartitions(self._task)
        return build_with_python(sc, rdd, self._python)

    def _run_stage(self) -> None:
        sc, n = self._sc, self._spec.run.num_processes
        with self._lock:
            if self._stopping:
                return
            sc.setJobDescription(f"torchdist run {self._spec.run.run_id}: {n} ranks")
            sc.setInterruptOnCancel(True)
            sc.addJobTag(self.job_tag)
        try:
            deadline = time.monotonic() + SPARK_SLOT_WAIT
            # a barrier stage submitted before enough executors registered waits 15 s to retry
            while max_concurrent_tasks(sc) < n and not self._stopping and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._frame is not None:
                from .spark_connect import data_stage, sort_rows

                with python_exec(sc, self._python):  # the stage's function, for the chosen interpreter
                    frame = data_stage(self._frame, n, self._task, self._frame.rdd.getNumPartitions())
                rows = sort_rows(r.asDict() for r in frame.collect())
                self._deliver(rows.values, rows.exits, rows.logs)
                return
            outcomes = self._barrier_rdd().collect()
        except Exception as exc:
            self._failed(exc)
            return
        finally:
            try:
                sc.removeJobTag(self.job_tag)
                sc.setJobDescription(None)
            except Exception:  # the SparkContext was stopped under the run
                pass
        exits: Dict[int, events.Exit] = {}
        for outcome in outcomes:
            try:
                exits[outcome.rank] = events.decode(outcome.exit_json)
            except events.MalformedEvent:
                pass  # a task of another version: the channel's handshake said so already
        self._deliver({o.rank: o.value for o in outcomes if o.value is not None}, exits,
                      {o.rank: o.log_tail for o in outcomes if o.channel_lost})

    def _interrupt(self) -> None:
        self._sc.cancelJobsWithTag(self.job_tag)


_PY_TRACEBACK = "Traceback (most recent call last):"
_EXC_LINE = re.compile(r"([A-Za-z_][\w.$]*): (.*)", re.S)
_TASK_RANK = (re.compile(r"barrier task ResultTask\(\d+, (\d+)\)"),
              re.compile(r"Lost task (\d+)\.\d+ in stage"))
_TASK_HOST = re.compile(r"Lost task \d+\.\d+ in stage \S+ \(TID \d+\) \(([^\s)]+) executor")
_TASK_REASON = (re.compile(r"finished unsuccessfully\.\n(.+)"),
                re.compile(r"Lost task \d+\.\d+ in stage \S+ \(TID \d+\) \([^)]*\): (.+)"))


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
        except Exception:  # the JVM is gone; str(exc) is all there is
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
        exc_line = "\n".join(lines[last_frame + 1:]).strip()
        traceback_text = "\n".join(lines).rstrip() + "\n"
    else:
        reasons = [m.group(1) for m in (p.search(text) for p in _TASK_REASON) if m]
        exc_line = (reasons or text.strip().splitlines() or [type(exc).__name__])[0].strip()
        traceback_text = ""
    typed = _EXC_LINE.match(exc_line)  # "pkg.SomeError: message"; anything else is a message
    return rank, events.Failure(
        rank=rank or 0, host=host,
        exc_type=typed.group(1).rsplit(".", 1)[-1] if typed else type(exc).__name__,
        message=typed.group(2).strip() if typed else exc_line, traceback=traceback_text)


# -- task side --------------------------------------------------------------------------------

@dataclass
class BarrierTaskSpec:
    """Everything a barrier task needs; travels to the executors inside the stage's closure."""

    run: RunSpec
    job_bytes: bytes
    #: a data run's Arrow schema (serialized), for a task whose partition is empty; else None
    data_schema: Optional[bytes] = None


class RunStopped(Exception):
    """The driver stopped the run before this task started its rank."""


class DriverMessages:
    """What the driver sends this task over the channel: ``Stop`` (``stopped()``, with the
    ``grace`` it gives the rank between SIGTERM and SIGKILL), ``Peers`` (``peers()``) and
    ``DumpStacks`` (answered by ``dump_stacks``, once the rank's process is there)."""

    def __init__(self):
        self._stop = threading.Event()
        self._peers = threading.Event()
        self.grace = STOP_GRACE
        self.peer_list: Optional[events.Peers] = None
        self.dump_stacks: Optional[Callable[[], None]] = None

    def on_message(self, record: events.Event) -> None:
        if isinstance(record, events.Stop):
            self.grace = max(record.grace, 0.0)
            self._stop.set()
        elif isinstance(record, events.Peers):
            self.peer_list = record
            self._peers.set()
        elif isinstance(record, events.DumpStacks) and self.dump_stacks is not None:
            self.dump_stacks()

    def stopped(self) -> bool:
        return self._stop.is_set()

    def peers(self, channel: ChannelClient) -> Optional[events.Peers]:
        """The driver's ``Peers`` once it sent them; ``None`` when the channel is lost first
        (the driver decides within ``SPARK_RENDEZVOUS_WAIT`` of the first task's ``Joined``)."""
        while not self._peers.wait(0.01):
            if channel.lost or self.stopped():
                return None
        return self.peer_list


@dataclass
class TaskOutcome:
    """What a barrier task returns to the driver, for the ranks whose channel may have been lost."""

    rank: int
    value: Optional[bytes]          # the rank's pickled value, when it is wanted
    exit_json: dict                 # its ``Exit`` record, encoded
    channel_lost: bool = False      # the driver heard nothing live from this task
    log_tail: List[str] = field(default_factory=list)  # the rank's last lines of output


def run_barrier_task(spec: BarrierTaskSpec, partition) -> List[TaskOutcome]:
    """One barrier task: run one rank, report it live over the channel, and return its outcome.
    A data run's ``partition`` (Arrow batches) is the rank's rows; otherwise it is ignored."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    rank = context.partitionId()
    driver = DriverMessages()
    channel = ChannelClient(spec.run.channel_address, spec.run.launcher_secret, spec.run.run_id, rank,
                            role="launcher", on_message=driver.on_message)
    exits: List[events.Exit] = []
    tail: "collections.deque[str]" = collections.deque(maxlen=LOG_TAIL)

    def emit(event: events.Event) -> None:
        if isinstance(event, events.Exit):
            exits.append(event)
        elif isinstance(event, events.Log) and not event.cr:
            tail.append(event.line)
        channel.send(event)

    try:
        value = _run_rank(spec, context, rank, channel, emit, driver,
                          partition if spec.data_schema is not None else None)
    except Exception as exc:  # the task's own failure (not the rank's): report it as this rank's
        value = None
        host = socket.gethostname()
        emit(events.Exit(rank=rank, code=1, time=time.time(), host=host, stopped=driver.stopped(),
                         failure=events.Failure(
                             rank=rank, exc_type=type(exc).__qualname__, message=str(exc), host=host,
                             exit_code=1, time=time.time(), traceback="".join(
                                 traceback.format_exception(type(exc), exc, exc.__traceback__)))))
    lost = channel.lost
    channel.close()
    final = exits[-1]
    if final.failure is not None:  # its output travels with it when nothing else carries it
        final = dataclasses.replace(final, failure=dataclasses.replace(final.failure, log_tail=list(tail)))
    return [TaskOutcome(rank, value, events.encode(final), channel_lost=lost,
                        log_tail=list(tail))]


def host_identity() -> str:
    """What tells this executor's machine apart from the others of the run: its host name, and
    the address its executor binds (``SPARK_LOCAL_IP``) when one is set."""
    bind = os.environ.get("SPARK_LOCAL_IP", "")
    return f"{socket.gethostname()}/{bind}" if bind else socket.gethostname()


def task_address(context, rank: int) -> str:
    """The address other ranks reach this task's host at: its executor's bind address when
    set, else the address Spark knows the executor by."""
    return os.environ.get("SPARK_LOCAL_IP") or context.getTaskInfos()[rank].address.rpartition(":")[0]


def rendezvous(context, channel: ChannelClient, driver: DriverMessages, mine: events.Joined) -> List[events.Joined]:
    """Every task's ``Joined``, in rank order: through the driver (its ``Peers``), or, when some
    task could not reach it, through Spark's barrier ``allGather`` (which waits in steps of a
    second, the reason it is not the first choice)."""
    channel.send(mine)
    peers = driver.peers(channel)
    if peers is not None and not peers.use_barrier:
        return peers.peers
    gathered = context.allGather(events.dumps(mine))
    return [events.loads(text) for text in gathered]


def _run_rank(spec: BarrierTaskSpec, context, rank: int, channel: ChannelClient,
              emit: Callable[[events.Event], None], driver: DriverMessages,
              batches=None) -> Optional[bytes]:
    """Start and watch the rank; ``batches``: its rows, written to a file of the task's workdir
    as they arrive (after the rendezvous, so that a large partition does not hold it up)."""
    run = spec.run
    workdir = tempfile.mkdtemp(prefix=f"torchdist-{run.run_id}-rank{rank}-")
    guard = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _GUARD_SOURCE, workdir, str(STOP_GRACE)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, TORCHDIST_RUN_ID=run.run_id), start_new_session=True, text=True)
    port = reserve_port("") if rank == 0 else None
    proc: Optional[RankProcess] = None
    try:
        gpus = None
        if run.use_gpu:
            resource = context.resources().get("gpu")
            gpus = ",".join(resource.addresses) if resource is not None else None
        mine = events.Joined(rank=rank, host=host_identity(), address=task_address(context, rank), gpus=gpus,
                             port=port.getsockname()[1] if port is not None else None)
        peers = rendezvous(context, channel, driver, mine)
        place = place_ranks([p.host for p in peers], peers[0].address, peers[0].port,
                            [p.gpus for p in peers])[rank]
        data_file = ""
        if batches is not None:
            from ..data import write_batches

            data_file = os.path.join(workdir, "data.arrow")
            write_batches(data_file, batches, spec.data_schema, driver.stopped)
        env = rank_environment(os.environ, run, place, data_file=data_file)
        env["TORCHDIST_CLEANUP"] = workdir  # the worker removes it if it outlives this task
        job_file = os.path.join(workdir, "job.pkl")
        fd = os.open(job_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(spec.job_bytes)
        if driver.stopped():
            raise RunStopped(f"the run was stopped before rank {rank} started")
        result_dir = os.path.join(workdir, f"rank-{rank}")
        proc = RankProcess(rank, job_file, result_dir, env, emit)
        driver.dump_stacks = proc.dump_stacks
        guard.stdin.write(f"{proc.pgid}\n")
        guard.stdin.flush()
        while not proc.exited.wait(0.05):
            if driver.stopped():
                stop_all([proc], driver.grace)
        wanted = proc.returncode == 0 and run.returns_value(rank)
        return read_result(result_dir) if wanted else None
    finally:
        if proc is not None:
            stop_all([proc], STOP_GRACE)  # also reaches what the worker left in its group
        if port is not None:
            port.close()
        shutil.rmtree(workdir, ignore_errors=True)
        try:
            guard.stdin.write("done\n")
            guard.stdin.close()
        except OSError:
            pass
        guard.wait()
