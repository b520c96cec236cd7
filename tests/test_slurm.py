"""``--backend slurm`` against the real two-node Slurm of ``tests/slurm_cluster.py`` (the contract
suite, ``test_contract``, runs on it too): ranks placed by node as torchrun places them, a run
inside an allocation the notebook runs in, and what the backend refuses before anything starts."""

import os
import re

import pytest

from helpers import assert_no_survivors, rank_failure_of, wait_until
from torchdist_magic import Distributor
from torchdist_magic.backends.slurm import block_placement, tasks_per_node


def placement():
    keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR")
    return {**{k: os.environ[k] for k in keys}, "node": os.environ["SLURMD_NODENAME"]}


def test_the_test_cluster_has_two_nodes(slurm):
    done = slurm.run(["srun", "-N2", "-n4", "sh", "-c", 'echo "$SLURM_NODEID $SLURMD_NODENAME"'])
    assert sorted(set(done.stdout.split("\n")) - {""}) == ["0 node1", "1 node2"]


def test_ranks_on_two_nodes_are_placed_as_torchrun_places_them(slurm):
    run = Distributor(4, backend="slurm", show=None, all_ranks=True, backend_options={"nodes": "2"}).submit(placement)
    values = run.result(timeout=120)
    assert [(v["node"], v["LOCAL_RANK"], v["GROUP_RANK"]) for v in values] == [
        ("node1", "0", "0"),
        ("node1", "1", "0"),
        ("node2", "0", "1"),
        ("node2", "1", "1"),
    ]
    assert {(v["LOCAL_WORLD_SIZE"], v["GROUP_WORLD_SIZE"], v["MASTER_ADDR"]) for v in values} == {
        ("2", "2", "127.0.0.1")
    }
    assert run.state.snapshot().backend == "Slurm steps of the run's own allocation"
    assert_no_survivors(run)


def test_inside_an_allocation_the_ranks_are_its_steps(slurm, monkeypatch):
    granted = slurm.run(["salloc", "--no-shell", "-N2", "-n4", "--job-name=notebook"])
    job = re.search(r"Granted job allocation (\d+)", granted.stderr).group(1)
    try:
        info = slurm.run(["squeue", "-h", "-j", job, "-o", "%N"]).stdout.strip()
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_JOB_NODELIST", info)
        monkeypatch.setenv("SLURM_TASKS_PER_NODE", "3,1")
        run = Distributor(4, backend="slurm", show=None, all_ranks=True).submit(placement)
        values = run.result(timeout=120)
        # the allocation's own spread: three tasks on node1, one on node2
        assert [(v["node"], v["LOCAL_RANK"], v["LOCAL_WORLD_SIZE"]) for v in values] == [
            ("node1", "0", "3"),
            ("node1", "1", "3"),
            ("node1", "2", "3"),
            ("node2", "0", "1"),
        ]
        assert slurm.jobs() == [job]  # the notebook's allocation is not the run's to end
        steps = lambda: slurm.run(["squeue", "-h", "-s", "-j", job, "-o", "%j"]).stdout.split()  # noqa: E731
        wait_until(lambda: not [s for s in steps() if s.startswith("torchdist-")], 30, "the run's steps to end")
        with pytest.raises(ValueError, match=rf"--np 5 is more than the 4 tasks of the Slurm allocation .*job {job}"):
            Distributor(5, backend="slurm", show=None).run(placement)
        with pytest.raises(ValueError, match="backend option partition is for an allocation of the run's own"):
            Distributor(2, backend="slurm", show=None, backend_options={"partition": "debug"}).run(placement)
    finally:
        slurm.run(["scancel", job])


def test_an_interpreter_the_nodes_lack_is_refused_by_name(slurm):
    run = Distributor(1, backend="slurm", show=None, backend_options={"python": "/nonexistent/python3"}).submit(
        placement
    )
    failure = rank_failure_of(run)
    assert re.fullmatch(
        r"rank 0 raised LauncherRefused: the interpreter /nonexistent/python3 does not exist on node\d: give "
        r"one that does \(with torchdist_magic, torch and the job's packages\) as the backend option python=PATH",
        failure.args[0],
    )


def test_an_unknown_backend_option_is_refused_with_the_keys_it_knows(slurm):
    with pytest.raises(ValueError) as refused:
        Distributor(2, backend="slurm", show=None, backend_options={"partiton": "gpu"}).run(placement)
    message = str(refused.value)
    assert message.startswith("backend 'slurm' has no option 'partiton': its options are account (")
    for key in ("nodes", "partition", "time", "python", "spec_dir", "address"):
        assert f" {key} (" in message
    assert not slurm.jobs()  # refused before anything started


@pytest.mark.parametrize(
    "options, message",
    [
        ({"nodes": "0"}, "backend option nodes must be a whole number of at least 1, got '0'"),
        ({"nodes": "3"}, "backend option nodes=3 is more than the run's 2 ranks"),
        ({"python": "python3"}, "backend option python must be an absolute path on the nodes, got 'python3'"),
        ({"spec_dir": "/nonexistent"}, "backend option spec_dir must be an existing directory, got '/nonexistent'"),
    ],
)
def test_bad_backend_option_values_are_refused(slurm, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Distributor(2, backend="slurm", show=None, backend_options=options).run(placement)


def test_a_backend_without_options_refuses_any():
    with pytest.raises(ValueError, match=r"^backend 'local' has no option 'partition': it takes no backend options$"):
        Distributor(1, backend="local", show=None, backend_options={"partition": "gpu"}).run(placement)


def test_without_slurm_s_commands_the_backend_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match=r"backend 'slurm' needs Slurm's client commands .* and srun is not there"):
        Distributor(1, backend="slurm", show=None).run(placement)


def test_the_allocation_s_tasks_are_read_as_slurm_writes_them():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert block_placement(["a", "b"], [2, 2], 3) == ["a", "a", "b"]
    with pytest.raises(ValueError, match=r"cannot read SLURM_TASKS_PER_NODE='x'"):
        tasks_per_node("x")
    with pytest.raises(ValueError, match="the allocation holds 2 tasks, and the run needs 3"):
        block_placement(["a"], [2], 3)
