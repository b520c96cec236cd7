"""Notebook values out to ranks on other machines: each machine fetches the values' file once
from the driver's channel (``hostcopy``), and its ranks map that copy.

On one machine the Spark tests take that path with ``TORCHDIST_VALUES_FETCH=1``; with
``local-cluster`` both executors share this machine, so "once per machine" is one fetch for both
ranks.  The fetch's failures are each made for real: a closed port, a wrong secret, a connection
cut by a relay, a file size limit in the fetching process."""

import os
import re
import socket
import struct
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest
import torch

from helpers import Collector, assert_nothing_left, pipe_bytes, wait_until
from torchdist_magic import Distributor, RankFailure
from torchdist_magic.launch import hostcopy
from torchdist_magic.core import privdir, values
from torchdist_magic.wire.frames import new_secret
from torchdist_magic.wire.server import ChannelServer
from torchdist_magic.core.names import VALUES_COPY_ENV, VALUES_FETCH_ENV
from torchdist_magic.core.rankenv import RunSpec, rank_key
from torchdist_magic.wire.tls import new_identity

MIB = 2**20
FETCHED = r"\[torchdist\] notebook values: {size} fetched from the driver in [\d.]+ s \(\d+ MiB/s\)"


def spark_copies(run_id):
    mine = privdir.user_path(values.SHARED_MEMORY)  # where every copy of this user's is
    names = os.listdir(mine) if os.path.isdir(mine) else []
    return [n for n in names if n.startswith(f"torchdist-{run_id}-")]


# -- the fetch, against a real channel ------------------------------------------------------


def copy_of(spec):
    return values.host_copy_path(spec.values_fetch, spec.values_fetch_size)


def fetch(spec, rank=0):
    return hostcopy.fetch(spec, copy_of(spec), rank, lambda: False)


def mapped(name, array, copy=None):
    """What a rank maps of the copy its launcher names (``VALUES_COPY_ENV``: ``copy``, else the
    machine's copy of ``name``) for values of one buffer the size of ``array``."""
    buffers = values.Buffers([], host_copy=name)
    buffers.sizes = [array.nbytes]
    saved = os.environ.get(VALUES_COPY_ENV)
    os.environ[VALUES_COPY_ENV] = copy or values.host_copy_path(name, 0)
    try:
        return buffers.load()
    finally:
        if saved is None:
            del os.environ[VALUES_COPY_ENV]
        else:
            os.environ[VALUES_COPY_ENV] = saved


def test_the_copy_goes_to_shared_memory_where_it_takes_at_most_half_of_it():
    """A container's shared memory is often 64 MiB: a larger copy goes to the temporary
    directory, on every task of the machine alike; so does the driver's file of the values."""
    import tempfile

    from torchdist_magic.core.values import value_directory

    mine = f"torchdist-{os.geteuid()}"  # this user's private directory (privdir)
    assert values.host_copy_path("v", 1 << 50) == os.path.join(tempfile.gettempdir(), mine, "v")
    assert os.access(values.SHARED_MEMORY, os.W_OK), f"{values.SHARED_MEMORY} is not writable here"
    assert values.host_copy_path("v", 1 << 20) == os.path.join(values.SHARED_MEMORY, mine, "v")
    folder = value_directory("torchdist-test-values-", 1 << 50)
    os.rmdir(folder)
    assert os.path.dirname(folder) == tempfile.gettempdir()


@pytest.fixture
def served(tmp_path):
    """``make(mib, tls=False, files=None)`` -> (channel, RunSpec of a rank fetching a blob of
    ``mib`` MiB of known bytes, the array); every copy is removed afterwards."""
    made = []

    def make(mib, tls=False, files=None):
        array = np.arange(mib * MIB // 8, dtype=np.int64)
        _, buffers = values.pickled_apart({"a": array})
        folder = tmp_path / f"sent-{len(made)}"
        folder.mkdir()
        path = buffers.in_file(str(folder)).path
        name = f"torchdist-test{uuid.uuid4().hex[:8]}-values-{os.getpid()}-copy"
        identity = new_identity() if tls else None
        secret, launcher_secret = new_secret(), new_secret()
        channel = ChannelServer(
            Collector(),
            "run-1",
            secret=secret,
            launcher_secret=launcher_secret,
            identity=identity,
            files={name: path} if files is None else files,
        )
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
            values_fetch=name,
            values_fetch_size=os.path.getsize(path),
        )
        made.append((channel, name))
        return channel, spec, array

    yield make
    for channel, name in made:
        channel.close()
        for suffix in ("", ".tmp", ".lock", ".users"):
            try:
                os.unlink(values.host_copy_path(name, 0) + suffix)
            except FileNotFoundError:
                pass


def test_a_planted_copy_is_not_mapped_but_fetched_again(served):
    # before, a file at the copy's predictable name in /dev/shm was "mapped" without asking the
    # driver; now the copy is in this user's private directory, and a file there that is not a
    # whole copy (by its size and its blob header) is replaced by a fetch
    channel, spec, array = served(1)
    copy = copy_of(spec)
    privdir.private_directory(os.path.dirname(copy))
    with open(copy, "wb") as fh:
        fh.write(b"\0" * spec.values_fetch_size)  # the right size, not the values
    assert re.fullmatch(FETCHED.format(size="1.0 MiB"), fetch(spec))
    assert channel.stats["files_sent"] == 1
    back = mapped(spec.values_fetch, array)
    assert (np.frombuffer(back[0], dtype=np.int64) == array).all()


def test_a_symlink_planted_at_the_lock_is_not_followed(served, tmp_path):
    _, spec, _ = served(1)
    copy = copy_of(spec)
    privdir.private_directory(os.path.dirname(copy))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, copy + ".lock")
    try:
        with pytest.raises(
            privdir.UnsafePath,
            match=(
                rf"^{re.escape(copy)}\.lock is a symbolic link where torchdist_magic keeps a file of its own; "
                r"it will not follow it\. Remove it$"
            ),
        ):
            fetch(spec)
    finally:
        os.unlink(copy + ".lock")
    assert victim.read_text() == "precious"  # before, the task truncated what the link named


def test_a_copy_directory_open_to_other_users_is_refused(served, tmp_path):
    _, spec, _ = served(1)
    planted = tmp_path / "planted"
    planted.mkdir()
    planted.chmod(0o777)  # what another user who made it first would leave
    with pytest.raises(
        privdir.UnsafePath,
        match=(
            rf"^{re.escape(str(planted))} is not this user's private directory \(mode 0777, open to other "
            r"users\): another user of this machine may have made it; torchdist_magic will not use it\. "
            r"Remove it, or point TMPDIR elsewhere$"
        ),
    ):
        hostcopy.join(str(planted / "copy"))
    with pytest.raises(privdir.UnsafePath):
        hostcopy.fetch(spec, str(planted / "copy"), 0, lambda: False)
    assert os.listdir(planted) == []


@pytest.mark.parametrize("tls", [False, True], ids=["sendfile", "tls"])
def test_a_machine_fetches_the_values_once_and_its_other_ranks_map_them(served, tls):
    channel, spec, array = served(8, tls=tls)
    size = f"{spec.values_fetch_size / MIB:.1f} MiB"
    assert re.fullmatch(FETCHED.format(size=size), fetch(spec, 1))
    assert fetch(spec, 0) == f"[torchdist] notebook values: {size} mapped (fetched by rank 1 on this host)"
    assert channel.stats["files_sent"] == 1
    back = mapped(spec.values_fetch, array)
    assert (np.frombuffer(back[0], dtype=np.int64) == array).all()
    assert not os.path.exists(copy_of(spec) + ".tmp")


def test_a_stranger_gets_nothing_of_the_values(served):
    channel, spec, _ = served(1)
    stranger = RunSpec(**{**spec.__dict__, "launcher_secret": new_secret()})
    with pytest.raises(
        hostcopy.ValuesNotFetched,
        match=(
            r"^rank 0 could not fetch the notebook values \(1\.0 MiB\) from the driver at 127\.0\.0\.1:\d+ "
            rf"onto {socket.gethostname()}: the driver refused: authentication failed: wrong secret "
            r"for role launcher of rank 0$"
        ),
    ):
        fetch(stranger, 0)
    assert channel.stats["files_sent"] == 0 and channel.stats["rejected"] == 1
    assert not os.path.exists(copy_of(spec))


def test_a_file_the_channel_does_not_serve_is_refused(served):
    _, spec, _ = served(1)
    other = RunSpec(**{**spec.__dict__, "values_fetch": spec.values_fetch + "-other"})
    with pytest.raises(
        hostcopy.ValuesNotFetched,
        match=(r": the driver refused: this channel serves no file named 'torchdist-.+-other'$"),
    ):
        fetch(other, 0)
    os.unlink(copy_of(other) + ".lock")


def test_an_unreachable_driver_fails_the_fetch_naming_host_size_and_cause(served):
    channel, spec, _ = served(1)
    channel.close()
    with pytest.raises(
        hostcopy.ValuesNotFetched,
        match=(
            rf"^rank 0 could not fetch the notebook values \(1\.0 MiB\) from the driver at {spec.channel_address} "
            rf"onto {socket.gethostname()}: cannot reach the driver's event channel \(\[Errno 111\] "
            r"Connection refused\)$"
        ),
    ):
        fetch(spec, 0)


def test_a_driver_that_cannot_read_its_file_says_so(served, tmp_path):
    _, spec, _ = served(1, files={})
    missing = str(tmp_path / "gone")
    channel = ChannelServer(
        Collector(),
        "run-1",
        secret=spec.secret,
        launcher_secret=spec.launcher_secret,
        files={spec.values_fetch: missing},
    )
    try:
        moved = RunSpec(**{**spec.__dict__, "channel_address": f"127.0.0.1:{channel.port}"})
        with pytest.raises(
            hostcopy.ValuesNotFetched,
            match=(r": the driver cannot read it: \[Errno 2\] No such file or directory: '.+/gone'$"),
        ):
            fetch(moved, 0)
    finally:
        channel.close()


def relay(target, limit, reset=False):
    """A port that relays one connection to ``target``, and cuts it once ``limit`` bytes came
    back from there (``reset``: with a TCP reset)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        client, _ = listener.accept()
        upstream = socket.create_connection(target)
        back = threading.Thread(target=pipe_bytes, args=(client, upstream, None), daemon=True)
        back.start()
        pipe_bytes(upstream, client, limit)
        client.shutdown(socket.SHUT_RD if reset else socket.SHUT_RDWR)  # ends the other direction
        back.join()
        if reset:  # closed with nothing in flight and no lingering: a reset
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        for s in (client, upstream, listener):
            s.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def through(spec, port):
    return RunSpec(**{**spec.__dict__, "channel_address": f"127.0.0.1:{port}"})


def driver_port(spec):
    return int(spec.channel_address.rpartition(":")[2])


def test_a_connection_cut_midway_fails_the_fetch_and_leaves_no_partial_copy(served):
    _, spec, _ = served(16)
    port = relay(("127.0.0.1", driver_port(spec)), 3 * MIB)
    # without TLS the bytes come in authenticated records of 1 MiB: of the 3 MiB on the wire, the
    # third record is cut short, so only the first two are taken
    with pytest.raises(
        hostcopy.ValuesNotFetched,
        match=(
            rf"^rank 0 could not fetch the notebook values \(16\.0 MiB\) from the driver at 127\.0\.0\.1:{port} "
            rf"onto {socket.gethostname()}: the connection was cut after 2\.0 MiB of 16\.0 MiB$"
        ),
    ):
        fetch(through(spec, port), 0)
    copy = copy_of(spec)
    assert not os.path.exists(copy) and not os.path.exists(copy + ".tmp")


def test_a_connection_reset_midway_fails_the_fetch(served):
    _, spec, _ = served(16)
    port = relay(("127.0.0.1", driver_port(spec)), 3 * MIB, reset=True)
    with pytest.raises(
        hostcopy.ValuesNotFetched,
        match=(r": the connection failed after [\d.]+ MiB of 16\.0 MiB \(\[Errno 104\] Connection reset by peer\)$"),
    ):
        fetch(through(spec, port), 0)
    assert not os.path.exists(copy_of(spec) + ".tmp")


def test_a_connection_cut_before_the_values_fails_the_fetch(served):
    from torchdist_magic.wire.frames import pack_frame

    _, spec, _ = served(1)
    handshake = len(pack_frame({"nonce": "0" * 32})) + len(pack_frame({"ok": True, "mac": "0" * 64}))
    port = relay(("127.0.0.1", driver_port(spec)), handshake)
    with pytest.raises(
        hostcopy.ValuesNotFetched, match=(r": the connection ended before the values began \(connection closed\)$")
    ):
        fetch(through(spec, port), 0)


def test_a_server_without_the_runs_certificate_gets_no_fetch(served):
    _, spec, _ = served(1, tls=True)
    other = RunSpec(**{**spec.__dict__, "channel_cert": new_identity().certificate})
    with pytest.raises(
        hostcopy.ValuesNotFetched,
        match=(
            r": the server there is not this run's driver: its TLS certificate is not the one this run "
            r"pinned \(.+\)$"
        ),
    ):
        fetch(other, 0)


def test_a_size_other_than_the_jobs_fails_the_fetch(served):
    _, spec, _ = served(1)
    wrong = RunSpec(**{**spec.__dict__, "values_fetch_size": spec.values_fetch_size + 1})
    with pytest.raises(
        hostcopy.ValuesNotFetched,
        match=(
            rf": the driver offered {spec.values_fetch_size} bytes where the job names {spec.values_fetch_size + 1}$"
        ),
    ):
        fetch(wrong, 0)


def test_what_is_not_the_values_is_not_kept(served, tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(b"x" * 4096)
    channel, spec, _ = served(1)
    other = ChannelServer(
        Collector(),
        "run-1",
        secret=spec.secret,
        launcher_secret=spec.launcher_secret,
        files={spec.values_fetch: str(junk)},
    )
    try:
        moved = RunSpec(**{**through(spec, other.port).__dict__, "values_fetch_size": 4096})
        with pytest.raises(
            hostcopy.ValuesNotFetched,
            match=(
                r": what arrived is not the values the job names \(4096 bytes written, -1 by its header, "
                r"4096 expected\)$"
            ),
        ):
            fetch(moved, 0)
    finally:
        other.close()
    copy = copy_of(spec)
    assert not os.path.exists(copy) and not os.path.exists(copy + ".tmp")


def test_a_copy_that_cannot_be_written_fails_the_fetch(served):
    _, spec, _ = served(1)
    tmp = copy_of(spec) + ".tmp"
    os.mkdir(tmp)
    try:
        with pytest.raises(
            hostcopy.ValuesNotFetched, match=(rf": cannot write {tmp} \(\[Errno 21\] Is a directory: '{tmp}'\)$")
        ):
            fetch(spec, 0)
    finally:
        os.rmdir(tmp)


def test_a_rank_whose_machine_has_no_copy_says_so(monkeypatch):
    missing = values.Buffers([], host_copy="torchdist-nothing-values-copy")
    copy = values.host_copy_path("torchdist-nothing-values-copy", 0)
    privdir.private_directory(os.path.dirname(copy))
    monkeypatch.setenv(VALUES_COPY_ENV, copy)
    with pytest.raises(
        FileNotFoundError,
        match=(
            r"^the notebook values sent to the ranks were to be fetched from the driver into "
            rf"{copy} on this rank's machine "
            rf"\({socket.gethostname()}\) before it started, and are not there$"
        ),
    ):
        missing.load()
    monkeypatch.delenv(VALUES_COPY_ENV)  # a rank whose launcher did not say where the copy is
    with pytest.raises(
        FileNotFoundError,
        match=(
            r"^the notebook values sent to the ranks were to be fetched from the driver onto this rank's "
            rf"machine \({socket.gethostname()}\) before it started, and its launcher did not say where "
            r"they are \(TORCHDIST_VALUES_COPY is not set\)$"
        ),
    ):
        missing.load()


FETCH_WITH_FILE_LIMIT = """
import json, resource, sys
from torchdist_magic.core import values
from torchdist_magic.launch import hostcopy
from torchdist_magic.core.rankenv import RunSpec
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
try:
    spec = RunSpec(**json.loads(sys.argv[1]))
    hostcopy.fetch(spec, values.host_copy_path(spec.values_fetch, spec.values_fetch_size), 0, lambda: False)
except hostcopy.ValuesNotFetched as exc:
    print(exc)
"""


def test_no_room_for_the_copy_fails_the_fetch(served):
    """A file size limit in the fetching process stands for a full disk."""
    import json

    channel, spec, _ = served(4)
    out = subprocess.run(
        [sys.executable, "-c", FETCH_WITH_FILE_LIMIT, json.dumps(spec.__dict__)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert re.fullmatch(
        rf"rank 0 could not fetch the notebook values \(4\.0 MiB\) from the driver at {spec.channel_address} "
        rf"onto {socket.gethostname()}: no room for it in {privdir.user_path(values.SHARED_MEMORY)} after [\d.]+ MiB "
        r"\(\[Errno 27\] File too large\)",
        out.stdout.strip(),
    ), out.stdout + out.stderr
    assert not os.path.exists(copy_of(spec) + ".tmp")


# -- through Spark ---------------------------------------------------------------------------


def sum_and_last(tensor):
    import torch

    from torchdist_magic import rank

    return rank(), float(tensor.sum(dtype=torch.float64)), tensor[-1].item()


def one_fetch(run, size):
    """The ranks' lines about the values: one fetched them, the other mapped that copy."""
    lines = {r: [line for line in run.logs(r).splitlines() if "notebook values" in line] for r in (0, 1)}
    fetcher = [r for r, found in lines.items() if found and "fetched from the driver" in found[0]]
    assert len(fetcher) == 1, lines
    other = 1 - fetcher[0]
    assert re.fullmatch(FETCHED.format(size=size), lines[fetcher[0]][0])
    assert lines[other] == [f"[torchdist] notebook values: {size} mapped (fetched by rank {fetcher[0]} on this host)"]


@pytest.mark.spark
@pytest.mark.big_values
def test_a_512_mib_notebook_tensor_reaches_two_executors_fetched_once(spark_cluster, monkeypatch):
    """Two executors (JVMs of their own) on this machine: one fetch, both ranks map it."""
    from torchdist_magic.capture import capture_cell
    from torchdist_magic.core.job import cell_job

    monkeypatch.setenv(VALUES_FETCH_ENV, "1")
    big = torch.arange(512 * MIB // 4, dtype=torch.float32)
    cell = capture_cell(
        "rank, float(big.sum(dtype=torch.float64)), big[-1].item()",
        {"big": big, "torch": torch},
        ["import torch"],
        warn_bytes=2**40,
    )
    run = Distributor(2, local_mode=False, show=None, all_ranks=True).submit(cell_job(cell, "cell"))
    assert len(run._job_bytes) < MIB and run.channel_encrypted
    expected = float(big.sum(dtype=torch.float64))
    assert run.result(timeout=600) == [(0, expected, big[-1].item()), (1, expected, big[-1].item())]
    one_fetch(run, "512.0 MiB")
    assert_nothing_left(run)
    assert not spark_copies(run.run_id)


def kill_my_task_after_the_values(tensor):
    import os
    import signal
    import time

    from torchdist_magic import rank

    if rank() == 1:
        os.kill(os.getppid(), signal.SIGKILL)  # the Python process of this rank's Spark task
    time.sleep(600)


@pytest.mark.spark
def test_a_killed_task_leaves_no_copy_of_the_values(spark_cluster, monkeypatch):
    monkeypatch.setenv(VALUES_FETCH_ENV, "1")
    run = Distributor(2, local_mode=False, show=None).submit(kill_my_task_after_the_values, torch.ones(4 * MIB))
    with pytest.raises(RankFailure):
        run.result(timeout=120)
    assert_nothing_left(run)  # the guards stopped the workers and the last one removed the copy
    wait_until(lambda: not spark_copies(run.run_id), 10, "the machine's copy of the values to go")


@pytest.mark.spark
def test_notebook_values_reach_spark_connect_tasks_fetched_once(spark_connect, monkeypatch):
    monkeypatch.setenv(VALUES_FETCH_ENV, "1")
    tensor = torch.arange(64 * MIB // 4, dtype=torch.float32)
    run = Distributor(2, local_mode=False, show=None, all_ranks=True).submit(sum_and_last, tensor)
    assert len(run._job_bytes) < MIB
    expected = float(tensor.sum(dtype=torch.float64))
    assert run.result(timeout=600) == [(0, expected, tensor[-1].item()), (1, expected, tensor[-1].item())]
    one_fetch(run, "64.0 MiB")
    assert_nothing_left(run)
    assert not spark_copies(run.run_id)


@pytest.mark.spark
def test_a_failed_fetch_fails_the_rank_naming_its_host_size_and_cause(spark_cluster, monkeypatch):
    """The driver's file gone before any task fetched it (the tasks take a second or more to
    start): the rank's failure says so, and nothing is left on either side."""
    monkeypatch.setenv(VALUES_FETCH_ENV, "1")
    run = Distributor(2, local_mode=False, show=None).submit(sum_and_last, torch.ones(MIB))
    (path,) = run._sent.served.values()
    os.unlink(path)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    assert info.value.exc_type == "ValuesNotFetched"
    assert re.fullmatch(
        rf"rank {info.value.rank} could not fetch the notebook values \(4\.0 MiB\) from the driver at "
        rf"{re.escape(run.channel_address)} onto {re.escape(socket.gethostname())}: the driver cannot read it: "
        r"\[Errno 2\] No such file or directory: '.+/sent\.values'",
        info.value.message,
    ), info.value.message
    assert_nothing_left(run)
    assert not spark_copies(run.run_id)


def test_many_machines_fetch_at_once_while_the_channel_delivers_records(served, tmp_path):
    """More fetches than the driver sends at once (``FETCHES_AT_ONCE``), one a machine (a rank's
    launcher each: one rank may have only ``TRANSFERS_PER_RANK`` open), all arrive; the channel's
    own records keep being delivered meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    from torchdist_magic.core import events
    from torchdist_magic.wire.client import ChannelClient
    from torchdist_magic.wire.transfers import FETCHES_AT_ONCE

    _, spec, array = served(4)
    names = [f"{spec.values_fetch}-{i}" for i in range(FETCHES_AT_ONCE + 4)]
    path = next((tmp_path / "sent-0").iterdir())  # the file the fixture serves
    records = Collector()
    channel = ChannelServer(
        records,
        "run-1",
        secret=spec.secret,
        launcher_secret=spec.launcher_secret,
        files={name: str(path) for name in names},
    )
    client = ChannelClient(
        f"127.0.0.1:{channel.port}", rank_key(spec.launcher_secret, "launcher", 0), "run-1", 0, role="launcher"
    )
    try:
        specs = [RunSpec(**{**through(spec, channel.port).__dict__, "values_fetch": name}) for name in names]
        with ThreadPoolExecutor(len(specs)) as pool:
            fetched = pool.map(fetch, specs, range(len(specs)))
            client.send(events.Log(rank=0, stream="stderr", line="still heard"))
            assert all("fetched from the driver" in line for line in fetched)
        assert [r.line for r in records.wait_for(1)] == ["still heard"]
        assert channel.stats["files_sent"] == len(names)
        for name in names:
            assert (np.frombuffer(mapped(name, array)[0], dtype=np.int64) == array).all()
    finally:
        client.close()
        channel.close()
        for name in names:
            for suffix in ("", ".lock"):
                os.unlink(values.host_copy_path(name, 0) + suffix)


def fails_on_the_first_attempt(tensor):
    import torch

    from torchdist_magic import rank, restart_count

    if restart_count() == 0 and rank() == 1:
        raise ValueError("first attempt")
    return rank(), float(tensor.sum(dtype=torch.float64))


@pytest.mark.spark
def test_a_restarted_run_has_its_values_in_every_attempt(spark_cluster, monkeypatch, tmp_path):
    monkeypatch.setenv(VALUES_FETCH_ENV, "1")
    tensor = torch.ones(4 * MIB)
    run = Distributor(
        2, local_mode=False, show=None, all_ranks=True, max_restarts=1, checkpoint_dir=str(tmp_path)
    ).submit(fails_on_the_first_attempt, tensor)
    assert run.result(timeout=300) == [(0, float(tensor.numel())), (1, float(tensor.numel()))]
    assert run.attempt == 2
    for attempt in (1, 2):  # each attempt's ranks have the values: fetched from its own channel, or
        # mapped (a copy that the first attempt's last task had not removed yet is the same values)
        lines = [line for r in (0, 1) for line in run.logs(r, attempt).splitlines() if "notebook values" in line]
        assert len(lines) == 2 and all("fetched from the driver" in line or "mapped" in line for line in lines), lines
    assert_nothing_left(run)
    assert not spark_copies(run.run_id)
