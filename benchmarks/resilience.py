"""Restart latency and the hang watchdog's detection time, 2 ranks (gloo).

    python benchmarks/resilience.py [--repeat 5] [--hang-timeout 2] [--spark]
                                    [--json benchmarks/results/resilience.json]

Restart latency: rank 1 SIGKILLs itself at step 10 of the first attempt (``max_restarts=1``,
checkpoints every step); measured from its death (the rank's own clock, just before the kill)
to the first step of the next attempt (the slower rank's first ``all_reduce`` after resuming),
with the part spent stopping the first attempt (death to the end of that attempt: the driver
notices, stops the survivor, cleans up) shown apart.

Watchdog detection: rank 1 sleeps while rank 0 waits in ``all_reduce``, both silent after their
last line; measured from that last line to the run's end (every rank's stacks captured, every
rank stopped), and that time less ``hang_timeout`` (what the watchdog adds to the quiet time it
waits for by design).

``--spark`` also measures both on a ``local[2]`` Spark session (each attempt a barrier stage).
Prints a table (median, min, max) and writes every time to the JSON file.
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

from report import machine, spark_session, write_json  # noqa: E402  (this script's folder is on sys.path)

sys.path.insert(0, os.path.dirname(HERE))


def restart_job(marks: str, kill_at: int, steps: int):
    """Checkpointed all_reduce steps; rank 1 dies at ``kill_at`` on the first attempt; the
    first step of a later attempt is stamped in ``marks``."""
    import torch
    import torch.distributed as dist

    from torchdist_magic import load_checkpoint, rank, restart_count, save_checkpoint

    dist.init_process_group("gloo")
    state = load_checkpoint() or {"step": 0}
    first = True
    for step in range(state["step"], steps):
        dist.all_reduce(torch.ones(1))
        if first and restart_count() > 0:
            with open(os.path.join(marks, f"first-step-{rank()}"), "w") as fh:
                fh.write(repr(time.time()))
        first = False
        save_checkpoint({"step": step + 1}, step=step + 1)
        if step + 1 == kill_at and rank() == 1 and restart_count() == 0:
            with open(os.path.join(marks, "death"), "w") as fh:
                fh.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()
    return restart_count()


def _say_until(done, text: str) -> None:
    while not done.wait(0.5):
        print(text, flush=True)


def hang_job():
    """Rank 1 sleeps, rank 0 waits for it in all_reduce; each prints the time it went quiet.
    While they set up (torch's import takes a while) they keep printing: only the hang is quiet."""
    import threading

    done = threading.Event()
    threading.Thread(target=_say_until, args=(done, "setting up"), daemon=True).start()
    import torch
    import torch.distributed as dist

    from torchdist_magic import rank

    dist.init_process_group("gloo")
    dist.barrier()
    done.set()
    print(f"quiet from {time.time()!r}", flush=True)
    if rank() == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))


def _read(path: str) -> float:
    with open(path, encoding="utf-8") as fh:
        return float(fh.read())


def measure_restart(local_mode: bool) -> dict:
    from torchdist_magic import Distributor

    with tempfile.TemporaryDirectory(prefix="torchdist-bench-restart-") as tmp:
        marks, checkpoints = os.path.join(tmp, "marks"), os.path.join(tmp, "checkpoints")
        os.makedirs(marks)
        run = Distributor(2, local_mode=local_mode, show=None, max_restarts=1, checkpoint_dir=checkpoints).submit(
            restart_job, marks, 10, 20
        )
        if run.result(timeout=600) != 1:
            raise RuntimeError("the job did not restart")
        death = _read(os.path.join(marks, "death"))
        first_step = max(_read(os.path.join(marks, f"first-step-{r}")) for r in range(2))
        return {
            "death_to_next_first_step_s": first_step - death,
            "death_to_attempt_end_s": run.attempts[0].ended - death,
        }


def measure_hang(local_mode: bool, hang_timeout: float) -> dict:
    from torchdist_magic import Distributor, HangTimeout

    run = Distributor(2, local_mode=local_mode, show=None, hang_timeout=hang_timeout).submit(hang_job)
    try:
        run.result(timeout=600)
    except HangTimeout:
        pass
    else:
        raise RuntimeError("the watchdog did not fire")
    quiet = max(
        float(line.split()[-1]) for r in range(2) for line in run.logs(r).splitlines() if line.startswith("quiet from ")
    )
    stacks = max(s.time for s in run.stacks.values())
    return {
        "quiet_to_error_s": run.state.ended - quiet,
        "overhead_s": run.state.ended - quiet - hang_timeout,
        "stacks_captured_after_s": stacks - quiet - hang_timeout,
    }


def stats(values: list) -> dict:
    return {
        "times_s": [round(v, 4) for v in values],
        "median_s": round(statistics.median(values), 4),
        "min_s": round(min(values), 4),
        "max_s": round(max(values), 4),
    }


def print_table(rows: dict) -> None:
    header = f"{'measure':<46} {'median s':>9} {'min s':>8} {'max s':>8}"
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        print(f"{name:<46} {row['median_s']:>9.2f} {row['min_s']:>8.2f} {row['max_s']:>8.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each measure")
    parser.add_argument("--hang-timeout", type=float, default=2.0, help="the watchdog's quiet time (s)")
    parser.add_argument("--spark", action="store_true", help="also on a local[2] Spark session")
    parser.add_argument(
        "--json",
        default=os.path.join(HERE, "results", "resilience.json"),
        help="where to write the times (default: benchmarks/results/resilience.json)",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.hang_timeout <= 0:
        parser.error("--repeat must be at least 1 and --hang-timeout positive")

    import torch

    modes = [("local", True)]
    spark = None
    if args.spark:
        spark = spark_session("torchdist resilience benchmark")
        modes.append(("spark local[2]", False))
    samples: dict = {}
    for mode, local_mode in modes:
        for round_no in range(args.repeat):
            restart = measure_restart(local_mode)
            hang = measure_hang(local_mode, args.hang_timeout)
            for key, value in {**restart, **hang}.items():
                samples.setdefault(f"{mode}: {key}", []).append(value)
            print(
                f"  {mode} round {round_no + 1}/{args.repeat}: restart "
                f"{restart['death_to_next_first_step_s']:.2f} s, hang detected "
                f"{hang['quiet_to_error_s']:.2f} s after the last output",
                flush=True,
            )
    if spark is not None:
        spark.stop()

    rows = {name: stats(values) for name, values in samples.items()}
    print()
    print_table(rows)
    print(f"(hang_timeout={args.hang_timeout:g} s: overhead = quiet-to-error less hang_timeout)")
    result = {
        "benchmark": "resilience: restart latency and hang watchdog detection, 2 ranks, gloo",
        "repeat": args.repeat,
        "hang_timeout_s": args.hang_timeout,
        "machine": machine(torch=torch.__version__),
        "measures": rows,
    }
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
