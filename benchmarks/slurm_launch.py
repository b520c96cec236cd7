"""Launch overhead on Slurm: a trivial distributed job (gloo all_reduce of one tensor, 4 ranks on
two nodes) timed end to end, ``--backend slurm`` against Slurm's own launchers on the same
allocation.

    python benchmarks/slurm_launch.py [--repeat 5] [--warmup 1] [--json benchmarks/results/slurm_launch.json]

The cluster is the tests' (``tests/slurm_cluster.py``: Debian's slurm-wlm, two ``slurmd -N`` on
this machine, started here and stopped at the end), so it needs root and the packages of
``.ci/slurm-install``.  Launchers:

    srun-python          srun -n4 python script.py      (the script reads SLURM_PROCID/SLURM_NTASKS)
    srun-torchrun        srun -N2 --ntasks-per-node=1 torchrun --nnodes 2 --nproc-per-node 2 (c10d)
    torchdist-in-alloc   Distributor(4, backend="slurm") inside the allocation (SLURM_JOB_ID set):
                         the ranks are steps of it, as in a notebook started in salloc
    torchdist-own-alloc  Distributor(4, backend="slurm", nodes=2) outside one: each run asks
                         for its own allocation (salloc) and cancels it (scancel), as from a login node

The first three share one allocation (``salloc --no-shell -N2 -n4``), made once: "warm" in the
sense that nothing waits for the scheduler; the last pays for an allocation per run ("cold").
Rounds are interleaved; warm-up rounds are not counted.  Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

from report import machine, write_json  # noqa: E402  (this script's folder is on sys.path)

sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

SCRIPT = """\
import os
import torch
import torch.distributed as dist

rank = int(os.environ.get("RANK") or os.environ["SLURM_PROCID"])  # torchrun's, else Slurm's
world = int(os.environ.get("WORLD_SIZE") or os.environ["SLURM_NTASKS"])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", os.environ.get("BENCH_PORT", "29511"))
dist.init_process_group("gloo", rank=rank, world_size=world)
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
dist.destroy_process_group()
assert t.item() == 10.0, t.item()
"""

LAUNCHERS = ("srun-python", "srun-torchrun", "torchdist-in-alloc", "torchdist-own-alloc")


def all_reduce_job():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # a function's ranks set it up themselves (a cell's get one)
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_launchers(script: str, job: str, alloc_env: dict) -> dict:
    from torchdist_magic import Distributor

    def srun_python():
        env = dict(os.environ, BENCH_PORT=str(free_port()))
        subprocess.run(["srun", f"--jobid={job}", "-n4", "--quiet", sys.executable, script], env=env, check=True)
        return 10.0

    def srun_torchrun():
        endpoint = f"127.0.0.1:{free_port()}"
        argv = ["srun", f"--jobid={job}", "-N2", "--ntasks-per-node=1", "--quiet", sys.executable, "-m"]
        argv += ["torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d"]
        argv += [f"--rdzv-endpoint={endpoint}", "--rdzv-id=bench", script]
        subprocess.run(argv, check=True, capture_output=True)
        return 10.0

    def torchdist_in_alloc():
        saved = {k: os.environ.get(k) for k in alloc_env}
        os.environ.update(alloc_env)
        try:
            return Distributor(4, backend="slurm", show=None).run(all_reduce_job)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def torchdist_own_alloc():
        return Distributor(4, backend="slurm", show=None, backend_options={"nodes": "2"}).run(all_reduce_job)

    return {
        "srun-python": srun_python,
        "srun-torchrun": srun_torchrun,
        "torchdist-in-alloc": torchdist_in_alloc,
        "torchdist-own-alloc": torchdist_own_alloc,
    }


def measure(launchers: dict, names: list, repeat: int, warmup: int) -> dict:
    times = {name: [] for name in names}
    for round_no in range(warmup + repeat):
        for name in names:
            start = time.perf_counter()
            value = launchers[name]()
            elapsed = time.perf_counter() - start
            if value != 10.0:
                raise RuntimeError(f"{name} returned {value!r}, expected 10.0")
            if round_no >= warmup:
                times[name].append(elapsed)
            tag = "" if round_no >= warmup else " (warm-up)"
            print(f"  round {round_no + 1}/{warmup + repeat}  {name:<20} {elapsed:7.2f} s{tag}", flush=True)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "slurm_launch.json"))
    parser.add_argument("--only", nargs="+", choices=LAUNCHERS, default=list(LAUNCHERS))
    args = parser.parse_args(argv)

    import torch
    from slurm_cluster import SlurmCluster, why_not

    why = why_not()
    if why:
        print(f"slurm_launch: cannot run here: {why}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="torchdist-bench-slurm-") as tmp:
        script = os.path.join(tmp, "all_reduce.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(SCRIPT)
        cluster = SlurmCluster(os.path.join(tmp, "cluster"))
        os.makedirs(cluster.directory)
        cluster.start()
        os.environ["SLURM_CONF"] = cluster.conf
        job = None
        try:
            granted = cluster.run(["salloc", "--no-shell", "-N2", "-n4", "--ntasks-per-node=2", "--job-name=bench"])
            job = re.search(r"Granted job allocation (\d+)", granted.stderr).group(1)
            nodelist = cluster.run(["squeue", "-h", "-j", job, "-o", "%N"]).stdout.strip()
            alloc_env = {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": nodelist, "SLURM_TASKS_PER_NODE": "2(x2)"}
            launchers = make_launchers(script, job, alloc_env)
            times = measure(launchers, args.only, args.repeat, args.warmup)
        finally:
            if job:
                cluster.run(["scancel", job], check=False)
            cluster.stop()

    medians = {name: statistics.median(ts) for name, ts in times.items()}
    base = medians.get("srun-python")
    summary = {
        name: {
            "times_s": [round(t, 4) for t in ts],
            "median_s": round(medians[name], 4),
            "min_s": round(min(ts), 4),
            "vs_srun_python": round(medians[name] / base, 3) if base else None,
        }
        for name, ts in times.items()
    }
    header = f"{'launcher':<20} {'median s':>9} {'min s':>8} {'vs srun python':>15}"
    print()
    print(header)
    print("-" * len(header))
    for name, row in summary.items():
        ratio = "-" if row["vs_srun_python"] is None else f"{row['vs_srun_python']:.2f}x"
        print(f"{name:<20} {row['median_s']:>9.2f} {row['min_s']:>8.2f} {ratio:>15}")
    write_json(
        args.json,
        {
            "benchmark": "Slurm launch: gloo all_reduce of one tensor, 4 ranks on two nodes, end to end",
            "repeat": args.repeat,
            "warmup": args.warmup,
            "machine": machine(torch=torch.__version__),
            "cluster": "tests/slurm_cluster.py: slurm-wlm, two slurmd -N on one machine, proctrack/linuxproc",
            "launchers": summary,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
