"""MLflow tracking (``mlflow=True``, ``--mlflow``): one MLflow run per job, written by the driver.

Against a real tracking store (``sqlite:`` in the test's directory, artifacts beside it), read
back with ``MlflowClient``: params, metric histories with their steps, system metrics, the logs
as artifacts, status and tags; for a good run, a failed one, a restarted one, a cancelled one,
warm cells, a run nested under the notebook's active run; the good, failed and restarted ones on
local processes and on classic Spark ``local[2]``, a good one on Spark Connect.
Then what a user sees: the view's line and link, the warning when points were dropped, the
errors when mlflow is missing or the tracking server cannot be reached.
"""

import os
import sys
import time
import uuid
import warnings

import pytest

import torchdist_magic
from helpers import alive, assert_no_survivors, cell, free_port, pids_of_run, rank_1_waits_for_data, touch, wait_until
from torchdist_magic import RankFailure, RunCancelled, rank, report, restart_count

mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def tracking_db(tmp_path_factory):
    """One sqlite tracking store for the module (making its tables takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture
def experiment(tracking_db, tmp_path, monkeypatch):
    """A fresh experiment (artifacts in the test's directory) that the notebook's MLflow uses, as
    ``MLFLOW_TRACKING_URI`` and ``MLFLOW_EXPERIMENT_ID`` make it; its id."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_db)
    client = mlflow.MlflowClient(tracking_db)
    experiment_id = client.create_experiment(
        f"test-{uuid.uuid4().hex[:8]}", artifact_location=(tmp_path / "artifacts").as_uri()
    )
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", experiment_id)
    return experiment_id


def runs_of(experiment_id):
    """The experiment's MLflow runs, oldest first."""
    client = mlflow.MlflowClient()
    return sorted(client.search_runs([experiment_id]), key=lambda r: r.info.start_time)


def history(run_id, name):
    return [(m.step, m.value) for m in mlflow.MlflowClient().get_metric_history(run_id, name)]


def artifact(run_id, path):
    local = mlflow.MlflowClient().download_artifacts(run_id, path, os.environ["TORCHDIST_TEST_DOWNLOADS"])
    with open(local, encoding="utf-8") as fh:
        return fh.read()


@pytest.fixture(autouse=True)
def _downloads(tmp_path, monkeypatch):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    monkeypatch.setenv("TORCHDIST_TEST_DOWNLOADS", str(downloads))


def wait_for_samples(run, ranks=(0, 1)):
    """Until every rank of ``ranks`` has sent a system sample with its CPU %."""
    wait_until(
        lambda: all("cpu_percent" in run.state.ranks[r].system for r in ranks), 60, "a system sample of every rank"
    )


def wait_for_points(run, name, count):
    wait_until(
        lambda: len(run.state.metric_history(ranks=[0], names=[name]).get(name, {}).get(0, [])) >= count,
        60,
        f"{count} points of {name} from rank 0",
    )


def _forget_runs():
    """Drop the module's reference to the latest run and collect it (and its directory)."""
    import gc

    import torchdist_magic.driver.distributor as distributor

    distributor._last_run = None
    gc.collect()


# -- jobs ------------------------------------------------------------------------------------------
def report_then_wait(marks, steps):
    """Rank 0 reports ``loss`` and ``lr`` at steps 0, 10, 20, ...; rank 1 a metric of its own;
    both print a line per step, then wait for the test's go."""
    for i in range(steps):
        if rank() == 0:
            report(step=10 * i, loss=1.0 / (i + 1), lr=0.1)
        else:
            report(step=10 * i, rank1_only=float(i))
        print(f"rank {rank()} step {i}", flush=True)
    while not os.path.exists(os.path.join(marks, "go")):
        time.sleep(0.05)
    return rank()


def fail_on_rank1(marks):
    print(f"rank {rank()} up", flush=True)
    touch(os.path.join(marks, f"up-{rank()}"))
    if rank() == 1:
        while not os.path.exists(os.path.join(marks, "go")):
            time.sleep(0.05)
        raise ValueError("bad batch 7")
    time.sleep(600)


def fail_the_first_attempt(marks):
    attempt = restart_count() + 1
    if rank() == 0:
        report(step=attempt, loss=float(attempt))
    print(f"rank {rank()} attempt {attempt}", flush=True)
    touch(os.path.join(marks, f"attempt{attempt}-{rank()}"))
    while not os.path.exists(os.path.join(marks, f"go{attempt}")):
        time.sleep(0.05)
    if attempt == 1 and rank() == 1:
        raise RuntimeError("lost a worker in attempt 1")
    return attempt


def sleep_long(marks):
    touch(os.path.join(marks, f"up-{rank()}"))
    time.sleep(600)


def report_many(count):
    for i in range(count):
        report(step=i, loss=float(i))
    return count


def numel(tensor):
    return tensor.numel()


def one():
    return 1


def report_odd_names():
    report(step=3, **{"acc@1": 0.9, "val/loss": 0.5})
    return 1


def rank_reports(count):
    for i in range(count):
        report(step=i, loss=float(rank()))
    print(f"rank {rank()} reported {count} points")
    return rank()


class Backend:
    """Where a test's runs go: ``make(n, **options)`` a silent Distributor there; ``name`` the
    ``backend`` param it logs; ``nothing_left(run)`` checks that no process (and no Spark task
    directory) of the run is left."""

    def __init__(self, name, local_mode, nothing_left):
        self.name, self.local_mode, self.nothing_left = name, local_mode, nothing_left

    def make(self, n, **options):
        from torchdist_magic import Distributor

        return Distributor(n, local_mode=self.local_mode, show=None, **options)


@pytest.fixture(params=["local", pytest.param("local2", id="spark-local2", marks=pytest.mark.spark)])
def on(request):
    """The good, failed and restarted runs on local processes and on classic Spark ``local[2]``
    (the parameter names the fixture as ``spark_fixtures`` orders Spark tests: with the others
    on ``local[2]``, after every test without Spark)."""
    from helpers import assert_nothing_left

    if request.param == "local":
        return Backend("local", True, assert_no_survivors)
    request.getfixturevalue("spark_local2")
    return Backend("spark", False, assert_nothing_left)


def rank1_behind():
    """Rank 1 sits outside any collective while rank 0 and 2 wait in the second all_reduce."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(2))
    print("one done", flush=True)  # the hang watchdog's quiet counts from here
    if rank() == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(2))


# -- good, failed, restarted: local processes and classic Spark --------------------------------------
def test_a_good_run_is_one_mlflow_run_with_options_metrics_system_metrics_and_logs(on, experiment, tmp_path):
    run = on.make(2, mlflow=True, timeout=300, env={"SECRET_TOKEN": "s3cret"}).submit(
        report_then_wait, str(tmp_path), 4
    )
    assert run.state.tracking is not None and run.state.tracking.url == ""  # sqlite: no web page
    wait_for_points(run, "loss", 4)
    wait_for_samples(run)
    touch(tmp_path / "go")
    assert run.result(timeout=180) == 0
    (mlrun,) = runs_of(experiment)
    run_id = mlrun.info.run_id
    assert run_id == run.tracking.run_id == run.state.tracking.run_id
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "report_then_wait"
    assert mlrun.data.params == {
        "num_processes": "2",
        "backend": on.name,
        "use_gpu": "False",
        "timeout": "300",
        "env": "SECRET_TOKEN",
        "job": "report_then_wait",
    }  # env: names, not values
    assert mlrun.data.tags["torchdist.state"] == "succeeded" and mlrun.data.tags["torchdist.run_id"] == run.run_id
    assert mlrun.data.tags["torchdist.version"] == torchdist_magic.__version__  # the release that ran it
    assert "mlflow.parentRunId" not in mlrun.data.tags and "torchdist.dropped_metric_points" not in mlrun.data.tags
    # rank 0's metrics under their own names and steps; rank 1's own metric is not the job's
    assert history(run_id, "loss") == [(0, 1.0), (10, 0.5), (20, 1 / 3), (30, 0.25)]
    assert history(run_id, "lr") == [(s, 0.1) for s in (0, 10, 20, 30)]
    assert history(run_id, "attempt") == [(0, 1.0)]
    names = set(mlrun.data.metrics)
    assert "rank1_only" not in names
    for r in (0, 1):
        for name in ("cpu_percent", "rss_bytes", "host_memory_available_bytes"):
            assert f"system/rank_{r}/{name}" in names
        rss = history(run_id, f"system/rank_{r}/rss_bytes")
        assert rss and all(value > 0 for _, value in rss)
        assert [step for step, _ in rss] == list(range(len(rss)))  # each sample its own step
    assert artifact(run_id, "logs/rank_0.txt") == run.logs(0)
    assert "rank 1 step 3\n" in artifact(run_id, "logs/rank_1.txt")
    assert [a.path for a in mlflow.MlflowClient().list_artifacts(run_id)] == ["logs"]  # no failure.txt
    on.nothing_left(run)


def test_each_ranks_step_split_the_runs_goodput_and_its_profile_are_logged(on, experiment):
    run = on.make(2, mlflow=True, profile=3).submit(rank_1_waits_for_data, 200)  # the profiled steps are not the last
    assert run.result(timeout=180) == 0
    (mlrun,) = runs_of(experiment)
    run_id = mlrun.info.run_id
    for r in (0, 1):
        for part in ("data", "compute", "comm"):
            assert history(run_id, f"system/rank_{r}/step_{part}_share"), (r, part)
    ((last_step, data),) = history(run_id, "system/rank_1/step_data_share")[-1:]
    assert data == run.state.ranks[1].step_split["data"] and data > 0.5
    goodput = run.goodput
    for key in ("startup_s", "training_s", "lost_to_restarts_s", "lost_to_hangs_s", "data_stall_s", "rank_seconds"):
        assert history(run_id, f"goodput/{key}") == [(0, pytest.approx(goodput[key]))], key
    assert [a.path for a in mlflow.MlflowClient().list_artifacts(run_id, "profile")] == ["profile/trace.json"]
    assert '"rank 1"' in artifact(run_id, "profile/trace.json")
    on.nothing_left(run)
    del run
    _forget_runs()


def test_a_failed_run_is_failed_with_its_root_cause_as_tags(on, experiment, tmp_path):
    run = on.make(2, mlflow=True).submit(fail_on_rank1, str(tmp_path))
    wait_until(lambda: (tmp_path / "up-0").exists() and (tmp_path / "up-1").exists(), 60, "both ranks up")
    touch(tmp_path / "go")
    with pytest.raises(RankFailure):
        run.result(timeout=180)
    (mlrun,) = runs_of(experiment)
    tags = mlrun.data.tags
    assert mlrun.info.status == "FAILED"
    assert (tags["torchdist.failed_rank"], tags["torchdist.exception"], tags["torchdist.message"]) == (
        "1",
        "ValueError",
        "bad batch 7",
    )
    assert tags["torchdist.state"] == "failed" and tags["torchdist.root_cause"].endswith(
        "raised ValueError: bad batch 7"
    )
    failure = artifact(mlrun.info.run_id, "failure.txt")
    assert "raised ValueError: bad batch 7" in failure and 'raise ValueError("bad batch 7")' in failure
    assert "rank 1 up" in artifact(mlrun.info.run_id, "logs/rank_1.txt")
    on.nothing_left(run)


def test_a_restarted_run_is_one_mlflow_run_with_the_attempt_as_a_metric(on, experiment, tmp_path):
    run = on.make(2, mlflow=True, max_restarts=1).submit(fail_the_first_attempt, str(tmp_path))
    for attempt in (1, 2):
        wait_until(
            lambda: all((tmp_path / f"attempt{attempt}-{r}").exists() for r in (0, 1)),  # noqa: B023
            60,
            f"attempt {attempt} of both ranks",
        )
        wait_for_points(run, "loss", 1)
        touch(tmp_path / f"go{attempt}")
    assert run.result(timeout=180) == 2
    (mlrun,) = runs_of(experiment)
    run_id = mlrun.info.run_id
    assert mlrun.info.status == "FINISHED" and mlrun.data.params["max_restarts"] == "1"
    assert mlrun.data.tags["torchdist.attempts"] == "2"
    assert history(run_id, "attempt") == [(0, 1.0), (1, 2.0)]
    assert history(run_id, "loss") == [(1, 1.0), (2, 2.0)]  # rank 0's points of both attempts
    log = artifact(run_id, "logs/rank_1.txt")
    assert log == "rank 1 attempt 1\nrank 1 attempt 2\n"
    assert mlrun.data.tags["torchdist.attempt_1.root_cause"].endswith("raised RuntimeError: lost a worker in attempt 1")
    on.nothing_left(run)
    del run  # its directory (the default checkpoints) goes with it
    _forget_runs()


@pytest.mark.spark
def test_a_spark_connect_run_is_written_by_the_notebook_too(spark_connect, experiment, tmp_path):
    from helpers import assert_nothing_left
    from torchdist_magic import Distributor

    run = Distributor(2, local_mode=False, show=None, mlflow=True).submit(report_then_wait, str(tmp_path), 3)
    wait_for_points(run, "loss", 3)
    wait_for_samples(run)
    touch(tmp_path / "go")
    assert run.result(timeout=180) == 0
    (mlrun,) = runs_of(experiment)
    assert mlrun.info.status == "FINISHED" and mlrun.data.params["backend"] == "spark"
    assert history(mlrun.info.run_id, "loss") == [(0, 1.0), (10, 0.5), (20, 1 / 3)]
    assert {f"system/rank_{r}/cpu_percent" for r in (0, 1)} <= set(mlrun.data.metrics)
    assert "rank 1 step 2\n" in artifact(mlrun.info.run_id, "logs/rank_1.txt")
    assert_nothing_left(run)


# -- more runs on local processes -------------------------------------------------------------------
def test_a_cancelled_run_is_killed(local_distributor, experiment, tmp_path):
    run = local_distributor(2, mlflow=True).submit(sleep_long, str(tmp_path))
    wait_until(lambda: (tmp_path / "up-0").exists() and (tmp_path / "up-1").exists(), 60, "both ranks up")
    run.cancel()
    with pytest.raises(RunCancelled):
        run.result(timeout=120)
    (mlrun,) = runs_of(experiment)
    assert mlrun.info.status == "KILLED"
    assert mlrun.data.tags["torchdist.state"] == "cancelled"
    assert mlrun.data.tags["torchdist.message"] == "stopped by cancel(); every rank was stopped"
    assert "torchdist.failed_rank" not in mlrun.data.tags
    assert_no_survivors(run)


def test_a_run_is_nested_under_the_notebooks_active_run(local_distributor, experiment):
    from torchdist_magic.driver.distributor import last_run

    with mlflow.start_run(experiment_id=experiment, run_name="notebook") as parent:
        assert local_distributor(1, mlflow=True).run(report_odd_names) == 1
    assert_no_survivors(last_run())
    child = next(r for r in runs_of(experiment) if r.info.run_name == "report_odd_names")
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.status == "FINISHED"
    # names MLflow would refuse (and with them the whole batch) are made acceptable
    assert history(child.info.run_id, "acc_1") == [(3, 0.9)] and history(child.info.run_id, "val/loss") == [(3, 0.5)]


def test_each_warm_cell_is_an_mlflow_run_of_its_own(local_distributor, experiment):
    from torchdist_magic import pools, shutdown_pools

    live = []
    try:
        warm = local_distributor(2, mlflow=True, warm=True, system_metrics=False)
        assert warm.run(report_many, 3) == 3
        assert warm.run(report_many, 5) == 5
        on_rank1 = local_distributor(2, mlflow=True, warm=True, system_metrics=False, ranks=(1,))
        assert on_rank1.run(rank_reports, 4) == 1
    finally:
        live = pools()
        shutdown_pools()
    (pool,) = live  # one pool served the three cells; its ranks are gone with it
    wait_until(
        lambda: not pids_of_run(pool.run_id) and not any(alive(p) for p in pool.pids), 15, "the pool's processes to end"
    )
    first, second, third = runs_of(experiment)
    assert len({first.info.run_id, second.info.run_id, third.info.run_id}) == 3
    assert first.info.status == second.info.status == third.info.status == "FINISHED"
    assert first.data.params["warm"] == second.data.params["warm"] == "True"
    assert history(first.info.run_id, "loss") == [(i, float(i)) for i in range(3)]
    assert history(second.info.run_id, "loss") == [(i, float(i)) for i in range(5)]
    # a warm run on rank 1 only: rank 1's metrics, as its value is rank 1's; rank 1's log only
    assert third.data.params["ranks"] == "1"
    assert history(third.info.run_id, "loss") == [(i, 1.0) for i in range(4)]
    assert [a.path for a in mlflow.MlflowClient().list_artifacts(third.info.run_id, "logs")] == ["logs/rank_1.txt"]
    assert artifact(third.info.run_id, "logs/rank_1.txt") == "rank 1 reported 4 points\n"


def test_points_that_find_the_buffer_full_are_counted_and_said(local_distributor, experiment, monkeypatch):
    import torchdist_magic.driver.tracking as tracking

    monkeypatch.setattr(tracking, "QUEUE_POINTS", 10)
    monkeypatch.setattr(tracking, "MLFLOW_FLUSH_INTERVAL", 3600.0)  # nothing is written before the end
    run = local_distributor(1, mlflow=True, system_metrics=False).submit(report_many, 100)
    with pytest.warns(RuntimeWarning) as caught:
        assert run.result(timeout=120) == 100
    assert_no_survivors(run)
    (text,) = [str(w.message) for w in caught]
    assert text == (
        f"torchdist: MLflow run {run.tracking.run_id} at {mlflow.get_tracking_uri()}: 90 metric "
        "points were not logged: they came faster than they could be written (at most 10 wait)"
    )
    (mlrun,) = runs_of(experiment)
    assert mlrun.data.tags["torchdist.dropped_metric_points"] == "90"
    assert history(mlrun.info.run_id, "loss") == [(i, float(i)) for i in range(10)]
    with warnings.catch_warnings():  # said once: the second result() warns no more
        warnings.simplefilter("error")
        assert run.result() == 100


def test_points_still_unwritten_when_the_wait_at_the_end_is_over_are_counted_and_said(
    local_distributor, experiment, monkeypatch
):
    import torchdist_magic.driver.tracking as tracking

    monkeypatch.setattr(tracking, "MLFLOW_FLUSH_INTERVAL", 3600.0)  # everything waits for the end...
    monkeypatch.setattr(tracking, "MLFLOW_CLOSE_WAIT", 0.0)  # ... which has no time for it
    run = local_distributor(1, mlflow=True, system_metrics=False).submit(report_many, 20)
    with pytest.warns(RuntimeWarning) as caught:
        assert run.result(timeout=120) == 20
    assert_no_survivors(run)
    (text,) = [str(w.message) for w in caught]
    assert text.endswith(
        ": 20 metric points were not written: the tracking store took more than 0 s for the "
        "points still buffered when the run ended"
    )
    (mlrun,) = runs_of(experiment)
    assert mlrun.data.tags["torchdist.dropped_metric_points"] == "20"
    assert mlrun.info.status == "FINISHED" and history(mlrun.info.run_id, "attempt") == [(0, 1.0)]
    assert history(mlrun.info.run_id, "loss") == []


def test_logs_that_cannot_be_stored_are_said_and_the_run_still_ends(
    local_distributor, tracking_db, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_db)
    (tmp_path / "a-file").write_text("not a directory")
    experiment_id = mlflow.MlflowClient(tracking_db).create_experiment(
        f"test-{uuid.uuid4().hex[:8]}", artifact_location=(tmp_path / "a-file" / "artifacts").as_uri()
    )
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", experiment_id)
    run = local_distributor(1, mlflow=True, system_metrics=False).submit(report_many, 3)
    with pytest.warns(RuntimeWarning) as caught:
        assert run.result(timeout=120) == 3
    assert_no_survivors(run)
    (text,) = [str(w.message) for w in caught]
    assert text.startswith(f"torchdist: MLflow run {run.tracking.run_id} at {tracking_db}: errors: artifacts: ")
    assert "a-file" in text
    (mlrun,) = runs_of(experiment_id)
    assert mlrun.info.status == "FINISHED" and mlrun.data.tags["torchdist.state"] == "succeeded"
    assert history(mlrun.info.run_id, "loss") == [(0, 0.0), (1, 1.0), (2, 2.0)]


# -- what a user sees ------------------------------------------------------------------------------
def test_the_view_links_to_the_run_on_a_server_with_a_ui():
    from torchdist_magic.driver.state import RunState
    from torchdist_magic.driver.tracking import TrackingLink, run_url
    from torchdist_magic.view.html import header_html
    from torchdist_magic.view.model import run_facts
    from torchdist_magic.view.text import header

    url = run_url("https://mlflow.example.com/", "7", "abc")
    assert url == "https://mlflow.example.com/#/experiments/7/runs/abc"
    assert run_url("sqlite:////tmp/m.db", "7", "abc") == "" and run_url("databricks", "7", "abc") == ""
    state = RunState("r1", 2, "local processes", job_name="cell In[3]")
    assert "MLflow" not in header(state) and "torchdist-mlflow" not in header_html(run_facts(state))
    state.track(TrackingLink("abc", "7", "https://mlflow.example.com/", url))
    assert header(state).splitlines()[1] == f"torchdist: MLflow run abc: {url}"
    assert (
        f'<a class="torchdist-mlflow" href="{url}" target="_blank" rel="noopener" '
        f'title="MLflow run abc: {url}">MLflow run</a>'
    ) in header_html(run_facts(state))
    state.track(TrackingLink("abc", "7", "sqlite:////tmp/m.db"))
    assert header(state).splitlines()[1] == "torchdist: MLflow run abc: experiment 7 at sqlite:////tmp/m.db"
    assert "<a " not in header_html(run_facts(state))


def test_the_magic_logs_when_configured_and_not_with_no_mlflow(ip, capsys, experiment):
    ip.run_line_magic("config", "TorchdistMagics.mlflow = True")
    try:
        result = cell(
            ip,
            """
            %%torchdist --np 1
            21 * 2
        """,
        )
        assert result.error_in_exec is None and result.result == 42
        assert_no_survivors(ip.user_ns["_torchdist_run"])
        (mlrun,) = runs_of(experiment)
        assert f"torchdist: MLflow run {mlrun.info.run_id}: experiment {experiment} at " in capsys.readouterr().out
        assert mlrun.info.status == "FINISHED" and mlrun.info.run_name.startswith("cell In[")
        assert cell(ip, "%%torchdist --np 1 --no-mlflow\n1").result == 1
        assert len(runs_of(experiment)) == 1
    finally:
        ip.run_line_magic("config", "TorchdistMagics.mlflow = False")
    assert cell(ip, "%%torchdist --np 1 --mlflow\n2").result == 2
    assert len(runs_of(experiment)) == 2


def test_a_run_without_mlflow_never_imports_it():
    import subprocess

    code = "\n".join(
        (
            "import sys",
            "from torchdist_magic import Distributor",
            "def one():",
            "    return 1",
            "assert Distributor(2, show='text').run(one) == 1",
            "print('mlflow' in sys.modules)",
        )
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "MLflow" not in out and out.splitlines()[-1] == "False"


def test_without_mlflow_installed_nothing_starts_and_the_error_says_what_to_install(
    ip, capsys, local_distributor, monkeypatch
):
    from torchdist_magic.driver.distributor import last_run
    from torchdist_magic import MlflowUnavailable

    monkeypatch.setitem(sys.modules, "mlflow", None)  # what ``import mlflow`` meets where it is missing
    before = last_run()
    expected = (
        "mlflow=True (--mlflow) logs the run to MLflow, and the mlflow package is not installed here: "
        "pip install mlflow (or torchdist_magic[mlflow]), or run without it"
    )
    with pytest.raises(MlflowUnavailable, match=r"^mlflow=True \(--mlflow\)") as info:
        local_distributor(1, mlflow=True).run(one)
    assert str(info.value) == expected and isinstance(info.value, ImportError)
    result = cell(ip, "%%torchdist --np 1 --mlflow\n1")
    assert result.error_in_exec is not None
    text = "".join(capsys.readouterr())
    assert f"UsageError: {expected}" in text and "Traceback" not in text
    assert last_run() is before  # no run started


def test_the_panel_shows_why_it_could_not_start_the_mlflow_run(monkeypatch):
    from test_panel import Notebook
    from torchdist_magic.driver.distributor import last_run
    from torchdist_magic.core.options import LaunchOptions
    from torchdist_magic.panel import LaunchPanel

    monkeypatch.setitem(sys.modules, "mlflow", None)
    panel = LaunchPanel(Notebook(), LaunchOptions())
    panel.code.value = "1"
    panel.controls["mlflow"].value = True
    assert panel.command_text() == "%%torchdist --np 1 --mlflow\n1"
    before = last_run()
    assert panel.launch() is None and panel.run is None and last_run() is before
    assert "torchdist-launch-error" in panel.message.value
    assert "the mlflow package is not installed here: pip install mlflow" in panel.message.value


def test_an_unreachable_tracking_server_is_refused_before_anything_starts(ip, capsys, local_distributor, monkeypatch):
    from torchdist_magic.driver.distributor import last_run
    from torchdist_magic import TrackingError

    uri = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    before = last_run()
    with pytest.raises(TrackingError, match=rf"^could not start an MLflow run at {uri}: ") as info:
        local_distributor(1, mlflow=True).run(one)
    assert "Connection refused" in str(info.value) or "Max retries" in str(info.value)
    import torch  # a large argument goes to shared memory first: refused, none of it stays there

    with pytest.raises(TrackingError):
        local_distributor(1, mlflow=True).run(numel, torch.zeros(2**20))
    result = cell(ip, "%%torchdist --np 1 --mlflow\n1")
    assert result.error_in_exec is not None
    text = "".join(capsys.readouterr())
    assert f"UsageError: could not start an MLflow run at {uri}: " in text and "Traceback" not in text
    assert last_run() is before


def test_a_hung_run_names_the_rank_that_held_the_others_up(experiment, run_clock):
    from torchdist_magic import Distributor, HangTimeout

    run = Distributor(3, local_mode=True, show=None, mlflow=True, hang_timeout=600).submit(rank1_behind)
    wait_until(
        lambda: all("one done" in run.logs(r) for r in range(3)) and run.culprit().suspects == (1,),
        180,
        "ranks 0 and 2 to wait in all_reduce for rank 1",
        interval=0.5,
    )
    run_clock.expire()  # the quiet passes hang_timeout now that the ranks are where the test wants them
    with pytest.raises(HangTimeout):
        run.result(timeout=240)
    (mlrun,) = runs_of(experiment)
    assert mlrun.data.tags["torchdist.suspects"] == "1"
    assert mlrun.data.tags["torchdist.culprit"] == (
        "rank 1 is behind: its last collective was #1 all_reduce; ranks 0, 2 wait in #2 all_reduce (default group)"
    )
    assert_no_survivors(run)
