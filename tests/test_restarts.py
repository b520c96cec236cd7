"""Restarts that learn (issue 47): a failure that repeats the previous attempt's ends the run with
its restarts unspent; ``--restart-on`` says which failures restart; ``--on-hang`` says what a hang
does (fail, observe, restart); a job that never steps nor reports has its start-up in its goodput.
The decision's rules on given attempts first, then real runs on local processes and on Spark."""

import gc
import os
import sys
import time

import pytest

from helpers import assert_no_survivors, wait_until
from torchdist_magic import HangTimeout, LaunchOptions, RankFailure, RunCancelled, rank, restart_count
from torchdist_magic.core.failure import Failure
from torchdist_magic.core.flags import FlagError, options_from_flags, parse_flags
from torchdist_magic.core.options import OptionError
from torchdist_magic.driver.restarts import Ending, RestartDecision, repeats, user_frame


def _forget_runs():
    import torchdist_magic.driver.distributor as distributor

    distributor._last_run = None
    gc.collect()


TRACEBACK = """Traceback (most recent call last):
  File "<torchdist cell In[3]>", line 7, in <module>
    step(batch)
  File "/home/me/model.py", line 12, in step
    check(x)
  File "/usr/lib/python3.11/site-packages/torch/nn/functional.py", line 99, in check
    raise ValueError("bad shape")
ValueError: bad shape
"""


def failure(exc_type="ValueError", traceback=TRACEBACK, rank=2, **more):
    return Failure(rank=rank, exc_type=exc_type, message="bad shape", traceback=traceback, **more)


# -- the rules, on given attempts -------------------------------------------------------------------


def test_the_place_of_a_failure_is_the_innermost_frame_of_the_users_own_code():
    assert user_frame(TRACEBACK) == ("/home/me/model.py", 12)  # not torch's frame below it
    ours = TRACEBACK.replace("/home/me/model.py", "/work/src/torchdist_magic/rank/runtime.py")
    assert user_frame(ours) == ("<torchdist cell In[3]>", 7)  # this package's frames are not the user's
    assert user_frame("") is None


def test_the_same_type_at_the_same_line_without_progress_repeats():
    first = Ending.of(1, failure(), step=312, checkpoint=None)
    assert repeats(first, Ending.of(2, failure(rank=0), step=312, checkpoint=None))
    # from scratch each time (no checkpoint): another step is another failure
    assert not repeats(first, Ending.of(2, failure(), step=500, checkpoint=None))
    # another type, another line: another failure
    assert not repeats(first, Ending.of(2, failure("KeyError"), step=312, checkpoint=None))
    moved = TRACEBACK.replace("line 12", "line 13")
    assert not repeats(first, Ending.of(2, failure(traceback=moved), step=312, checkpoint=None))


def test_after_a_checkpoint_the_step_is_counted_from_the_resume_and_only_a_newer_checkpoint_is_progress():
    saved = Ending.of(1, failure(), step=312, checkpoint=300)
    # attempt 2 resumed at step 300 and its bar counts from there: no checkpoint since, a repeat
    assert repeats(saved, Ending.of(2, failure(), step=12, checkpoint=None), saved_before=300)
    # it saved step 300 again as it resumed: no further than before, a repeat
    assert repeats(saved, Ending.of(2, failure(), step=12, checkpoint=300), saved_before=300)
    # it saved a later step before it failed: it got further, worth another try
    assert not repeats(saved, Ending.of(2, failure(), step=112, checkpoint=400), saved_before=300)
    # attempt 1 kept none, attempt 2 did: further too
    assert not repeats(Ending.of(1, failure(), 5, None), Ending.of(2, failure(), 5, checkpoint=0), saved_before=None)


def test_a_rank_killed_by_a_signal_is_never_taken_for_a_repeat():
    killed = Failure(rank=1, exit_code=-9)
    first = Ending.of(1, killed, step=None, checkpoint=None)
    assert not repeats(first, Ending.of(2, killed, step=None, checkpoint=None))


def test_the_decision_says_who_repeated_what_where_and_how_many_restarts_were_left():
    decision = RestartDecision("any")
    assert decision.decide(Ending.of(1, failure(), 5, None), 3) is None
    assert decision.decide(Ending.of(2, failure(), 5, None), 2) == (
        "rank 2 raised the same ValueError at the same line (model.py, line 12) in attempts 1 and 2: "
        "not restarting; 2 restarts left"
    )
    other_rank = RestartDecision("any")
    other_rank.decide(Ending.of(1, failure(rank=0), 5, None), 1)
    assert other_rank.decide(Ending.of(2, failure(rank=3), 5, None), 1).startswith(
        "ranks 0 and 3 raised the same ValueError at the same line (model.py, line 12) in attempts 1 and 2: "
        "not restarting; 1 restart left"
    )
    always = RestartDecision("always")
    assert always.decide(Ending.of(1, failure(), 5, None), 3) is None
    assert always.decide(Ending.of(2, failure(), 5, None), 2) is None


def test_a_list_of_names_restarts_those_types_and_killed_ranks_only():
    decision = RestartDecision("torch.distributed.DistBackendError,killed")
    assert decision.decide(Ending.of(1, failure("DistBackendError"), None, None), 3) is None
    assert decision.decide(Ending.of(2, Failure(rank=1, exit_code=-9), None, None), 2) is None
    assert decision.decide(Ending.of(3, failure("KeyError"), None, None), 1) == (
        "rank 2 raised KeyError, which --restart-on (torch.distributed.DistBackendError,killed) does not "
        "name: not restarting; 1 restart left"
    )
    assert RestartDecision("ValueError").decide(Ending.of(1, Failure(rank=0, exit_code=3), None, None), 1) == (
        "rank 0 exited with code 3, which --restart-on (ValueError) does not name: not restarting; 1 restart left"
    )


def test_a_policy_function_decides_and_its_mistakes_end_the_run_with_their_reason():
    def only_oom(failure):
        return failure.exc_type == "OutOfMemoryError"

    decision = RestartDecision(only_oom)
    assert decision.decide(Ending.of(1, failure("OutOfMemoryError"), None, None), 2) is None
    assert decision.decide(Ending.of(2, failure(), None, None), 1) == (
        "the restart_on policy only_oom returned False for rank 2 raised ValueError: not restarting; 1 restart left"
    )

    def broken(failure):
        return failure.no_such_field

    assert RestartDecision(broken).decide(Ending.of(1, failure(), None, None), 2) == (
        "the restart_on policy broken raised AttributeError: 'Failure' object has no attribute 'no_such_field' "
        "(asked about rank 2 raised ValueError): not restarting; 2 restarts left"
    )
    says_yes = RestartDecision(lambda failure: "yes").decide(Ending.of(1, failure(), None, None), 2)
    assert says_yes == (
        "the restart_on policy <lambda> returned 'yes', not True or False (asked about rank 2 raised "
        "ValueError): not restarting; 2 restarts left"
    )


# -- the options and their refusals -----------------------------------------------------------------


def test_restart_on_takes_words_names_lists_and_functions():
    assert LaunchOptions().restart_on == "any" and LaunchOptions().on_hang == "fail"
    assert LaunchOptions(restart_on=" always ").restart_on == "always"
    assert LaunchOptions(restart_on=["RuntimeError", "killed"]).restart_on == "RuntimeError,killed"
    assert LaunchOptions(restart_on="RuntimeError, RuntimeError,killed").restart_on == "RuntimeError,killed"

    def policy(failure):
        return True

    assert LaunchOptions(restart_on=policy).restart_on is policy
    flags = options_from_flags(parse_flags("--max-restarts 2 --restart-on ValueError,killed"), LaunchOptions())
    assert (flags.max_restarts, flags.restart_on) == (2, "ValueError,killed")


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"restart_on": 3},
            "restart_on must be 'any', 'always', exception type names ('RuntimeError,killed') or a function "
            "of the failure that returns True to restart, got 3",
        ),
        (
            {"restart_on": "any,ValueError"},
            "restart_on 'any,ValueError': 'any' and 'always' stand alone; to restart on some failures only, "
            "name their exception types",
        ),
        (
            {"restart_on": "Value Error"},
            "restart_on: 'Value Error' is not an exception type name; give 'any', 'always' or names separated "
            "by commas (RuntimeError,DistBackendError,killed)",
        ),
        (
            {"restart_on": "ValueError,"},
            "restart_on: 'ValueError,' is not an exception type name; give 'any', 'always' or names separated "
            "by commas (RuntimeError,DistBackendError,killed)",
        ),
        ({"on_hang": "watch", "hang_timeout": 5}, "on_hang must be one of 'fail', 'observe', 'restart', got 'watch'"),
        (
            {"on_hang": "observe"},
            "on_hang observe says what a hang does, and this run has no hang timeout: give it one "
            "(--hang-timeout SECONDS, hang_timeout=)",
        ),
        (
            {"on_hang": "restart", "hang_timeout": 5},
            "on_hang restart starts the job again after a hang, within --max-restarts, which is 0: give it "
            "restarts (--max-restarts N, max_restarts=)",
        ),
        (
            {"on_hang": "restart", "hang_timeout": 5, "max_restarts": 1, "restart_on": "ValueError"},
            "on_hang restart starts the job again after a hang, and --restart-on 'ValueError' does not name "
            "HangTimeout: add it, or use --on-hang fail",
        ),
        (
            {"restart_on": lambda failure: True, "detach": True},
            "restart_on as a function decides in this kernel, and a run under a process of its own (--detach, "
            "--channel process) cannot call it: name exception types instead ('RuntimeError,killed')",
        ),
    ],
)
def test_bad_restart_and_hang_settings_are_refused_with_what_to_give(options, message):
    with pytest.raises(OptionError) as info:
        LaunchOptions(**options)
    assert str(info.value) == message


def test_the_magic_names_its_flags_in_the_refusals():
    with pytest.raises(FlagError, match=r"^--on-hang observe says what a hang does, and this run has no hang"):
        options_from_flags(parse_flags("--on-hang observe"), LaunchOptions())
    with pytest.raises(FlagError, match=r"^--restart-on: 'Value Error' is not an exception type name"):
        options_from_flags(parse_flags("--restart-on 'Value Error'"), LaunchOptions())
    with pytest.raises(FlagError, match=r"--on-hang: invalid choice: 'watch'"):
        parse_flags("--on-hang watch")


# -- real runs: repeated and different failures -----------------------------------------------------


def same_error_on_rank_1():
    if rank() == 1:
        raise ValueError(f"bad batch in attempt {restart_count() + 1}")
    time.sleep(600)


def test_a_repeated_failure_stops_after_two_attempts_and_says_so(local_distributor):
    from torchdist_magic.view.text import summary

    run = local_distributor(2, max_restarts=3).submit(same_error_on_rank_1)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    err = info.value
    reason = (
        "rank 1 raised the same ValueError at the same line (test_restarts.py, line "
        f"{same_error_on_rank_1.__code__.co_firstlineno + 2}) in attempts 1 and 2: not restarting; 2 restarts left"
    )
    assert err.reason == reason and run.attempt == 2 and len(run.attempts) == 1
    assert str(err).splitlines()[:2] == [
        "RankFailure: " + err.failure.summary(),
        f"Not restarted: {reason}",
    ]
    assert [f.message for f in err.attempts] == ["bad batch in attempt 1", "bad batch in attempt 2"]
    assert reason in summary(run.state)  # the view's outcome says it too
    assert_no_survivors(run)
    del run, info, err
    _forget_runs()


def another_error_each_attempt():
    attempt = restart_count() + 1
    if rank() == 0:
        if attempt == 1:
            raise ValueError("first")
        if attempt == 2:
            raise KeyError("second")
        return attempt
    time.sleep(0.1 if attempt == 3 else 600)


def test_a_different_failure_is_restarted(local_distributor):
    run = local_distributor(2, max_restarts=3).submit(another_error_each_attempt)
    assert run.result(timeout=180) == 3
    assert [a.failure.exc_type for a in run.attempts] == ["ValueError", "KeyError"]
    assert_no_survivors(run)
    del run
    _forget_runs()


def steps_then_fails_at(fail_at):
    """Steps from the checkpoint on, saves one every 5 steps, raises at step ``fail_at[attempt]``
    (the same line each time)."""
    from torchdist_magic import load_checkpoint, progress, save_checkpoint

    start = (load_checkpoint() or {"step": 0})["step"]
    for step in progress(range(start, 100), desc="step"):
        if step == fail_at[restart_count()]:
            raise ValueError(f"step {step} went wrong")
        if step and step % 5 == 0:
            save_checkpoint({"step": step}, step=step)
    return start


def test_a_failure_after_a_newer_checkpoint_is_progress_and_one_before_it_repeats(local_distributor, tmp_path):
    # attempt 1 saves step 5, fails at 7; attempt 2 resumes at 5, saves 5 again and 10, fails at 12:
    # further than before, restarted; attempt 3 resumes at 10, saves 10 again, fails at 12: a repeat
    run = local_distributor(1, max_restarts=3, checkpoint_dir=str(tmp_path)).submit(steps_then_fails_at, [7, 12, 12])
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    assert info.value.reason.endswith("in attempts 2 and 3: not restarting; 1 restart left")
    assert run.attempt == 3 and [f.message for f in info.value.attempts] == [
        "step 7 went wrong",
        "step 12 went wrong",
        "step 12 went wrong",
    ]
    assert_no_survivors(run)
    del run, info
    _forget_runs()


def fails_at_its_own_line(kind):
    if rank() == 0:
        raise {"key": KeyError, "value": ValueError}[kind]("no")
    time.sleep(600)


def test_restart_on_names_end_a_run_on_any_other_failure(local_distributor):
    run = local_distributor(2, max_restarts=2, restart_on="KeyError,killed").submit(fails_at_its_own_line, "value")
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    assert info.value.reason == (
        "rank 0 raised ValueError, which --restart-on (KeyError,killed) does not name: not restarting; 2 restarts left"
    )
    assert run.attempt == 1
    assert_no_survivors(run)
    del run, info
    _forget_runs()


def test_a_policy_function_is_asked_about_the_root_cause(local_distributor):
    asked = []

    def retry_key_errors(failure):
        asked.append((failure.rank, failure.exc_type))
        return failure.exc_type == "KeyError"

    run = local_distributor(2, max_restarts=2, restart_on=retry_key_errors).submit(fails_at_its_own_line, "key")
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    # asked after attempt 1, restarted; attempt 2 repeated attempt 1's failure: not asked again
    assert asked == [(0, "KeyError")] and run.attempt == 2
    assert info.value.reason.startswith("rank 0 raised the same KeyError at the same line")
    assert_no_survivors(run)
    del run, info
    _forget_runs()


def test_on_spark_a_repeated_failure_stops_after_two_attempts(spark_local2):
    from torchdist_magic import Distributor

    run = Distributor(2, local_mode=False, show=None, max_restarts=3).submit(same_error_on_rank_1)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=300)
    assert info.value.reason.startswith("rank 1 raised the same ValueError at the same line (test_restarts.py")
    assert info.value.reason.endswith("in attempts 1 and 2: not restarting; 2 restarts left")
    assert run.attempt == 2
    assert_no_survivors(run)
    del run, info
    _forget_runs()


# -- real runs: hang modes -----------------------------------------------------------------------------


def rank_1_stuck(marks):
    """Rank 1 never reaches the all_reduce that rank 0 waits in."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    attempt = restart_count() + 1
    open(os.path.join(marks, f"rank{rank()}-attempt{attempt}"), "w").close()
    if attempt == 1 and rank() == 1:
        time.sleep(600)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return attempt


def test_on_hang_observe_keeps_a_hung_run_with_its_culprit_named_until_it_is_stopped(
    local_distributor, tmp_path, run_clock
):
    run = local_distributor(2, hang_timeout=60, on_hang="observe").submit(rank_1_stuck, str(tmp_path))
    try:
        wait_until(lambda: all((tmp_path / f"rank{r}-attempt1").exists() for r in (0, 1)), 120, "both ranks up")
        run_clock.expire()
        logs = run.logs
        wait_until(lambda: "--on-hang observe" in logs(1), 60, "the culprit's notice")
        log = run.logs(1)
        assert "[torchdist] --on-hang observe: rank 1 is behind" in log.lower()
        assert "the ranks keep running" in log and "run.cancel()" in log and "py-spy dump --pid" in log
        assert "rank_1_stuck (" in log  # where the culprit is, from its stack
        assert not run.done() and run.state.state == "running"
        assert sorted(run.stacks) == [0, 1] and run.last_verdict().suspects == (1,)
        pids = [rs.pid for rs in run.state.snapshot().ranks]
        assert all(pid and os.path.exists(f"/proc/{pid}") for pid in pids)  # nobody was stopped
        run.cancel()
        with pytest.raises(RunCancelled):
            run.result(timeout=120)
    finally:
        run.cancel()
        run.wait(60)
    assert run.state.state == "cancelled"
    assert_no_survivors(run)
    del run
    _forget_runs()


def quiet_once_up(monkeypatch, marks, attempts):
    """The ranks' quiet (``RunState.idle``) passes any hang timeout in each of ``attempts`` once
    every rank of it is in the job's code (its marks exist), however long they took to start."""
    from torchdist_magic.driver.console import Console
    from torchdist_magic.driver.state import RunState

    idle = RunState.idle

    def hung_when_up(state):
        up = state.attempt in attempts and all(
            (marks / f"rank{r}-attempt{state.attempt}").exists() for r in range(state.num_processes)
        )
        return idle(state) + (86400.0 if up else 0.0)

    monkeypatch.setattr(RunState, "idle", hung_when_up)
    monkeypatch.setattr(Console, "idle", lambda console: 86400.0)  # no debugger session: never in the way


def test_on_hang_restart_starts_the_job_again_as_after_a_failure(local_distributor, tmp_path, monkeypatch):
    quiet_once_up(monkeypatch, tmp_path, attempts=(1,))
    run = local_distributor(2, hang_timeout=60, on_hang="restart", max_restarts=2).submit(rank_1_stuck, str(tmp_path))
    try:
        assert run.result(timeout=180) == 2
    finally:
        run.cancel()
        run.wait(60)
    (first,) = run.attempts
    assert (first.failure.rank, first.failure.exc_type) == (1, "HangTimeout")
    assert "rank 1 is behind" in first.failure.message.lower()
    assert_no_survivors(run)
    del run
    _forget_runs()


def test_a_hang_that_repeats_under_on_hang_restart_ends_the_run(local_distributor, tmp_path, monkeypatch):
    quiet_once_up(monkeypatch, tmp_path, attempts=(1, 2, 3, 4))
    run = local_distributor(2, hang_timeout=60, on_hang="restart", max_restarts=3).submit(
        say_up_and_sleep, str(tmp_path)
    )
    try:
        with pytest.raises(HangTimeout) as info:
            run.result(timeout=180)
    finally:
        run.cancel()
        run.wait(60)
    assert run.attempt == 2 and run.state.state == "hung"
    assert "Not restarted: rank 0 hung at the same line (test_restarts.py, line" in info.value.headline
    assert "in attempts 1 and 2: not restarting; 2 restarts left" in info.value.headline
    assert_no_survivors(run)
    del run, info
    _forget_runs()


def say_up_and_sleep(marks):
    open(os.path.join(marks, f"rank{rank()}-attempt{restart_count() + 1}"), "w").close()
    time.sleep(600)


# -- goodput of a job that never steps nor reports --------------------------------------------------


def silent_job(marks):
    """Trains without progress() or report(); fails once after its start."""
    time.sleep(0.3)
    if restart_count() == 0 and rank() == 0:
        raise RuntimeError("lost")
    return restart_count()


def test_a_silent_job_has_its_start_up_measured_in_every_attempt(local_distributor, tmp_path):
    from torchdist_magic.driver.goodput import says_something
    from torchdist_magic.view.text import summary

    run = local_distributor(2, max_restarts=1).submit(silent_job, str(tmp_path))
    assert run.result(timeout=120) == 1
    (first,) = run.attempts
    assert first.first_work is not None and first.first_work > first.started  # its code's start
    parts = run.goodput
    assert parts["startup_s"] > 0 and says_something(parts)
    assert parts["startup_s"] == pytest.approx(first.first_work - run.state.started)
    assert "goodput: training" in summary(run.state)
    assert_no_survivors(run)
    del run
    _forget_runs()


def test_a_notebook_import_that_fails_on_the_ranks_is_not_retried(ip, tmp_path):
    """The import of an earlier cell, replayed on every rank, fails there the same way each time."""
    from helpers import cell

    (tmp_path / "only_here.py").write_text("VALUE = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        cell(ip, "import only_here")
        os.remove(tmp_path / "only_here.py")
        result = cell(
            ip,
            f"%%torchdist --np 2 --local --max-restarts 3 --checkpoint-dir {tmp_path / 'c'} --quiet\nonly_here.VALUE",
        )
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("only_here", None)
        ip.user_ns.pop("only_here", None)
    err = result.error_in_exec
    assert isinstance(err, RankFailure) and err.exc_type == "CellImportError"
    assert '  File "<import from In[' in err.traceback  # where it failed: the replayed import
    assert "raised the same CellImportError at the same line (<import from In[" in err.reason
    assert err.reason.endswith("in attempts 1 and 2: not restarting; 2 restarts left")
    assert_no_survivors(ip.user_ns["_torchdist_run"])
    ip.user_ns.pop("_torchdist_run")
    del result, err
    _forget_runs()
