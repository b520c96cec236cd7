"""One host relay per machine for a run's launchers (``launch.hostrelay``): the first launcher
starts it, the others join it, the owner leaves last and takes the files with it; a dead owner's
relay is replaced, and its files removed by the last launcher out.  Real locks, real sockets,
a real driver's channel."""

import glob
import os
import subprocess
import sys
import threading
import types

import pytest

from helpers import Collector
from torchdist_magic.core import events
from torchdist_magic.core.rankenv import RunSpec, rank_key
from torchdist_magic.launch import hostrelay, remote
from torchdist_magic.wire.client import ChannelClient
from torchdist_magic.wire.frames import new_secret
from torchdist_magic.wire.server import ChannelServer


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run's spec whose driver's channel listens; the machine's temporary directory is the
    test's own."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    got = Collector()
    secret, launcher_secret = new_secret(), new_secret()
    server = ChannelServer(got, "run-h", secret=secret, launcher_secret=launcher_secret, ranks=4)
    spec = types.SimpleNamespace(got=got, server=server, tmp=tmp_path)
    spec.spec = RunSpec(
        run_id="run-h",
        num_processes=4,
        use_gpu=False,
        all_ranks=False,
        env={},
        timeout=None,
        channel_address=f"127.0.0.1:{server.port}",
        secret=secret,
        launcher_secret=launcher_secret,
        host_relay=True,
    )
    for name in ("run_id", "secret"):
        setattr(spec, name, getattr(spec.spec, name))
    yield spec
    server.close()


def relay_files(run):
    return glob.glob(os.path.join(str(run.tmp), "torchdist-*", "relay-*"))


def send_started(run, membership, rank):
    client = ChannelClient(membership.address, rank_key(run.secret, "worker", rank), run.run_id, rank)
    client.send(events.Started(rank=rank))
    client.close()


def test_the_first_launcher_starts_the_relay_the_others_join_it_and_the_owner_leaves_last(run):
    first, second = hostrelay.join(run.spec, 0), hostrelay.join(run.spec, 1)
    assert first.owner and not second.owner and second.address == first.address
    for rank, membership in ((0, first), (1, second)):
        send_started(run, membership, rank)
    owner_left = threading.Thread(target=first.leave)
    owner_left.start()
    assert owner_left.is_alive() and relay_files(run)  # it waits for the machine's other launcher
    second.leave()
    owner_left.join(30)
    assert not owner_left.is_alive()
    assert sorted(r.rank for r in run.got.records) == [0, 1]
    assert run.server.stats["accepted"] == 1
    assert relay_files(run) == []  # the owner took the files with it
    assert [t for t in threading.enumerate() if t.name.startswith("torchdist-relay")] == []
    third = hostrelay.join(run.spec, 2)  # a launcher that comes later starts a relay of its own
    try:
        assert third.owner
    finally:
        third.leave()


def killed(membership):
    """``membership``'s launcher killed: its relay gone, its lock let go (as the kernel does), and
    its address naming a process that has exited."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    membership.relay.close()
    os.close(membership._users)
    membership._users = -1
    with open(membership.base + ".address", "w") as fh:
        fh.write(f"{done.stdout.strip()} {membership.address}\n")


def test_a_dead_owners_relay_is_replaced_and_its_files_go_with_the_last_launcher_out(run):
    first = hostrelay.join(run.spec, 0)
    killed(first)
    second = hostrelay.join(run.spec, 1)  # a launcher that comes later: the dead owner's relay is not used
    assert second.owner and second.address != first.address
    third = hostrelay.join(run.spec, 2)
    assert not third.owner and third.address == second.address
    killed(second)
    assert relay_files(run)
    third.leave()  # the last launcher out, its owner dead: it takes the files
    assert relay_files(run) == []


def test_a_machine_without_room_for_the_relays_files_connects_its_rank_to_the_driver(run, monkeypatch):
    # links where this user's directory and the run's own fallback would go: neither is used
    elsewhere = run.tmp / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, run.tmp / f"torchdist-{os.geteuid()}")
    os.symlink(elsewhere, run.tmp / f"torchdist-{os.geteuid()}-{hostrelay.relay_token(run.spec)}")
    membership, lines = remote._join_relay(run.spec, 3)
    assert membership is None and len(lines) == 1
    assert lines[0].startswith("[torchdist] host relay: not used on ")
    assert "torchdist_magic will not use it" in lines[0] and lines[0].endswith(
        "this rank connects to the driver itself"
    )


def test_where_another_user_made_the_usual_directory_the_relay_says_so_and_goes_beside_it(run):
    elsewhere = run.tmp / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, run.tmp / f"torchdist-{os.geteuid()}")
    membership, lines = remote._join_relay(run.spec, 0)
    try:
        assert membership.owner and os.path.basename(os.path.dirname(membership.base)).endswith(
            hostrelay.relay_token(run.spec)
        )
        assert any("symbolic link" in line for line in lines), lines  # said in the rank's log
        assert lines[-1].startswith("[torchdist] host relay: this machine's ranks reach the driver over one connection")
    finally:
        membership.leave()


def test_a_run_without_relays_joins_none(run):
    import dataclasses

    assert remote._join_relay(dataclasses.replace(run.spec, host_relay=False), 0) == (None, [])
