"""``--backend slurm`` against the real two-node Slurm of ``tests/slurm_cluster.py`` (the contract
suite, ``test_contract``, runs on it too): ranks placed by node as torchrun places them, a run
inside an allocation the notebook runs in, and what the backend refuses before anything starts."""

import gc
import os
import re
import subprocess

import pytest

from helpers import assert_no_survivors, rank_failure_of, wait_until
from torchdist_magic import Distributor
from torchdist_magic.driver import distributor
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
    assert [r.host for r in run.state.ranks] == ["node1", "node1", "node2", "node2"]  # as the view names them
    assert_no_survivors(run)


def channel_of_rank():
    return os.environ["TORCHDIST_CHANNEL"]


def test_the_ranks_reach_the_driver_through_their_machines_relay(slurm, monkeypatch):
    """Four ranks' workers and launchers (eight connections without relays) reach the driver
    over one connection per relay; every step of the run has ended."""
    monkeypatch.setenv("TORCHDIST_HOST_RELAY", "1")
    run = Distributor(4, backend="slurm", show=None, all_ranks=True, backend_options={"nodes": "2"}).submit(
        channel_of_rank
    )
    relays = set(run.result(timeout=120))
    assert run.channel_address not in relays and all(r.startswith("127.0.0.1:") for r in relays)
    assert run._channel.stats["accepted"] == len(relays) < 4
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
    assert message.startswith("backend 'slurm' has no option 'partiton': its options are account: the account")
    for key in ("nodes", "partition", "time", "python", "spec_dir", "address"):
        assert f"; {key}: " in message
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


def test_a_detached_run_on_slurm_is_attached_and_leaves_nothing(slurm, home):
    import torchdist_magic
    from helpers import assert_nothing_survives

    handle = Distributor(4, backend="slurm", show=None, detach=True, backend_options={"nodes": "2"}).submit(placement)
    assert handle.record.detached and handle.record.pid != os.getpid()
    value = torchdist_magic.attach(handle.run_id).result(120)
    assert (value["node"], value["RANK"], value["LOCAL_WORLD_SIZE"]) == ("node1", "0", "2")
    record = torchdist_magic.runs()[0]
    assert (record.state, record.backend) == ("succeeded", "Slurm steps of the run's own allocation")
    assert_nothing_survives(handle.run_id, handle.record.pid)


def test_a_backend_registered_here_alone_cannot_be_detached(shell_backend, home):
    with pytest.raises(ValueError, match=r"^backend 'shell' was registered in this process \(register_backend\)"):
        Distributor(1, backend="shell", show=None, detach=True).submit(placement)


def test_a_backend_that_says_it_cannot_run_detached_is_refused(slurm, home, monkeypatch):
    from torchdist_magic.backends.slurm import SlurmBackend

    monkeypatch.setattr(SlurmBackend, "detachable", lambda self: False)
    with pytest.raises(ValueError, match=r"^backend 'slurm' cannot run detached \(--detach\): it says so"):
        Distributor(1, backend="slurm", show=None, detach=True).submit(placement)


def wrapper_and_spec_dir(spec_dir):
    return os.environ.get("STARTED_BY_WRAPPER"), sorted(os.listdir(spec_dir))


def test_the_python_and_spec_dir_options_are_what_the_nodes_use(slurm, tmp_path):
    import sys

    python = tmp_path / "python3"  # an interpreter of the nodes' own: here, this one by a wrapper
    python.write_text(f'#!/bin/sh\nSTARTED_BY_WRAPPER=yes exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    shared = tmp_path / "shared"
    shared.mkdir()
    options = {"python": str(python), "spec_dir": str(shared)}
    run = Distributor(2, backend="slurm", show=None, backend_options=options).submit(wrapper_and_spec_dir, str(shared))
    wrapped, listed = run.result(timeout=120)
    assert wrapped == "yes"
    assert len(listed) == 1 and re.fullmatch(rf"torchdist-{run.run_id}-launchers-\w+", listed[0])
    assert os.listdir(shared) == []  # the spec went with the run


def test_the_channel_is_encrypted_when_the_nodes_reach_it_beyond_loopback(slurm):
    from torchdist_magic import LaunchOptions
    from torchdist_magic.backends import make_backend

    def tls(address, **options):
        launch = LaunchOptions(backend="slurm", backend_options={"address": address}, **options)
        return make_backend(launch).check(launch).tls

    assert tls("10.0.0.1") and not tls("127.0.0.1") and tls("127.0.0.1", tls=True) and not tls("10.0.0.1", tls=False)
    hostname = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    for address in [a for a in hostname if "." in a][:1]:  # a real run over this machine's address, where it has one
        run = Distributor(2, backend="slurm", show=None, backend_options={"address": address}).submit(placement)
        assert run.result(timeout=120)["MASTER_ADDR"] == address  # the address the nodes reach it at
        assert run.channel_encrypted


def cuda_error_on_node2():
    import time

    from torchdist_magic import restart_count

    if restart_count() == 0:
        if os.environ["SLURMD_NODENAME"] == "node2" and os.environ["LOCAL_RANK"] == "0":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        time.sleep(600)
    return {"node": os.environ["SLURMD_NODENAME"], "WORLD_SIZE": os.environ["WORLD_SIZE"]}


def test_a_node_with_a_machine_fault_is_left_out_and_the_run_goes_on_with_fewer_ranks(slurm):
    run = Distributor(
        (2, 4), backend="slurm", show=None, all_ranks=True, max_restarts=1, backend_options={"nodes": "2"}
    ).submit(cuda_error_on_node2)
    values = run.result(timeout=180)
    (first,) = run.attempts
    assert (first.failure.rank, first.fault.kind, first.world_size) == (2, "machine", 4)
    # node2 held ranks 2 and 3; the next attempt runs on node1's two tasks
    assert values == [{"node": "node1", "WORLD_SIZE": "2"}] * 2
    (left_out,) = run.state.excluded
    assert (left_out.host, left_out.kind, left_out.why) == ("node2", "machine", "a CUDA error")
    assert_no_survivors(run)
    del run
    distributor._last_run = None  # the run's directory (its checkpoints) goes with its last reference
    gc.collect()


def test_a_node_the_next_attempt_cannot_do_without_is_used_again(slurm):
    # MIN 4 on two nodes of 2 tasks: without node2 the restart would not fit, so node2 is kept
    run = Distributor(
        (4, 4), backend="slurm", show=None, all_ranks=True, max_restarts=1, backend_options={"nodes": "2"}
    ).submit(cuda_error_on_node2)
    values = run.result(timeout=180)
    (first,) = run.attempts
    assert (first.failure.rank, first.fault.kind, first.world_size) == (2, "machine", 4)
    assert [v["node"] for v in values] == ["node1", "node1", "node2", "node2"]
    assert {v["WORLD_SIZE"] for v in values} == {"4"}
    assert run.state.excluded == []
    assert_no_survivors(run)
    del run
    distributor._last_run = None
    gc.collect()
