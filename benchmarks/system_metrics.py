"""What sampling each rank's system metrics costs: the DDP script of ``rank_overhead.py`` (steps
of about 2 ms that call ``progress``, ``report`` and ``print``) run by torchdist_magic on local
processes with system metrics on and off, in interleaved rounds; and the CPU time of one sample
(``sysmetrics.RankSampler.sample``: a read of ``/proc`` per process of the machine, meminfo, the
rank's cgroup) in the driver, where the launcher takes it every ``SYSTEM_METRICS_INTERVAL``.

    python benchmarks/system_metrics.py [--ranks 2] [--steps 2000] [--rounds 5]
                                        [--json benchmarks/results/system_metrics.json]

The figures: the ratio of the medians of rank 0's steps/s, on / off (1.0: no cost), and one
sample's CPU milliseconds as a share of one core at one sample per interval.  The ranks, the
driver and whatever else runs on the machine share its cores: the steps/s ratio moves with the
machine's load by a few percent either way; the per-sample CPU time does not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

from rank_overhead import SCRIPT, WARMUP  # noqa: E402  (this script's folder is on sys.path)
from report import machine, write_json  # noqa: E402

sys.path.insert(0, os.path.dirname(HERE))


def steps_per_s(script: str, ranks: int, steps: int, out: str, system_metrics: bool) -> float:
    from torchdist_magic import Distributor

    Distributor(ranks, local_mode=True, show=None, system_metrics=system_metrics).run(
        script, str(steps), str(WARMUP), out
    )
    with open(out) as fh:
        return json.load(fh)["steps_per_s"]


def sample_cost(samples: int = 200) -> dict:
    """CPU milliseconds of one sample of a live process group (a ``sleep`` of its own), and the
    processes this machine had (what a sample reads)."""
    from torchdist_magic.launch import sysmetrics

    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        sampler = sysmetrics.RankSampler(sleeper.pid)
        started = time.process_time()
        for _ in range(samples):
            sampler.sample()
        cpu_ms = 1e3 * (time.process_time() - started) / samples
    finally:
        sleeper.kill()
        sleeper.wait()
    processes = sum(1 for name in os.listdir("/proc") if name.isdigit())
    return {"samples": samples, "cpu_ms_per_sample": cpu_ms, "machine_processes": processes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "system_metrics.json"))
    args = parser.parse_args()

    import torch

    from torchdist_magic.core.timing import SYSTEM_METRICS_INTERVAL

    runs = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as fh:
            fh.write(SCRIPT)
        for i in range(args.rounds):
            order = ["on", "off"] if i % 2 == 0 else ["off", "on"]  # a busy moment hits both alike
            for name in order:
                out = os.path.join(tmp, f"{name}-{i}.json")
                runs[name].append(steps_per_s(script, args.ranks, args.steps, out, name == "on"))
                print(f"round {i + 1}/{args.rounds} system metrics {name:<4} {runs[name][-1]:8.1f} steps/s", flush=True)
    cost = sample_cost()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratio = medians["on"] / medians["off"]
    core_share = cost["cpu_ms_per_sample"] / 1e3 / SYSTEM_METRICS_INTERVAL
    load = os.getloadavg()
    print(f"\n{'system metrics':<16} {'steps/s (median)':>16} {'min':>8} {'max':>8}")
    for name, values in runs.items():
        print(f"{name:<16} {medians[name]:>16.1f} {min(values):>8.1f} {max(values):>8.1f}")
    print(
        f"on / off: {ratio:.3f}x ({args.ranks} ranks, {args.steps} steps of which {WARMUP} warm-up, "
        f"{args.rounds} interleaved rounds; load average {load[0]:.1f} on {machine()['cores']} cores)"
    )
    print(
        f"one sample: {cost['cpu_ms_per_sample']:.2f} ms of CPU ({cost['machine_processes']} processes on the "
        f"machine), every {SYSTEM_METRICS_INTERVAL:g} s per rank: {100 * core_share:.3f}% of a core per rank"
    )
    write_json(
        args.json,
        {
            "benchmark": "system metrics: steps/s with and without, and one sample's CPU time",
            "machine": machine(torch=torch.__version__),
            "ranks": args.ranks,
            "steps": args.steps,
            "warmup": WARMUP,
            "rounds": args.rounds,
            "runs": runs,
            "medians": medians,
            "ratio": ratio,
            "load_average": load,
            "sample_cost": cost,
            "interval_s": SYSTEM_METRICS_INTERVAL,
            "core_share_per_rank": core_share,
        },
    )


if __name__ == "__main__":
    main()
