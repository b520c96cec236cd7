"""The event channel against hostile input: thousands of strangers' frames before
authentication, malformed and forbidden records after it, and a flood against a real run.

What must hold: every record of an authenticated rank arrives, in order; strangers cost a
bounded number of threads and a bounded amount of memory; nothing is printed.
"""

import dataclasses
import json
import random
import socket
import ssl
import struct
import threading
import time

import pytest

from helpers import Collector, assert_no_survivors, wait_until
from torchdist_magic.wire import framemac, tls
from torchdist_magic.core import events
from torchdist_magic.wire.client import ChannelClient
from torchdist_magic.core.rankenv import rank_key
from torchdist_magic.wire.frames import MAX_FRAME, MAX_HELLO, hello_mac, hello_proof, pack_frame, read_frame
from torchdist_magic.wire.server import ChannelServer

LEN = struct.Struct(">I")
WORKER_SECRET, LAUNCHER_SECRET = "worker-secret", "launcher-secret"


def rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def frame(body: bytes) -> bytes:
    return LEN.pack(len(body)) + body


def hello_frame(**fields) -> bytes:
    base = {
        "mac": "0" * 64,
        "nonce": "n",
        "run_id": "run-1",
        "rank": 0,
        "role": "worker",
        "protocol": events.PROTOCOL_VERSION,
    }
    base.update(fields)
    return frame(json.dumps(base).encode())


def crafted_hellos() -> list:
    """Frames a stranger might send instead of a hello, each aimed at one check or parser."""
    deep = b"[" * 2000 + b"]" * 2000  # fits MAX_HELLO, deeper than the JSON parser's recursion
    return [
        hello_frame(),  # looks right, wrong MAC
        hello_frame(mac="ü" * 64),  # non-ASCII MAC
        frame(b'{"mac": "\\ud800\\udfff\\ud800", "role": "worker", "protocol": 1}'),  # lone surrogates
        hello_frame(mac=None),
        hello_frame(mac=["a"]),
        hello_frame(mac={"a": 1}),
        hello_frame(mac=1),
        hello_frame(role=["worker"]),
        hello_frame(role={"r": 1}),
        hello_frame(role="driver"),
        hello_frame(role=None),
        hello_frame(protocol=True),
        hello_frame(protocol="1"),
        hello_frame(protocol=1.0),
        hello_frame(protocol=None),
        hello_frame(protocol=10**100),
        hello_frame(rank="0"),
        hello_frame(rank=-1),
        hello_frame(rank=True),
        hello_frame(rank=10**30),
        hello_frame(run_id={"run": 1}),
        hello_frame(nonce=["n"]),
        frame(deep),
        frame(b'{"a":' * 1000 + b"1" + b"}" * 1000),
        frame(b"[" * 100_000 + b"]" * 100_000),  # 100k deep: over the hello limit
        frame(b"\xff\xfe{}"),
        frame(b"[]"),
        frame(b'"hello"'),
        frame(b"1e999999"),
        frame(b"9" * 5000),
        frame(b"{}") + b"trailing garbage",
        frame(b""),
        LEN.pack(100) + b"truncated",
        b"\xff\xff\xff\xff" + b"x" * 100,
        LEN.pack(MAX_HELLO + 1) + b"{",
        LEN.pack(MAX_FRAME) + b"{",
        LEN.pack(0x7FFFFFFF),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    ]


def stranger_payloads(rng: random.Random, n_random: int) -> list:
    payloads = crafted_hellos()
    for _ in range(n_random):
        kind = rng.random()
        if kind < 0.4:  # random bytes
            payloads.append(rng.randbytes(rng.randint(1, 300)))
        elif kind < 0.7:  # a well-framed body of random bytes
            payloads.append(frame(rng.randbytes(rng.randint(0, MAX_HELLO))))
        elif kind < 0.85:  # a random length prefix, little behind it
            payloads.append(LEN.pack(rng.getrandbits(32)) + rng.randbytes(rng.randint(0, 50)))
        else:  # a hello with a random, well-formed but wrong MAC
            payloads.append(hello_frame(mac=rng.randbytes(32).hex(), rank=rng.randint(0, 8)))
    return payloads


#: what a stranger speaks to a TLS server: TLS without checking who it talks to (anyone can
#: finish a TLS handshake with the driver; the secrets are what keep strangers out)
STRANGER_TLS = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
STRANGER_TLS.check_hostname = False
STRANGER_TLS.verify_mode = ssl.CERT_NONE


def send_as_stranger(address, payload: bytes, read_challenge: bool, over_tls: bool = False) -> None:
    try:
        with socket.create_connection(address, timeout=10) as raw:
            sock = STRANGER_TLS.wrap_socket(raw) if over_tls else raw
            if read_challenge:
                sock.recv(4096)
            sock.sendall(payload)
    except OSError:  # the server hung up on us: that is what it should do
        pass


@pytest.fixture(scope="module")
def identity():
    return tls.new_identity()


def make_server(got, encrypted: bool, identity):
    """A channel server, with TLS or without; ``.cert`` is what its ranks pin."""
    server = ChannelServer(
        got, "run-1", secret=WORKER_SECRET, launcher_secret=LAUNCHER_SECRET, identity=identity if encrypted else None
    )
    server.cert = identity.certificate if encrypted else ""
    return server


def try_to_send_4_mib(address, blob: bytes) -> None:
    try:
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(LEN.pack(len(blob)) + blob)
    except OSError:
        pass


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "tls"])
def test_a_flood_of_strangers_costs_bounded_threads_and_memory_and_loses_no_record(capfd, identity, encrypted):
    rng = random.Random(1234)
    payloads = stranger_payloads(rng, 3000)
    blob = b"{" * (4 * 1024 * 1024)  # allocated before the baseline is taken
    idle_count, big_count, flood_threads = 300, 50, 4

    ours = set(threading.enumerate())
    rss_before = rss_bytes()
    got = Collector()
    server = make_server(got, encrypted, identity)
    address = server.address
    addr_text = f"{address[0]}:{address[1]}"
    rank0 = rank1 = None
    flood_done = threading.Event()
    sent_steps, idle, started_threads = [], [], []

    def train():  # the known sequence, sent all through the flood
        step = 0
        while not flood_done.is_set() or step < 2000:
            for _ in range(10):
                rank0.send(events.Metrics.point(rank=0, step=step, values={"loss": 1.0 / (step + 1)}))
                step += 1
            time.sleep(0.002)
        sent_steps.extend(range(step))

    # against TLS, half the strangers speak TLS and send their payload inside it (those that wait
    # for the challenge among them: a TLS server says nothing to the others)
    tasks = [
        (send_as_stranger, (address, p, i % 2 == 0 and not (encrypted and i % 4 >= 2), encrypted and i % 4 < 2))
        for i, p in enumerate(payloads)
    ]
    tasks += [(try_to_send_4_mib, (address, blob))] * big_count
    rng.shuffle(tasks)

    def flood(share):
        for func, args in share:
            func(*args)

    def hold_idle():
        for i in range(idle_count):
            try:
                sock = socket.create_connection(address, timeout=10)
                if i % 3 == 0:
                    sock.send(LEN.pack(MAX_HELLO)[:2])  # half a length prefix, then silence
                idle.append(sock)
            except OSError:
                pass

    trainer = threading.Thread(target=train)
    workers = [threading.Thread(target=flood, args=(tasks[i::flood_threads],)) for i in range(flood_threads)]
    workers.append(threading.Thread(target=hold_idle))
    try:
        rank0 = ChannelClient(
            addr_text, rank_key(WORKER_SECRET, "worker", 0), "run-1", 0, certificate=server.cert
        )  # before the flood
        wait_until(lambda: server.stats["authenticated"] == 1)
        started = time.monotonic()
        for t in [trainer, *workers]:
            t.start()
            started_threads.append(t)

        # a rank that connects in the middle of the flood gets through too
        wait_until(lambda: server.stats["accepted"] > len(tasks) // 3, timeout=30)
        rank1 = ChannelClient(
            addr_text, rank_key(LAUNCHER_SECRET, "launcher", 1), "run-1", 1, role="launcher", certificate=server.cert
        )
        for i in range(1000):
            rank1.send(events.Log(rank=1, line=f"line {i}"))

        threads_peak, rss_peak = 0, 0
        helpers = ours | {trainer, *workers}
        while any(t.is_alive() for t in workers):
            threads_peak = max(threads_peak, len(set(threading.enumerate()) - helpers))
            rss_peak = max(rss_peak, rss_bytes())
            time.sleep(0.01)
        elapsed = time.monotonic() - started
    finally:  # also when the flood failed: its threads, the clients, the sockets, the server
        flood_done.set()
        for t in started_threads:
            t.join(60)
        for client in (rank0, rank1):
            if client is not None:
                client.close()
        for sock in idle:
            sock.close()
        stats = dict(server.stats)
        server.close()

    by_rank = {0: [], 1: []}
    for record in got.records:
        by_rank[record.rank].append(record)
    assert [p.step for r in by_rank[0] for p in r.points()] == sent_steps
    assert [o.line for r in by_rank[1] for o in r.lines()] == [f"line {i}" for i in range(1000)]
    assert stats["authenticated"] == 2
    assert stats["malformed"] == stats["forbidden"] == stats["callback_errors"] == 0
    strangers = len(tasks) + idle_count
    assert stats["accepted"] >= strangers  # plus the ranks' (and any retried) handshakes
    # the server's own thread and each client's sender: no thread per connection
    assert threads_peak <= 3, threads_peak
    assert rss_peak - rss_before < 50 * 1024 * 1024, (rss_peak - rss_before) / 2**20
    assert capfd.readouterr().err == ""
    print(
        f"\n{strangers} stranger connections in {elapsed:.2f} s ({strangers / elapsed:.0f}/s), "
        f"{len(sent_steps)} + 1000 records delivered; peak extra threads {threads_peak}, "
        f"peak RSS growth {(rss_peak - rss_before) / 2**20:.1f} MiB; {stats}"
    )


def authenticate(server, role: str, rank: int) -> socket.socket:
    """A connection that did the handshake itself, so that it can write anything after it."""
    secret = rank_key({"worker": WORKER_SECRET, "launcher": LAUNCHER_SECRET}[role], role, rank)
    sock = socket.create_connection(server.address, timeout=10)
    if server.cert:
        sock = tls.client_context(server.cert).wrap_socket(sock)
    nonce = read_frame(sock, MAX_HELLO)["nonce"]
    hello = {"nonce": "mine", "run_id": "run-1", "rank": rank, "role": role, "protocol": events.PROTOCOL_VERSION}
    sock.sendall(pack_frame({**hello, "mac": hello_proof(secret, nonce, hello)}))
    reply = read_frame(sock, MAX_HELLO)
    assert reply["ok"] is True and reply["mac"] == hello_mac(secret, "mine").decode()
    # without TLS, what it writes goes in authenticated records (what it makes of them is the test's)
    return sock if server.cert else framemac.MacSocket(sock, framemac.session_key(secret, nonce, "mine"))


ODD_VALUES = [
    None,
    True,
    False,
    -1,
    0,
    10**400,
    2**63,
    1e308,
    -0.0,
    "",
    "ü\ud800",
    "nan",
    [],
    [1, [2]],
    {},
    {"a": 1},
    {"": None},
    [None] * 3,
    "x" * 1000,
]


def mutated_items(rng: random.Random, n: int) -> list:
    """Encodings of valid records with fields replaced, removed or added at random."""
    samples = [
        events.encode(r)
        for r in (
            events.Started(rank=0, host="h", pid=1),
            events.Log(rank=0, line="x"),
            events.Progress(rank=0, bar="b", n=1, total=2),
            events.Metrics.point(rank=0, step=1, values={"a": 1.0}),
            events.Dropped(rank=0, count=1),
            events.Exit(rank=0, code=1, failure=events.Failure(rank=0)),
            events.Stop(rank=0),
            events.RunJob(rank=0, job_id="j"),
        )
    ]
    items = []
    for _ in range(n):
        item = dict(rng.choice(samples))
        for _ in range(rng.randint(1, 3)):
            action, key = rng.random(), rng.choice(list(item) + ["type", "extra"])
            if action < 0.6:
                item[key] = rng.choice(ODD_VALUES + [rng.choice(list(events.RECORDS)), "unknown"])
            elif action < 0.8:
                item.pop(key, None)
            else:
                item = rng.choice(ODD_VALUES)
                break
        items.append(item)
    return items


def expected_outcome(item, role: str) -> str:
    """What the contract says a record should come to (``events.decode`` is the judge)."""
    try:
        record = events.decode(item)
    except Exception:  # noqa: BLE001  anything decode raises makes the record malformed
        return "malformed"
    return "delivered" if type(record) in events.SENDERS[role] else "forbidden"


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "tls"])
def test_after_authentication_bad_records_are_counted_and_good_ones_delivered(capfd, identity, encrypted):
    rng = random.Random(99)
    got = Collector()
    server = make_server(got, encrypted, identity)
    sock = authenticate(server, "worker", rank=3)

    crafted = [
        {
            "type": "metrics",
            "rank": 0,
            "names": ["a"],
            "steps": [1],
            "times": [0.0],
            "values": [[10**400]],
        },  # OverflowError
        {"type": "progress", "rank": 0, "elapsed": 10**400},
        {"type": "exit", "rank": 0, "code": 0},  # forbidden
        {"type": "log", "rank": 0, "line": "forged"},  # forbidden
        {"type": "stop", "rank": 0},  # driver -> rank only
        {"type": "metrics"},
        {"type": 1, "rank": 0},
        {"rank": 0},
        "metrics",
        [],
        None,
        7,
    ]
    items = crafted + mutated_items(rng, 3000)
    expected = {"delivered": [], "malformed": 0, "forbidden": 0}
    body_frames = []
    for i in range(0, len(items), 37):
        chunk = items[i : i + 37]
        good = events.Metrics.point(rank=99, step=i)
        chunk.append(events.encode(good))
        for item in chunk:
            outcome = expected_outcome(item, "worker")
            if outcome == "delivered":
                expected["delivered"].append(dataclasses.replace(events.decode(item), rank=3))
            else:
                expected[outcome] += 1
        body_frames.append(json.dumps({"events": chunk}).encode())

    bad_frames = [
        b"not json",
        b"\xff\xfe\xfd",
        b"[]",
        b'"events"',
        b'{"events": "x"}',
        b'{"events": {}}',
        b'{"no": []}',
        b"{" * 100_000,
        b"[" * 100_000 + b"]" * 100_000,
        b'{"events": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b"",
    ]
    bad_frames += [rng.randbytes(rng.randint(1, 2000)) for _ in range(300)]
    for body in bad_frames:
        try:
            parsed = json.loads(body.decode("utf-8"))
            ok = isinstance(parsed, dict) and isinstance(parsed.get("events"), list)
        except (ValueError, RecursionError):
            ok = False
        assert not ok
    expected["malformed"] += len(bad_frames)

    stream = []
    for i, body in enumerate(body_frames):
        stream.append(frame(body))
        stream += [frame(b) for b in bad_frames[i :: len(body_frames)]]
    sock.sendall(b"".join(stream))
    sock.sendall(LEN.pack(MAX_FRAME + 1))  # the stream can no longer be split: the server hangs up
    while sock.recv(65536):
        pass
    sock.close()

    # the channel still serves a well-behaved rank
    client = ChannelClient(
        f"{server.address[0]}:{server.address[1]}",
        rank_key(WORKER_SECRET, "worker", 4),
        "run-1",
        4,
        certificate=server.cert,
    )
    client.send(events.Started(rank=4, pid=4))
    client.close()
    server.close()

    assert got.records == expected["delivered"] + [events.Started(rank=4, pid=4)]
    assert server.stats["malformed"] == expected["malformed"] + 1  # + the oversized frame
    assert server.stats["forbidden"] == expected["forbidden"]
    assert expected["forbidden"] >= 3 and len(expected["delivered"]) > len(body_frames)
    assert capfd.readouterr().err == ""


def ok_after_three_seconds():
    from torchdist_magic import rank, report

    deadline, step = time.monotonic() + 3, 0
    while time.monotonic() < deadline:
        step += 1
        report(step=step, steps=float(step))
        time.sleep(0.05)
    report(step=step + 1, finished=1.0)
    return ("ok", rank())


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "tls"])
def test_a_run_finishes_while_strangers_flood_its_channel(encrypted):
    from torchdist_magic import Distributor

    run = Distributor(2, local_mode=True, show=None, tls=encrypted).submit(ok_after_three_seconds)
    stop = threading.Event()
    threads = []
    try:
        wait_until(lambda: run.channel_address is not None or run.done(), timeout=30)
        assert run.channel_address is not None, run.exception
        host, _, port = run.channel_address.rpartition(":")
        address = (host, int(port))

        def flood(seed):
            rng = random.Random(seed)
            payloads = stranger_payloads(rng, 200)
            while not stop.is_set():
                over_tls = encrypted and rng.random() < 0.5
                send_as_stranger(
                    address, rng.choice(payloads), (over_tls or not encrypted) and rng.random() < 0.5, over_tls
                )

        def hold_idle():
            held = []
            while not stop.is_set() and len(held) < 200:
                try:
                    held.append(socket.create_connection(address, timeout=10))
                except OSError:
                    break
            stop.wait()
            for sock in held:
                sock.close()

        threads = [threading.Thread(target=flood, args=(seed,)) for seed in range(3)]
        threads.append(threading.Thread(target=hold_idle))
        for t in threads:
            t.start()
        assert run.result(timeout=60) == ("ok", 0)
        assert run.channel_encrypted is encrypted
        # what the ranks reported over the channel while it was flooded arrived
        assert [rs.metrics.get("finished") for rs in run.state.ranks] == [1.0, 1.0]
        assert all(len(rs.history["steps"]) > 10 for rs in run.state.ranks)
    finally:
        stop.set()
        for t in threads:
            t.join()
        run.cancel()
        run.wait(30)
    assert_no_survivors(run)
