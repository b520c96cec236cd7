"""Hardening, second pass (issue 41): the history's home and what is read back from it, secrets
at rest, records of another host, what a killed supervising process leaves.  Another local user
is a real second uid (65534, in a forked child: the tests run as root, as CI does); runs are real
detached runs, their supervising processes real processes killed by pid."""

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

import torchdist_magic
from torchdist_magic import Distributor
from torchdist_magic.core import privdir, values
from torchdist_magic.core.options import LaunchOptions
from torchdist_magic.driver import history, layout
from torchdist_magic.supervise import supervisor

from helpers import assert_nothing_survives, pids_of_run, touch, wait_until

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a second user's files and directories")

OTHER_UID = 65534


def as_other_user(directory, action):
    """Run ``action()`` in a forked child of uid ``OTHER_UID`` whose working directory is
    ``directory`` (entered as root: the child needs no way there of its own)."""
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.chdir(directory)
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            action()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


class LeavesAMark:
    """Unpickled, it makes the directory it names: proof that a pickle was loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def write_file(name, data):
    with open(name, "wb") as fh:
        fh.write(data)


def open_to_everyone(path):
    path.mkdir()
    path.chmod(0o777)  # the other user may write here, not reach what is above
    return path


# -- the home: checked as ssh's StrictModes checks a path -----------------------------------------


@needs_root
def test_a_home_under_a_directory_another_user_owns_is_refused_naming_it(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)  # they may rename our home away and put theirs there
    monkeypatch.setenv(history.HOME_ENV, str(theirs / "home"))
    with pytest.raises(
        privdir.UnsafePath,
        match=rf"^{re.escape(str(theirs))}, a directory above {re.escape(str(theirs))}/home, is owned by uid "
        rf"{OTHER_UID}: another user of this machine could swap what is below it",
    ):
        torchdist_magic.runs()
    assert not (theirs / "home").exists()  # refused before anything was made there


def test_a_home_under_a_directory_anyone_may_write_is_refused_and_a_sticky_one_of_roots_is_not(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "project").mkdir(mode=0o755)  # safe itself, under an unsafe one: every ancestor counts
    monkeypatch.setenv(history.HOME_ENV, str(shared / "project" / "home"))
    with pytest.raises(
        privdir.UnsafePath,
        match=rf"^{re.escape(str(shared))}, a directory above {re.escape(str(shared))}/project/home, is mode "
        r"0777, writable by other users: .* \(or root's and sticky, as /tmp\)\. TORCHDIST_HOME says where the "
        r"history of runs is kept$",
    ):
        history.home()
    if os.geteuid() == 0:  # a sticky directory of root's: others cannot rename what is ours in it
        shared.chmod(0o1777)
        assert history.home() == str(shared / "project" / "home")


@needs_root
def test_a_home_under_a_directory_its_group_may_write_is_refused_unless_the_group_is_this_users_alone(
    tmp_path, monkeypatch
):
    project = tmp_path / "project"
    project.mkdir()
    os.chown(project, 0, 65534)  # group nogroup: the primary group of another account (nobody)
    project.chmod(0o2775)
    monkeypatch.setenv(history.HOME_ENV, str(project / "home"))
    assert not privdir.group_is_only_mine(65534)
    with pytest.raises(
        privdir.UnsafePath, match=rf"^{re.escape(str(project))}, a directory above .* is mode 2775, writable by other"
    ):
        history.home()
    # root's own group, no other account in it: a single-user container's group-writable home
    os.chown(project, 0, 0)
    assert privdir.group_is_only_mine(0)
    assert history.home() == str(project / "home")


def test_a_home_under_a_file_is_refused_naming_it(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(history.HOME_ENV, str(tmp_path / "a-file" / "home"))
    with pytest.raises(
        privdir.UnsafePath, match=rf"^{re.escape(str(tmp_path))}/a-file, a directory above .* is not a directory:"
    ):
        history.home()


def test_a_home_reached_through_a_link_is_used_where_it_is(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    monkeypatch.setenv(history.HOME_ENV, str(tmp_path / "link" / "home"))
    # the records' paths are the checked ones: swapping the link later changes nothing
    assert history.home() == str(tmp_path / "real" / "home")


# -- what is read back from a run's directory: checked on the open file ---------------------------


@needs_root
def test_take_value_refuses_a_value_another_user_put_in_its_place_and_never_unpickles_it(tmp_path):
    record = open_to_everyone(tmp_path / "record")  # as a swapped home's record would be
    mark = tmp_path / "unpickled"
    blob = bytes(values.dumps(LeavesAMark(str(mark))))
    as_other_user(record, lambda: write_file(layout.VALUE_FILE, blob))
    with pytest.raises(
        privdir.UnsafePath,
        match=rf"value.blob.* is not a file of this user's own \(owned by uid {OTHER_UID}, not 0\): another user",
    ):
        history.take_value(str(record), "run-1")
    assert not mark.exists()
    assert os.stat(record / layout.VALUE_FILE).st_uid == OTHER_UID  # left where it was, untouched


@needs_root
def test_take_value_refuses_a_link_another_user_put_in_its_place(tmp_path):
    record = open_to_everyone(tmp_path / "record")
    mine = tmp_path / "mine.blob"  # a value of this user's elsewhere, which the link would name
    values.dump({"not": "this run's"}, str(mine))
    as_other_user(record, lambda: os.symlink(mine, layout.VALUE_FILE))
    with pytest.raises(privdir.UnsafePath, match=r"value.blob\S* is a symbolic link where torchdist_magic keeps"):
        history.take_value(str(record), "run-1")
    assert os.path.islink(record / layout.VALUE_FILE)


@needs_root
def test_the_supervising_process_refuses_a_job_another_user_put_in_its_place(home, tmp_path):
    """The review's shape: the run's directory, as a swapped home would hold it, with another
    user's ``job.bin``; the supervising process exits saying so, and the job is never loaded."""
    import cloudpickle

    mark = tmp_path / "unpickled"
    directory = history.record_directory("planted-1")
    history.write_private(os.path.join(directory, layout.OPTIONS_FILE), json.dumps({"num_processes": 1}))
    history.write_private(os.path.join(directory, layout.TOKEN_FILE), "t" * 64)
    history.RunRecord(run_id="planted-1", detached=True, pid=os.getpid(), directory=directory).save()
    drop = open_to_everyone(tmp_path / "drop")
    job = cloudpickle.dumps(LeavesAMark(str(mark)))
    as_other_user(drop, lambda: write_file("job.bin", job))
    os.rename(drop / "job.bin", os.path.join(directory, layout.JOB_FILE))  # swapped in, owner kept
    done = subprocess.run(
        [sys.executable, "-m", "torchdist_magic.supervise.supervisor", directory],
        input=json.dumps({"env": {}, "spark": None}).encode(),
        capture_output=True,
        timeout=120,
    )
    assert not mark.exists()
    assert done.returncode == 1
    assert done.stderr.decode() == (
        f"torchdist: {directory}/job.bin is not a file of this user's own (owned by uid {OTHER_UID}, not 0): "
        "another user of this machine may have put it there; torchdist_magic will not read it\n"
    )


def test_the_supervising_process_started_by_hand_says_how_it_is_started(home):
    directory = history.record_directory("by-hand-1")
    done = subprocess.run(
        [sys.executable, "-m", "torchdist_magic.supervise.supervisor", directory],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.decode() == (
        "torchdist: the supervising process of a detached run takes what its kernel hands it on its "
        "standard input (Expecting value: line 1 column 1 (char 0)); it is started by --detach, not by hand\n"
    )


def test_a_files_owner_type_and_mode_are_checked_on_the_open_descriptor(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # opened without blocking, then refused
    with pytest.raises(privdir.UnsafePath, match=r"fifo is not a file of this user's own \(not a regular file\)"):
        privdir.read_own(str(fifo))
    open_one = tmp_path / "open"
    open_one.write_bytes(b"x")
    open_one.chmod(0o666)
    with pytest.raises(privdir.UnsafePath, match=r"\(mode 0666, writable by other users\)"):
        privdir.read_own(str(open_one))
    open_one.chmod(0o644)
    assert privdir.read_own(str(open_one)) == bytearray(b"x")


# -- secrets at rest --------------------------------------------------------------------------------


SECRET_NAME = "TORCHDIST_TEST_SECRET"


def digest_of_the_secret(marker):
    import hashlib
    import os
    import time

    print("waiting", flush=True)
    while not os.path.exists(marker):
        time.sleep(0.05)
    return hashlib.sha256(os.environ["TORCHDIST_TEST_SECRET"].encode()).hexdigest()


def files_holding(secret, *roots):
    """The regular files under ``roots`` whose bytes hold ``secret``."""
    found = []
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    if not stat.S_ISREG(os.lstat(path).st_mode):
                        continue
                    with open(path, "rb") as fh:
                        if secret.encode() in fh.read():
                            found.append(path)
                except OSError:  # another test session's file, gone meanwhile
                    continue
    return found


def run_files(run_id):
    """Where a run's files may be besides its record: the temporary directories, shared memory."""
    import tempfile

    roots = [tempfile.gettempdir()]
    for parent in ("/tmp", "/dev/shm"):
        if os.path.isdir(parent):
            roots += [os.path.join(parent, n) for n in os.listdir(parent) if run_id in n or n.startswith("torchdist-")]
    return roots


def test_env_values_reach_the_ranks_and_no_file_or_repr(home, tmp_path):
    import hashlib
    import secrets as token_source

    secret = token_source.token_hex(16)
    marker = str(tmp_path / "go")
    handle = Distributor(num_processes=2, show=None, detach=True, env={SECRET_NAME: secret}).submit(
        digest_of_the_secret, marker
    )
    try:
        wait_until(lambda: "waiting" in handle.logs(1), 60, "rank 1 to wait")
        assert files_holding(secret, str(home), *run_files(handle.run_id)) == []  # the options, while it runs
    finally:
        touch(marker)
    assert handle.wait(60)
    value = os.path.join(handle.directory, layout.VALUE_FILE)
    assert stat.S_IMODE(os.stat(value).st_mode) == 0o600  # as every other file of the record
    assert handle.result(10) == hashlib.sha256(secret.encode()).hexdigest()  # the ranks had it
    assert files_holding(secret, str(home), *run_files(handle.run_id)) == []  # the record, logs and all
    record = history.read_record(handle.run_id)
    assert record.options["env"] == {SECRET_NAME: "***"}
    with open(os.path.join(handle.directory, layout.OPTIONS_FILE), encoding="utf-8") as fh:
        assert json.load(fh)["env"] == {SECRET_NAME: "***"}
    assert_nothing_survives(handle.run_id, handle.record.pid)


def test_the_repr_of_options_and_of_a_runs_spec_shows_env_names_not_values():
    from torchdist_magic.core.rankenv import RunSpec

    options = LaunchOptions(num_processes=2, env={"API_KEY": "s3cret-value", "MODE": "fast"})
    spec = RunSpec.resolve(options, "run-1", "127.0.0.1:9", "worker-key", "launcher-key")
    for text in (repr(options), str(options), repr(spec)):
        assert "s3cret-value" not in text and "fast" not in text
        assert "env={'API_KEY': '***', 'MODE': '***'}" in text
    assert repr(options).startswith("LaunchOptions(num_processes=2, min_processes=None, use_gpu=False, backend='auto',")
    assert options.env == {"API_KEY": "s3cret-value", "MODE": "fast"}  # the ranks still get them


def test_a_spark_target_never_reaches_a_file_even_when_the_supervising_process_fails_at_once(home, monkeypatch):
    import secrets as token_source

    from torchdist_magic.core.job import build_job

    monkeypatch.setattr(sys, "executable", "/bin/false")  # it exits before it reads anything
    token = token_source.token_hex(16)  # not in this file's source, which the job carries
    target = {"kind": "connect", "remote": f"sc://spark.example:15002/;token={token};use_ssl=true"}
    with pytest.raises(RuntimeError, match=r"did not start it \(exit code 1\)"):
        supervisor.start_detached(build_job(digest_of_the_secret, ("x",), {}), LaunchOptions(num_processes=1), target)
    [record] = torchdist_magic.runs()
    assert record.state == "failed"
    assert files_holding(token, str(home)) == []


def test_a_value_is_never_written_through_a_link(tmp_path):
    precious = tmp_path / "precious"
    precious.write_bytes(b"the user's file")
    os.symlink(precious, tmp_path / "value.blob")
    with pytest.raises(privdir.UnsafePath, match="value.blob is a symbolic link"):
        values.dump(7, str(tmp_path / "value.blob"))
    assert precious.read_bytes() == b"the user's file"


# -- a record of another host ------------------------------------------------------------------------

#: a pid no process of this host has
NO_SUCH_PID = 2**22 + 12345


def other_hosts_record(run_id, **fields):
    record = history.RunRecord(
        run_id=run_id,
        started=time.time() - 40 * 86400,
        pid=NO_SUCH_PID,
        host="gpu-node-17",
        detached=True,
        control=f"/tmp/torchdist-0/ctl-{run_id}.sock",
        directory=history.record_directory(run_id),
        **fields,
    )
    record.save()
    return record


def test_a_running_record_of_another_host_is_neither_judged_nor_pruned_from_here(home, monkeypatch):
    other_hosts_record("elsewhere-1")
    assert os.uname().nodename != "gpu-node-17"
    [record] = torchdist_magic.runs()
    assert record.state == "running" and record.failure == "" and record.elsewhere
    row = history.runs_table().splitlines()[1]
    assert row.split()[1] == "unknown" and row.endswith("on host gpu-node-17, unknown from here")
    monkeypatch.setenv(history.DAYS_ENV, "1")
    assert history.prune(now=time.time() + 86400) == []  # 40 days old, and still there
    assert [r.run_id for r in torchdist_magic.runs()] == ["elsewhere-1"]
    with pytest.raises(
        ValueError,
        match=r"^run elsewhere-1 is supervised on host gpu-node-17, and its control socket is there: "
        r"stop it from a kernel or terminal on gpu-node-17$",
    ):
        torchdist_magic.stop("elsewhere-1")


def test_a_handle_on_another_hosts_run_waits_for_its_end_not_for_this_hosts_pid(home):
    record = other_hosts_record("elsewhere-2")
    handle = torchdist_magic.attach("elsewhere-2")
    assert not handle.wait(1.0)  # no process of this host has its pid, which says nothing here
    values.dump(42, os.path.join(record.directory, layout.VALUE_FILE))
    record.state, record.outcome, record.ended, record.has_value = "succeeded", "succeeded", time.time(), True
    record.save()
    history.write_private(os.path.join(record.directory, layout.DONE_FILE), "succeeded")
    assert handle.result(30) == 42


# -- what a supervising process killed with SIGKILL leaves ---------------------------------------------


def sleeps():
    import time

    print("sleeping", flush=True)
    time.sleep(600)


@pytest.mark.parametrize("finder", ["runs", "prune"])
def test_whoever_finds_a_supervising_process_killed_with_sigkill_removes_what_it_left(home, finder):
    from torchdist_magic.core.job import build_job

    # no handle: nothing follows the run but what the test calls
    run_id = supervisor.start_detached(build_job(sleeps, (), {}), LaunchOptions(num_processes=2))
    record = history.read_record(run_id)
    token = os.path.join(record.directory, layout.TOKEN_FILE)
    try:
        assert stat.S_ISSOCK(os.lstat(record.control).st_mode) and os.path.exists(token)
        wait_until(lambda: len(pids_of_run(run_id)) >= 2, 60, "the ranks to start")
    finally:
        os.kill(record.pid, signal.SIGKILL)
    wait_until(lambda: not history.process_alive(record.pid), 30, "the supervising process to die")
    assert os.path.lexists(record.control)  # nothing of its own removed it
    {"runs": torchdist_magic.runs, "prune": history.prune}[finder]()
    assert not os.path.lexists(record.control) and not os.path.exists(token)
    found = history.read_record(run_id)
    assert found.state == "failed" and found.failure == (
        f"its supervising process (pid {record.pid}) ended before the run did"
    )
    assert_nothing_survives(run_id, record.pid)


def test_a_process_is_alive_until_it_exits_and_not_when_reaped_between_the_signal_and_the_proc_read(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert history.process_alive(child.pid)
        child.kill()
        wait_until(lambda: not history.process_alive(child.pid), 30, "the killed child to be seen as ended")
        assert os.path.exists(f"/proc/{child.pid}/stat")  # a zombie: not reaped yet, already not alive
    finally:
        child.kill()
        child.wait()
    assert not history.process_alive(child.pid)

    # the zombie reaped after the signal found it and before its /proc entry is read (as happened
    # under a full test run): gone, not "alive because /proc could not be read"
    from torchdist_magic.core import procs

    real_open = open

    def reaped(path, *args, **kwargs):
        if str(path) == f"/proc/{os.getpid()}/stat":
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(procs, "open", reaped, raising=False)
    assert not history.process_alive(os.getpid())


def test_a_socket_a_record_names_is_removed_only_when_it_is_this_runs_and_this_users(home, tmp_path):
    import socket

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)  # not a private directory
    bound = []
    for path in (elsewhere / "ctl-dead-1.sock", tmp_path / "private" / "ctl-another-run.sock"):
        path.parent.mkdir(mode=0o700, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        bound.append(sock)
    for run_id, control in (("dead-1", bound[0]), ("dead-2", bound[1])):
        history.RunRecord(
            run_id=run_id,
            pid=NO_SUCH_PID,
            host=os.uname().nodename,
            detached=True,
            control=control.getsockname(),
            directory=history.record_directory(run_id),
        ).save()
    assert {r.state for r in torchdist_magic.runs()} == {"failed"}
    assert all(os.path.exists(sock.getsockname()) for sock in bound)  # neither was the run's own
    for sock in bound:
        sock.close()
