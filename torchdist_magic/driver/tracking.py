"""MLflow tracking of a run (``mlflow=True``, ``--mlflow``), written by the driver alone.

The notebook's process is the only MLflow client: the ranks never talk to the tracking server,
so this works on clusters whose executors cannot reach it, and with whatever tracking URI and
experiment the notebook has (``mlflow.get_tracking_uri()``, ``mlflow.set_experiment``, a
Databricks notebook's own).  One MLflow run per job (a run that restarts keeps one MLflow run
for all its attempts; each warm cell is a job of its own), nested under the notebook's active
run when there is one.  It holds:

* params: the launch options (``num_processes``, ``backend``, ``use_gpu`` and every other one
  that differs from its default; of ``env`` only the names, its values may be secrets), ``job``;
* rank 0's ``report()`` metrics (on some ranks of a warm pool, ``ranks``, the lowest chosen
  rank's) under their own names (characters MLflow refuses become ``_``) and steps, every
  rank's system samples as ``system/rank_<r>/<name>`` (``events.SystemMetrics``), its step
  split as ``system/rank_<r>/step_data_share`` (``_compute_share``, ``_comm_share``), and
  ``attempt`` (1, 2, ... by restart count);
* each rank's complete log (a ``ranks`` run: each chosen rank's) as the artifact
  ``logs/rank_<r>.txt`` and the root cause's traceback as ``failure.txt``, written at the end;
* with ``--profile``, the merged trace of every rank (``profile/trace.json``);
* where its wall time went (``goodput``) as ``goodput/<part>`` (``goodput/training_s``, ...),
  written at the end;
* tags ``torchdist.run_id``, ``torchdist.backend`` and ``torchdist.version`` (the release of
  torchdist_magic that ran it), from the start;
* status FINISHED, FAILED (tags ``torchdist.failed_rank``, ``torchdist.exception``,
  ``torchdist.message``) or KILLED (cancelled, timed out, hung), and ``torchdist.state``;
  where the ranks' collective records named the rank that held the others up (``culprit``),
  ``torchdist.culprit`` (the verdict's sentence) and ``torchdist.suspects`` (``2`` or ``0,3``).

Never in the ranks' way.  ``RunState`` hands every record it takes to ``MlflowLogger.take`` in
the channel's thread, which keeps the metric points in a bounded buffer and returns; the
logger's own thread writes them with ``log_batch`` every ``MLFLOW_FLUSH_INTERVAL``.  When the run
ends, what is still buffered is written for at most ``MLFLOW_CLOSE_WAIT`` (the buffer's bound
keeps that short on a store that keeps up).  Points that find the buffer full, that the tracking
server refused, or that were still unwritten then, are counted: the run's ``result()`` warns with
the count, and the MLflow run has it as the tag ``torchdist.dropped_metric_points``.

``mlflow`` is imported when a run asks for it, never with the extension.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..core import events
from ..core.options import LaunchOptions, option_fields
from .state import RunState
from ..core.timing import MLFLOW_CLOSE_WAIT, MLFLOW_FLUSH_INTERVAL
from ..core.version import __version__

#: metric points waiting to be written at most; more are dropped (and counted)
QUEUE_POINTS = 100_000
#: MLflow's limits: metrics per ``log_batch``, params per call, characters of a param and a tag
BATCH_METRICS = 1000
BATCH_PARAMS = 100
PARAM_CHARS = 6000
TAG_CHARS = 5000
#: lines of a rank's log read at once when it is written as an artifact
ARTIFACT_READ_LINES = 20_000
#: the MLflow status of each way a run ends
STATUS = {"succeeded": "FINISHED", "failed": "FAILED"}  # anything else (cancelled, timed out, hung): KILLED
#: characters MLflow refuses in a metric name
_METRIC_NAME_BAD = re.compile(r"[^\w\-. /]")

MISSING_TEXT = (
    "mlflow=True (--mlflow) logs the run to MLflow, and the mlflow package is not installed "
    "here: pip install mlflow (or torchdist_magic[mlflow]), or run without it"
)


class MlflowUnavailable(ImportError):
    """``mlflow=True`` and the ``mlflow`` package cannot be imported; raised before any rank starts.

    Example:

    ```python
    from torchdist_magic import Distributor, MlflowUnavailable

    try:
        Distributor(num_processes=2, mlflow=True).run(train)
    except MlflowUnavailable as error:
        print(error)   # says how to install mlflow; no rank was started
    ```
    """


class TrackingError(RuntimeError):
    """The MLflow run could not be created (the tracking server refused or could not be reached);
    raised before any rank starts.

    Example:

    ```python
    from torchdist_magic import Distributor, TrackingError

    try:
        Distributor(num_processes=2, mlflow=True).run(train)
    except TrackingError as error:
        print(error)   # the tracking server's answer; nothing was started
    ```
    """


@dataclass(frozen=True)
class TrackingLink:
    """The MLflow run a torchdist run is logged to, as the views name it (``RunState.tracking``)."""

    run_id: str
    experiment_id: str
    tracking_uri: str
    url: str = ""  # the run's page, when the tracking server has a web UI (an http(s) URI)

    def text(self) -> str:
        """One line for a terminal: the run's page, else where it is."""
        where = self.url or f"experiment {self.experiment_id} at {self.tracking_uri}"
        return f"MLflow run {self.run_id}: {where}"


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The web page of an MLflow run on a tracking server with a UI (``http(s)://``); ``""`` for
    a store without one (``sqlite:``, a file path, ``databricks``)."""
    if not tracking_uri.lower().startswith(("http://", "https://")):
        return ""
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def _param_text(value: Any) -> str:
    return str(value)[:PARAM_CHARS]


def launch_params(options: LaunchOptions, job_name: str) -> Dict[str, str]:
    """The run's params: ``num_processes``, ``backend``, ``use_gpu``, every other option that
    differs from its default (``env``: its names only), and ``job``."""
    defaults = LaunchOptions()
    params = {"num_processes": str(options.num_processes), "backend": options.backend, "use_gpu": str(options.use_gpu)}
    for f in option_fields():
        value = getattr(options, f.name)
        if f.name in params or f.name == "mlflow" or value == getattr(defaults, f.name):
            continue
        text = f.metadata.get("text")  # how the flag writes it (``--ranks 1,3``)
        if f.name == "env":
            params[f.name] = ",".join(sorted(value))
        else:
            params[f.name] = _param_text(text(value) if text else value)
    params["job"] = _param_text(job_name)
    return params


def metric_name(name: str) -> str:
    """``name`` as MLflow accepts it (letters, digits, ``_ - . /`` and spaces; others become ``_``)."""
    return _METRIC_NAME_BAD.sub("_", name) or "_"


def _number(value: Any) -> Optional[float]:
    """A metric value as a float (a non-finite one arrives as its text: ``"nan"``); else None."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _import_mlflow():
    try:
        import mlflow
    except ImportError as exc:
        raise MlflowUnavailable(MISSING_TEXT) from exc
    return mlflow


def _clip(text: str) -> str:
    return text if len(text) <= TAG_CHARS else text[: TAG_CHARS - 1] + "…"


class MlflowLogger:
    """The MLflow run of one torchdist run: made at once (``TrackingError`` when it cannot be),
    fed by ``state``'s records, ended by ``close``.  Call in the notebook's thread: the active run
    it nests under is that thread's."""

    def __init__(self, state: RunState, options: LaunchOptions, job_name: str):
        mlflow = _import_mlflow()
        from mlflow.entities import Param
        from mlflow.tracking import fluent

        self.state = state
        self.tracking_uri = mlflow.get_tracking_uri()
        parent = mlflow.active_run()
        tags = {"torchdist.run_id": state.run_id, "torchdist.backend": state.backend, "torchdist.version": __version__}
        self.run_id = ""
        try:
            self._client = mlflow.MlflowClient(self.tracking_uri)
            if parent is not None:
                experiment_id = parent.info.experiment_id
                tags["mlflow.parentRunId"] = parent.info.run_id
            else:
                experiment_id = fluent._get_experiment_id()  # set_experiment, env, a Databricks notebook's
            run = self._client.create_run(experiment_id or "0", tags=tags, run_name=job_name)
            self.run_id = run.info.run_id
            self.experiment_id = run.info.experiment_id
            params = list(launch_params(options, job_name).items())
            for i in range(0, len(params), BATCH_PARAMS):
                self._client.log_batch(
                    self.run_id, params=[Param(k, v) for k, v in params[i : i + BATCH_PARAMS]], synchronous=True
                )
        except Exception as exc:
            if self.run_id:  # made, and its params refused: it ends at once
                try:
                    self._client.set_terminated(self.run_id, "FAILED")
                except Exception:  # the error raised below says what went wrong first  # noqa: BLE001
                    pass
            raise TrackingError(
                f"could not start an MLflow run at {self.tracking_uri}: {type(exc).__name__}: {exc}"
            ) from exc
        self.link = TrackingLink(
            self.run_id,
            self.experiment_id,
            self.tracking_uri,
            run_url(self.tracking_uri, self.experiment_id, self.run_id),
        )
        self._lock = threading.Lock()
        self._pending: List[Tuple[str, Any, float, int]] = []  # (name, value, time, step) as they came
        self._names: Dict[str, str] = {}  # a name as reported -> as MLflow takes it
        self._system_steps: Dict[int, int] = {}
        self._split_steps: Dict[int, int] = {}
        #: whose ``report()`` metrics are the job's: rank 0's, or on some ranks of a warm pool
        #: (``ranks``) the lowest chosen one's, as the job's value is
        self.metrics_rank = min(options.ranks) if options.ranks else 0
        self._attempt_logged = 0
        self.dropped = 0  # points that found the buffer full
        self.failed = 0  # points the tracking server refused
        self.late = 0  # points still unwritten ``MLFLOW_CLOSE_WAIT`` after the run ended
        self.errors: List[str] = []
        self._stop = threading.Event()
        state.track(self.link)
        self._thread = threading.Thread(target=self._loop, name=f"torchdist-mlflow-{state.run_id}", daemon=True)
        self._thread.start()
        state.listen(self.take)

    # -- the channel's thread ----------------------------------------------------------------
    def take(self, record: events.Event) -> None:
        """Keep the metric points of ``record`` for the writer, as they came (the writer makes
        them MLflow's); never waits (the state's lock is held, and the channel's thread must go on)."""
        if isinstance(record, events.Metrics):
            if record.rank != self.metrics_rank:
                return
            rows = [
                (name, value, when, step)
                for step, when, row in zip(record.steps, record.times, zip(*record.values))
                for name, value in zip(record.names, row)
                if value is not None  # a point that did not report this name
            ]
        elif isinstance(record, events.SystemMetrics):
            step = self._system_steps.get(record.rank, 0)
            self._system_steps[record.rank] = step + 1
            prefix = f"system/rank_{record.rank}/"
            rows = [(prefix + name, value, record.time, step) for name, value in record.values.items()]
        elif isinstance(record, events.StepSplit):
            step = self._split_steps.get(record.rank, 0)
            self._split_steps[record.rank] = step + 1
            prefix = f"system/rank_{record.rank}/step_"
            rows = [
                (f"{prefix}{name}_share", getattr(record, name), record.time, step)
                for name in ("data", "compute", "comm")
            ]
        else:
            return
        with self._lock:
            room = QUEUE_POINTS - len(self._pending)
            if len(rows) > room:
                self.dropped += len(rows) - max(room, 0)
                rows = rows[: max(room, 0)]
            self._pending += rows

    # -- the writer's thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(MLFLOW_FLUSH_INTERVAL):
            self._flush()

    def _flush(self, deadline: Optional[float] = None) -> None:
        """Write the buffered points (and a new attempt); with a ``deadline`` (``time.monotonic``)
        the points still unwritten then are counted as ``late``."""
        with self._lock:
            rows, self._pending = self._pending, []
        attempt = self.state.attempt
        if attempt > self._attempt_logged:
            now = time.time()
            self._write([("attempt", n, now, n - 1) for n in range(self._attempt_logged + 1, attempt + 1)])
            self._attempt_logged = attempt
        for i in range(0, len(rows), BATCH_METRICS):
            if deadline is not None and time.monotonic() >= deadline:
                self.late += len(rows) - i
                return
            self._write(rows[i : i + BATCH_METRICS])

    def _write(self, rows: List[Tuple[str, Any, float, int]]) -> None:
        from mlflow.entities import Metric

        metrics = []
        for name, value, at, step in rows:
            number = _number(value)
            if number is None:
                continue
            key = self._names.get(name)
            if key is None:
                key = self._names[name] = metric_name(name)
            metrics.append(Metric(key, number, _ms(at), step))
        try:
            self._client.log_batch(self.run_id, metrics=metrics, synchronous=True)
        except Exception as exc:  # noqa: BLE001
            self.failed += len(rows)
            self._error(f"log_batch: {type(exc).__name__}: {exc}")

    def _error(self, text: str) -> None:
        if len(self.errors) < 3:  # the first few say why; the counts say how much
            self.errors.append(text.splitlines()[0][:300] if text else text)

    # -- the end -------------------------------------------------------------------------------
    def close(self) -> str:
        """Write what is left, the logs and the outcome, and end the MLflow run; the warning a
        user should see (points not logged, a write that failed), or ``""``."""
        self._stop.set()
        self._thread.join()
        self._flush(deadline=time.monotonic() + MLFLOW_CLOSE_WAIT)
        snap = self.state.snapshot()
        self._write_artifacts(snap)
        tags = {"torchdist.state": snap.state, "torchdist.attempts": str(snap.attempt)}
        if snap.message:
            tags["torchdist.message"] = _clip(snap.message)
        failure = snap.failure
        if failure is not None:
            exception = failure.exc_type or (
                f"killed by {failure.signal_name}" if failure.signal_name else f"exit code {failure.exit_code}"
            )
            tags.update(
                {
                    "torchdist.failed_rank": str(failure.rank),
                    "torchdist.exception": exception,
                    "torchdist.message": _clip(failure.message or failure.summary()),
                    "torchdist.root_cause": _clip(failure.summary()),
                }
            )
            if failure.host:
                tags["torchdist.failed_host"] = failure.host
        if snap.verdict:  # which rank held the others up (``culprit``)
            tags.update(
                {
                    "torchdist.culprit": _clip(snap.verdict.sentence),
                    "torchdist.suspects": ",".join(map(str, snap.verdict.suspects)),
                }
            )
        for ended in snap.attempts:  # a run that restarted: what ended each earlier attempt
            if ended.failure is not None:
                tags[f"torchdist.attempt_{ended.number}.root_cause"] = _clip(ended.failure.summary())
        lost = self.dropped + self.failed + self.late
        if lost:
            tags["torchdist.dropped_metric_points"] = str(lost)
        try:
            from mlflow.entities import Metric, RunTag

            at = _ms(snap.ended or time.time())
            self._client.log_batch(
                self.run_id,
                tags=[RunTag(k, v) for k, v in tags.items()],
                metrics=[Metric(f"goodput/{k}", v, at, 0) for k, v in snap.goodput.items()],
                synchronous=True,
            )
        except Exception as exc:  # noqa: BLE001
            self._error(f"tags: {type(exc).__name__}: {exc}")
        try:
            self._client.set_terminated(self.run_id, STATUS.get(snap.state, "KILLED"))
        except Exception as exc:  # noqa: BLE001
            self._error(f"set_terminated: {type(exc).__name__}: {exc}")
        return self.warning()

    def _write_artifacts(self, snap) -> None:
        try:
            self._write_files(snap)
        except Exception as exc:  # the status and tags are still written  # noqa: BLE001
            self._error(f"artifacts: {type(exc).__name__}: {exc}")

    def _write_files(self, snap) -> None:
        with tempfile.TemporaryDirectory(prefix=f"torchdist-mlflow-{self.state.run_id}-") as directory:
            logs = os.path.join(directory, "logs")
            os.makedirs(logs)
            for r in range(snap.num_processes):
                if r in self.state.idle_ranks:  # not one of a warm run's ranks: it printed nothing
                    continue
                with open(os.path.join(logs, f"rank_{r}.txt"), "w", encoding="utf-8", errors="replace") as fh:
                    start = 0
                    while True:
                        read = self.state.read_log(r, start, ARTIFACT_READ_LINES)
                        fh.write("".join(line.text + ("\r" if line.cr else "\n") for line in read.lines))
                        if read.stop >= read.total:
                            break
                        start = read.stop
            if snap.failure is not None and snap.failure.traceback:
                with open(os.path.join(directory, "failure.txt"), "w", encoding="utf-8", errors="replace") as fh:
                    fh.write(f"{snap.failure.summary()}\n\n{snap.failure.traceback}")
            self._client.log_artifacts(self.run_id, directory)
        profile = self.state.profile()
        if profile is not None and profile.trace_path:
            self._client.log_artifact(self.run_id, profile.trace_path, "profile")

    def warning(self) -> str:
        """What went unlogged, in one paragraph; ``""`` when everything was written."""
        parts = []
        if self.dropped:
            parts.append(
                f"{_points(self.dropped)} not logged: they came faster than they could be written "
                f"(at most {QUEUE_POINTS} wait)"
            )
        if self.late:
            parts.append(
                f"{_points(self.late)} not written: the tracking store took more than "
                f"{MLFLOW_CLOSE_WAIT:g} s for the points still buffered when the run ended"
            )
        if self.failed:
            parts.append(f"{_points(self.failed)} refused by the tracking server")
        if self.errors:
            parts.append("errors: " + "; ".join(self.errors))
        if not parts:
            return ""
        return f"torchdist: MLflow run {self.run_id} at {self.tracking_uri}: " + "; ".join(parts)


def _ms(at: float) -> int:
    """Seconds since the epoch (0: now) as MLflow's milliseconds."""
    return int((at or time.time()) * 1000)


def _points(count: int) -> str:
    return f"{count} metric point{'s were' if count != 1 else ' was'}"
