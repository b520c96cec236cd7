"""What torchdist_magic costs a rank: the same DDP training script, steps of about 2 ms (a small
model, gloo, CPU) that call ``progress``, ``report`` and ``print`` every step, run by
torchdist_magic (local processes, the driver in this process, as a notebook's kernel would be)
and by plain ``torchrun`` (``python -m torch.distributed.run``), in interleaved rounds.

    python benchmarks/rank_overhead.py [--ranks 2] [--steps 2000] [--rounds 5]
                                       [--json benchmarks/results/rank_overhead.json]

Under torchrun the script's ``progress`` and ``report`` do nothing (there is no run to report
to) and its output goes to a pipe this process reads, as a launcher's does; under
torchdist_magic they send to the run's channel, and the output goes through its launcher to the
run's logs.  Rank 0 times the steps after a warm-up and writes its steps/s to a file.  The
figure is the ratio of the medians, torchdist_magic / torchrun (1.0: no overhead).  The ranks,
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
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                           script, str(steps), str(WARMUP), out], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if proc.returncode:
        raise RuntimeError(f"torchrun failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    with open(out) as fh:
        return json.load(fh)["steps_per_s"]


def with_torchdist(script: str, ranks: int, steps: int, out: str) -> float:
    from torchdist_magic import Distributor

    Distributor(ranks, local_mode=True, show=None).run(script, str(steps), str(WARMUP), out)
    with open(out) as fh:
        return json.load(fh)["steps_per_s"]


def _discarding_driver(addresses) -> None:
    """A real ``ChannelServer`` that drops what it gets, in a process of its own."""
    from torchdist_magic.channel import ChannelServer

    server = ChannelServer(lambda record: None, "overhead", secret="s", launcher_secret="l")
    addresses.put(server.address)
    time.sleep(600)


def reporting_cost(calls: int = 20_000) -> dict:
    """CPU microseconds per step that ``progress`` and ``report`` (3 values) cost a rank in a
    tight loop, with no run and with a real client sending to a real driver (its sender thread
    included: it runs on the rank's interpreter too).  Load-independent, unlike steps/s."""
    import multiprocessing

    from torchdist_magic import channel, runtime

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
        client = channel.ChannelClient(f"{host}:{port}", channel.rank_key("s", "worker", 0), "overhead", 0)
        runtime._install_sink(client)
        reporting = per_step()
        client.close()
        runtime._install_sink(None)
    finally:
        driver.kill()
        driver.join()
    return {"calls": calls, "no_run_us": alone, "reporting_us": reporting}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "rank_overhead.json"))
    args = parser.parse_args()

    import torch

    runners = {"torchrun": with_torchrun, "torchdist_magic": with_torchdist}
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
                print(f"round {i + 1}/{args.rounds} {name:<16} {runs[name][-1]:8.1f} steps/s "
                      f"({time.monotonic() - started:.1f} s with start-up)", flush=True)
    cost = reporting_cost()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratio = medians["torchdist_magic"] / medians["torchrun"]
    load = os.getloadavg()
    print(f"\n{'launcher':<16} {'steps/s (median)':>16} {'min':>8} {'max':>8}")
    for name, values in runs.items():
        print(f"{name:<16} {medians[name]:>16.1f} {min(values):>8.1f} {max(values):>8.1f}")
    print(f"torchdist_magic / torchrun: {ratio:.3f}x ({args.ranks} ranks, {args.steps} steps of which "
          f"{WARMUP} warm-up, {args.rounds} interleaved rounds; load average {load[0]:.1f} on "
          f"{machine()['cores']} cores)")
    print(f"progress + report (3 values) per step, CPU of the rank: {cost['reporting_us']:.1f} us reporting to "
          f"a driver, {cost['no_run_us']:.1f} us outside a run")
    write_json(args.json, {"benchmark": "a rank's overhead: torchdist_magic vs torchrun, same DDP script",
                           "machine": machine(torch=torch.__version__), "ranks": args.ranks, "steps": args.steps,
                           "warmup": WARMUP, "rounds": args.rounds, "runs": runs, "medians": medians,
                           "ratio": ratio, "load_average": load, "reporting_cost": cost})


if __name__ == "__main__":
    main()
