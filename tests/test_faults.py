"""Root causes classified (``core.faults``) from failure records as the backends make them, the
next attempt's world and exclusions (``driver.elastic``), ``--np MIN:MAX``, and a local run
whose rank is killed by SIGKILL named a machine fault in its status and explanation."""

from __future__ import annotations

import gc
import os
import signal

import pytest

from helpers import assert_no_survivors
from torchdist_magic import LaunchOptions, RankFailure, rank
from torchdist_magic.backends.spark_stage import spark_failure
from torchdist_magic.core import events, faults
from torchdist_magic.core.failure import Failure
from torchdist_magic.core.flags import FlagError, parse_flags
from torchdist_magic.driver import distributor, elastic

#: what Spark 4 raises from ``collect()`` when an executor JVM under a barrier task is killed
EXECUTOR_LOST = (
    "org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a "
    "failed barrier ResultStage. Most recent failure reason: Stage failed because barrier task "
    "ResultTask(3, 2) finished unsuccessfully.\n"
    "ExecutorLostFailure (executor 2 exited caused by one of the running tasks) Reason: Command "
    "exited with code 137\n"
    "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:2856)"
)


def test_a_lost_spark_executor_is_lost_and_names_its_executor():
    _, failure = spark_failure(Exception(EXECUTOR_LOST))
    fault = faults.classify(failure)
    assert fault == faults.Fault(faults.LOST, "executor 2 was lost") and fault.excludes_host
    excluded = faults.exclusion(failure, fault, attempt=1)
    assert (excluded.executor, excluded.kind, excluded.attempt) == ("2", faults.LOST, 1)
    assert excluded.sentence().startswith("executor 2 on ")


def test_a_user_error_is_the_users_and_leaves_the_host_in():
    try:
        raise ValueError("shape mismatch")
    except ValueError as exc:
        failure = Failure.from_exception(1, exc, host="node-a")
    fault = faults.classify(failure)
    assert fault.kind == faults.USER and not fault.excludes_host
    assert faults.exclusion(failure, fault, 1) is None


@pytest.mark.parametrize(
    "exc_type, message, why",
    [
        ("RuntimeError", "CUDA error: an illegal memory access was encountered", "a CUDA error"),
        ("DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error", "an NCCL error"),
        ("RuntimeError", "CUDA error: uncorrectable ECC error encountered", "an ECC error on its GPU"),
        ("OSError", "[Errno 28] No space left on device: '/ckpt/checkpoint-000000012.pt'", "its disk is full"),
    ],
)
def test_machine_errors_are_the_machines(exc_type, message, why):
    failure = Failure(rank=0, host="node-b", exit_code=1, exc_type=exc_type, message=message)
    fault = faults.classify(failure)
    assert (fault.kind, fault.why) == (faults.MACHINE, why)
    assert faults.exclusion(failure, fault, 2).host == "node-b"


def test_cuda_out_of_memory_is_the_jobs():
    failure = Failure(exc_type="OutOfMemoryError", message="CUDA out of memory. Tried to allocate 2.00 GiB")
    assert faults.classify(failure).kind == faults.USER


def test_a_rank_killed_by_sigkill_is_a_machine_fault():
    failure = Failure.from_exit(0, -signal.SIGKILL, host="node-c")
    fault = faults.classify(failure)
    assert fault.kind == faults.MACHINE and "OOM killer" in fault.why


def test_a_gpu_the_preflight_saw_with_ecc_errors_or_throttled_is_the_machine():
    failure = Failure(exc_type="RuntimeError", message="loss is nan")
    ecc = events.Preflight(rank=0, gpus=[events.GpuHealth(index=1, ecc_errors=3)])
    throttled = events.Preflight(rank=0, gpus=[events.GpuHealth(index=0, throttled="hw_slowdown")])
    assert (
        faults.classify(failure, preflight=ecc).why == "its GPU 1 had 3 uncorrected ECC errors at the pre-flight check"
    )
    assert faults.classify(failure, preflight=throttled).kind == faults.MACHINE
    assert faults.classify(failure, preflight=events.Preflight(rank=0, gpus=[events.GpuHealth(index=0)])).kind == "user"


def test_a_hang_is_a_hang():
    assert faults.classify(None, hung=True).kind == faults.HANG


# -- --np MIN:MAX ---------------------------------------------------------------------------------
def test_np_takes_a_range_from_python_and_flags():
    assert (LaunchOptions(num_processes=(2, 3)).num_processes, LaunchOptions(num_processes=(2, 3)).min_processes) == (
        3,
        2,
    )
    parsed = LaunchOptions(**{k: v for k, v in vars(parse_flags("--np 2:3")).items() if k == "num_processes"})
    assert (parsed.num_processes, parsed.min_processes) == (3, 2)
    with pytest.raises(ValueError, match=r"num_processes MIN:MAX needs MIN <= MAX, got 3:2"):
        LaunchOptions(num_processes=(3, 2))
    with pytest.raises(ValueError, match=r"num_processes as a range is \(MIN, MAX\), two numbers"):
        LaunchOptions(num_processes=(1, 2, 3))
    with pytest.raises(ValueError, match=r"min_processes \(4\) must be at most num_processes \(3\)"):
        LaunchOptions(num_processes=3, min_processes=4)
    with pytest.raises(ValueError, match="min_processes is 1 but num_processes says 2: give one of them"):
        LaunchOptions(num_processes=(2, 3), min_processes=1)
    with pytest.raises(FlagError, match=r"argument --np: needs N or MIN:MAX \(whole numbers\), got '2:x'"):
        parse_flags("--np 2:x")


class Cluster:
    """A backend as ``elastic`` sees it: slots now, and what it agrees to leave out."""

    def __init__(self, slots, can_exclude=True):
        self.slots_now, self.can_exclude, self.excluded = slots, can_exclude, []

    def slots(self):
        return self.slots_now

    def placeable(self):
        return self.slots_now

    def exclude(self, exclusion):
        self.excluded.append(exclusion)
        return self.can_exclude

    def describe(self):
        return "a cluster of 2 slots"


def test_the_first_attempt_places_what_fits_and_refuses_below_min():
    assert elastic.first_world(LaunchOptions(num_processes=(2, 4)), Cluster(3)).num_processes == 3
    assert elastic.first_world(LaunchOptions(num_processes=(2, 4)), Cluster(None)).num_processes == 4
    with pytest.raises(
        ValueError, match="--np/num_processes 3:4 needs at least 3 ranks, but a cluster of 2 slots has room for 2"
    ):
        elastic.first_world(LaunchOptions(num_processes=(3, 4)), Cluster(2))


def test_a_restart_after_a_lost_executor_goes_on_with_fewer_ranks_down_to_min():
    _, lost = spark_failure(Exception(EXECUTOR_LOST))
    fault = faults.classify(lost)
    cluster = Cluster(3)  # the lost executor's replacement registered already: not waited for, not used
    world = elastic.next_world(LaunchOptions(num_processes=(2, 3), max_restarts=1), cluster, lost, fault, 1)
    assert (world.num_processes, [e.executor for e in world.excluded], world.refusal) == (2, ["2"], "")
    # a fixed world keeps its size; the exclusion is still taken
    fixed = elastic.next_world(LaunchOptions(num_processes=3, max_restarts=1), Cluster(3), lost, fault, 1)
    assert (fixed.num_processes, len(fixed.excluded)) == (3, 1)
    # below MIN: no restart, saying why
    below = elastic.next_world(LaunchOptions(num_processes=(3, 3), max_restarts=2), Cluster(3), lost, fault, 1)
    assert below.refusal.startswith("executor 2 on ")
    assert below.refusal.endswith(
        "the next attempt could place 2 ranks, fewer than MIN 3 of --np/num_processes MIN:MAX; 2 restarts left"
    )
    # a backend without hosts (local processes) leaves nothing out and keeps the world
    local = elastic.next_world(
        LaunchOptions(num_processes=(1, 2), max_restarts=1), Cluster(None, False), lost, fault, 1
    )
    assert (local.num_processes, local.excluded) == (2, ())


class Hosts(Cluster):
    """A backend whose places go with the hosts it leaves out (a Slurm allocation's nodes)."""

    def __init__(self, per_host, hosts):
        super().__init__(per_host * len(hosts))
        self.per_host, self.hosts = per_host, list(hosts)

    def placeable(self):
        return self.per_host * sum(1 for h in self.hosts if h not in [e.host for e in self.excluded])

    def readmit(self, exclusion):
        self.excluded.remove(exclusion)
        return True


def test_a_machine_that_faulted_is_used_again_only_where_the_next_attempt_cannot_do_without_it():
    failure = Failure(rank=2, host="node2", exit_code=1, exc_type="RuntimeError", message="CUDA error: unknown")
    fault = faults.classify(failure)
    assert fault.kind == "machine"
    # a fixed world of 4 on two nodes of 2: without node2 it would not fit, so node2 is kept
    tight = Hosts(2, ["node1", "node2"])
    world = elastic.next_world(LaunchOptions(num_processes=4, max_restarts=1), tight, failure, fault, 1)
    assert (world.num_processes, world.excluded, world.refusal, tight.excluded) == (4, (), "", [])
    # MIN 4 of 2:4 alike; MIN 2 fits on node1: node2 is left out
    assert (
        elastic.next_world(LaunchOptions(num_processes=(4, 4), max_restarts=1), tight, failure, fault, 1).excluded == ()
    )
    roomy = elastic.next_world(LaunchOptions(num_processes=(2, 4), max_restarts=1), tight, failure, fault, 1)
    assert (roomy.num_processes, [e.host for e in roomy.excluded]) == (2, ["node2"])
    # with a third node, a fixed world of 4 runs without node2
    spare = Hosts(2, ["node1", "node2", "node3"])
    fixed = elastic.next_world(LaunchOptions(num_processes=4, max_restarts=1), spare, failure, fault, 1)
    assert (fixed.num_processes, [e.host for e in fixed.excluded]) == (4, ["node2"])


# -- a local run --------------------------------------------------------------------------------
def killed_on_rank1():
    import time

    if rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def test_a_local_rank_killed_like_the_oom_killer_does_is_named_a_machine_fault(local_distributor):
    from torchdist_magic.cli import explain_text
    from torchdist_magic.driver.status import explain, run_status
    from torchdist_magic.view.text import summary

    run = local_distributor(2, max_restarts=1).submit(killed_on_rank1)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    assert info.value.rank == 1 and info.value.exit_code == -signal.SIGKILL
    status = run_status(run.state)
    assert status["fault"]["kind"] == "machine" and "SIGKILL" in status["fault"]["why"]
    assert [(a["world_size"], a["fault"]["kind"]) for a in status["restarts"]] == [(2, "machine")]
    assert status["excluded"] == []  # local processes: no host to leave out
    text = explain_text(explain(run.state))
    assert "fault: machine (its process was killed by SIGKILL, as the kernel's OOM killer does" in text
    assert "  attempt 1 on 2 ranks: rank 1" in text and "[machine fault]" in text
    assert "was killed by SIGKILL [machine fault, 2 ranks] (restarted)" in summary(run.state)
    record = run.record.record  # the run's record in the history of runs
    assert record.fault.startswith("machine: its process was killed by SIGKILL")
    assert (record.world_sizes, record.excluded) == ([2, 2], [])
    assert_no_survivors(run)
    del run, info
    distributor._last_run = None  # the run's directory goes with its last reference
    gc.collect()
