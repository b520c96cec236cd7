"""The event contract (one JSON encoding, strict decoding) and RunState built from records."""

import dataclasses
import json

import pytest

from torchdist_magic import events
from torchdist_magic.events import (Dropped, Exit, Failure, Log, MalformedEvent, Metrics, Progress, RunJob,
                                    Started, Stop)
from torchdist_magic.state import MAX_POINTS, RunState

SAMPLES = [
    Started(rank=1, host="h", pid=42, time=1.5),
    Log(rank=0, stream="stderr", line="héllo \x1b[0m", cr=True),
    Progress(rank=0, bar="epoch#0", desc="epoch", n=2, total=None, elapsed=0.5, state="done"),
    Metrics(rank=1, step=3, values={"loss": 0.25, "bad": "nan"}, time=2.0),
    Dropped(rank=0, count=7),
    Exit(rank=1, code=-9, time=3.0, host="h", stopped=False,
         failure=Failure(rank=1, exit_code=-9, exc_type="", message="", log_tail=["a", "b"])),
    Exit(rank=0, code=None, stopped=True),
    Stop(rank=-1, grace=2.0),
    RunJob(rank=0, job_id="j1", job_file="/tmp/j"),
]


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_json(record):
    text = events.dumps(record)
    assert json.loads(text)["type"] == record.type
    assert events.loads(text) == record


def test_every_record_type_is_in_the_contract_and_handled():
    assert set(events.RECORDS.values()) == set(events.RANK_TO_DRIVER) | set(events.DRIVER_TO_RANK)
    assert set(RunState.HANDLERS) == set(events.RANK_TO_DRIVER)
    assert events.SENDERS["worker"] < events.SENDERS["launcher"]
    assert events.Exit not in events.SENDERS["worker"] and events.Log not in events.SENDERS["worker"]


@pytest.mark.parametrize("data, text", [
    ([], "an event is a JSON object, got list"),
    ({"rank": 0}, "unknown event type None"),
    ({"type": "status", "rank": 0}, "unknown event type 'status'"),
    ({"type": "log"}, "log: missing field 'rank'"),
    ({"type": "log", "rank": "0"}, "log.rank: expected int"),
    ({"type": "log", "rank": True}, "log.rank: expected int"),
    ({"type": "exit", "rank": 0, "code": 1.5}, "exit.code"),
    ({"type": "exit", "rank": 0, "failure": {"rank": "x"}}, "exit.failure.rank: expected int"),
    ({"type": "exit", "rank": 0, "failure": "boom"}, "exit.failure"),
    ({"type": "metrics", "rank": 0, "values": {"a": [1]}}, "metrics.values"),
    ({"type": "metrics", "rank": 0, "values": [1]}, "metrics.values: expected dict"),
    ({"type": "progress", "rank": 0, "elapsed": float("inf")}, "progress.elapsed: expected float"),
    ({"type": "progress", "rank": 0, "elapsed": 10**400}, "progress.elapsed: expected float"),
    ({"type": "exit", "rank": 0, "failure": {"log_tail": ["a", 1]}}, r"exit.failure.log_tail\[\]"),
])
def test_malformed_records_are_refused(data, text):
    with pytest.raises(MalformedEvent, match=text):
        events.decode(data)


def test_unknown_fields_are_ignored_and_json_errors_refused():
    assert events.decode({"type": "dropped", "rank": 0, "count": 1, "new": "x"}) == Dropped(rank=0, count=1)
    with pytest.raises(MalformedEvent, match="not JSON"):
        events.loads("{")
    with pytest.raises(MalformedEvent, match="not JSON"):
        events.loads("[" * 100_000 + "]" * 100_000)


def test_failure_json_round_trip():
    failure = Failure(rank=2, host="h", exit_code=7, exc_type="SystemExit", message="exit code 7",
                      traceback="tb", time=1.0)
    assert events.failure_from_json(json.loads(json.dumps(events.failure_to_json(failure)))) == failure


# -- RunState ----------------------------------------------------------------------------------

def test_metrics_history_is_bounded_and_non_finite_values_are_not_plotted():
    state = RunState("r", 1)
    for step in range(MAX_POINTS + 1):
        state.apply(Metrics(rank=0, step=step, values={"loss": 1.0, "odd": "nan"}))
    points = state.ranks[0].history["loss"]
    assert len(points) <= MAX_POINTS and points[0][0] == 0 and points[-1][0] == MAX_POINTS
    assert "odd" not in state.ranks[0].history


def test_records_of_ranks_outside_the_run_are_ignored():
    state = RunState("r", 2)
    state.apply(Log(rank=5, line="x"))
    state.apply(Log(rank=-1, line="x"))
    assert state.version == 0


def test_started_marks_the_rank_and_the_run_running():
    state = RunState("r", 2)
    state.apply(Started(rank=1, host="h1", pid=99))
    assert (state.ranks[1].state, state.ranks[1].host, state.ranks[1].pid, state.state) == ("running", "h1", 99, "running")


def test_failures_ordered_by_time_root_cause_first():
    state = RunState("r", 3)
    state.apply(Exit(rank=2, code=1, time=20.0, failure=Failure(exc_type="E2", time=20.0)))
    state.apply(Exit(rank=1, code=-9, time=10.0))
    assert [f.rank for f in state.failures()] == [1, 2]
    assert state.failures()[0].exit_code == -9


def test_collateral_failure_is_never_the_root_cause():
    state = RunState("r", 2)
    state.apply(Exit(rank=0, code=1, time=1.0, failure=Failure(exc_type="RuntimeError", time=1.0,
                                                               message="Connection closed by peer")))
    state.apply(Exit(rank=1, code=1, time=2.0, failure=Failure(exc_type="ValueError", message="bad", time=2.0)))
    assert [f.exc_type for f in state.failures()] == ["ValueError", "RuntimeError"]


def test_failure_gets_the_rank_its_log_tail_and_the_exit_code():
    state = RunState("r", 2)
    for i in range(30):
        state.apply(Log(rank=1, line=f"line {i}"))
    state.apply(Exit(rank=1, code=3, time=5.0, host="h", failure=Failure(rank=0, exc_type="E")))
    failure = state.failures()[0]
    assert (failure.rank, failure.exit_code, failure.host, failure.time) == (1, 3, "h", 5.0)
    assert failure.log_tail == [f"line {i}" for i in range(10, 30)]


def test_repeated_exit_is_ignored():
    state = RunState("r", 1)
    state.apply(Exit(rank=0, code=0, time=1.0))
    state.apply(Exit(rank=0, code=1, time=2.0))
    assert (state.ranks[0].state, state.ranks[0].exit_code) == ("done", 0)


def test_late_exit_after_the_run_ended_does_not_turn_a_stop_into_a_failure():
    state = RunState("r", 2)
    state.apply(Started(rank=1))
    state.finish("cancelled")
    state.apply(Exit(rank=1, code=-15, time=1.0))
    assert state.ranks[1].state == "cancelled" and state.ranks[1].exit_code == -15
    assert state.failures() == []


def test_records_are_plain_dataclasses():
    for cls in events.RECORDS.values():
        assert dataclasses.is_dataclass(cls) and cls.type
