"""One route per setting: options resolved once into a RunSpec, placement, each rank's env."""

import pytest

from torchdist_magic.options import LaunchOptions
from torchdist_magic.rankenv import RunSpec, place_ranks, rank_environment


def test_placement_on_two_hosts_is_torchruns():
    places = place_ranks(["a", "b", "a", "b", "c"], "a", 1234, ["0", "3", "1", "2", "0"])
    assert [(p.local_rank, p.local_world_size, p.group_rank, p.group_world_size) for p in places] == [
        (0, 2, 0, 3), (0, 2, 1, 3), (1, 2, 0, 3), (1, 2, 1, 3), (0, 1, 2, 3)]
    # one GPU per rank: each rank sees its host's GPUs in local-rank order, cuda:LOCAL_RANK its own
    assert [p.cuda_visible_devices for p in places] == ["0,1", "3,2", "0,1", "3,2", "0"]
    assert {(p.master_addr, p.master_port) for p in places} == {("a", 1234)}


def test_ranks_with_several_gpus_see_their_own():
    places = place_ranks(["a", "a"], "a", 1, ["0,1", "2,3"])
    assert [p.cuda_visible_devices for p in places] == ["0,1", "2,3"]
    assert [p.cuda_visible_devices for p in place_ranks(["a", "a"], "a", 1)] == [None, None]


def test_environment_of_a_rank():
    spec = RunSpec.resolve(LaunchOptions(num_processes=4, use_gpu=True, env={"X": "1"}), "run-1",
                           "127.0.0.1:9", "s3cret", "launcher-s3cret")
    place = place_ranks(["a", "a", "b", "b"], "a", 1234, [None, None, "3", "5"])[3]  # rank 3: cuda:1
    env = rank_environment({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"}, spec, place)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                                "TORCHDIST_USE_GPU", "TORCHDIST_RETURN_VALUE", "X", "PATH")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "NODE_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1234",
        "CUDA_VISIBLE_DEVICES": "3,5", "TORCHDIST_USE_GPU": "1", "TORCHDIST_RETURN_VALUE": "0", "X": "1",
        "PATH": "/bin"}
    assert env["TORCHDIST_SECRET"] == "s3cret" and "launcher-s3cret" not in env.values()
    assert int(env["OMP_NUM_THREADS"]) >= 1


@pytest.mark.parametrize("all_ranks, wanted", [(False, ["1", "0", "0"]), (True, ["1", "1", "1"])])
def test_which_ranks_return_their_value(all_ranks, wanted):
    spec = RunSpec.resolve(LaunchOptions(num_processes=3, all_ranks=all_ranks), "r")
    assert [rank_environment({}, spec, p)["TORCHDIST_RETURN_VALUE"]
            for p in place_ranks(["h"] * 3, "h", 1)] == wanted


def test_user_env_wins_over_launcher_env_but_not_over_the_runs_own():
    spec = RunSpec.resolve(LaunchOptions(num_processes=1, env={"OMP_NUM_THREADS": "7", "RANK": "9"}), "r")
    env = rank_environment({"OMP_NUM_THREADS": "1"}, spec, place_ranks(["h"], "h", 1)[0])
    assert env["OMP_NUM_THREADS"] == "7" and env["RANK"] == "0"
