"""Detached runs (supervise/supervisor.py, handles/attach.py): a run under a supervising process of
its own, its handle from any process (``attach``), ``stop`` by id, its record; real processes,
real sockets.  The kernel tests (a kernel killed with SIGKILL) are in test_detach_kernel.py."""

import os
import signal
import socket

import pytest

import torchdist_magic
from torchdist_magic import Distributor, NotAvailable, RankFailure, RunCancelled
from torchdist_magic.core import events
from torchdist_magic.handles import attach as attaching
from torchdist_magic.driver import history, layout
from torchdist_magic.supervise import supervisor

from helpers import alive, assert_nothing_survives, pids_of_run, touch, wait_until


def prints_then_returns(marker):
    import os
    import time

    from torchdist_magic import rank

    print(f"rank {rank()} started", flush=True)
    while not os.path.exists(marker):
        time.sleep(0.05)
    print(f"rank {rank()} went on", flush=True)
    return {"rank": rank(), "value": 42}


def sleeps():
    import time

    print("sleeping", flush=True)
    time.sleep(600)


def raises_on_rank_1():
    from torchdist_magic import rank

    if rank() == 1:
        raise KeyError("no such shard")
    return 1


def detached(np=2, **options):
    return Distributor(num_processes=np, show=None, detach=True, **options)


def test_a_detached_run_returns_at_once_and_any_handle_gets_its_value_and_lines(home, tmp_path):
    marker = str(tmp_path / "go")
    handle = detached().run(prints_then_returns, marker)
    assert isinstance(handle, attaching.AttachedRun) and not handle.done()
    assert handle.record.detached and handle.record.pid != os.getpid()
    wait_until(lambda: "rank 1 started" in handle.logs(1), 60, "rank 1's first line")
    [record] = torchdist_magic.runs()
    assert record.run_id == handle.run_id and record.state == "running" and record.detached
    touch(marker)
    assert handle.result(60) == {"rank": 0, "value": 42}
    assert torchdist_magic.attach(handle.run_id) is handle  # this process's own handle, value and all
    later = attaching.AttachedRun(handle.run_id)  # another kernel's, after the end: everything is there
    assert later.wait(30) and later.logs(1) == "rank 1 started\nrank 1 went on\n"
    with pytest.raises(
        history.ValueGone, match=f"^rank 0's value of run {handle.run_id} was taken by process {os.getpid()} at "
    ):
        later.result(10)  # taken out of the record by this kernel's handle, which keeps it
    assert handle.result(0) == {"rank": 0, "value": 42}
    record = history.read_record(handle.run_id)
    assert record.state == "succeeded" and record.has_value and record.pid == handle.record.pid
    assert record.log(0) == "rank 0 started\nrank 0 went on\n"
    assert_nothing_survives(handle.run_id, handle.record.pid)


KERNEL_ONLY = """
class Weights:
    def __init__(self, rank):
        self.rank = rank
"""


def returns_a_kernel_only_value(directory):
    import sys

    sys.path.insert(0, directory)  # the rank's own way to the class
    import kernel_only_weights

    from torchdist_magic import rank

    return kernel_only_weights.Weights(rank())


@pytest.mark.parametrize("all_ranks", [False, True])
def test_a_detached_value_reaches_the_kernel_as_the_rank_made_it(home, tmp_path, monkeypatch, all_ranks):
    """The supervising process keeps the ranks' bytes and never decodes them: a value of a class
    only the ranks and the kernel can import reaches the kernel (before, the supervising process
    unpickled it, failed, and the value was lost)."""
    (tmp_path / "kernel_only_weights.py").write_text(KERNEL_ONLY)
    handle = detached(all_ranks=all_ranks).submit(returns_a_kernel_only_value, str(tmp_path))
    assert handle.wait(120)
    record = history.read_record(handle.run_id)
    assert record.state == "succeeded" and record.has_value
    monkeypatch.syspath_prepend(str(tmp_path))  # the kernel can import the class; the supervisor could not
    value = attaching.AttachedRun(handle.run_id).result(30)
    if all_ranks:
        assert [type(v).__name__ for v in value] == ["Weights", "Weights"] and [v.rank for v in value] == [0, 1]
    else:
        assert type(value).__module__ == "kernel_only_weights" and value.rank == 0
    assert_nothing_survives(handle.run_id, handle.record.pid)


def test_stop_by_id_ends_every_rank_and_the_record_says_cancelled(home):
    handle = detached().submit(sleeps)
    wait_until(lambda: "sleeping" in handle.logs(1), 60, "rank 1 to sleep")
    ranks = pids_of_run(handle.run_id)
    assert len(ranks) >= 2
    assert torchdist_magic.stop(handle.run_id, by="a test") is True
    with pytest.raises(RunCancelled, match="stopped by a test"):
        handle.result(60)
    record = history.read_record(handle.run_id)
    assert record.state == "cancelled" and record.failure == "stopped by a test; every rank was stopped"
    assert torchdist_magic.stop(handle.run_id) is False  # it had ended
    assert_nothing_survives(handle.run_id, handle.record.pid)
    assert not [p for p in ranks if alive(p)]


def test_a_detached_run_that_fails_leaves_its_failure_in_the_record(home):
    handle = detached().submit(raises_on_rank_1)
    with pytest.raises(RankFailure, match="no such shard") as failure:
        handle.result(60)
    assert failure.value.rank == 1 and "raises_on_rank_1" in failure.value.traceback
    record = history.read_record(handle.run_id)
    assert record.state == "failed" and record.root_cause.rank == 1 and "KeyError" in record.failure
    assert not record.has_value
    assert_nothing_survives(handle.run_id, handle.record.pid)


def test_a_killed_supervising_process_takes_its_ranks_and_the_handle_says_so(home):
    handle = detached().submit(sleeps)
    wait_until(lambda: "sleeping" in handle.logs(1), 60, "rank 1 to sleep")
    os.kill(handle.record.pid, signal.SIGKILL)
    with pytest.raises(
        attaching.RunLost,
        match=f"the supervising process of detached run {handle.run_id} "
        r"\(pid \d+\) ended before the run did",
    ):
        handle.result(60)
    # the handle that found it dead removed its control socket (and its token): SIGKILL left them
    assert not os.path.lexists(handle.record.control)
    assert not os.path.exists(os.path.join(handle.directory, layout.TOKEN_FILE))
    assert history.read_record(handle.run_id).failure == (
        f"its supervising process (pid {handle.record.pid}) ended before the run did"
    )
    assert_nothing_survives(handle.run_id, handle.record.pid)


def test_sigterm_to_the_supervising_process_stops_the_run(home):
    handle = detached(np=1).submit(sleeps)
    wait_until(lambda: "sleeping" in handle.logs(0), 60, "rank 0 to sleep")
    os.kill(handle.record.pid, signal.SIGTERM)
    with pytest.raises(RunCancelled, match="stopped by SIGTERM to its supervising process"):
        handle.result(60)
    assert_nothing_survives(handle.run_id, handle.record.pid)


def test_the_control_socket_takes_only_a_stop_with_the_runs_token(home):
    handle = detached(np=1).submit(sleeps)
    try:
        wait_until(lambda: "sleeping" in handle.logs(0), 60, "rank 0 to sleep")
        path = handle.record.control
        assert os.stat(os.path.dirname(path)).st_mode & 0o077 == 0  # in a private directory

        def ask(payload: bytes) -> bytes:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(path)
                conn.sendall(payload)
                return conn.recv(64)

        assert ask(events.dumps(events.StopRun(rank=-1, token="0" * 64, by="a guess")).encode() + b"\n") == b"refused\n"
        assert ask(b'{"type": "stop", "rank": 0, "grace": 1.0}\n') == b"refused\n"  # not a kernel's record
        assert ask(b"not json\n") == b"refused\n"
        with open(os.path.join(handle.directory, layout.TOKEN_FILE), "w") as fh:
            fh.write("f" * 64)
        with pytest.raises(PermissionError, match="refused the request to stop it"):
            torchdist_magic.stop(handle.run_id)
        assert not handle.done()
    finally:
        os.kill(handle.record.pid, signal.SIGTERM)
        assert handle.wait(60)
    assert_nothing_survives(handle.run_id, handle.record.pid)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a process of another user that listens")
def test_stop_sends_the_token_to_no_socket_another_user_listens_on(home):
    """A running detached run's record whose control path is a socket of another uid (the path
    taken over, the directory swapped): before, ``stop`` sent the run's token to it and believed
    its "ok"."""
    import tempfile

    directory = tempfile.mkdtemp(dir="/tmp")
    os.chmod(directory, 0o777)
    path = os.path.join(directory, "ctl.sock")
    record_dir = history.record_directory("taken-1")
    token = "7" * 64
    history.write_private(os.path.join(record_dir, layout.TOKEN_FILE), token)
    history.RunRecord(
        run_id="taken-1",
        started=1.0,
        detached=True,
        pid=os.getpid(),  # alive: the record reads "running"
        host=socket.gethostname(),
        control=path,
        directory=record_dir,
    ).save()
    heard_r, heard_w = os.pipe()
    child = os.fork()
    if child == 0:  # another user's process that answers "ok" to whatever comes, and tells what came
        try:
            os.close(heard_r)
            os.setgid(65534)
            os.setuid(65534)
            listener = socket.socket(socket.AF_UNIX)
            # listening before it takes the control socket's name: a connect between bind and
            # listen is refused (the run would read as gone, and the test would test nothing)
            listener.bind(path + ".new")
            listener.listen(1)
            os.rename(path + ".new", path)
            conn = listener.accept()[0]
            conn.settimeout(30)
            got = b""
            try:
                conn.sendall(b"ok\n")
                while chunk := conn.recv(4096):
                    got += chunk
            except OSError:  # the kernel closed first, or with the "ok" unread
                pass
            os.write(heard_w, got or b"nothing")
        finally:
            os._exit(0)
    os.close(heard_w)
    try:
        wait_until(lambda: os.path.exists(path), 30, "the other user's socket")
        with pytest.raises(
            PermissionError,
            match=rf"^run taken-1's control socket {path} is held by a process of uid 65534, not of this user "
            r"\(uid 0\): the run's token was not sent to it, and the run was not stopped$",
        ):
            torchdist_magic.stop("taken-1")
        os.waitpid(child, 0)
        with os.fdopen(heard_r, "rb") as fh:
            heard = fh.read()
        assert heard == b"nothing" and token.encode() not in heard
    finally:
        try:
            os.kill(child, 9)
            os.waitpid(child, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.unlink(path)
        os.rmdir(directory)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"warm": True}, "detach runs under a process of its own, and a warm pool's ranks belong to this kernel"),
        ({"pdb": True}, "pdb holds a failing rank for a debugger in the cell, and a detached run has no cell"),
        (
            {"backend": "spark"},
            "runs on the active SparkSession \\(classic or Spark Connect\\), and this process has none",
        ),
    ],
)
def test_what_cannot_be_detached_is_refused_before_anything_starts(home, options, message):
    with pytest.raises(ValueError, match=message):
        detached(
            np=1,
            **{k: v for k, v in options.items() if k != "backend"},
            **({"local_mode": False} if "backend" in options else {}),
        ).submit(sleeps)
    assert torchdist_magic.runs() == []


def test_a_detached_run_cannot_train_on_a_dataframe(home):
    pandas = pytest.importorskip("pandas")
    with pytest.raises(ValueError, match="--detach cannot train on a DataFrame"):
        detached(np=1).train_on_dataframe(sleeps, pandas.DataFrame({"x": [1.0, 2.0]}))


def test_what_the_supervising_process_refuses_is_raised_here(home):
    # the supervising process checks the placement (this machine has fewer GPUs than ranks)
    with pytest.raises(ValueError, match="(?i)gpu") as refused:
        detached(np=64, use_gpu=True).submit(sleeps)
    [record] = torchdist_magic.runs()
    assert record.state == "failed" and record.failure == str(refused.value)
    wait_until(lambda: not alive(record.pid), 30, "the supervising process to exit")


def test_attach_refuses_a_run_that_was_not_detached_and_an_unknown_id(home):
    run = Distributor(num_processes=1, show=None).submit(raises_on_rank_1)
    run.wait(60)
    with pytest.raises(ValueError, match=f"run {run.run_id} was not detached: it ran in the kernel"):
        torchdist_magic.attach(run.run_id)
    with pytest.raises(KeyError, match="no run 'nope'"):
        torchdist_magic.attach("nope")


def test_a_detached_run_cannot_be_profiled_from_an_attached_kernel(home):
    handle = detached(np=1).submit(raises_on_rank_1)
    handle.wait(60)
    with pytest.raises(NotAvailable, match="its ranks can be profiled from the start only"):
        handle.start_profile(5)


def test_the_magic_detaches_attaches_and_stops(home, ip, capsys, tmp_path):
    from IPython.core.error import UsageError

    from helpers import cell

    marker = tmp_path / "go"
    ip.user_ns["marker"] = str(marker)
    cell(
        ip,
        """
        %%torchdist --np 2 --local --detach
        import os, time
        print("waiting", flush=True)
        while not os.path.exists(marker):
            time.sleep(0.05)
        rank * 10 + 5
    """,
    )
    handle = ip.user_ns["_torchdist_run"]
    out = capsys.readouterr().out
    assert f"torchdist: detached run {handle.run_id} started (np=2)" in out
    touch(str(marker))
    assert ip.run_line_magic("torchdist", f"attach {handle.run_id}") == 5
    assert "waiting" in handle.logs(1)
    ip.run_line_magic("torchdist", f"stop {handle.run_id}")
    assert capsys.readouterr().out.endswith(f"torchdist: run {handle.run_id} had ended already\n")
    with pytest.raises(UsageError, match="%torchdist attach needs a run id"):
        ip.run_line_magic("torchdist", "attach")
    with pytest.raises(UsageError, match="no run 'nope'"):
        ip.run_line_magic("torchdist", "attach nope")
    with pytest.raises(UsageError, match="and this process has none"):
        cell(ip, "%%torchdist --np 1 --spark --detach\n1").raise_error()
    assert_nothing_survives(handle.run_id, handle.record.pid)


# -- Spark: the supervising process opens a session of its own on the same cluster ----------------


def spark_job():
    from torchdist_magic import rank

    print(f"rank {rank()} on Spark", flush=True)
    return rank() + 40


@pytest.mark.spark
def test_a_detached_run_on_classic_local2(home, spark_local2):
    handle = detached(local_mode=False).submit(spark_job)
    assert handle.result(240) == 40
    assert handle.logs(1) == "rank 1 on Spark\n"
    record = history.read_record(handle.run_id)
    assert record.state == "succeeded" and record.detached and record.backend.startswith("Spark")
    assert_nothing_survives(handle.run_id, handle.record.pid)


@pytest.mark.spark
def test_a_detached_run_on_spark_connect_uses_the_same_remote(home, spark_connect):
    target = supervisor.spark_target(spark_connect)
    assert target["kind"] == "connect" and target["remote"].startswith("sc://") and "session_id" not in target["remote"]
    handle = detached(local_mode=False).submit(spark_job)
    assert handle.result(240) == 40
    assert "rank 0 on Spark" in handle.logs(0)
    assert history.read_record(handle.run_id).state == "succeeded"
    assert_nothing_survives(handle.run_id, handle.record.pid)


@pytest.mark.spark
def test_classic_spark_whose_context_belongs_to_the_notebook_is_refused(home, spark_local2, monkeypatch):
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    with pytest.raises(ValueError, match="this cluster's one SparkContext belongs to the notebook .*Spark Connect"):
        detached(local_mode=False).submit(spark_job)
    assert torchdist_magic.runs() == []


@pytest.mark.spark
def test_stop_ends_a_detached_run_on_classic_local2(home, spark_local2):
    handle = detached(local_mode=False).submit(sleeps)
    wait_until(lambda: "sleeping" in handle.logs(1), 240, "rank 1 to sleep")
    assert torchdist_magic.stop(handle.run_id, by="a test") is True
    with pytest.raises(RunCancelled, match="stopped by a test"):
        handle.result(120)
    assert history.read_record(handle.run_id).state == "cancelled"
    assert_nothing_survives(handle.run_id, handle.record.pid)


def fails_once_then_returns():
    from torchdist_magic import rank, restart_count

    print(f"attempt {restart_count() + 1}", flush=True)
    if restart_count() == 0 and rank() == 1:
        raise RuntimeError("first attempt")
    return restart_count()


def test_a_detached_run_restarts_under_its_supervising_process(home):
    handle = detached(max_restarts=1).submit(fails_once_then_returns)
    assert handle.result(120) == 1
    assert handle.logs(1).startswith("attempt 1\n") and "attempt 2\n" in handle.logs(1)
    assert handle.state.attempt == 2 and handle.state.attempts[0].failure.message == "first attempt"
    assert [rs.state for rs in handle.state.snapshot().ranks] == ["done", "done"]
    record = history.read_record(handle.run_id)
    assert record.state == "succeeded" and record.options["max_restarts"] == 1
    assert_nothing_survives(handle.run_id, handle.record.pid)


def test_a_full_journal_is_said_by_the_kernel_that_attaches(home, monkeypatch, capsys):
    """The journal's bound, on a journal written here (``Journal`` is the supervising process's)
    and a run's end as its supervising process leaves it."""
    from torchdist_magic.core import values

    monkeypatch.setattr(supervisor, "JOURNAL_MAX_BYTES", 200)
    directory = history.record_directory("full-1")
    journal = supervisor.Journal(directory)
    for i in range(10):
        journal.put(events.Log(rank=0, stream="stdout", line=f"line {i}"))
    journal.close()
    assert os.path.exists(os.path.join(directory, layout.JOURNAL_FULL_FILE))
    values.dump(7, os.path.join(directory, layout.VALUE_FILE))
    history.RunRecord(
        run_id="full-1",
        state="succeeded",
        outcome="succeeded",
        started=1.0,
        ended=2.0,
        detached=True,
        has_value=True,
        directory=directory,
    ).save()
    history.write_private(os.path.join(directory, layout.DONE_FILE), "succeeded")
    handle = torchdist_magic.attach("full-1")
    assert attaching.follow_attached(handle) == 7
    assert capsys.readouterr().out == (
        "torchdist: the run's journal was full: this view lacks its later records; "
        "the record has its end and the tails of its logs\n"
    )
    assert 0 < handle.logs(0).count("\n") < 10


def test_a_supervising_process_that_cannot_start_is_said_with_its_output(home, monkeypatch):
    import sys

    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(
        RuntimeError,
        match=r"the supervising process of detached run \S+ did not start it "
        r"\(exit code 1\); its output is in .*supervisor\.log",
    ):
        detached(np=1).submit(sleeps)


def test_an_interrupted_attach_stops_following_not_the_run(home, capsys):
    class Interrupting:
        def update(self):
            raise KeyboardInterrupt

        def close(self):
            pass

    handle = detached(np=1).submit(sleeps)
    try:
        with pytest.raises(KeyboardInterrupt):
            attaching.follow_attached(torchdist_magic.attach(handle.run_id), Interrupting())
        assert capsys.readouterr().out == (
            f"torchdist: stopped following run {handle.run_id}, which goes on (%torchdist attach {handle.run_id} "
            f"follows it again, %torchdist stop {handle.run_id} stops it)\n"
        )
        assert history.read_record(handle.run_id).state == "running"
    finally:
        handle.cancel()
        assert handle.wait(60)  # a handle that stopped following still says when the run ends
    assert_nothing_survives(handle.run_id, handle.record.pid)


def test_attach_and_stop_take_one_run_id(home, ip):
    from IPython.core.error import UsageError

    with pytest.raises(
        UsageError, match="%torchdist stop needs one run id \\(%torchdist runs lists them\\), got 'a b'"
    ):
        ip.run_line_magic("torchdist", "stop a b")


def returns_seven():
    return 7


def test_a_value_nobody_took_expires_and_the_record_says_when(home, monkeypatch):
    handle = detached().submit(returns_seven)
    assert handle.wait(60)
    record = history.read_record(handle.run_id)
    assert record.has_value and os.path.exists(os.path.join(record.directory, layout.VALUE_FILE))
    monkeypatch.setenv(history.VALUE_DAYS_ENV, "2")
    assert history.prune(now=record.ended + 86400) == []  # a day on: still there
    assert os.path.exists(os.path.join(record.directory, layout.VALUE_FILE))
    assert history.prune(now=record.ended + 3 * 86400) == []  # the record stays, its value goes
    assert not os.path.exists(os.path.join(record.directory, layout.VALUE_FILE))
    with pytest.raises(
        history.ValueGone,
        match=f"^rank 0's value of run {handle.run_id} expired at .*, TORCHDIST_VALUE_DAYS after the run ended$",
    ):
        attaching.AttachedRun(handle.run_id).result(10)
    assert_nothing_survives(handle.run_id, handle.record.pid)
