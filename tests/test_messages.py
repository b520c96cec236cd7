"""Messages a user or a maintainer sees that no other test triggered: each is made to happen here,
with the real parts (a rank's channel client against a driver that stalls, cuts or misbehaves, a
warm pool, the magic), and its text checked."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from helpers import assert_no_survivors, wait_until
from test_channel import StalledDriver
from torchdist_magic.core import events
from torchdist_magic.launch.remote import CommandLineSite
from torchdist_magic.wire import frames, handshake, server as channel_server, tls
from torchdist_magic.wire.client import ChannelClient


# -- a rank's event channel ---------------------------------------------------------------------------
def test_events_not_sent_within_the_close_wait_are_dropped_and_said(capfd):
    driver = StalledDriver("s")  # accepts, never sends its challenge: the sender waits in the handshake
    client = ChannelClient(driver.address, "s", "r", 3)
    client.send(events.Started(rank=3, pid=3))
    client.close(timeout=0.5)
    driver.close()
    err = capfd.readouterr().err
    assert err == ("torchdist_magic: the events of rank 3 were not all sent within 0.5 s; the rest are dropped\n"), err


def test_a_channel_the_driver_cuts_after_the_handshake_is_lost_and_said_once(capfd):
    driver = StalledDriver("s")
    client = ChannelClient(driver.address, "s", "r", 4)
    client.send(events.Started(rank=4, pid=4))
    conn = driver.handshake()
    conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    conn._sock.close()  # a reset, as when the driver's process is killed
    driver.close()

    def lost():
        client.send(events.Log(rank=4, line="x"))
        return client._lost

    wait_until(lost, 30, "the client to find its channel lost", interval=0.1)
    client.close()
    err = capfd.readouterr().err
    assert err.count("torchdist_magic:") == 1, err
    assert err.startswith("torchdist_magic: the event channel of rank 4 to the driver was lost ("), err
    assert err.endswith("); its events are dropped from now on\n"), err


def test_a_record_the_rank_cannot_handle_is_said_and_the_next_still_handled(capfd):
    driver = StalledDriver("s")
    handled = []

    def on_message(record):
        if not handled:
            handled.append("failed")
            raise RuntimeError("no debugger here")
        handled.append(record.type)

    client = ChannelClient(driver.address, "s", "r", 0, role="launcher", on_message=on_message)
    conn = driver.handshake()
    for _ in range(2):
        conn.sendall(frames.pack_frame({"events": [events.encode(events.Stop(rank=0))]}))
    wait_until(lambda: len(handled) == 2, 30, "both records handled")
    client.close()
    conn.close()
    driver.close()
    assert handled == ["failed", "stop"]
    err = capfd.readouterr().err
    assert err == (
        "torchdist_magic: rank 0 could not handle 'stop' from the driver: RuntimeError('no debugger here')\n"
    ), err


def test_a_driver_that_never_answers_is_given_up_naming_the_handshake_deadline(capfd, monkeypatch):
    monkeypatch.setattr(handshake, "HANDSHAKE_DEADLINE", 0.2)
    silent = socket.create_server(("127.0.0.1", 0))  # its backlog takes the connection; nobody answers
    address = "127.0.0.1:%d" % silent.getsockname()[1]
    client = ChannelClient(address, "s", "r", 2)
    assert not client.reaches_driver(30)
    client.close()
    silent.close()
    err = capfd.readouterr().err
    assert err == (
        f"torchdist_magic: cannot reach the driver's event channel at {address} (no handshake "
        "within 0.2 s); events of rank 2 are dropped\n"
    ), err


def test_a_driver_that_closes_during_the_tls_handshake_is_given_up_saying_so(capfd, monkeypatch):
    monkeypatch.setattr(handshake, "HANDSHAKE_DEADLINE", 0.5)
    listener = socket.create_server(("127.0.0.1", 0))
    address = "127.0.0.1:%d" % listener.getsockname()[1]
    done = threading.Event()

    def close_each():
        listener.settimeout(0.1)
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conn.settimeout(5)
            try:
                conn.recv(65536)  # the client's hello read: the close is an end, not a reset
            except OSError:
                pass
            conn.close()

    closer = threading.Thread(target=close_each)
    closer.start()
    try:
        client = ChannelClient(address, "s", "r", 1, certificate=tls.new_identity().certificate)
        assert not client.reaches_driver(30)
        client.close()
    finally:
        done.set()
        closer.join()
        listener.close()
    err = capfd.readouterr().err
    assert err == (
        f"torchdist_magic: cannot reach the driver's event channel at {address} (connection "
        "closed during the TLS handshake); events of rank 1 are dropped\n"
    ), err


# -- warm pools ---------------------------------------------------------------------------------------
def say_then_sleep():
    print("sleeping", flush=True)
    time.sleep(600)


def test_a_warm_run_stopped_mid_job_ends_its_pool_and_says_the_next_starts_a_fresh_one(local_distributor):
    from torchdist_magic.backends.pool import pools

    run = local_distributor(2, warm=True).submit(say_then_sleep)
    wait_until(lambda: all("sleeping" in run.logs(r) for r in (0, 1)), 60, "both ranks in the job")
    (info,) = pools()
    run.cancel()
    run.wait(60)
    assert (
        f"[torchdist] warm {info.id} stopped (ranks 0, 1 were still in the job); the next warm run starts a fresh pool"
    ) in run.logs(0)
    wait_until(lambda: pools() == [], 30, "the pool to stop")
    assert_no_survivors(run)


def test_pool_stop_says_which_pools_it_stopped_or_that_none_ran(ip, capsys, local_distributor):
    from torchdist_magic.backends.pool import pools

    ip.run_line_magic("torchdist_pool", "stop")
    assert capsys.readouterr().out == "no warm pool was running\n"
    local_distributor(2, warm=True).run(time.time)
    (info,) = pools()
    ip.run_line_magic("torchdist_pool", "stop")
    assert capsys.readouterr().out == f"stopped {info.id}\n"
    assert pools() == []


# -- capture -------------------------------------------------------------------------------------------
def test_notebook_values_that_fail_only_together_are_said_as_a_whole():
    from torchdist_magic.capture import _unpicklable_message

    # each value alone pickles: the error names no one of them
    assert _unpicklable_message({"a": 1, "b": [2]}, RecursionError("maximum recursion depth exceeded")) == (
        "the cell's notebook values cannot be sent to the ranks: maximum recursion depth exceeded"
    )


# -- a rank's process and its launcher ------------------------------------------------------------------
def say_how_it_was_stopped(marks):
    import os

    from torchdist_magic import RankStopped

    try:
        print("up", flush=True)
        time.sleep(600)
    except RankStopped as exc:  # what a job that cleans up on a stop is told
        print(f"stopped: {exc}", flush=True)
        open(os.path.join(marks, "said"), "w").close()
        raise


def test_a_rank_stopped_by_its_run_is_told_so(local_distributor, tmp_path):
    run = local_distributor(1).submit(say_how_it_was_stopped, str(tmp_path))
    wait_until(lambda: "up" in run.logs(0), 60, "the rank to be up")
    run.cancel()
    run.wait(60)
    assert (tmp_path / "said").exists()
    assert "stopped: the run stopped this rank (SIGTERM)" in run.logs(0)
    assert_no_survivors(run)


def test_a_failed_system_sample_is_logged_and_the_run_goes_on(local_distributor, monkeypatch, caplog):
    from torchdist_magic.launch import sysmetrics

    def broken(self):
        raise RuntimeError("no /proc here")

    monkeypatch.setattr(sysmetrics.RankSampler, "sample", broken)
    with caplog.at_level("ERROR", logger="torchdist_magic.launch.launcher"):
        run = local_distributor(1).submit(time.time)
        run.result(timeout=60)
    failed = [r for r in caplog.records if r.getMessage() == "rank 0: sampling its system metrics failed"]
    assert failed and failed[0].exc_info[1].args == ("no /proc here",)
    assert_no_survivors(run)


def test_a_failure_to_end_what_a_rank_left_is_logged_and_its_exit_still_reported(
    local_distributor, monkeypatch, caplog
):
    from torchdist_magic.launch import launcher

    def broken(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(launcher, "end_marked_processes", broken)
    with caplog.at_level("ERROR", logger="torchdist_magic.launch.launcher"):
        run = local_distributor(1).submit(time.time)
        assert run.result(timeout=60) > 0
    (failed,) = [r for r in caplog.records if "left running" in r.getMessage()]
    assert failed.getMessage() == "rank 0: ending the processes it left running failed"
    assert str(failed.exc_info[1]) == "no /proc here"
    assert_no_survivors(run)


# -- the driver's event channel ---------------------------------------------------------------------------
def test_a_channel_whose_thread_is_held_past_its_close_is_left_behind_and_said(monkeypatch, caplog):
    from test_channel import worker
    from torchdist_magic.wire.frames import new_secret
    from torchdist_magic.wire.server import ChannelServer

    monkeypatch.setattr(channel_server, "CHANNEL_CLOSE_WAIT", 0.2)
    monkeypatch.setattr(channel_server, "CHANNEL_THREAD_WAIT", 0.2)
    release, delivering = threading.Event(), threading.Event()

    def on_event(record):  # a view that holds the channel's thread (it must not, and is not waited for)
        delivering.set()
        release.wait(60)

    server = ChannelServer(on_event, "run-1", secret=new_secret(), launcher_secret=new_secret())
    server.cert = None
    client = worker(server)
    client.send(events.Started(rank=0, pid=1))
    client.close()
    assert delivering.wait(30)
    with caplog.at_level("WARNING", logger="torchdist_magic"):
        server.close()
    release.set()
    server._thread.join(30)
    assert [r.getMessage() for r in caplog.records] == [
        "run run-1: the event channel's thread was still delivering a record 0.4 s after close; left behind"
    ]


# -- Spark ---------------------------------------------------------------------------------------------
@pytest.mark.spark
def test_a_chosen_interpreter_the_executors_cannot_start_is_refused_saying_so(spark_local2, monkeypatch, tmp_path):
    from torchdist_magic import Distributor
    from torchdist_magic.backends import spark_python
    from torchdist_magic.driver.distributor import last_run

    missing = str(tmp_path / "no-python")
    monkeypatch.setenv("PYSPARK_PYTHON", missing)
    monkeypatch.setattr(spark_python, "_chosen", {})
    before = last_run()
    with pytest.raises(spark_python.InterpreterMismatch) as info:
        Distributor(2, local_mode=False, show=None).submit(time.time)
    text = str(info.value)
    assert f"with the interpreter you chose ({missing})" in text, text
    assert "\n  executors: Python did not start: " in text and missing in text, text
    assert last_run() is before


# -- a rank's value, sent to the driver ------------------------------------------------------------------
def test_a_driver_that_ends_the_upload_before_the_value_began_fails_the_sending(tmp_path):
    from torchdist_magic.core import values
    from torchdist_magic.core.rankenv import RunSpec, rank_key
    from torchdist_magic.launch import valueupload
    from torchdist_magic.wire.frames import new_secret

    launcher_secret = new_secret()
    driver = StalledDriver(rank_key(launcher_secret, "launcher", 0))
    spec = RunSpec(
        "r",
        1,
        False,
        False,
        {},
        None,
        channel_address=driver.address,
        secret=new_secret(),
        launcher_secret=launcher_secret,
    )
    path = str(tmp_path / "result.pkl")
    values.dump({"a": 1}, path)
    size = f"{os.path.getsize(path) / 2**20:.1f} MiB"
    ended = threading.Thread(target=lambda: driver.handshake()._sock.close())  # accepted, then gone
    ended.start()
    with pytest.raises(valueupload.ValueNotSent) as info:
        valueupload.send(spec, path, 0)
    ended.join()
    driver.close()
    assert str(info.value) == (
        f"rank 0 could not send its value ({size}) from {socket.gethostname()} to the "
        f"driver at {driver.address}: the connection ended before the value began "
        "(connection closed)"
    ), str(info.value)


# -- a launcher meeting the other ranks ---------------------------------------------------------------
def meet(client, driver):
    from torchdist_magic.launch import remote

    mine = events.Joined(rank=0, host="h", address="127.0.0.1", port=1)
    with pytest.raises(remote.RunStopped) as info:
        remote.rendezvous(remote.CommandLineSite(0, "127.0.0.1"), client, driver, mine)
    return str(info.value)


def launcher_client(driver, messages):
    return ChannelClient(driver.address, "s", "r", 0, role="launcher", on_message=messages.on_message)


def test_a_launcher_whose_channel_is_lost_before_the_peers_cannot_meet_the_others_and_says_why():
    from torchdist_magic.launch.remote import DriverMessages

    driver, messages = StalledDriver("s"), DriverMessages()
    client = launcher_client(driver, messages)
    client.send(events.Log(rank=0, line="x"))
    conn = driver.handshake()
    conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    conn._sock.close()  # a reset, as when the driver's process is killed
    driver.close()

    def lost():
        client.send(events.Log(rank=0, line="x"))
        return client.lost

    wait_until(lost, 30, "the client to find its channel lost", interval=0.1)
    text = meet(client, messages)
    client.close()
    assert text == "rank 0 could not meet the other ranks: the driver's channel was lost", text


@pytest.mark.parametrize(
    "record, reason",
    [
        (events.Stop(rank=0), "the run was stopped first"),
        (
            events.Peers(rank=0, use_barrier=True),
            "not every rank reached the driver, and this backend has no other way to meet",
        ),
    ],
)
def test_a_launcher_the_driver_stops_or_sends_to_a_barrier_it_lacks_cannot_meet_the_others(record, reason):
    from torchdist_magic.launch.remote import DriverMessages

    driver, messages = StalledDriver("s"), DriverMessages()
    client = launcher_client(driver, messages)
    client.send(events.Log(rank=0, line="x"))
    conn = driver.handshake()
    conn.sendall(frames.pack_frame({"events": [events.encode(record)]}))
    wait_until(lambda: messages.stopped() or messages.peer_list is not None, 30, "the driver's record")
    text = meet(client, messages)
    client.close()
    conn.close()
    driver.close()
    assert text == f"rank 0 could not meet the other ranks: {reason}", text


def test_a_warm_pool_whose_backend_cannot_start_is_stopped_saying_so(local_distributor, monkeypatch):
    from torchdist_magic.backends import local, warm
    from torchdist_magic.backends.pool import pools

    def cannot_start(self, ctx):
        raise OSError("no room for the ranks")

    starts = []
    first_start = warm.WarmBackend.start

    def recorded(self, ctx):
        starts.append((self, ctx))
        return first_start(self, ctx)

    monkeypatch.setattr(local.LocalProcessBackend, "start", cannot_start)
    monkeypatch.setattr(warm.WarmBackend, "start", recorded)
    run = local_distributor(2, warm=True).submit(time.time)
    with pytest.raises(OSError, match="no room for the ranks"):
        run.result(timeout=60)
    assert pools() == []
    ((backend, ctx),) = starts
    # what a run that still held the pool is told when it starts on it
    with pytest.raises(RuntimeError) as info:
        first_start(backend, ctx)
    assert str(info.value) == f"warm {backend.pool.id} was stopped: it could not start"


# -- what a rank left running -------------------------------------------------------------------------
def test_processes_a_rank_left_that_cannot_be_signalled_or_do_not_end_are_logged(monkeypatch, caplog):
    import signal
    import subprocess
    import uuid

    from helpers import alive
    from torchdist_magic.core import procs

    mark = f"{uuid.uuid4().hex}:0:1"
    sleeper = subprocess.Popen(
        ["sleep", "600"], start_new_session=True, env=dict(os.environ, **{procs.MARK_VARIABLE: mark})
    )
    real_kill = os.kill

    def kill(pid, sig):  # forced: a SIGTERM refused, a SIGKILL the kernel has not acted on yet
        if pid != sleeper.pid:
            return real_kill(pid, sig)
        if sig == signal.SIGTERM:
            raise PermissionError(1, "Operation not permitted")

    try:
        wait_until(lambda: procs.marked_processes(mark) == [sleeper.pid], 10, "the sleeper's mark")
        monkeypatch.setattr(procs.os, "kill", kill)
        with caplog.at_level("WARNING", logger="torchdist_magic"):
            assert procs.end_marked_processes(mark, grace=0.0, reap=0.2) == [sleeper.pid]
        monkeypatch.undo()
        assert alive(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    described = f"process {sleeper.pid} (sleep 600)"
    assert [r.getMessage() for r in caplog.records] == [
        f"rank {mark}: could not send SIGTERM to {described}: [Errno 1] Operation not permitted",
        f"rank {mark}: {described} did not end within 0.2 s of SIGKILL",
    ]
    assert not alive(sleeper.pid)


def test_a_rank_whose_group_cannot_be_signalled_is_logged_and_so_is_its_missing_end(
    local_distributor, monkeypatch, caplog
):
    from torchdist_magic.launch import launcher

    def refused(pgid, sig):  # forced: the group may not be signalled (another user's, a container's rule)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(launcher, "REAP_WAIT", 0.2)
    run = local_distributor(1).submit(say_then_sleep)
    wait_until(lambda: "sleeping" in run.logs(0), 60, "the rank in its job")
    (pgid,) = {rs.pid for rs in run.state.ranks}  # the worker leads a session, and so its group, of its own
    monkeypatch.setattr(launcher.os, "killpg", refused)
    with caplog.at_level("WARNING", logger="torchdist_magic"):
        run.cancel()
        wait_until(lambda: any("after SIGKILL" in r.getMessage() for r in caplog.records), 60, "the stop to end")
    monkeypatch.undo()
    os.killpg(pgid, 9)  # what the refused stop could not do
    run.wait(60)
    # (the run's close, which may come before the undo, tries once more)
    assert [r.getMessage() for r in caplog.records][:3] == [
        f"rank 0: could not send SIGTERM to its process group {pgid}: [Errno 1] Operation not permitted",
        f"rank 0: could not send SIGKILL to its process group {pgid}: [Errno 1] Operation not permitted",
        f"rank 0: process {pgid} has not ended (or not been reported) 2.2 s after SIGKILL",
    ]
    assert_no_survivors(run)


# -- a kernel's widget messages while a cell blocks ---------------------------------------------------
#: a handler in the kernel that keeps what the package logs, and the error each record carries
CATCH_LOG = """
import logging
caught = []

class Keep(logging.Handler):
    def emit(self, record):
        caught.append((record.name, record.getMessage(), repr(record.exc_info[1]) if record.exc_info else ""))

logging.getLogger("torchdist_magic").addHandler(Keep())
"""


@pytest.mark.kernel
def test_a_widget_message_the_kernel_cannot_handle_while_a_cell_blocks_is_logged_and_the_wait_goes_on():
    pytest.importorskip("ipykernel")
    from helpers import alive
    from test_kernel_poll import SETUP, Kernel, comm_with_class, send_comm

    kernel = Kernel()
    try:
        kernel.run(SETUP)
        kernel.run(CATCH_LOG)
        kc = kernel.kc
        blocking = kc.execute("try:\n    wait_for(WaitingRun(2), 60)\nexcept RuntimeError:\n    pass")
        stop, deadline = None, time.monotonic() + 60
        while stop is None and time.monotonic() < deadline:
            msg = kernel.iopub()
            if msg["parent_header"].get("msg_id") == blocking:
                stop = comm_with_class(msg, "torchdist-stop")
        assert stop, "the view's Stop button never opened"
        kc.shell_channel.send(kc.session.msg("comm_msg", {"data": {}}))  # a frontend's message without its comm
        send_comm(kc, stop, {"method": "custom", "content": {"event": "click"}})  # still heard: the wait went on
        reply = kc.get_shell_msg(timeout=60)
        assert reply["parent_header"]["msg_id"] == blocking and reply["content"]["status"] == "ok"
        kernel.run(
            "assert caught == [('torchdist_magic.view.kernel_poll', "
            "'torchdist: error in a widget message handler', \"KeyError('comm_id')\")], caught"
        )
    finally:
        kernel.close()
    wait_until(lambda: not alive(kernel.pid), 10, "the kernel to end")


class RowsUntilStopped(CommandLineSite):
    """A launcher's site whose rows take until the driver stops the run (``Site.data_file`` is
    given the stop)."""

    def data_file(self, workdir, stopped):
        wait_until(stopped, 30, "the driver's stop")
        return ""


def test_a_launcher_the_driver_stops_before_its_rank_started_reports_it_and_starts_nothing():
    import uuid

    from helpers import pids_of_run
    from torchdist_magic.core.rankenv import RunSpec, rank_key
    from torchdist_magic.launch import remote
    from torchdist_magic.wire.frames import new_secret

    run_id, launcher_secret = f"stopped-{uuid.uuid4().hex}", new_secret()
    driver = StalledDriver(rank_key(launcher_secret, "launcher", 0))
    spec = RunSpec(
        run_id,
        1,
        False,
        False,
        {},
        None,
        channel_address=driver.address,
        secret=new_secret(),
        launcher_secret=launcher_secret,
    )
    outcomes = []
    launcher = threading.Thread(
        target=lambda: outcomes.append(
            remote.run_launcher(remote.RemoteSpec(spec, b""), RowsUntilStopped(0, "127.0.0.1"))
        )
    )
    launcher.start()
    conn = driver.handshake()
    joined = events.Joined(rank=0, host="h", address="127.0.0.1", port=1)
    conn.sendall(frames.pack_frame({"events": [events.encode(events.Peers(rank=0, peers=[joined]))]}))
    conn.sendall(frames.pack_frame({"events": [events.encode(events.Stop(rank=0))]}))
    launcher.join(60)
    conn.close()
    driver.close()
    (outcome,) = outcomes
    final = events.decode(outcome.exit_json)
    assert (final.code, final.stopped) == (1, True)
    assert (final.failure.exc_type, final.failure.message) == (
        "RunStopped",
        "the run was stopped before rank 0 started",
    ), final.failure
    assert pids_of_run(run_id) == []  # its guard is gone too, and no worker was started


# -- a Spark task's rows of the run's DataFrame ---------------------------------------------------------
def test_a_task_stopped_while_it_reads_its_rows_stops_reading_and_says_so(tmp_path):
    pa = pytest.importorskip("pyarrow")
    from torchdist_magic.launch.partitions import DataStopped, write_batches

    batch = pa.record_batch({"x": [1, 2, 3]})
    taken = []

    def batches():  # a mapInArrow task's input; the driver stops the run after the first batch
        for i in range(3):
            taken.append(i)
            yield batch

    path = str(tmp_path / "rows.arrow")
    with pytest.raises(DataStopped) as info:
        write_batches(path, batches(), batch.schema.serialize().to_pybytes(), lambda: len(taken) > 1)
    assert str(info.value) == "the run was stopped while this task was reading its rows"
    assert taken == [0, 1]  # the rest are not read


# -- stopping a Spark stage ----------------------------------------------------------------------------
@pytest.mark.spark
def test_a_spark_stage_stopped_by_interrupts_logs_each_one_and_what_failed(spark_local2, monkeypatch, caplog):
    import pyspark

    from helpers import assert_nothing_left
    from torchdist_magic import Distributor, RunCancelled
    from torchdist_magic.backends import spark_classic, spark_stage

    interrupt = spark_classic.SparkRun._interrupt
    interrupts = []

    def first_fails(self):  # forced: the first interrupt finds the session gone, the next ones do not
        interrupts.append(self.job_tag)
        if len(interrupts) == 1:
            raise RuntimeError("the Java gateway is gone")
        interrupt(self)

    def gone(self, tag):
        raise RuntimeError("the SparkContext was stopped")

    monkeypatch.setattr(spark_stage, "SPARK_STAGE_END_WAIT", -60.0)  # no wait for the tasks: interrupt at once
    monkeypatch.setattr(spark_classic.SparkRun, "_interrupt", first_fails)
    monkeypatch.setattr(pyspark.SparkContext, "removeJobTag", gone)
    run = Distributor(2, local_mode=False, show=None).submit(say_then_sleep)
    wait_until(lambda: all("sleeping" in run.logs(r) for r in (0, 1)), 120, "both ranks in the job")
    with caplog.at_level("INFO", logger="torchdist_magic"):
        run.cancel()
        with pytest.raises(RunCancelled):
            run.result(timeout=120)
    said = [r.getMessage() for r in caplog.records if "job tag" in r.getMessage()]
    tag = interrupts[0]
    prefix = f"run {run.run_id}:"
    assert said[:3] == [
        f"{prefix} interrupting Spark job tag {tag}",
        f"{prefix} could not interrupt job tag {tag} (RuntimeError: the Java gateway is gone); the session is gone",
        f"{prefix} the stage of job tag {tag} was still running 30 s after it was interrupted",
    ], said
    # the run's close stops it again, and this time the interrupt ends the stage
    assert said[3:-1] and set(said[3:-1]) == {f"{prefix} interrupting Spark job tag {tag}"}, said
    assert said[-1] == f"{prefix} could not remove job tag {tag} (RuntimeError: the SparkContext was stopped)"
    assert_nothing_left(run)
