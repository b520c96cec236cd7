"""LaunchOptions, runtime helpers outside a run, RunState bookkeeping, errors."""

import dataclasses

import pytest

from torchdist_magic import LaunchOptions, is_main, local_rank, progress, rank, report, world_size
from torchdist_magic.errors import FailureInfo, RankFailure
from torchdist_magic.options import option_fields
from torchdist_magic.state import MAX_POINTS, RunState


def test_defaults_and_no_environment_probe(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    opts = LaunchOptions()
    assert (opts.num_processes, opts.use_gpu, opts.backend, opts.timeout, opts.env) == (1, False, "auto", None, {})
    assert "torch" not in sys.modules


def test_every_field_documented_with_a_flag():
    names = {f.name for f in dataclasses.fields(LaunchOptions)}
    flagged = {f.name: f.metadata for f in option_fields()}
    assert set(flagged) == names
    assert all(m["help"] and m["flag"].startswith("--") for m in flagged.values())


def test_env_forms_normalise():
    assert LaunchOptions(env=["A=1", "B=x=y"]).env == {"A": "1", "B": "x=y"}
    assert LaunchOptions(env={"N": 3}).env == {"N": "3"}
    assert LaunchOptions(env="C=") .env == {"C": ""}


def test_helpers_outside_a_run(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert (rank(), world_size(), local_rank(), is_main()) == (0, 1, 0, True)
    assert list(progress(range(3), desc="x")) == [0, 1, 2]
    assert len(progress([1, 2])) == 2
    report(loss=0.5)  # no run: nothing to send, nothing raised
    with pytest.raises(TypeError, match=r"report\(loss=...\) needs a number, got str"):
        report(loss="high")
    with pytest.raises(TypeError, match="progress over an iterable of unknown length"):
        len(progress(iter([1])))


def test_device_outside_a_run_is_cpu():
    from torchdist_magic import device

    assert str(device()) == "cpu"


def test_runstate_metrics_history_is_bounded():
    state = RunState("r", 1)
    for step in range(MAX_POINTS + 1):
        state.apply({"type": "metrics", "rank": 0, "step": step, "values": {"loss": 1.0}})
    points = state.ranks[0].history["loss"]
    assert len(points) <= MAX_POINTS and points[0][0] == 0 and points[-1][0] == MAX_POINTS


def test_runstate_ignores_events_for_unknown_ranks():
    state = RunState("r", 2)
    for bad in ({"type": "log", "rank": 5}, {"type": "log", "rank": "0"}, {"type": "nope", "rank": 0}):
        state.apply(bad)
    assert state.version == 0


def test_failures_ordered_by_time_root_cause_first():
    state = RunState("r", 3)
    state.apply({"type": "exit", "rank": 2, "code": 1, "time": 20.0, "failure": {"exc_type": "E2"}})
    state.apply({"type": "exit", "rank": 1, "code": -9, "time": 10.0, "failure": {}})
    assert [f.rank for f in state.failures()] == [1, 2]
    err = RankFailure(state.failures()[0], state.failures()[1:])
    assert err.exit_code == -9 and "killed by SIGKILL" in str(err)
    assert "Other ranks stopped after the root cause" in err.details()
    assert err._render_traceback_()[0].startswith("RankFailure: rank 1")


def test_rank_failure_pickles():
    import pickle

    err = RankFailure(FailureInfo(rank=1, exc_type="ValueError", message="m", traceback="tb"))
    again = pickle.loads(pickle.dumps(err))
    assert (again.rank, again.exc_type, again.traceback) == (1, "ValueError", "tb")


def test_late_exit_after_the_run_ended_does_not_turn_a_stop_into_a_failure():
    state = RunState("r", 2)
    state.apply({"type": "status", "rank": 1, "state": "running"})
    state.finish("cancelled")
    state.apply({"type": "exit", "rank": 1, "code": -15, "time": 1.0, "failure": {}})
    assert state.ranks[1].state == "cancelled" and state.ranks[1].exit_code == -15
    assert state.failures() == []
