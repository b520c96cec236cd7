"""Spark backend: one barrier stage of N tasks; each task is one rank and starts one worker.

The tasks agree on rank 0's address and port through ``BarrierTaskContext.allGather``, start
the worker with the same launcher as the local backend (``RankProcess``) and forward its logs
and its ``exit`` over the run's event channel, so the driver sees a rank fail as soon as it
does.  Rank 0's value (every rank's with ``all_ranks``) comes back through the stage's
``collect``.

Stopping.  The event channel only goes worker -> driver, so each task also holds a connection
to the run's ``StopBeacon`` on the driver; when the driver fires it, the task gives its worker
SIGTERM, the grace, then SIGKILL, reports the exit and returns.  A task can also be killed
outright (Spark kills the Python process of a cancelled or failed stage's task with SIGKILL
after ``spark.python.task.killTimeout``), and then no ``finally`` runs: so each task also starts
a small guard process in a session of its own, which notices the task's end and, unless the
task said "done", stops the worker's process group and removes the task's files.

A stage that fails outside any rank (the task's Python code itself, a killed task, a lost
executor) is not retried by Spark (a barrier result stage cannot be); the run fails with the
Python exception, or Spark's reason, of the failed task instead of a Py4JJavaError.
"""

from __future__ import annotations

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

from ..channel import ChannelClient
from ..launcher import RankProcess, rank_environment, read_result, reserve_port, stop_all
from ..options import LaunchOptions
from . import Backend, BackendRun, LaunchContext

GPU_AMOUNT_CONF = "spark.task.resource.gpu.amount"
TASK_STOP_GRACE = 2.0   # seconds between SIGTERM and SIGKILL when a task stops its worker
SLOT_WAIT = 30.0        # how long a run waits for executors to register before submitting anyway
CANCEL_RETRY = 0.25     # a cancel can race the job's submission: repeat it until the stage is gone
STAGE_END_WAIT = 3.0    # after the ranks' grace, how long stop() waits for the tasks to return
CANCEL_WAIT = 30.0      # how long stop() keeps cancelling a stage that does not end

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

def active_or_new_session():
    """The active SparkSession, or ``SparkSession.builder.getOrCreate()`` when none is active."""
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()


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
    """Runs the ranks as one barrier stage on ``spark`` (default: the active SparkSession)."""

    name = "spark"

    def __init__(self, spark=None):
        self._spark = spark

    @property
    def spark(self):
        if self._spark is None:
            self._spark = active_or_new_session()
        if is_spark_connect(self._spark):
            raise ValueError(
                "the Spark backend needs a classic SparkSession: barrier execution (RDD.barrier) "
                "is not available over Spark Connect; use a classic session or --backend local")
        return self._spark

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
        deadline = time.monotonic() + SLOT_WAIT
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
        opts = ctx.options
        beacon = StopBeacon(self.channel_host())
        try:
            spec = BarrierTaskSpec(
                run_id=ctx.run_id, num_processes=opts.num_processes, job_bytes=ctx.job_bytes,
                channel_address=ctx.channel_address, secret=ctx.secret, stop_address=beacon.address,
                env=dict(opts.env), use_gpu=opts.use_gpu, all_ranks=opts.all_ranks)
            run = SparkRun(self.spark.sparkContext, spec, ctx.emit, self.task_function(spec), beacon)
            run.launch()
        except BaseException:
            beacon.close()
            raise
        return run

    def task_function(self, spec: "BarrierTaskSpec") -> Callable:
        """What each barrier task runs (the ``mapPartitions`` function)."""
        return functools.partial(run_barrier_task, spec)


class StopBeacon:
    """Driver side of the stop signal.  Each task keeps a connection to it while it runs.

    ``fire(grace)`` sends every task the grace and half-closes its connection; the task stops
    its worker (SIGTERM, grace, SIGKILL), reports the exit over the event channel and closes its
    end, which ``wait`` waits for.  Nothing a task sends is used: a stranger's connection gains
    nothing.
    """

    def __init__(self, host: str):
        self._server = socket.create_server((host, 0))
        host, port = self._server.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._conns: List[socket.socket] = []
        self._lock = threading.Lock()
        self._grace: Optional[float] = None
        threading.Thread(target=self._accept, name="torchdist-stop-beacon", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
                grace = self._grace
            if grace is not None:  # a task that connects after the stop stops at once
                self._signal(conn, grace)

    @staticmethod
    def _signal(conn: socket.socket, grace: float) -> None:
        try:
            conn.sendall(f"{grace}\n".encode())
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def fire(self, grace: float) -> None:
        with self._lock:
            if self._grace is not None:
                return
            self._grace = grace
            conns = list(self._conns)
        for conn in conns:
            self._signal(conn, grace)

    def wait(self, timeout: float) -> bool:
        """True once every connected task has closed its end (it has stopped its rank)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                try:
                    conn.settimeout(remaining)
                    if not conn.recv(4096):
                        break
                except socket.timeout:
                    return False
                except OSError:
                    break
        return True

    def close(self) -> None:
        self._server.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()


class SparkRun(BackendRun):
    """The barrier stage of one run; ``collect`` runs in a thread of its own, under a job tag."""

    def __init__(self, sc, spec: "BarrierTaskSpec", emit: Callable[[dict], None], task: Callable,
                 beacon: StopBeacon):
        from pyspark import InheritableThread

        self._sc = sc
        self._spec = spec
        self._emit = emit
        self._task = task
        self._beacon = beacon
        self.job_tag = f"torchdist-{spec.run_id}"
        self._lock = threading.Lock()
        self._stopping = False
        self._closed = False
        self._values: Dict[int, bytes] = {}
        self._error: Optional[BaseException] = None
        self._thread = InheritableThread(target=self._run_stage, name=f"torchdist-spark-{spec.run_id}",
                                         daemon=True)

    def launch(self) -> None:
        self._thread.start()

    def _run_stage(self) -> None:
        sc, n = self._sc, self._spec.num_processes
        with self._lock:
            if self._stopping:
                return
            sc.setJobDescription(f"torchdist run {self._spec.run_id}: {n} ranks")
            sc.setInterruptOnCancel(True)
            sc.addJobTag(self.job_tag)
        try:
            deadline = time.monotonic() + SLOT_WAIT
            # a barrier stage submitted before enough executors registered waits 15 s to retry
            while max_concurrent_tasks(sc) < n and not self._stopping and time.monotonic() < deadline:
                time.sleep(0.1)
            rows = sc.parallelize(range(n), n).barrier().mapPartitions(self._task).collect()
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
        for rank, _code, value, _exit in rows:
            if value is not None:
                self._values[rank] = value
        for _rank, _code, _value, exit_event in rows:
            # normally the channel delivered it already (a repeated exit is ignored); this covers
            # a rank whose channel to the driver was lost
            self._emit(exit_event)

    def _report_stage_failure(self, exc: BaseException) -> None:
        """The stage failed outside any rank: one rank fails with Spark's reason, the others stop."""
        failure = spark_failure(exc)
        now = time.time()
        culprit = min(max(failure.pop("rank", 0), 0), self._spec.num_processes - 1)
        self._emit({"type": "exit", "rank": culprit, "code": 1, "time": now,
                    "host": failure.get("host", ""), "failure": dict(failure, exit_code=1)})
        for rank in range(self._spec.num_processes):
            if rank != culprit:
                self._emit({"type": "exit", "rank": rank, "code": None, "time": now, "stopped": True})

    def stop(self, grace: float) -> None:
        """Tell every task to stop its rank and wait for them; cancel the stage if that is not
        enough (a task not started yet, or stuck before its rank started).

        A cancelled task is killed only after ``spark.python.task.killTimeout``, with SIGKILL; its
        guard then stops the worker.  The beacon makes the usual case quick and graceful.
        """
        with self._lock:
            self._stopping = True
        self._beacon.fire(grace)
        self._beacon.wait(max(grace, 0.0) + STAGE_END_WAIT)
        self._thread.join(CANCEL_RETRY)
        deadline = time.monotonic() + CANCEL_WAIT
        try:
            while self._thread.is_alive() and time.monotonic() < deadline:
                self._sc.cancelJobsWithTag(self.job_tag)
                self._thread.join(CANCEL_RETRY)
        except Exception:  # the SparkContext is gone, and with it the stage
            pass

    def result(self, rank: int) -> Optional[bytes]:
        self._thread.join()
        if rank in self._values:
            return self._values[rank]
        if self._error is not None:
            reason = spark_failure(self._error)
            raise RuntimeError(f"rank {rank} finished, but Spark could not return its value: "
                               f"{reason['exc_type']}: {reason['message']}")
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self.stop(TASK_STOP_GRACE)
        self._beacon.close()


_PY_TRACEBACK = "Traceback (most recent call last):"
_TASK_RANK = (re.compile(r"barrier task ResultTask\(\d+, (\d+)\)"),
              re.compile(r"Lost task (\d+)\.\d+ in stage"))
_TASK_HOST = re.compile(r"Lost task \d+\.\d+ in stage \S+ \(TID \d+\) \(([^\s)]+) executor")
_TASK_REASON = (re.compile(r"finished unsuccessfully\.\n(.+)"),
                re.compile(r"Lost task \d+\.\d+ in stage \S+ \(TID \d+\) \([^)]*\): (.+)"))


def spark_failure(exc: BaseException) -> dict:
    """What a user needs from a failed stage's error (a Py4JJavaError of a few hundred lines):
    the Python exception raised in the task (type, message, traceback) when there is one, else
    the task's failure reason from Spark; and the task's rank and host when Spark names them."""
    text = str(exc)
    java = getattr(exc, "java_exception", None)
    if java is not None:
        try:
            text = str(java.toString()) + "\n" + text
        except Exception:  # the JVM is gone; str(exc) is all there is
            pass
    info: dict = {"host": ""}
    for pattern in _TASK_RANK:
        m = pattern.search(text)
        if m:
            info["rank"] = int(m.group(1))
            break
    m = _TASK_HOST.search(text)
    if m:
        info["host"] = m.group(1)
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
    exc_type, sep, message = exc_line.partition(": ")
    info.update(exc_type=exc_type.rsplit(".", 1)[-1] if sep else type(exc).__name__,
                message=message.strip() if sep else exc_line, traceback=traceback_text)
    return info


# -- task side --------------------------------------------------------------------------------

@dataclass
class BarrierTaskSpec:
    """Everything a barrier task needs; travels to the executors inside the stage's closure."""

    run_id: str
    num_processes: int
    job_bytes: bytes
    channel_address: str
    secret: str
    stop_address: str
    env: Dict[str, str] = field(default_factory=dict)
    use_gpu: bool = False
    all_ranks: bool = False


class RunStopped(Exception):
    """The driver stopped the run before this task started its rank."""


class StopSignal:
    """Task side of the ``StopBeacon``: ``is_set()`` once the driver stops the run (or is gone);
    ``grace`` is the time the driver gives the rank between SIGTERM and SIGKILL."""

    def __init__(self, address: str):
        self._event = threading.Event()
        self.grace = TASK_STOP_GRACE
        host, _, port = address.rpartition(":")
        try:
            self._sock: Optional[socket.socket] = socket.create_connection((host, int(port)), timeout=10)
        except OSError:  # no beacon: the run still stops, through Spark's task kill and the guard
            self._sock = None
            return
        self._sock.settimeout(None)
        threading.Thread(target=self._watch, name="torchdist-stop-signal", daemon=True).start()

    def _watch(self) -> None:
        data = b""
        try:
            while True:
                chunk = self._sock.recv(64)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        try:
            self.grace = float(data.decode().strip() or TASK_STOP_GRACE)
        except ValueError:
            pass
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


def run_barrier_task(spec: BarrierTaskSpec, _partition) -> List[Tuple[int, int, Optional[bytes], dict]]:
    """One barrier task: run one rank; ``[(rank, exit_code, value or None, exit event)]``."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    rank = context.partitionId()
    channel = ChannelClient(spec.channel_address, spec.secret, spec.run_id, rank)
    stop = StopSignal(spec.stop_address)
    exits: List[dict] = []

    def emit(event: dict) -> None:
        if event.get("type") == "exit":
            exits.append(event)
        channel.send(event)

    try:
        code, value = _run_rank(spec, context, rank, emit, stop)
    except Exception as exc:  # the task's own failure (not the rank's): report it as this rank's
        code, value = 1, None
        host = socket.gethostname()
        emit({"type": "exit", "rank": rank, "code": 1, "time": time.time(), "host": host,
              "stopped": stop.is_set(),
              "failure": {"exc_type": type(exc).__qualname__, "message": str(exc), "host": host,
                          "exit_code": 1, "traceback": "".join(
                              traceback.format_exception(type(exc), exc, exc.__traceback__))}})
    finally:
        stop.close()
        channel.close()
    return [(rank, code, value, exits[-1])]


def _run_rank(spec: BarrierTaskSpec, context, rank: int, emit: Callable[[dict], None],
              stop: StopSignal) -> Tuple[int, Optional[bytes]]:
    workdir = tempfile.mkdtemp(prefix=f"torchdist-{spec.run_id}-rank{rank}-")
    guard = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _GUARD_SOURCE, workdir, str(TASK_STOP_GRACE)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, TORCHDIST_RUN_ID=spec.run_id), start_new_session=True, text=True)
    port = reserve_port("") if rank == 0 else None
    proc: Optional[RankProcess] = None
    try:
        host = context.getTaskInfos()[rank].address.rpartition(":")[0]
        mine = {"host": host, "port": port.getsockname()[1] if port is not None else None}
        peers = [json.loads(p) for p in context.allGather(json.dumps(mine))]
        hosts = [p["host"] for p in peers]
        same_host = [r for r, h in enumerate(hosts) if h == host]
        extra: Dict[str, str] = {}
        if spec.use_gpu:
            gpus = context.resources().get("gpu")
            if gpus is not None:
                extra["CUDA_VISIBLE_DEVICES"] = ",".join(gpus.addresses)
        extra.update(spec.env)
        env = rank_environment(
            os.environ, rank=rank, local_rank=same_host.index(rank), world_size=spec.num_processes,
            local_world_size=len(same_host), master_addr=hosts[0], master_port=peers[0]["port"],
            extra=extra, channel=spec.channel_address, secret=spec.secret, run_id=spec.run_id,
            use_gpu=spec.use_gpu)
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
        wanted = proc.returncode == 0 and (rank == 0 or spec.all_ranks)
        return proc.returncode, read_result(result_dir) if wanted else None
    finally:
        if proc is not None:
            stop_all([proc], TASK_STOP_GRACE)  # also reaches what the worker left in its group
        if port is not None:
            port.close()
        shutil.rmtree(workdir, ignore_errors=True)
        try:
            guard.stdin.write("done\n")
            guard.stdin.close()
        except OSError:
            pass
        guard.wait()
