"""Backend contract: every backend passes these (return value, failure, cancel, timeout,
no leftover processes, event delivery; restarts from checkpoints, the hang watchdog's stacks,
graceful stops).  The ``dist`` fixture is parametrized by backend."""

import inspect
import os
import re
import signal
import sys
import threading
import time

import pytest

from helpers import assert_no_survivors, rank_failure_of, touch, wait_until
from torchdist_magic import (
    HangTimeout,
    JobTimeout,
    RankFailure,
    RunCancelled,
    load_checkpoint,
    progress,
    rank,
    report,
    restart_count,
    save_checkpoint,
)


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
    err = rank_failure_of(run)  # rank 0 sleeps: it is stopped
    assert isinstance(err, RuntimeError)
    assert err.rank == 1
    assert err.exc_type == "ValueError"
    assert err.message == "bad batch on rank 1"
    assert "raise_on" in err.traceback and 'raise ValueError(f"bad batch' in err.traceback
    assert f'File "{__file__}", line ' in err.traceback  # the test file's own name, as sent by value
    assert run.state.ranks[0].state == "cancelled"
    assert_no_survivors(run)


def test_a_helper_modules_function_fails_with_its_file_and_line(dist, tmp_path, monkeypatch):
    """A module next to the notebook (not installed) travels by value: its frames name its file
    and show its lines, which the ranks read from the job where they cannot read the file."""
    helper = tmp_path / "contract_helper.py"
    helper.write_text(
        "import os, time\n"
        "def bad_shard(go):\n"
        "    while not os.path.exists(go):\n"
        "        time.sleep(0.05)\n"
        "    raise KeyError('shard ' + str(go))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import contract_helper

    go = tmp_path / "go"
    try:
        run = dist(2).submit(contract_helper.bad_shard, str(go))
        helper.unlink()  # as on an executor, where the file is not
        go.touch()
        err = rank_failure_of(run)
    finally:
        sys.modules.pop("contract_helper", None)
    assert err.exc_type == "KeyError"
    assert f'File "{helper}", line 5, in bad_shard' in err.traceback
    assert "raise KeyError('shard ' + str(go))" in err.traceback
    assert_no_survivors(run)


@pytest.mark.parametrize(
    "how,expected_code", [("sys.exit", 3), ("os._exit", 3), ("sigkill", -signal.SIGKILL), ("segfault", -signal.SIGSEGV)]
)
def test_any_exit_fails_the_run(dist, how, expected_code):
    run = dist(2).submit(exit_on, 1, how)
    err = rank_failure_of(run)
    assert err.rank == 1
    assert err.exit_code == expected_code
    if how == "segfault":
        assert "SIGSEGV" in str(err)
        assert "Segmentation fault" in run.logs(1)
    assert_no_survivors(run)


def test_timeout_raises_builtin_timeout_error(dist, run_clock):
    # the limit passes once both ranks sleep, however long their start took (Spark's tasks too)
    run = dist(2, timeout=600).submit(sleep_forever)
    wait_until(lambda: all("sleeping" in run.logs(r) for r in (0, 1)), 120, "both ranks to sleep")
    run_clock.expire()
    with pytest.raises(TimeoutError) as info:
        run.result(timeout=120)
    assert isinstance(info.value, JobTimeout)
    assert "timed out after 600 s" in str(info.value)
    assert info.value._render_traceback_()[0].startswith("JobTimeout: distributed run timed out after 600 s")
    assert run.state.state == "timed out"
    # where each rank was, as after a hang
    assert set(info.value.stacks) == {0, 1} and set(run.stacks) == {0, 1}
    for r in (0, 1):
        assert f"  rank {r}: sleep_forever ({__file__}, line " in str(info.value), str(info.value)
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


# -- restarts, hangs, graceful stops ---------------------------------------------------------------
def count_to(steps, kill_at):
    """Add 1 per rank and step (an all_reduce), checkpointing every step; rank 1 dies at step
    ``kill_at`` of the first attempt."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    state = load_checkpoint() or {"step": 0, "total": 0}
    resumed_at = state["step"]
    for step in range(resumed_at, steps):
        t = torch.ones(1)
        dist.all_reduce(t)
        state = {"step": step + 1, "total": state["total"] + int(t.item())}
        save_checkpoint(state, step=step + 1)
        if step + 1 == kill_at and rank() == 1 and restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()
    return dict(state, resumed_at=resumed_at, attempt=restart_count())


def test_killed_rank_restarts_from_its_checkpoint(dist, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    run = dist(2, max_restarts=1, checkpoint_dir=str(checkpoints)).submit(count_to, 40, 20)
    value = run.result(timeout=240)
    # resumed where rank 0's last save was: step 20, or 19 when stopping it cut that save short
    assert value["attempt"] == 1 and value["resumed_at"] in (19, 20)
    assert (value["step"], value["total"]) == (40, 80)  # every step counted once, by both ranks
    assert run.state.state == "succeeded" and run.attempt == 2
    (first,) = run.attempts
    assert (first.number, first.failure.rank, first.failure.exit_code) == (1, 1, -signal.SIGKILL)
    assert sorted(os.listdir(checkpoints)) == [f"checkpoint-{s:09d}.pt" for s in (38, 39, 40)]  # the newest 3
    assert_no_survivors(run)


def test_killed_rank_without_restarts_is_the_failure(dist, tmp_path):
    run = dist(2, checkpoint_dir=str(tmp_path / "checkpoints")).submit(count_to, 40, 20)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    assert (info.value.rank, info.value.exit_code) == (1, -signal.SIGKILL)
    assert info.value.earlier == [] and run.attempts == [] and run.attempt == 1
    assert_no_survivors(run)


def stuck_in_sleep():
    time.sleep(600)


STUCK_LINE = inspect.getsourcelines(stuck_in_sleep)[1] + 1


def _say_until(done, text):
    while not done.wait(0.5):
        print(text, flush=True)


def hang_in_all_reduce():
    """Rank 1 sleeps in ``stuck_in_sleep`` while rank 0 waits for it in ``all_reduce``.  While
    they set up (torch's import takes a while), they keep printing: the watchdog must only see
    the hang."""
    done = threading.Event()
    threading.Thread(target=_say_until, args=(done, "setting up"), daemon=True).start()
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    done.set()
    print("ready", flush=True)
    if rank() == 1:
        stuck_in_sleep()
    dist.all_reduce(torch.zeros(1))


def test_hang_shows_where_each_rank_waits(dist, run_clock):
    # quiet from when rank 0 waits in all_reduce for rank 1, however long the start took
    run = dist(2, hang_timeout=600).submit(hang_in_all_reduce)
    wait_until(
        lambda: all("ready" in run.logs(r) for r in (0, 1)) and run.culprit().suspects == (1,),
        180,
        "rank 0 to wait in all_reduce for rank 1",
        interval=0.5,
    )
    run_clock.expire()
    with pytest.raises(TimeoutError) as info:
        run.result(timeout=240)
    err = info.value
    assert isinstance(err, HangTimeout)
    text = str(err)
    # the ranks' collective records name the rank behind before anything else (``culprit``)
    assert text.startswith(
        "Rank 1 is behind: its last collective was #1 barrier; rank 0 waits in #2 all_reduce "
        "(default group). No rank sent progress, metrics or output for 600 s (hang_timeout); "
        "every rank was stopped"
    ), text
    assert err.suspects == (1,)
    assert re.search(r"rank 0: all_reduce \(torch/distributed/distributed_c10d\.py, line \d+\)", text), text
    assert f"rank 1: stuck_in_sleep ({__file__}, line {STUCK_LINE})" in text, text
    assert "hang_in_all_reduce" in err.stacks[0].where()  # the user's own frame, under the library's
    rendered = "\n".join(err._render_traceback_())
    assert "--- rank 1, main thread (most recent call last) ---" in rendered and "worker.py" not in rendered
    assert run.state.state == "hung" and set(run.stacks) == {0, 1}
    assert_no_survivors(run)


def loop_until_stopped(marks):
    import atexit

    atexit.register(touch, os.path.join(marks, f"atexit-{rank()}"))
    try:
        print("looping", flush=True)
        while True:
            time.sleep(0.05)
    finally:
        touch(os.path.join(marks, f"finally-{rank()}"))


def test_cancel_runs_every_ranks_finally_and_atexit(dist, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    run = dist(2).submit(loop_until_stopped, str(marks))
    try:
        wait_until(lambda: all("looping" in run.logs(r) for r in range(2)), 120, "both ranks to loop")
    finally:
        run.cancel()
    with pytest.raises(RunCancelled):
        run.result(timeout=60)
    assert sorted(os.listdir(marks)) == ["atexit-0", "atexit-1", "finally-0", "finally-1"]
    assert {rs.state for rs in run.state.ranks} == {"cancelled"}
    assert_no_survivors(run)
