"""Values both ways: rank 0's value back to the notebook, and a notebook value out to the ranks,
for 1, 64, 512 and 2048 MiB, on local processes and Spark ``local[2]`` (classic), against
pyspark's TorchDistributor (local mode and Spark) in the same process.

    python benchmarks/values.py [--sizes 1 64 512 2048] [--repeat 3] [--json OUT] [--no-spark]
                                [--no-torchdistributor]

Every figure is the whole run's wall time (start the ranks, train nothing, move the value,
return), the median of ``--repeat``; "MiB/s" is the size over the time beyond the 1 MiB run's,
i.e. what the value itself costs.  The driver's peak resident memory is read from
``/proc/self/status`` (VmHWM, reset before each size) and reported in units of the value.
TorchDistributor has no notebook-value path of its own beyond its function's arguments, which
is what "out" times for it too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

from report import machine, spark_session, write_json  # noqa: E402  (this script's folder is on sys.path)
sys.path.insert(0, os.path.dirname(HERE))


def back(mib):
    """Rank 0's value: a float32 tensor of ``mib`` MiB."""
    import os

    import torch

    if os.environ.get("RANK", "0") != "0":
        return None
    return torch.full((mib * 2**18,), 1.0)


def out(tensor):
    """A notebook tensor, out to every rank: its sum comes back."""
    return float(tensor[::4096].sum())


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _status_bytes(field: str) -> int:
    """A memory figure of this process from ``/proc/self/status`` (``VmHWM``: its peak)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_bytes() -> int:
    return _status_bytes("VmHWM")


def _rss_bytes() -> int:
    return _status_bytes("VmRSS")


def time_runs(call, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def runners(spark: bool, torchdistributor: bool):
    from torchdist_magic import Distributor

    found = {"torchdist local": lambda fn, *a: Distributor(2, local_mode=True, show=None).run(fn, *a)}
    if spark:
        found["torchdist spark"] = lambda fn, *a: Distributor(2, local_mode=False, show=None).run(fn, *a)
    if torchdistributor:
        from pyspark.ml.torch.distributor import TorchDistributor

        found["TorchDistributor local"] = lambda fn, *a: TorchDistributor(2, local_mode=True, use_gpu=False).run(fn, *a)
        if spark:
            found["TorchDistributor spark"] = lambda fn, *a: TorchDistributor(2, local_mode=False, use_gpu=False).run(fn, *a)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 512, 2048])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "values.json"))
    parser.add_argument("--no-spark", action="store_true")
    parser.add_argument("--no-torchdistributor", action="store_true")
    args = parser.parse_args()
    import torch

    spark = None
    if not args.no_spark:
        spark = spark_session("torchdist_magic values benchmark")
        # TorchDistributor's tasks run Spark's interpreter: the notebook's, as torchdist_magic picks
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    found = runners(spark is not None, not args.no_torchdistributor and spark is not None)
    rows = []
    for name, run in found.items():
        run(back, 1)  # warm-up: the file cache, Spark's Python daemon
        base = {}
        for direction in ("back", "out"):
            for mib in args.sizes:
                _reset_peak()
                before = _rss_bytes()
                if direction == "back":
                    seconds = time_runs(lambda: run(back, mib), args.repeat)
                else:
                    tensor = torch.ones(mib * 2**18)
                    before = _rss_bytes()
                    seconds = time_runs(lambda: run(out, tensor), args.repeat)
                    del tensor
                peak = (_peak_bytes() - before) / (mib * 2**20)
                base.setdefault(direction, seconds)
                extra = seconds - base[direction]
                rate = (mib - args.sizes[0]) / extra if extra > 0 and mib > args.sizes[0] else None
                rows.append({"runner": name, "direction": direction, "mib": mib, "seconds": seconds,
                             "mib_per_s": rate, "driver_peak_per_value": peak})
                print(f"{name:24s} {direction:4s} {mib:5d} MiB  {seconds:7.2f} s  "
                      f"{(f'{rate:7.0f} MiB/s' if rate else '     -     ')}  driver peak +{peak:.2f}x", flush=True)
    print()
    header = "| runner | direction | " + " | ".join(f"{m} MiB" for m in args.sizes) + " | MiB/s beyond a trivial run |"
    print(header)
    print("|" + "---|" * (3 + len(args.sizes)))
    for name in found:
        for direction in ("back", "out"):
            mine = [r for r in rows if r["runner"] == name and r["direction"] == direction]
            rate = mine[-1]["mib_per_s"]
            rate_text = f"{rate:.0f}" if rate else "-"
            print(f"| {name} | {direction} | " + " | ".join(f"{r['seconds']:.2f}" for r in mine) + f" | {rate_text} |")
    import pyspark

    write_json(args.json, {"machine": machine(torch=torch.__version__, pyspark=pyspark.__version__),
                           "repeat": args.repeat, "rows": rows})
    if spark is not None:
        spark.stop()


if __name__ == "__main__":
    main()
