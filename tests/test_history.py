"""The history of runs (driver/history.py): every run leaves a bounded record under a private
per-user directory, which ``torchdist_magic.runs()`` and ``%torchdist runs`` list."""

import json
import os
import stat
import time

import pytest

import torchdist_magic
from torchdist_magic import Distributor, RankFailure
from torchdist_magic.driver import history

from helpers import assert_no_survivors, cell


def talks_and_returns():
    from torchdist_magic import rank, report

    print(f"hello from rank {rank()}")
    report(loss=0.5)
    return 7


def raises_on_rank_1():
    from torchdist_magic import rank

    if rank() == 1:
        raise KeyError("no such shard")
    return 1


def test_a_run_leaves_its_record_options_logs_and_metrics(home):
    run = Distributor(num_processes=2, show=None).submit(talks_and_returns)
    assert run.result(60) == 7
    records = torchdist_magic.runs()
    assert [r.run_id for r in records] == [run.run_id]
    record = records[0]
    assert record.state == "succeeded" and record.failure == ""
    assert record.started <= record.ended and not record.detached
    assert record.options["num_processes"] == 2 and record.job_name == "talks_and_returns"
    # the release that ran it, in the record's file as well
    assert record.version == torchdist_magic.__version__
    with open(os.path.join(record.directory, "record.json"), encoding="utf-8") as fh:
        assert json.load(fh)["version"] == torchdist_magic.__version__
    assert record.log(1) == "hello from rank 1\n"
    assert [value for _step, value in record.metrics()["metrics"]["loss"]["0"]] == [0.5]
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(record.directory, "record.json")).st_mode) == 0o600
    assert_no_survivors(run)


def test_a_record_written_before_releases_were_recorded_has_no_version(tmp_path):
    record = history.RunRecord.from_json({"run_id": "r1", "state": "succeeded"}, str(tmp_path))
    assert record.version == "" and history.RunRecord("r2").version == torchdist_magic.__version__


def test_a_failed_run_keeps_its_root_cause(home):
    run = Distributor(num_processes=2, show=None).submit(raises_on_rank_1)
    with pytest.raises(RankFailure):
        run.result(60)
    record = torchdist_magic.runs()[0]
    assert record.state == "failed" and record.outcome == "failed"
    assert record.failure.startswith("rank 1 on ") and record.failure.endswith(" raised KeyError: 'no such shard'")
    assert record.root_cause.rank == 1 and "raises_on_rank_1" in record.root_cause.traceback
    assert_no_survivors(run)


def test_the_history_keeps_the_newest_runs_and_days(home, monkeypatch):
    monkeypatch.setenv(history.RUNS_ENV, "2")
    ids = [Distributor(num_processes=1, show=None).submit(talks_and_returns) for _ in range(3)]
    for run in ids:
        run.result(60)
    # three records: the third run's start pruned nothing yet (two finished before it)
    assert len(torchdist_magic.runs()) == 3
    run = Distributor(num_processes=1, show=None).submit(talks_and_returns)
    run.result(60)
    kept = [r.run_id for r in torchdist_magic.runs()]
    assert kept == [run.run_id, ids[2].run_id, ids[1].run_id]  # the newest 2 finished ones, and the new run
    monkeypatch.setenv(history.RUNS_ENV, "100")
    monkeypatch.setenv(history.DAYS_ENV, "1")
    removed = history.prune(now=time.time() + 2 * 86400)
    assert set(removed) == set(kept) and torchdist_magic.runs() == []


def test_bad_bounds_are_refused(home, monkeypatch):
    monkeypatch.setenv(history.RUNS_ENV, "many")
    with pytest.raises(ValueError, match="TORCHDIST_HISTORY_RUNS must be a positive whole number, got 'many'"):
        history.bounds()


def test_a_record_left_running_by_a_dead_process_reads_failed(home):
    record = history.RunRecord(
        run_id="lost-1", started=time.time(), pid=2**22 + 12345, directory=history.record_directory("lost-1")
    )
    record.save()
    found = history.read_record("lost-1")
    assert found.state == "failed"
    assert found.failure == f"the kernel (or process) that ran it (pid {record.pid}) ended before the run did"


def test_a_home_open_to_others_is_refused(home):
    os.makedirs(home, mode=0o755)
    os.chmod(home, 0o755)
    with pytest.raises(PermissionError, match="is not this user's private directory"):
        torchdist_magic.runs()


def test_an_unknown_run_id_names_the_newest(home):
    run = Distributor(num_processes=1, show=None).submit(talks_and_returns)
    run.result(60)
    with pytest.raises(KeyError, match=f"no run 'nope' in .*; the newest are {run.run_id}"):
        history.read_record("nope")


def test_a_record_that_cannot_be_written_is_said_once_and_the_run_goes_on(home, tmp_path, monkeypatch):
    monkeypatch.setenv(history.HOME_ENV, str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    with pytest.warns(RuntimeWarning, match="could not be recorded in the history of runs"):
        run = Distributor(num_processes=1, show=None).submit(talks_and_returns)
    assert run.result(60) == 7


def test_percent_torchdist_runs_shows_the_table(home, ip, capsys):
    cell(ip, "%%torchdist --np 1 --local --quiet\n6 * 7")
    capsys.readouterr()
    ip.run_line_magic("torchdist", "runs")
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["run", "id", "state"]
    assert "succeeded" in out and "cell In[" in out


def test_percent_torchdist_runs_takes_nothing(home, ip):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="%torchdist runs takes nothing, got 'now'"):
        ip.run_line_magic("torchdist", "runs now")


def prints_ten_lines():
    for i in range(10):
        print(f"line {i}")


def test_a_record_keeps_the_newest_lines_of_each_rank(home, monkeypatch):
    monkeypatch.setattr(history, "LOG_KEEP_LINES", 3)
    run = Distributor(num_processes=1, show=None).submit(prints_ten_lines)
    run.result(60)
    assert history.read_record(run.run_id).log(0) == (
        "[torchdist] the record keeps the last 3 lines of this log\nline 7\nline 8\nline 9\n"
    )
    monkeypatch.setattr(history, "LOG_KEEP_CHARS", 14)
    run = Distributor(num_processes=1, show=None).submit(prints_ten_lines)
    run.result(60)
    assert history.read_record(run.run_id).log(0) == (
        "[torchdist] the record keeps the last 14 characters of this log\nline 8\nline 9\n"
    )
