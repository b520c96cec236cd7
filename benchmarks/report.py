"""What the benchmark scripts here share: the Spark session they time on, the machine they ran
on, and the JSON file of their figures."""

from __future__ import annotations

import json
import os
import platform


def machine(**versions: str) -> dict:
    """Platform, Python, usable cores, and the versions given (``torch=torch.__version__``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "python": platform.python_version(), "cores": cores, **versions}


def write_json(path: str, result: dict) -> None:
    """Write ``result`` to ``path`` (making its folder) and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    print(f"\nwrote {path}")


def end_processes(procs, wait: float) -> None:
    """Wait up to ``wait`` seconds for each of ``procs`` (``multiprocessing`` processes), then
    kill whichever is still there: a benchmark leaves no generator behind."""
    for p in procs:
        p.join(wait)
        if p.is_alive():
            p.kill()
            p.join()


def spark_session(app: str):
    """A quiet ``local[2]`` SparkSession on the loopback interface, without the UI."""
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName(app)
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark
