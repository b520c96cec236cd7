"""Recovery from a lost rank's host: how long until the failure is seen, until the next attempt
takes its first step, and how many steps are done again.

    python benchmarks/recovery.py [--repeat 3] [--spark-repeat 1] [--no-spark]
                                  [--json benchmarks/results/recovery.json]

The job: ``all_reduce`` steps of 0.2 s, a checkpoint every ``CHECKPOINT_EVERY`` steps, resumed
from the newest one.  Once every rank has taken ``KILL_AT`` steps, this script kills from outside:

- local processes (2 ranks, ``max_restarts=1``): rank 1's process, by SIGKILL (what the OOM killer
  does; a root cause of class ``machine``);
- Spark ``local-cluster[3,1,1024]`` (``--np 2:3``, ``max_restarts=1``): the executor JVM under
  rank 2, found from the rank's own process tree and killed by SIGKILL (a lost worker: class
  ``lost``); the next attempt goes on with two ranks, that executor left out.

Measured from the kill (this script's clock, just before ``os.kill``): ``detection_s``, to the
first failure the run recorded; ``attempt_end_s``, to the end of the first attempt (every rank
stopped); ``first_step_s``, to the first step of the next attempt (the slowest rank's first
``all_reduce`` after resuming); ``steps_lost``, the steps taken since the checkpoint the next
attempt resumed from.

Warm pools are not measured: a warm run refuses ``max_restarts`` (a pool keeps its ranks and
cannot start them again), so a warm run that loses a rank fails, with nothing to recover.
Prints a table (median, min, max) naming the machine and its load, and writes every figure to
the JSON file.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

from report import describe_machine, load, machine, spark_session, write_json  # noqa: E402

sys.path.insert(0, os.path.dirname(HERE))

KILL_AT = 8
CHECKPOINT_EVERY = 5
STEPS = 20
STEP_S = 0.2
CLUSTER = "local-cluster[3,1,1024]"


def recovering_job(marks: str, steps: int, every: int, pause: float):
    """Checkpointed all_reduce steps on however many ranks there are; each rank stamps its first
    step after a restart, rank 0 the steps it reached in every attempt."""
    import torch
    import torch.distributed as dist

    from torchdist_magic import load_checkpoint, progress, rank, restart_count, save_checkpoint, world_size

    dist.init_process_group("gloo")
    state = load_checkpoint() or {"step": 0}
    attempt = restart_count()
    with open(os.path.join(marks, f"resumed-{attempt}"), "w") as fh:
        fh.write(str(state["step"]))
    first = True
    for step in progress(range(state["step"], steps), desc="step"):
        dist.all_reduce(torch.ones(1))
        if first and attempt > 0:
            with open(os.path.join(marks, f"first-step-{rank()}"), "w") as fh:
                fh.write(repr(time.time()))
        first = False
        if rank() == 0:
            with open(os.path.join(marks, f"reached-{attempt}"), "w") as fh:
                fh.write(str(step + 1))
        if (step + 1) % every == 0:
            save_checkpoint({"step": step + 1}, step=step + 1)
        time.sleep(pause)
    dist.destroy_process_group()
    return world_size()


def java_ancestor(pid: int) -> int:
    """The nearest ``java`` process above ``pid`` (a Spark rank's executor JVM), by /proc."""
    while pid > 1:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            stat = fh.read()
        if stat[stat.index("(") + 1 : stat.rindex(")")] == "java":
            return pid
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    raise RuntimeError("no executor JVM above the rank's process")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def measure(spark: bool) -> dict:
    from torchdist_magic import Distributor
    from torchdist_magic.driver.status import run_status

    with tempfile.TemporaryDirectory(prefix="torchdist-bench-recovery-") as tmp:
        marks, checkpoints = os.path.join(tmp, "marks"), os.path.join(tmp, "checkpoints")
        os.makedirs(marks)
        np = (2, 3) if spark else 2
        run = Distributor(np, local_mode=not spark, show=None, max_restarts=1, checkpoint_dir=checkpoints).submit(
            recovering_job, marks, STEPS, CHECKPOINT_EVERY, STEP_S
        )
        victim = 2 if spark else 1
        deadline = time.monotonic() + 600
        while True:
            status = run_status(run.state)
            bars = [r["progress"] for r in status["ranks"]]
            if status["attempt"] == 1 and all(b and b["n"] >= KILL_AT for b in bars):
                break
            if run.done() or time.monotonic() > deadline:
                raise RuntimeError(f"the run never reached step {KILL_AT}: {status['state']}")
            time.sleep(0.05)
        pid = status["ranks"][victim]["pid"]
        target = java_ancestor(pid) if spark else pid
        killed = time.time()
        os.kill(target, signal.SIGKILL)
        worlds = run.result(timeout=600)
        first = run.attempts[0]
        resumed = int(_read(os.path.join(marks, "resumed-1")))
        reached = int(_read(os.path.join(marks, "reached-0")))
        ranks = run.options.num_processes
        first_step = max(float(_read(os.path.join(marks, f"first-step-{r}"))) for r in range(ranks))
        return {
            "detection_s": min(f.time for f in first.failures) - killed,
            "attempt_end_s": first.ended - killed,
            "first_step_s": first_step - killed,
            "steps_lost": float(reached - resumed),
            "world_sizes": [first.world_size, worlds],
            "fault": first.fault.kind if first.fault else "",
            "excluded": [e.sentence() for e in run.state.excluded],
        }


def stats(values: list) -> dict:
    return {
        "values": [round(v, 4) for v in values],
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


MEASURES = ("detection_s", "attempt_end_s", "first_step_s", "steps_lost")


def print_table(rows: dict, about: dict) -> None:
    header = f"{'backend':<40} {'measure':<15} {'median':>8} {'min':>8} {'max':>8}"
    print(header)
    print("-" * len(header))
    for mode, row in rows.items():
        for name in MEASURES:
            cell = row[name]
            print(f"{mode:<40} {name:<15} {cell['median']:>8.2f} {cell['min']:>8.2f} {cell['max']:>8.2f}")
        print(f"{'':<40} fault {about[mode]['fault']}; world sizes {about[mode]['world_sizes']}")
        for sentence in about[mode]["excluded"]:
            print(f"{'':<40} {sentence}")
    print("warm pools: not measured (a warm run refuses max_restarts: nothing restarts)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs on local processes")
    parser.add_argument("--spark-repeat", type=int, default=1, help=f"runs on Spark {CLUSTER}")
    parser.add_argument("--no-spark", action="store_true", help="local processes only")
    parser.add_argument(
        "--json",
        default=os.path.join(HERE, "results", "recovery.json"),
        help="where to write the figures (default: benchmarks/results/recovery.json)",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.spark_repeat < 1:
        parser.error("--repeat and --spark-repeat must be at least 1")

    import torch

    load_before = load()
    modes = [("local processes, np 2", False, args.repeat)]
    spark = None
    if not args.no_spark:
        spark = spark_session("torchdist recovery benchmark", CLUSTER)
        modes.append((f"spark {CLUSTER}, np 2:3", True, args.spark_repeat))
    samples: dict = {}
    about: dict = {}
    for mode, on_spark, repeat in modes:
        for round_no in range(repeat):
            got = measure(on_spark)
            for name in MEASURES:
                samples.setdefault(mode, {}).setdefault(name, []).append(got[name])
            about[mode] = {k: got[k] for k in ("fault", "world_sizes", "excluded")}
            print(
                f"  {mode} round {round_no + 1}/{repeat}: seen after {got['detection_s']:.2f} s, next first "
                f"step after {got['first_step_s']:.2f} s, {got['steps_lost']:.0f} steps lost",
                flush=True,
            )
    if spark is not None:
        spark.stop()

    rows = {mode: {name: stats(values) for name, values in by.items()} for mode, by in samples.items()}
    info = machine(torch=torch.__version__)
    print()
    print(
        f"recovery from a killed rank's host on {describe_machine(info)}; load {load_before} before, {info['load']} after"
    )
    print_table(rows, about)
    write_json(
        args.json,
        {
            "benchmark": "recovery: a rank's host killed mid-run; detection, next first step, steps lost",
            "kill_at_step": KILL_AT,
            "checkpoint_every": CHECKPOINT_EVERY,
            "step_s": STEP_S,
            "load_before": load_before,
            "machine": info,
            "measures": rows,
            "runs": about,
            "warm_pools": "not measured: a warm run refuses max_restarts, so nothing restarts",
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
