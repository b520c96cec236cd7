"""Launch figures with the history of runs and ``--detach`` (issue 33): a trivial distributed job
(gloo all_reduce of one tensor, 2 ranks) timed end to end under each way of launching it, side
by side in one process.

    python benchmarks/detach.py [--repeat 5] [--warmup 1] [--json benchmarks/results/detach.json]

Ways (rows):

    torchrun              python -m torch.distributed.run --standalone --nproc_per_node=2
    cold                  Distributor(2, local_mode=True).run(job): a run not detached (its record
                          in the history of runs included)
    detached              Distributor(2, detach=True).run(job).result(): a detached run, from the
                          call to rank 0's value read back in this process
    detached-returns      the same call, until it returns the handle (the cell's return)
    warm-relaunch         Distributor(2, warm=True).run(job) on a pool already started

The targets (issue 33): cold <= 0.6x torchrun, warm relaunch <= 0.1 s, detached within 0.5 s of
cold.  Runs are interleaved (one of each way per round) so that a slow moment of the machine does
not land on one row only; the warm-up rounds are not counted.  The history goes to a temporary
``TORCHDIST_HOME``.  Prints a table (median, min, the targets) and the machine's load average,
and writes every time to the JSON file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

from report import machine, write_json  # noqa: E402  (this script's folder is on sys.path)

sys.path.insert(0, os.path.dirname(HERE))

TORCHRUN_SCRIPT = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
dist.destroy_process_group()
assert t.item() == 3.0
"""

WAYS = ("torchrun", "cold", "detached", "detached-returns", "warm-relaunch")


def all_reduce_job():
    """The job every way runs (the torchrun script does the same at top level)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():  # a warm pool's process group stays up between jobs
        dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.item()


def make_ways(script_path: str) -> dict:
    from torchdist_magic import Distributor

    def torchrun():
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script_path],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def cold():
        assert Distributor(2, local_mode=True, show=None).run(all_reduce_job) == 3.0

    def detached():
        assert Distributor(2, local_mode=True, show=None, detach=True).run(all_reduce_job).result(120) == 3.0

    def detached_returns():
        handle = Distributor(2, local_mode=True, show=None, detach=True).run(all_reduce_job)
        returned = time.perf_counter()
        handle.result(120)  # not timed: the next round must not overlap this run
        return returned

    def warm():
        assert Distributor(2, local_mode=True, show=None, warm=True).run(all_reduce_job) == 3.0

    return {
        "torchrun": torchrun,
        "cold": cold,
        "detached": detached,
        "detached-returns": detached_returns,
        "warm-relaunch": warm,
    }


def measure(ways: dict, repeat: int, warmup: int) -> dict:
    times = {name: [] for name in ways}
    for round_ in range(warmup + repeat):
        for name, launch in ways.items():
            start = time.perf_counter()
            end = launch()
            took = (end if isinstance(end, float) else time.perf_counter()) - start
            if round_ >= warmup:
                times[name].append(took)
    return times


def summarize(times: dict) -> dict:
    medians = {name: statistics.median(t) for name, t in times.items()}
    summary = {
        name: {"median_s": round(medians[name], 4), "min_s": round(min(t), 4), "times_s": [round(x, 4) for x in t]}
        for name, t in times.items()
    }
    summary["targets"] = {
        "cold_vs_torchrun": round(medians["cold"] / medians["torchrun"], 3),
        "cold_vs_torchrun_target": 0.6,
        "warm_relaunch_s": round(medians["warm-relaunch"], 4),
        "warm_relaunch_target_s": 0.1,
        "detached_minus_cold_s": round(medians["detached"] - medians["cold"], 4),
        "detached_minus_cold_target_s": 0.5,
    }
    return summary


def print_table(summary: dict, load: tuple) -> None:
    print(f"{'way':<18} {'median s':>9} {'min s':>8}")
    for name in WAYS:
        row = summary[name]
        print(f"{name:<18} {row['median_s']:>9.3f} {row['min_s']:>8.3f}")
    t = summary["targets"]
    print(f"\ncold / torchrun          {t['cold_vs_torchrun']:.2f}x   (target <= {t['cold_vs_torchrun_target']}x)")
    print(f"warm relaunch            {t['warm_relaunch_s']:.3f} s  (target <= {t['warm_relaunch_target_s']} s)")
    print(
        f"detached - cold          {t['detached_minus_cold_s']:+.3f} s  (target <= {t['detached_minus_cold_target_s']} s)"
    )
    print(f"load average before/after: {load[0]:.2f} / {load[1]:.2f} on {os.cpu_count()} cores")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "detach.json"))
    args = parser.parse_args(argv)
    import torch

    from torchdist_magic import shutdown_pools

    home = tempfile.mkdtemp(prefix="torchdist-bench-home-")
    os.environ["TORCHDIST_HOME"] = home
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "all_reduce.py")
        with open(script, "w") as fh:
            fh.write(TORCHRUN_SCRIPT)
        load_before = os.getloadavg()[0]
        try:
            times = measure(make_ways(script), args.repeat, args.warmup)
        finally:
            shutdown_pools()
        load = (load_before, os.getloadavg()[0])
    summary = summarize(times)
    print_table(summary, load)
    write_json(
        args.json,
        {
            "benchmark": "detach",
            "machine": machine(torch=torch.__version__),
            "load_average": list(load),
            "repeat": args.repeat,
            "results": summary,
        },
    )
    import shutil

    shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
