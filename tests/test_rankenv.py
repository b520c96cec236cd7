"""One route per setting: options resolved once into a RunSpec, placement, each rank's env."""

import pytest

from torchdist_magic.core.options import LaunchOptions
from torchdist_magic.core.rankenv import RunSpec, place_ranks, place_spark_tasks, rank_environment, rank_key


def test_placement_on_two_hosts_is_torchruns():
    places = place_ranks(["a", "b", "a", "b", "c"], "a", 1234, ["0", "3", "1", "2", "0"])
    assert [(p.local_rank, p.local_world_size, p.group_rank, p.group_world_size) for p in places] == [
        (0, 2, 0, 3),
        (0, 2, 1, 3),
        (1, 2, 0, 3),
        (1, 2, 1, 3),
        (0, 1, 2, 3),
    ]
    # one GPU per rank: each rank sees its host's GPUs in local-rank order, cuda:LOCAL_RANK its own
    assert [p.cuda_visible_devices for p in places] == ["0,1", "3,2", "0,1", "3,2", "0"]
    assert {(p.master_addr, p.master_port) for p in places} == {("a", 1234)}


def test_ranks_with_several_gpus_see_their_own():
    places = place_ranks(["a", "a"], "a", 1, ["0,1", "2,3"])
    assert [p.cuda_visible_devices for p in places] == ["0,1", "2,3"]
    assert [p.cuda_visible_devices for p in place_ranks(["a", "a"], "a", 1)] == [None, None]


def test_environment_of_a_rank():
    spec = RunSpec.resolve(
        LaunchOptions(num_processes=4, use_gpu=True, env={"X": "1"}),
        "run-1",
        "127.0.0.1:9",
        "s3cret",
        "launcher-s3cret",
    )
    place = place_ranks(["a", "a", "b", "b"], "a", 1234, [None, None, "3", "5"])[3]  # rank 3: cuda:1
    env = rank_environment({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"}, spec, place)
    assert {
        k: env[k]
        for k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "NODE_RANK",
            "GROUP_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES",
            "TORCHDIST_USE_GPU",
            "TORCHDIST_RETURN_VALUE",
            "X",
            "PATH",
        )
    } == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "a",
        "MASTER_PORT": "1234",
        "CUDA_VISIBLE_DEVICES": "3,5",
        "TORCHDIST_USE_GPU": "1",
        "TORCHDIST_RETURN_VALUE": "0",
        "X": "1",
        "PATH": "/bin",
    }
    # rank 3's own key, neither secret of the run
    assert env["TORCHDIST_SECRET"] == rank_key("s3cret", "worker", 3)
    assert not {"s3cret", "launcher-s3cret", rank_key("s3cret", "worker", 0)} & set(env.values())
    assert int(env["OMP_NUM_THREADS"]) >= 1


@pytest.mark.parametrize("all_ranks, wanted", [(False, ["1", "0", "0"]), (True, ["1", "1", "1"])])
def test_which_ranks_return_their_value(all_ranks, wanted):
    spec = RunSpec.resolve(LaunchOptions(num_processes=3, all_ranks=all_ranks), "r")
    assert [rank_environment({}, spec, p)["TORCHDIST_RETURN_VALUE"] for p in place_ranks(["h"] * 3, "h", 1)] == wanted


def test_user_env_wins_over_launcher_env_but_not_over_the_runs_own():
    spec = RunSpec.resolve(LaunchOptions(num_processes=1, env={"OMP_NUM_THREADS": "7", "RANK": "9"}), "r")
    env = rank_environment({"OMP_NUM_THREADS": "1"}, spec, place_ranks(["h"], "h", 1)[0])
    assert env["OMP_NUM_THREADS"] == "7" and env["RANK"] == "0"


def test_spark_tasks_are_nodes_of_one_process_whatever_the_spread():
    """TorchDistributor's placement: ``devices=1, num_nodes=N`` holds on an uneven spread too."""
    places = place_spark_tasks(["a", "b", "a", "a"], "a", 1234, True, ["0", "0", "1", "2"])
    assert [(p.local_rank, p.local_world_size, p.group_rank, p.group_world_size) for p in places] == [
        (0, 1, r, 4) for r in range(4)
    ]
    assert [p.host_ranks for p in places] == [(0, 2, 3), (1,), (0, 2, 3), (0, 2, 3)]
    # its own GPU first (cuda:0 is its own), then its host's others: peers stay reachable
    assert [p.cuda_visible_devices for p in places] == ["0,1,2", "0", "1,0,2", "2,0,1"]


def test_spark_tasks_never_list_a_gpu_twice():
    # TorchDistributor's fixture: two workers on one machine, each handing out GPU 0
    assert [p.cuda_visible_devices for p in place_spark_tasks(["h", "h"], "h", 1, True, ["0", "0"])] == ["0", "0"]
    # several GPUs per task: its own first
    assert [p.cuda_visible_devices for p in place_spark_tasks(["h", "h"], "h", 1, True, ["0,1", "2,3"])] == [
        "0,1,2,3",
        "2,3,0,1",
    ]


def test_a_cpu_run_on_spark_sees_no_gpu():
    places = place_spark_tasks(["h", "h"], "h", 1, False, [None, None])
    spec = RunSpec.resolve(LaunchOptions(num_processes=2), "r")
    assert [rank_environment({"CUDA_VISIBLE_DEVICES": "0"}, spec, p)["CUDA_VISIBLE_DEVICES"] for p in places] == [
        "",
        "",
    ]
    # with use_gpu but no GPU from Spark, the executor's own setting stays
    assert place_spark_tasks(["h"], "h", 1, True, [None])[0].cuda_visible_devices is None


def test_threads_and_host_ranks_go_by_the_ranks_on_the_machine(monkeypatch):
    import torchdist_magic.core.rankenv as rankenv

    monkeypatch.setattr(rankenv, "cores_available", lambda: 8)
    spec = RunSpec.resolve(LaunchOptions(num_processes=3), "r")
    spark = [rank_environment({}, spec, p) for p in place_spark_tasks(["a", "b", "a"], "a", 1, False)]
    assert [(e["OMP_NUM_THREADS"], e["TORCHDIST_HOST_RANKS"]) for e in spark] == [
        ("4", "0,2"),
        ("8", "1"),
        ("4", "0,2"),
    ]
    local = [rank_environment({}, spec, p) for p in place_ranks(["h"] * 3, "h", 1)]
    assert [(e["OMP_NUM_THREADS"], e["TORCHDIST_HOST_RANKS"]) for e in local] == [("2", "0,1,2")] * 3


def test_host_ranks_outside_and_inside_a_run(monkeypatch):
    from torchdist_magic import host_ranks

    monkeypatch.delenv("TORCHDIST_HOST_RANKS", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert host_ranks() == [0]
    monkeypatch.setenv("TORCHDIST_HOST_RANKS", "1,4,6")
    assert host_ranks() == [1, 4, 6]
