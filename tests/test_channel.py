"""Event channel: authentication, garbage frames, ordering, non-blocking send."""

import socket
import struct
import threading
import time

import pytest

from torchdist_magic.channel import (MAX_FRAME, ChannelClient, ChannelServer, FrameError, _coalesce,
                                     read_frame, write_frame)


class Collector:
    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def __call__(self, event):
        with self.lock:
            self.events.append(event)

    def wait_for(self, n, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.events) >= n:
                    return list(self.events)
            time.sleep(0.01)
        return list(self.events)


@pytest.fixture
def server():
    got = Collector()
    srv = ChannelServer(got, run_id="run-1")
    srv.got = got
    yield srv
    srv.close()


def _address(srv):
    return f"{srv.address[0]}:{srv.address[1]}"


def test_authenticated_client_delivers_in_order(server):
    client = ChannelClient(_address(server), server.secret, "run-1", rank=3)
    for i in range(5000):
        client.send({"type": "log", "line": f"l{i}", "rank": 99})
    client.close()
    events = server.got.wait_for(5000)
    assert [e["line"] for e in events] == [f"l{i}" for i in range(5000)]
    assert {e["rank"] for e in events} == {3}  # the rank is the authenticated one, not the event's


def _raw_connect(srv):
    sock = socket.create_connection(srv.address, timeout=5)
    nonce = read_frame(sock)["nonce"]
    return sock, nonce


def test_wrong_secret_is_rejected(server, capfd):
    client = ChannelClient(_address(server), "not-the-secret", "run-1", rank=0)
    client.send({"type": "log", "line": "intruder"})
    client.close()
    time.sleep(0.3)
    assert server.got.events == []
    assert server.rejected == 1
    assert "event channel to the driver lost" in capfd.readouterr().err


def test_wrong_run_id_is_rejected(server):
    client = ChannelClient(_address(server), server.secret, "another-run", rank=0)
    client.send({"type": "log", "line": "x"})
    client.close()
    time.sleep(0.3)
    assert server.got.events == [] and server.rejected == 1


@pytest.mark.parametrize("garbage", [
    b"\x00\x00\x00\x05hello",                      # not JSON
    b"\xff\xff\xff\xff",                            # absurd length
    b"\x00\x00\x00\x02[]",                          # JSON, not an object
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",          # a stray HTTP client
])
def test_garbage_before_auth_is_dropped_and_server_survives(server, garbage):
    sock, _ = _raw_connect(server)
    sock.sendall(garbage)
    sock.close()
    client = ChannelClient(_address(server), server.secret, "run-1", rank=1)
    client.send({"type": "status", "state": "running"})
    client.close()
    assert server.got.wait_for(1)[0]["state"] == "running"


def test_garbage_after_auth_closes_only_that_connection(server):
    from torchdist_magic.channel import _mac

    sock, nonce = _raw_connect(server)
    write_frame(sock, {"mac": _mac(server.secret, nonce), "run_id": "run-1", "rank": 0})
    assert read_frame(sock) == {"ok": True}
    write_frame(sock, {"events": [{"type": "log", "line": "ok"}, "not-an-event", {"no": "type"}]})
    write_frame(sock, {"not": "events"})
    sock.sendall(b"\x00\x00\x00\x03abc")
    assert [e["line"] for e in server.got.wait_for(1)] == ["ok"]
    good = ChannelClient(_address(server), server.secret, "run-1", rank=1)
    good.send({"type": "log", "line": "still serving"})
    good.close()
    assert server.got.wait_for(2)[-1]["line"] == "still serving"
    sock.close()


def test_frame_size_limit():
    a, b = socket.socketpair()
    with pytest.raises(FrameError, match="over the"):
        write_frame(a, {"x": "y" * (MAX_FRAME + 1)})
    a.sendall(struct.pack(">I", MAX_FRAME + 1))
    with pytest.raises(FrameError, match="over the"):
        read_frame(b)
    a.close(), b.close()


def test_send_never_blocks_when_driver_is_unreachable():
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    client = ChannelClient(f"127.0.0.1:{port}", "s", "r", rank=0, maxsize=10)
    for i in range(1000):  # far more than the queue holds: dropped, not blocked
        client.send({"type": "metrics", "values": {"i": i}})
    client.close(timeout=2)


def test_progress_updates_are_coalesced_per_bar():
    batch = [{"type": "progress", "bar": "a", "n": 1}, {"type": "log", "line": "x"},
             {"type": "progress", "bar": "b", "n": 1}, {"type": "progress", "bar": "a", "n": 2}]
    assert _coalesce(batch) == [batch[1], batch[2], batch[3]]
