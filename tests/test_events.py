"""The event contract (one JSON encoding, strict decoding) and RunState built from records."""

import dataclasses
import json
import os
import re

import pytest

from torchdist_magic.core import events
from torchdist_magic.core.events import Dropped, Exit, Log, Metrics, Progress, RunJob, Started, Stop
from torchdist_magic.core.failure import Failure
from torchdist_magic.core.recordcheck import MalformedEvent
from torchdist_magic.core.stacks import is_library_file
from torchdist_magic.driver.state import MAX_POINTS, RunState

SAMPLES = [
    Started(rank=1, host="h", pid=42, time=1.5),
    events.StopRun(rank=-1, token="ab" * 32, by="%torchdist stop"),
    events.AttemptBegan(rank=-1, attempt=2),
    Log(rank=0, stream="stderr", line="héllo \x1b[0m", cr=True),
    Progress(rank=0, bar="epoch#0", desc="epoch", n=2, total=None, elapsed=0.5, state="done"),
    Metrics.point(rank=1, step=3, values={"loss": 0.25, "bad": "nan"}, time=2.0),
    Dropped(rank=0, count=7),
    Exit(
        rank=1,
        code=-9,
        time=3.0,
        host="h",
        stopped=False,
        failure=Failure(rank=1, exit_code=-9, exc_type="", message="", log_tail=["a", "b"]),
    ),
    Exit(rank=0, code=None, stopped=True),
    Stop(rank=-1, grace=2.0),
    events.DumpStacks(rank=-1),
    events.Stacks(
        rank=1,
        text='Thread 0x0001 (most recent call first):\n  File "a.py", line 3 in f\n',
        main_thread=1,
        time=4.0,
        note="",
    ),
    Progress(rank=1, bar="tqdm#0", desc="Epoch 0", n=3, total=5, state="cleared", postfix="loss=0.3"),
    events.Joined(rank=1, host="h/127.0.0.3", address="127.0.0.3", port=None, gpus="0"),
    events.Peers(rank=-1, peers=[events.Joined(rank=0, host="h", address="a", port=29500)], use_barrier=False),
    RunJob(rank=0, job_id="j1", data="AAA=", last=True, env={"K": "v"}, all_ranks=True),
    events.JobValue(rank=0, job_id="j1", data="gAN9cQAu"),
    events.JobDone(
        rank=1,
        job_id="j1",
        code=1,
        time=5.0,
        has_value=False,
        failure=Failure(rank=1, exc_type="ValueError", message="bad", traceback="T"),
    ),
    events.OutputEnd(rank=1, job_id="j1", stream="stderr"),
    events.DumpCollectives(rank=-1),
    events.Collectives(
        rank=2,
        source="flight recorder",
        time=6.0,
        groups=[
            events.GroupCollectives(group="default group", entered=4, finished=3, op="all_reduce", sizes=[[10], [2, 3]])
        ],
    ),
    events.Collectives(rank=1, source="stack", in_collective="broadcast", note=""),
    events.Preflight(
        rank=0,
        host="h",
        python="3.11.9",
        torch="2.13.0",
        cuda="12.8",
        nccl="2.27.3",
        driver="570.1",
        gpus=[events.GpuHealth(index=0, name="H100", ecc_errors=1, throttled="hw_slowdown", free_bytes=8e9)],
        bus_gbps=12.5,
        link_gbps=20.0,
        seconds=0.7,
    ),
]


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_json(record):
    text = events.dumps(record)
    assert json.loads(text)["type"] == record.type
    assert events.loads(text) == record


def test_every_record_type_is_in_the_contract_and_handled():
    assert set(events.RECORDS.values()) == (
        set(events.RANK_TO_DRIVER)
        | set(events.DRIVER_TO_RANK)
        | set(events.LAUNCHER_TO_DRIVER)
        | set(events.POOL_TO_DRIVER)
        | set(events.DEBUG_TO_DRIVER)
        | set(events.PROFILE_TO_DRIVER)
        | set(events.KERNEL_TO_SUPERVISOR)
        | set(events.SUPERVISOR_TO_KERNEL)
    )
    assert set(RunState.HANDLERS) == set(events.RANK_TO_DRIVER)
    assert events.SENDERS["worker"] < events.SENDERS["launcher"]
    assert events.Exit not in events.SENDERS["worker"] and events.Log not in events.SENDERS["worker"]
    # a rank can never stop a detached run through its channel, nor a kernel send a rank's record
    assert events.StopRun not in events.SENDERS["launcher"] and events.SENDERS["kernel"] == {
        events.StopRun,
        events.ReadState,
    }
    assert not any(events.AttemptBegan in senders for senders in events.SENDERS.values())  # a journal's only


#: records the contract refuses, and what it says of each
MALFORMED = [
    ([], "an event is a JSON object, got list"),
    ({"rank": 0}, "unknown event type None"),
    ({"type": "status", "rank": 0}, "unknown event type 'status'"),
    ({"type": "log"}, "log: missing field 'rank'"),
    ({"type": "log", "rank": "0"}, "log.rank: expected int"),
    ({"type": "log", "rank": True}, "log.rank: expected int"),
    ({"type": "exit", "rank": 0, "code": 1.5}, r"^exit\.code: expected int, got 1\.5$"),
    ({"type": "exit", "rank": 0, "failure": {"rank": "x"}}, "exit.failure.rank: expected int"),
    ({"type": "exit", "rank": 0, "failure": "boom"}, r"^exit\.failure: expected Failure, got 'boom'$"),
    (
        {"type": "metrics", "rank": 0, "names": ["a"], "steps": [1], "times": [1.0], "values": [[[1]]]},
        r"^metrics\.values\[\]\[\]: \[1\] is none of ",
    ),
    ({"type": "metrics", "rank": 0, "values": [1]}, r"^metrics\.values\[\]: expected list, got 1$"),
    ({"type": "metrics", "rank": 0, "values": {"a": 1.0}}, "metrics.values: expected list"),
    ({"type": "progress", "rank": 0, "elapsed": float("inf")}, "progress.elapsed: expected float"),
    ({"type": "progress", "rank": 0, "elapsed": 10**400}, "progress.elapsed: expected float"),
    (
        {"type": "exit", "rank": 0, "failure": {"log_tail": ["a", 1]}},
        r"^exit\.failure\.log_tail\[\]: expected str, got 1$",
    ),
    ({"type": "metrics", "rank": 0, "steps": ["1"], "times": [1.0]}, r"^metrics\.steps\[\]: expected int"),
    (
        {"type": "metrics", "rank": 0, "names": ["a"], "steps": [1], "times": [1.0], "values": [[float("nan")]]},
        r"^metrics\.values\[\]\[\]: nan is none of ",
    ),
    ({"type": "metrics", "rank": 0, "names": [1]}, r"^metrics\.names\[\]: expected str, got 1$"),
    # the columns must line up: a time per step, a column per name, a value per point
    ({"type": "metrics", "rank": 0, "steps": [1, 2], "times": [1.0]}, r"^metrics: 2 steps but 1 times$"),
    ({"type": "metrics", "rank": 0, "names": ["a"]}, r"^metrics: 1 names but 0 columns of values$"),
    (
        {"type": "metrics", "rank": 0, "names": ["a", "a"], "values": [[], []]},
        r"^metrics: a metric name twice$",
    ),
    (
        {"type": "metrics", "rank": 0, "names": ["a"], "steps": [1], "times": [1.0], "values": [[1.0, 2.0]]},
        r"^metrics: 2 values of 'a' for 1 points$",
    ),
]


@pytest.mark.parametrize("data, text", MALFORMED)
def test_malformed_records_are_refused(data, text):
    with pytest.raises(MalformedEvent, match=text):
        events.decode(data)


def test_unknown_fields_are_ignored_and_json_errors_refused():
    assert events.decode({"type": "dropped", "rank": 0, "count": 1, "new": "x"}) == Dropped(rank=0, count=1)
    with pytest.raises(MalformedEvent, match="not JSON"):
        events.loads("{")
    with pytest.raises(MalformedEvent, match="not JSON"):
        events.loads("[" * 100_000 + "]" * 100_000)


def test_a_column_of_floats_passes_by_its_sum_only_when_every_point_is_finite():
    """A column of floats is found finite by its sum (nan or an infinity makes it so): a column
    of large finite numbers whose sum overflows still passes, one nan or infinity among many
    numbers is still refused, where it is, and a column of whole numbers becomes floats."""
    metrics = '{"type":"metrics","rank":0,"names":["x"],"steps":[1,2,3],"times":%s,"values":[%s]}'
    big = events.loads(metrics % ("[1.0,2.0,3.0]", "[1e308,1e308,1e308]"))
    assert big.values == [[1e308, 1e308, 1e308]]
    for bad in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(MalformedEvent, match=r"metrics.values\[\]"):
            events.loads(metrics % ("[1.0,2.0,3.0]", f"[1.0,{bad},2.0]"))
        with pytest.raises(MalformedEvent, match=r"metrics.times\[\]"):
            events.loads(metrics % (f"[1.0,{bad},3.0]", "[1.0,2.0,3.0]"))
    whole = events.loads(metrics % ("[1,2,3]", '[1,"nan",null]'))
    assert whole.times == [1.0, 2.0, 3.0] and all(type(t) is float for t in whole.times)
    assert whole.values == [[1.0, "nan", None]] and type(whole.values[0][0]) is float


def test_the_builders_by_type_keep_nothing_for_a_name_that_is_no_record_s():
    """``events.BUILDERS`` (what ``events.decode`` builds a record with) makes a record
    type's builder on first use and refuses any other name without keeping it."""
    assert events.BUILDERS["dropped"]({"type": "dropped", "rank": 0, "count": 2}, "dropped") == Dropped(rank=0, count=2)
    for name in ("no-such-record", "__class__", ""):
        with pytest.raises(KeyError):
            events.BUILDERS[name]
        assert name not in events.BUILDERS
    with pytest.raises(MalformedEvent, match="dropped.count"):
        events.BUILDERS["dropped"]({"type": "dropped", "rank": 0, "count": "2"}, "dropped")


# -- the driver's compiled decoder (core.recorddecoder): the channel's, the contract's judgement ----------

#: a record of every type the samples above lack, with every field set
MORE_SAMPLES = [
    events.SystemMetrics(rank=0, values={"cpu_percent": 12.5, "rss_bytes": 1e9}, time=7.0),
    events.StepSplit(rank=0, data=0.25, compute=0.5, comm=0.25, seconds=2.0, steps=4, step_s=9.0, data_s=2.0, time=8.0),
    events.Checkpoint(rank=1, step=100, time=9.0),
    events.CodeStarted(rank=1, time=9.5),
    events.ProfilePiece(rank=0, data='{"traceEvents": []}'),
    events.ProfileDone(
        rank=0,
        steps=3,
        size=20,
        kept_at="h:/tmp/p.json",
        top=[events.ProfileOp(name="aten::mm", self_cpu_s=0.5, calls=3)],
        peak_memory_bytes=1e8,
        peak_gpu_memory_bytes=None,
        error="",
        time=10.0,
    ),
    events.StartProfile(rank=-1, steps=5),
    events.DebugOutput(rank=0, session="s1", kind="post-mortem", text="> f()", prompt="(Pdb) ", end=False, time=1.0),
    events.DebugInput(rank=0, session="s1", line="p x", end=True),
    events.ReadState(
        rank=-1, token="t", read="logs", at=2, since=3, ranks=[0, 1], names=["loss"], reads=[[0, 0, None, True]]
    ),
    Metrics(
        rank=1,
        names=["loss", "acc", "odd"],
        steps=[1, 2, 3],
        times=[1.0, 2.0, 3.0],
        values=[[1.0, 0.5, 0.25], [None, None, 0.9], ["nan", None, None]],
    ),
    Log(rank=2, stream="stderr", line="a", cr=True, more=["b", "c"]),
]


def decode_frame(items: list, text: str = "") -> list:
    """What the driver's channel makes of a frame of ``items`` (or of its JSON ``text``): each
    record, or the ``MalformedEvent`` it was refused with."""
    from torchdist_magic.core.recorddecoder import RecordDecoder

    decoder = RecordDecoder()
    found = decoder.frame((text or json.dumps({"events": items})).encode("utf-8"))
    assert found is not None
    out = []
    for item in found:
        try:
            out.append(decoder.record(item))
        except MalformedEvent as exc:
            out.append(exc)
    return out


def test_the_samples_hold_a_record_of_every_type():
    assert {type(r) for r in SAMPLES + MORE_SAMPLES} == set(events.RECORDS.values())


@pytest.mark.parametrize("record", SAMPLES + MORE_SAMPLES, ids=lambda r: type(r).__name__)
def test_the_channels_decoder_builds_every_record_as_the_contract_does(record):
    [got] = decode_frame([], f'{{"events":[{events.dumps(record)}]}}')
    assert type(got) is type(record) and got == record == events.loads(events.dumps(record))


@pytest.mark.parametrize("data, text", MALFORMED)
def test_the_channels_decoder_refuses_what_the_contract_refuses_and_says_the_same(data, text):
    [got] = decode_frame([data])
    assert isinstance(got, MalformedEvent)
    assert re.search(text, str(got)), str(got)


def test_the_channels_decoder_builds_well_formed_records_without_the_contracts_python_check(monkeypatch):
    """msgspec builds what is well formed: ``events.decode`` (the contract's check in Python)
    is not called for it; it is for what msgspec does not take (and says why)."""
    from torchdist_magic.core import recorddecoder

    judged = []
    monkeypatch.setattr(recorddecoder.events, "decode", lambda data: judged.append(data) or Dropped(rank=0))
    records = SAMPLES + MORE_SAMPLES
    got = decode_frame([], '{"events":[%s]}' % ",".join(events.dumps(r) for r in records))
    assert got == records and judged == []
    decode_frame([{"type": "dropped", "rank": 0, "count": "2"}])
    assert judged == [{"type": "dropped", "rank": 0, "count": "2"}]


def test_the_channels_decoder_takes_what_json_allows_and_msgspec_does_not_as_the_contract_does():
    """A text with a lone surrogate escape, and ``NaN`` in a field no record has, are JSON that
    Python's ``json`` reads and msgspec's strict decoder does not: the contract takes such a
    record, and so does the channel (the rest of the frame too)."""
    surrogate = '{"events":[{"type":"log","rank":0,"line":"\\udc80 x"},{"type":"dropped","rank":0,"count":1}]}'
    assert decode_frame([], surrogate) == [Log(rank=0, line="\udc80 x"), Dropped(rank=0, count=1)]
    nan = '{"events":[{"type":"dropped","rank":0,"count":1,"new":NaN},{"type":"dropped","rank":0,"count":2}]}'
    assert decode_frame([], nan) == [Dropped(rank=0, count=1), Dropped(rank=0, count=2)]
    whole = decode_frame([{"type": "metrics", "rank": 0, "names": ["x"], "steps": [1], "times": [1], "values": [[2]]}])
    assert whole == [Metrics(rank=0, names=["x"], steps=[1], times=[1.0], values=[[2.0]])]
    assert type(whole[0].times[0]) is float and type(whole[0].values[0][0]) is float


def test_the_channels_decoder_reads_integers_beyond_64_bits_as_json_does():
    """(msgspec below 0.19 read some of them wrong: setup.cfg's lower bound.)"""
    pids = [2**64, 19910487346695355018, 19994416407280847239, 2**200 + 12345]
    records = [Started(rank=0, pid=pid) for pid in pids]
    assert decode_frame([events.encode(r) for r in records]) == records


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"\xff",
        b"[]",
        b'{"events": 5}',
        b'{"no": []}',
        b'{"events": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
)
def test_the_channels_decoder_refuses_a_frame_that_is_no_object_with_a_list_of_records(body):
    from torchdist_magic.core.recorddecoder import RecordDecoder

    assert RecordDecoder().frame(body) is None


def test_failure_json_round_trip():
    failure = Failure(
        rank=2, host="h", exit_code=7, exc_type="SystemExit", message="exit code 7", traceback="tb", time=1.0
    )
    assert events.failure_from_json(json.loads(json.dumps(events.failure_to_json(failure)))) == failure


# -- building a Failure ------------------------------------------------------------------------


def _raised(exc):
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001
        return caught


def test_failure_from_an_exception_names_its_type_message_and_traceback():
    failure = Failure.from_exception(3, _raised(KeyError("k")), host="h", exit_code=1)
    assert (failure.rank, failure.host, failure.exit_code, failure.exc_type, failure.message) == (
        3,
        "h",
        1,
        "KeyError",
        "'k'",
    )
    assert failure.traceback.startswith("Traceback (most recent call last):\n")
    assert "in _raised" in failure.traceback and failure.traceback.endswith("KeyError: 'k'\n")
    assert failure.time > 0 and failure.log_tail == []
    assert failure.summary() == "rank 3 on h raised KeyError: 'k'"


def test_failure_from_an_exception_takes_what_its_caller_says_instead():
    class Inner(Exception):
        pass

    failure = Failure.from_exception(
        0, _raised(Inner("x")), exc_type="TypeError", message="cannot be pickled", traceback_text="", time=7.0
    )
    assert (failure.exc_type, failure.message, failure.traceback, failure.time) == (
        "TypeError",
        "cannot be pickled",
        "",
        7.0,
    )
    assert (
        Failure.from_exception(0, Inner("x")).exc_type
        == "test_failure_from_an_exception_takes_what_its_caller_says_instead.<locals>.Inner"
    )
    assert Failure.from_exception(0, ValueError("x")).traceback == "ValueError: x\n"  # never raised: no frames


@pytest.mark.parametrize(
    "code, summary",
    [
        (-9, "rank 1 on h was killed by SIGKILL"),
        (-15, "rank 1 on h was killed by SIGTERM"),
        (-200, "rank 1 on h was killed by signal 200"),
        (3, "rank 1 on h exited with code 3"),
        (None, "rank 1 on h failed: "),
    ],
)
def test_failure_from_an_exit_alone(code, summary):
    failure = Failure.from_exit(1, code, host="h", time=5.0)
    assert failure == Failure(rank=1, host="h", exit_code=code, time=5.0)
    assert failure.summary() == summary


def test_failure_from_an_exit_keeps_what_the_rank_reported():
    reported = Failure(
        rank=0,
        host="worker-host",
        exit_code=7,
        exc_type="SystemExit",
        message="exit code 7",
        traceback="tb",
        time=2.0,
        log_tail=["a"],
    )
    plain = Failure.from_exit(4, 7, host="launcher-host", time=9.0, reported=reported)
    assert plain == Failure(
        rank=4,
        host="worker-host",
        exit_code=7,
        exc_type="SystemExit",
        message="exit code 7",
        traceback="tb",
        time=2.0,
        log_tail=["a"],
    )
    # a plain exit of another code, and an exit with no code: the rank's own code stands
    assert Failure.from_exit(4, 1, reported=reported).exit_code == 7
    assert Failure.from_exit(4, None, reported=reported).exit_code == 7
    # a signal is what the process did, whatever the rank reported
    killed = Failure.from_exit(4, -9, reported=reported)
    assert (killed.exit_code, killed.exc_type, killed.summary()) == (
        -9,
        "SystemExit",
        "rank 4 on worker-host raised SystemExit: exit code 7",
    )
    assert killed.signal_name == "SIGKILL"
    # what the report lacks comes from the exit; lines seen here replace the report's
    bare = Failure(exc_type="E", message="m")
    filled = Failure.from_exit(2, 3, host="h", time=9.0, reported=bare, log_tail=["x", "y"])
    assert (filled.host, filled.time, filled.exit_code, filled.log_tail) == ("h", 9.0, 3, ["x", "y"])
    assert Failure.from_exit(2, 3, reported=reported, log_tail=[]).log_tail == ["a"]
    assert reported == Failure(
        rank=0,
        host="worker-host",
        exit_code=7,
        exc_type="SystemExit",
        message="exit code 7",
        traceback="tb",
        time=2.0,
        log_tail=["a"],
    )  # untouched


def test_failure_for_rank_is_a_changed_copy():
    original = Failure(rank=0, host="h", exc_type="E", time=1.0)
    copy = original.for_rank(2, exit_code=1, time=3.0)
    assert copy == Failure(rank=2, host="h", exit_code=1, exc_type="E", time=3.0)
    assert original == Failure(rank=0, host="h", exc_type="E", time=1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_field'"):
        original.for_rank(1, no_such_field=1)


# -- RunState ----------------------------------------------------------------------------------


def test_metrics_history_is_bounded_and_non_finite_values_are_not_plotted():
    state = RunState("r", 1)
    for step in range(MAX_POINTS + 1):
        state.apply(Metrics.point(rank=0, step=step, values={"loss": 1.0, "odd": "nan"}))
    points = state.ranks[0].history["loss"].pairs()
    assert len(points) <= MAX_POINTS and points[0][0] == 0 and points[-1][0] == MAX_POINTS
    assert "odd" not in state.ranks[0].history


def test_a_metric_history_keeps_its_points_in_two_arrays_not_a_pair_per_point():
    """16 bytes a point (a step, a value), not a tuple of them (56 bytes and a list's slot)."""
    import tracemalloc

    state = RunState("r", 1)
    state.apply(Metrics.point(rank=0, step=0, values={"loss": 1.0}))
    count = 5000
    record = Metrics(
        rank=0, names=["loss"], steps=list(range(1, count + 1)), times=[1.0] * count, values=[[0.5] * count]
    )
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        state.apply(record)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 24 * count, grown
    assert state.metric_history()["loss"][0][-2:] == [(count - 1, 0.5), (count, 0.5)]


def test_a_step_beyond_64_bits_is_not_plotted_and_said_once_in_the_ranks_log():
    state = RunState("r", 1)
    state.apply(Metrics.point(rank=0, step=1, values={"loss": 1.0}))
    state.apply(Metrics.point(rank=0, step=2**64, values={"loss": 2.0}))
    state.apply(Metrics(rank=0, names=["loss"], steps=[-(2**70), 2], times=[0.0, 0.0], values=[[3.0, 4.0]]))
    assert state.metric_history() == {"loss": {0: [(1, 1.0), (2, 4.0)]}}
    assert state.ranks[0].metrics == {"loss": 4.0}
    text = state.logs(0)
    assert text.count("beyond a 64-bit integer") == 1
    assert "torchdist: rank 0 reported a step beyond a 64-bit integer (18446744073709551616); its points" in text


def test_the_points_of_one_metrics_record_are_applied_in_order():
    record = Metrics(
        rank=0,
        names=["loss", "acc", "odd"],
        steps=[1, 2, 3],
        times=[1.0, 2.0, 3.0],
        values=[[1.0, 0.5, 0.25], [None, None, 0.9], ["nan", None, None]],
    )
    assert events.decode(json.loads(events.dumps(record))) == record
    assert record.points() == [
        events.MetricPoint(1, {"loss": 1.0, "odd": "nan"}, 1.0),
        events.MetricPoint(2, {"loss": 0.5}, 2.0),
        events.MetricPoint(3, {"loss": 0.25, "acc": 0.9}, 3.0),
    ]
    state = RunState("r", 1)
    state.apply(record)
    rs = state.ranks[0]
    assert {name: series.pairs() for name, series in rs.history.items()} == {
        "loss": [(1, 1.0), (2, 0.5), (3, 0.25)],
        "acc": [(3, 0.9)],
    }
    assert rs.metrics == {"loss": 0.25, "acc": 0.9}


def test_a_log_record_with_more_lines_round_trips():
    record = events.Log(rank=2, stream="stderr", line="a", cr=True, more=["b", "c"])
    assert events.decode(json.loads(events.dumps(record))) == record
    assert record.lines() == [
        events.OutputLine("stderr", "a", True),
        events.OutputLine("stderr", "b", False),
        events.OutputLine("stderr", "c", False),
    ]
    with pytest.raises(events.MalformedEvent, match=r"^log\.more\[\]: expected str, got 3$"):
        events.decode({"type": "log", "rank": 0, "line": "a", "more": ["b", 3]})


def test_a_run_of_many_ranks_keeps_a_share_of_the_runs_memory_for_each():
    from torchdist_magic.driver import logstore, state as S

    state = RunState("r", 1024)
    share = logstore.RUN_LOG_MEMORY_LINES // 1024
    for i in range(2 * share):
        state.apply(Log(rank=7, line=f"line {i}"))
    for step in range(2 * state.max_points):
        state.apply(Metrics.point(rank=7, step=step, values={"loss": 1.0}))
    assert state.ranks[7].logs.spilled > 0 and len(state.ranks[7].logs.recent(10**6)) <= share
    assert state.logs(7) == "".join(f"line {i}\n" for i in range(2 * share))  # all of it, in order
    points = state.ranks[7].history["loss"].pairs()
    assert state.max_points < S.MAX_POINTS and len(points) <= state.max_points
    assert points[0][0] == 0 and points[-1][0] == 2 * state.max_points - 1
    assert RunState("r", 4).max_points == S.MAX_POINTS  # a small run keeps what it always kept


def test_records_of_ranks_outside_the_run_are_ignored():
    state = RunState("r", 2)
    state.apply(Log(rank=5, line="x"))
    state.apply(Log(rank=-1, line="x"))
    assert state.version == 0


def test_started_marks_the_rank_and_the_run_running():
    state = RunState("r", 2)
    state.apply(Started(rank=1, host="h1", pid=99))
    assert (state.ranks[1].state, state.ranks[1].host, state.ranks[1].pid, state.state) == (
        "running",
        "h1",
        99,
        "running",
    )


def test_failures_ordered_by_time_root_cause_first():
    state = RunState("r", 3)
    state.apply(Exit(rank=2, code=1, time=20.0, failure=Failure(exc_type="E2", time=20.0)))
    state.apply(Exit(rank=1, code=-9, time=10.0))
    assert [f.rank for f in state.failures()] == [1, 2]
    assert state.failures()[0].exit_code == -9


def test_collateral_failure_is_never_the_root_cause():
    state = RunState("r", 2)
    state.apply(
        Exit(
            rank=0,
            code=1,
            time=1.0,
            failure=Failure(exc_type="RuntimeError", time=1.0, message="Connection closed by peer"),
        )
    )
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


# -- stacks ------------------------------------------------------------------------------------


def _innermost_of_mine(done):
    done.wait()


def _dump_with_a_waiting_thread(tmp_path):
    """A real faulthandler dump of this process, with a second thread blocked in a C call."""
    import faulthandler
    import threading

    done = threading.Event()
    waiter = threading.Thread(target=_innermost_of_mine, args=(done,))
    waiter.start()
    try:
        with open(tmp_path / "stacks.txt", "w+") as fh:
            faulthandler.dump_traceback(fh, all_threads=True)
            fh.seek(0)
            return fh.read(), waiter.ident
    finally:
        done.set()
        waiter.join()


def test_stacks_of_a_real_dump_name_each_threads_frames(tmp_path):
    import threading

    text, waiter = _dump_with_a_waiting_thread(tmp_path)
    main = threading.main_thread().ident
    record = events.Stacks(rank=0, text=text, main_thread=main)
    threads = {t.ident: t for t in record.threads()}
    assert {main, waiter} <= set(threads)
    assert threads[waiter].frames[0].function == "wait"  # innermost first: threading's wait
    assert "_innermost_of_mine" in [f.function for f in threads[waiter].frames]
    assert record.main().ident == main
    assert record.main().frames[0].function == "_dump_with_a_waiting_thread"
    assert record.where().startswith(f"_dump_with_a_waiting_thread ({__file__}, line ")
    # without the main thread's ident, the oldest thread (listed last) is taken
    assert events.Stacks(rank=0, text=text).main().ident == main


def test_where_shows_library_frames_then_the_users_own():
    text = """Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2950 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/usr/lib/python3.11/contextlib.py", line 81 in inner
  File "/home/me/train.py", line 12 in step
  File "/work/torchdist_magic/rank/worker.py", line 118 in _run_function
  File "<frozen runpy>", line 88 in _run_code
"""
    record = events.Stacks(rank=0, text=text, main_thread=0x7F0000000001)
    assert record.where() == (
        "all_reduce (torch/distributed/distributed_c10d.py, line 2950) < wrapper (torch/distributed/c10d_logger.py, "
        "line 81) < inner (/usr/lib/python3.11/contextlib.py, line 81) < ... < step (/home/me/train.py, line 12)"
    )
    assert [f.function for f in record.main().job_frames()] == ["all_reduce", "wrapper", "inner", "step"]
    assert is_library_file("/usr/lib/python3.11/threading.py")
    assert not is_library_file("/home/me/train.py") and not is_library_file("<torchdist cell In[3]>")
    assert events.Stacks(rank=1, note="the rank had exited").where() == "the rank had exited"
    assert events.Stacks(rank=1).where() == "no Python stack"


# -- logs ----------------------------------------------------------------------------------------


def test_log_store_spills_and_reads_back_every_line_in_order(tmp_path, monkeypatch):
    from torchdist_magic.driver import logstore as S

    monkeypatch.setattr(S, "LOG_MEMORY_LINES", 100)
    monkeypatch.setattr(S, "SPILL_INDEX_EVERY", 16)
    store = S.LogStore(lambda: str(tmp_path / "logs"), "rank-0")
    (tmp_path / "logs").mkdir()
    texts = [f"line {i} \\ back\\slash" if i % 7 else f"odd\nline\r{i}" for i in range(1000)]
    for i, text in enumerate(texts):
        store.append(S.LogLine("stderr" if i % 3 else "stdout", text))
    assert len(store) == 1000 and store.spilled > 800 and len(store.recent(10_000)) <= 100
    assert [line.text for line in store] == texts
    assert [line.text for line in store[123:137]] == texts[123:137]
    assert store[5].text == texts[5] and store[-1].text == texts[-1] and store[500].stream == "stderr"
    assert store.text(998) == "".join(t + "\n" for t in texts[998:])
    with pytest.raises(IndexError, match="log line index out of range"):
        store[1000]
    with pytest.raises(ValueError, match="a log is sliced with step 1 only"):
        store[::2]
    assert os.listdir(tmp_path / "logs") == ["rank-0.log"]


def test_log_store_spills_lines_of_one_stream_and_redrawn_lines_alike(tmp_path, monkeypatch):
    """A spill writes its lines at once, one stream's plain lines joined whole, others line by
    line: every line, its stream and its redrawn mark come back, from any index."""
    from torchdist_magic.driver import logstore as S

    monkeypatch.setattr(S, "SPILL_INDEX_EVERY", 16)
    store = S.LogStore(lambda: str(tmp_path), "rank-0", max_lines=50, max_chars=10_000)
    expected = [S.LogLine("stdout", f"step {i}") for i in range(130)]  # one stream: joined whole
    expected.append(S.LogLine("stdout", "bar 50%", True))  # a redrawn line nothing replaces...
    expected += [S.LogLine("stderr", f"warn {i}") for i in range(100)]  # ...spilled among others
    expected += [S.LogLine("stdout", "x" * 3000) for _ in range(4)]  # long lines: spilled by size
    for line in expected:
        store.append(line)
    assert store.spilled > 200 and sum(len(line.text) for line in store.recent(100)) <= 10_000
    assert list(store) == expected
    assert [store[i] for i in (0, 15, 16, 17, 129, 130, 131, 233)] == [
        expected[i] for i in (0, 15, 16, 17, 129, 130, 131, 233)
    ]
    assert store[40:75] == expected[40:75]
    assert store.text(128, 132) == "step 128\nstep 129\nbar 50%\rwarn 0\n"


def test_the_logs_of_many_ranks_spill_to_one_file_and_each_reads_back_its_own(tmp_path, monkeypatch):
    """A run's ranks share one spill file (making a file per rank cost the channel's thread a
    millisecond each at a thousand ranks): each spill is a block, blocks of ranks interleave."""
    from torchdist_magic.driver import logstore as S
    from torchdist_magic.driver.state import SPILL_FILE

    monkeypatch.setattr(S, "SPILL_INDEX_EVERY", 4)
    (tmp_path / "logs").mkdir()
    spill = S.SpillFile(lambda: str(tmp_path / "logs"), "shared.spill")
    stores = [
        S.LogStore(lambda: pytest.fail("a store of its own"), f"rank-{r}", max_lines=10, spill=spill) for r in range(3)
    ]
    expected = [[S.LogLine("stdout" if i % 5 else "stderr", f"r{r} line {i}") for i in range(97)] for r in range(3)]
    for i in range(97):
        for r, store in enumerate(stores):
            store.append(expected[r][i])
    assert os.listdir(tmp_path / "logs") == ["shared.spill"]
    for r, store in enumerate(stores):
        assert store.spilled > 80 and list(store) == expected[r]
        assert store[3:29] == expected[r][3:29] and store[50] == expected[r][50]
        assert store.text(90) == "".join(line.text + "\n" for line in expected[r][90:])
    state = RunState("r", 1024, spill_dir=lambda: str(tmp_path / "run"))  # 390 lines in memory each
    (tmp_path / "run").mkdir()
    for i in range(600):
        for r in (0, 1023):
            state.apply(Log(rank=r, line=f"{r}:{i}"))
    assert os.listdir(tmp_path / "run") == [SPILL_FILE]
    assert state.ranks[1023].logs.spilled and state.logs(1023) == "".join(f"1023:{i}\n" for i in range(600))


def test_a_log_store_keeps_the_plain_lines_of_a_record_at_once_as_one_by_one(tmp_path):
    """``extend`` (a record's ``more``) keeps what ``add`` of each line would: its first line
    takes the place of the stream's redrawn line, a new attempt's does not, and it spills."""
    from torchdist_magic.driver.logstore import LogLine, LogStore

    store = LogStore(lambda: str(tmp_path), "rank-0", max_lines=8)
    store.add("stderr", "bar 10%", True)
    store.extend("stdout", ["a", "b"])  # the other stream: the bar stays
    store.extend("stderr", ["bar done", "c"])  # takes the bar's place
    store.add("stderr", "bar 20%", True)
    store.seal()
    store.extend("stderr", ["d"])  # a new attempt: the bar stays
    store.extend("stdout", [f"{i}" for i in range(20)])  # past max_lines: spills
    store.extend("stdout", [])
    assert store.spilled and len(store.recent(100)) <= 8
    assert store[:6] == [
        LogLine("stderr", "bar done"),  # in the redrawn line's place
        LogLine("stdout", "a"),
        LogLine("stdout", "b"),
        LogLine("stderr", "c"),
        LogLine("stderr", "bar 20%", True),
        LogLine("stderr", "d"),
    ]
    assert [line.text for line in store[6:]] == [f"{i}" for i in range(20)]


def test_redrawn_lines_that_spill_together_read_back_redrawn(tmp_path):
    """Lines of one kind spill under one head, redrawn ones too (each attempt's last bar, the
    next attempt's first line not taking its place), and read back as they were kept."""
    from torchdist_magic.driver.logstore import LogLine, LogStore

    store = LogStore(lambda: str(tmp_path), "rank-0", max_lines=4)
    for i in range(9):
        store.add("stderr", f"bar {i}", True)
        store.seal()
    assert store.spilled
    assert store[:] == [LogLine("stderr", f"bar {i}", True) for i in range(9)]
    assert store.text(0, 3) == "bar 0\rbar 1\rbar 2\r"


def test_a_line_longer_than_a_log_keeps_in_memory_stays_until_the_next(tmp_path):
    from torchdist_magic.driver.logstore import LogStore

    store = LogStore(lambda: str(tmp_path), "rank-0", max_chars=100)
    store.add("stdout", "x" * 500)
    assert store.spilled == 0 and len(store) == 1
    store.extend("stdout", ["y" * 300, "z"])
    store.add("stdout", "w" * 200)
    assert store.spilled == 3 and [line.text for line in store] == ["x" * 500, "y" * 300, "z", "w" * 200]


def test_lines_kept_in_memory_give_the_garbage_collector_nothing_to_follow():
    """A thousand ranks keep some 400,000 lines in the driver: as objects the collector tracks,
    every full collection walked them all (four tenths of the driver's CPU at 1024 ranks)."""
    import gc

    from torchdist_magic.driver.logstore import LogLine, LogStore

    store = LogStore(lambda: pytest.fail("nothing spills"), "rank-0", max_lines=50_000)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(20_000):
        store.add("stdout", f"line {i}", i % 2 == 1 and i == 19_999)
        store.append(LogLine("stderr", f"err {i}"))
    gc.collect()
    assert len(gc.get_objects()) - before < 1_000
    assert len(store) == 40_000 and store[-2] == LogLine("stdout", "line 19999", True)
    assert [line.text for line in store.recent(2)] == ["line 19999", "err 19999"]
    assert store.recent(0) == []


def test_log_store_keeps_a_redrawn_line_s_latest_state_only():
    from torchdist_magic.driver.logstore import LogLine, LogStore

    store = LogStore(lambda: pytest.fail("nothing spills"), "rank-0")
    for pct in (10, 50):
        store.append(LogLine("stderr", f"{pct}%", cr=True))
    store.append(LogLine("stdout", "a print meanwhile"))  # another stream: its own line
    store.append(LogLine("stderr", "90%", cr=True))  # the bar's line again, where it was
    store.append(LogLine("stderr", "100% done"))
    assert [(l.stream, l.text, l.cr) for l in store] == [
        ("stderr", "100% done", False),
        ("stdout", "a print meanwhile", False),
    ]
    assert "\r" not in store.text()
    store.append(LogLine("stderr", "next", cr=True))
    store.seal()  # a new attempt: its first line is a line of its own
    store.append(LogLine("stderr", "attempt 2"))
    assert [l.text for l in store][-2:] == ["next", "attempt 2"]


def test_restart_keeps_logs_ignores_the_ended_attempts_records_and_records_its_cause():
    state = RunState("r", 2, max_attempts=2)
    state.apply(Started(rank=1, pid=7), attempt=1)
    state.apply(Log(rank=1, line="first"), attempt=1)
    state.apply(Exit(rank=1, code=-9, time=1.0), attempt=1)
    state.restart()
    assert (state.attempt, state.state, state.ranks[1].state) == (2, "restarting", "starting")
    state.apply(Log(rank=1, line="late"), attempt=1)  # the ended attempt's: ignored
    state.apply(Log(rank=1, line="second"), attempt=2)
    state.apply(Started(rank=1, pid=8), attempt=2)
    assert state.state == "running" and state.ranks[1].pid == 8
    assert state.logs(1) == "first\nsecond\n"
    assert (state.logs(1, attempt=1), state.logs(1, attempt=2)) == ("first\n", "second\n")
    with pytest.raises(IndexError, match=r"attempt 3 is not in this run \(attempts 1\.\.2\)"):
        state.logs(1, attempt=3)
    (first,) = state.attempts
    assert (first.number, first.failure.rank, first.failure.exit_code) == (1, 1, -9)


def test_activity_is_output_progress_and_metrics():
    state = RunState("r", 1)
    state.last_activity -= 100
    state.apply(Dropped(rank=0, count=1))
    assert state.idle() >= 100
    for record in (Log(rank=0, line="x"), Progress(rank=0, bar="b"), Metrics.point(rank=0, values={"a": 1.0})):
        state.last_activity -= 100
        state.apply(record)
        assert state.idle() < 100


def test_a_cleared_bar_is_gone():
    state = RunState("r", 1)
    state.apply(Progress(rank=0, bar="val", n=1, total=2))
    state.apply(Progress(rank=0, bar="val", n=2, total=2, state="cleared"))
    assert state.ranks[0].progress == {}


@pytest.mark.parametrize(
    "values, ok",
    [
        ({"loss": 0.5, "note": "nan"}, True),  # the common case passes as it came
        ({"loss": 1}, True),  # an integer is made a float
        ({"loss": True}, False),
        ({"loss": [1.0]}, False),
        ({3: 1.0}, False),
        ({"loss": float("nan")}, False),
        ({"loss": float("inf")}, False),
    ],
)
def test_metric_values_are_checked_whatever_path_they_take(values, ok):
    names = list(values)
    data = {
        "type": "metrics",
        "rank": 0,
        "names": names,
        "steps": [1],
        "times": [1.0],
        "values": [[v] for v in values.values()],
    }
    if ok:
        got = events.decode(data).points()[0].values
        assert got == {k: float(v) if isinstance(v, int) else v for k, v in values.items()}
        assert all(type(v) in (float, str) for v in got.values())
    else:
        with pytest.raises(events.MalformedEvent):
            events.decode(data)


def test_a_dict_of_texts_refuses_a_number():
    with pytest.raises(events.MalformedEvent):
        events.decode({"type": "run_job", "rank": 0, "env": {"A": 1.5}})


def test_a_run_state_names_where_it_is_tracked_once_told():
    """MLflow's logger says where the run is tracked through ``RunState.track``; every view reads
    it from the state's snapshot."""
    from torchdist_magic.driver.tracking import TrackingLink

    state = RunState("r", 2)
    assert state.tracking is None and state.snapshot().tracking is None
    before = state.version
    link = TrackingLink("abc", "7", "sqlite:////tmp/m.db")
    state.track(link)
    assert state.tracking is link and state.snapshot().tracking is link and state.version > before


def _fields_as_json(value):
    """What a record's JSON object is, written the slow way: field by field, recursively."""
    import dataclasses

    if dataclasses.is_dataclass(value):
        return {f.name: _fields_as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _fields_as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_fields_as_json(v) for v in value]
    return value


def test_each_record_types_encoder_gives_its_fields_as_json():
    """The encoders written once per type (``recordcheck._encoder``) against the fields read
    one by one, for every record type and for records with nested points, lines and failures."""
    samples = [cls(rank=2) for cls in events.RECORDS.values()]
    samples += [
        events.Metrics(
            rank=1, names=["loss", "note"], steps=[3, 4], times=[1.5, 2.0], values=[[0.5, 0.25], ["nan", None]]
        ),
        events.Log(rank=0, line="a", more=["b", "c"]),
        events.Exit(rank=1, code=3, failure=events.Failure(rank=1, exc_type="KeyError", message="x")),
    ]
    for record in samples:
        encoded = events.encode(record)
        assert encoded == {**_fields_as_json(record), "type": record.type}
        assert events.decode(encoded) == record
    record = events.Metrics.point(0, 1, {"loss": 1.0}, 2.0)
    encoded = events.encode(record)
    assert encoded["values"] == [[1.0]] and encoded["values"][0] is not record.values[0]  # copies
