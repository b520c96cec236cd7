"""MLflow tracking against a real ``mlflow server`` on loopback (``test_mlflow`` uses a sqlite
store in this process): the server runs from this interpreter's mlflow on a free port, with a
sqlite backend and an artifact root in the test's directory, serving the artifacts over HTTP.
A short training tracked to it has a run link that the server answers for and its logs fetched
over HTTP; the server's refusals (an experiment it does not have, points for a run deleted
meanwhile) are said; then the server is stopped by its pid and none of its processes is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid

import pytest

from helpers import assert_no_survivors, free_port, touch, wait_until
from spark_fixtures import _live_members
from torchdist_magic import TrackingError, rank, report

mlflow = pytest.importorskip("mlflow")

#: seconds the server may take to make its tables and answer
SERVER_START = 180.0


class MlflowServer:
    """``python -m mlflow server`` on a free loopback port, in a process group of its own (it
    starts its web server as a child process), its store and artifacts under ``base_dir``."""

    def __init__(self, base_dir: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = os.path.join(base_dir, "server.log")
        command = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{base_dir}/mlflow.db",
            "--serve-artifacts",
            "--artifacts-destination",
            os.path.join(base_dir, "artifacts"),
        ]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=base_dir,
                start_new_session=True,
                # its job runner (which these tests do not use) would keep its queue in a new
                # directory of /dev/shm that the server never removes
                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            )
        wait_until(self._answers, SERVER_START, "the MLflow server to answer")

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            with open(self.log, "rb") as fh:
                raise AssertionError(f"the MLflow server exited: {fh.read()[-2000:]!r}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                return answer.status == 200
        except OSError:
            return False

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as answer:
            return answer.read()

    def stop(self) -> None:
        """SIGTERM to the server's group, a grace, SIGKILL; no live process may be left in it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what the server left in its group
        except ProcessLookupError:
            pass
        self.proc.wait()
        wait_until(lambda: not _live_members({self.proc.pid}), 20, "the MLflow server's processes to end")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = MlflowServer(str(tmp_path_factory.mktemp("mlflow-server")))
    yield running
    running.stop()
    assert running.proc.returncode is not None and not _live_members({running.proc.pid})


@pytest.fixture
def experiment(server, monkeypatch):
    """A fresh experiment on the server that the notebook's MLflow uses; its id."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    experiment_id = mlflow.MlflowClient(server.url).create_experiment(f"test-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", experiment_id)
    return experiment_id


def train_then_wait(marks, steps):
    """A short training: rank 0 reports its loss at each step; both ranks print a line per step,
    then wait for the test's go."""
    import time

    import torch

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.ones(8, 4), torch.zeros(8, 1)
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank() == 0:
            report(step=step, loss=loss.item())
        print(f"rank {rank()} step {step}", flush=True)
    while not os.path.exists(os.path.join(marks, "go")):
        time.sleep(0.05)
    return rank()


def test_a_run_tracked_to_the_server_links_to_it_and_its_logs_come_back_over_http(
    server, experiment, local_distributor, tmp_path
):
    touch(tmp_path / "go")
    run = local_distributor(2, mlflow=True, system_metrics=False).submit(train_then_wait, str(tmp_path), 5)
    assert run.result(timeout=180) == 0
    assert_no_survivors(run)
    run_id = run.tracking.run_id
    assert run.state.tracking.url == f"{server.url}/#/experiments/{experiment}/runs/{run_id}"
    # the page the link opens asks the server for the run it names
    page = server.get("/")
    assert b"<html" in page.lower()
    got = json.loads(server.get(f"/ajax-api/2.0/mlflow/runs/get?run_id={run_id}"))["run"]
    assert got["info"]["experiment_id"] == experiment and got["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in got["data"]["params"]}
    assert params["num_processes"] == "2" and params["job"] == "train_then_wait"
    losses = json.loads(server.get(f"/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key=loss"))
    assert [m["step"] for m in losses["metrics"]] == [0, 1, 2, 3, 4]
    # the artifacts went to the server over HTTP (its artifact root is mlflow-artifacts:) and come back so
    assert got["info"]["artifact_uri"].startswith("mlflow-artifacts:")
    for r in (0, 1):
        text = server.get(f"/get-artifact?path=logs/rank_{r}.txt&run_uuid={run_id}").decode()
        assert text == run.logs(r) and f"rank {r} step 4\n" in text


def test_an_experiment_the_server_does_not_have_is_refused_before_anything_starts(
    server, experiment, local_distributor, monkeypatch
):
    from torchdist_magic.driver.distributor import last_run

    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "987654321")
    before = last_run()
    with pytest.raises(TrackingError) as info:
        local_distributor(1, mlflow=True).run(train_then_wait, "", 1)
    message = str(info.value)
    assert message.startswith(f"could not start an MLflow run at {server.url}: "), message
    assert "987654321" in message, message
    assert last_run() is before


def test_points_for_a_run_deleted_on_the_server_are_refused_counted_and_said(
    server, experiment, local_distributor, tmp_path, monkeypatch
):
    import torchdist_magic.driver.tracking as tracking

    monkeypatch.setattr(tracking, "MLFLOW_FLUSH_INTERVAL", 3600.0)  # nothing is written before the end
    # the server is up: a connection it misses on a busy machine is tried again, as MLflow's own
    # default does (its refusals, 4xx answers, are not)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    run = local_distributor(2, mlflow=True, system_metrics=False).submit(train_then_wait, str(tmp_path), 5)
    wait_until(
        lambda: len(run.state.metric_history(ranks=[0], names=["loss"]).get("loss", {}).get(0, [])) >= 5,
        60,
        "rank 0's five losses",
    )
    client = mlflow.MlflowClient(server.url)
    client.delete_run(run.tracking.run_id)
    touch(tmp_path / "go")
    with pytest.warns(RuntimeWarning) as caught:
        assert run.result(timeout=180) == 0
    assert_no_survivors(run)
    (text,) = [str(w.message) for w in caught]
    refusal = (
        f"RestException: INVALID_PARAMETER_VALUE: The run {run.tracking.run_id} must be in the 'active' "
        "state. Current state is deleted."
    )
    # five losses and the attempt; the tags written at the end are refused too
    assert text.startswith(
        f"torchdist: MLflow run {run.tracking.run_id} at {server.url}: 6 metric points were "
        f"refused by the tracking server; errors: log_batch: {refusal}"
    ), text
    assert text.endswith(f"; tags: {refusal}"), text
    (mlrun,) = client.search_runs([experiment], run_view_type=mlflow.entities.ViewType.DELETED_ONLY)
    assert mlrun.info.run_id == run.tracking.run_id and "loss" not in mlrun.data.metrics
