"""What torchdist_magic costs a rank: the same DDP training script, steps of about 2 ms (a small
model, gloo, CPU) that call ``progress``, ``report`` and ``print`` every step, run by
torchdist_magic (local processes, the driver in this process, as a notebook's kernel would be)
and by plain ``torchrun`` (``python -m torch.distributed.run``), in interleaved rounds; and by
torchdist_magic with torch's Flight Recorder off (``TORCH_FR_BUFFER_SIZE=0``), which a run
otherwise turns on for every rank (``collectives``): the recorder's own cost.

    python benchmarks/rank_overhead.py [--ranks 2] [--steps 2000] [--rounds 5]
                                       [--json benchmarks/results/rank_overhead.json]

Under torchrun the script's ``progress`` and ``report`` do nothing (there is no run to report
to) and its output goes to a pipe this process reads, as a launcher's does; under
torchdist_magic they send to the run's channel, and the output goes through its launcher to the
run's logs.  Rank 0 times the steps after a warm-up and writes its steps/s to a file.  The
figure is the ratio of the medians, torchdist_magic / torchrun (1.0: no overhead).  Then what the
step split costs (``split_cost``): its share of the same model's step.  The ranks,
the driver (or torchrun's agent) and whatever else runs on the machine share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))

from report import machine, write_json  # noqa: E402  (this script's folder is on sys.path)

sys.path.insert(0, os.path.dirname(HERE))

WARMUP = 200

SCRIPT = textwrap.dedent('''
    import json, sys, time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torchdist_magic import progress, report

    steps, warmup, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                                        torch.nn.Linear(512, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    for i in progress(range(steps), desc="train"):
        if i == warmup:
            start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.item()
        report(loss=value, lr=1e-3, step_time=0.002)
        print(f"step {i} loss {value:.5f}")
    elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump({"steps_per_s": (steps - warmup) / elapsed}, fh)
    dist.destroy_process_group()
''')


def with_torchrun(script: str, ranks: int, steps: int, out: str) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            script,
            str(steps),
            str(WARMUP),
            out,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    if proc.returncode:
        raise RuntimeError(f"torchrun failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    with open(out) as fh:
        return json.load(fh)["steps_per_s"]


def with_torchdist(script: str, ranks: int, steps: int, out: str, env: Optional[dict] = None) -> float:
    from torchdist_magic import Distributor

    Distributor(ranks, local_mode=True, show=None, env=env or {}).run(script, str(steps), str(WARMUP), out)
    with open(out) as fh:
        return json.load(fh)["steps_per_s"]


def without_recorder(script: str, ranks: int, steps: int, out: str) -> float:
    return with_torchdist(script, ranks, steps, out, env={"TORCH_FR_BUFFER_SIZE": "0"})


def _discarding_driver(addresses) -> None:
    """A real ``ChannelServer`` that drops what it gets, in a process of its own."""
    from torchdist_magic.wire.server import ChannelServer

    server = ChannelServer(lambda record: None, "overhead", secret="s", launcher_secret="l")
    addresses.put(server.address)
    time.sleep(600)


def reporting_cost(calls: int = 20_000) -> dict:
    """CPU microseconds per step that ``progress`` and ``report`` (3 values) cost a rank in a
    tight loop, with no run and with a real client sending to a real driver (its sender thread
    included: it runs on the rank's interpreter too).  Load-independent, unlike steps/s."""
    import multiprocessing

    from torchdist_magic.core.rankenv import rank_key
    from torchdist_magic.wire.client import ChannelClient
    from torchdist_magic.rank import runtime

    context = multiprocessing.get_context("spawn")
    addresses = context.Queue()
    driver = context.Process(target=_discarding_driver, args=(addresses,), daemon=True)
    driver.start()
    host, port = addresses.get(timeout=60)

    def per_step() -> float:
        started = time.process_time()
        for _ in runtime.progress(range(calls)):
            runtime.report(loss=0.5, lr=1e-3, step_time=0.002)
        return 1e6 * (time.process_time() - started) / calls

    try:
        alone = per_step()
        client = ChannelClient(f"{host}:{port}", rank_key("s", "worker", 0), "overhead", 0)
        runtime._install_sink(client)
        reporting = per_step()
        client.close()
        runtime._install_sink(None)
    finally:
        driver.kill()
        driver.join()
    return {"calls": calls, "no_run_us": alone, "reporting_us": reporting}


def _recorder_rank(rank: int, port: int, recorder: bool, calls: int, out) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        TORCH_FR_BUFFER_SIZE="256" if recorder else "0",
    )
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tensor = torch.ones(16)
    for _ in range(200):
        dist.all_reduce(tensor)
    started = time.thread_time()
    for _ in range(calls):
        dist.all_reduce(tensor)
    if rank == 0:
        out.put(1e6 * (time.thread_time() - started) / calls)
    dist.destroy_process_group()


def recorder_cost(calls: int = 5000, rounds: int = 3) -> dict:
    """CPU microseconds of the calling thread per ``all_reduce`` of 16 floats (2 ranks, gloo),
    with torch's Flight Recorder on (256 entries, as a run sets it) and off: what recording a
    collective costs, apart from the collective's own wait.  Load-independent, unlike steps/s."""
    import multiprocessing
    import socket

    context = multiprocessing.get_context("spawn")
    found = {"on": [], "off": []}
    for i in range(rounds):
        for recorder in (True, False) if i % 2 == 0 else (False, True):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = context.Queue()
            procs = [context.Process(target=_recorder_rank, args=(r, port, recorder, calls, out)) for r in range(2)]
            for p in procs:
                p.start()
            found["on" if recorder else "off"].append(out.get(timeout=600))
            for p in procs:
                p.join(60)
    return {
        "calls": calls,
        "rounds": rounds,
        "on_us": statistics.median(found["on"]),
        "off_us": statistics.median(found["off"]),
        "runs": found,
    }


class _Discard:
    def send(self, record) -> None:
        pass


def split_cost(steps: int = 20_000, ddp_steps: int = 100, ddp_pairs: int = 30, rounds: int = 7) -> dict:
    """What the step split (``stepsplit``) costs a rank, in CPU microseconds (load-independent,
    unlike steps/s): per step of a ``progress()`` loop (timing the wait for each item, a record
    a second), per read of DDP's timers (one every ``POLL_EVERY`` s at most), per collective
    timed; and per DDP step, CPU microseconds of the benchmark's model with DDP's timers on every
    iteration (sample rate 1, as the split sets it) against DDP's default (every 100th), on a
    one-rank gloo group in this process with one thread (a machine's other load then moves the
    figures least): the median difference of ``ddp_pairs`` pairs of rounds."""
    import torch
    import torch.distributed as dist

    from torchdist_magic.rank import runtime, stepsplit

    def loop_us(split_on: bool) -> float:
        runtime._install_sink(_Discard())
        if not split_on:
            runtime._split = None
        started = time.process_time()
        for _ in runtime.progress(range(steps)):
            pass
        used = time.process_time() - started
        runtime._install_sink(None)
        return 1e6 * used / steps

    plain = statistics.median(loop_us(False) for _ in range(rounds))
    split = statistics.median(loop_us(True) for _ in range(rounds))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
        )
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = torch.randn(64, 256), torch.randn(64, 256)

        def ddp_step_us(rate: int) -> float:
            model._set_ddp_runtime_logging_sample_rate(rate)
            started = time.process_time()
            for _ in range(ddp_steps):
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            return 1e6 * (time.process_time() - started) / ddp_steps

        ddp_step_us(100)  # warm-up
        timed, default = [], []
        for i in range(ddp_pairs):  # pairs, each order in turn: the median of their differences
            for rate in (1, 100) if i % 2 == 0 else (100, 1):
                (timed if rate == 1 else default).append(ddp_step_us(rate))
        timers_us = statistics.median(t - d for t, d in zip(timed, default))
        reads = 2000
        started = time.process_time()
        for _ in range(reads):
            model._get_ddp_logging_data()
        read_us = 1e6 * (time.process_time() - started) / reads

        tensor = torch.ones(4)
        calls = 5000
        meter = stepsplit.StepSplit(lambda record: None, lambda: 0)
        meter.enter()

        def collective_us(through_split: bool) -> float:
            started = time.process_time()
            for _ in range(calls):
                if through_split:
                    meter.collective(dist.all_reduce, tensor)
                else:
                    dist.all_reduce(tensor)
            return 1e6 * (time.process_time() - started) / calls

        direct = statistics.median(collective_us(False) for _ in range(rounds))
        wrapped = statistics.median(collective_us(True) for _ in range(rounds))
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    step_ms = statistics.median(default) / 1000
    return {
        "progress_step_plain_us": plain,
        "progress_step_split_us": split,
        "ddp_step_default_us": statistics.median(default),
        "ddp_step_timers_us": statistics.median(timed),
        "ddp_timers_us": timers_us,
        "ddp_timer_read_us": read_us,
        "reads_per_s": 1 / stepsplit.POLL_EVERY,
        "collective_direct_us": direct,
        "collective_timed_us": wrapped,
        # per step of this model: the loop's, the timers' (a negative difference: below what a
        # busy machine lets this measure, counted as none) and the reads' (a share of each second)
        "cost_percent_of_step": 100
        * ((split - plain + max(timers_us, 0.0)) / 1000 / step_ms + read_us / 1e6 / stepsplit.POLL_EVERY),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "rank_overhead.json"))
    args = parser.parse_args()

    import torch

    runners = {"torchrun": with_torchrun, "torchdist_magic": with_torchdist, "no recorder": without_recorder}
    runs = {name: [] for name in runners}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as fh:
            fh.write(SCRIPT)
        for i in range(args.rounds):
            order = list(runners) if i % 2 == 0 else list(reversed(runners))  # a busy moment hits both alike
            for name in order:
                out = os.path.join(tmp, f"{name}-{i}.json")
                started = time.monotonic()
                runs[name].append(runners[name](script, args.ranks, args.steps, out))
                print(
                    f"round {i + 1}/{args.rounds} {name:<16} {runs[name][-1]:8.1f} steps/s "
                    f"({time.monotonic() - started:.1f} s with start-up)",
                    flush=True,
                )
    cost = reporting_cost()
    recording = recorder_cost()
    split = split_cost()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratio = medians["torchdist_magic"] / medians["torchrun"]
    recorder = medians["torchdist_magic"] / medians["no recorder"]
    load = os.getloadavg()
    print(f"\n{'launcher':<16} {'steps/s (median)':>16} {'min':>8} {'max':>8}")
    for name, values in runs.items():
        print(f"{name:<16} {medians[name]:>16.1f} {min(values):>8.1f} {max(values):>8.1f}")
    print(
        f"torchdist_magic / torchrun: {ratio:.3f}x ({args.ranks} ranks, {args.steps} steps of which "
        f"{WARMUP} warm-up, {args.rounds} interleaved rounds; load average {load[0]:.1f} on "
        f"{machine()['cores']} cores)"
    )
    print(f"Flight Recorder on / off (torchdist_magic, TORCH_FR_BUFFER_SIZE=0 for off): {recorder:.3f}x")
    print(
        f"Flight Recorder per all_reduce, CPU of the calling thread: {recording['on_us']:.1f} us on, "
        f"{recording['off_us']:.1f} us off (2 ranks, gloo, 16 floats)"
    )
    print(
        f"progress + report (3 values) per step, CPU of the rank: {cost['reporting_us']:.1f} us reporting to "
        f"a driver, {cost['no_run_us']:.1f} us outside a run"
    )
    print(
        f"step split: {split['progress_step_split_us'] - split['progress_step_plain_us']:.2f} us of CPU per "
        f"progress() step; DDP's timers on every iteration {split['ddp_timers_us']:+.1f} us per step of "
        f"{split['ddp_step_default_us']:.0f} us; a read of them {split['ddp_timer_read_us']:.0f} us "
        f"(at most {split['reads_per_s']:.0f}/s); a timed collective {split['collective_timed_us']:.1f} us, "
        f"{split['collective_direct_us']:.1f} us untimed; in all {split['cost_percent_of_step']:.2f}% of a step"
    )
    write_json(
        args.json,
        {
            "benchmark": "a rank's overhead: torchdist_magic vs torchrun, same DDP script",
            "machine": machine(torch=torch.__version__),
            "ranks": args.ranks,
            "steps": args.steps,
            "warmup": WARMUP,
            "rounds": args.rounds,
            "runs": runs,
            "medians": medians,
            "ratio": ratio,
            "recorder_ratio": recorder,
            "load_average": load,
            "reporting_cost": cost,
            "recorder_cost": recording,
            "step_split_cost": split,
        },
    )


if __name__ == "__main__":
    main()
