"""A run on ``local-cluster[3,1,1024]`` with ``--np 2:3`` that loses a worker's executor JVM
(killed by its pid, found from the rank's own process tree) restarts from its checkpoint on the
two ranks that can still be placed, and names the executor it left out."""

from __future__ import annotations

import os
import signal

import pytest

from helpers import assert_nothing_left, wait_until
from torchdist_magic import Distributor
from torchdist_magic.driver.status import explain, run_status
from torchdist_magic.view.text import summary

pytest.importorskip("pyspark")

STEPS = 12


def train_on_what_is_left(steps):
    """A job that resumes from its checkpoint, on however many ranks it is given."""
    import time

    import torch
    import torch.distributed as dist

    from torchdist_magic import load_checkpoint, progress, save_checkpoint, world_size

    dist.init_process_group("gloo")  # a function's ranks make their own group, as TorchDistributor's do
    state = load_checkpoint() or {"step": 0, "worlds": []}
    worlds = state["worlds"] + [world_size()]
    for step in progress(range(state["step"], steps), desc="step"):
        ones = torch.ones(1)
        dist.all_reduce(ones)
        assert ones.item() == world_size()
        save_checkpoint({"step": step + 1, "worlds": worlds}, step=step + 1)
        time.sleep(0.4)
    dist.destroy_process_group()
    return {"worlds": worlds, "resumed_at": state["step"]}


def java_ancestor(pid: int) -> int:
    """The nearest ``java`` process above ``pid`` (a rank's executor JVM), by /proc."""
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        if comm == "java":
            return pid
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    raise AssertionError("no executor JVM above the rank's process")


def test_a_lost_worker_is_left_out_and_the_run_finishes_on_two_ranks(spark_cluster3, tmp_path):
    run = Distributor(
        num_processes=(2, 3), local_mode=False, max_restarts=1, checkpoint_dir=str(tmp_path / "ckpt"), show=None
    ).submit(train_on_what_is_left, STEPS)
    assert run.options.num_processes == 3  # as many as the cluster places, up to MAX

    def step_of(rank):
        ranks = run_status(run.state)["ranks"]
        bar = ranks[rank]["progress"] if rank < len(ranks) else None
        return bar["n"] if bar else 0

    wait_until(lambda: run.state.attempt == 1 and step_of(2) >= 3, 240, "rank 2 to take three steps")
    rank2 = run_status(run.state)["ranks"][2]
    executor_jvm = java_ancestor(rank2["pid"])
    driver_jvm_pids = {os.getpid(), os.getppid()}
    assert executor_jvm not in driver_jvm_pids
    os.kill(executor_jvm, signal.SIGKILL)

    value = run.result(timeout=300)
    assert value["worlds"] == [3, 2] and value["resumed_at"] >= 3
    status = run_status(run.state)
    assert status["num_processes"] == 2 and status["attempt"] == 2
    (first,) = status["restarts"]
    assert first["world_size"] == 3 and first["fault"]["kind"] == "lost"
    (left_out,) = status["excluded"]
    assert left_out["kind"] == "lost" and left_out["attempt"] == 1 and left_out["executor"]
    assert f"executor {left_out['executor']} was lost" == left_out["why"]
    assert explain(run.state)["excluded"] == status["excluded"]
    sentence = (
        f"executor {left_out['executor']} on {left_out['host']} left out after attempt 1: "
        f"lost fault, executor {left_out['executor']} was lost"
    )
    assert f"  {sentence}" in summary(run.state).splitlines()  # the view
    record = run.record.record  # the run's record in the history of runs
    assert (record.excluded, record.world_sizes) == ([sentence], [3, 2])
    assert_nothing_left(run)


def test_a_range_whose_min_the_cluster_cannot_place_is_refused_before_anything_starts(spark_cluster3):
    with pytest.raises(ValueError) as info:
        Distributor(num_processes=(4, 5), local_mode=False, show=None).submit(train_on_what_is_left, 1)
    assert str(info.value) == (
        "--np/num_processes 4:5 needs at least 4 ranks, but Spark barrier stage on local-cluster[3,1,1024] has room "
        "for 3: lower MIN, or add executors/hosts"
    )
