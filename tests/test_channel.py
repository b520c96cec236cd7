"""Event channel: typed records both ways, roles, refusals, dropping, coalescing, closing."""

import dataclasses
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import threading

import pytest

from helpers import Collector, wait_until
from torchdist_magic.wire import framemac, handshake, tls
from torchdist_magic.wire import server as server_module
from torchdist_magic.core import events
from torchdist_magic.wire.batching import MERGED_LOG_CHARS, _coalesce, _merge_metrics, encode_batch, merge_logs
from torchdist_magic.wire.client import ChannelClient, client_from_env
from torchdist_magic.core.rankenv import rank_key
from torchdist_magic.wire.frames import MAX_FRAME, MAX_HELLO, hello_mac, hello_proof, new_secret, pack_frame, read_frame
from torchdist_magic.wire.server import ChannelServer
from torchdist_magic.driver.state import RunState


@pytest.fixture(scope="module")
def identity():
    return tls.new_identity()


@pytest.fixture(scope="module")
def other_identity():
    return tls.new_identity()


@pytest.fixture(params=["plain", "tls"])
def server(request, identity):
    """A channel server, unencrypted and with TLS: every test of it holds for both."""
    got = Collector()
    encrypted = request.param == "tls"
    srv = ChannelServer(
        got, run_id="run-1", secret=new_secret(), launcher_secret=new_secret(), identity=identity if encrypted else None
    )
    srv.got = got
    srv.cert = identity.certificate if encrypted else ""  # what its clients pin
    yield srv
    srv.close()


def address(srv):
    return f"{srv.address[0]}:{srv.address[1]}"


def key(srv, role, rank=0):
    """What ``role`` of ``rank`` authenticates with on ``srv`` (``rank_key``)."""
    return rank_key(srv._secrets[role], role, rank)


def worker(srv, rank=0, **kwargs):
    return ChannelClient(address(srv), key(srv, "worker", rank), "run-1", rank, certificate=srv.cert, **kwargs)


def launcher(srv, rank=0, **kwargs):
    return ChannelClient(
        address(srv), key(srv, "launcher", rank), "run-1", rank, role="launcher", certificate=srv.cert, **kwargs
    )


EVERY_RANK_RECORD = [
    events.Started(rank=99, host="h", pid=12, time=1.5),
    events.Log(rank=99, stream="stderr", line="épsilon ☃", cr=True),
    events.Progress(rank=99, bar="b", desc="epoch", n=3, total=10, elapsed=0.5, state="done"),
    events.Metrics.point(rank=99, step=7, values={"loss": 0.25, "acc": "nan"}, time=2.0),
    events.Dropped(rank=99, count=4),
    events.Exit(
        rank=99,
        code=-9,
        time=3.0,
        host="h",
        stopped=True,
        failure=events.Failure(
            rank=99,
            host="h",
            exit_code=-9,
            exc_type="KeyError",
            message="m",
            traceback="tb",
            time=3.0,
            log_tail=["a", "b"],
        ),
    ),
]


def test_every_record_type_arrives_intact_with_the_authenticated_rank(server):
    client = launcher(server, rank=3)
    for record in EVERY_RANK_RECORD:
        client.send(record)
    client.close()
    assert server.got.records == [dataclasses.replace(r, rank=3) for r in EVERY_RANK_RECORD]
    assert server.stats["delivered"] == len(EVERY_RANK_RECORD)


def test_many_records_arrive_in_order(server):
    client = launcher(server, rank=1)
    for i in range(20_000):
        client.send(events.Log(rank=1, line=f"l{i}"))
    client.close()  # returns once the driver has handled everything sent before it
    assert [o.line for r in server.got.records for o in r.lines()] == [f"l{i}" for i in range(20_000)]


def test_a_worker_may_not_send_what_only_its_launcher_may(server):
    client = worker(server, rank=2)
    client.send(events.Exit(rank=2, code=0))
    client.send(events.Log(rank=2, line="forged output"))
    client.send(events.Metrics.point(rank=2, step=1, values={"x": 1.0}))
    client.close()
    assert server.got.records == [events.Metrics.point(rank=2, step=1, values={"x": 1.0})]
    assert server.stats["forbidden"] == 2


def test_on_event_errors_are_counted_and_the_channel_goes_on():
    seen = []

    def on_event(record):
        seen.append(record)
        if record.n % 2:
            raise RuntimeError("handler bug")

    srv = ChannelServer(on_event, "run-1", secret="s", launcher_secret="l")
    client = ChannelClient(address(srv), key(srv, "worker"), "run-1", 0)
    for n in range(10):  # records of their own each (metric points of one flush share one)
        client.send(events.Progress(rank=0, bar=f"bar{n}", n=n))
    client.close()
    srv.close()
    assert [r.n for r in seen] == list(range(10))
    assert srv.stats["callback_errors"] == 5 and srv.stats["delivered"] == 5


def test_driver_records_reach_on_message(server):
    got_a, got_b = Collector(), Collector()
    a = launcher(server, rank=0, on_message=got_a)
    b = launcher(server, rank=1, on_message=got_b)
    w = worker(server, rank=0)
    wait_until(lambda: server.stats["authenticated"] == 3)
    assert server.send(1, events.RunJob(rank=1, job_id="j2", data="AAA=", last=True, env={"A": "1"}))
    assert server.broadcast(events.Stop(rank=-1, grace=1.5)) == 2  # launchers only
    assert not server.send(7, events.Stop(rank=7))  # no such rank
    assert got_b.wait_for(2) == [
        events.RunJob(rank=1, job_id="j2", data="AAA=", last=True, env={"A": "1"}),
        events.Stop(rank=-1, grace=1.5),
    ]
    assert got_a.wait_for(1) == [events.Stop(rank=-1, grace=1.5)]
    for client in (a, b, w):
        client.close()


def test_close_delivers_what_clients_already_sent(server):
    client = launcher(server, rank=0)
    for i in range(5000):
        client.send(events.Log(rank=0, line=str(i)))
    wait_until(lambda: server.stats["authenticated"] == 1)
    closing = threading.Thread(target=client.close)
    closing.start()
    server.close()
    closing.join()
    assert [o.line for r in server.got.records for o in r.lines()] == [str(i) for i in range(5000)]
    server.close()  # idempotent
    assert not server.send(0, events.Stop(rank=0))


def test_progress_updates_of_a_bar_are_coalesced_to_the_newest():
    a1, a2 = events.Progress(rank=0, bar="a", n=1), events.Progress(rank=0, bar="a", n=2)
    b1, log = events.Progress(rank=0, bar="b", n=1), events.Log(rank=0, line="x")
    assert _coalesce([a1, log, b1, a2]) == [log, b1, a2]


def test_the_lines_of_a_flush_travel_as_one_record_and_never_cross_a_job_end():
    a, b = events.Log(rank=0, line="a"), events.Log(rank=0, line="b")
    bar, point = events.Progress(rank=0, bar="x", n=1), events.Metrics.point(rank=0, step=1, values={"l": 1.0})
    end = events.OutputEnd(rank=0, job_id="j1")
    c, d = events.Log(rank=0, line="c"), events.Log(rank=1, line="d")
    merged = merge_logs([a, bar, b, point, end, c, d])
    # b moves ahead of the progress and metrics records, into a's record; c stays after the job's end
    assert [type(r).__name__ for r in merged] == ["Log", "Progress", "Metrics", "OutputEnd", "Log", "Log"]
    assert merged[0] == events.Log(rank=0, line="a", more=["b"])
    assert merged[4] is c and merged[5] is d  # rank 1's line is its own record
    assert a.more == []  # the sender's record is not changed


def test_a_record_of_merged_lines_holds_one_stream_and_a_redrawn_line_only_first():
    lines = [
        events.Log(rank=0, line="a"),
        events.Log(rank=0, stream="stderr", line="b"),
        events.Log(rank=0, stream="stderr", line="c"),
        events.Log(rank=0, stream="stderr", line="50%", cr=True),
        events.Log(rank=0, stream="stderr", line="100%"),
        events.Log(rank=0, line="d"),
    ]
    merged = merge_logs(lines)
    assert merged == [
        events.Log(rank=0, line="a"),
        events.Log(rank=0, stream="stderr", line="b", more=["c"]),
        events.Log(rank=0, stream="stderr", line="50%", cr=True, more=["100%"]),
        events.Log(rank=0, line="d"),
    ]
    assert [line for r in merged for line in r.lines()] == [events.OutputLine(r.stream, r.line, r.cr) for r in lines]
    state = RunState("r", 1)
    for record in merged:
        state.apply(record)
    assert state.logs(0) == "a\nb\nc\n100%\nd\n"  # the redrawn line replaced, as on a terminal


def test_the_points_of_a_flush_travel_as_one_record_column_by_column():
    a = events.Metrics.point(rank=0, step=1, values={"loss": 1.0}, time=1.0)
    b = events.Metrics.point(rank=0, step=2, values={"loss": 0.5, "acc": "nan"}, time=2.0)
    c = events.Metrics.point(rank=0, step=3, values={"acc": 0.9}, time=3.0)
    other, bar = events.Metrics.point(rank=1, step=7, values={"x": 2.0}), events.Progress(rank=0, bar="b")
    merged = _merge_metrics([a, bar, b, other, c])
    assert merged[1:] == [bar, other]
    # each name once, in the order it first came; None where a point did not report it
    assert merged[0] == events.Metrics(
        rank=0,
        names=["loss", "acc"],
        steps=[1, 2, 3],
        times=[1.0, 2.0, 3.0],
        values=[[1.0, 0.5, None], [None, "nan", 0.9]],
    )
    assert [p.values for p in merged[0].points()] == [{"loss": 1.0}, {"loss": 0.5, "acc": "nan"}, {"acc": 0.9}]
    assert a == events.Metrics.point(rank=0, step=1, values={"loss": 1.0}, time=1.0)  # the sender's, unchanged
    # a point JSON cannot carry is dropped alone, counted; the others still go
    body = encode_batch([a, events.Metrics.point(rank=0, step=2, values={"loss": object()}), c], rank=0)
    got = [events.decode(record) for record in json.loads(body[4:])["events"]]
    assert got == [a, c, events.Dropped(rank=0, count=1)]


def test_merged_lines_stay_below_the_size_of_one_record():
    line = "x" * 1000
    merged = merge_logs([events.Log(rank=0, line=line) for _ in range(200)])
    assert sum(len(r.lines()) for r in merged) == 200
    assert len(merged) == 4  # 64 lines of 1000 characters fit 64 KiB
    assert all(sum(len(o.line) for o in r.lines()) <= MERGED_LOG_CHARS for r in merged)


def test_the_run_state_keeps_every_line_of_a_merged_record():
    state = RunState("r", 1)
    state.apply(merge_logs([events.Log(rank=0, line=str(i)) for i in range(5)])[0])
    assert state.logs(0).splitlines() == ["0", "1", "2", "3", "4"]


class StalledDriver:
    """A listener that accepts but answers only when told: the client's sender thread waits in
    its handshake meanwhile, so its queue fills up."""

    def __init__(self, secret):
        self.secret = secret
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]

    def handshake(self):
        conn, _ = self.listener.accept()
        conn.settimeout(10)
        conn.sendall(pack_frame({"nonce": "n0"}))
        hello = read_frame(conn, MAX_HELLO)
        assert hello["mac"] == hello_proof(self.secret, "n0", hello)
        conn.sendall(pack_frame({"ok": True, "mac": hello_mac(self.secret, hello["nonce"]).decode()}))
        return DriverRecords(conn, framemac.session_key(self.secret, "n0", hello["nonce"]))

    def cut_off(self):
        """What a driver flooded by strangers does to a handshake: evict it half-way."""
        conn, _ = self.listener.accept()
        conn.sendall(pack_frame({"nonce": "n1"}))
        conn.close()

    def close(self):
        self.listener.close()


class DriverRecords(framemac.MacSocket):
    """The driver's end of a connection without TLS after its handshake (records both ways)."""

    def __init__(self, sock, key):
        super().__init__(sock, key)
        self._sealer = framemac.Sealer(key, framemac.FROM_DRIVER)
        self._opener = framemac.Opener(key, framemac.FROM_CLIENT)


def test_a_full_queue_drops_and_reports_how_many():
    driver = StalledDriver("s")
    client = ChannelClient(driver.address, "s", "r", 5, maxsize=10)
    for i in range(1000):  # far more than the queue holds, and nothing drains it yet: never blocks
        client.send(events.Metrics.point(rank=5, step=i))
    conn = driver.handshake()
    closing = threading.Thread(target=client.close)
    closing.start()
    received = []
    while True:
        try:
            frame = read_frame(conn, MAX_FRAME)
        except EOFError:
            break
        received += [events.decode(e) for e in frame["events"]]
    conn.close()
    closing.join()
    driver.close()
    # the points queued, in one record, then how many were dropped
    assert [(p.step, p.values) for p in received[0].points()] == [(i, {}) for i in range(10)]
    assert received[1:] == [events.Dropped(rank=5, count=990)]


def assert_the_record_arrives_on(conn, client, driver, capfd):
    """The client's one record (``Started`` of rank 2) comes on ``conn``, the connection of its
    retried handshake, as the client closes; nothing was printed."""
    closing = threading.Thread(target=client.close)
    closing.start()
    frame = read_frame(conn, MAX_FRAME)
    assert [events.decode(e) for e in frame["events"]] == [events.Started(rank=2, pid=2)]
    conn.close()
    closing.join()
    driver.close()
    assert capfd.readouterr().err == ""


def test_a_handshake_cut_off_is_tried_again(capfd):
    driver = StalledDriver("s")
    client = ChannelClient(driver.address, "s", "r", 2)
    client.send(events.Started(rank=2, pid=2))
    driver.cut_off()
    conn = driver.handshake()
    assert_the_record_arrives_on(conn, client, driver, capfd)


def test_a_handshake_that_takes_too_long_is_tried_again(capfd, monkeypatch):
    # the first attempt waits this long for a challenge that never comes; the second's must come
    # within it too, from this test's thread, which a loaded machine may hold up a while
    monkeypatch.setattr(handshake, "HANDSHAKE_DEADLINE", 3.0)
    driver = StalledDriver("s")
    client = ChannelClient(driver.address, "s", "r", 2)
    client.send(events.Started(rank=2, pid=2))
    slow, _ = driver.listener.accept()  # a driver too busy to send its challenge in time
    conn = driver.handshake()  # the client's next attempt
    slow.close()
    assert_the_record_arrives_on(conn, client, driver, capfd)


def test_a_driver_that_cannot_prove_the_secret_is_not_obeyed(capfd):
    driver = StalledDriver("s")
    got = Collector()
    client = ChannelClient(driver.address, "s", "r", 0, role="launcher", on_message=got)
    conn, _ = driver.listener.accept()
    conn.sendall(pack_frame({"nonce": "n0"}))
    read_frame(conn, MAX_HELLO)
    conn.sendall(pack_frame({"ok": True, "mac": "0" * 64}))
    conn.sendall(pack_frame({"events": [events.encode(events.Stop(rank=0))]}))
    client.close()
    conn.close()
    driver.close()
    assert got.records == []
    err = capfd.readouterr().err
    assert err.count("torchdist_magic:") == 1 and "could not prove" in err, err


def test_records_json_cannot_carry_are_counted_as_dropped(server):
    client = worker(server, rank=0)
    client.send(events.Metrics.point(rank=0, step=1, values={"loss": float("nan")}))
    client.send(events.Metrics.point(rank=0, step=2, values={"loss": 1.0}))
    client.close()
    assert server.got.records == [
        events.Metrics.point(rank=0, step=2, values={"loss": 1.0}),
        events.Dropped(rank=0, count=1),
    ]


def test_send_takes_only_records(server):
    client = worker(server)
    with pytest.raises(TypeError, match="events.Event"):
        client.send({"type": "log", "line": "x"})
    client.close()


@pytest.mark.parametrize(
    "make, reason",
    [
        # over TLS too: the certificate says who the driver is, the secrets who may speak
        (
            lambda srv: ChannelClient(address(srv), "not-the-secret", "run-1", 0, certificate=srv.cert),
            "wrong secret for role worker",
        ),
        (
            lambda srv: ChannelClient(address(srv), key(srv, "worker"), "another-run", 0, certificate=srv.cert),
            "wrong run",
        ),
        # a worker knows only its own key: it cannot pose as its launcher
        (
            lambda srv: ChannelClient(
                address(srv), key(srv, "worker"), "run-1", 0, role="launcher", certificate=srv.cert
            ),
            "wrong secret for role launcher",
        ),
    ],
    ids=["bad-secret", "wrong-run", "worker-posing-as-launcher"],
)
def test_refused_clients_say_why_once_and_deliver_nothing(server, capfd, make, reason):
    client = make(server)
    for i in range(3):
        client.send(events.Metrics.point(rank=0, step=i))
    client.close()
    err = capfd.readouterr().err
    assert err.count("torchdist_magic:") == 1 and reason in err and "refused" in err, err
    assert server.got.records == [] and server.stats["rejected"] == 1


def test_a_peer_of_another_protocol_version_is_told_both_versions(server):
    other = events.PROTOCOL_VERSION + 1
    code = (
        f"from torchdist_magic.core import events\nfrom torchdist_magic.wire.client import ChannelClient\n"
        f"events.PROTOCOL_VERSION = {other}\n"
        f"c = ChannelClient({address(server)!r}, {key(server, 'worker')!r}, 'run-1', 0, "
        f"certificate={server.cert!r})\n"
        f"c.send(events.Metrics.point(rank=0))\n"
        f"c.close()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchdist_magic:"), proc.stderr
    assert f"version {other}" in lines[0] and f"version {events.PROTOCOL_VERSION}" in lines[0]
    assert "same torchdist_magic version" in lines[0]
    assert server.got.records == [] and server.stats["rejected"] == 1


def test_an_unreachable_driver_costs_one_line_and_never_blocks(capfd):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    client = ChannelClient(f"127.0.0.1:{port}", "s", "r", rank=0, maxsize=10)
    for i in range(1000):
        client.send(events.Metrics.point(rank=0, step=i))
    client.close(timeout=5)
    err = capfd.readouterr().err
    # one line that says where, why, and that the records (sent or still to come) are dropped
    assert err == (
        f"torchdist_magic: cannot reach the driver's event channel at 127.0.0.1:{port} "
        "([Errno 111] Connection refused); events of rank 0 are dropped\n"
    ), err


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\x00\x00\x05hello",  # not JSON
        b"\xff\xff\xff\xff",  # absurd length
        b"\x00\x00\x00\x02[]",  # JSON, not an object
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # a stray HTTP client
    ],
)
def test_garbage_before_authentication_is_rejected_and_the_server_serves_on(server, garbage):
    with socket.create_connection(server.address, timeout=5) as sock:
        sock.sendall(garbage)
        wait_until(lambda: server.stats["rejected"] == 1)
    client = worker(server, rank=1)
    client.send(events.Started(rank=1, pid=1))
    client.close()
    assert server.got.records == [events.Started(rank=1, pid=1)]


def _closed_by_peer(sock):
    try:
        while sock.recv(4096):  # the challenge, then the end
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_new_connection_evicts_the_oldest_waiting_one(server, monkeypatch):
    monkeypatch.setattr(server_module, "MAX_PENDING", 64)  # a smaller table: the same rule, fewer sockets
    idle = [socket.create_connection(server.address, timeout=10) for _ in range(server_module.MAX_PENDING)]
    wait_until(lambda: server.stats["accepted"] == server_module.MAX_PENDING)
    newest = socket.create_connection(server.address, timeout=10)
    assert _closed_by_peer(idle[0])
    wait_until(lambda: server.stats["evicted"] == 1)
    for sock in idle + [newest]:
        sock.close()


def test_a_silent_connection_is_closed_at_the_handshake_deadline(monkeypatch):
    monkeypatch.setattr(server_module, "HANDSHAKE_DEADLINE", 0.2)
    srv = ChannelServer(Collector(), "run-1", secret="s", launcher_secret="l")
    with socket.create_connection(srv.address, timeout=10) as sock:
        assert _closed_by_peer(sock)
    assert srv.stats["rejected"] == 1
    srv.close()


def test_client_from_env(server, monkeypatch):
    monkeypatch.delenv("TORCHDIST_CHANNEL", raising=False)
    assert client_from_env() is None
    monkeypatch.setenv("TORCHDIST_CHANNEL", address(server))
    monkeypatch.setenv("TORCHDIST_SECRET", key(server, "worker", 4))
    monkeypatch.setenv("TORCHDIST_RUN_ID", "run-1")
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("TORCHDIST_CHANNEL_CERT", server.cert)
    client = client_from_env()
    client.send(events.Started(rank=0, pid=os.getpid()))
    client.close()
    assert server.got.records == [events.Started(rank=4, pid=os.getpid())]


def test_frames_are_length_prefixed_json():
    data = pack_frame({"events": [events.encode(events.Stop(rank=1, grace=2.0))]})
    (length,) = struct.unpack(">I", data[:4])
    assert json.loads(data[4 : 4 + length]) == {"events": [{"type": "stop", "rank": 1, "grace": 2.0}]}


# -- TLS --------------------------------------------------------------------------------------


def tls_server(identity, **kwargs):
    got = Collector()
    srv = ChannelServer(got, run_id="run-1", secret="s", launcher_secret="l", identity=identity, **kwargs)
    srv.got = got
    return srv


def test_a_client_pinned_to_another_certificate_is_refused_and_sends_nothing(identity, other_identity, capfd):
    srv = tls_server(identity)
    client = ChannelClient(address(srv), "s", "run-1", 0, certificate=other_identity.certificate)
    client.send(events.Metrics.point(rank=0, step=1))
    client.close()
    wait_until(lambda: srv.stats["rejected"] == 1)  # the client's TLS alert ends the handshake
    srv.close()
    err = capfd.readouterr().err
    assert err.count("torchdist_magic:") == 1, err
    assert "is not this run's driver: its TLS certificate is not the one this run pinned" in err, err
    assert srv.got.records == [] and srv.stats["authenticated"] == 0


@pytest.mark.parametrize("kind", ["self-signed", "issued-by-the-pinned-one"])
def test_a_server_with_another_certificate_for_the_same_key_is_refused(identity, capfd, kind):
    """The pin is the exact certificate, not its key: another certificate made with the driver's
    key, self-signed or claiming the pinned one as its issuer, is refused."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key = serialization.load_pem_private_key(identity.private_key, None)
    pinned = x509.load_pem_x509_certificate(identity.certificate.encode())
    subject = (
        pinned.subject if kind == "self-signed" else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "impostor")])
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    twin = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(pinned.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    srv = tls_server(tls.ChannelIdentity(twin.public_bytes(serialization.Encoding.PEM).decode(), identity.private_key))
    client = ChannelClient(address(srv), "s", "run-1", 0, certificate=identity.certificate)
    client.send(events.Metrics.point(rank=0, step=1))
    client.close()
    srv.close()
    err = capfd.readouterr().err
    assert err.count("torchdist_magic:") == 1, err
    assert "is not this run's driver: its TLS certificate is not the one this run pinned" in err, err
    assert srv.got.records == [] and srv.stats["authenticated"] == 0


def test_a_plaintext_client_is_refused_by_a_tls_server_within_the_handshake_deadline(identity, monkeypatch, capfd):
    monkeypatch.setattr(server_module, "HANDSHAKE_DEADLINE", 0.2)
    monkeypatch.setattr(handshake, "HANDSHAKE_DEADLINE", 0.2)
    srv = tls_server(identity)
    # a TLS server says nothing in plaintext: a silent stranger gets no challenge, only the end
    with socket.create_connection(srv.address, timeout=10) as sock:
        assert sock.recv(4096) == b""
    wait_until(lambda: srv.stats["rejected"] == 1)
    # our own client without the certificate waits for a challenge that never comes, and the
    # server lets its pending slot go at the deadline
    client = ChannelClient(address(srv), "s", "run-1", 0)
    client.send(events.Metrics.point(rank=0, step=1))
    client.close()
    wait_until(lambda: not srv._pending, what="the pending table to be empty")
    srv.close()
    err = capfd.readouterr().err
    assert err.count("torchdist_magic:") == 1 and "cannot reach the driver's event channel" in err, err
    assert srv.got.records == [] and srv.stats["authenticated"] == 0 and srv.stats["rejected"] >= 2


def test_a_tls_client_of_a_plaintext_server_gives_up_with_one_line(identity, capfd):
    srv = ChannelServer(Collector(), run_id="run-1", secret="s", launcher_secret="l")
    client = ChannelClient(address(srv), "s", "run-1", 0, certificate=identity.certificate)
    client.send(events.Metrics.point(rank=0, step=1))
    client.close()
    srv.close()
    err = capfd.readouterr().err
    assert err.count("torchdist_magic:") == 1 and "cannot reach the driver's event channel" in err, err
    assert srv.stats["authenticated"] == 0


class Relay:
    """A TCP relay on 127.0.0.1 between one client and the server that records what passes,
    each way: what anyone on the network between a rank and the driver sees."""

    def __init__(self, target):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.up, self.down = bytearray(), bytearray()  # rank -> driver, driver -> rank
        self.threads = [threading.Thread(target=self._serve)]
        self.threads[0].start()

    def _serve(self):
        near, _ = self.listener.accept()
        far = socket.create_connection(self.target)
        pumps = [
            threading.Thread(target=self._pump, args=(near, far, self.up)),
            threading.Thread(target=self._pump, args=(far, near, self.down)),
        ]
        for t in pumps:
            t.start()
        for t in pumps:
            t.join()
        near.close()
        far.close()

    @staticmethod
    def _pump(src, dst, seen):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                seen += data
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:  # the other side went first
            pass

    def close(self):
        self.threads[0].join(30)
        self.listener.close()


def test_the_bytes_on_the_wire_are_ciphertext_with_tls_only(server):
    """The same records through a relay: readable on the wire without TLS, not with it."""
    relay = Relay(server.address)
    got = Collector()
    client = ChannelClient(
        relay.address, key(server, "launcher"), "run-1", 0, role="launcher", certificate=server.cert, on_message=got
    )
    client.send(events.Log(rank=0, line="rank says: the-distinctive-loss-4711"))
    wait_until(lambda: server.got.records)
    assert server.send(
        0, events.RunJob(rank=0, job_id="j", data="", last=True, env={"NOTE": "driver says: the-distinctive-job-0815"})
    )
    assert got.wait_for(1)[0].env == {"NOTE": "driver says: the-distinctive-job-0815"}
    client.close()
    relay.close()
    assert server.got.records == [events.Log(rank=0, line="rank says: the-distinctive-loss-4711")]
    up, down = bytes(relay.up), bytes(relay.down)
    if server.encrypted:
        assert up[:1] == b"\x16" and down[:1] == b"\x16"  # each way starts with a TLS handshake record
        assert b"the-distinctive-loss-4711" not in up and b"the-distinctive-job-0815" not in down
        assert b"run-1" not in up and b"nonce" not in down  # the hello and the challenge too
    else:
        assert b"the-distinctive-loss-4711" in up and b"the-distinctive-job-0815" in down


CONNECT_ALL = """
import resource, sys
from torchdist_magic.wire.client import ChannelClient
from torchdist_magic.core.rankenv import rank_key
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, {count} + 256)), hard))
address, secret, role, cert = sys.argv[1:5]
clients = [ChannelClient(address, rank_key(secret, role, rank), "run-1", rank, role=role, certificate=cert)
           for rank in range({count})]
sys.stdin.read()  # until the test has seen them all
for client in clients:
    client.close()
"""


@pytest.mark.scale
def test_every_connection_of_1024_ranks_opened_at_once_authenticates(identity):
    # a worker's and a launcher's connection per rank, as on Spark, over TLS; one helper process
    # per role keeps each process under its file descriptor limit, and this one holds 2048 sockets
    count = 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2 * count + 256:
        pytest.skip(f"the file descriptor limit ({hard}) is below {2 * count + 256}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * count)), hard))
    got = Collector()
    srv = ChannelServer(got, "run-1", secret="s", launcher_secret="l", identity=identity)
    helpers = [
        subprocess.Popen(
            [sys.executable, "-c", CONNECT_ALL.format(count=count), address(srv), secret, role, identity.certificate],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role, secret in (("worker", "s"), ("launcher", "l"))
    ]
    try:
        wait_until(
            lambda: srv.stats["authenticated"] == 2 * count,
            timeout=240,
            what=f"all {2 * count} connections to authenticate",
        )
        routes = set(srv._routes)  # nobody connects any more: read as it is
    finally:
        errors = [helper.communicate(timeout=120)[1] for helper in helpers]
        srv.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert routes == {(role, rank) for role in ("worker", "launcher") for rank in range(count)}
    assert [helper.returncode for helper in helpers] == [0, 0] and errors == ["", ""], errors
    assert srv.stats["rejected"] == 0
