"""A rank's value back to the driver from a machine other than the driver's: the rank's task
sends the file its rank wrote over the run's channel (``valueupload``), and the driver writes it
into its value directory, which the stage's outcome names.

On one machine the Spark tests take that path with ``TORCHDIST_VALUES_FETCH=1``.  The sending's
failures are each made for real: a closed port, a secret of the wrong role, a connection cut by
a relay, a file size limit in the driver's process, a value larger than the driver's free space."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from helpers import Collector, assert_nothing_left, pipe_bytes
from torchdist_magic import Distributor, RankFailure
from torchdist_magic.core import values
from torchdist_magic.launch import valueupload
from torchdist_magic.wire.frames import new_secret, Refused
from torchdist_magic.wire.handshake import open_connection
from torchdist_magic.wire.server import ChannelServer
from torchdist_magic.core.rankenv import RunSpec, rank_key
from torchdist_magic.wire.tls import new_identity
from torchdist_magic.core.names import VALUES_FETCH_ENV

MIB = 2**20
SENT = r"\[torchdist\] value of rank {rank}: {size} sent to the driver in [\d.]+ s \(\d+ MiB/s\)"


def sent_line(run, rank):
    return [line for line in run.logs(rank).splitlines() if "sent to the driver" in line]


# -- the sending, against a real channel ----------------------------------------------------


@pytest.fixture
def uploads(tmp_path):
    """``make(mib, tls=False)`` -> (channel, RunSpec of rank 0, path of its value blob of ``mib``
    MiB of known bytes, the array, the driver's directory for it); channels closed afterwards."""
    made = []

    def make(mib, tls=False):
        array = np.arange(mib * MIB // 8, dtype=np.int64)
        rank_dir = tmp_path / f"rank-{len(made)}"
        driver_dir = tmp_path / f"driver-{len(made)}"
        rank_dir.mkdir()
        driver_dir.mkdir()
        path = str(rank_dir / "result.pkl")
        values.dump({"a": array}, path)
        identity = new_identity() if tls else None
        secret, launcher_secret = new_secret(), new_secret()
        channel = ChannelServer(Collector(), "run-1", secret=secret, launcher_secret=launcher_secret, identity=identity)
        channel.receive_values({0: str(driver_dir / "rank-0.value")})
        spec = RunSpec(
            "run-1",
            2,
            False,
            False,
            {},
            None,
            channel_address="127.0.0.1:%d" % channel.port,
            secret=secret,
            launcher_secret=launcher_secret,
            channel_cert=identity.certificate if tls else "",
        )
        made.append(channel)
        return channel, spec, path, array, str(driver_dir)

    yield make
    for channel in made:
        channel.close()


def until_empty(folder):
    """What is left in ``folder`` once the driver's thread of a failed upload has ended."""
    deadline = time.monotonic() + 30
    while os.listdir(folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.listdir(folder)


@pytest.mark.parametrize("tls", [False, True], ids=["sendfile", "tls"])
def test_a_value_reaches_the_drivers_value_directory(uploads, tls):
    channel, spec, path, array, driver_dir = uploads(8, tls=tls)
    size = f"{os.path.getsize(path) / MIB:.1f} MiB"
    assert re.fullmatch(SENT.format(rank=0, size=size), valueupload.send(spec, path, 0))
    assert channel.stats["values_received"] == 1
    assert os.listdir(driver_dir) == ["rank-0.value"]
    back = values.loads(open(os.path.join(driver_dir, "rank-0.value"), "rb").read())
    assert (back["a"] == array).all()
    with pytest.raises(
        valueupload.ValueNotSent,
        match=(  # once: nothing overwrites it
            r": the driver refused: this channel waits for no value from rank 0$"
        ),
    ):
        valueupload.send(spec, path, 0)


def test_a_rank_whose_value_the_driver_does_not_take_is_refused(uploads):
    channel, spec, path, _, driver_dir = uploads(1)
    with pytest.raises(
        valueupload.ValueNotSent,
        match=(
            rf"^rank 1 could not send its value \(1\.0 MiB\) from {socket.gethostname()} to the driver at "
            r"127\.0\.0\.1:\d+: the driver refused: this channel waits for no value from rank 1$"
        ),
    ):
        valueupload.send(spec, path, 1)
    assert channel.stats["values_received"] == 0 and not os.listdir(driver_dir)


def test_only_a_launcher_uploads(uploads):
    """A rank's worker has its own key of the run's other secret: it cannot write the driver's files."""
    _, spec, _, _, driver_dir = uploads(1)
    with pytest.raises(Refused, match="^only a rank's launcher uploads, and only its own rank's value$"):
        open_connection(
            ("127.0.0.1", driver_port(spec)), rank_key(spec.secret, "worker", 0), "run-1", 0, "worker", upload=10
        )
    assert not os.listdir(driver_dir)


def test_an_upload_without_its_size_is_refused(uploads):
    _, spec, _, _, driver_dir = uploads(1)
    with pytest.raises(Refused, match="^an upload needs the value's size$"):
        open_connection(
            ("127.0.0.1", driver_port(spec)),
            rank_key(spec.launcher_secret, "launcher", 0),
            "run-1",
            0,
            "launcher",
            upload=-1,
        )
    assert not os.listdir(driver_dir)


def test_a_stranger_uploads_nothing(uploads):
    channel, spec, path, _, driver_dir = uploads(1)
    stranger = RunSpec(**{**spec.__dict__, "launcher_secret": new_secret()})
    with pytest.raises(
        valueupload.ValueNotSent,
        match=(r": the driver refused: authentication failed: wrong secret for role launcher of rank 0$"),
    ):
        valueupload.send(stranger, path, 0)
    assert channel.stats["rejected"] == 1 and not os.listdir(driver_dir)


def test_an_unreachable_driver_fails_the_sending_naming_host_size_and_cause(uploads):
    channel, spec, path, _, _ = uploads(1)
    channel.close()
    with pytest.raises(
        valueupload.ValueNotSent,
        match=(
            rf"^rank 0 could not send its value \(1\.0 MiB\) from {socket.gethostname()} to the driver at "
            rf"{spec.channel_address}: cannot reach the driver's event channel \(\[Errno 111\] "
            r"Connection refused\)$"
        ),
    ):
        valueupload.send(spec, path, 0)


def relay_up(target, limit):
    """A port that relays one connection to ``target``, and cuts it once ``limit`` bytes went
    there."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        client, _ = listener.accept()
        upstream = socket.create_connection(target)
        back = threading.Thread(target=pipe_bytes, args=(upstream, client, None), daemon=True)
        back.start()
        pipe_bytes(client, upstream, limit)
        for s in (client, upstream):
            s.shutdown(socket.SHUT_RDWR)
        back.join()
        for s in (client, upstream, listener):
            s.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def driver_port(spec):
    return int(spec.channel_address.rpartition(":")[2])


@pytest.mark.parametrize("tls", [False, True], ids=["sendfile", "tls"])
def test_a_connection_cut_midway_fails_the_sending_and_leaves_nothing_on_the_driver(uploads, tls):
    channel, spec, path, _, driver_dir = uploads(64, tls=tls)
    port = relay_up(("127.0.0.1", driver_port(spec)), 3 * MIB)
    cut = RunSpec(**{**spec.__dict__, "channel_address": f"127.0.0.1:{port}"})
    with pytest.raises(
        valueupload.ValueNotSent,
        match=(
            rf"^rank 0 could not send its value \(64\.0 MiB\) from {socket.gethostname()} to the driver at "
            r"127\.0\.0\.1:\d+: the connection (failed after [\d.]+ MiB of 64\.0 MiB \(.+\)"
            r"|ended before the driver confirmed the value \(.+\))$"
        ),
    ):
        valueupload.send(cut, path, 0)
    assert until_empty(driver_dir) == [] and channel.stats["values_received"] == 0


DRIVER_WITH_FILE_LIMIT = """
import json, resource, sys
from torchdist_magic.wire.frames import new_secret
from torchdist_magic.wire.server import ChannelServer
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
secret, launcher_secret = new_secret(), new_secret()
channel = ChannelServer(lambda record: None, "run-1", secret=secret, launcher_secret=launcher_secret)
channel.receive_values({0: sys.argv[1]})
print(json.dumps({"port": channel.port, "secret": secret, "launcher_secret": launcher_secret}), flush=True)
sys.stdin.read()
channel.close()
"""


def test_no_room_on_the_driver_fails_the_sending_and_leaves_nothing_there(uploads):
    """A file size limit in the driver's process stands for its full disk."""
    _, spec, path, _, driver_dir = uploads(4)
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER_WITH_FILE_LIMIT, os.path.join(driver_dir, "rank-0.value")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        given = json.loads(driver.stdout.readline())
        there = RunSpec(
            **{
                **spec.__dict__,
                "channel_address": f"127.0.0.1:{given['port']}",
                "secret": given["secret"],
                "launcher_secret": given["launcher_secret"],
            }
        )
        with pytest.raises(valueupload.ValueNotSent) as info:
            valueupload.send(there, path, 0)
        assert re.fullmatch(
            rf"rank 0 could not send its value \(4\.0 MiB\) from {socket.gethostname()} to the driver at "
            rf"{there.channel_address}: no room for it in {driver_dir} on the driver after [\d.]+ MiB "
            r"\(\[Errno 27\] File too large\)",
            str(info.value),
        ), str(info.value)
        assert until_empty(driver_dir) == []
    finally:
        driver.stdin.close()
        assert driver.wait(timeout=60) == 0


def test_a_value_larger_than_the_drivers_free_space_is_refused_before_it_is_sent(uploads, tmp_path):
    """The size the hello announces is checked against the driver's free space first (a sparse
    file stands for the rank's large value)."""
    channel, spec, _, _, driver_dir = uploads(1)
    room = os.statvfs(driver_dir)
    huge = str(tmp_path / "huge.pkl")
    with open(huge, "wb") as fh:
        fh.truncate(room.f_bavail * room.f_frsize + 2**30)
    with pytest.raises(
        valueupload.ValueNotSent,
        match=(
            rf"\) from {socket.gethostname()} to the driver at 127\.0\.0\.1:\d+: no room for it on the driver: "
            rf"{re.escape(driver_dir)} has [\d.]+ MiB free$"
        ),
    ):
        valueupload.send(spec, huge, 0)
    assert not os.listdir(driver_dir) and channel.stats["values_received"] == 0


# -- through Spark ---------------------------------------------------------------------------


def rank_and_tensor(mib):
    import torch

    from torchdist_magic import rank

    return rank(), torch.full((mib * MIB // 4,), float(rank() + 1))


@pytest.mark.spark
def test_a_512_mib_value_comes_back_from_an_executor_over_the_channel(spark_cluster, monkeypatch):
    monkeypatch.setenv(VALUES_FETCH_ENV, "1")
    run = Distributor(2, local_mode=False, show=None).submit(rank_and_tensor, 512)
    got_rank, tensor = run.result(timeout=600)
    assert run.channel_encrypted and got_rank == 0
    assert tensor.shape == (512 * MIB // 4,) and bool((tensor == 1.0).all())
    (line,) = sent_line(run, 0)
    assert re.fullmatch(SENT.format(rank=0, size=r"512\.0 MiB"), line)
    assert sent_line(run, 1) == []
    # while it went, rank 0's log said why its exit waited
    lines = run.logs(0).splitlines()
    assert lines.index("[torchdist] value of rank 0: sending 512.0 MiB to the driver") == lines.index(line) - 1
    assert "sending" not in run.logs(1)
    del tensor
    assert_nothing_left(run)
    assert not [n for n in os.listdir(values.SHARED_MEMORY) if n.startswith(f"torchdist-{run.run_id}-")]


@pytest.mark.spark
def test_every_ranks_value_comes_back_over_an_unencrypted_channel(spark_local2, monkeypatch):
    monkeypatch.setenv(VALUES_FETCH_ENV, "1")
    run = Distributor(2, local_mode=False, show=None, all_ranks=True, tls=False).submit(rank_and_tensor, 8)
    back = run.result(timeout=300)
    assert not run.channel_encrypted
    assert [r for r, _ in back] == [0, 1]
    assert [float(t[0]) for _, t in back] == [1.0, 2.0] and all(t.numel() == 2 * MIB for _, t in back)
    for rank in (0, 1):
        (line,) = sent_line(run, rank)
        assert re.fullmatch(SENT.format(rank=rank, size=r"8\.0 MiB"), line)
    assert_nothing_left(run)


@pytest.mark.spark
def test_behind_a_host_relay_each_value_still_comes_back_on_a_connection_of_its_own(spark_cluster, monkeypatch):
    """The records go through the machine's relay; each launcher sends its rank's value to the
    driver itself, as a relay carries no file."""
    monkeypatch.setenv(VALUES_FETCH_ENV, "1")
    monkeypatch.setenv("TORCHDIST_HOST_RELAY", "1")
    run = Distributor(2, local_mode=False, show=None, all_ranks=True).submit(rank_and_tensor, 8)
    back = run.result(timeout=300)
    assert [float(t[0]) for _, t in back] == [1.0, 2.0]
    for rank in (0, 1):
        (line,) = sent_line(run, rank)
        assert re.fullmatch(SENT.format(rank=rank, size=r"8\.0 MiB"), line)
    stats = run._channel.stats
    assert (stats["accepted"], stats["values_received"]) == (3, 2)  # the relay's, and one per value
    assert_nothing_left(run)


def remove_the_drivers_value_directory():
    import glob

    for folder in glob.glob(f"{values.SHARED_MEMORY}/torchdist-{os.environ['TORCHDIST_RUN_ID']}-values-*"):
        shutil.rmtree(folder)
    return torch.ones(MIB)


@pytest.mark.spark
def test_a_value_the_driver_cannot_write_fails_its_rank_naming_host_size_and_cause(spark_local2, monkeypatch):
    monkeypatch.setenv(VALUES_FETCH_ENV, "1")
    run = Distributor(2, local_mode=False, show=None).submit(remove_the_drivers_value_directory)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=300)
    assert info.value.rank == 0 and info.value.exc_type == "ValueNotSent"
    assert re.fullmatch(
        rf"rank 0 could not send its value \([\d.]+ MiB\) from {re.escape(socket.gethostname())} to the driver "
        rf"at {re.escape(run.channel_address)}: the driver cannot write .+/rank-0\.value\.tmp: \[Errno 2\] "
        r"No such file or directory: '.+'",
        info.value.message,
    ), info.value.message
    assert_nothing_left(run)


@pytest.mark.spark
def test_values_come_back_from_spark_connect_tasks_over_the_channel(spark_connect, monkeypatch):
    monkeypatch.setenv(VALUES_FETCH_ENV, "1")
    run = Distributor(2, local_mode=False, show=None, all_ranks=True).submit(rank_and_tensor, 64)
    back = run.result(timeout=300)
    assert run.channel_encrypted and [r for r, _ in back] == [0, 1]
    assert [float(t[-1]) for _, t in back] == [1.0, 2.0] and all(t.numel() == 16 * MIB for _, t in back)
    assert all(len(sent_line(run, rank)) == 1 for rank in (0, 1))
    assert_nothing_left(run)


def seven_for_rank_0(size):
    import torch

    from torchdist_magic import rank

    return torch.full((size // 4,), 7.0) if rank() == 0 else None


@pytest.mark.spark
@pytest.mark.big_values
def test_a_value_over_4_gib_comes_back_over_the_channel(spark_local2, monkeypatch):
    size = 4 * 2**30 + 64 * MIB  # past 4 GiB by a partial chunk
    monkeypatch.setenv(VALUES_FETCH_ENV, "1")
    run = Distributor(2, local_mode=False, show=None, tls=False).submit(seven_for_rank_0, size)
    value = run.result(timeout=600)
    assert value.shape == (size // 4,) and bool((value == 7.0).all())
    (line,) = sent_line(run, 0)
    assert re.fullmatch(SENT.format(rank=0, size=r"4160\.0 MiB"), line)
    del value
    assert_nothing_left(run)
    assert not [n for n in os.listdir(values.SHARED_MEMORY) if n.startswith(f"torchdist-{run.run_id}-")]
