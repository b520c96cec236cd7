"""Launch overhead: a trivial distributed job (gloo all_reduce of one tensor, 2 ranks), timed
end to end under each launcher, side by side in one process.

    python benchmarks/launch.py [--repeat 5] [--warmup 1] [--json benchmarks/results/launch.json]
                                [--only NAME ...]

Launchers (``--only`` takes these names):

    torchdist-local            torchdist_magic Distributor(2, local_mode=True)
    torchrun                   python -m torch.distributed.run --standalone --nproc_per_node=2
    TorchDistributor-local     pyspark.ml.torch TorchDistributor(num_processes=2, local_mode=True)
    torchdist-spark            torchdist_magic Distributor(2, local_mode=False) on local[2]
    TorchDistributor-spark     TorchDistributor(num_processes=2, local_mode=False) on local[2]
    torchdist-connect          Distributor(2, local_mode=False) on a Spark Connect session
    TorchDistributor-connect   TorchDistributor(num_processes=2, local_mode=False), same session

The Connect rows run last, on a Spark Connect server (master local[2]) that the benchmark
starts from the pyspark wheel the way the tests do (``tests/spark_fixtures.ConnectServer``)
and stops at the end.

Runs are interleaved (one of each launcher per round) so that a slow moment of the machine does
not land on one launcher only; the warm-up rounds (Spark's Python daemon, the OS file cache) are
not counted.  Prints a table (median, min, ratios) and writes every time to the JSON file.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

from report import machine, spark_session, write_json  # noqa: E402  (this script's folder is on sys.path)

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

LAUNCHERS = (
    "torchdist-local",
    "torchrun",
    "TorchDistributor-local",
    "torchdist-spark",
    "TorchDistributor-spark",
    "torchdist-connect",
    "TorchDistributor-connect",
)
CONNECT = ("torchdist-connect", "TorchDistributor-connect")
#: the TorchDistributor row each launcher is compared with (same mode: local or Spark)
TORCH_DISTRIBUTOR_PEER = {
    "torchdist-local": "TorchDistributor-local",
    "torchrun": "TorchDistributor-local",
    "TorchDistributor-local": "TorchDistributor-local",
    "torchdist-spark": "TorchDistributor-spark",
    "TorchDistributor-spark": "TorchDistributor-spark",
    "torchdist-connect": "TorchDistributor-connect",
    "TorchDistributor-connect": "TorchDistributor-connect",
}


def all_reduce_job():
    """The job every launcher runs (the torchrun script does the same at top level)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def spark_session_for_both():
    """The session both torchdist_magic and TorchDistributor run on."""
    # TorchDistributor's tasks run Spark's interpreter, ``python3`` from PATH unless this is set;
    # torchdist_magic would pick this interpreter by itself, TorchDistributor needs it set
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    return spark_session("torchdist launch benchmark")


def make_launchers(script_path: str) -> dict:
    from pyspark.ml.torch.distributor import TorchDistributor

    from torchdist_magic import Distributor

    def torchdist(local_mode):
        return lambda: Distributor(2, local_mode=local_mode, show=None).run(all_reduce_job)

    def torch_distributor(local_mode):
        def launch():
            # TorchDistributor prints its ranks' output and logs on the driver
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                return TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False).run(all_reduce_job)

        return launch

    def torchrun():
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script_path],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return 3.0  # the script asserts the sum itself

    return {
        "torchdist-local": torchdist(True),
        "torchrun": torchrun,
        "TorchDistributor-local": torch_distributor(True),
        "torchdist-spark": torchdist(False),
        "TorchDistributor-spark": torch_distributor(False),
        "torchdist-connect": torchdist(False),
        "TorchDistributor-connect": torch_distributor(False),
    }


def measure(launchers: dict, names: list, repeat: int, warmup: int) -> dict:
    times = {name: [] for name in names}
    for round_no in range(warmup + repeat):
        counted = round_no >= warmup
        for name in names:
            start = time.perf_counter()
            value = launchers[name]()
            elapsed = time.perf_counter() - start
            if value != 3.0:
                raise RuntimeError(f"{name} returned {value!r}, expected 3.0")
            if counted:
                times[name].append(elapsed)
            tag = "" if counted else " (warm-up)"
            print(f"  round {round_no + 1}/{warmup + repeat}  {name:<24} {elapsed:7.2f} s{tag}", flush=True)
    return times


def measure_on_connect(launchers: dict, names: list, repeat: int, warmup: int, tmp: str) -> dict:
    """``measure`` with a Spark Connect session on a server started for it (and stopped)."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from pyspark.sql import SparkSession
    from spark_fixtures import ConnectServer

    start = time.perf_counter()
    server = ConnectServer(os.path.join(tmp, "connect"))
    print(f"Spark Connect server up in {time.perf_counter() - start:.1f} s")
    try:
        spark = SparkSession.builder.remote(server.url).getOrCreate()
        print(f"timing {', '.join(names)}: {warmup} warm-up + {repeat} counted runs each")
        times = measure(launchers, names, repeat, warmup)
        spark.stop()
    finally:
        server.stop()
    return times


def summarize(times: dict) -> dict:
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    out = {}
    for name, ts in times.items():
        peer = TORCH_DISTRIBUTOR_PEER[name]
        out[name] = {
            "times_s": [round(t, 4) for t in ts],
            "median_s": round(medians[name], 4),
            "min_s": round(min(ts), 4),
            "vs_torchrun": round(medians[name] / medians["torchrun"], 3) if "torchrun" in medians else None,
            "vs_TorchDistributor": (round(medians[name] / medians[peer], 3) if peer in medians else None),
            "TorchDistributor_peer": peer,
        }
    return out


def print_table(summary: dict) -> None:
    def ratio(x):
        return "-" if x is None else f"{x:.2f}x"

    header = f"{'launcher':<24} {'median s':>9} {'min s':>8} {'vs torchrun':>12} {'vs TorchDistributor':>20}"
    print(header)
    print("-" * len(header))
    for name, row in summary.items():
        print(
            f"{name:<24} {row['median_s']:>9.2f} {row['min_s']:>8.2f} {ratio(row['vs_torchrun']):>12} "
            f"{ratio(row['vs_TorchDistributor']):>20}"
        )
    print("(vs TorchDistributor compares with TorchDistributor in the same mode: local, Spark or Spark Connect)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="counted runs per launcher")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted runs per launcher first")
    parser.add_argument(
        "--json",
        default=os.path.join(HERE, "results", "launch.json"),
        help="where to write the times (default: benchmarks/results/launch.json)",
    )
    parser.add_argument(
        "--only", nargs="+", choices=LAUNCHERS, default=list(LAUNCHERS), help="launchers to time (default: all)"
    )
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0:
        parser.error("--repeat must be at least 1 and --warmup at least 0")

    import pyspark
    import torch

    classic = [name for name in args.only if name not in CONNECT]
    connect = [name for name in args.only if name in CONNECT]
    times = {}
    with tempfile.TemporaryDirectory(prefix="torchdist-bench-") as tmp:
        script = os.path.join(tmp, "all_reduce.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(TORCHRUN_SCRIPT)
        launchers = make_launchers(script)
        if classic:
            spark = spark_session_for_both()  # TorchDistributor wants an active session even in local mode
            print(f"timing {', '.join(classic)}: {args.warmup} warm-up + {args.repeat} counted runs each")
            times.update(measure(launchers, classic, args.repeat, args.warmup))
            spark.stop()
        if connect:  # last: a Connect session makes this process a Connect client for good
            times.update(measure_on_connect(launchers, connect, args.repeat, args.warmup, tmp))

    summary = summarize(times)
    print()
    print_table(summary)
    result = {
        "benchmark": "launch: gloo all_reduce of one tensor, 2 ranks, end to end",
        "repeat": args.repeat,
        "warmup": args.warmup,
        "machine": machine(torch=torch.__version__, pyspark=pyspark.__version__),
        "spark_master": "local[2] (classic, and the Spark Connect server's)",
        "launchers": summary,
    }
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
