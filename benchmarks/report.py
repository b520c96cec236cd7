"""What the benchmark scripts here share: the Spark session they time on, the machine they ran
on, and the JSON file of their figures."""

from __future__ import annotations

import json
import os
import platform


def machine(**versions: str) -> dict:
    """Platform, CPU model, Python, usable cores, the load average now, and the versions given
    (``torch=torch.__version__``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "cores": cores,
        "load": load(),
        **versions,
    }


def cpu_model() -> str:
    """The CPU's model name as the system reports it ("" where it does not)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def load() -> float:
    """The 1-minute load average (runnable processes, averaged), or -1 where there is none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def describe_machine(m: dict) -> str:
    """One line naming ``m`` (``machine()``) for a table's caption."""
    return f"{m['cpu'] or m['platform']}, {m['cores']} usable cores, Python {m['python']}"


def short_machine(m: dict) -> str:
    """``m`` (``machine()``) in a table's column: its CPU model and usable cores
    (``AMD EPYC 7B13 x2``)."""
    cpu = m["cpu"] or m["platform"]
    for noise in ("(R)", "(TM)", " Processor", " CPU"):
        cpu = cpu.replace(noise, "")
    cpu = cpu.split(" @ ")[0]
    cpu = " ".join(word for word in cpu.split() if not word.endswith("-Core"))
    return f"{cpu} x{m['cores']}"


class BusyCore:
    """A process that spins on one core (the first of this process's) while the block runs: a
    benchmark run beside it shows how much headroom its own figures have."""

    def __enter__(self):
        import multiprocessing

        self._stop = multiprocessing.Event()
        self._proc = multiprocessing.Process(target=_spin, args=(self._stop,), daemon=True)
        self._proc.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        end_processes([self._proc], 5.0)


def _spin(stop) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    while not stop.is_set():
        for _ in range(100_000):
            pass


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


def spark_session(app: str, master: str = "local[2]"):
    """A quiet SparkSession (``local[2]`` unless ``master`` says) on the loopback interface,
    without the UI."""
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark
