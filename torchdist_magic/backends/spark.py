"""Spark backend: one barrier stage of N tasks; each task is one rank and starts one worker.

The tasks agree on rank 0's address and port through ``BarrierTaskContext.allGather``, start
the worker with the same launcher as the local backend (``RankProcess``) and forward its logs
and its ``exit`` over the run's event channel, so the driver sees a rank fail as soon as it
does.  Rank 0's value (every rank's with ``all_ranks``) comes back through the stage's
``collect``.

Interpreter.  On a master of this machine (``local[...]``, ``local-cluster[...]``) the tasks run
on the notebook's own interpreter (``sys.executable``), unless the user chose one with
``PYSPARK_PYTHON`` or ``spark.pyspark.python``: executors otherwise start ``python3`` from PATH,
which may lack torch or torchdist_magic or have another cloudpickle.

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

import dataclasses
import functools
import json
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
from ..timing import (SPARK_CANCEL_RETRY, SPARK_CANCEL_WAIT, SPARK_SLOT_WAIT, SPARK_STAGE_END_WAIT,
                      STOP_GRACE)
from . import Backend, BackendRun, LaunchContext

GPU_AMOUNT_CONF = "spark.task.resource.gpu.amount"

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


def is_local_master(master: str) -> bool:
    """A master whose executors run on this machine, with this machine's interpreters."""
    return master.strip().startswith(("local[", "local-cluster[")) or master.strip() == "local"


def python_for_tasks(sc) -> str:
    """The interpreter the stage's tasks run: the notebook's own on a local master unless the
    user chose one (``PYSPARK_PYTHON``, ``spark.pyspark.python``), else Spark's choice."""
    chosen = os.environ.get("PYSPARK_PYTHON") or sc.getConf().get("spark.pyspark.python", "")
    if is_local_master(sc.master) and not chosen:
        return sys.executable
    return sc.pythonExec


class SparkBarrierBackend(Backend):
    """Runs the ranks as one barrier stage on ``spark``, a classic SparkSession."""

    name = "spark"

    def __init__(self, spark):
        if is_spark_connect(spark):
            raise ValueError(
                "this SparkSession is a Spark Connect session, which torchdist_magic's Spark "
                "backend does not support yet; use a classic SparkSession or --local")
        self.spark = spark

    def describe(self) -> str:
        return f"Spark barrier stage on {self.spark.sparkContext.master}"

    def channel_host(self) -> str:
        # the driver's address as Spark knows it: what executors already use to reach the driver
        return self.spark.sparkContext.getConf().get("spark.driver.host", socket.gethostname())

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

    def start(self, ctx: LaunchContext) -> "SparkRun":
        spec = BarrierTaskSpec(run=ctx.spec, job_bytes=ctx.job_bytes)
        run = SparkRun(self.spark.sparkContext, spec, ctx, self.task_function(spec))
        run.launch()
        return run

    def task_function(self, spec: "BarrierTaskSpec") -> Callable:
        """What each barrier task runs (the ``mapPartitions`` function)."""
        return functools.partial(run_barrier_task, spec)


class SparkRun(BackendRun):
    """The barrier stage of one run; ``collect`` runs in a thread of its own, under a job tag."""

    def __init__(self, sc, spec: "BarrierTaskSpec", ctx: LaunchContext, task: Callable):
        from pyspark import InheritableThread

        self._sc = sc
        self._spec = spec
        self._ctx = ctx
        self._task = task
        self.job_tag = f"torchdist-{spec.run.run_id}"
        self._lock = threading.Lock()
        self._stopping = False
        self._closed = False
        self._values: Dict[int, bytes] = {}
        self._error: Optional[BaseException] = None
        self._thread = InheritableThread(target=self._run_stage, name=f"torchdist-spark-{spec.run.run_id}",
                                         daemon=True)

    def launch(self) -> None:
        self._thread.start()

    def _barrier_rdd(self):
        """The stage's RDD, its Python function bound to the tasks' interpreter.

        PySpark builds a stage's Python function with ``SparkContext.pythonExec``; it is set
        only while this RDD's function is built, so other jobs of the session are unaffected.
        """
        sc, n = self._sc, self._spec.run.num_processes
        rdd = sc.parallelize(range(n), n).barrier().mapPartitions(self._task)
        python = python_for_tasks(sc)
        with _PYTHON_EXEC_LOCK:
            previous, sc.pythonExec = sc.pythonExec, python
            try:
                rdd._jrdd  # noqa: B018  builds the Java-side function now, with ``python``
            finally:
                sc.pythonExec = previous
        return rdd

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
            rows = self._barrier_rdd().collect()
        except Exception as exc:
            self._error = exc
            if not self._stopping:
                self._report_stage_failure(exc)
            return
        finally:
            try:
                sc.removeJobTag(self.job_tag)
                sc.setJobDescription(None)
            except Exception:  # the SparkContext was stopped under the run
                pass
        for rank, value, _exit in rows:
            if value is not None:
                self._values[rank] = value
        for _rank, _value, exit_json in rows:
            # normally the channel delivered it already (a repeated exit is ignored); this covers
            # a rank whose channel to the driver was lost
            try:
                self._ctx.emit(events.decode(exit_json))
            except events.MalformedEvent:
                pass  # a task of another version: the channel's handshake said so already

    def _report_stage_failure(self, exc: BaseException) -> None:
        """The stage failed outside any rank: one rank fails with Spark's reason, the others stop."""
        culprit, failure = spark_failure(exc)
        now = time.time()
        n = self._spec.run.num_processes
        culprit = min(max(culprit or 0, 0), n - 1)
        failure = dataclasses.replace(failure, rank=culprit, exit_code=1, time=now)
        self._ctx.emit(events.Exit(rank=culprit, code=1, time=now, host=failure.host, failure=failure))
        for rank in range(n):
            if rank != culprit:
                self._ctx.emit(events.Exit(rank=rank, code=None, time=now, stopped=True))

    def stop(self, grace: float) -> None:
        """Tell every task to stop its rank and wait for the stage to end; cancel it if that is
        not enough (a task not started yet, or stuck before its rank started).

        ``Stop`` is sent again while waiting: a task that connects to the channel late still
        gets it.  A cancelled task is killed only after ``spark.python.task.killTimeout``, with
        SIGKILL; its guard then stops the worker.
        """
        with self._lock:
            self._stopping = True
        stop = events.Stop(rank=-1, grace=grace)
        deadline = time.monotonic() + max(grace, 0.0) + SPARK_STAGE_END_WAIT
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._ctx.to_ranks(stop)
            self._thread.join(SPARK_CANCEL_RETRY)
        deadline = time.monotonic() + SPARK_CANCEL_WAIT
        try:
            while self._thread.is_alive() and time.monotonic() < deadline:
                self._sc.cancelJobsWithTag(self.job_tag)
                self._thread.join(SPARK_CANCEL_RETRY)
        except Exception:  # the SparkContext is gone, and with it the stage
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
        if self._thread.is_alive():
            self.stop(STOP_GRACE)


_PYTHON_EXEC_LOCK = threading.Lock()
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


class RunStopped(Exception):
    """The driver stopped the run before this task started its rank."""


class StopSignal:
    """Set when the driver sends ``events.Stop`` to this task; ``grace`` is the time the
    driver gives the rank between SIGTERM and SIGKILL."""

    def __init__(self):
        self._event = threading.Event()
        self.grace = STOP_GRACE

    def on_message(self, record: events.Event) -> None:
        if isinstance(record, events.Stop):
            self.grace = max(record.grace, 0.0)
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def run_barrier_task(spec: BarrierTaskSpec, _partition) -> List[Tuple[int, Optional[bytes], dict]]:
    """One barrier task: run one rank; ``[(rank, value or None, its Exit record as JSON)]``."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    rank = context.partitionId()
    stop = StopSignal()
    channel = ChannelClient(spec.run.channel_address, spec.run.launcher_secret, spec.run.run_id, rank,
                            role="launcher", on_message=stop.on_message)
    exits: List[events.Exit] = []

    def emit(event: events.Event) -> None:
        if isinstance(event, events.Exit):
            exits.append(event)
        channel.send(event)

    try:
        value = _run_rank(spec, context, rank, emit, stop)
    except Exception as exc:  # the task's own failure (not the rank's): report it as this rank's
        value = None
        host = socket.gethostname()
        emit(events.Exit(rank=rank, code=1, time=time.time(), host=host, stopped=stop.is_set(),
                         failure=events.Failure(
                             rank=rank, exc_type=type(exc).__qualname__, message=str(exc), host=host,
                             exit_code=1, time=time.time(), traceback="".join(
                                 traceback.format_exception(type(exc), exc, exc.__traceback__)))))
    finally:
        channel.close()
    return [(rank, value, events.encode(exits[-1]))]


def _run_rank(spec: BarrierTaskSpec, context, rank: int, emit: Callable[[events.Event], None],
              stop: StopSignal) -> Optional[bytes]:
    run = spec.run
    workdir = tempfile.mkdtemp(prefix=f"torchdist-{run.run_id}-rank{rank}-")
    guard = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _GUARD_SOURCE, workdir, str(STOP_GRACE)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, TORCHDIST_RUN_ID=run.run_id), start_new_session=True, text=True)
    port = reserve_port("") if rank == 0 else None
    proc: Optional[RankProcess] = None
    try:
        host = context.getTaskInfos()[rank].address.rpartition(":")[0]
        gpus = None
        if run.use_gpu:
            resource = context.resources().get("gpu")
            gpus = ",".join(resource.addresses) if resource is not None else None
        mine = {"host": host, "port": port.getsockname()[1] if port is not None else None, "gpus": gpus}
        peers = [json.loads(p) for p in context.allGather(json.dumps(mine))]
        place = place_ranks([p["host"] for p in peers], peers[0]["host"], peers[0]["port"],
                            [p["gpus"] for p in peers])[rank]
        env = rank_environment(os.environ, run, place)
        env["TORCHDIST_CLEANUP"] = workdir  # the worker removes it if it outlives this task
        job_file = os.path.join(workdir, "job.pkl")
        fd = os.open(job_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(spec.job_bytes)
        if stop.is_set():
            raise RunStopped(f"the run was stopped before rank {rank} started")
        result_dir = os.path.join(workdir, f"rank-{rank}")
        proc = RankProcess(rank, job_file, result_dir, env, emit)
        guard.stdin.write(f"{proc.pgid}\n")
        guard.stdin.flush()
        while not proc.exited.wait(0.05):
            if stop.is_set():
                stop_all([proc], stop.grace)
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
