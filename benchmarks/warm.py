"""Warm relaunch: the same trivial distributed job (gloo all_reduce of one tensor, 2 ranks), cold
(every run starts its ranks) against warm (``warm=True``: the ranks of a pool serve run after
run), on local processes and on Spark ``local[2]``, in one process.

    python benchmarks/warm.py [--repeat 7] [--json benchmarks/results/warm.json] [--no-spark]

Each mode's first warm run starts the pool; it is reported apart ("pool start") and the
median is over the runs after it.  Goal (issue 11): a warm relaunch within 0.3 s locally and
0.5 s on Spark.  Prints a table and writes every time to the JSON file.
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

GOALS = {"local": 0.3, "spark": 0.5}


def all_reduce_once():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # a no-op on a warm pool, whose group is up
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()  # likewise: the pool's group stays up
    return t.item()


def timed(distributor) -> float:
    start = time.perf_counter()
    assert distributor.run(all_reduce_once) == 3.0
    return time.perf_counter() - start


def measure(local_mode: bool, repeat: int) -> dict:
    """Cold runs, then warm ones: on Spark ``local[2]`` a live pool holds both task slots, so
    the two cannot be interleaved."""
    from torchdist_magic import Distributor, shutdown_pools

    cold = Distributor(2, local_mode=local_mode, show=None)
    warm = Distributor(2, local_mode=local_mode, show=None, warm=True)
    timed(cold)  # warm-up: the OS file cache, Spark's Python daemon
    out = {"cold": [timed(cold) for _ in range(repeat)], "warm": [], "pool_start": None}
    try:
        out["pool_start"] = timed(warm)
        out["warm"] = [timed(warm) for _ in range(repeat)]
    finally:
        shutdown_pools()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "warm.json"))
    parser.add_argument("--no-spark", action="store_true", help="local processes only")
    args = parser.parse_args()

    import pyspark
    import torch

    results = {"local": measure(True, args.repeat)}
    if not args.no_spark:
        spark = spark_session("torchdist-warm-benchmark")
        try:
            results["spark"] = measure(False, args.repeat)
        finally:
            spark.stop()

    rows = []
    print(
        f"\n{'backend':<8} {'cold median':>12} {'warm median':>12} {'warm min':>9} {'pool start':>11} "
        f"{'speed-up':>9} {'goal':>6}"
    )
    for name, r in results.items():
        cold, warm = statistics.median(r["cold"]), statistics.median(r["warm"])
        ok = "met" if warm <= GOALS[name] else "MISSED"
        print(
            f"{name:<8} {cold:>11.3f}s {warm:>11.3f}s {min(r['warm']):>8.3f}s {r['pool_start']:>10.3f}s "
            f"{cold / warm:>8.1f}x {ok:>6}"
        )
        rows.append(
            {
                "backend": name,
                "cold_median_s": cold,
                "warm_median_s": warm,
                "warm_min_s": min(r["warm"]),
                "pool_start_s": r["pool_start"],
                "speedup": cold / warm,
                "goal_s": GOALS[name],
                "goal_met": warm <= GOALS[name],
                "cold_s": r["cold"],
                "warm_s": r["warm"],
            }
        )
    write_json(
        args.json,
        {
            "benchmark": "warm relaunch, gloo all_reduce, 2 ranks",
            "repeat": args.repeat,
            "machine": machine(torch=torch.__version__, pyspark=pyspark.__version__),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
