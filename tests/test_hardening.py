"""Hardening (issue 30): the driver within its file limit, each rank only itself, nothing trusted
by name.  Each test takes the shape of a finding of the review: silent connections under a low
limit, an impostor rank's hello, a second claim on a rank, a planted file or directory."""

import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from helpers import Collector, wait_until
from torchdist_magic.core import events, fdlimit
from torchdist_magic.core.rankenv import rank_key
from torchdist_magic.wire.client import ChannelClient
from torchdist_magic.wire.frames import Refused, new_secret, pack_frame
from torchdist_magic.wire.handshake import open_connection
from torchdist_magic.wire.server import ACCEPT_PAUSE, ChannelServer
# -- file limits ----------------------------------------------------------------------------------

#: a driver process under a low limit on open files, whose own files already take most of it (as
#: a notebook's would): it serves a channel, says where, and reports its channel's counts and
#: the channel thread's CPU time once told to (a line on stdin)
LOW_LIMIT_DRIVER = textwrap.dedent("""
    import json, os, resource, sys, time
    from torchdist_magic.core import fdlimit
    from torchdist_magic.wire.server import ChannelServer
    limit, free = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    got = []
    server = ChannelServer(got.append, "run-1", secret="s" * 64, launcher_secret="l" * 64)
    ballast = []
    while fdlimit.open_now() < limit - free:  # what the rest of the kernel holds
        ballast.append(open(os.devnull))
    print(json.dumps({"port": server.port}), flush=True)
    for line in sys.stdin:
        if line.startswith("free"):  # the kernel closes some of its files
            for fh in ballast[:int(line.split()[1])]:
                fh.close()
            del ballast[:int(line.split()[1])]
            print("{}", flush=True)
            continue
        tid = server._thread.native_id
        with open(f"/proc/self/task/{tid}/stat") as fh:
            ticks = sum(map(int, fh.read().rsplit(")", 1)[1].split()[11:13]))
        print(json.dumps({"stats": server.stats, "cpu": ticks / os.sysconf("SC_CLK_TCK"),
                          "ranks": sorted({record.rank for record in got})}), flush=True)
        break
    server.close()
""")


class LowLimitDriver:
    def __init__(self, limit, free):
        self.process = subprocess.Popen(
            [sys.executable, "-c", LOW_LIMIT_DRIVER, str(limit), str(free)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.port = json.loads(self.process.stdout.readline())["port"]
        self.started = time.monotonic()

    def free(self, count):
        self.process.stdin.write(f"free {count}\n")
        self.process.stdin.flush()
        self.process.stdout.readline()

    def report(self):
        self.process.stdin.write("report\n")
        self.process.stdin.flush()
        report = json.loads(self.process.stdout.readline())
        report["elapsed"] = time.monotonic() - self.started
        assert self.process.wait(timeout=60) == 0
        return report

    def client(self, rank, role="worker"):
        secret = ("s" if role == "worker" else "l") * 64
        return ChannelClient(f"127.0.0.1:{self.port}", rank_key(secret, role, rank), "run-1", rank, role=role)


def test_silent_connections_under_a_low_file_limit_leave_the_ranks_room_and_the_channel_idle():
    # the kernel holds all but 12 of its 128 descriptors; 80 connections that say nothing arrive
    # first: each accept() that finds no descriptor gives up the oldest of them for the newcomer
    # (before, it swallowed EMFILE and went round again at once: 50-100 % of a core)
    driver = LowLimitDriver(limit=128, free=12)
    silent = [socket.create_connection(("127.0.0.1", driver.port), timeout=30) for _ in range(80)]
    try:
        clients = [driver.client(rank) for rank in range(2)]
        for rank, client in enumerate(clients):
            client.send(events.Started(rank=rank, pid=os.getpid()))
        for client in clients:
            client.close()
        report = driver.report()
    finally:
        for sock in silent:
            sock.close()
    assert report["ranks"] == [0, 1]  # both ranks got in and were heard
    stats = report["stats"]
    assert stats["out_of_files"] >= 1 and stats["evicted"] >= 1
    # every failed accept() gave up a descriptor or paused accepting: no more than the
    # connections that came, and one per pause
    assert stats["accept_failed"] <= stats["accepted"] + report["elapsed"] / ACCEPT_PAUSE + 1
    print(f"channel thread: {report['cpu']:.2f} s of CPU in {report['elapsed']:.1f} s")


def test_with_no_descriptor_to_give_up_the_channel_pauses_accepting_and_resumes():
    driver = LowLimitDriver(limit=96, free=0)
    waiting = socket.create_connection(("127.0.0.1", driver.port), timeout=30)  # stays in the backlog
    try:
        time.sleep(1.0)  # what a spinning thread would fill with failed accept() calls
        driver.free(24)
        client = driver.client(0)
        client.send(events.Started(rank=0, pid=os.getpid()))
        client.close()
        report = driver.report()
    finally:
        waiting.close()
    assert report["ranks"] == [0]
    assert 1 <= report["stats"]["accept_failed"] <= report["elapsed"] / ACCEPT_PAUSE + 2
    print(f"channel thread: {report['cpu']:.2f} s of CPU in {report['elapsed']:.1f} s")


FDLIMIT_CHILD = textwrap.dedent("""
    import json, resource, sys
    from torchdist_magic.core import fdlimit
    soft, hard, ranks = map(int, sys.argv[1:4])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        fdlimit.make_room(ranks, local=True)
    except ValueError as exc:
        print(json.dumps({"error": str(exc)}))
    else:
        print(json.dumps({"soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                          "need": fdlimit.descriptors_needed(ranks, True)}))
""")


def _fdlimit_child(soft, hard, ranks):
    out = subprocess.run(
        [sys.executable, "-c", FDLIMIT_CHILD, str(soft), str(hard), str(ranks)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return json.loads(out)


def test_the_soft_file_limit_is_raised_toward_the_hard_one_for_a_large_run():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 8192:
        pytest.skip(f"the hard limit on open files ({hard}) is below what 1024 local ranks need")
    got = _fdlimit_child(1024, 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192), 1024)
    assert got["soft"] >= 1024 * fdlimit.PER_LOCAL_RANK + fdlimit.HEADROOM
    assert got["soft"] >= got["need"] - 8  # counted again after: about the same files are open
    small = _fdlimit_child(1024, 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192), 4)
    assert small["soft"] == 1024  # never raised for a run that fits


def test_a_run_the_hard_file_limit_cannot_hold_is_refused_before_anything_starts():
    got = _fdlimit_child(512, 512, 1024)
    assert got["error"].startswith("a run of 1024 ranks needs about ")
    assert "its hard limit is 512: raise it before starting Jupyter (`ulimit -n 8192`" in got["error"]


def test_distributor_refuses_a_run_beyond_the_hard_file_limit():
    script = textwrap.dedent("""
        import resource
        from torchdist_magic import Distributor
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
        try:
            Distributor(200, local_mode=True, show=None).run(lambda: 1)
        except ValueError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("a run of 200 ranks needs about "), out
    assert "open files in this process (4 per rank, " in out and "its hard limit is 300" in out


# -- each rank only itself ------------------------------------------------------------------------


@pytest.fixture
def run_channel():
    """A run's channel whose records go to a real ``RunState`` of 4 ranks (what the view reads)."""
    from torchdist_magic.driver.state import RunState

    state = RunState("run-1", 4)
    srv = ChannelServer(state.apply, "run-1", secret=new_secret(), launcher_secret=new_secret())
    srv.state = state
    yield srv
    srv.close()


def _key(srv, role, rank):
    return rank_key(srv._secrets[role], role, rank)


def _connect(srv, role, rank, key_rank=None):
    """A raw authenticated connection as ``role`` of ``rank``, with the key of ``key_rank``."""
    return open_connection(srv.address, _key(srv, role, rank if key_rank is None else key_rank), "run-1", rank, role)


def test_a_worker_cannot_say_hello_as_another_rank(run_channel):
    # rank 3's worker holds rank 3's key only; before, every worker held the run's one secret
    with pytest.raises(Refused, match="^authentication failed: wrong secret for role worker of rank 0$"):
        _connect(run_channel, "worker", 0, key_rank=3)
    assert run_channel.stats["authenticated"] == 0


def test_a_launcher_cannot_upload_another_ranks_value(run_channel, tmp_path):
    (tmp_path / "values").mkdir()
    run_channel.receive_values({0: str(tmp_path / "values" / "rank-0.value")})
    with pytest.raises(Refused, match="^authentication failed: wrong secret for role launcher of rank 0$"):
        open_connection(run_channel.address, _key(run_channel, "launcher", 1), "run-1", 0, "launcher", upload=10)
    assert not os.listdir(tmp_path / "values")


def test_a_worker_sends_records_only_as_its_own_rank(run_channel):
    client = ChannelClient(f"127.0.0.1:{run_channel.port}", _key(run_channel, "worker", 2), "run-1", 2)
    client.send(events.Started(rank=0, pid=1234))  # it claims rank 0 in the record
    client.close()
    wait_until(lambda: run_channel.stats["delivered"] == 1)
    assert run_channel.state.ranks[2].pid == 1234 and run_channel.state.ranks[0].pid != 1234


def test_a_second_claim_on_a_rank_is_refused_and_shown_in_that_ranks_log(run_channel, capfd):
    first = ChannelClient(
        f"127.0.0.1:{run_channel.port}", _key(run_channel, "worker", 0), "run-1", 0, on_message=Collector()
    )
    first.send(events.Started(rank=0, pid=1))
    wait_until(lambda: run_channel.stats["delivered"] == 1)
    # the same rank and role again (its key leaked, or a launcher that knows the run's secret):
    # before, the newest connection took over the rank's debugger input and warm jobs
    second = ChannelClient(f"127.0.0.1:{run_channel.port}", _key(run_channel, "worker", 0), "run-1", 0)
    second.send(events.Started(rank=0, pid=2))
    second.close()
    err = capfd.readouterr().err
    assert err.count("torchdist_magic:") == 1 and "rank 0's worker is already connected to this run" in err, err
    wait_until(lambda: "refused a second connection as rank 0's worker (from 127.0.0.1:" in run_channel.state.logs(0))
    assert "another one already speaks for it; only the first is heard" in run_channel.state.logs(0)
    assert run_channel.state.ranks[0].pid == 1 and run_channel.stats["claims_refused"] == 1
    # the driver's records still reach the first
    assert run_channel.send(0, events.DebugInput(rank=0, session="s", line="p x"), role="worker")
    wait_until(lambda: first._on_message.records)
    first.close()


def test_a_claim_whose_connection_ended_before_a_single_frame_is_free_again(run_channel):
    # a rank whose client gave up on a slow reply tries again: that must not lock it out
    _connect(run_channel, "worker", 1).close()
    wait_until(lambda: ("worker", 1) not in run_channel._routes)
    _connect(run_channel, "worker", 1).close()
    assert run_channel.stats["claims_refused"] == 0 and run_channel.stats["authenticated"] == 2


# -- nothing trusted by name ----------------------------------------------------------------------


def _spec(tmp_path, launcher_secret="l" * 64):
    from torchdist_magic.backends.spark_task import BarrierTaskSpec
    from torchdist_magic.core.rankenv import RunSpec

    run = RunSpec("run-7", 2, False, False, {}, None, secret="s" * 64, launcher_secret=launcher_secret)
    return BarrierTaskSpec(run=run, job_bytes=b"", value_dir=str(tmp_path / "values"))


def test_a_task_writes_its_value_only_into_the_drivers_own_marked_directory(tmp_path):
    from torchdist_magic.launch.remote import value_dir_mark, value_dir_token

    spec = _spec(tmp_path)
    folder = tmp_path / "values"
    folder.mkdir(mode=0o700)
    mark = folder / value_dir_mark("run-7")
    # the review's shape: a directory of the right name with the mark's name in it, made by
    # someone who does not know the run's secret, received the trained model
    mark.write_text("")
    assert spec.value_file(0) == ""
    mark.write_bytes(value_dir_token(_spec(tmp_path, launcher_secret="x" * 64).run))  # another run's
    assert spec.value_file(0) == ""
    mark.write_bytes(value_dir_token(spec.run))
    assert spec.value_file(0) == str(folder / "rank-0.value")
    folder.chmod(0o777)  # the right mark in a directory others may write: not trusted either
    assert spec.value_file(0) == ""
    folder.chmod(0o700)
    mark.unlink()
    os.symlink(tmp_path / "elsewhere", mark)
    assert spec.value_file(0) == ""


def test_a_directory_of_another_user_is_not_private(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    from torchdist_magic.core import privdir

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)
    with pytest.raises(privdir.UnsafePath, match=r"\(owned by uid 4242, not 0\)"):
        privdir.private_directory(str(theirs))


def test_map_value_reads_and_removes_only_files_of_the_runs_value_directory(tmp_path):
    from torchdist_magic.core import privdir
    from torchdist_magic.core.values import map_value

    folder, elsewhere = tmp_path / "values", tmp_path / "precious"
    folder.mkdir()
    elsewhere.write_bytes(b"the user's file")
    for named in (str(elsewhere), str(folder / ".." / "precious")):  # what a task's outcome may name
        with pytest.raises(
            privdir.UnsafePath,
            match=(
                rf"^a rank's value was to be read from {re.escape(named)}, outside the run's value directory "
                rf"{re.escape(str(folder))}; it is neither read nor removed$"
            ),
        ):
            map_value(named, str(folder))
    os.symlink(elsewhere, folder / "rank-0.value")
    with pytest.raises(privdir.UnsafePath, match="is a symbolic link"):
        map_value(str(folder / "rank-0.value"), str(folder))
    assert elsewhere.read_bytes() == b"the user's file"
    (folder / "rank-1.value").write_bytes(b"value")
    assert bytes(map_value(str(folder / "rank-1.value"), str(folder))) == b"value"
    assert not (folder / "rank-1.value").exists()


def test_a_stop_after_the_rank_ended_does_not_signal_whoever_has_its_group_id_now(tmp_path):
    from torchdist_magic.launch.launcher import RankProcess, stop_all

    rank = RankProcess(
        0, "no-job", str(tmp_path / "rank-0"), dict(os.environ), Collector(), python="/bin/true", system_metrics=False
    )
    assert rank.exited.wait(30)
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a process group of its own
    try:
        rank.pgid = stranger.pid  # the rank's group id, taken again by an unrelated process
        stop_all([rank], 0.1)  # before, its SIGKILL went to the group id whatever held it
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


# -- secrets out of reprs, the TLS key never on disk ----------------------------------------------


def test_a_run_specs_repr_shows_neither_secret(tmp_path):
    from torchdist_magic.backends.spark_task import BarrierTaskSpec
    from torchdist_magic.core.options import LaunchOptions
    from torchdist_magic.core.rankenv import RunSpec

    spec = RunSpec.resolve(LaunchOptions(num_processes=2), "run-1", "127.0.0.1:9", "s3cret-worker", "s3cret-launcher")
    for text in (repr(spec), repr(BarrierTaskSpec(run=spec, job_bytes=b""))):
        assert "s3cret" not in text and "run-1" in text


def test_the_channels_tls_key_is_never_written_in_the_clear(monkeypatch, tmp_path):
    from torchdist_magic.wire import tls

    identity = tls.new_identity()

    def no_temporary_file(*args, **kwargs):
        raise AssertionError("the TLS key went to a temporary file")

    if hasattr(os, "memfd_create"):  # in memory only
        monkeypatch.setattr(tls.tempfile, "mkstemp", no_temporary_file)
        assert tls.ChannelIdentity(identity.certificate, identity.private_key).server_context()
        monkeypatch.undo()
    # where the system has no memfd: the file holds the key encrypted, with a password kept in memory
    monkeypatch.delattr(os, "memfd_create", raising=False)
    made = []
    real = tempfile.mkstemp

    def seen(*args, **kwargs):
        fd, path = real(*args, dir=str(tmp_path), **{k: v for k, v in kwargs.items() if k != "dir"})
        os.link(path, path + ".seen")
        made.append(path + ".seen")
        return fd, path

    monkeypatch.setattr(tls.tempfile, "mkstemp", seen)
    srv = ChannelServer(Collector(), "run-1", secret="s", launcher_secret="l", identity=identity)
    client = ChannelClient(
        f"127.0.0.1:{srv.port}", rank_key("s", "worker", 0), "run-1", 0, certificate=identity.certificate
    )
    client.send(events.Started(rank=0, pid=1))
    client.close()
    wait_until(lambda: srv.stats["delivered"] == 1)
    srv.close()
    written = open(made[0], "rb").read()
    assert b"ENCRYPTED PRIVATE KEY" in written and identity.private_key not in written


# -- without TLS, every record authenticated ------------------------------------------------------


class InjectingRelay:
    """What sits on the path between a rank and the driver of a channel without TLS: it passes
    every byte along, and writes bytes of its own into either direction (``inject``), between
    the sender's writes."""

    def __init__(self, target):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.target = target
        self.lock = threading.Lock()
        self.ends = {}
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        near, _ = self.listener.accept()
        far = socket.create_connection(self.target)
        self.ends = {"up": far, "down": near}
        self.ready.set()
        pumps = [
            threading.Thread(target=self._pump, args=(near, far)),
            threading.Thread(target=self._pump, args=(far, near)),
        ]
        for pump in pumps:
            pump.start()
        for pump in pumps:
            pump.join()
        near.close()
        far.close()

    def _pump(self, source, sink):
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                with self.lock:
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def inject(self, direction, data):
        self.ready.wait(10)
        with self.lock:
            self.ends[direction].sendall(data)

    def close(self):
        self.thread.join(30)
        self.listener.close()


def forged_record(frame):
    """A record as the channel's look, carrying ``frame``, with a tag made up by who wrote it."""
    return len(frame).to_bytes(4, "big") + frame + b"\0" * 32


def test_a_record_injected_on_a_plain_connection_is_not_delivered(run_channel):
    relay = InjectingRelay(run_channel.address)
    client = ChannelClient(relay.address, _key(run_channel, "launcher", 0), "run-1", 0, role="launcher")
    client.send(events.Started(rank=0, pid=7))
    wait_until(lambda: run_channel.stats["delivered"] == 1)
    # before, only the start of a connection was authenticated: this Exit (or a warm rank's
    # JobValue, which the driver unpickles) was taken as the rank's
    relay.inject("up", forged_record(pack_frame({"events": [events.encode(events.Exit(rank=0, code=0))]})))
    wait_until(lambda: run_channel.stats["forged"] == 1)
    client.close()
    relay.close()
    assert run_channel.state.ranks[0].exit_code is None and run_channel.stats["delivered"] == 1
    assert (
        "torchdist: the event channel of rank 0's launcher carried a record that failed its authentication "
        "(record 1 failed its authentication); someone on the network may have written into it. The "
        "connection was closed, and nothing of that record was used"
    ) in run_channel.state.logs(0)


def test_a_record_injected_toward_a_rank_is_not_run(run_channel, capfd):
    relay = InjectingRelay(run_channel.address)
    got = Collector()
    client = ChannelClient(relay.address, _key(run_channel, "worker", 0), "run-1", 0, on_message=got)
    assert client.reaches_driver(30)
    assert run_channel.send(0, events.DebugInput(rank=0, session="s", line="p 1"), role="worker")
    got.wait_for(1)
    # a debugger line (or a warm pool's next job) that the driver did not send
    relay.inject(
        "down",
        forged_record(
            pack_frame(
                {"events": [events.encode(events.DebugInput(rank=0, session="s", line="import os; os.system('id')"))]}
            )
        ),
    )
    wait_until(lambda: client.lost, what="the rank to stop listening")
    client.close()
    relay.close()
    assert [r.line for r in got.records] == ["p 1"]
    err = capfd.readouterr().err
    assert (
        err.count("torchdist_magic:") == 1
        and (
            "torchdist_magic: a record to rank 0 on the event channel failed its authentication (record 1 failed "
            "its authentication): someone on the network may have written into it; nothing of it was used, and "
            "the rank's events are dropped from now on"
        )
        in err
    ), err


# -- per-run caps ----------------------------------------------------------------------------------


def test_a_hello_for_a_rank_the_run_does_not_have_is_refused():
    srv = ChannelServer(Collector(), "run-1", secret="s", launcher_secret="l", ranks=4)
    try:
        with pytest.raises(Refused, match="^rank 4 is not a rank of this run, which has 4$"):
            open_connection(srv.address, rank_key("l", "launcher", 4), "run-1", 4, "launcher")
        open_connection(srv.address, rank_key("l", "launcher", 3), "run-1", 3, "launcher").close()
    finally:
        srv.close()


def test_distinct_metric_names_and_open_bars_are_capped_per_run_with_a_line_each():
    from torchdist_magic.driver import state as run_state

    state = run_state.RunState("run-1", 2)
    for i in range(run_state.MAX_METRIC_NAMES + 10):  # a name per step, on both ranks
        state.apply(events.Metrics.point(rank=i % 2, step=i, values={f"loss_{i}": 1.0, "loss": 2.0}))
    for i in range(run_state.MAX_BARS + 5):
        state.apply(events.Progress(rank=0, bar=f"bar{i}", n=1, total=10))
    names = set(state.ranks[0].metrics) | set(state.ranks[1].metrics)
    assert len(names) == run_state.MAX_METRIC_NAMES and "loss" in names
    assert len(state.ranks[0].progress) == run_state.MAX_BARS
    for rank in (0, 1):
        assert state.logs(rank).count("distinct metric names already") == 1
    assert (
        f"torchdist: this run has {run_state.MAX_METRIC_NAMES} distinct metric names already; rank 1's "
        f"'loss_{run_state.MAX_METRIC_NAMES - 1}' and any newer names are not kept (report() a name per "
        "quantity, with the step as step=)"
    ) in state.logs(1)
    assert (
        f"torchdist: rank 0 has {run_state.MAX_BARS} progress bars open already; 'bar{run_state.MAX_BARS}' "
        "and any newer ones are not shown (close bars when they are done, or make them with "
        "leave=False)"
    ) in state.logs(0)
    state.apply(events.Progress(rank=0, bar="bar0", n=2, total=10))  # an open bar still moves
    assert state.ranks[0].progress["bar0"]["n"] == 2


def test_the_output_a_run_keeps_is_capped_per_rank_with_a_line_and_a_count(monkeypatch):
    from torchdist_magic.driver import state as run_state

    monkeypatch.setattr(run_state, "MAX_RUN_LOG_CHARS", 2 * 1000)
    monkeypatch.setattr(run_state, "MIN_RANK_LOG_CHARS", 100)
    state = run_state.RunState("run-1", 2)
    assert state.max_rank_log_chars == 1000  # each rank's share of the run's
    lines = [f"{i:02d}" + "x" * 48 for i in range(30)]  # 30 lines of 50 characters on rank 0
    state.apply(events.Log(rank=0, line=lines[0], more=lines[1:12]))  # within its share: kept at once
    state.apply(events.Log(rank=0, line=lines[12], more=lines[13:]))  # past it part of the way
    for i in range(100):  # a bar redrawn in place is not counted
        state.apply(events.Log(rank=1, line=f"bar {i}%" + " " * 40, cr=True))
    state.apply(events.Log(rank=1, line="done"))
    kept = [line for line in state.logs(0).splitlines() if line.endswith("x" * 48)]
    assert [line[:2] for line in kept] == [f"{i:02d}" for i in range(20)]
    assert state.ranks[0].log_dropped == 10 and state.ranks[1].log_dropped == 0
    assert state.logs(0).count("printed over its share") == 1
    assert (
        "torchdist: rank 0 printed over its share of what a run keeps of its output (0 MiB of 0 GiB, "
        "MAX_RUN_LOG_CHARS); its later lines are not kept (counted in run.state.ranks[0].log_dropped)"
    ) in state.logs(0)
    assert state.logs(1).rstrip().endswith("done")


def test_a_thousand_ranks_each_keep_a_share_of_the_runs_output():
    from torchdist_magic.driver import state as run_state

    assert run_state.RunState("run-1", 1024).max_rank_log_chars == max(
        run_state.MIN_RANK_LOG_CHARS, run_state.MAX_RUN_LOG_CHARS // 1024
    )


# -- file transfers (issue 41) --------------------------------------------------------------------

#: the file the transfer tests serve: sparse, larger than what a socket's buffers hold, so that a
#: fetch whose client does not read holds its transfer thread
SERVED_BYTES = 64 * 2**20


@pytest.fixture
def serving(tmp_path):
    """A run's channel of 4 ranks serving a file (``"values"``) and taking ranks 0 and 1's values; what
    it refuses counted in a real ``RunState`` (what the view shows)."""
    from torchdist_magic.driver.state import RunState

    path = tmp_path / "values.blob"
    with open(path, "wb") as fh:
        fh.truncate(SERVED_BYTES)
    (tmp_path / "up").mkdir()
    state = RunState("run-1", 4)
    srv = ChannelServer(
        state.apply,
        "run-1",
        secret=new_secret(),
        launcher_secret=new_secret(),
        files={"values": str(path)},
        ranks=4,
        on_refusal=state.refused,
    )
    srv.receive_values({rank: str(tmp_path / "up" / f"rank-{rank}.value") for rank in (0, 1)})
    srv.state = state
    yield srv
    srv.close()


def _fetch(srv, rank, role="launcher"):
    return open_connection(srv.address, _key(srv, role, rank), "run-1", rank, role, fetch="values")


def _read_file(sock):
    """The size a fetch's head announced, and how many bytes of the file came."""
    from torchdist_magic.wire.frames import MAX_HELLO, read_frame

    sock.settimeout(60)
    size = read_frame(sock, MAX_HELLO)["size"]
    buffer = bytearray(1 << 20)
    got = 0
    while got < size:
        n = sock.recv_into(buffer)
        if not n:
            break
        got += n
    return size, got


def test_a_workers_key_neither_fetches_nor_uploads(serving, tmp_path):
    # before, a worker's key fetched any file the channel served, as often as it liked
    with pytest.raises(Refused, match="^only a rank's launcher fetches files$"):
        _fetch(serving, 1, role="worker")
    with pytest.raises(Refused, match="^only a rank's launcher uploads, and only its own rank's value$"):
        open_connection(serving.address, _key(serving, "worker", 1), "run-1", 1, "worker", upload=10)
    assert serving.stats["authenticated"] == 0 and serving.stats["files_sent"] == 0
    assert serving.stats["rejected"] == 2 and not os.listdir(tmp_path / "up")


def test_a_launchers_transfers_are_capped_and_the_excess_refused_and_said_once(serving, caplog):
    from torchdist_magic.wire.transfers import TRANSFERS_PER_RANK

    # a launcher's key (leaked, or a task gone wrong) opens fetches it never reads; before, each
    # was taken and queued without bound, and 8 of them held every transfer thread
    holding = [_fetch(serving, 0) for _ in range(TRANSFERS_PER_RANK)]
    try:
        for _ in range(2):
            with pytest.raises(
                Refused,
                match=f"^rank 0's launcher has {TRANSFERS_PER_RANK} file transfers open already, "
                "the most one rank may have$",
            ):
                _fetch(serving, 0)
        with pytest.raises(Refused, match="file transfers open already"):  # an upload counts the same
            open_connection(serving.address, _key(serving, "launcher", 0), "run-1", 0, "launcher", upload=10)
        fetch = _fetch(serving, 1)  # another rank's fetch is served meanwhile, whole
        try:
            assert _read_file(fetch) == (SERVED_BYTES, SERVED_BYTES)
        finally:
            fetch.close()
    finally:
        for sock in holding:
            sock.close()
    wait_until(lambda: serving.stats["files_sent"] == 1)
    assert serving.stats["transfers_refused"] == 3
    [logged] = [r.getMessage() for r in caplog.records if "file transfer beyond" in r.getMessage()]
    assert logged == (
        f"run run-1: the channel refused a file transfer beyond the {TRANSFERS_PER_RANK} that one rank may have "
        "open at once from rank 0's launcher (further refusals of this kind are counted in run.state.refusals)"
    )
    [refusal] = serving.state.refusals.values()
    assert (refusal.kind, refusal.count, refusal.rank) == ("transfers_refused", 3, 0)
    assert refusal.detail == f"a file transfer beyond the {TRANSFERS_PER_RANK} that one rank may have open at once"
    # the transfers the launcher closed let go of their places: it fetches again
    wait_until(lambda: not serving._files._open, what="the closed transfers to end")
    fetch = _fetch(serving, 0)
    try:
        assert _read_file(fetch) == (SERVED_BYTES, SERVED_BYTES)
    finally:
        fetch.close()


def test_a_fetch_waiting_for_its_turn_has_its_handshake_done(serving, monkeypatch):
    from torchdist_magic.wire import handshake, transfers

    monkeypatch.setattr(transfers, "FETCHES_AT_ONCE", 1)
    monkeypatch.setattr(handshake, "CONNECT_ATTEMPTS", 1)
    holding = _fetch(serving, 0)  # holds the one transfer thread: it does not read
    # before, the hello's reply went when the transfer's turn came: a fetch that waited longer
    # than a handshake may take tried again, and again, and failed
    waiting = _fetch(serving, 1)
    try:
        holding.close()
        assert _read_file(waiting) == (SERVED_BYTES, SERVED_BYTES)
    finally:
        waiting.close()


class RewritingRelay(InjectingRelay):
    """On the path of a channel without TLS: passes every byte along but the hello, which it
    rewrites with ``rewrite(hello)``."""

    def __init__(self, target, rewrite):
        self.rewrite = rewrite
        super().__init__(target)

    def _pump(self, source, sink):
        if source is self.ends["down"]:  # the rank's side: its first frame is the hello
            from torchdist_magic.wire.frames import MAX_HELLO, read_frame

            try:
                sink.sendall(pack_frame(self.rewrite(read_frame(source, MAX_HELLO))))
            except (OSError, EOFError):
                return
        super()._pump(source, sink)


def test_a_hello_changed_on_its_way_is_refused(serving, tmp_path):
    """Without TLS, whoever is on the path rewrites an upload's announced size: before, the driver
    took it (and refused the value for want of room: a denial of service)."""
    host, port = serving.address
    relay = RewritingRelay((host, port), lambda hello: {**hello, "size": 2**60})
    try:
        with pytest.raises(Refused, match="^authentication failed: wrong secret for role launcher of rank 1$"):
            open_connection(
                ("127.0.0.1", int(relay.address.rpartition(":")[2])),
                _key(serving, "launcher", 1),
                "run-1",
                1,
                "launcher",
                upload=10,
            )
    finally:
        relay.close()
    assert serving.stats["authenticated"] == 0 and not os.listdir(tmp_path / "up")
