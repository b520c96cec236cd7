"""Spark backend beyond the contract suite: ranks really run inside executors, big values come
back through collect, bad placements are refused before anything starts, a stage that fails
outside any rank still ends as a readable RankFailure, and nothing is left behind."""

import importlib.util
import os
import signal
import time

import pytest

from helpers import assert_nothing_left, one, wait_until
from torchdist_magic import Distributor, LaunchOptions, RankFailure, RunCancelled, rank
from torchdist_magic.backends import make_backend
from torchdist_magic.backends.spark_classic import SparkBarrierBackend, SparkRun

pytestmark = pytest.mark.spark  # also run under pyspark 3.5 (README's test command)


def spark_dist(n=2, **options):
    return Distributor(n, local_mode=False, show=None, **options)


def ancestors_and_environment():
    """(pid, command line) of every process above this one, and the rank's environment."""
    chain = []
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            chain.append((pid, fh.read().replace(b"\0", b" ").decode(errors="replace")))
        with open(f"/proc/{pid}/stat", "rb") as fh:
            pid = int(fh.read().rsplit(b")", 1)[1].split()[1])
    names = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "MASTER_ADDR",
        "FROM_OPTIONS",
        "CUDA_VISIBLE_DEVICES",
        "TORCHDIST_HOST_RANKS",
    )
    return {"rank": rank(), "ancestors": chain, "env": {k: os.environ.get(k) for k in names}}


def state_dict_of_mib(mib):
    import torch

    return {"weight": torch.arange(mib * 2**18, dtype=torch.float32), "rank": rank()}


def kill_my_spark_task(bad_rank):
    print("started", flush=True)
    if rank() == bad_rank:
        time.sleep(0.5)
        os.kill(os.getppid(), signal.SIGKILL)  # the Python process of this rank's Spark task
    time.sleep(600)


def say_stopped_on_sigterm():
    def on_sigterm(signum, frame):
        print(f"rank {rank()} stopping cleanly", flush=True)
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    print("ready", flush=True)
    time.sleep(600)


@pytest.mark.spark
def test_ranks_run_inside_executor_processes(spark_cluster, monkeypatch):
    # the executors' own environment names a GPU: a CPU run must not see it
    monkeypatch.setitem(spark_cluster.sparkContext.environment, "CUDA_VISIBLE_DEVICES", "0")
    run = spark_dist(2, all_ranks=True, env={"FROM_OPTIONS": "yes"}).submit(ancestors_and_environment)
    values = run.result(timeout=180)
    executors = []
    for r, value in enumerate(values):
        # each task a node of one process, as under TorchDistributor, though both share this host
        assert value["env"] == {
            "RANK": str(r),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "NODE_RANK": str(r),
            "GROUP_RANK": str(r),
            "GROUP_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "FROM_OPTIONS": "yes",
            "CUDA_VISIBLE_DEVICES": "",
            "TORCHDIST_HOST_RANKS": "0,1",
        }
        jvms = [cmd for _, cmd in value["ancestors"] if "CoarseGrainedExecutorBackend" in cmd]
        assert jvms, f"rank {value['rank']} is not below an executor JVM: {value['ancestors']}"
        words = jvms[0].split()
        executors.append(words[words.index("--executor-id") + 1])
    assert len(set(executors)) == 2, f"both ranks ran in one executor: {executors}"
    assert run.state.backend == "Spark barrier stage on local-cluster[2,1,1024]"
    assert_nothing_left(run)


@pytest.mark.spark
@pytest.mark.parametrize("session", ["spark_local2", "spark_cluster"])
def test_50_mib_value_comes_back_through_collect(request, session):
    request.getfixturevalue(session)
    run = spark_dist(2).submit(state_dict_of_mib, 50)
    value = run.result(timeout=180)
    assert value["rank"] == 0
    assert value["weight"].numel() * 4 == 50 * 2**20
    assert float(value["weight"][-1]) == 50 * 2**18 - 1
    assert_nothing_left(run)


@pytest.mark.spark
@pytest.mark.parametrize("session", ["spark_local2", "spark_cluster"])
def test_more_ranks_than_task_slots_is_refused_before_start(request, session):
    from torchdist_magic.driver.distributor import last_run

    request.getfixturevalue(session)
    before = last_run()
    with pytest.raises(ValueError) as info:
        spark_dist(3).submit(one)
    text = str(info.value)
    assert "3 ranks need 3 Spark task slots" in text
    assert "has 2" in text
    assert last_run() is before


@pytest.mark.spark
def test_gpu_without_spark_task_gpus_is_refused(spark_local2):
    with pytest.raises(ValueError, match=r"spark\.task\.resource\.gpu\.amount is not set"):
        spark_dist(1, use_gpu=True).submit(one)


def test_spark_connect_session_is_refused():
    connect_session = type("SparkSession", (), {"__module__": "pyspark.sql.connect.session"})()
    with pytest.raises(
        ValueError, match="is a Spark Connect session: its runs go to spark_connect.SparkConnectBackend"
    ):
        SparkBarrierBackend(connect_session)


def interpreter():
    import sys

    return sys.executable


@pytest.mark.spark
@pytest.mark.parametrize("session", ["spark_local2", "spark_cluster"])
def test_ranks_run_on_the_notebooks_interpreter_when_sparks_cannot(request, session, monkeypatch):
    import sys

    spark = request.getfixturevalue(session)
    # what Spark would start otherwise: ``python3`` from PATH, here one that does not exist
    monkeypatch.setattr(spark.sparkContext, "pythonExec", "/nonexistent/python3")
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    run = spark_dist(2, all_ranks=True).submit(interpreter)
    assert run.result(timeout=120) == [sys.executable] * 2
    assert spark.sparkContext.pythonExec == "/nonexistent/python3"  # the session itself is unchanged
    assert_nothing_left(run)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A Python of the same version without torch, cloudpickle or torchdist_magic."""
    import subprocess
    import sys

    env = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    return str(env / "bin" / "python")


@pytest.mark.spark
def test_executors_with_another_interpreter_are_refused_before_training(spark_local2, bare_python, monkeypatch):
    from torchdist_magic.backends.spark_python import InterpreterMismatch

    monkeypatch.setenv("PYSPARK_PYTHON", bare_python)  # the user's choice: no fallback
    monkeypatch.setattr(spark_local2.sparkContext, "pythonExec", bare_python)
    with pytest.raises(InterpreterMismatch) as info:
        spark_dist(2).submit(interpreter)
    text = str(info.value)
    assert f"with the interpreter you chose ({bare_python})" in text
    assert f"executors:     {bare_python} on " in text
    assert "torch 2.13.0 here, not installed there" in text.replace("+cpu", "")
    import cloudpickle

    assert f"cloudpickle {cloudpickle.__version__} here, not installed there" in text  # 2.2 in compat, 3.1 in .venv
    assert text.count(f"executors:     {bare_python}") == 1  # the same executor facts once
    assert "spark.pyspark.python" in text and "spark.archives" in text


def test_interpreter_differences_are_named():
    from torchdist_magic.backends.spark_python import describe, differences

    mine = {
        "executable": "/a/python",
        "python": "3.11.7",
        "host": "h",
        "packages": {"torch": "2.13.0+cpu", "cloudpickle": "3.1.2", "torchdist_magic": "0.1.0"},
    }
    same_but_cuda = dict(mine, python="3.11.2", packages=dict(mine["packages"], torch="2.13.0+cu124"))
    assert differences(mine, same_but_cuda) == []
    other = dict(mine, python="3.10.12", packages={"torch": None, "cloudpickle": "2.2.1", "torchdist_magic": "0.1.0"})
    assert differences(mine, other) == [
        "Python 3.11.7 here, 3.10.12 there",
        "torch 2.13.0+cpu here, not installed there",
        "cloudpickle 3.1.2 here, 2.2.1 there",
    ]
    assert describe(other) == (
        "/a/python on h: Python 3.10.12, torch not installed, cloudpickle 2.2.1, torchdist_magic 0.1.0"
    )


@pytest.mark.spark
def test_auto_backend_is_spark_when_a_session_is_active(spark_local2):
    assert isinstance(make_backend(LaunchOptions(backend="auto")), SparkBarrierBackend)
    run = Distributor(2, local_mode=None, show=None).submit(one)
    assert run.result(timeout=120) == 1
    assert run.state.backend == "Spark barrier stage on local[2]"
    assert_nothing_left(run)


@pytest.mark.spark
@pytest.mark.parametrize("session", ["spark_local2", "spark_cluster"])
def test_killed_spark_task_is_rank_failure_with_spark_reason(request, session):
    request.getfixturevalue(session)
    run = spark_dist(2).submit(kill_my_spark_task, 1)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    err = info.value
    assert err.rank == 1
    assert err.exc_type == "SparkException"
    assert "Python worker exited unexpectedly" in err.message
    assert "Py4JJavaError" not in str(err) and "\tat org.apache" not in str(err)
    assert_nothing_left(run)  # the task's guard stopped the orphaned worker and removed its files


class ClosureFailsOnExecutorBackend(SparkBarrierBackend):
    """A task function that fails in the Spark task itself, before any rank starts."""

    def task_function(self, spec):
        def task(partition):
            raise ImportError("No module named 'torchdist_magic' (simulated on the executor)")

        return task


@pytest.mark.spark
def test_stage_failure_is_rank_failure_with_the_python_exception(spark_local2, monkeypatch):
    import torchdist_magic.driver.distributor as distributor

    monkeypatch.setattr(distributor, "make_backend", lambda options: ClosureFailsOnExecutorBackend(spark_local2))
    run = spark_dist(2).submit(one)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    err = info.value
    assert err.exc_type == "ImportError"
    assert err.message == "No module named 'torchdist_magic' (simulated on the executor)"
    assert "raise ImportError(" in err.traceback
    assert "Py4JJavaError" not in str(err) and "\tat org.apache" not in str(err)
    assert {rs.state for rs in run.state.ranks} == {"failed", "cancelled"}
    assert_nothing_left(run)


@pytest.mark.spark
def test_cancel_gives_ranks_their_sigterm_grace(spark_local2):
    run = spark_dist(2).submit(say_stopped_on_sigterm)
    wait_until(lambda: all("ready" in run.logs(r) for r in (0, 1)), 60, "both ranks to be ready")
    run.cancel()
    with pytest.raises(RunCancelled):
        run.result(timeout=60)
    for r in (0, 1):
        assert f"rank {r} stopping cleanly" in run.logs(r)
    assert {rs.state for rs in run.state.ranks} == {"cancelled"}
    assert_nothing_left(run)


def placement_and_all_reduce():
    import sys

    import torch
    import torch.distributed as dist

    names = (
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "GROUP_WORLD_SIZE",
        "MASTER_ADDR",
        "SPARK_LOCAL_IP",
    )
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return {"env": {k: os.environ.get(k) for k in names}, "sum": total.item(), "python": sys.executable}


@pytest.mark.spark
def test_ranks_on_two_hosts_are_placed_as_torchrun_would(spark_standalone):
    """Two workers bound to 127.0.0.2 and 127.0.0.3 stand for two hosts; the driver sees both
    executors' connections come from 127.0.0.1, so hosts must be told apart by the executors."""
    import sys

    run = spark_dist(2, all_ranks=True).submit(placement_and_all_reduce)
    values = run.result(timeout=180)
    envs = [v["env"] for v in values]
    assert {e["SPARK_LOCAL_IP"] for e in envs} == {"127.0.0.2", "127.0.0.3"}
    for r, env in enumerate(envs):
        assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(r), "0", "1")
        assert env["GROUP_RANK"] == env["NODE_RANK"] == str(r) and env["GROUP_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == envs[0]["SPARK_LOCAL_IP"]  # rank 0's own address
    assert [v["sum"] for v in values] == [3.0, 3.0]
    # the workers' ``python3`` lacks torch: the notebook's interpreter, which is there, runs the ranks
    assert [v["python"] for v in values] == [sys.executable] * 2
    assert_nothing_left(run)


def this_runs_relay_files():
    """Where this rank's host relay keeps its files (``launch.hostrelay``), less their suffix: the
    relay whose address is this rank's channel (other tests' runs may have relays of their own)."""
    import glob
    import tempfile

    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"torchdist-{os.geteuid()}*", "relay-*.address")):
        with open(path) as fh:
            if fh.read().split()[-1] == os.environ["TORCHDIST_CHANNEL"]:
                return path[: -len(".address")]
    return ""


def channel_and_hello():
    print(f"rank {rank()} says hello", flush=True)
    return {
        "channel": os.environ["TORCHDIST_CHANNEL"],
        "cert": os.environ.get("TORCHDIST_CHANNEL_CERT", ""),
        "relay_files": this_runs_relay_files(),
    }


def say_relay_files_then_kill_my_spark_task(bad_rank):
    print(f"relay files: {this_runs_relay_files()}", flush=True)
    kill_my_spark_task(bad_rank)


@pytest.mark.spark
def test_a_machines_ranks_reach_the_driver_through_one_relay(spark_cluster, monkeypatch):
    """Two executors on this machine: their ranks' workers and launchers (four connections
    without a relay) reach the driver over the one connection of the relay one launcher
    started, and it leaves nothing behind."""
    import glob

    monkeypatch.setenv("TORCHDIST_HOST_RELAY", "1")
    run = spark_dist(2, all_ranks=True).submit(channel_and_hello)
    values = run.result(timeout=180)
    relay = values[0]["channel"]
    assert relay.startswith("127.0.0.1:") and values[1]["channel"] == relay != run.channel_address
    assert [v["cert"] for v in values] == ["", ""]  # the relay's loopback; the driver's side is TLS
    assert run._channel.encrypted and run._channel.stats["accepted"] == 1
    logs = [run.logs(r) for r in (0, 1)]
    assert [f"rank {r} says hello" in logs[r] for r in (0, 1)] == [True, True]
    started = [r for r in (0, 1) if "host relay: this machine's ranks reach the driver over one connection" in logs[r]]
    assert len(started) == 1, logs
    assert_nothing_left(run)
    files = {v["relay_files"] for v in values}
    assert len(files) == 1 and files != {""}  # both ranks saw the one relay's files while it ran
    assert glob.glob(files.pop() + ".*") == []  # and they went with it


@pytest.mark.spark
@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_task_leaves_no_relay_files_whichever_started_the_relay(spark_cluster, monkeypatch, killed):
    import glob
    import re

    monkeypatch.setenv("TORCHDIST_HOST_RELAY", "1")
    run = spark_dist(2).submit(say_relay_files_then_kill_my_spark_task, killed)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    assert info.value.rank == killed
    assert_nothing_left(run)
    said = {m for r in (0, 1) for m in re.findall(r"relay files: (\S+)", run.logs(r))}
    assert len(said) == 1, [run.logs(r) for r in (0, 1)]  # the machine's one relay, while it ran
    files = said.pop()
    wait_until(lambda: not glob.glob(files + ".*"), 30, "the relay's files to go")


class OneTaskCannotReachTheDriver(SparkBarrierBackend):
    """Rank 1's task is given an address where no driver listens (a firewalled driver)."""

    def task_function(self, spec):
        import dataclasses

        from torchdist_magic.backends.spark_task import run_barrier_task

        cut_off = dataclasses.replace(spec, run=dataclasses.replace(spec.run, channel_address="127.0.0.1:9"))

        def task(partition):
            from pyspark import BarrierTaskContext

            return run_barrier_task(cut_off if BarrierTaskContext.get().partitionId() == 1 else spec, partition)

        return task


@pytest.mark.spark
def test_tasks_that_cannot_reach_the_driver_still_rendezvous(spark_local2, monkeypatch):
    import torchdist_magic.backends.spark_stage as spark_stage
    import torchdist_magic.driver.distributor as distributor

    monkeypatch.setattr(spark_stage, "SPARK_RENDEZVOUS_WAIT", 1.0)  # the driver's wait for rank 1
    monkeypatch.setattr(distributor, "make_backend", lambda options: OneTaskCannotReachTheDriver(spark_local2))
    run = spark_dist(2, all_ranks=True).submit(placement_and_all_reduce)
    values = run.result(timeout=120)
    assert [v["sum"] for v in values] == [3.0, 3.0]  # both ranks joined one process group
    assert [v["env"]["RANK"] for v in values] == ["0", "1"]
    # rank 1's exit reached the driver through the stage's result, its only way back
    assert [(rs.state, rs.exit_code) for rs in run.state.ranks] == [("done", 0), ("done", 0)]
    assert run.state.ranks[1].pid is None and run.state.ranks[0].pid  # no live events from rank 1
    assert run.logs(1).startswith("[torchdist] no live view of this rank") and "no live view" not in run.logs(0)
    assert_nothing_left(run)


@pytest.mark.spark
def test_pyspark_python_set_after_the_session_started_is_what_runs(spark_local2, bare_python, monkeypatch):
    """A user who started the session without PYSPARK_PYTHON, then set it to the notebook's own
    interpreter, gets that interpreter: it is what is probed, and what runs the ranks."""
    import sys

    from torchdist_magic.backends import spark_python

    monkeypatch.setattr(spark_local2.sparkContext, "pythonExec", bare_python)  # Spark's own: no torch
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    monkeypatch.setattr(spark_python, "_chosen", {})
    run = spark_dist(2, all_ranks=True).submit(interpreter)
    assert run.result(timeout=120) == [sys.executable] * 2
    assert_nothing_left(run)


@pytest.mark.spark
def test_a_chosen_interpreter_that_cannot_run_the_ranks_is_the_one_named(spark_local2, bare_python, monkeypatch):
    import sys

    from torchdist_magic.backends import spark_python

    monkeypatch.setattr(spark_local2.sparkContext, "pythonExec", sys.executable)  # Spark's own would do
    monkeypatch.setenv("PYSPARK_PYTHON", bare_python)
    monkeypatch.setattr(spark_python, "_chosen", {})
    with pytest.raises(spark_python.InterpreterMismatch) as info:
        spark_dist(2).submit(interpreter)
    assert f"with the interpreter you chose ({bare_python})" in str(info.value)
    assert f"executors:     {bare_python} on " in str(info.value)


@pytest.mark.spark
def test_classic_spark_whose_executors_cannot_reach_the_notebook_still_returns_rank_0s_value(spark_local2, monkeypatch):
    """No task reaches the notebook (a firewall between the executors and the driver): the
    tasks meet through Spark's barrier, and rank 0's value comes back through the stage."""
    import torchdist_magic.backends.channels as channels
    from torchdist_magic.wire.server import ChannelServer

    class BehindAFirewall(ChannelServer):
        """The run's channel, whose address as the tasks are told it is where nothing listens."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.address = ("127.0.0.1", 9)

    monkeypatch.setattr(channels, "ChannelServer", BehindAFirewall)
    run = spark_dist(2).submit(placement_and_all_reduce)
    value = run.result(timeout=180)
    assert value["env"]["RANK"] == "0" and value["sum"] == 3.0  # both ranks joined one process group
    assert [(rs.state, rs.exit_code) for rs in run.state.ranks] == [("done", 0), ("done", 0)]
    for r in (0, 1):  # the view says why there was nothing live, in one line
        assert run.logs(r).startswith(
            "[torchdist] no live view of this rank: its task could not reach "
            "this notebook's event channel at 127.0.0.1:9"
        )
    assert_nothing_left(run)


def mib_for_rank_0(mib):
    return bytes(mib * 2**20) if rank() == 0 else None


@pytest.mark.spark
def test_a_value_over_the_drivers_result_limit_from_a_task_off_the_channel_says_spark_could_not_return_it(
    spark_local2_small_results, monkeypatch
):
    import torchdist_magic.backends.channels as channels
    import torchdist_magic.launch.remote as remote
    from torchdist_magic.wire.frames import new_secret
    from torchdist_magic.wire.server import ChannelServer

    # as above, and the channel refuses the tasks' launchers (another launcher secret than the
    # one they are given): they meet through Spark's barrier, and the value goes through Spark
    monkeypatch.setattr(remote, "value_dir_mark", lambda run_id: "not-what-the-tasks-look-for")
    monkeypatch.setattr(
        channels,
        "ChannelServer",
        lambda *args, **kwargs: ChannelServer(*args, **{**kwargs, "launcher_secret": new_secret()}),
    )
    run = spark_dist(2).submit(mib_for_rank_0, 2)
    with pytest.raises(RankFailure) as info:  # the driver heard of the ranks through Spark alone
        run.result(timeout=180)
    assert info.value.exc_type == "SparkException"
    assert "is bigger than spark.driver.maxResultSize" in info.value.message
    assert_nothing_left(run)


@pytest.mark.spark
def test_a_value_over_the_drivers_result_limit_comes_back_over_the_channel(spark_local2_small_results, monkeypatch):
    import torchdist_magic.launch.remote as remote

    # the tasks do not find the driver's value directory (as on a cluster): each sends its
    # rank's value over the run's channel, not through Spark, whose driver here takes at most
    # 1 MiB of task results (spark.driver.maxResultSize)
    monkeypatch.setattr(remote, "value_dir_mark", lambda run_id: "not-what-the-tasks-look-for")
    run = spark_dist(2).submit(mib_for_rank_0, 2)
    assert run.result(timeout=180) == bytes(2 * 2**20)
    assert "MiB sent to the driver in" in run.logs(0)
    assert_nothing_left(run)


def long_lines_then_mib(mib):
    for i in range(30):  # more than the tasks' LOG_TAIL lines, each of 64 KiB
        print(f"{i:02d}" + "x" * 65536)
    return bytes(mib * 2**20) if rank() == 0 else None


@pytest.mark.spark
def test_ranks_that_print_long_lines_return_their_value_under_a_small_result_limit(spark_local2_small_results):
    # the channel carried every line: the tasks' results (2 x 20 lines of 64 KiB, before, over
    # the 1 MiB of spark.driver.maxResultSize) do not repeat them, and the stage does not fail
    run = spark_dist(2).submit(long_lines_then_mib, 2)
    assert run.result(timeout=180) == bytes(2 * 2**20)
    assert run.logs(1).count("x" * 65536) == 30
    assert_nothing_left(run)


def failing_after(task, remove_value):
    """The barrier task ``task``, then, once every rank has finished, a failure of rank 0's task
    (as when its executor is lost then), having first removed rank 0's value file from the
    driver's directory if ``remove_value``."""

    def run(partition):
        from pyspark import BarrierTaskContext

        outcomes = task(partition)
        BarrierTaskContext.get().barrier()  # every rank has finished, its Exit sent
        for outcome in outcomes:
            if outcome.rank == 0:
                if remove_value:
                    os.remove(outcome.value_file)
                raise OSError(f"the executor of rank {outcome.rank} went away after its rank finished")
        return outcomes

    return run


@pytest.mark.spark
@pytest.mark.parametrize("remove_value", [False, True], ids=["value-there", "value-gone"])
def test_a_stage_that_fails_after_its_ranks_finished(spark_local2, monkeypatch, remove_value):
    original = SparkRun._barrier_rdd

    def barrier_rdd(self):
        self._task = failing_after(self._task, remove_value)
        return original(self)

    monkeypatch.setattr(SparkRun, "_barrier_rdd", barrier_rdd)
    run = spark_dist(2).submit(mib_for_rank_0, 1)
    if not remove_value:  # the value its rank wrote into the driver's directory is whole there
        assert run.result(timeout=180) == bytes(2**20)
    else:
        with pytest.raises(RuntimeError) as info:
            run.result(timeout=180)
        assert str(info.value).startswith("rank 0 finished, but Spark could not return its value: ")
        assert "the executor of rank " in str(info.value)
    assert run.state.snapshot().ranks[0].exit_code == 0
    assert_nothing_left(run)


@pytest.mark.spark
@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_a_process_a_rank_started_in_a_session_of_its_own_ends_with_the_spark_run(spark_local2, tmp_path, fail):
    from helpers import alive
    from test_launcher import _daemon_pids, _end, start_daemon_then

    pid_dir = tmp_path / "daemons"
    pid_dir.mkdir()
    run = spark_dist(2).submit(start_daemon_then, str(pid_dir), fail)
    try:
        if fail:
            with pytest.raises(RankFailure, match="after starting a daemon"):
                run.result(timeout=120)
        else:
            assert run.result(timeout=120) == 0
        daemons = _daemon_pids(str(pid_dir))
        assert len(daemons) == 2
        wait_until(lambda: not any(alive(pid) for pid in daemons), 30, "the ranks' daemons to end")
        assert_nothing_left(run)
    finally:
        run.cancel()
        run.wait(60)
        _end(_daemon_pids(str(pid_dir)))


def lightning_as_torchdistributor_documents_it(num_processes, root):
    """TorchDistributor's docstring pattern: ``devices=1, num_nodes=num_processes`` (on CPU here)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=num_processes,
        strategy="ddp",
        max_epochs=1,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), data)
    return trainer.global_rank, trainer.node_rank, trainer.local_rank, trainer.world_size


@pytest.mark.spark
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning (the notebooks extra)")
def test_torchdistributors_lightning_pattern_runs_unchanged(spark_local2, tmp_path):
    """Both ranks on one host: with torchrun's placement rank 1 would be LOCAL_RANK 1 of a
    ``devices=1`` node, and Lightning fails (``parallel_devices[local_rank]``)."""
    run = spark_dist(2, all_ranks=True).submit(lightning_as_torchdistributor_documents_it, 2, str(tmp_path))
    assert run.result(timeout=300) == [(0, 0, 0, 2), (1, 1, 0, 2)]
    assert_nothing_left(run)


def gpu_environment():
    return {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "NODE_RANK", "TORCHDIST_HOST_RANKS")}


@pytest.mark.spark
def test_ranks_on_torchdistributors_gpu_fixture_each_see_their_own_gpu_once(spark_fake_gpus):
    """Two executors on one machine, each given GPU "0" by its own worker: each rank sees "0"
    (what TorchDistributor's test expects), never "0,0"."""
    run = spark_dist(2, all_ranks=True, use_gpu=True).submit(gpu_environment)
    assert run.result(timeout=180) == [
        {"CUDA_VISIBLE_DEVICES": "0", "LOCAL_RANK": "0", "NODE_RANK": str(r), "TORCHDIST_HOST_RANKS": "0,1"}
        for r in range(2)
    ]
    assert_nothing_left(run)


@pytest.mark.spark
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning (the notebooks extra)")
def test_torchdistributors_lightning_pattern_on_its_gpu_fixture(spark_fake_gpus, tmp_path):
    """The same pattern on the fake-GPU cluster (on CPU: the GPUs are only addresses)."""
    run = spark_dist(2, all_ranks=True).submit(lightning_as_torchdistributor_documents_it, 2, str(tmp_path))
    assert run.result(timeout=300) == [(0, 0, 0, 2), (1, 1, 0, 2)]
    assert_nothing_left(run)
