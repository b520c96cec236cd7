"""Host relays (``wire.relay``, ``wire.fanin``): a host's ranks reach the driver over one
connection, each record still checked as its rank's worker or launcher, and a relay speaks for
its own host's ranks only.  Real sockets, real servers and clients, TLS and not."""

import socket
import threading

import pytest

from helpers import Collector, wait_until
from torchdist_magic.core import events
from torchdist_magic.core.rankenv import RELAY_ENV, RELAY_FROM, rank_key, uses_relay
from torchdist_magic.wire import fanin, tls
from torchdist_magic.wire.client import ChannelClient
from torchdist_magic.wire.frames import LENGTH, MAX_FRAME, Refused, new_secret
from torchdist_magic.wire.handshake import MAX_RELAY_RANKS, open_connection
from torchdist_magic.wire.relay import HostRelay
from torchdist_magic.wire.server import ChannelServer

RUN = "run-r"


@pytest.fixture(scope="module")
def identity():
    return tls.new_identity()


class Driver:
    """A driver's channel of a 4-rank run and the refusals it reported."""

    def __init__(self, identity=None):
        self.got = Collector()
        self.refusals = []
        self.secret, self.launcher_secret = new_secret(), new_secret()
        self.server = ChannelServer(
            self.got,
            RUN,
            secret=self.secret,
            launcher_secret=self.launcher_secret,
            identity=identity,
            ranks=4,
            on_refusal=lambda *refusal: self.refusals.append(refusal),
        )
        self.cert = identity.certificate if identity is not None else ""
        self.address = f"127.0.0.1:{self.server.port}"

    def relay(self, ranks, **kwargs):
        kwargs.setdefault("certificate", self.cert)
        return HostRelay(self.address, self.secret, self.launcher_secret, RUN, ranks, world_size=4, **kwargs)

    def client(self, where, rank, role="worker", **kwargs):
        secret = self.launcher_secret if role == "launcher" else self.secret
        return ChannelClient(where, rank_key(secret, role, rank), RUN, rank, role=role, **kwargs)

    def raw_relay(self, ranks, first=None):
        """A connection to the driver as the relay of ``ranks``, written by hand."""
        first = min(ranks) if first is None else first
        key = rank_key(self.launcher_secret, "relay", first)
        context = tls.client_context(self.cert) if self.cert else None
        return open_connection(self.server.address, key, RUN, first, "relay", context, ranks=list(ranks))

    def lines(self):
        return [line.line for line in self.got.records if isinstance(line, events.Log) for line in line.lines()]


@pytest.fixture(params=["plain", "tls"])
def driver(request, identity):
    made = Driver(identity if request.param == "tls" else None)
    yield made
    made.server.close()


def relay_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("torchdist-relay")]


def test_a_hosts_ranks_reach_the_driver_over_one_connection(driver):
    relay = driver.relay([2, 3])
    clients = [driver.client(relay.address, rank, role) for rank in (2, 3) for role in ("worker", "launcher")]
    for i in range(200):
        for client in clients[::2]:
            client.send(events.Progress(rank=99, bar="b", n=i))
    for client, rank in zip(clients[1::2], (2, 3)):
        client.send(events.Log(rank=99, line=f"from {rank}"))
        client.send(events.Exit(rank=99, code=0))
    for client in clients:
        client.close()
    relay.close()
    got = driver.got.records
    for rank in (2, 3):  # each rank's records, in order, under the rank that sent them
        mine = [r for r in got if r.rank == rank]
        assert [r for r in mine if not isinstance(r, events.Progress)] == [
            events.Log(rank=rank, line=f"from {rank}"),
            events.Exit(rank=rank, code=0),
        ]
        steps = [r.n for r in mine if isinstance(r, events.Progress)]
        assert steps == sorted(steps) and steps[-1] == 199
    assert driver.server.stats["accepted"] == 1  # one connection to the driver, for four
    assert driver.server.stats["authenticated"] == 5  # the relay, and each role and rank behind it
    assert driver.refusals == [] and relay_threads() == []


def test_each_record_is_checked_as_its_ranks_role_would_be(driver):
    relay = driver.relay([2, 3])
    client = driver.client(relay.address, 2)
    client.send(events.Exit(rank=2, code=0))  # only a launcher reports an exit
    client.send(events.Metrics.point(rank=0, step=1, values={"x": 1.0}))
    client.close()
    relay.close()
    assert driver.got.records == [events.Metrics.point(rank=2, step=1, values={"x": 1.0})]
    assert driver.refusals == [("forbidden", 2, "a Exit record, which a worker may not send")]


def test_the_driver_reaches_each_rank_behind_a_relay(driver):
    relay = driver.relay([2, 3])
    got = {rank: Collector() for rank in (2, 3)}
    launchers = [driver.client(relay.address, rank, "launcher", on_message=got[rank]) for rank in (2, 3)]
    wait_until(lambda: driver.server.stats["authenticated"] == 3)
    assert driver.server.send(3, events.Stop(rank=3, grace=1.0))
    assert driver.server.broadcast(events.DumpStacks(rank=-1)) == 2
    assert not driver.server.send(2, events.Stop(rank=2), role="worker")  # no worker of rank 2 connected
    assert got[3].wait_for(2) == [events.Stop(rank=3, grace=1.0), events.DumpStacks(rank=-1)]
    assert got[2].wait_for(1) == [events.DumpStacks(rank=-1)]
    for client in launchers:
        client.close()
    relay.close()


def test_a_launchers_relay_learns_its_machines_ranks_as_they_come(driver):
    relay = driver.relay([0], others=True)  # it names its own rank; the others connect
    clients = [driver.client(relay.address, rank) for rank in (0, 3)]
    for rank, client in zip((0, 3), clients):
        client.send(events.Started(rank=rank))
        client.close()
    relay.close()
    assert sorted(r.rank for r in driver.got.records) == [0, 3] and driver.refusals == []


def test_a_relay_takes_only_its_hosts_ranks(driver, capfd):
    relay = driver.relay([2, 3])
    stranger = driver.client(relay.address, 1)
    stranger.send(events.Started(rank=1))
    stranger.close()
    relay.close()
    err = capfd.readouterr().err
    assert "refused the event channel of rank 1: rank 1 is not a rank of this host's relay" in err, err
    assert driver.got.records == []


def test_a_second_connection_as_a_rank_at_the_relay_is_said_in_that_ranks_log(driver):
    relay = driver.relay([2, 3])
    first = driver.client(relay.address, 2)
    first.send(events.Started(rank=2))
    driver.got.wait_for(1)
    second = driver.client(relay.address, 2)
    second.send(events.Started(rank=2))
    second.close()
    wait_until(lambda: any("refused a second connection as rank 2's worker" in line for line in driver.lines()))
    first.close()
    relay.close()
    assert [r for r in driver.got.records if isinstance(r, events.Started)] == [events.Started(rank=2)]


def test_a_relay_cannot_speak_for_a_rank_it_did_not_connect_or_another_relay_speaks_for(driver):
    other = driver.raw_relay([0, 1])
    sock = driver.raw_relay([2, 3])
    try:
        body = b'{"events":[{"type":"started","rank":3,"host":"","pid":0,"time":0.0}]}'
        sock.sendall(
            fanin.bundle(
                [
                    fanin.segment(fanin.WORKER, 3, body),  # rank 3's worker never joined
                    fanin.segment(fanin.JOINED, 1, bytes([fanin.WORKER])),  # the other relay's
                    fanin.segment(fanin.JOINED, 2, bytes([7])),  # no role
                    fanin.segment(fanin.JOINED, 9, bytes([fanin.WORKER])),  # no rank of this run's 4
                    fanin.segment(fanin.JOINED, 2, bytes([fanin.WORKER])),
                    fanin.segment(fanin.JOINED, 2, bytes([fanin.WORKER])),  # said twice: the first stands
                    fanin.segment(fanin.WORKER, 2, body),  # joined: taken, as rank 2's
                ]
            )
        )
        wait_until(lambda: len(driver.refusals) == 4 and driver.got.records)
    finally:
        sock.close()
        other.close()
    assert driver.refusals == [
        ("forbidden", 2, "records of rank 3's worker, which this relay has not connected"),
        ("forbidden", 2, "a connection of rank 1, which another relay speaks for"),
        ("forbidden", 2, "a connection of no role or rank of this run (2)"),
        ("forbidden", 2, "a connection of no role or rank of this run (9)"),
    ]
    assert driver.server.stats["authenticated"] == 3  # the two relays, and rank 2's worker once
    assert [r.rank for r in driver.got.records] == [2]


def test_a_frame_that_cannot_be_split_ends_the_relays_connection(driver):
    sock = driver.raw_relay([0, 1])
    try:
        sock.sendall(LENGTH.pack(fanin.SEGMENT.size) + fanin.SEGMENT.pack(9, 0, 0))
        wait_until(lambda: driver.refusals)
        assert sock.recv(1) == b""  # the driver closed it
    finally:
        sock.close()
    assert driver.refusals == [
        ("malformed", 0, "a relay's frame that cannot be split (a segment of kind 9, which does not exist)")
    ]


def test_no_two_relays_name_the_same_rank(driver):
    first = driver.raw_relay([0, 1])
    try:
        with pytest.raises(Refused, match="rank 1 already has a host relay in this run"):
            driver.raw_relay([1, 2])
    finally:
        first.close()


@pytest.mark.parametrize(
    "role, ranks, first, message",
    [
        ("relay", [2, 3], 3, "a host relay names its ranks: from 1 to 256 different ranks of this run"),
        ("relay", [1, 1], 1, "a host relay names its ranks"),
        ("relay", [3, 7], 3, "a host relay names its ranks"),  # rank 7 is not one of this run's 4
        ("relay", list(range(MAX_RELAY_RANKS + 1)), 0, "a host relay names its ranks"),
        ("relay", None, 0, "a host relay names its ranks"),
        ("worker", [0], 0, "only a host relay names ranks"),
    ],
    ids=["first-not-lowest", "twice", "out-of-run", "too-many", "none", "worker"],
)
def test_a_hello_that_names_ranks_badly_is_refused(driver, role, ranks, first, message):
    secret = driver.secret if role == "worker" else driver.launcher_secret
    context = tls.client_context(driver.cert) if driver.cert else None
    with pytest.raises(Refused, match=message):
        open_connection(driver.server.address, rank_key(secret, role, first), RUN, first, role, context, ranks=ranks)


def test_a_relay_fetches_nothing(driver):
    key = rank_key(driver.launcher_secret, "relay", 0)
    with pytest.raises(Refused, match="a host relay fetches and uploads nothing"):
        open_connection(
            driver.server.address,
            key,
            RUN,
            0,
            "relay",
            tls.client_context(driver.cert) if driver.cert else None,
            fetch="values",
            ranks=[0],
        )


def test_a_relay_key_is_its_own():
    driver = Driver()
    try:  # a worker's key, a launcher's key: neither opens a relay
        for secret, role in ((driver.secret, "worker"), (driver.launcher_secret, "launcher")):
            with pytest.raises(Refused, match="wrong secret for role relay of rank 0"):
                open_connection(driver.server.address, rank_key(secret, role, 0), RUN, 0, "relay", ranks=[0, 1])
    finally:
        driver.server.close()


def test_a_rank_connected_directly_stays_with_its_connection(driver):
    direct = driver.client(driver.address, 2, certificate=driver.cert)
    direct.send(events.Started(rank=2))
    driver.got.wait_for(1)
    relay = driver.relay([2, 3])
    late = driver.client(relay.address, 2)
    # the relay closes it: its client sees that at a write
    wait_until(lambda: late.send(events.Started(rank=2, pid=5)) or late.lost, 10, "rank 2's second connection closed")
    line = "torchdist: refused rank 2's worker through its host's relay: another connection already speaks for it"
    assert any(text.startswith(line) for text in driver.lines())
    assert driver.server.stats["claims_refused"] == 1
    for client in (late, direct):
        client.close()
    relay.close()
    assert [r for r in driver.got.records if isinstance(r, events.Started)] == [events.Started(rank=2)]


def test_a_frame_over_the_limit_at_the_relay_is_refused_and_said(driver):
    relay = driver.relay([0])
    sock = open_connection(
        ("127.0.0.1", int(relay.address.rpartition(":")[2])), rank_key(driver.secret, "worker", 0), RUN, 0, "worker"
    )
    try:
        sock.sendall(LENGTH.pack(MAX_FRAME + 1))
        wait_until(lambda: driver.lines(), 10, "the relay's note")
    finally:
        sock.close()
    relay.close()
    assert driver.lines() == [
        f"torchdist: the host relay refused a frame over the channel's {MAX_FRAME} bytes; the connection "
        "was closed from rank 0's worker"
    ]


def test_an_unreachable_driver_costs_one_line_and_ends_the_ranks_connections(capfd):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    relay = HostRelay(f"127.0.0.1:{port}", new_secret(), new_secret(), RUN, [0, 1])
    wait_until(lambda: relay.lost)
    relay.close()
    err = capfd.readouterr().err
    assert err == (
        f"torchdist_magic: cannot reach the driver's event channel at 127.0.0.1:{port} "
        "([Errno 111] Connection refused); the events of ranks 0, 1 are dropped\n"
    )
    assert relay_threads() == []


def test_a_relay_the_driver_refuses_says_why(capfd):
    driver = Driver()
    try:
        relay = HostRelay(driver.address, driver.secret, "not-the-launchers-secret", RUN, [0, 1])
        wait_until(lambda: relay.lost)
        relay.close()
    finally:
        driver.server.close()
    err = capfd.readouterr().err
    assert "refused the host relay of ranks 0, 1: authentication failed: wrong secret for role relay of rank 0" in err


def test_a_relay_checks_the_drivers_certificate(identity, capfd):
    driver = Driver(tls.new_identity())
    try:
        relay = HostRelay(
            driver.address, driver.secret, driver.launcher_secret, RUN, [0], certificate=identity.certificate
        )
        wait_until(lambda: relay.lost)
        relay.close()
    finally:
        driver.server.close()
    err = capfd.readouterr().err
    assert f"the server at {driver.address} is not this run's driver" in err and "events of ranks 0 are dropped" in err


def test_when_the_driver_goes_the_relays_ranks_see_their_channel_lost(capfd):
    driver = Driver()
    relay = driver.relay([0, 1])
    client = driver.client(relay.address, 0)
    client.send(events.Started(rank=0))
    driver.got.wait_for(1)
    driver.server.close()
    wait_until(lambda: relay.lost, 10, "the relay to see the driver gone")
    # the relay has closed the rank's connection: its client sees that at a write, and gives up
    wait_until(lambda: client.send(events.Started(rank=0)) or client.lost, 10, "the rank's channel lost")
    client.close()
    relay.close()
    assert "the host relay's connection to the driver ended" in capfd.readouterr().err
    assert relay_threads() == []


def test_a_relay_needs_a_rank():
    with pytest.raises(ValueError, match="a host relay speaks for at least one rank"):
        HostRelay("127.0.0.1:1", "s", "l", RUN, [])


def test_bundles_split_where_a_frame_would_be_too_large_and_keep_their_order():
    big = b"x" * (MAX_FRAME - 100)
    parts = [fanin.segment(fanin.WORKER, rank, big) for rank in range(3)] + [fanin.segment(fanin.LEFT, 7, b"\x00")]
    data, bodies = fanin.bundle(parts), []
    while data:
        (length,) = LENGTH.unpack_from(data)
        assert length <= fanin.MAX_BUNDLE
        bodies.append(data[LENGTH.size : LENGTH.size + length])
        data = data[LENGTH.size + length :]
    assert len(bodies) == 3
    assert [(k, r, p) for body in bodies for k, r, p in fanin.segments(body)] == [
        (fanin.WORKER, 0, big),
        (fanin.WORKER, 1, big),
        (fanin.WORKER, 2, big),
        (fanin.LEFT, 7, b"\x00"),
    ]
    with pytest.raises(fanin.MalformedBundle, match="past the end"):
        list(fanin.segments(fanin.SEGMENT.pack(fanin.NOTE, 0, 10) + b"short"))
    with pytest.raises(fanin.MalformedBundle, match="cut short"):
        list(fanin.segments(b"\x00\x00"))


def test_the_host_relay_setting_is_auto_on_or_off():
    assert not uses_relay(RELAY_FROM - 1, {}) and uses_relay(RELAY_FROM, {})
    assert uses_relay(2, {RELAY_ENV: "1"}) and not uses_relay(4096, {RELAY_ENV: "0"})
    with pytest.raises(ValueError, match="TORCHDIST_HOST_RELAY is auto .* 1 .* or 0 .*, not 'maybe'"):
        uses_relay(2, {RELAY_ENV: "maybe"})
