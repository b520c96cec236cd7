"""System metrics per rank: the sampler on real processes, the run state's samples and step
times, real local and Spark runs, and a rank the kernel's OOM killer ends, explained.

The GPU half runs against a fake ``GpuSource`` here (this machine has no GPU); the real NVML
source is tested in ``test_gpu.py`` (marked ``gpu``)."""

import os
import signal
import subprocess
import sys
import textwrap
import uuid

import cloudpickle
import pytest

from helpers import alive, assert_no_survivors, touch, wait_until
from torchdist_magic import Distributor, LaunchOptions, RankFailure
from torchdist_magic.core import events, timing
from torchdist_magic.launch import sysmetrics
from torchdist_magic.core.job import function_job
from torchdist_magic.launch.launcher import RankProcess
from torchdist_magic.core.options import OptionTypeError
from torchdist_magic.core.flags import FlagError, options_from_flags, parse_flags
from torchdist_magic.driver.state import RunState
from torchdist_magic.driver.stragglers import SLOW_FOR, Pace, Straggler

GIB = 1 << 30


class FakeGpuSource:
    """A ``GpuSource`` that answers with fixed numbers per device, and notes what it was asked."""

    def __init__(self, used=3 * GIB, total=16 * GIB, util=87.0):
        self.used, self.total, self.util = used, total, util
        self.asked = []
        self.closed = False

    def sample(self, device_indices):
        self.asked.append(list(device_indices))
        n = len(device_indices)
        return {
            "gpu_memory_used_bytes": float(self.used * n),
            "gpu_memory_total_bytes": float(self.total * n),
            "gpu_util_percent": self.util,
        }

    def close(self):
        self.closed = True


# -- the sampler, on real processes -----------------------------------------------------------

BURN = textwrap.dedent("""
    import sys, time
    held = b"x" * (64 << 20)          # touched: resident
    print("up", flush=True)
    end = time.monotonic() + 600
    while time.monotonic() < end:
        pass
""")


@pytest.fixture
def burner():
    proc = subprocess.Popen([sys.executable, "-c", BURN], start_new_session=True, stdout=subprocess.PIPE)
    proc.stdout.readline()
    yield proc
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the test ended it
        pass
    proc.wait()
    assert not alive(proc.pid)


def test_a_sample_has_the_group_s_cpu_and_memory_and_the_host_s(burner):
    sampler = sysmetrics.RankSampler(burner.pid)
    sample = wait_until(lambda: (s := sampler.sample())["cpu_percent"] > 0 and s, 30, "some CPU time")
    assert sample["rss_bytes"] >= 64 << 20
    available, total = sysmetrics.host_memory()
    assert 0 < sample["host_memory_available_bytes"] <= sample["host_memory_total_bytes"] == total
    assert 0 < sample["memory_limit_bytes"] <= total
    assert not any(k.startswith("gpu_") for k in sample)
    assert sampler.last == sample


def test_a_sample_with_a_gpu_source_has_the_rank_s_devices(burner):
    source = FakeGpuSource()
    sample = sysmetrics.RankSampler(burner.pid, gpu=(source, ["2", "3"])).sample()
    assert source.asked == [["2", "3"]]
    assert sample["gpu_memory_used_bytes"] == 6 * GIB and sample["gpu_memory_total_bytes"] == 32 * GIB
    assert sample["gpu_util_percent"] == 87.0


def test_a_group_that_is_gone_samples_as_nothing_and_keeps_its_last_sample(burner):
    sampler = sysmetrics.RankSampler(burner.pid)
    last = sampler.sample()
    os.killpg(burner.pid, signal.SIGKILL)
    burner.wait()
    assert sampler.sample() == {}
    assert sampler.last == last


def test_a_process_with_less_memory_than_an_interpreter_samples_as_nothing(burner, monkeypatch):
    """The first sample is taken as the rank's process starts: caught in exec (``/proc`` as it
    reads then, 400 KiB resident), it would show a finished short rank as ``rss 0 MiB``."""
    sampler = sysmetrics.RankSampler(burner.pid)
    monkeypatch.setattr(sysmetrics, "_group_usage", lambda pgid: {pgid: (3, 400 << 10)})
    assert sampler.sample() == {} and sampler.last == {}
    monkeypatch.undo()
    last = sampler.sample()
    assert last["rss_bytes"] >= sysmetrics.MIN_PROCESS_RSS and sampler.last == last


# -- what a SIGKILL says ----------------------------------------------------------------------


def _sampled(**values):
    sampler = sysmetrics.RankSampler(os.getpid())
    sampler.last = {
        "cpu_percent": 1.0,
        "rss_bytes": 0.0,
        "host_memory_available_bytes": 20 * GIB,
        "host_memory_total_bytes": 24 * GIB,
        "memory_limit_bytes": 24 * GIB,
        **values,
    }
    return sampler


def test_a_sigkill_near_the_limit_is_probably_out_of_memory():
    sampler = _sampled(rss_bytes=11.8 * GIB, memory_limit_bytes=12 * GIB)
    why = sampler.explain_kill(-signal.SIGKILL)
    assert why == "probably out of memory: RSS 11.8 GiB of 12.0 GiB (its cgroup's limit)"
    failure = events.Failure(rank=3, exit_code=-9, message=why)
    assert failure.summary() == (
        "rank 3 was killed (SIGKILL), probably out of memory: RSS 11.8 GiB of 12.0 GiB (its cgroup's limit)"
    )


def test_a_sigkill_near_the_machines_memory_without_a_cgroup_limit_says_so():
    why = _sampled(rss_bytes=23.8 * GIB).explain_kill(-signal.SIGKILL)  # the limit is the machine's 24 GiB
    assert why == "probably out of memory: RSS 23.8 GiB of 24.0 GiB (the machine's memory)"


def test_a_sigkill_when_the_machine_was_full_is_probably_out_of_memory():
    why = _sampled(rss_bytes=2 * GIB, host_memory_available_bytes=0.5 * GIB).explain_kill(-signal.SIGKILL)
    assert why == "probably out of memory: the machine had 0.5 GiB of 24.0 GiB available (RSS 2 GiB)"


def test_other_ends_are_not_explained_by_memory():
    assert _sampled(rss_bytes=2 * GIB).explain_kill(-signal.SIGKILL) == ""
    assert _sampled(rss_bytes=11.9 * GIB, memory_limit_bytes=12 * GIB).explain_kill(-signal.SIGTERM) == ""
    assert _sampled(rss_bytes=11.9 * GIB, memory_limit_bytes=12 * GIB).explain_kill(1) == ""
    assert sysmetrics.RankSampler(os.getpid()).explain_kill(-signal.SIGKILL) == ""  # never sampled
    assert events.Failure(rank=1, exit_code=-9).summary() == "rank 1 was killed by SIGKILL"


def test_a_cuda_out_of_memory_message_gets_the_device_memory():
    sample = {"gpu_memory_used_bytes": 15.5 * GIB, "gpu_memory_total_bytes": 16 * GIB}
    assert sysmetrics.explain_cuda_oom("CUDA out of memory.", sample) == (
        "CUDA out of memory. [device memory when last sampled: 15.5 GiB of 16.0 GiB used]"
    )
    assert sysmetrics.explain_cuda_oom("CUDA out of memory.", {"rss_bytes": 1.0}) == "CUDA out of memory."
    assert sysmetrics.is_cuda_oom("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB")
    assert sysmetrics.is_cuda_oom("RuntimeError", "CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not sysmetrics.is_cuda_oom("RuntimeError", "shape mismatch")


def raise_cuda_out_of_memory(marker=None):
    import os
    import time

    import torch

    while marker is not None and not os.path.exists(marker):  # a rank that ran a while
        time.sleep(0.01)
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_rank_s_cuda_out_of_memory_error_shows_its_device_memory(tmp_path):
    """A real worker raises torch's own ``OutOfMemoryError``; its launcher samples the GPU named by
    the rank's ``CUDA_VISIBLE_DEVICES`` through a fake NVML source (no GPU here)."""
    job_file = tmp_path / "job.pkl"
    marker = tmp_path / "sampled"
    job_file.write_bytes(cloudpickle.dumps(function_job(raise_cuda_out_of_memory, (str(marker),), {})))
    got = []
    source = FakeGpuSource(used=int(15.5 * GIB))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHDIST_")}
    env.update(CUDA_VISIBLE_DEVICES="1", TORCHDIST_RUN_ID=uuid.uuid4().hex)
    proc = RankProcess(0, str(job_file), str(tmp_path / "rank-0"), env, got.append, gpu_source=source)
    # the rank fails once its launcher has sampled it (on a busy machine a rank that fails at
    # once may end before its first sample: then its error has nothing to add)
    wait_until(lambda: any(isinstance(e, events.SystemMetrics) for e in got), 120, "the rank's first sample")
    marker.write_text("")
    wait_until(proc.exited.is_set, 120, "the rank's exit")
    assert not alive(proc.pgid)
    (exit_record,) = [e for e in got if isinstance(e, events.Exit)]
    assert exit_record.failure.exc_type == "OutOfMemoryError"
    assert exit_record.failure.message == (
        "CUDA out of memory. Tried to allocate 2.00 GiB [device memory when last sampled: 15.5 GiB of 16.0 GiB used]"
    )
    samples = [e for e in got if isinstance(e, events.SystemMetrics)]
    assert samples and samples[0].values["gpu_util_percent"] == 87.0
    assert source.asked[0] == ["1"]


# -- a rank the kernel's OOM killer ends ------------------------------------------------------


@pytest.fixture
def memory_cgroup():
    """A memory cgroup of 256 MiB below this process's own (cgroup v1's memory hierarchy, as
    this machine has it, or v2 where its memory controller is delegated); skipped where none can
    be made (not root, a read-only /sys/fs/cgroup).  Removed afterwards."""
    own = sysmetrics.memory_cgroup(os.getpid())
    if own is None:
        pytest.skip("this process has no memory cgroup that this machine shows")
    path = os.path.join(own, f"torchdist-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
        limit_file = (
            "memory.limit_in_bytes" if os.path.exists(os.path.join(path, "memory.limit_in_bytes")) else "memory.max"
        )
        with open(os.path.join(path, limit_file), "w") as fh:
            fh.write(str(256 << 20))
        for swap in ("memory.memsw.limit_in_bytes", "memory.swap.max"):  # no swap to escape to
            if os.path.exists(os.path.join(path, swap)):
                with open(os.path.join(path, swap), "w") as fh:
                    fh.write(str(256 << 20) if swap.endswith("bytes") else "0")
    except OSError as exc:
        if os.path.isdir(path):
            os.rmdir(path)
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    yield path
    wait_until(lambda: not open(os.path.join(path, "cgroup.procs")).read().strip(), 10, "the cgroup to empty")
    os.rmdir(path)


def allocate_until_killed(cgroup, go):
    """Join ``cgroup`` (as a rank in a memory-limited container is), wait until the test saw the
    launcher's sampler see it there (``go``), then allocate touched memory in steps until the
    kernel ends us."""
    import os
    import time

    with open(os.path.join(cgroup, "cgroup.procs"), "w") as fh:
        fh.write(str(os.getpid()))
    while not os.path.exists(go):
        time.sleep(0.02)
    held = []
    while True:
        held.append(b"x" * (8 << 20))
        time.sleep(0.01)


def test_a_rank_the_oom_killer_ends_is_reported_as_out_of_memory(
    local_distributor, memory_cgroup, monkeypatch, tmp_path
):
    """Honest and real: the kernel's own OOM killer, in a memory cgroup of 256 MiB that the rank
    joins (the test makes it; no limit of this package's).  The rank starts allocating once a
    sample of the launcher's has the cgroup's limit."""
    monkeypatch.setattr(timing, "SYSTEM_METRICS_INTERVAL", 0.1)
    run = local_distributor(1).submit(allocate_until_killed, memory_cgroup, str(tmp_path / "go"))
    wait_until(
        lambda: run.state.snapshot().ranks[0].system.get("memory_limit_bytes") == 256 << 20,
        60,
        "a sample of the rank in its cgroup",
    )
    touch(str(tmp_path / "go"))
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    failure = info.value.failure
    assert failure.exit_code == -signal.SIGKILL
    summary = failure.summary()
    assert summary.startswith(f"rank 0 on {failure.host} was killed (SIGKILL), probably out of memory: RSS ")
    assert " of 0.25 GiB" in summary and "the kernel's OOM killer fired in its cgroup" in summary
    assert str(info.value) == f"RankFailure: {summary}"
    assert run.state.ranks[0].system["rss_bytes"] > 0
    assert_no_survivors(run)


def ignores_sigterm(path):
    import os
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stop ends it with SIGKILL
    print("ignoring SIGTERM", flush=True)
    while not os.path.exists(path):
        time.sleep(0.02)


def test_a_rank_that_is_stopped_is_not_called_out_of_memory(tmp_path, monkeypatch):
    """A stop that ends in SIGKILL (the rank ignores SIGTERM) while every sample says the
    machine's memory is nearly full (forced: any share of it is "nearly full") is a stop, not an
    out-of-memory kill; the same kill unasked is called one."""
    from torchdist_magic.launch.launcher import stop_all

    monkeypatch.setattr(sysmetrics, "HOST_NEARLY_FULL", 2.0)
    monkeypatch.setattr(timing, "SYSTEM_METRICS_INTERVAL", 0.1)
    job_file = tmp_path / "job.pkl"
    job_file.write_bytes(cloudpickle.dumps(function_job(ignores_sigterm, (str(tmp_path / "go"),), {})))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHDIST_")}
    exits = {}
    for stopped in (True, False):
        got = []
        env.update(TORCHDIST_RUN_ID=uuid.uuid4().hex)
        proc = RankProcess(0, str(job_file), str(tmp_path / f"rank-{stopped}"), env, got.append)
        wait_until(
            lambda: (
                any(isinstance(e, events.SystemMetrics) for e in got)  # noqa: B023
                and any(isinstance(e, events.Log) and "ignoring SIGTERM" in [o.line for o in e.lines()] for e in got)  # noqa: B023
            ),
            120,
            "a sample of the rank, ignoring SIGTERM",
        )
        if stopped:
            stop_all([proc], 0.5)
        else:
            proc.signal_group(signal.SIGKILL, "a test, as the OOM killer would")
        wait_until(proc.exited.is_set, 60, "the rank's exit")
        assert not alive(proc.pgid)
        (exits[stopped],) = [e for e in got if isinstance(e, events.Exit)]
    assert exits[True].code == -signal.SIGKILL and exits[True].stopped
    assert "memory" not in exits[True].failure.summary()
    assert exits[False].failure.message.startswith("probably out of memory: the machine had ")


def wait_for_file(path):
    import os
    import time

    from torchdist_magic import rank

    while not os.path.exists(path):
        time.sleep(0.02)
    return rank()


def test_a_local_run_has_each_rank_s_system_metrics_while_live_and_after(local_distributor, tmp_path):
    run = local_distributor(2).submit(wait_for_file, str(tmp_path / "go"))

    def sampled():
        snap = run.state.snapshot()
        return snap if all(r.system for r in snap.ranks) else None

    live = wait_until(sampled, 60, "every rank's first sample")
    assert run.state.ended is None
    for r in (0, 1):
        system = live.ranks[r].system
        assert {"time", "cpu_percent", "rss_bytes", "host_memory_available_bytes", "host_memory_total_bytes"} <= set(
            system
        )
    # sampling goes on while the rank lives: a later sample of each rank, with every field
    wait_until(
        lambda: all(run.state.ranks[r].system["time"] > live.ranks[r].system["time"] for r in (0, 1)),
        60,
        "a second sample of every rank",
    )
    for r in (0, 1):
        assert set(live.ranks[r].system) <= set(run.state.ranks[r].system)
    touch(str(tmp_path / "go"))
    assert run.result(timeout=60) == 0
    for r in (0, 1):
        assert run.state.ranks[r].system["cpu_percent"] >= 0
        history = run.state.system_history(r)
        assert history and {"time", "cpu_percent", "rss_bytes"} <= set(history[-1])
    assert_no_survivors(run)


def test_system_metrics_off_gives_none(local_distributor):
    run = local_distributor(2, system_metrics=False).submit(os.getpid)
    run.result(timeout=60)
    assert [r.system for r in run.state.ranks] == [{}, {}]
    assert run.state.system_history(0) == []
    assert_no_survivors(run)


@pytest.mark.spark
def test_a_spark_run_has_each_rank_s_system_metrics(spark_local2, tmp_path):
    # the ranks wait until every one was sampled: a rank that ends before its launcher's first
    # sample has none (an exiting rank's sample is skipped), and how soon that is depends on the load
    run = Distributor(2, local_mode=False, show=None).submit(wait_for_file, str(tmp_path / "go"))
    try:
        wait_until(lambda: all(rs.system for rs in run.state.snapshot().ranks), 120, "every rank's first sample")
    finally:
        touch(str(tmp_path / "go"))
    assert run.result(timeout=180) == 0
    for r in (0, 1):
        assert {"time", "cpu_percent", "rss_bytes", "host_memory_available_bytes"} <= set(run.state.ranks[r].system)
    assert_no_survivors(run)


# -- options ----------------------------------------------------------------------------------


def test_system_metrics_is_on_by_default_and_a_flag_turns_it_off():
    assert LaunchOptions().system_metrics is True
    assert options_from_flags(parse_flags("--no-system-metrics"), LaunchOptions()).system_metrics is False
    assert options_from_flags(parse_flags("--system-metrics"), LaunchOptions(system_metrics=False)).system_metrics
    assert options_from_flags(parse_flags(""), LaunchOptions(system_metrics=False)).system_metrics is False
    with pytest.raises(FlagError, match="--system-metrics and --no-system-metrics contradict each other"):
        parse_flags("--system-metrics --no-system-metrics")
    with pytest.raises(OptionTypeError, match="system_metrics must be True or False, got 'yes'"):
        LaunchOptions(system_metrics="yes")
    with pytest.raises(OptionTypeError, match="system_metrics must be True or False, got None"):
        Distributor(1, system_metrics=None)


# -- the run state ----------------------------------------------------------------------------


def _system(rank, t, **values):
    return events.SystemMetrics(rank=rank, values={"cpu_percent": 50.0, "rss_bytes": 1e9, **values}, time=t)


def test_the_state_keeps_the_latest_sample_and_a_bounded_history():
    state = RunState("r", 2)
    state.apply(_system(0, 10.0, host_memory_available_bytes=5e9))
    state.apply(events.SystemMetrics(rank=0, values={"torch_max_allocated_bytes": 7e8}, time=11.0))
    assert state.ranks[0].system == {
        "cpu_percent": 50.0,
        "rss_bytes": 1e9,
        "host_memory_available_bytes": 5e9,
        "torch_max_allocated_bytes": 7e8,
        "time": 11.0,
    }
    assert state.snapshot().ranks[0].system == state.ranks[0].system
    assert state.snapshot().ranks[1].system == {}
    assert state.system_history(0) == [{"time": 10.0, "cpu_percent": 50.0, "rss_bytes": 1e9}]
    for i in range(3 * state.max_system_points):
        state.apply(_system(1, 100.0 + i, gpu_memory_used_bytes=float(i)))
    history = state.system_history(1)
    assert len(history) <= state.max_system_points
    assert history[0]["time"] == 100.0 and history[-1]["time"] == 100.0 + 3 * state.max_system_points - 1
    assert len(state.system_history(1, points=10)) <= 11
    state.restart()
    assert state.ranks[0].system == {} and state.system_history(0) == []


def test_samples_are_no_sign_of_a_rank_s_life():
    state = RunState("r", 1)
    before = state.last_activity
    state.apply(_system(0, 1.0))
    assert state.last_activity == before
    assert state.snapshot().quiet == (None,)


def _progress(rank, n, elapsed, bar="b1", desc="batch", state="running"):
    return events.Progress(rank=rank, bar=bar, desc=desc, n=n, total=100, elapsed=elapsed, state=state)


def test_step_time_is_the_innermost_running_bar_s_average():
    state = RunState("r", 1)
    state.apply(_progress(0, 0, 0.0, bar="e", desc="epoch"))
    assert state.ranks[0].step_time is None
    state.apply(_progress(0, 4, 2.0))
    assert state.ranks[0].step_time == 0.5
    state.apply(_progress(0, 6, 3.0))  # 0.5 s/step again
    assert state.ranks[0].step_time == pytest.approx(0.5)
    state.apply(_progress(0, 7, 7.0))  # 4 s for the 7th step: 1 s/step over the bar
    assert state.ranks[0].step_time == pytest.approx(1.0)
    assert state.snapshot().ranks[0].step_time == state.ranks[0].step_time
    state.apply(_progress(0, 100, 9.0, state="done"))
    state.apply(_progress(0, 1, 9.0, bar="e", desc="epoch", state="done"))
    assert state.ranks[0].step_time is None


def test_a_rank_whose_step_time_is_well_above_the_median_is_a_straggler():
    now = [0.0]
    pace = Pace(4, lambda: now[0])
    for t in range(0, int(SLOW_FOR) + 2):
        now[0] = float(t)
        for r in range(4):
            pace.step_time(r, 0.9 if r == 2 else 0.3, "batch")
        pace.check()
    assert pace.stragglers(["h"] * 4) == [
        Straggler(2, "h", f"900 ms/step against a median of 300 ms/step (batch), for {int(SLOW_FOR) + 1} s")
    ]
    for r in range(4):  # its bar ended: not compared any more, still listed
        pace.step_time(r, None, "batch")
    pace.check()
    assert [s.rank for s in pace.stragglers(["h"] * 4)] == [2]


# -- the view ---------------------------------------------------------------------------------


def _sampled_state(ranks):
    state = RunState("v", ranks)
    for r in range(ranks):
        state.apply(events.Started(rank=r, host=f"node-{r // 8}", pid=100 + r))
        state.apply(
            events.SystemMetrics(
                rank=r,
                time=state.started + 2.0,
                values={
                    "cpu_percent": 150.0,
                    "rss_bytes": float((r + 1) * GIB),
                    "host_memory_available_bytes": 8e9,
                    "gpu_memory_used_bytes": 3.0 * GIB,
                    "gpu_memory_total_bytes": 16.0 * GIB,
                    "gpu_util_percent": 87.0,
                },
            )
        )
        state.apply(_progress(r, 10, 5.0 * (r + 1)))
    return state


def test_the_small_view_shows_each_rank_s_system_metrics_and_plots_them():
    from torchdist_magic.view import html, model, text

    state = _sampled_state(2)
    rows = model.rank_rows(state)
    assert rows[0].system == "cpu 150% · rss 1 GiB · gpu 3 GiB/16 GiB 87% · 500 ms/step"
    assert rows[1].system == "cpu 150% · rss 2 GiB · gpu 3 GiB/16 GiB 87% · 1 s/step"
    assert rows[0].system in text.summary(state)
    table = html.rows_html(rows)
    assert table.count('class="torchdist-system"') == 2 and ">system</span>" in table
    series = model.system_series(state)
    assert series["rss (GiB)"] == {0: [(2.0, 1.0)], 1: [(2.0, 2.0)]}
    assert series["cpu %"][1] == [(2.0, 150.0)]
    assert "rss (GiB)" in html.summary_html(state)


def test_a_rank_without_samples_has_no_system_column():
    from torchdist_magic.view import html, model

    state = RunState("v", 2)
    rows = model.rank_rows(state)
    assert [r.system for r in rows] == ["", ""] and ">system</span>" not in html.rows_html(rows)


def test_the_large_view_aggregates_system_metrics_with_the_extremes_named():
    from torchdist_magic.driver import summary as overview
    from torchdist_magic.view import html, text

    state = _sampled_state(64)
    ov = overview.overview(state)
    by_key = {item.key: item for item in ov.system}
    assert by_key["rss_bytes"].text == "rss: min 1 GiB (rank 0), median 32.5 GiB, max 64 GiB (rank 63), 64 ranks"
    assert by_key["step_time"].text == (
        "step time: min 500 ms/step (rank 0), median 16.2 s/step, max 32 s/step (rank 63), 64 ranks"
    )
    assert by_key["cpu_percent"].ranks == 64 and by_key["gpu_memory_used_bytes"].high == 3.0 * GIB
    assert by_key["rss_bytes"].text in html.overview_html(ov)
    assert by_key["rss_bytes"].text in text.status(state)
    assert by_key["cpu_percent"].text in text.summary(state)


def test_a_launcher_samples_the_device_its_rank_trains_on():
    """``rank.device()`` is ``cuda:LOCAL_RANK`` of the GPUs the rank sees (a Spark task sees its
    host's other GPUs after its own; a local rank every GPU): that one is sampled, not all."""
    from torchdist_magic.launch.gpu_metrics import rank_device

    assert rank_device({}) == ["0"] and rank_device({"LOCAL_RANK": "2"}) == ["2"]
    assert rank_device({"CUDA_VISIBLE_DEVICES": "3,2", "LOCAL_RANK": "1"}) == ["2"]
    assert rank_device({"CUDA_VISIBLE_DEVICES": "GPU-ab,GPU-cd", "LOCAL_RANK": "0"}) == ["GPU-ab"]
    assert rank_device({"CUDA_VISIBLE_DEVICES": "", "LOCAL_RANK": "0"}) == []  # a run without GPUs
