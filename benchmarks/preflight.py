"""What the pre-flight check (``--preflight``) costs a run on CPU (gloo, local processes): the
seconds each rank spent on it (versions, an ``all_reduce`` probe and a ring probe of 4 MiB, the
exchange of the reports), as the ranks report them, and the wall time of a run of a job that
does nothing, with and without the check, in interleaved rounds.

    python benchmarks/preflight.py [--ranks 2 4 8] [--rounds 3]
                                   [--json benchmarks/results/preflight.json]

The ranks and the driver share this machine's cores, so the figures grow with the ranks on a
small machine; the ranks' own ``seconds`` (the slowest rank's) is the check's cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

from report import machine, write_json  # noqa: E402  (this script's folder is on sys.path)

sys.path.insert(0, os.path.dirname(HERE))


def nothing() -> int:
    return 0


def one_run(ranks: int, preflight: bool) -> dict:
    from torchdist_magic import Distributor

    started = time.perf_counter()
    run = Distributor(ranks, local_mode=True, show=None, preflight=preflight).submit(nothing)
    run.result(timeout=600)
    wall = time.perf_counter() - started
    reports = run.preflight_reports
    return {
        "wall_s": wall,
        "check_s": max((r.seconds for r in reports.values()), default=0.0),
        "bus_gbps": min((r.bus_gbps for r in reports.values()), default=0.0),
        "link_gbps": min((r.link_gbps for r in reports.values()), default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "preflight.json"))
    args = parser.parse_args()

    import torch

    rows = []
    for ranks in args.ranks:
        runs = {True: [], False: []}
        for i in range(args.rounds):
            for preflight in (True, False) if i % 2 == 0 else (False, True):  # a busy moment hits both
                runs[preflight].append(one_run(ranks, preflight))
        row = {
            "ranks": ranks,
            "wall_with_s": statistics.median(r["wall_s"] for r in runs[True]),
            "wall_without_s": statistics.median(r["wall_s"] for r in runs[False]),
            "check_s": statistics.median(r["check_s"] for r in runs[True]),
            "bus_gbps": statistics.median(r["bus_gbps"] for r in runs[True]),
            "link_gbps": statistics.median(r["link_gbps"] for r in runs[True]),
            "runs": {"with": runs[True], "without": runs[False]},
        }
        rows.append(row)
        print(f"{ranks} ranks done", flush=True)
    load = os.getloadavg()
    print(f"\n{'ranks':>5} {'check s':>8} {'run with s':>11} {'run without s':>14} {'bus GB/s':>9} {'link GB/s':>10}")
    for row in rows:
        print(
            f"{row['ranks']:>5} {row['check_s']:>8.2f} {row['wall_with_s']:>11.2f} {row['wall_without_s']:>14.2f} "
            f"{row['bus_gbps']:>9.2f} {row['link_gbps']:>10.2f}"
        )
    print(f"(medians of {args.rounds} interleaved rounds; load average {load[0]:.1f} on {machine()['cores']} cores)")
    write_json(
        args.json,
        {
            "benchmark": "the pre-flight check's cost on CPU (gloo, local processes)",
            "machine": machine(torch=torch.__version__),
            "rounds": args.rounds,
            "rows": rows,
            "load_average": load,
        },
    )


if __name__ == "__main__":
    main()
