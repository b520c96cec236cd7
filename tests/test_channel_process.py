"""A run whose channel is off the kernel (``--channel process``, ``channel="process"``, and
``"auto"`` from ``PROCESS_CHANNEL_RANKS`` ranks): its supervising process receives and applies
the records, the cell waits, shows the run through the feed (``feed.HostedState``) and returns
rank 0's value; Ctrl-C stops the run.  Real processes, real sockets."""

import gc
import os
import signal
import threading

import pytest

import torchdist_magic
from torchdist_magic import Distributor, RankFailure
from torchdist_magic.core.options import PROCESS_CHANNEL_RANKS, LaunchOptions, OptionValueError
from torchdist_magic.handles import attach as attaching
from torchdist_magic.driver import history, layout
from torchdist_magic.handles.feed import HostedState

from helpers import alive, assert_nothing_survives, pids_of_run, touch, wait_until


def waits_for(marker):
    import os
    import time

    from torchdist_magic import rank

    print(f"rank {rank()} waiting", flush=True)
    while not os.path.exists(marker):
        time.sleep(0.05)
    return rank() * 10 + 7


def sleeps():
    import time

    print("sleeping", flush=True)
    time.sleep(600)


def fails_on_rank_1():
    from torchdist_magic import rank

    if rank() == 1:
        raise KeyError("no such shard")
    return 1


def test_the_cell_waits_for_a_run_whose_channel_is_in_a_process_of_its_own(home, tmp_path):
    marker = str(tmp_path / "go")
    run = Distributor(num_processes=2, local_mode=True, show=None, channel="process").submit(waits_for, marker)
    try:
        assert isinstance(run, attaching.AttachedRun) and isinstance(run.state, HostedState)
        wait_until(
            lambda: "rank 1 waiting" in run.logs(1) and "rank 0 waiting" in run.logs(0), 60, "the ranks to start"
        )
        # on a busy machine the ranks' output can be read before the record that marks a rank
        # running is applied
        wait_until(
            lambda: [rs.state for rs in run.state.snapshot().ranks] == ["running", "running"], 60, "both ranks running"
        )
        snap = run.state.snapshot()
        assert run.state.hosted and snap.num_processes == 2 and snap.state == "running"
        assert run.record.pid != os.getpid() and alive(run.record.pid)  # the records go there, not here
    except BaseException:
        run.cancel()
        raise
    finally:
        touch(marker)
    assert attaching.follow_attached(run, own=True) == 7
    record = history.read_record(run.run_id)
    assert record.state == "succeeded"
    assert_nothing_survives(run.run_id, run.record.pid)
    # once the supervising process has gone: the run's record (such a run keeps no journal)
    assert run.logs(0) == "rank 0 waiting\n" and not run.state.hosted
    assert run.state.state == "succeeded" and run.state.finished
    assert not os.path.exists(os.path.join(run.directory, layout.JOURNAL_FILE))


def test_run_returns_rank_0s_value_and_raises_a_ranks_failure(home):
    assert Distributor(num_processes=2, local_mode=True, show="text", channel="process").run(waits_for, "/") == 7
    with pytest.raises(RankFailure, match="KeyError"):
        Distributor(num_processes=2, local_mode=True, show=None, channel="process").run(fails_on_rank_1)
    failed = Distributor(num_processes=2, local_mode=True, show=None, channel="process").submit(fails_on_rank_1)
    assert failed.exception is None or failed.done()  # None while it runs
    assert failed.wait(120) and isinstance(failed.exception, RankFailure)  # as Run.exception (the panel reads it)
    for record in torchdist_magic.runs():
        assert_nothing_survives(record.run_id, record.pid)


def test_ctrl_c_stops_a_run_whose_channel_is_in_a_process_of_its_own(home):
    """The kernel's interrupt (SIGINT to this process's main thread) while the cell waits: every
    rank is stopped, as for a run in the kernel, and the interrupt goes on."""
    started = threading.Event()

    def interrupt_when_started():
        wait_until(lambda: any(pids_of_run(r.run_id) for r in torchdist_magic.runs()), 60, "the ranks to start")
        started.set()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        Distributor(num_processes=2, local_mode=True, show=None, channel="process").run(sleeps)
    assert started.is_set()
    [record] = torchdist_magic.runs()
    assert record.state == "cancelled" and record.failure.startswith("stopped by Ctrl-C")
    assert_nothing_survives(record.run_id, record.pid)


def test_ctrl_c_while_the_run_starts_stops_it_once_its_supervising_process_takes_requests(home):
    """The interrupt lands while the kernel waits for the supervising process to start the run
    (before any handle exists): the run is stopped all the same, never left running."""
    from torchdist_magic.driver import history
    from torchdist_magic.driver.layout import READY_FILE

    interrupted = []

    def interrupt_at_the_start():
        def starting():
            found = [r for r in history.runs() if r.pid > 0]
            return found and not os.path.exists(os.path.join(found[0].directory, READY_FILE))

        wait_until(starting, 60, "the supervising process to be started")
        interrupted.append(True)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_at_the_start, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        Distributor(num_processes=2, local_mode=True, show=None, channel="process").run(sleeps)
    assert interrupted
    [record] = torchdist_magic.runs()
    assert record.state == "cancelled" and record.failure.startswith("stopped by Ctrl-C")
    assert_nothing_survives(record.run_id, record.pid)


def test_the_magic_runs_a_cell_with_its_channel_in_a_process_of_its_own(home, ip, capsys):
    from IPython.core.error import UsageError

    from helpers import cell

    ip.user_ns["offset"] = 5
    assert cell(ip, "%%torchdist --np 2 --local --channel process\nrank * 10 + offset").result == 5
    run = ip.user_ns["_torchdist_run"]
    assert isinstance(run, attaching.AttachedRun) and "detached run" not in capsys.readouterr().out
    assert_nothing_survives(run.run_id, run.record.pid)
    with pytest.raises(UsageError, match="argument --channel: invalid choice: 'nowhere'"):
        cell(ip, "%%torchdist --np 1 --channel nowhere\n1").raise_error()


def test_auto_puts_large_runs_in_a_process_of_their_own_where_nothing_keeps_them_here():
    supervised = attaching.supervised
    assert supervised(LaunchOptions(num_processes=PROCESS_CHANNEL_RANKS, backend="local"))
    assert not supervised(LaunchOptions(num_processes=PROCESS_CHANNEL_RANKS - 1, backend="local"))
    assert not supervised(LaunchOptions(num_processes=PROCESS_CHANNEL_RANKS, backend="local", channel="kernel"))
    assert not supervised(LaunchOptions(num_processes=PROCESS_CHANNEL_RANKS, backend="local", warm=True))
    assert not supervised(LaunchOptions(num_processes=PROCESS_CHANNEL_RANKS, backend="local", pdb=True))
    assert not supervised(LaunchOptions(num_processes=PROCESS_CHANNEL_RANKS, backend="local"), data=[1])
    # a Spark run with no session: the kernel's path says so
    assert not supervised(LaunchOptions(num_processes=PROCESS_CHANNEL_RANKS, backend="spark"))
    assert supervised(LaunchOptions(num_processes=2, channel="process"))
    assert supervised(LaunchOptions(num_processes=2, detach=True))


def test_what_keeps_a_run_in_the_kernel_refuses_channel_process(home):
    pandas = pytest.importorskip("pandas")
    with pytest.raises(OptionValueError, match="channel must be one of 'auto', 'process', 'kernel', got 'x'"):
        LaunchOptions(channel="x")
    with pytest.raises(OptionValueError, match="a warm pool's ranks belong to this kernel"):
        LaunchOptions(channel="process", warm=True)
    with pytest.raises(OptionValueError, match="which a run whose channel is in a process of its own cannot reach"):
        LaunchOptions(channel="process", pdb=True)
    with pytest.raises(ValueError, match="--channel process cannot train on a DataFrame .*--channel kernel"):
        Distributor(num_processes=1, local_mode=True, show=None, channel="process").train_on_dataframe(
            sleeps, pandas.DataFrame({"x": [1.0, 2.0]})
        )
    assert torchdist_magic.runs() == []


@pytest.mark.spark
def test_classic_spark_that_only_the_notebook_can_use_keeps_the_channel_here(home, spark_local2, monkeypatch):
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    with pytest.raises(ValueError, match="--channel process cannot run here on classic Spark.*--channel kernel"):
        Distributor(num_processes=1, local_mode=False, show=None, channel="process").submit(sleeps)
    assert not attaching.supervised(LaunchOptions(num_processes=PROCESS_CHANNEL_RANKS, backend="spark"))
    assert torchdist_magic.runs() == []


def prints_lines(n):
    import sys

    from torchdist_magic import rank, report

    for step in range(1, 4):
        report(step, loss=1.0 / step)
    if rank() == 1:
        for i in range(n):
            print(f"line {i}")
        sys.stdout.write("a bar in progress\r")
    return 3


def test_every_line_of_a_run_whose_channel_was_in_a_process_of_its_own_stays_after_it_ended(home):
    lines = history.LOG_KEEP_LINES + 5_000  # more than the run's record keeps
    run = Distributor(num_processes=2, local_mode=True, show=None, channel="process").submit(prints_lines, lines)
    assert attaching.follow_attached(run, own=True) == 3
    assert_nothing_survives(run.run_id, run.record.pid)  # its supervising process has gone
    text = run.logs(1)
    assert not run.state.hosted  # read from what that process left, not through its feed
    assert text.splitlines() == [f"line {i}" for i in range(lines)] + ["a bar in progress"]
    assert run.logs(1, attempt=1) == text and run.logs(0) == ""
    # the rest of the state is the record's: each rank's newest lines, its metric histories
    assert [line.text for line in run.state.recent_log(1, 2).lines] == [f"line {lines - 1}", "a bar in progress"]
    assert text.endswith("a bar in progress\r"), repr(text[-40:])
    history_ = run.state.metric_history()
    assert {rank: [step for step, _ in points] for rank, points in history_["loss"].items()} == {
        0: [1, 2, 3],
        1: [1, 2, 3],
    }
    assert history_["loss"][1][2][1] == pytest.approx(1 / 3)
    assert "the record keeps the last 20000 lines" in history.read_record(run.run_id).log(1)
    with pytest.raises(IndexError, match="attempt 2 is not in this run"):
        run.logs(1, attempt=2)
    full = os.path.join(run.directory, layout.FULL_LOGS_DIR)
    assert sorted(os.listdir(full)) == ["attempts.json", "rank-0.log", "rank-1.log"]
    del run
    gc.collect()
    assert not os.path.exists(full)  # the kernel's own run: its logs go with its handle
