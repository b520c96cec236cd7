"""What torchdist_magic costs a rank, end to end and part by part.

    python benchmarks/rank_overhead.py --end-to-end      # torchrun vs Distributor.run: a quiet machine
    python benchmarks/rank_overhead.py --parts-only      # each part's cost (CPU time, instructions)
    python benchmarks/rank_overhead.py --instructions-only   # callgrind's counts only (any load)
    python benchmarks/rank_overhead.py                   # all of it
        [--ranks 2 4 8] [--steps 1000] [--rounds 5] [--before TREE]
        [--json benchmarks/results/rank_overhead.json]

Each mode writes its own sections of the JSON and keeps the others it finds there.

End to end: the same DDP training script, steps of about 2 ms (a small model, gloo, CPU) that
call ``progress``, ``report`` and ``print`` every step, run by ``torchrun`` (``python -m
torch.distributed.run``) and by torchdist_magic (local processes, its driver in a process of its
own), in interleaved rounds at each number of ranks; ``--before TREE`` adds the package found
in ``TREE`` (an earlier checkout: ``git archive COMMIT torchdist_magic | tar -x -C TREE``).
Under torchrun ``progress`` and ``report`` do nothing (there is no run) and the output goes to a
pipe this process reads, as a launcher's does.  Rank 0 times the steps after a warm-up; the
figure is the ratio of the medians, torchdist_magic / torchrun (1.0: no overhead); beside it the
paired ratio (the median of each round's two runs' ratio, which leaves out how the machine's
speed moved from round to round) and each launcher process's own CPU while rank 0 timed its
steps (torchrun's agent, torchdist_magic's driver: read from ``/proc`` the same way for both).
The ranks, the driver and whatever else runs on the machine share its cores: steps/s move with
the load.
Both launchers' ranks get the same ``OMP_NUM_THREADS`` (``THREADS``, unless it is set): left to
themselves, torchrun gives each rank one thread where several share a machine and
torchdist_magic gives each the cores over the ranks, a setting and not an overhead (on 16 cores
8 threads made this small model's steps 1.8 times slower than one thread did).

Part by part, in CPU time (``time.thread_time`` of the rank's calling thread, or
``process_time`` where a part's work is on other threads of the rank), which a busy machine
moves far less than steps/s: per collective (an ``all_reduce`` of 16 floats, at each number of
ranks) the rank's own record (``collring``, the wrapper that writes it), the step split's timing
of it, torch's Flight Recorder (``--trace-collectives``); per step of an FSDP-like loop (100
small collectives a step) the same; per ``progress()`` step the split's timing of the data wait;
per DDP step its timers at sample rate 1; per step ``progress`` + ``report`` (3 values) sending
to a real driver, against the same calls with no run; and the driver's CPU per rank-step in the
end-to-end runs (reading and forwarding each rank's output, the channel's records).

Per call in instructions (valgrind's callgrind, a one-rank gloo group, every thread of the
process), which no load moves: an ``all_reduce`` as torch has it, through the run's wrapper (the
ring's record) and with the split's timing, with torch's Flight Recorder off and on; ``report()``
of 3 values (its points sent every 50 calls, as a run of 2 ms steps sends them every 0.1 s) and a
``progress()`` step with no run and in a run.  What ``progress`` does once an interval (a
``Progress`` record every 0.1 s, the split's every second) weighs more per step under callgrind,
which runs the process some 50 times slower or more, than in a real run: an upper bound.
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
import threading
import time
from typing import List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))

from report import describe_machine, machine, write_json  # noqa: E402  (this script's folder is on sys.path)

#: the tree whose torchdist_magic the parts are measured from (this checkout's unless named: an
#: earlier one's figures, ``RANK_OVERHEAD_TREE=TREE python benchmarks/rank_overhead.py --parts-only``)
TREE = os.environ.get("RANK_OVERHEAD_TREE") or os.path.dirname(HERE)
sys.path.insert(0, TREE)

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
    group = dist.distributed_c10d._get_default_group()
    for i in progress(range(steps), desc="train"):
        if i == warmup:
            start = time.perf_counter()
            counted = group._get_sequence_number_for_group()
            if dist.get_rank() == 0:
                open(out + ".start", "w").close()  # the launcher's CPU is read from here on
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
            collectives = (group._get_sequence_number_for_group() - counted) / (steps - warmup)
            json.dump({"steps_per_s": (steps - warmup) / elapsed, "collectives_per_step": collectives}, fh)
    dist.destroy_process_group()
''')


def _cpu_seconds(pid: int) -> float:
    """The CPU seconds process ``pid``'s live threads have run so far: the scheduler's own
    count, in nanoseconds (``/proc/PID/task/TID/schedstat``), where ``/proc/PID/stat`` counts in
    ticks of 10 ms, too coarse for a few milliseconds a second over a few seconds."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                total += int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            pass
    return total / 1e9


def _launch(command: List[str], env: dict, out: str) -> Tuple[int, bytes, bytes, float]:
    """Run a launcher (``command``) to its end; its exit code, output, and its own CPU (the
    launcher process, not its ranks) in milliseconds per second while rank 0 timed its steps:
    read the same way for torchrun's agent and torchdist_magic's driver, from outside, as
    rank 0 starts and ends its timing (``out`` + ``.start``, then ``out``)."""
    for path in (out, out + ".start"):
        if os.path.exists(path):
            os.unlink(path)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    got: dict = {}
    reader = threading.Thread(target=lambda: got.update(zip(("out", "err"), proc.communicate())), daemon=True)
    reader.start()
    marks = []  # (monotonic, launcher CPU s) at the start and at the end of the timed steps
    for path in (out + ".start", out):
        while not os.path.exists(path) and proc.poll() is None:
            time.sleep(0.05)  # as often for either launcher: a wake-up of this process each time
        try:
            marks.append((time.monotonic(), _cpu_seconds(proc.pid)))
        except OSError:  # it ended first
            break
    reader.join()
    launcher_ms_per_s = float("nan")
    if len(marks) == 2 and marks[1][0] > marks[0][0]:
        launcher_ms_per_s = 1000 * (marks[1][1] - marks[0][1]) / (marks[1][0] - marks[0][0])
    return proc.returncode, got.get("out", b""), got.get("err", b""), launcher_ms_per_s


def with_torchrun(script: str, ranks: int, steps: int, out: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    code, _, err, launcher = _launch(
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
        env,
        out,
    )
    if code:
        raise RuntimeError(f"torchrun failed ({code}): {err.decode()[-2000:]}")
    with open(out) as fh:
        found = json.load(fh)
    found["launcher_ms_per_s"] = launcher
    return found


#: how many times a failed run is run again (torchrun's or torchdist_magic's: a rank that torch's
#: gloo teardown aborts, SIGABRT, now and then on a loaded machine; each one is in the JSON)
RETRIES = 3

#: the driver of a torchdist_magic run, in a process of its own: its CPU seconds on stdout
DRIVER = (
    "import sys, time\n"
    "from torchdist_magic import Distributor\n"
    "Distributor(int(sys.argv[1]), local_mode=True, show=None).run(*sys.argv[2:])\n"
    "print(time.process_time())\n"
)


def with_torchdist(script: str, ranks: int, steps: int, out: str, tree: str = "") -> dict:
    """A run of ``script`` by the torchdist_magic of ``tree`` (this checkout's by default)."""
    tree = tree or os.path.dirname(HERE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
    code, stdout, err, launcher = _launch(
        [sys.executable, "-c", DRIVER, str(ranks), script, str(steps), str(WARMUP), out], env, out
    )
    if code:
        raise RuntimeError(f"torchdist_magic failed ({code}): {err.decode()[-2000:]}")
    with open(out) as fh:
        found = json.load(fh)
    found["driver_cpu_s"] = float(stdout.decode().split()[-1])
    found["launcher_ms_per_s"] = launcher
    return found


def _discarding_driver(addresses) -> None:
    """A real ``ChannelServer`` that drops what it gets, in a process of its own."""
    from torchdist_magic.wire.server import ChannelServer

    server = ChannelServer(lambda record: None, "overhead", secret="s", launcher_secret="l")
    addresses.put(server.address)
    time.sleep(600)


def reporting_cost(calls: int = 20_000, rounds: int = 3) -> dict:
    """CPU microseconds per step that ``progress`` and ``report`` (3 values) cost a rank in a
    tight loop, with no run and with a real client sending to a real driver: the process's CPU
    from the loop's start until the client has sent every point and closed (its sender thread
    and the report batch's run on the rank's interpreter too).  Load-independent, unlike steps/s;
    the median of ``rounds``."""
    import multiprocessing

    from torchdist_magic.core.rankenv import rank_key
    from torchdist_magic.wire.client import ChannelClient
    from torchdist_magic.rank import runtime

    context = multiprocessing.get_context("spawn")
    addresses = context.Queue()
    driver = context.Process(target=_discarding_driver, args=(addresses,), daemon=True)
    driver.start()
    host, port = addresses.get(timeout=60)

    def loop() -> None:
        for _ in runtime.progress(range(calls)):
            runtime.report(loss=0.5, lr=1e-3, step_time=0.002)

    def alone() -> float:
        started = time.process_time()
        loop()
        return 1e6 * (time.process_time() - started) / calls

    def reporting(i: int) -> float:  # a client of its own each round: rank i's
        client = ChannelClient(f"{host}:{port}", rank_key("s", "worker", i), "overhead", i)
        client.reaches_driver(30)
        runtime._install_sink(client)
        started = time.process_time()
        loop()
        getattr(runtime, "flush_reports", lambda: None)()  # a tree before the batch has none
        client.close()
        used = time.process_time() - started
        runtime._install_sink(None)
        return 1e6 * used / calls

    found = {"no_run": [], "reporting": []}
    try:
        for i in range(rounds):
            found["no_run"].append(alone())
            found["reporting"].append(reporting(i))
    finally:
        driver.kill()
        driver.join()
    return {
        "calls": calls,
        "no_run_us": statistics.median(found["no_run"]),
        "reporting_us": statistics.median(found["reporting"]),
        "runs": found,
    }


#: per collective of the micro-benchmark: an all_reduce of this many floats
SMALL = 16
#: collectives per step of the FSDP-like loop, and their size
FSDP_COLLECTIVES, FSDP_FLOATS = 100, 1024


def _collective_rank(rank: int, ranks: int, port: int, recorder: bool, calls: int, rounds: int, out) -> None:
    """One rank of ``collective_costs``: CPU microseconds of this thread per ``all_reduce`` as
    torch has it (``bare``), through the run's wrapper with no split (``ring``: the record only)
    and with the split timing it inside a loop (``ring+split``: what a run does), in interleaved
    rounds; and per FSDP-like step, bare and as a run does."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(ranks),
        TORCH_FR_BUFFER_SIZE="256" if recorder else "0",
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from torchdist_magic.rank import stepsplit

    dist.init_process_group("gloo")
    bare = c10d.all_reduce
    current = [None]
    stepsplit.patch_collectives(c10d, lambda: current[0])
    wrapped = c10d.all_reduce
    split = stepsplit.StepSplit(lambda record: None, lambda: rank)
    split.enter()
    tensor, pieces = torch.ones(SMALL), [torch.ones(FSDP_FLOATS) for _ in range(FSDP_COLLECTIVES)]

    def per_call(call, with_split) -> float:
        current[0] = split if with_split else None
        started = time.thread_time()
        for _ in range(calls):
            call(tensor)
        return 1e6 * (time.thread_time() - started) / calls

    def per_step(call) -> float:
        current[0] = split
        steps = max(calls // FSDP_COLLECTIVES, 5)
        started = time.thread_time()
        for _ in range(steps):
            for piece in pieces:
                call(piece)
        return 1e6 * (time.thread_time() - started) / steps

    for _ in range(200):
        bare(tensor)
    found = {name: [] for name in ("bare", "ring", "ring+split", "fsdp_step_bare", "fsdp_step_run")}
    for i in range(rounds):
        order = [("bare", bare, False), ("ring", wrapped, False), ("ring+split", wrapped, True)]
        for name, call, with_split in order if i % 2 == 0 else reversed(order):
            found[name].append(per_call(call, with_split))
        for name, call in (("fsdp_step_bare", bare), ("fsdp_step_run", wrapped))[:: 1 if i % 2 == 0 else -1]:
            found[name].append(per_step(call))
    out.put((rank, {name: statistics.median(v) for name, v in found.items()}))
    dist.barrier()
    dist.destroy_process_group()


def collective_costs(ranks: int, calls: int = 3000, rounds: int = 5) -> dict:
    """``_collective_rank``'s figures at ``ranks`` ranks, with torch's Flight Recorder off and on
    (256 entries, as ``--trace-collectives`` sets it): the median over the ranks of each."""
    import multiprocessing
    import socket

    context = multiprocessing.get_context("spawn")
    result = {}
    for recorder in (False, True):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = context.Queue()
        procs = [
            context.Process(target=_collective_rank, args=(r, ranks, port, recorder, calls, rounds, out))
            for r in range(ranks)
        ]
        for p in procs:
            p.start()
        per_rank = dict(out.get(timeout=900) for _ in procs)
        for p in procs:
            p.join(60)
        for name in per_rank[0]:
            result[f"{name}{' +FR' if recorder else ''}"] = statistics.median(f[name] for f in per_rank.values())
    return {
        "ranks": ranks,
        "calls": calls,
        "rounds": rounds,
        "us": result,
        # per collective: what each part adds to the call as torch has it
        "ring_us": result["ring"] - result["bare"],
        "split_us": result["ring+split"] - result["ring"],
        "flight_recorder_us": result["bare +FR"] - result["bare"],
        "run_us": result["ring+split"] - result["bare"],
        "trace_collectives_us": result["ring+split +FR"] - result["bare"],
        "fsdp_step_run_us": result["fsdp_step_run"] - result["fsdp_step_bare"],
        "fsdp_step_trace_us": result["fsdp_step_run +FR"] - result["fsdp_step_bare"],
        "fsdp_step_bare_us": result["fsdp_step_bare"],
    }


#: the phases of ``_instructions_child``, in order: one callgrind dump each (``*_no_run``: the
#: call outside a run, as under torchrun; ``*_run``: in a run, sending to a sink that drops it)
PHASES = (
    "bare",
    "ring",
    "ring+split",
    "report_no_run",
    "progress_no_run",
    "report_run",
    "progress_run",
)


#: ``report()`` points a run of 2 ms steps sends in one record (``runtime.REPORT_INTERVAL``: 0.1 s)
POINTS_PER_SEND = 50


def _instructions_child(recorder: str, calls: int) -> None:
    """A one-rank gloo group in this process: ``calls`` calls of each of ``PHASES``, each after
    ``os.getppid()`` (the marker callgrind dumps its counts before: ``instruction_costs``)."""
    os.environ["TORCH_FR_BUFFER_SIZE"] = recorder
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from torchdist_magic.rank import runtime, stepsplit

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    bare = c10d.all_reduce
    current = [None]
    stepsplit.patch_collectives(c10d, lambda: current[0])
    split = stepsplit.StepSplit(lambda record: None, lambda: 0)
    split.enter()
    tensor = torch.ones(SMALL)

    def collectives(call, with_split: bool) -> None:
        current[0] = split if with_split else None
        for _ in range(calls):
            call(tensor)

    # the batch's points go every ``POINTS_PER_SEND`` calls, as a run of 2 ms steps sends them,
    # not every 0.1 s of this process's time: callgrind slows it down by a factor that the load sets
    runtime.REPORT_INTERVAL = 3600.0
    flush = getattr(runtime, "flush_reports", lambda: None)  # a tree before the batch has none

    def reports() -> None:
        for i in range(calls):
            runtime.report(loss=0.5, lr=1e-3, step_time=0.002)
            if i % POINTS_PER_SEND == POINTS_PER_SEND - 1:
                flush()

    def progress_steps() -> None:
        for _ in runtime.progress(range(calls)):
            pass

    def run_phases(phases) -> None:
        for phase in phases:
            os.getppid()
            phase()

    for _ in range(50):  # warm: first calls build what later ones reuse
        bare(tensor)
        c10d.all_reduce(tensor)
        runtime.report(loss=0.5, lr=1e-3, step_time=0.002)
    run_phases(
        (
            lambda: collectives(bare, False),
            lambda: collectives(c10d.all_reduce, False),
            lambda: collectives(c10d.all_reduce, True),
            reports,
            progress_steps,
        )
    )

    runtime._install_sink(_Discard())
    run_phases((reports, progress_steps))
    os.getppid()
    runtime._install_sink(None)
    dist.destroy_process_group()


def instruction_costs(calls: int = 2000, tree: str = "") -> dict:
    """Instructions per call of each of ``PHASES`` (valgrind's callgrind, every thread of the
    process: counts that no other load on the machine moves), with torch's Flight Recorder off and
    on, of the torchdist_magic in ``tree`` (``TREE`` by default); {} without valgrind.  Python's string hashes are fixed
    (``PYTHONHASHSEED=0``): they move a count by some hundreds from one process to the next."""
    import glob
    import shutil

    if shutil.which("valgrind") is None:
        return {}
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        children = {}
        for recorder in ("0", "256"):
            out = os.path.join(tmp, f"fr{recorder}")
            os.makedirs(out)
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([tree or TREE, os.environ.get("PYTHONPATH", "")]),
                "RANK_OVERHEAD_TREE": tree or TREE,
                "PYTHONHASHSEED": "0",
            }
            children[recorder] = (
                out,
                subprocess.Popen(
                    [
                        "valgrind",
                        "--tool=callgrind",
                        "--dump-before=getppid",
                        f"--callgrind-out-file={out}/cg.%p",
                        sys.executable,
                        os.path.abspath(__file__),
                        "--instructions-child",
                        recorder,
                        str(calls),
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                ),
            )
        for recorder, (out, child) in children.items():
            child.wait(3600)
            dumps = sorted((p for p in glob.glob(os.path.join(out, "cg.*.*"))), key=lambda p: int(p.rsplit(".", 1)[1]))[
                -len(PHASES) :
            ]
            for phase, path in zip(PHASES, dumps):
                with open(path) as fh:
                    total = next(int(line.split()[1]) for line in fh if line.startswith(("summary:", "totals:")))
                found[f"{phase}{' +FR' if recorder != '0' else ''}"] = total / calls
    return {
        "calls": calls,
        "tree": tree or TREE,
        "per_call": found,
        "ring": found["ring"] - found["bare"],
        "split": found["ring+split"] - found["ring"],
        "flight_recorder": found["bare +FR"] - found["bare"],
        "run": found["ring+split"] - found["bare"],
        "trace_collectives": found["ring+split +FR"] - found["bare"],
        "report_sending": found["report_run"] - found["report_no_run"],
        "progress_in_a_run": found["progress_run"] - found["progress_no_run"],
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


#: each rank's ``OMP_NUM_THREADS`` in the end-to-end runs, under both launchers (torchrun's own)
THREADS = "1"


def end_to_end(ranks_list, steps: int, rounds: int, before: str) -> dict:
    """Steps/s of the DDP script under each launcher, interleaved rounds at each number of ranks."""
    os.environ.setdefault("OMP_NUM_THREADS", THREADS)  # the same for both: see the module's docstring
    runners = {"torchrun": with_torchrun, "torchdist_magic": with_torchdist}
    if before:
        runners["before"] = lambda *args: with_torchdist(*args, tree=before)
    found = {}
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as fh:
            fh.write(SCRIPT)
        for ranks in ranks_list:
            runs = {name: [] for name in runners}
            driver = {name: [] for name in runners if name != "torchrun"}
            launcher_cpu = {name: [] for name in runners}
            per_step = []
            loads = []
            for i in range(rounds):
                order = list(runners) if i % 2 == 0 else list(reversed(runners))  # a busy moment hits all alike
                for name in order:
                    out = os.path.join(tmp, f"{ranks}-{name}-{i}.json")
                    started = time.monotonic()
                    for tries_left in range(RETRIES, -1, -1):
                        try:
                            got = runners[name](script, ranks, steps, out)
                            break
                        except RuntimeError as exc:  # torch's gloo teardown aborts a rank now and then
                            if not tries_left:
                                raise
                            print(f"{ranks} ranks, {name} failed, run again: {str(exc)[-300:]}", flush=True)
                            failures.append(f"{ranks} ranks, {name}: {str(exc)[-300:]}")
                    runs[name].append(got["steps_per_s"])
                    per_step.append(got.get("collectives_per_step", 0.0))
                    if name in driver:
                        driver[name].append(1e6 * got["driver_cpu_s"] / (steps * ranks))
                    launcher_cpu[name].append(got["launcher_ms_per_s"])
                    loads.append(os.getloadavg()[0])
                    print(
                        f"{ranks} ranks, round {i + 1}/{rounds} {name:<16} {runs[name][-1]:8.1f} steps/s "
                        f"({time.monotonic() - started:.1f} s with start-up, load {loads[-1]:.1f})",
                        flush=True,
                    )
            medians = {name: statistics.median(v) for name, v in runs.items()}
            # each round's two runs ran back to back: their ratio leaves out what moved the
            # machine's speed from one round to the next
            paired = [mine / theirs for mine, theirs in zip(runs["torchdist_magic"], runs["torchrun"])]
            found[str(ranks)] = {
                "runs": runs,
                "medians": medians,
                "ratio": medians["torchdist_magic"] / medians["torchrun"],
                "paired_ratios": paired,
                "paired_ratio": statistics.median(paired),
                "launcher_cpu_ms_per_s": {name: statistics.median(v) for name, v in launcher_cpu.items()},
                "launcher_cpu_ms_per_s_runs": launcher_cpu,
                "ratio_before": medians["before"] / medians["torchrun"] if before else None,
                "driver_cpu_us_per_rank_step": {name: statistics.median(v) for name, v in driver.items()},
                "collectives_per_step": statistics.median(per_step),
                "load_average": [min(loads), statistics.median(loads), max(loads)],
                "failed_and_rerun": list(failures),
            }
            failures.clear()
    return found


#: the rows of the instruction table: (what, its figure in ``instruction_costs``' result)
INSTRUCTION_ROWS = (
    ("an all_reduce as torch has it", lambda i: i["per_call"]["bare"]),
    ("the ring's record (the wrapper, no split)", lambda i: i["ring"]),
    ("the step split's timing of it", lambda i: i["split"]),
    ("a Python-called collective, as shipped", lambda i: i["run"]),
    ("torch's Flight Recorder, per collective", lambda i: i["flight_recorder"]),
    ("a Python-called collective, --trace-collectives", lambda i: i["trace_collectives"]),
    ("report() of 3 values, no run", lambda i: i["per_call"]["report_no_run"]),
    ("report() of 3 values, in a run (sending)", lambda i: i["per_call"]["report_run"]),
    ("progress() step, no run", lambda i: i["per_call"].get("progress_no_run")),
    ("progress() step, in a run", lambda i: i["per_call"].get("progress_run")),
)


def instruction_table(after: dict, before: Optional[dict] = None) -> List[dict]:
    """The rows of ``INSTRUCTION_ROWS`` for ``after`` (``instruction_costs``), beside ``before``'s
    where given (an earlier tree's): what the table prints and the JSON keeps."""
    rows = []
    for what, figure in INSTRUCTION_ROWS:
        row = {"part": what, "after": figure(after)}
        if before:
            row["before"] = figure(before)
        rows.append(row)
    return rows


def print_instruction_table(rows: List[dict], calls: int, before_label: str = "before") -> None:
    with_before = any("before" in row for row in rows)
    print(f"\nInstructions per call (callgrind, one rank, gloo, {calls} calls; no load moves these)")
    print(f"{'part':<50} {before_label if with_before else '':>10} {'after':>10}")
    for row in rows:
        old = row.get("before")
        cells = [f"{v:>10,.0f}" if v is not None else f"{'-':>10}" for v in (old, row["after"])]
        print(f"{row['part']:<50} {cells[0] if with_before else '':>10} {cells[1]}")


def print_end_to_end(runs: dict, where: dict, loads: Tuple[float, float]) -> None:
    """The end-to-end table, named with its machine and its load."""
    print(
        f"\nEnd to end: the DDP script under torchrun and under Distributor.run(script); "
        f"{describe_machine(where)}, torch {where.get('torch', '?')}; load average (1 min) "
        f"{loads[0]:.1f} at the start, {loads[1]:.1f} at the end"
    )
    print(
        f"{'ranks':>5} {'launcher':<16} {'steps/s median':>14} {'min':>8} {'max':>8} {'ratio':>6} {'paired':>6} "
        f"{'launcher CPU':>12} {'load':>11}"
    )
    for ranks, found in runs.items():
        for name, values in found["runs"].items():
            ratio = found["medians"][name] / found["medians"]["torchrun"]
            paired = found.get("paired_ratio") if name == "torchdist_magic" else None
            cpu = found.get("launcher_cpu_ms_per_s", {}).get(name, float("nan"))
            low, _, high = found["load_average"]
            print(
                f"{ranks:>5} {name:<16} {found['medians'][name]:>14.1f} {min(values):>8.1f} {max(values):>8.1f} "
                f"{ratio:>6.3f} {f'{paired:.3f}' if paired else '':>6} {cpu:>7.1f} ms/s {low:>5.1f}-{high:<5.1f}"
            )
    print(
        "  (ratio: of the medians; paired: the median of each round's two runs' ratio; launcher CPU: the "
        "launcher process alone (torchrun's agent, torchdist_magic's driver) while rank 0 timed its steps)"
    )


def print_parts(collectives: dict, cost: dict, split: dict, runs: dict) -> None:
    """The CPU-time table, part by part."""
    step_us = split["ddp_step_default_us"]
    print(
        f"\nCPU costs, part by part (per call; per step of the DDP script, {step_us / 1000:.1f} ms of CPU; per "
        f"FSDP-like step of {FSDP_COLLECTIVES} collectives)"
    )
    print(f"{'part':<44} {'ranks':>5} {'us per call':>11} {'% DDP step':>10} {'% FSDP step':>11}  default")
    ddp_calls = {r: f.get("collectives_per_step", 0.0) for r, f in runs.items()}

    def row(part, ranks, us, per_step_calls, fsdp_us, default):
        fsdp = collectives[ranks]["fsdp_step_bare_us"]
        share = 100 * us * per_step_calls / step_us if per_step_calls is not None else float("nan")
        print(
            f"{part:<44} {ranks:>5} {us:>11.2f} {share:>10.2f} {100 * fsdp_us / fsdp if fsdp_us is not None else float('nan'):>11.2f}  {default}"
        )

    for ranks, c in collectives.items():
        row("collective record (ring), per collective", ranks, c["ring_us"], 0, None, "on")
        row("step split, per timed collective", ranks, c["split_us"], 0, None, "on")
        row("both, as a run wraps a collective", ranks, c["run_us"], 0, c["fsdp_step_run_us"], "on")
        row(
            "Flight Recorder (--trace-collectives)",
            ranks,
            c["flight_recorder_us"],
            ddp_calls.get(ranks, 1.0),
            c["fsdp_step_trace_us"] - c["fsdp_step_run_us"],
            "off",
        )
    print("  (the DDP script's collectives run in C++, where the ring and the split's timing are not;")
    print(
        f"   {', '.join(f'{r} ranks: {v:.1f}' for r, v in ddp_calls.items())} collectives a step; all_reduce of {SMALL} floats per call)"
    )
    split_us = split["progress_step_split_us"] - split["progress_step_plain_us"]
    print(
        f"{'step split, per progress() step':<44} {'':>5} {split_us:>11.2f} {100 * split_us / step_us:>10.2f} {'':>11}  on"
    )
    print(
        f"{'DDP timers at sample rate 1, per DDP step':<44} {'':>5} {split['ddp_timers_us']:>11.2f} "
        f"{100 * max(split['ddp_timers_us'], 0) / step_us:>10.2f} {'':>11}  on"
    )
    print(
        f"{'a read of DDP timers (at most 10/s)':<44} {'':>5} {split['ddp_timer_read_us']:>11.2f} "
        f"{100 * split['ddp_timer_read_us'] * split['reads_per_s'] * step_us / 1e6 / step_us:>10.3f} {'':>11}  on"
    )
    sending = cost["reporting_us"] - cost["no_run_us"]
    print(
        f"{'progress + report(3 values), sending':<44} {'':>5} {sending:>11.2f} {100 * sending / step_us:>10.2f} {'':>11}  on"
        f"  ({cost['reporting_us']:.2f} us in a run, {cost['no_run_us']:.2f} us with none)"
    )
    for ranks, found in runs.items():
        for name, us in found["driver_cpu_us_per_rank_step"].items():
            print(
                f"{'driver CPU per rank-step (output, records)':<44} {ranks:>5} {us:>11.2f} {'':>10} {'':>11}  "
                f"on ({name}; shares the ranks' cores)"
            )


def update_json(path: str, sections: dict) -> None:
    """Write ``sections`` into the JSON at ``path``, keeping the sections of it that this run did
    not measure (``--end-to-end`` on a quiet machine leaves the parts as they were, and the other
    way round)."""
    found: dict = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            found = json.load(fh)
    found.update(sections)
    found["benchmark"] = "a rank's overhead: torchdist_magic vs torchrun, same DDP script, and part by part"
    write_json(path, found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--end-to-end",
        action="store_true",
        help="only the end-to-end comparison (torchrun against Distributor.run(script)): on a quiet machine",
    )
    mode.add_argument("--parts-only", action="store_true", help="only the costs part by part (CPU time, instructions)")
    mode.add_argument("--instructions-only", action="store_true", help="only the callgrind instruction counts")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds of each launcher at each number of ranks"
    )
    parser.add_argument("--before", default="", help="a tree with an earlier torchdist_magic, measured beside this one")
    parser.add_argument("--calls", type=int, default=3000, help="collectives per configuration and round, per rank")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "rank_overhead.json"))
    args = parser.parse_args()

    import torch

    where = machine(torch=torch.__version__)
    start = os.getloadavg()[0]
    sections: dict = {}
    runs: dict = {}
    if not (args.parts_only or args.instructions_only):
        runs = end_to_end(args.ranks, args.steps, args.rounds, args.before)
        loads = (start, os.getloadavg()[0])
        print_end_to_end(runs, where, loads)
        sections.update(
            end_to_end=runs,
            end_to_end_setup={
                "machine": where,
                "load_average": {"start": loads[0], "end": loads[1]},
                "steps": args.steps,
                "warmup": WARMUP,
                "rounds": args.rounds,
                "threads_per_rank": os.environ["OMP_NUM_THREADS"],
                "before": args.before,
                "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            },
        )
    if not args.end_to_end:
        part_start = os.getloadavg()[0]
        if not args.instructions_only:
            collectives = {str(r): collective_costs(r, calls=args.calls) for r in args.ranks}
            cost = reporting_cost()
            split = split_cost()
            print_parts(collectives, cost, split, runs)
            sections.update(collective_cost=collectives, reporting_cost=cost, step_split_cost=split)
        instructions = instruction_costs()
        before = instruction_costs(tree=args.before) if instructions and args.before else None
        if instructions:
            rows = instruction_table(instructions, before)
            print_instruction_table(rows, instructions["calls"])
            sections.update(instructions=instructions, instructions_before=before, instruction_table=rows)
        sections.update(
            machine=where,
            load_average={"start": part_start, "end": os.getloadavg()[0]},
            tree=TREE,
        )
    update_json(args.json, sections)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--instructions-child"]:
        _instructions_child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
