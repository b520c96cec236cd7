"""``--profile STEPS``: torch.profiler on every rank for the same steps, every rank's trace back
over the run's channel and merged into one Chrome trace, one process per rank, with a summary per
rank (top operators, step split, peak memory).  The merge and the rank's profiler in this
process, then real runs of 2 DDP ranks on local processes and on Spark ``local[2]``."""

import json
import os
import socket

import pytest

from helpers import assert_no_survivors
from test_stepsplit import ddp_train
from torchdist_magic import Distributor
from torchdist_magic.core import events
from torchdist_magic.core.options import LaunchOptions, OptionError
from torchdist_magic.core.flags import options_from_flags, parse_flags
from torchdist_magic.rank import profile as rankprofile
from torchdist_magic.driver.profiles import ProfileCollector, merge_traces
from torchdist_magic.view.text import summary


def test_profile_is_a_number_of_steps_from_a_flag_or_a_keyword():
    assert LaunchOptions().profile == 0
    assert options_from_flags(parse_flags("--profile 5"), LaunchOptions()).profile == 5
    with pytest.raises(OptionError, match="profile must be a whole number, got 'many'"):
        LaunchOptions(profile="many")
    with pytest.raises(OptionError, match="profile must be at least 0, got -1"):
        Distributor(2, profile=-1)


def test_a_warm_run_cannot_be_profiled():
    with pytest.raises(
        ValueError,
        match=r"a warm run cannot be profiled \(--profile\): the pool's ranks were "
        "started without a profiler; run it without --warm/warm=True",
    ):
        Distributor(2, local_mode=True, show=None, warm=True, profile=3).submit(os.getpid)


def _trace(tmp_path, name, base_ns, events_):
    path = tmp_path / name
    path.write_text(json.dumps({"baseTimeNanoseconds": base_ns, "traceEvents": events_}))
    return str(path)


def test_traces_merge_into_one_process_per_rank_on_one_clock(tmp_path):
    own_name = {"ph": "M", "name": "process_name", "pid": 77, "tid": 0, "args": {"name": "python"}}
    rank0 = _trace(
        tmp_path,
        "0.json",
        1_000_000_000,
        [
            own_name,
            {"ph": "X", "name": "aten::mm", "pid": 77, "tid": 5, "ts": 10.0, "dur": 3.0},
            {"ph": "s", "id": 4, "name": "flow", "pid": 77, "tid": 5, "ts": 11.0},
        ],
    )
    rank1 = _trace(
        tmp_path,
        "1.json",
        1_000_002_000,
        [  # its clock's base 2 us later
            own_name,
            {"ph": "X", "name": "aten::mm", "pid": 88, "tid": 6, "ts": 10.0, "dur": 3.0},
            {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": 20.0},
        ],
    )
    out = str(tmp_path / "trace.json")
    merge_traces({1: rank1, 0: rank0}, out)
    with open(out) as fh:
        merged = json.load(fh)
    assert merged["baseTimeNanoseconds"] == 1_000_000_000
    trace = merged["traceEvents"]
    names = [(e["pid"], e["args"]["name"]) for e in trace if e["name"] == "process_name"]
    assert names == [(0, "rank 0"), (1, "rank 1")]  # the ranks' own process names are gone
    mm = [(e["pid"], e["ts"]) for e in trace if e["name"] == "aten::mm"]
    assert mm == [(0, 10.0), (1, 12.0)]
    assert [e["id"] for e in trace if e.get("ph") == "s"] == ["0:4"]
    assert {e["pid"] for e in trace} == {0, 1}


def test_a_collector_waits_for_every_rank_then_merges_once(tmp_path):
    collector = ProfileCollector(lambda: str(tmp_path), [0, 1])
    assert collector.profile() is None
    text = json.dumps(
        {"baseTimeNanoseconds": 5, "traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}]}
    )
    for r in (0, 1):
        collector.take(events.ProfilePiece(rank=r, data=text[:20]))
        collector.take(events.ProfilePiece(rank=r, data=text[20:]))
    collector.take(
        events.ProfileDone(
            rank=0, steps=3, size=len(text), peak_memory_bytes=2.0**30, top=[events.ProfileOp("aten::mm", 0.0412, 12)]
        )
    )
    waiting = collector.profile({0: {"data": 0.62, "compute": 0.35, "comm": 0.03}})
    assert waiting.trace_path == "" and waiting.waiting == [1]
    assert waiting.lines() == [
        "profile: waiting for rank 1",
        "rank 0: 3 steps · data 62% compute 35% comm 3% · peak memory 1 GiB · top: aten::mm 41.2 ms (12)",
    ]
    collector.take(events.ProfileDone(rank=1, steps=3, size=len(text), kept_at="", error=""))
    done = collector.profile()
    assert done.trace_path == str(tmp_path / "trace.json") and done.waiting == []
    assert collector.profile().trace_path == done.trace_path
    assert done.lines()[0] == f"profile: {done.trace_path} (Perfetto, chrome://tracing)"


@pytest.fixture(autouse=True)
def _torch_cache(tmp_path, monkeypatch):
    """torch's profiler makes torch's compile cache directory: in the test's own directory."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch-cache"))


def _profile_in_this_process(steps=3):
    import torch

    sent = []
    profiler = rankprofile.StepProfiler(steps, sent.append, lambda: 0)
    for _ in range(steps + 2):
        profiler.step()
        torch.ones(16, 16) @ torch.ones(16, 16)
    profiler.finish()
    return sent


def test_a_trace_too_large_to_send_stays_where_the_rank_ran(monkeypatch, tmp_path):
    monkeypatch.setattr(rankprofile, "MAX_TRACE_CHARS", 10)
    *pieces, done = _profile_in_this_process()
    assert pieces == [] and isinstance(done, events.ProfileDone) and done.steps == 3
    host, path = done.kept_at.split(":", 1)
    assert host == socket.gethostname() and os.path.getsize(path) == done.size > 10
    os.remove(path)
    collector = ProfileCollector(lambda: str(tmp_path), [0])
    collector.take(done)
    profile = collector.profile()
    assert profile.trace_path == "" and profile.lines()[1].endswith(
        f" · trace too large to send, kept at {done.kept_at}"
    )


def test_a_profiler_that_fails_says_why_in_the_summary(monkeypatch, tmp_path):
    import torch.profiler

    def no_profiler(**kwargs):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(torch.profiler, "profile", no_profiler)
    (done,) = _profile_in_this_process()
    assert done.error == "RuntimeError: no profiler here"
    collector = ProfileCollector(lambda: str(tmp_path), [0])
    collector.take(done)
    profile = collector.profile()
    assert profile.trace_path == "" and profile.lines()[1] == "rank 0: no profile: RuntimeError: no profiler here"


def test_real_ranks_profile_the_same_steps_into_one_trace():
    run = Distributor(2, local_mode=True, show=None, profile=3).submit(ddp_train, "data", 10)
    assert run.result(timeout=180) == 0
    profile = run.profile
    assert profile.waiting == [] and os.path.dirname(profile.trace_path).startswith(run.directory.path())
    with open(profile.trace_path) as fh:
        trace = json.load(fh)["traceEvents"]
    assert [(e["pid"], e["args"]["name"]) for e in trace if e["name"] == "process_name"] == [
        (0, "rank 0"),
        (1, "rank 1"),
    ]
    for r in (0, 1):
        assert any(e["pid"] == r and e["name"] == "c10d::allreduce_" for e in trace), r  # DDP's, on both ranks
        rank = profile.summary[r]
        assert rank.steps == 3 and rank.top and rank.peak_memory_bytes > 0 and rank.step_split
    # rank 1 waits for its data loader: its top operator is the loader's next batch
    assert "DataLoader" in profile.summary[1].top[0].name
    text = summary(run.state)
    assert f"  profile: {profile.trace_path} (Perfetto, chrome://tracing)" in text.splitlines()
    assert "  rank 1: 3 steps · data " in text
    assert_no_survivors(run)
    directory = run.directory.path()
    del run, profile
    _forget_runs()
    assert not os.path.exists(directory)  # the run's directory, its profile in it, goes with the run


def _forget_runs():
    """Drop the module's reference to the latest run and collect it (and its directory)."""
    import gc

    import torchdist_magic.driver.distributor as distributor

    distributor._last_run = None
    gc.collect()


@pytest.mark.spark
def test_spark_ranks_send_their_traces_to_the_notebook(spark_local2):
    from helpers import assert_nothing_left

    run = Distributor(2, local_mode=False, show=None, profile=3).submit(ddp_train, "data", 10)
    assert run.result(timeout=300) == 0
    profile = run.profile
    with open(profile.trace_path) as fh:
        trace = json.load(fh)["traceEvents"]
    assert {e["pid"] for e in trace} == {0, 1} and all(profile.summary[r].steps == 3 for r in (0, 1))
    assert_nothing_left(run)
    del run, profile
    _forget_runs()


def steps_until_told(marks, steps):
    """A loop of at most ``steps`` steps of 20 ms that says when it is under way and ends once
    the test leaves ``done`` in ``marks`` (``profiled``)."""
    import time

    from torchdist_magic import progress, rank

    for i in progress(range(steps), desc="step"):
        if i == 5:
            open(os.path.join(marks, f"stepping-{rank()}"), "w").close()
        if os.path.exists(os.path.join(marks, "done")):
            break
        time.sleep(0.02)
    return rank()


def profiled(run, marks):
    """Wait until every rank's profile has come, then tell ``steps_until_told`` to end."""
    from helpers import wait_until

    wait_until(lambda: run.profile is not None and not run.profile.waiting, 120, "every rank's profile")
    open(os.path.join(marks, "done"), "w").close()


def test_the_profile_button_profiles_a_running_job_and_the_view_shows_it(tmp_path):
    from helpers import wait_until
    from torchdist_magic.view import widget as W

    run = Distributor(2, local_mode=True, show=None).submit(steps_until_told, str(tmp_path), 400)
    view = W.WidgetView(run, display=False)
    assert "torchdist-profile" in view.profile_button._dom_classes and view.profile_button.layout.display == ""
    wait_until(lambda: all((tmp_path / f"stepping-{r}").exists() for r in (0, 1)), 120, "both ranks stepping")
    view.profile_button.click()
    assert view.profile_button.disabled and view.profile_button.description == "Profiling…"
    profiled(run, str(tmp_path))
    assert run.result(timeout=180) == 0
    profile = run.profile
    assert profile.waiting == [] and all(profile.summary[r].steps == W.PROFILE_STEPS for r in (0, 1))
    view.update()
    view.close()
    assert profile.trace_path in view.profile_note.value and "rank 1: 5 steps" in view.profile_note.value
    assert view.profile_button.layout.display == "none"  # the run is over
    with pytest.raises(RuntimeError, match=r"run \S+ is over: there are no steps to profile"):
        run.start_profile(3)
    with pytest.raises(ValueError, match="start_profile: steps must be a whole number of at least 1, got 0"):
        run.start_profile(0)
    assert_no_survivors(run)
    import ipywidgets

    ipywidgets.Widget.close_all()  # the registry of live widgets holds the view, and the view its run
    del run, profile, view
    _forget_runs()


def test_a_profile_button_pressed_after_the_run_ended_says_so(tmp_path):
    from torchdist_magic.view import widget as W

    run = Distributor(1, local_mode=True, show=None).submit(os.getpid)
    run.result(timeout=120)
    view = W.WidgetView(run, display=False)
    view._on_profile()
    assert f"run {run.run_id} is over: there are no steps to profile" in view.profile_note.value
    view.close()
    assert_no_survivors(run)


@pytest.mark.spark
def test_spark_ranks_profile_a_running_job_when_asked(spark_local2, tmp_path):
    from helpers import assert_nothing_left, wait_until

    run = Distributor(2, local_mode=False, show=None).submit(steps_until_told, str(tmp_path), 400)
    wait_until(lambda: all((tmp_path / f"stepping-{r}").exists() for r in (0, 1)), 180, "both ranks stepping")
    run.start_profile(3)
    profiled(run, str(tmp_path))
    assert run.result(timeout=300) == 0
    profile = run.profile
    assert profile.waiting == [] and all(profile.summary[r].steps == 3 for r in (0, 1)) and profile.trace_path
    assert_nothing_left(run)
    del run, profile
    _forget_runs()


@pytest.mark.spark
def test_spark_connect_ranks_split_their_steps_and_send_their_profiles(spark_connect):
    from helpers import assert_nothing_left

    run = Distributor(2, local_mode=False, show=None, profile=3).submit(ddp_train, "data", 120)
    assert run.result(timeout=300) == 0
    splits = [rs.step_split for rs in run.state.ranks]
    assert splits[1]["data"] > 0.5 and splits[0]["comm"] > 0.5, splits
    profile = run.profile
    assert profile.trace_path and all(profile.summary[r].steps == 3 for r in (0, 1))
    assert run.goodput["data_stall_s"] > 0
    assert_nothing_left(run)
    del run, profile
    _forget_runs()
