"""Backend contract: every backend passes these (return value, failure, cancel, timeout,
no leftover processes, event delivery).  The ``dist`` fixture is parametrized by backend."""

import os
import signal
import sys
import time

import pytest

from helpers import assert_no_survivors, wait_until
from torchdist_magic import JobTimeout, RankFailure, RunCancelled, progress, rank, report


def rank_value_after_delay(slow_rank):
    if rank() == slow_rank:
        time.sleep(0.5)
    return {"rank": rank(), "pid": os.getpid()}


def raise_on(bad_rank):
    if rank() == bad_rank:
        raise ValueError(f"bad batch on rank {rank()}")
    time.sleep(600)


def exit_on(bad_rank, how, code=3):
    if rank() == bad_rank:
        if how == "sys.exit":
            sys.exit(code)
        if how == "os._exit":
            os._exit(code)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segfault":
            import ctypes

            ctypes.string_at(0)
    time.sleep(600)


def sleep_forever():
    print("sleeping", flush=True)
    time.sleep(600)


def report_steps(n):
    for i in progress(range(n), desc="step"):
        report(loss=1.0 / (i + 1))
    print("reported", flush=True)
    return rank()


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_rank0_value_always(dist, slow_rank):
    d = dist(2)
    run = d.submit(rank_value_after_delay, slow_rank)
    assert run.result(timeout=120)["rank"] == 0
    assert_no_survivors(run)


def test_all_ranks_values_by_rank(dist):
    run = dist(2, all_ranks=True).submit(rank_value_after_delay, 0)
    values = run.result(timeout=120)
    assert [v["rank"] for v in values] == [0, 1]
    assert_no_survivors(run)


def test_raise_is_rank_failure_with_root_cause(dist):
    run = dist(2).submit(raise_on, 1)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.rank == 1
    assert err.exc_type == "ValueError"
    assert err.message == "bad batch on rank 1"
    assert "raise_on" in err.traceback and 'raise ValueError(f"bad batch' in err.traceback
    assert run.state.ranks[0].state == "cancelled"
    assert_no_survivors(run)


@pytest.mark.parametrize("how,expected_code", [
    ("sys.exit", 3), ("os._exit", 3), ("sigkill", -signal.SIGKILL), ("segfault", -signal.SIGSEGV)])
def test_any_exit_fails_the_run(dist, how, expected_code):
    run = dist(2).submit(exit_on, 1, how)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    assert info.value.rank == 1
    assert info.value.exit_code == expected_code
    if how == "segfault":
        assert "SIGSEGV" in str(info.value)
        assert "Segmentation fault" in run.logs(1)
    assert_no_survivors(run)


def test_timeout_raises_builtin_timeout_error(dist):
    run = dist(2, timeout=3).submit(sleep_forever)
    with pytest.raises(TimeoutError) as info:
        run.result(timeout=120)
    assert isinstance(info.value, JobTimeout)
    assert "timed out after 3 s" in str(info.value)
    assert info.value._render_traceback_()[0].startswith("JobTimeout: distributed run timed out after 3 s")
    assert run.state.state == "timed out"
    assert_no_survivors(run)


def test_cancel_stops_every_rank(dist):
    run = dist(2).submit(sleep_forever)
    wait_until(lambda: "sleeping" in run.logs(1), 60, "rank 1 to be sleeping")
    run.cancel()
    with pytest.raises(RunCancelled) as info:
        run.result(timeout=60)
    assert info.value._render_traceback_() == ["RunCancelled: the run was cancelled; every rank was stopped"]
    assert run.done()
    assert {rs.state for rs in run.state.ranks} == {"cancelled"}
    assert_no_survivors(run)


def test_events_arrive(dist):
    run = dist(2).submit(report_steps, 5)
    assert run.result(timeout=120) == 0
    for rs in run.state.ranks:
        bar = rs.current_progress()
        assert (bar["n"], bar["total"], bar["desc"], bar["state"]) == (5, 5, "step", "done")
        assert [s for s, _ in rs.history["loss"]] == [1, 2, 3, 4, 5]
        assert rs.metrics["loss"] == pytest.approx(0.2)
        assert rs.host
    assert "reported" in run.logs(1)
    assert_no_survivors(run)
