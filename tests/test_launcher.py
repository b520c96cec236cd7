"""Stopping a rank ends everything it started, also what left its process group; every signal
sent and every stop that failed is in the ``torchdist_magic`` log; one reading of ``/proc``."""

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest

from helpers import alive, assert_no_survivors, wait_until
from torchdist_magic.core import procs
from torchdist_magic.core.errors import RankFailure
from torchdist_magic.core.timing import STOP_GRACE


def _end(daemons):
    """End what a failing test left running: each daemon leads a process group of its own."""
    for pid in daemons:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- a process a rank starts in a session of its own ---------------------------------------------


def start_daemon_then(pid_dir, fail, ignore_sigterm=False):
    """Start ``sleep 600`` in a session of its own (out of the rank's process group), write its
    pid into ``pid_dir``, then return (or raise: rank 1, once rank 0's daemon is there too)."""
    import os
    import subprocess
    import time

    from torchdist_magic import rank

    if ignore_sigterm:
        daemon = subprocess.Popen(
            ["sh", "-c", "trap '' TERM; echo up; sleep 600 & wait"], start_new_session=True, stdout=subprocess.PIPE
        )
        daemon.stdout.readline()  # its trap is in place
    else:  # it holds the rank's output pipes, as a daemon that does not close them does
        daemon = subprocess.Popen(["sleep", "600"], start_new_session=True)
    mine = os.path.join(pid_dir, f"rank{rank()}")
    with open(mine + ".part", "w") as fh:
        fh.write(str(daemon.pid))
    os.replace(mine + ".part", mine)  # a reader sees the whole pid or no file
    if fail and rank() == 1:
        # its failure stops rank 0: not before rank 0 has started the daemon the test counts
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(pid_dir, "rank0")):
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 never started its daemon")
            time.sleep(0.05)
        raise ValueError("after starting a daemon")
    return rank()


def _daemon_pids(pid_dir):
    names = sorted(name for name in os.listdir(pid_dir) if not name.endswith(".part"))
    return [int(open(os.path.join(pid_dir, name)).read()) for name in names]


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_a_process_a_rank_started_in_a_session_of_its_own_ends_with_the_run(local_distributor, tmp_path, fail):
    pid_dir = tmp_path / "daemons"
    pid_dir.mkdir()
    run = local_distributor(2).submit(start_daemon_then, str(pid_dir), fail)
    try:
        if fail:
            with pytest.raises(RankFailure, match="after starting a daemon"):
                run.result(timeout=60)
        else:
            assert run.result(timeout=60) == 0
        daemons = _daemon_pids(str(pid_dir))
        assert len(daemons) == 2
        assert [pid for pid in daemons if alive(pid)] == [], "a rank's daemon outlived the run"
        assert_no_survivors(run, extra_pids=daemons)
    finally:
        run.cancel()
        run.wait(30)
        _end(_daemon_pids(str(pid_dir)))


DRIVER = """
import subprocess, sys, time
from torchdist_magic import Distributor
def start_daemon():
    daemon = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    print("up", daemon.pid, flush=True)
    time.sleep(600)
run = Distributor(1, show=None).submit(start_daemon)
while "up" not in run.logs(0):
    time.sleep(0.05)
print(run.logs(0).split()[1], flush=True)
time.sleep(600)
"""


def test_a_process_a_rank_started_in_a_session_of_its_own_ends_when_the_driver_is_killed(tmp_path):
    scratch = tmp_path / "driver-tmp"
    scratch.mkdir()
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=dict(os.environ, TMPDIR=str(scratch))
    )
    daemon = None
    try:
        lines = []
        reader = threading.Thread(target=lambda: lines.append(driver.stdout.readline()), daemon=True)
        reader.start()
        wait_until(lambda: lines or driver.poll() is not None, 60, "the driver to print its rank's daemon")
        assert lines and lines[0].strip(), f"the driver exited ({driver.returncode}) first"
        daemon = int(lines[0])
        assert alive(daemon)
        driver.kill()
        driver.wait()
        wait_until(lambda: not alive(daemon), 30, "the orphaned rank to end its daemon")
        wait_until(lambda: not any(scratch.iterdir()), 30, "the orphaned rank to remove its run directory")
    finally:
        driver.kill()
        driver.wait()
        if daemon is not None:
            _end([daemon])


def hang(marker_dir):
    import os
    import time

    from torchdist_magic import rank

    open(os.path.join(marker_dir, f"rank{rank()}"), "w").close()
    time.sleep(600)


def test_a_cancelled_run_logs_every_signal_it_sent(local_distributor, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="torchdist_magic")
    marker_dir = tmp_path / "started"
    marker_dir.mkdir()
    run = local_distributor(2).submit(hang, str(marker_dir))
    try:
        wait_until(lambda: len(os.listdir(marker_dir)) == 2, 60, "both ranks to start their job")
        # a rank's job can be under way before the driver has applied the record with its pid
        wait_until(lambda: all(rs.pid for rs in run.state.ranks), 30, "the driver to know both ranks' pids")
        pgids = [rs.pid for rs in run.state.ranks]
        run.cancel()
        assert run.wait(30), "the cancelled run did not end"
    finally:
        run.cancel()
        run.wait(30)
    messages = [r.getMessage() for r in caplog.records if r.name == "torchdist_magic"]
    for rank, pgid in enumerate(pgids):
        assert any(
            m.startswith(f"rank {rank}: sent SIGTERM to its process group {pgid}, stopping the rank (")
            for m in messages
        ), messages
    assert_no_survivors(run)


def test_a_daemon_that_ignores_sigterm_is_killed_and_both_signals_are_logged(local_distributor, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="torchdist_magic")
    pid_dir = tmp_path / "daemons"
    pid_dir.mkdir()
    run = local_distributor(1).submit(start_daemon_then, str(pid_dir), False, True)
    try:
        assert run.result(timeout=60) == 0
        (daemon,) = _daemon_pids(str(pid_dir))
        assert not alive(daemon)
    finally:
        _end(_daemon_pids(str(pid_dir)))
    messages = [r.getMessage() for r in caplog.records if r.name == "torchdist_magic"]
    mark = f"{run.run_id}:0:0"
    assert any(
        m.startswith(f"rank {mark}: sent SIGTERM to process {daemon} (sh -c ")
        and m.endswith("a process the rank left running")
        for m in messages
    ), messages
    # SIGKILL goes to what is left of the rank's processes then: the daemon, or the child it
    # started (which inherited the ignored SIGTERM), whichever the scan finds still running
    assert any(
        m.startswith(f"rank {mark}: sent SIGKILL to process ")
        and m.endswith(f"still running {STOP_GRACE:g} s after SIGTERM")
        for m in messages
    ), messages
    assert_no_survivors(run, extra_pids=[daemon])


def test_the_log_is_silent_unless_the_application_turns_it_on():
    code = textwrap.dedent("""
        import logging
        from torchdist_magic.launch import launcher
        logging.getLogger("torchdist_magic").warning("could not send SIGKILL")
        print("handlers", [type(h).__name__ for h in logging.getLogger("torchdist_magic").handlers])
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "handlers ['NullHandler']\n", "")


# -- the mark, and ending what carries it ----------------------------------------------------------


def _marked_sleeper(mark):
    return subprocess.Popen(
        ["sleep", "600"], start_new_session=True, env=dict(os.environ, **{procs.MARK_VARIABLE: mark})
    )


def test_ending_one_rank_s_processes_never_touches_another_rank_s():
    run = uuid.uuid4().hex
    ours, rank_10, other_attempt = (
        _marked_sleeper(f"{run}:0:1"),
        _marked_sleeper(f"{run}:0:10"),
        _marked_sleeper(f"{run}:1:1"),
    )
    sleepers = [ours, rank_10, other_attempt]
    try:
        wait_until(lambda: procs.marked_processes(f"{run}:0:1") == [ours.pid], 10, "the sleeper's mark")
        assert procs.end_marked_processes(f"{run}:0:1", grace=5.0) == [ours.pid]
        assert ours.wait(10) == -signal.SIGTERM
        assert alive(rank_10.pid) and alive(other_attempt.pid)
        assert procs.end_marked_processes(f"{run}:0:2", grace=5.0) == []
        assert procs.end_marked_processes("", grace=5.0) == []
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_the_process_that_ends_a_mark_is_never_ended_by_it():
    mark = f"{uuid.uuid4().hex}:0:0"
    code = (
        "from torchdist_magic.core import procs; import sys; print(procs.end_marked_processes(sys.argv[1], grace=0.0))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, mark],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, **{procs.MARK_VARIABLE: mark}),
    )
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


# -- /proc --------------------------------------------------------------------------------------


def test_process_exited_counts_a_zombie_as_exited():
    child = subprocess.Popen(["sleep", "600"])
    try:
        assert not procs.process_exited(child.pid)
        assert not procs.process_exited(os.getpid())
        child.kill()
        wait_until(lambda: procs.process_exited(child.pid), 10, "the killed child to be a zombie")
        assert os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None  # not reaped yet
    finally:
        child.kill()
        child.wait()
    assert procs.process_exited(child.pid)  # reaped: no such process


def test_group_members_are_the_live_processes_of_a_group():
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 600 & echo $!; wait"], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(leader.stdout.readline())
        assert sorted(procs.group_members(leader.pid)) == sorted([leader.pid, child])
        assert os.getpid() not in procs.group_members(leader.pid)
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
    wait_until(lambda: procs.group_members(leader.pid) == [], 10, "the group to be gone")


# -- rank 0's port ---------------------------------------------------------------------------------


def test_rank_0_s_port_is_below_the_ephemeral_range_and_no_zmq_style_listener_can_share_it():
    """What CI saw: a Jupyter kernel's ZeroMQ socket (SO_REUSEADDR) listened on the port a run had
    reserved, picked in the ephemeral range, and rank 0's store failed with EADDRINUSE.  The
    port is now below that range, held exclusively against another reservation, and rank 0's
    store can still listen on it."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    from torchdist_magic.launch import launcher

    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        low = int(fh.read().split()[0])
    held = [launcher.reserve_port("127.0.0.1") for _ in range(8)]
    try:
        ports = [s.getsockname()[1] for s in held]
        assert len(set(ports)) == len(ports), ports
        assert all(launcher.PORT_FLOOR <= p < low for p in ports), (ports, low)
        # a port picked the way Jupyter picks a kernel's (bind port 0, close) is never one of them
        picks = set()
        for _ in range(200):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                picks.add(s.getsockname()[1])
        assert not picks & set(ports)
        # no one binds it without SO_REUSEADDR (another run's reservation does so first)
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", ports[0]))
        store = TCPStore("127.0.0.1", ports[0], 1, True, timeout=datetime.timedelta(seconds=10))
        store.set("k", "v")
        assert store.get("k") == b"v"
        del store
    finally:
        for s in held:
            s.close()


def test_where_the_ephemeral_range_leaves_no_room_a_port_in_it_is_taken(monkeypatch):
    from torchdist_magic.launch import launcher

    monkeypatch.setattr(launcher, "_ephemeral_low", lambda: launcher.PORT_FLOOR + 100)
    with launcher.reserve_port("127.0.0.1") as sock:
        assert sock.getsockname()[1] > 0
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)


def test_the_system_s_reserved_ports_are_read_as_ranges(tmp_path, monkeypatch):
    import builtins

    from torchdist_magic.launch import launcher

    real_open = builtins.open
    listing = tmp_path / "reserved"
    listing.write_text("8080,25000-25002,bad\n")

    def fake_open(path, *args, **kwargs):
        return real_open(listing if path == "/proc/sys/net/ipv4/ip_local_reserved_ports" else path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert launcher._reserved_ports() == {8080, 25000, 25001, 25002}


def test_the_lines_of_one_read_are_one_record_and_a_redrawn_line_one_of_its_own(tmp_path):
    """A rank that prints a line a step: the driver takes the lines its launcher read at once as
    one ``Log`` (the others in ``more``), not one record a line; a ``\\r`` line stays apart."""
    from helpers import Collector
    from torchdist_magic.core import events
    from torchdist_magic.launch.launcher import RankProcess

    not_a_worker = tmp_path / "python"  # one write of several lines, then a second one
    not_a_worker.write_text(
        "#!/bin/sh\nprintf 'step 1\\nstep 2\\nbar 50%%\\rstep 3\\nstep 4\\n'\nsleep 0.5\necho last\n"
    )
    not_a_worker.chmod(0o755)
    got = Collector()
    proc = RankProcess(0, "job", str(tmp_path / "rank-0"), dict(os.environ), got, python=str(not_a_worker))
    wait_until(lambda: any(r.type == "exit" for r in got.records), 30, "the rank's exit record")
    logs = [r for r in got.records if isinstance(r, events.Log)]
    assert [(r.line, r.more, r.cr) for r in logs] == [
        ("step 1", ["step 2"], False),
        ("bar 50%", [], True),
        ("step 3", ["step 4"], False),
        ("last", [], False),
    ]
    assert [line.line for r in logs for line in r.lines()] == [
        "step 1",
        "step 2",
        "bar 50%",
        "step 3",
        "step 4",
        "last",
    ]
    assert proc.returncode == 0 and not alive(proc.pgid)
