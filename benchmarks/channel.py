"""The event channel's cost with and without TLS: a real ``ChannelServer`` and real
``ChannelClient``s, each client in a process of its own (as ranks are), on this machine's
loopback.

    python benchmarks/channel.py [--clients 4] [--records 50000] [--connections 200] [--repeat 3]
                                 [--json benchmarks/results/channel.json]

Three figures per mode (plain, tls):

* throughput: every client sends ``--records`` log lines (about 100 bytes each) as fast as its
  queue takes them; records/s from the start signal until the server has delivered them all;
* latency: every client sends one metrics record every 5 ms for a while; p50/p99 of the time from
  ``send`` to the server's delivery (one monotonic clock: the clients are on this machine);
* handshakes: ``--connections`` clients (threads of this process) connect at once; the time
  until the server has authenticated them all (TCP, the TLS handshake, the HMAC challenge).

Loopback is the best case for the network: what TLS costs here is CPU (encryption, the
ECDHE/ECDSA handshake), which a real network does not hide.  The clients and the server share
this machine's cores, so the figures are of one machine, not of a cluster.  Each figure is
measured ``--repeat`` times, the modes taking turns; the table shows the medians, the JSON file
every run.
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

from report import end_processes, machine, write_json  # noqa: E402  (this script's folder is on sys.path)

sys.path.insert(0, os.path.dirname(HERE))

from torchdist_magic.core import events  # noqa: E402
from torchdist_magic.wire import tls  # noqa: E402
from torchdist_magic.core.rankenv import rank_key  # noqa: E402
from torchdist_magic.wire.client import ChannelClient  # noqa: E402
from torchdist_magic.wire.server import ChannelServer  # noqa: E402

SECRET, LAUNCHER_SECRET, RUN_ID = "benchmark-secret", "benchmark-launcher-secret", "bench"
LATENCY_INTERVAL = 0.005
LATENCY_RECORDS = 400


def _client(address: str, certificate: str, rank: int, go, kind: str, count: int) -> None:
    """One rank's process: connect, wait for ``go``, send, flush."""
    client = ChannelClient(
        address, rank_key(LAUNCHER_SECRET, "launcher", rank), RUN_ID, rank, role="launcher", certificate=certificate
    )
    go.wait()
    if kind == "throughput":
        line = "step {:>7} loss 0.{:06d} lr 3.0e-4 grad-norm 1.2345 tokens/s 123456 " + "x" * 20
        for i in range(count):
            client.send(events.Log(rank=rank, line=line.format(i, i)))
    else:
        for i in range(count):
            client.send(events.Metrics.point(rank, i, time=time.monotonic()))
            time.sleep(LATENCY_INTERVAL)
    client.close(timeout=300)


class Sink:
    """The server's ``on_event``: counts what the clients sent (each metric point and each log
    line: a client sends the points, and the lines, of one flush in one record), and each point's
    age on arrival."""

    def __init__(self, expected: int):
        self.expected = expected
        self.count = 0
        self.latencies = []
        self.done = threading.Event()
        self.last = 0.0

    def __call__(self, record) -> None:
        now = time.monotonic()
        if isinstance(record, events.Metrics):
            self.latencies += [now - when for when in record.times]
            self.count += len(record.steps)
        elif isinstance(record, events.Log):  # the lines of one flush travel as one record
            self.count += len(record.lines())
        else:
            self.count += 1
        if self.count >= self.expected and not self.done.is_set():
            self.last = now
            self.done.set()


def streams(identity, kind: str, clients: int, count: int) -> dict:
    """``clients`` processes sending ``count`` records each; throughput or latencies."""
    sink = Sink(clients * count)
    server = ChannelServer(sink, RUN_ID, secret=SECRET, launcher_secret=LAUNCHER_SECRET, identity=identity)
    address = f"{server.address[0]}:{server.address[1]}"
    certificate = identity.certificate if identity is not None else ""
    context = multiprocessing.get_context("spawn")
    go = context.Event()
    procs = [context.Process(target=_client, args=(address, certificate, r, go, kind, count)) for r in range(clients)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120
        while server.stats["authenticated"] < clients:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {server.stats['authenticated']} of {clients} clients connected")
            time.sleep(0.01)
        start = time.monotonic()
        go.set()
        if not sink.done.wait(600):
            raise RuntimeError(f"{sink.count} of {sink.expected} records arrived")
        elapsed = sink.last - start
    finally:
        end_processes(procs, 60)
        server.close()
    if kind == "throughput":
        return {"records": sink.count, "seconds": elapsed, "records_per_s": sink.count / elapsed}
    ms = sorted(x * 1000 for x in sink.latencies)
    return {"records": len(ms), "p50_ms": statistics.median(ms), "p99_ms": ms[int(0.99 * (len(ms) - 1))]}


def handshakes(identity, connections: int) -> dict:
    """``connections`` clients connecting at once: the time until all are authenticated."""
    server = ChannelServer(
        lambda record: None, RUN_ID, secret=SECRET, launcher_secret=LAUNCHER_SECRET, identity=identity
    )
    address = f"{server.address[0]}:{server.address[1]}"
    certificate = identity.certificate if identity is not None else ""
    start = time.monotonic()
    clients = [
        ChannelClient(address, rank_key(SECRET, "worker", r), RUN_ID, r, certificate=certificate)
        for r in range(connections)
    ]
    try:
        deadline = start + 120
        while server.stats["authenticated"] < connections and time.monotonic() < deadline:
            time.sleep(0.002)
        elapsed = time.monotonic() - start
        authenticated = server.stats["authenticated"]
    finally:
        for client in clients:
            client.close()
        server.close()
    return {
        "connections": connections,
        "authenticated": authenticated,
        "seconds": elapsed,
        "per_connection_ms": 1000 * elapsed / connections,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--records", type=int, default=50_000, help="log records per client (throughput)")
    parser.add_argument("--connections", type=int, default=200, help="clients connecting at once")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each figure; the table shows medians")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "channel.json"))
    args = parser.parse_args()

    import ssl

    started = time.monotonic()
    identity = tls.new_identity()
    identity_ms = 1000 * (time.monotonic() - started)
    modes = (("plain", None), ("tls", identity))
    runs = {mode: [] for mode, _ in modes}
    for _ in range(args.repeat):  # the modes take turns, so that a busy moment hits both alike
        for mode, ident in modes:
            runs[mode].append(
                {
                    "throughput": streams(ident, "throughput", args.clients, args.records),
                    "latency": streams(ident, "latency", args.clients, LATENCY_RECORDS),
                    "handshakes": handshakes(ident, args.connections),
                }
            )
    rows = []
    for mode, _ in modes:

        def median(part, key, repeats=runs[mode]):
            return statistics.median(r[part][key] for r in repeats)

        rows.append(
            {
                "mode": mode,
                "clients": args.clients,
                "runs": runs[mode],
                "throughput": {"records_per_s": median("throughput", "records_per_s")},
                "latency": {"p50_ms": median("latency", "p50_ms"), "p99_ms": median("latency", "p99_ms")},
                "handshakes": {
                    "connections": args.connections,
                    "authenticated": min(r["handshakes"]["authenticated"] for r in runs[mode]),
                    "seconds": median("handshakes", "seconds"),
                    "per_connection_ms": median("handshakes", "per_connection_ms"),
                },
            }
        )

    print(
        f"\n{'mode':<6} {'clients':>7} {'records/s':>10} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'connections':>11} {'all in s':>8} {'ms/conn':>8}"
    )
    for r in rows:
        t, lat, h = r["throughput"], r["latency"], r["handshakes"]
        print(
            f"{r['mode']:<6} {r['clients']:>7} {t['records_per_s']:>10,.0f} {lat['p50_ms']:>7.2f} "
            f"{lat['p99_ms']:>7.2f} {h['authenticated']:>5}/{h['connections']:<5} {h['seconds']:>8.3f} "
            f"{h['per_connection_ms']:>8.2f}"
        )
    plain, secure = rows
    print(
        f"TLS: {secure['throughput']['records_per_s'] / plain['throughput']['records_per_s']:.2f}x the "
        f"plain throughput; a run's key and certificate took {identity_ms:.0f} ms (the first one loads "
        "cryptography)"
    )
    write_json(
        args.json,
        {
            "benchmark": "event channel, plain and TLS, loopback",
            "repeat": args.repeat,
            "records_per_client": args.records,
            "latency_interval_s": LATENCY_INTERVAL,
            "identity_ms": identity_ms,
            "machine": machine(openssl=ssl.OPENSSL_VERSION),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
