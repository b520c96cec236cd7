"""Spark Connect backend beyond the contract suite: chosen for a Connect session, big values in
chunks, too many ranks refused before starting, and runs whose executors cannot reach the
notebook (a laptop on Databricks Connect): the value, a failure with the rank's own traceback
and output, and a cancel all come through the stage itself."""

import dataclasses
import os
import time
import weakref

import pytest

from helpers import assert_nothing_left, one, touch, wait_until
from torchdist_magic import Distributor, RankFailure, RunCancelled, rank
from torchdist_magic.backends.spark_connect import SparkConnectBackend

pytestmark = pytest.mark.spark


def mib_of_bytes(mib):
    return bytes(range(256)) * (mib * 4096) + bytes([rank()])


def test_a_connect_session_runs_on_the_connect_backend(spark_connect):
    run = Distributor(2, local_mode=None, show=None).submit(one)
    assert run.result(timeout=120) == 1
    assert run.state.backend == "Spark Connect barrier stage on local[2]"
    assert_nothing_left(run)


def test_a_50_mib_value_comes_back_in_chunks(spark_connect):
    run = Distributor(2, local_mode=False, show=None).submit(mib_of_bytes, 50)
    value = run.result(timeout=180)
    assert len(value) == 50 * 2**20 + 1 and value[-1] == 0 and value[:256] == bytes(range(256))
    assert_nothing_left(run)


def test_more_ranks_than_slots_is_refused_in_seconds(spark_connect):
    from torchdist_magic.driver.distributor import last_run

    before = last_run()
    with pytest.raises(
        ValueError,
        match="3 ranks need 3 Spark task slots at once .* the Spark Connect "
        "server's cluster has 2; use 2 or fewer ranks",
    ):
        Distributor(3, local_mode=False, show=None).submit(one)
    assert last_run() is before  # refused before any run started


class Unreachable(SparkConnectBackend):
    """Every task gets an address where no driver listens (executors behind a firewall)."""

    def start(self, ctx):
        ctx.spec = dataclasses.replace(ctx.spec, channel_address="127.0.0.1:9")
        return super().start(ctx)


@pytest.fixture
def unreachable(spark_connect, monkeypatch):
    import torchdist_magic.driver.distributor as distributor

    monkeypatch.setattr(distributor, "make_backend", lambda options: Unreachable(spark_connect))
    return lambda n=2, **o: Distributor(n, local_mode=False, show=None, **o)


def fail_on_rank_1():
    print(f"rank {rank()} working", flush=True)
    if rank() == 1:
        raise ValueError("bad shard on rank 1")
    time.sleep(600)  # rank 0 is stopped with the stage, not waited for


def sleep_after_saying_so(marks):
    print("up", flush=True)  # (comes back only with the stage: the channel is out of reach)
    touch(os.path.join(marks, f"up-{rank()}"))
    time.sleep(600)


def test_without_the_channel_the_value_still_comes_back(unreachable):
    run = unreachable(2, all_ranks=True).submit(mib_of_bytes, 1)
    values = run.result(timeout=120)
    assert [v[-1] for v in values] == [0, 1]
    assert [rs.state for rs in run.state.ranks] == ["done", "done"]
    for r in (0, 1):  # the view says why there was nothing live, in one line
        assert run.logs(r).startswith(
            "[torchdist] no live view of this rank: its task could not reach "
            "this notebook's event channel at 127.0.0.1:9"
        )
    assert_nothing_left(run)


def test_without_the_channel_a_failure_is_the_ranks_own_and_prompt(unreachable):
    run = unreachable(2).submit(fail_on_rank_1)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)  # rank 0 sleeps for 600 s: only the stage's failure can end it
    err = info.value
    assert (err.rank, err.exc_type, err.message) == (1, "ValueError", "bad shard on rank 1")
    assert 'raise ValueError("bad shard on rank 1")' in err.traceback
    assert "rank 1 working" in err.failure.log_tail
    assert "rank 1 working" in run.logs(1)  # the output came back with the failure
    assert run.logs(1).startswith("[torchdist] no live view of this rank")
    assert_nothing_left(run)


def test_without_the_channel_cancel_interrupts_the_stage(unreachable, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    run = unreachable(2).submit(sleep_after_saying_so, str(marks))
    try:
        wait_until(lambda: sorted(os.listdir(marks)) == ["up-0", "up-1"], 120, "both ranks to be up")
    finally:
        run.cancel()
    with pytest.raises(RunCancelled):
        run.result(timeout=120)
    assert_nothing_left(run)


def test_executors_with_other_versions_are_refused_before_training(spark_connect, monkeypatch):
    from torchdist_magic.backends import spark_python

    real = spark_python.local_facts()
    claimed = dict(real, packages=dict(real["packages"], cloudpickle="0.0.1"))
    monkeypatch.setattr(spark_python, "local_facts", lambda: claimed)
    monkeypatch.setattr(spark_python, "_checked_connect", weakref.WeakSet())
    with pytest.raises(spark_python.InterpreterMismatch) as info:
        Distributor(2, local_mode=False, show=None).submit(one)
    text = str(info.value)
    assert "the Spark Connect server's executors cannot run the ranks" in text
    assert f"cloudpickle 0.0.1 here, {real['packages']['cloudpickle']} there" in text


def test_gpu_without_task_gpus_on_the_connect_server_is_refused_before_start(spark_connect):
    from torchdist_magic import last_run

    before = last_run()
    with pytest.raises(
        ValueError,
        match=r"^use_gpu/--gpu needs GPUs assigned to Spark tasks, but "
        r"spark\.task\.resource\.gpu\.amount is not set on the Spark "
        r"Connect server's cluster$",
    ):
        Distributor(2, local_mode=False, use_gpu=True, show=None).submit(one)
    assert last_run() is before  # nothing started


def test_executors_that_cannot_run_the_python_check_say_so_before_training(spark_connect):
    from torchdist_magic import last_run

    # this session's Python UDFs run an interpreter the executors do not have
    spark_connect.conf.set("spark.sql.execution.pyspark.python", "/nonexistent/python3")
    before = last_run()
    with pytest.raises(ValueError) as info:
        Distributor(2, local_mode=False, show=None).submit(one)
    text = str(info.value)
    assert text.startswith("the Spark Connect server's executors could not run a Python check: "), text
    assert "/nonexistent/python3" in text
    assert last_run() is before  # nothing started
