"""Nothing refused in silence: a record the channel refuses (one its sender may not send, one that
does not decode, one the run's state cannot take) is logged once per kind, counted in
``run.state.refusals`` and shown by the views.  And the worker's own ``SystemMetrics`` (torch's
peak GPU memory, which only the rank's process knows) is a record a worker may send."""

import json
import logging
import socket
import types

import pytest

from helpers import Collector, wait_until
from torchdist_magic.core import events
from torchdist_magic.core.rankenv import rank_key
from torchdist_magic.driver.state import RunState
from torchdist_magic.rank.worker import torch_memory
from torchdist_magic.view import html, text
from torchdist_magic.view.model import run_facts
from torchdist_magic.wire import framemac
from torchdist_magic.wire.client import ChannelClient
from torchdist_magic.wire.frames import LENGTH, MAX_HELLO, hello_proof, new_secret, pack_frame, read_frame
from torchdist_magic.wire.server import ChannelServer


class Refusals:
    def __init__(self):
        self.seen = []

    def __call__(self, kind, rank, detail):
        self.seen.append((kind, rank, detail))


@pytest.fixture
def channel():
    got, refused = Collector(), Refusals()
    srv = ChannelServer(got, run_id="run-r", secret=new_secret(), launcher_secret=new_secret(), on_refusal=refused)
    srv.got, srv.refused = got, refused
    yield srv
    srv.close()


def worker(srv, rank):
    host, port = srv.address
    return ChannelClient(f"{host}:{port}", rank_key(srv._secrets["worker"], "worker", rank), "run-r", rank)


def test_a_worker_may_send_its_own_system_metrics():
    assert events.SystemMetrics in events.SENDERS["worker"]


def test_the_workers_torch_memory_read_from_a_fake_cuda_reaches_the_run_state(channel):
    fake_cuda = types.SimpleNamespace(
        is_initialized=lambda: True, device_count=lambda: 2, max_memory_allocated=lambda i: (i + 1) * 1e9
    )
    values = torch_memory(fake_cuda)
    assert values == {"torch_max_allocated_bytes": 3e9}
    state = RunState("run-r", 2)
    channel._delivery.on_event = state.apply
    client = worker(channel, 1)
    try:
        client.send(events.SystemMetrics(rank=1, values=values, time=12.0))
        wait_until(lambda: "torch_max_allocated_bytes" in state.ranks[1].system, 10, "the worker's sample")
    finally:
        client.close()
    assert state.ranks[1].system["torch_max_allocated_bytes"] == 3e9
    assert channel.stats["forbidden"] == 0 and not channel.refused.seen


def test_torch_memory_before_cuda_is_initialised_is_nothing():
    fake_cuda = types.SimpleNamespace(is_initialized=lambda: False)
    assert torch_memory(fake_cuda) == {}


def test_a_forbidden_record_is_logged_once_and_counted(channel, caplog):
    client = worker(channel, 3)
    try:
        with caplog.at_level(logging.WARNING, logger="torchdist_magic"):
            client.send(events.Exit(rank=3, code=0, time=1.0))  # only a launcher says how a rank exited
            client.send(events.Exit(rank=3, code=0, time=2.0))
            client.send(events.Started(rank=3, pid=1, host="h", time=3.0))
            channel.got.wait_for(1)
            wait_until(lambda: len(channel.refused.seen) == 2, 10, "both refusals")
    finally:
        client.close()
    assert channel.refused.seen == [("forbidden", 3, "a Exit record, which a worker may not send")] * 2
    assert channel.stats["forbidden"] == 2
    said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert said == [
        "run run-r: the channel refused a Exit record, which a worker may not send from rank 3's "
        "worker (further refusals of this kind are counted in run.state.refusals)"
    ]


def test_a_record_the_state_cannot_take_is_a_refusal_not_a_silence(channel):
    def broken(record):
        raise KeyError("no such bar")

    channel._delivery.on_event = broken
    client = worker(channel, 0)
    try:
        client.send(events.Started(rank=0, pid=1, host="h", time=3.0))
        wait_until(lambda: channel.refused.seen, 10, "the refusal")
    finally:
        client.close()
    assert channel.refused.seen == [
        ("callback_errors", 0, "a Started record that the run's state could not take (KeyError: 'no such bar')")
    ]


def test_frames_and_records_that_do_not_decode_are_malformed(channel):
    """What a peer that passed the handshake writes after it, byte for byte."""
    sock = socket.create_connection(channel.address, timeout=10)
    try:
        secret = rank_key(channel._secrets["worker"], "worker", 2)
        nonce = read_frame(sock, MAX_HELLO)["nonce"]
        hello = {"nonce": "mine", "run_id": "run-r", "rank": 2, "role": "worker", "protocol": events.PROTOCOL_VERSION}
        sock.sendall(pack_frame({**hello, "mac": hello_proof(secret, nonce, hello)}))
        assert read_frame(sock, MAX_HELLO)["ok"] is True
        # without TLS what follows the handshake goes in authenticated records, as a peer's would
        sealed = framemac.MacSocket(sock, framemac.session_key(secret, nonce, "mine"))
        body = json.dumps({"events": [{"type": "nope"}]}).encode()
        for raw in (b'{"events": 5}', body):
            sealed.sendall(LENGTH.pack(len(raw)) + raw)
        wait_until(lambda: len(channel.refused.seen) == 2, 10, "both refusals")
    finally:
        sock.close()
    assert channel.refused.seen == [
        ("malformed", 2, "a frame that is not a JSON object with a list of records"),
        ("malformed", 2, "a record that does not decode ('nope')"),
    ]
    assert channel.stats["malformed"] == 2


def test_the_run_state_counts_refusals_and_the_views_say_them():
    state = RunState("run-v", 2)
    state.refused("forbidden", 1, "a Exit record, which a worker may not send")
    state.refused("forbidden", 0, "a Exit record, which a worker may not send")
    state.refused("malformed", 1, "a record that does not decode ('Nope')")
    snap = state.snapshot()
    assert [(r.kind, r.count, r.rank) for r in snap.refusals] == [("forbidden", 2, 1), ("malformed", 1, 1)]
    expected = (
        "the run's channel refused 3 records: a Exit record, which a worker may not send, from rank 1 "
        "and 1 more; a record that does not decode ('Nope'), from rank 1"
    )
    assert run_facts(snap).refused_text == expected
    assert f"  {expected}" in text.summary(state).splitlines()
    assert 'class="torchdist-refused"' in html.header_html(run_facts(snap))


def test_a_run_without_refusals_says_nothing_of_them():
    state = RunState("run-w", 1)
    assert run_facts(state.snapshot()).refused_text == ""
    assert "refused" not in text.summary(state)
    assert "torchdist-refused" not in html.header_html(run_facts(state.snapshot()))
