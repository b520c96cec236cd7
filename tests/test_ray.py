"""``--backend ray`` against the real three-node Ray cluster of ``tests/ray_cluster.py`` (the
contract suite, ``test_contract``, runs on it too): ranks placed by Ray node as torchrun places
them, a run the cluster cannot place refused in seconds naming what is missing, a cancelled or
failed run leaving no actor and no placement group, and what the backend refuses before anything
starts."""

import gc
import os
import re
import signal
import subprocess
import sys

import pytest

from helpers import assert_no_survivors, rank_failure_of, wait_until
from torchdist_magic import Distributor, RunCancelled
from torchdist_magic.driver import distributor

pytestmark = pytest.mark.ray


def placement():
    """The rank's placement, and its Ray node's raylet (``RAY_RAYLET_PID``, which the rank has
    from its actor: ``RayCluster.nodes_by_raylet`` names the node)."""
    keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR")
    return {**{k: os.environ[k] for k in keys}, "raylet": os.environ.get("RAY_RAYLET_PID", "")}


def ray_nodes():
    """``{node id prefix: its resource name}`` of the cluster's worker nodes."""
    import ray

    out = {}
    for node in ray.nodes():
        names = [k for k in node["Resources"] if re.fullmatch(r"node\d", k)]
        if node["Alive"] and names:
            out[node["NodeID"][:12]] = names[0]
    return out


def test_the_test_cluster_has_a_head_and_two_nodes_of_two_cpus(ray_connected):
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 3
    assert sorted(ray_nodes().values()) == ["node1", "node2"]
    assert ray.cluster_resources()["CPU"] == 4


def test_four_ranks_on_two_nodes_are_placed_as_torchrun_places_them(ray_connected):
    import ray

    run = Distributor(4, backend="ray", show=None, all_ranks=True).submit(placement)
    values = run.result(timeout=180)
    # two ranks on each worker node (PACK fills node by node)
    nodes = ray_connected.nodes_by_raylet()
    named = [nodes[int(v["raylet"])] for v in values]
    assert sorted(named) == ["node1", "node1", "node2", "node2"] and named[0] == named[1] and named[2] == named[3]
    placed = [(v["LOCAL_RANK"], v["LOCAL_WORLD_SIZE"], v["GROUP_RANK"], v["GROUP_WORLD_SIZE"]) for v in values]
    assert placed == [("0", "2", "0", "2"), ("1", "2", "0", "2"), ("0", "2", "1", "2"), ("1", "2", "1", "2")]
    assert {v["MASTER_ADDR"] for v in values} == {ray.util.get_node_ip_address()}  # rank 0's node's address
    assert run.state.snapshot().backend == "Ray actors (PACK) on a Ray cluster of 3 nodes"
    assert_no_survivors(run)


def channel_of_rank():
    return os.environ["TORCHDIST_CHANNEL"]


def test_the_ranks_reach_the_driver_through_their_machines_relay(ray_connected, monkeypatch):
    """Four ranks' workers and launchers (eight connections without relays) reach the driver
    over one connection per relay; every actor has ended."""
    monkeypatch.setenv("TORCHDIST_HOST_RELAY", "1")
    run = Distributor(4, backend="ray", show=None, all_ranks=True).submit(channel_of_rank)
    relays = set(run.result(timeout=180))
    assert run.channel_address not in relays and all(r.startswith("127.0.0.1:") for r in relays)
    assert run._channel.stats["accepted"] == len(relays) < 4
    assert_no_survivors(run)


def test_strict_spread_puts_each_rank_on_a_node_of_its_own(ray_connected):
    run = Distributor(
        2, backend="ray", show=None, all_ranks=True, backend_options={"strategy": "strict_spread"}
    ).submit(placement)
    values = run.result(timeout=180)
    assert [(v["LOCAL_RANK"], v["GROUP_RANK"]) for v in values] == [("0", "0"), ("0", "1")]
    nodes = ray_connected.nodes_by_raylet()
    assert sorted(nodes[int(v["raylet"])] for v in values) == ["node1", "node2"]
    assert_no_survivors(run)


@pytest.mark.parametrize(
    "n, options, message",
    [
        (
            5,
            {},
            "5 ranks need 5 Ray bundles of 1 CPU (strategy PACK), but this Ray cluster can place 4: its 3 "
            "alive nodes hold 4 CPU in all; use 4 or fewer ranks, smaller bundles (backend options "
            "num_cpus, num_gpus), or add nodes",
        ),
        (
            3,
            {"strategy": "STRICT_SPREAD"},
            "3 ranks need 3 Ray bundles of 1 CPU each on a node of its own (strategy STRICT_SPREAD), but "
            "this Ray cluster can place 2",
        ),
        (
            2,
            {"num_cpus": "1.5", "strategy": "STRICT_PACK"},
            "2 ranks need 2 Ray bundles of 1.5 CPU all on one node (strategy STRICT_PACK), but this Ray "
            "cluster can place 1",
        ),
        (1, {}, "1 ranks need 1 Ray bundles of 1 CPU, 1 GPU (strategy PACK), but this Ray cluster can place 0"),
    ],
    ids=["more-ranks-than-cpus", "strict-spread", "strict-pack", "gpu"],
)
def test_more_ranks_than_the_cluster_can_place_are_refused_at_once(ray_connected, n, options, message):
    with pytest.raises(ValueError) as refused:
        Distributor(n, backend="ray", show=None, use_gpu=message.endswith("place 0"), backend_options=options).run(
            placement
        )
    assert str(refused.value).startswith(message), str(refused.value)


def test_a_cluster_whose_resources_are_held_says_what_is_free_instead_of_waiting(ray_connected):
    """Resources the cluster has but others hold (here a placement group of the test's own):
    the run's group is not placed, and the run fails within ``RAY_PLACEMENT_WAIT`` naming what
    is free, leaving no placement group of its own."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    held = placement_group([{"CPU": 1}] * 3, strategy="PACK", name="held-by-the-test")
    ray.get(held.ready(), timeout=60)
    try:
        run = Distributor(2, backend="ray", show=None).submit(placement)
        with pytest.raises(ValueError) as failed:
            run.result(timeout=120)
    finally:
        remove_placement_group(held)
    assert str(failed.value) == (
        "the Ray cluster did not place the run's 2 bundles of 1 CPU (strategy PACK) within 10 s: it has "
        "1 CPU free now (other runs or actors hold the rest); use fewer ranks, or run when they are free"
    )


def sleep_and_say():
    import time

    print("sleeping", flush=True)
    time.sleep(600)


def test_cancel_kills_the_actors_and_removes_the_placement_group(ray_connected):
    import ray

    run = Distributor(2, backend="ray", show=None).submit(sleep_and_say)
    wait_until(lambda: all("sleeping" in run.logs(r) for r in (0, 1)), 120, "both ranks to sleep")
    mine = lambda: [g for g in ray.util.placement_group_table().values() if run.run_id in g["name"]]  # noqa: E731
    assert [g["state"] for g in mine()] == ["CREATED"]
    actors = [a for a in ray_connected.alive_actors() if a["class"] == "RankLauncher"]
    assert len(actors) == 2
    run.cancel()
    with pytest.raises(RunCancelled):
        run.result(timeout=60)
    assert [g["state"] for g in mine()] == ["REMOVED"]
    wait_until(lambda: not ray_connected.alive_actors(), 30, "the run's actors to be gone from the state API")
    assert_no_survivors(run, extra_pids=[a["pid"] for a in actors])


def test_an_actor_killed_from_outside_is_its_rank_s_failure(ray_connected):
    run = Distributor(2, backend="ray", show=None).submit(sleep_and_say)
    wait_until(lambda: all("sleeping" in run.logs(r) for r in (0, 1)), 120, "both ranks to sleep")
    actor = [a for a in ray_connected.alive_actors() if a["class"] == "RankLauncher"][0]
    os.kill(actor["pid"], signal.SIGKILL)  # as when its node is lost
    failure = rank_failure_of(run)
    assert failure.exc_type == "LauncherLost"
    assert re.match(r"the Ray actor of rank \d ended without reporting its rank's exit: \w+", failure.message)
    assert_no_survivors(run, extra_pids=[actor["pid"]])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_cpus": "0"}, "backend option num_cpus must be a number of CPUs above 0, got '0'"),
        ({"num_gpus": "-1"}, "backend option num_gpus must be a number of GPUs, 0 or more, got '-1'"),
        (
            {"strategy": "LOOSE"},
            "backend option strategy must be one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD, got 'LOOSE'",
        ),
    ],
)
def test_bad_backend_option_values_are_refused(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Distributor(1, backend="ray", show=None, backend_options=options).run(placement)


def test_an_unknown_backend_option_is_refused_with_the_keys_it_knows():
    with pytest.raises(ValueError) as refused:
        Distributor(1, backend="ray", show=None, backend_options={"num_cpu": "2"}).run(placement)
    message = str(refused.value)
    assert message.startswith("backend 'ray' has no option 'num_cpu': its options are address: ")
    for key in ("num_cpus", "num_gpus", "strategy"):
        assert f"; {key}: " in message


def test_gpu_with_no_gpus_per_rank_is_refused(ray_connected):
    with pytest.raises(
        ValueError, match=r"^use_gpu/--gpu needs GPUs for the ranks, and the backend option num_gpus is 0$"
    ):
        Distributor(1, backend="ray", show=None, use_gpu=True, backend_options={"num_gpus": "0"}).run(placement)


CHILD = """
import sys
from torchdist_magic import Distributor
try:
    Distributor(1, backend="ray", show=None, backend_options=dict(a.split("=", 1) for a in sys.argv[1:])).run(int)
except ValueError as exc:
    print(exc)
"""


def test_without_a_cluster_the_backend_says_how_to_connect(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.startswith(
        "backend 'ray' runs on the Ray cluster this process is connected to, and it is connected to none. "
        "Connect first, e.g.:"
    ), done.stdout + done.stderr


VALUE_CHILD = """
import sys
from torchdist_magic import Distributor
print("value", Distributor(2, backend="ray", show=None, backend_options={"address": sys.argv[1]}).run(lambda: 7))
"""


def test_an_address_option_connects_this_process_to_the_cluster(ray_connected):
    """A process that is not connected yet reaches the cluster by the address option."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", VALUE_CHILD, ray_connected.address], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.stdout.splitlines()[-1:] == ["value 7"], done.stdout + done.stderr[-3000:]


def test_a_bad_address_is_refused_naming_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "address=127.0.0.1:1"], capture_output=True, text=True, env=env, timeout=180
    )
    assert done.stdout.startswith(
        "backend 'ray' could not connect to the Ray cluster at '127.0.0.1:1': nothing answers there "
        "(ConnectionRefusedError: Connection refused)"
    ), done.stdout + done.stderr[-2000:]


def cuda_error_on_rank2():
    import time

    from torchdist_magic import restart_count

    if restart_count() == 0:
        if os.environ["RANK"] == "2":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        time.sleep(600)
    return placement()


def test_a_node_with_a_machine_fault_is_left_out_by_the_next_placement_group(ray_connected):
    run = Distributor((2, 4), backend="ray", show=None, all_ranks=True, max_restarts=1).submit(cuda_error_on_rank2)
    values = run.result(timeout=240)
    (first,) = run.attempts
    assert (first.failure.rank, first.fault.kind, first.world_size) == (2, "machine", 4)
    (left_out,) = run.state.excluded
    assert (left_out.rank, left_out.kind, left_out.why) == (2, "machine", "a CUDA error")
    (bad_id,) = run.backend.left_out  # the node id its placement groups refuse from now on
    bad = ray_nodes()[bad_id[:12]]
    # the next attempt: the two bundles the other node holds, none on the node left out
    nodes = ray_connected.nodes_by_raylet()
    named = [nodes[int(v["raylet"])] for v in values]
    assert len(named) == 2 and bad not in named and len(set(named)) == 1
    assert {v["RANK"] for v in values} == {"0", "1"}
    assert_no_survivors(run)
    del run
    distributor._last_run = None  # the run's directory (its checkpoints) goes with its last reference
    gc.collect()
