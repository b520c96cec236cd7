"""Classic Spark: the ranks as one barrier stage of a classic SparkSession (a SparkContext).

The stage is ``sc.parallelize(range(n), n).barrier().mapPartitions(run_barrier_task)``, or for a
data run the DataFrame's ``mapInArrow(..., barrier=True)``; rank 0's value (every rank's with
``all_ranks``) comes back through the stage's ``collect``.  What the stage does in the executors
is ``spark_task``; what the driver shares with Spark Connect is ``spark_stage``.

Interpreter.  Before the stage, ``spark_python.choose_python`` checks that the executors' Python
matches this notebook's (or uses the notebook's own where it is there), so that a mismatch is a
clear error before any training, not a ``ModuleNotFoundError`` from inside Spark.
"""

from __future__ import annotations

import functools
import re
import socket
import threading
import time
from typing import Callable, Dict

from ..core import events
from ..core.timing import SPARK_SLOT_WAIT
from .base import LaunchContext
from .spark_python import build_with_python, choose_python, python_exec
from .spark_stage import (
    GPU_AMOUNT_CONF,
    BarrierStageRun,
    SparkStageBackend,
    data_stage,
    is_spark_connect,
    log,
    sort_rows,
)
from .spark_task import BarrierTaskSpec, run_arrow_task, run_barrier_task

_LOCAL_CLUSTER = re.compile(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]")


def max_concurrent_tasks(sc) -> int:
    """Tasks the registered executors can run at once: the number Spark's own barrier check uses."""
    jsc = sc._jsc.sc()
    try:
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # py4j cannot reach the internal API: estimate from the parallelism  # noqa: BLE001
        return sc.defaultParallelism // max(1, int(sc.getConf().get("spark.task.cpus", "1")))


def task_slots(sc) -> int:
    """How many tasks of one barrier stage can run at the same time on this cluster."""
    slots = max_concurrent_tasks(sc)
    m = _LOCAL_CLUSTER.fullmatch(sc.master.strip())
    if m:  # the executors of a local cluster may still be registering; they will all come
        cpus = max(1, int(sc.getConf().get("spark.task.cpus", "1")))
        slots = max(slots, int(m.group(1)) * (int(m.group(2)) // cpus))
    return slots


class SparkBarrierBackend(SparkStageBackend):
    """Runs the ranks as one barrier stage on ``session``, a classic SparkSession."""

    def __init__(self, session):
        if is_spark_connect(session):
            raise ValueError(
                "this SparkSession is a Spark Connect session: its runs go to spark_connect.SparkConnectBackend"
            )
        super().__init__(session)

    def ranks_share_machine(self) -> bool:
        """``local[...]`` and ``local-cluster[...]``: executors on this machine."""
        return self.session.sparkContext.master.strip().startswith("local")

    @property
    def context(self):
        return self.session.sparkContext

    def describe(self) -> str:
        return f"Spark barrier stage on {self.context.master}"

    def channel_host(self) -> str:
        # the driver's address as Spark knows it: what executors already use to reach the driver
        return self.conf("spark.driver.host", socket.gethostname())

    def conf(self, key: str, default: str = "") -> str:
        return self.context.getConf().get(key, default) or default

    def runtime_conf(self, key: str, default: str = "") -> str:
        # spark.conf sees the SparkContext's settings too; its getConf() misses spark.conf.set
        return self.session.conf.get(key, default) or default

    def gpu_refusal(self) -> str:
        return (
            f"{GPU_AMOUNT_CONF} is not set on this SparkSession; start it with {GPU_AMOUNT_CONF}=1 "
            "and executor GPU resources (spark.executor.resource.gpu.amount, a discovery script)"
        )

    def slots(self) -> int:
        return task_slots(self.context)

    def placeable(self) -> int:
        """The slots of the executors registered now (a lost one's replacement may be on its
        way: a restart does not wait for it)."""
        return max_concurrent_tasks(self.context)

    def exclude(self, exclusion) -> bool:
        """Leave a Spark executor out: one Spark named as lost is gone already; one still
        registered (a machine fault on it) is killed without a replacement
        (``SparkContext.killExecutor``: the cluster manager lowers the application's target).
        A host without an executor id (a rank's own machine error) cannot be steered away from by
        a barrier stage: not taken."""
        if not exclusion.executor:
            return False
        try:
            self.context._jsc.sc().killExecutor(exclusion.executor)
        except Exception as exc:  # noqa: BLE001 - a master that cannot kill executors (local[N]), or it is gone
            log.info("could not kill excluded executor %s (%s: %s)", exclusion.executor, type(exc).__name__, exc)
        return True

    def slot_detail(self) -> str:
        return f" (master {self.context.master}, spark.task.cpus={self.conf('spark.task.cpus', '1')})"

    def wait_for_slots(self, n: int) -> int:
        slots = self.slots()
        deadline = time.monotonic() + SPARK_SLOT_WAIT
        while slots < n and not self.context.master.startswith("local") and time.monotonic() < deadline:
            time.sleep(0.5)  # executors of a cluster that just started may still be registering
            slots = self.slots()
        return slots

    def check_python(self, num_processes: int) -> str:
        return choose_python(self.context, num_processes)

    def stage_run(self, spec: BarrierTaskSpec, ctx: LaunchContext, frame) -> "SparkRun":
        return SparkRun(
            self.context, spec, ctx, self.task_function(spec), ctx.plan.python or self.context.pythonExec, frame
        )

    def task_function(self, spec: BarrierTaskSpec) -> Callable:
        """What each barrier task runs: the ``mapPartitions`` function, or for a data run the
        ``mapInArrow`` function of the DataFrame's stage."""
        if spec.data_schema is not None:
            return functools.partial(run_arrow_task, spec)
        return functools.partial(run_barrier_task, spec)


class SparkRun(BarrierStageRun):
    """The classic barrier stage: an RDD's ``mapPartitions`` collected under a job tag; for a
    data run, the DataFrame's ``mapInArrow(barrier=True)`` stage (``spark_stage.data_stage``)."""

    def __init__(self, sc, spec: BarrierTaskSpec, ctx: LaunchContext, task: Callable, python: str, frame=None):
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
                with python_exec(sc, self._python):  # the stage's function, for the chosen interpreter
                    frame = data_stage(self._frame, n, self._task, self._frame.rdd.getNumPartitions())
                rows = sort_rows(r.asDict() for r in frame.collect())
                self._deliver(rows.values, rows.exits, rows.logs, rows.value_files)
                return
            outcomes = self._barrier_rdd().collect()
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
            return
        finally:
            try:
                sc.removeJobTag(self.job_tag)
                sc.setJobDescription(None)
            except Exception as exc:  # the SparkContext was stopped under the run  # noqa: BLE001
                log.info(
                    "run %s: could not remove job tag %s (%s: %s)",
                    self._spec.run.run_id,
                    self.job_tag,
                    type(exc).__name__,
                    exc,
                )
        exits: Dict[int, events.Exit] = {}
        for outcome in outcomes:
            try:
                exits[outcome.rank] = events.decode(outcome.exit_json)
            except events.MalformedEvent:
                pass  # a task of another version: the channel's handshake said so already
        self._deliver(
            {o.rank: o.value for o in outcomes if o.value is not None},
            exits,
            {o.rank: o.log_tail for o in outcomes if o.channel_lost},
            {o.rank: o.value_file for o in outcomes if o.value_file},
        )

    def _interrupt(self) -> None:
        self._sc.cancelJobsWithTag(self.job_tag)
