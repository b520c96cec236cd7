"""What a host relay costs the machine it runs on (``wire.relay.HostRelay``): CPU per record it
passes on, and the time it adds to a record's way.

    python benchmarks/relay.py [--ranks 8] [--rate 100] [--seconds 20] [--repeat 3]
                               [--json benchmarks/results/relay.json]

A real driver's channel (``ChannelServer``, TLS, records dropped as they arrive) in this
process; a real ``HostRelay`` in a process of its own (the launcher that owns a machine's relay),
whose CPU seconds are read from ``/proc``; ``--ranks`` ranks' real clients (``ChannelClient``: a
worker's and a launcher's per rank, as a rank's are) in this process, connected to the relay,
each rank sending ``--rate`` records a second (per 10: a progress update, 5 metric points, 4
log lines) for ``--seconds``.  Each record's way is timed from its ``Progress`` update's send
to the driver's receipt (its ``elapsed`` carries the send time), so the relay's gathering
(``relay.RELAY_WINDOW``) and the clients' own (``batching.flush_every``) are both in it.  The
table names the machine and its load; the JSON has every run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))

from report import describe_machine, load, machine, short_machine, write_json  # noqa: E402

sys.path.insert(0, os.path.dirname(HERE))

from torchdist_magic.core import events  # noqa: E402
from torchdist_magic.core.rankenv import rank_key  # noqa: E402
from torchdist_magic.wire.client import ChannelClient  # noqa: E402
from torchdist_magic.wire.frames import new_secret  # noqa: E402
from torchdist_magic.wire.relay import RELAY_WINDOW, HostRelay  # noqa: E402
from torchdist_magic.wire.server import ChannelServer  # noqa: E402
from torchdist_magic.wire.tls import new_identity  # noqa: E402

RUN = "relay-bench"


def _relay_process(address, secret, launcher_secret, certificate, ranks, world, pipe) -> None:
    relay = HostRelay(
        address, secret, launcher_secret, RUN, ranks, world_size=world, certificate=certificate, others=True
    )
    pipe.send(relay.address)
    pipe.recv()  # until the clients are done
    relay.close()
    pipe.send("closed")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(ranks: int, rate: float, seconds: float) -> dict:
    identity = new_identity()
    secret, launcher_secret = new_secret(), new_secret()
    lock = threading.Lock()
    ways = []  # seconds from a progress update's send to its arrival
    counts = {"lines": 0}

    def arrived(record) -> None:
        now = time.time()
        with lock:
            if type(record) is events.Log:
                counts["lines"] += 1 + len(record.more)
            elif type(record) is events.Progress:
                ways.append(now - record.elapsed)

    driver = ChannelServer(arrived, RUN, secret=secret, launcher_secret=launcher_secret, identity=identity, ranks=ranks)
    ours, theirs = multiprocessing.Pipe()
    proc = multiprocessing.Process(
        target=_relay_process,
        args=(f"127.0.0.1:{driver.port}", secret, launcher_secret, identity.certificate, [0], ranks, theirs),
    )
    proc.start()
    where = ours.recv()
    clients = {
        (r, role): ChannelClient(
            where,
            rank_key(launcher_secret if role == "launcher" else secret, role, r),
            RUN,
            r,
            role=role,
        )
        for r in range(ranks)
        for role in ("worker", "launcher")
    }
    load_before = load()
    cpu0 = _cpu_seconds(proc.pid)
    start = time.time()
    sent = lines = 0
    tick = 0
    while time.time() < start + seconds:
        tick += 1
        time.sleep(max(0.0, start + tick / rate - time.time()))
        now = time.time()
        for r in range(ranks):
            kind = tick % 10
            if kind == 0:
                clients[(r, "worker")].send(events.Progress(rank=r, bar="train#0", n=tick, elapsed=now))
            elif kind <= 5:
                clients[(r, "worker")].send(events.Metrics.point(r, tick, {"loss": 1.0 / tick, "lr": 3e-4}, now))
            else:
                clients[(r, "launcher")].send(events.Log(rank=r, line=f"step {tick} loss {1.0 / tick:.6f}"))
                lines += 1
            sent += 1
    for client in clients.values():
        client.close()
    cpu = _cpu_seconds(proc.pid) - cpu0
    ours.send("done")
    ours.recv()
    proc.join(30)
    driver.close()
    return {
        "ranks": ranks,
        "rate": rate,
        "seconds": seconds,
        "sent": sent,
        "lines_sent": lines,
        "lines_arrived": counts["lines"],
        "relay_cpu_s": cpu,
        "relay_us_per_record": 1e6 * cpu / max(1, sent),
        "relay_cpu_percent": 100 * cpu / seconds,
        "way_p50_ms": 1e3 * statistics.median(ways) if ways else None,
        "way_p99_ms": 1e3 * sorted(ways)[int(0.99 * (len(ways) - 1))] if ways else None,
        "driver_connections_accepted": driver.stats["accepted"],
        "load_before": load_before,
        "load_after": load(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8, help="ranks on the relay's machine (default 8)")
    parser.add_argument("--rate", type=float, default=100, help="records a second per rank (default 100)")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "relay.json"))
    args = parser.parse_args()
    where = machine()
    runs = [one_run(args.ranks, args.rate, args.seconds) for _ in range(args.repeat)]
    print(
        f"A host relay's own cost: {describe_machine(where)}; relay window {RELAY_WINDOW * 1e3:.0f} ms, TLS to the driver"
    )
    print(
        f"{'machine':<16} {'load':>9} {'ranks':>5} {'rec/s':>7} {'sent':>7} {'lines lost':>10} "
        f"{'relay CPU':>9} {'us/rec':>7} {'way p50':>8} {'p99 ms':>7} {'conns':>5}"
    )
    for run in runs:
        print(
            f"{short_machine(where):<16} {run['load_before']:>4.1f}>{run['load_after']:<4.1f} {run['ranks']:>5} "
            f"{run['ranks'] * run['rate']:>7.0f} {run['sent']:>7} {run['lines_sent'] - run['lines_arrived']:>10} {run['relay_cpu_percent']:>8.1f}% "
            f"{run['relay_us_per_record']:>7.1f} {run['way_p50_ms']:>8.0f} {run['way_p99_ms']:>7.0f} "
            f"{run['driver_connections_accepted']:>5}"
        )
    write_json(args.json, {"benchmark": "host relay cost", "machine": where, "runs": runs})


if __name__ == "__main__":
    main()
