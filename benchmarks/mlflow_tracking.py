"""What ``--mlflow`` costs, against a SQLite tracking store in a temporary directory.

    python benchmarks/mlflow_tracking.py [--records 20000] [--points 10] [--repeat 3] [--json OUT]

* **channel thread**: the driver's cost per ``Metrics`` record of rank 0 (``--points`` points of
  two metrics each, as a rank's client sends one flush), ``RunState.apply`` without a logger and
  with one listening (``MlflowLogger.take``: the points into the bounded buffer), in µs;
* **writer**: how fast the logger's thread empties that buffer into the store (``log_batch`` of
  1000 points), in points per second; what a run can report, all ranks together, before points
  are dropped (they never slow the ranks: the buffer is bounded);
* **start / end**: making the MLflow run with its params (before any rank starts), and ending it
  (two ranks' logs of 1000 lines as artifacts, tags, status: before ``result()`` returns);
* **a run**: a 2-rank local run that reports ``--run-points`` points of two metrics from every
  rank at full speed, wall time with and without ``mlflow=True`` (median of ``--repeat``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

from report import machine, write_json  # noqa: E402  (this script's folder is on sys.path)

sys.path.insert(0, os.path.dirname(HERE))


def report_points(count):
    """Every rank reports ``count`` points of two metrics as fast as it can."""
    from torchdist_magic import report

    for i in range(count):
        report(step=i, loss=1.0 / (i + 1), lr=0.1)
    return count


def metrics_records(count: int, points: int):
    from torchdist_magic.core import events

    out = []
    for i in range(count):
        now = time.time()
        out.append(
            events.Metrics(
                rank=0,
                names=["loss", "lr"],
                steps=list(range(i * points, (i + 1) * points)),
                times=[now] * points,
                values=[[0.5] * points, [0.1] * points],
            )
        )
    return out


def per_record_us(state, records) -> float:
    start = time.perf_counter()
    for record in records:
        state.apply(record)
    return (time.perf_counter() - start) / len(records) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--points", type=int, default=10)
    parser.add_argument("--run-points", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "mlflow_tracking.json"))
    args = parser.parse_args()

    import mlflow

    import torchdist_magic.driver.tracking as tracking
    from torchdist_magic import Distributor
    from torchdist_magic.core import events
    from torchdist_magic.core.options import LaunchOptions
    from torchdist_magic.driver.state import RunState

    workdir = tempfile.mkdtemp(prefix="torchdist-bench-mlflow-")
    try:
        mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
        mlflow.set_experiment(
            experiment_id=mlflow.create_experiment("bench", artifact_location=f"file://{workdir}/artifacts")
        )
        records = metrics_records(args.records, args.points)
        points = args.records * args.points * 2

        plain = RunState("plain", 2)
        without = per_record_us(plain, records)

        tracked = RunState("tracked", 2)
        started = time.perf_counter()
        tracking.QUEUE_POINTS = points  # room for all: the writer's rate is measured, nothing dropped
        logger = tracking.MlflowLogger(tracked, LaunchOptions(num_processes=2, mlflow=True), "bench")
        start_s = time.perf_counter() - started
        with_logger = per_record_us(tracked, records)
        for r in range(2):
            for i in range(1000):
                tracked.apply(events.Log(rank=r, line=f"line {i} of rank {r}"))
        began = time.perf_counter()
        logger._stop.set()
        logger._thread.join()
        logger._flush()
        drain_s = time.perf_counter() - began
        tracked.finish("succeeded")
        began = time.perf_counter()
        warning = logger.close()
        end_s = time.perf_counter() - began
        assert not warning, warning
        kept = len(mlflow.MlflowClient().get_metric_history(logger.run_id, "loss"))
        assert kept == args.records * args.points, kept

        walls = {}
        for on in (False, True):
            times = []
            for _ in range(args.repeat):
                began = time.perf_counter()
                Distributor(2, show=None, mlflow=on, system_metrics=False).run(report_points, args.run_points)
                times.append(time.perf_counter() - began)
            walls[on] = statistics.median(times)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rows = [
        ("channel thread, per Metrics record of %d points: without a logger" % args.points, f"{without:.1f} µs"),
        ("... with MlflowLogger.take listening", f"{with_logger:.1f} µs"),
        ("writer: points into the SQLite store", f"{points / drain_s:,.0f} points/s"),
        ("start: MLflow run and params", f"{start_s * 1000:.0f} ms"),
        ("end: 2 logs of 1000 lines, tags, status", f"{end_s * 1000:.0f} ms"),
        (f"2-rank run, {args.run_points} points x 2 metrics per rank: without mlflow", f"{walls[False]:.2f} s"),
        ("... with mlflow=True", f"{walls[True]:.2f} s"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    write_json(
        args.json,
        {
            "machine": machine(mlflow=mlflow.__version__),
            "records": args.records,
            "points_per_record": args.points,
            "apply_us_without": without,
            "apply_us_with": with_logger,
            "writer_points_per_s": points / drain_s,
            "start_s": start_s,
            "end_s": end_s,
            "run_points": args.run_points,
            "run_wall_s": {"without": walls[False], "with": walls[True]},
        },
    )


if __name__ == "__main__":
    main()
