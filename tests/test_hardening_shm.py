"""Hardening, second pass (issue 41, findings 1 and 3): a machine's copy of the notebook values
and this user's directories of fixed names, against another user of the same machine.

That other user is real: a process this test forks, which takes uid 65534 (``nobody``) before it
makes a directory, plants a file or holds a lock.  The runs are real too: ranks started by
command lines (``tests/shell_backend.py``) that fetch the values from the driver's channel as on
a cluster (``TORCHDIST_VALUES_FETCH=1``).  What happens in ``/dev/shm`` happens in a tmpfs of the
test's own, in a mount namespace of its own (``unshare``, as ``test_values`` does for a full
``/dev/shm``): a directory there that the other user made goes with it, whatever the test's
outcome, and no other test session sees it."""

import json
import os
import re
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import pytest

from helpers import OTHER_UID, as_other_user
from helpers import end_other_user as end
from torchdist_magic.core import privdir, values
from torchdist_magic.core.names import VALUES_COPY_ENV

HERE = os.path.dirname(os.path.abspath(__file__))


def _unshare_flags():
    """``unshare -m`` where it gives a process a mount of its own (as root), or ``None``."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("unshare"):
        return None
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return ["-m"] if probe.returncode == 0 else None


UNSHARE = _unshare_flags()
NEEDS_UNSHARE = pytest.mark.skipif(
    UNSHARE is None, reason="another user's /dev/shm directory needs root and a mount of its own (unshare)"
)
NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a process of another user")


@pytest.fixture(autouse=True)
def _each_refusal_said_again():
    """Each test sees the line of a refused directory, which a process says once."""
    privdir._refused_said.clear()
    yield
    privdir._refused_said.clear()


# -- the run, in a mount namespace of its own --------------------------------------------------

#: a driver in a mount namespace whose /dev/shm is a 64 MiB tmpfs of its own: another user (a
#: forked process of uid 65534) makes /dev/shm/torchdist-<uid> first (``block``), and plants in it
#: a blob of the copy's name and size with bytes of its own (``plant``), which it may hold
#: ``LOCK_EX`` on (``lock``); then two ranks, started by command lines, each fetch the values (a
#: NumPy array of ``mib`` MiB) from the driver as on a cluster, and return their sum.  Prints one
#: JSON line: the ranks' sums, the real one, rank 0's log, what is left in /dev/shm and in the
#: temporary directory afterwards.
ATTACKED_RUN = r"""
import fcntl, json, os, struct, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from helpers import as_other_user, assert_no_survivors, end_other_user as end
from shell_backend import ShellBackend
from torchdist_magic import Distributor, RankFailure, register_backend
from torchdist_magic.core import values
from torchdist_magic.driver.distributor import submit

mib, block, plant, lock = int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1", sys.argv[5] == "1"
register_backend("shell", ShellBackend)
array = np.arange(mib * 2**20 // 8, dtype=np.int64)
run_id = "attacked-1"
name = f"torchdist-{run_id}-values-{os.getpid()}-copy"  # what the guard's argv shows
mine = os.path.join("/dev/shm", f"torchdist-{os.geteuid()}")

def other_user():
    os.mkdir(mine, 0o700)
    if not plant:
        return
    fd = os.open(os.path.join(mine, name), os.O_RDWR | os.O_CREAT, 0o644)
    text = json.dumps({"pickle": 0, "buffers": [array.nbytes]}).encode()  # a blob's header
    head = values.MAGIC + struct.pack("<Q", len(text)) + text
    size = len(head) + values._pad(len(head)) + values._pad(len(head) + values._pad(len(head))) + array.nbytes
    os.write(fd, head)
    os.ftruncate(fd, size)
    os.pwrite(fd, b"\x41" * array.nbytes, size - array.nbytes)  # the other user's "tensors"
    if lock:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held while it lives

def total(a):
    return int(a.sum())

attacker = as_other_user(other_user) if block else None
try:
    dist = Distributor(2, backend="shell", show=None)
    run = submit(total, (array,), {}, dist.options, run_id=run_id)
    try:
        sums = run.result(timeout=120)
        sums = [sums]
    except RankFailure as exc:
        sums = [f"{exc.exc_type}: {exc.message}"]
    except TimeoutError:
        sums = ["no result within 120 s"]
        run.cancel()
        run.wait(60)
    logs = run.logs(0)
    assert_no_survivors(run, wait=30)
    deadline = time.monotonic() + 30  # the launchers' guards remove the machine's copy when they end
    left = lambda: sorted(n for n in os.listdir("/dev/shm") if n != os.path.basename(mine) or not block)
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    tmp = os.environ["TMPDIR"]
    print(json.dumps({
        "sums": sums,
        "real": int(array.sum()),
        "log": logs,
        "shm": left(),
        "ours in shm": sorted(os.listdir(mine)) if block and os.path.isdir(mine) else [],
        "tmp": sorted(os.path.relpath(os.path.join(d, n), tmp) for d, ds, fs in os.walk(tmp) for n in ds + fs),
    }))
finally:
    if attacker is not None:
        end(attacker)
"""


def attacked_run(tmp_path, mib, block, plant=False, lock=False):
    """What ``ATTACKED_RUN`` prints, run in a mount namespace of its own (its /dev/shm a 64 MiB
    tmpfs, which another user's directory in it goes with)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = f'mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && exec {sys.executable} -c "$0" "$@"'
    flags = [str(mib)] + ["1" if x else "0" for x in (block, plant, lock)]
    done = subprocess.run(
        ["unshare", *UNSHARE, "sh", "-c", script, ATTACKED_RUN, HERE, *flags],
        capture_output=True,
        text=True,
        timeout=400,
        env={
            **os.environ,
            "PYTHONPATH": os.path.dirname(HERE),
            "TMPDIR": str(tmp),
            "TORCHDIST_VALUES_FETCH": "1",
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@NEEDS_UNSHARE
@pytest.mark.parametrize("lock", [False, True], ids=["planted", "planted-and-locked"])
def test_a_rank_maps_only_the_copy_its_launcher_fetched(tmp_path, lock):
    # the review's shape: 40 MiB of values take more than half of a 64 MiB /dev/shm, so each
    # machine's copy goes to its temporary directory; another user made /dev/shm/torchdist-0,
    # where a rank looked first, and put a blob of the copy's name there (its "tensors" all 0x41):
    # before, every rank mapped it, or, with that user's LOCK_EX on it, waited in flock forever
    got = attacked_run(tmp_path, mib=40, block=True, plant=True, lock=lock)
    assert got["sums"] == [got["real"]], got["log"]
    assert re.search(r"notebook values: 40\.0 MiB (fetched from the driver|mapped)", got["log"])
    assert got["shm"] == [] and got["tmp"] == [f"torchdist-{os.geteuid()}"]  # the copy went with the run


@NEEDS_UNSHARE
def test_a_shared_memory_directory_another_user_made_is_refused_and_the_run_uses_its_own(tmp_path):
    # 2 MiB of values fit /dev/shm, where another user made this user's directory first: before,
    # every rank failed ("not this user's private directory"); now the machine's launchers share
    # a copy in a directory of the run's own (named by its secret), said in each rank's log, and
    # gone with the run
    got = attacked_run(tmp_path, mib=2, block=True)
    assert got["sums"] == [got["real"]], got["log"]
    uid = os.geteuid()
    said = re.search(
        rf"\[torchdist\] /dev/shm/torchdist-{uid} is not this user's private directory \(owned by uid "
        rf"{OTHER_UID}, not {uid}\): another user of this machine may have made it; torchdist_magic will not "
        rf"use it\. Remove it, or point TMPDIR elsewhere\. Meanwhile it uses (/dev/shm/torchdist-{uid}-[0-9a-f]+) "
        r"instead, a private directory of this user's\n",
        got["log"],
    )
    assert said, got["log"]
    assert "notebook values: 2.0 MiB" in got["log"]
    assert got["shm"] == [] and got["ours in shm"] == []  # the run's own directory went with it
    assert got["tmp"] == []


# -- the rank's checks of the copy it is handed ------------------------------------------------


def _copy(directory, array, name="torchdist-t-values-1-copy"):
    """A copy of the values (one buffer, ``array``) as a launcher fetches it into ``directory``."""
    _, buffers = values.pickled_apart({"a": array})
    src = directory / "src"
    src.mkdir(mode=0o700)
    path = buffers.in_file(str(src)).path
    copy = directory / name
    os.rename(path, copy)
    src.rmdir()
    loaded = values.Buffers([], host_copy=name)
    loaded.sizes = buffers.sizes
    return str(copy), loaded


def test_a_rank_maps_the_copy_it_is_handed_and_refuses_one_that_is_not_the_jobs(tmp_path, monkeypatch):
    array = np.arange(2**17, dtype=np.int64)
    folder = tmp_path / "copies"
    folder.mkdir(mode=0o700)
    copy, loaded = _copy(folder, array)
    monkeypatch.setenv(VALUES_COPY_ENV, copy)
    assert (np.frombuffer(loaded.load()[0], dtype=np.int64) == array).all()

    def refused(why):
        return pytest.raises(
            privdir.UnsafePath,
            match=rf"^{re.escape(copy)} is not the copy of the notebook values this rank's launcher fetched "
            rf"\({why}\); it is not mapped$",
        )

    with open(copy, "r+b") as fh:  # the job's size, another header (its buffer split in two)
        head = values._header_of(0, [array.nbytes // 2, array.nbytes // 2])
        fh.write(head)
    with refused("its header is not the one of the job's values"):
        loaded.load()
    os.truncate(copy, os.path.getsize(copy) + 64)
    with refused(rf"{os.path.getsize(copy)} bytes where the job's values take {os.path.getsize(copy) - 64}"):
        loaded.load()
    os.unlink(copy)
    os.mkfifo(copy)  # what would keep a rank waiting in open() were it not opened without waiting
    with refused(r"not a regular file, 0 bytes where the job's values take \d+"):
        loaded.load()
    os.unlink(copy)
    os.symlink(tmp_path / "elsewhere", copy)
    with pytest.raises(privdir.UnsafePath, match=r"is a symbolic link where torchdist_magic keeps a file"):
        loaded.load()
    os.unlink(copy)
    monkeypatch.setenv(VALUES_COPY_ENV, str(folder / "another-copy"))
    with pytest.raises(
        privdir.UnsafePath,
        match=(
            r"^the notebook values sent to the ranks are torchdist-t-values-1-copy, and this rank's launcher "
            rf"named {re.escape(str(folder / 'another-copy'))}; it is not mapped$"
        ),
    ):
        loaded.load()
    folder.chmod(0o755)
    monkeypatch.setenv(VALUES_COPY_ENV, copy)
    with pytest.raises(privdir.UnsafePath, match=r"is not this user's private directory \(mode 0755"):
        loaded.load()


@NEEDS_ROOT
def test_a_copy_of_another_user_is_not_mapped(tmp_path, monkeypatch):
    array = np.arange(2**17, dtype=np.int64)
    folder = tmp_path / "copies"
    folder.mkdir(mode=0o700)
    copy, loaded = _copy(folder, array)
    os.chown(copy, OTHER_UID, OTHER_UID)  # what another user's file would be, of the right size and header
    monkeypatch.setenv(VALUES_COPY_ENV, copy)
    with pytest.raises(
        privdir.UnsafePath,
        match=rf"\(owned by uid {OTHER_UID}, not {os.geteuid()}\); it is not mapped$",
    ):
        loaded.load()


# -- this user's directories of fixed names ------------------------------------------------------


@pytest.fixture
def shared_tmp(monkeypatch):
    """A temporary directory that every user may write, as ``/tmp`` is (mode 1777), made this
    test's temporary directory (``tempfile`` and ``TMPDIR``); removed afterwards, with what
    another user made in it."""
    import shutil

    folder = tempfile.mkdtemp(prefix="torchdist-test-shared-", dir="/tmp")
    os.chmod(folder, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    monkeypatch.setenv("TMPDIR", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def made_by_other_user(path):
    """``path``, made by another user (uid ``OTHER_UID``, mode 0700)."""
    end(as_other_user(os.mkdir, path, 0o700))
    assert os.stat(path).st_uid == OTHER_UID
    return path


def refusal(refused, fallback):
    uid = os.geteuid()
    return (
        rf"^{re.escape(refused)} is not this user's private directory \(owned by uid {OTHER_UID}, not {uid}\): "
        r"another user of this machine may have made it; torchdist_magic will not use it\. Remove it, or point "
        rf"TMPDIR elsewhere\. Meanwhile it uses {fallback} instead, a private directory of this user's$"
    )


@NEEDS_ROOT
def test_a_directory_another_user_made_gets_a_private_fallback_said_once(shared_tmp, monkeypatch, tmp_path):
    monkeypatch.delenv(privdir.RUNTIME_DIR_ENV, raising=False)
    blocked = made_by_other_user(privdir.user_path(shared_tmp))
    with pytest.warns(privdir.PrivateDirectoryRefused, match=refusal(blocked, rf"{re.escape(blocked)}-\w+")):
        fallback = privdir.usable_user_directory(shared_tmp)
    assert os.path.dirname(fallback) == shared_tmp and privdir.is_fallback(fallback)
    assert privdir.check_private(fallback) == fallback
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        again = privdir.usable_user_directory(shared_tmp)
    assert again != fallback and privdir.is_fallback(again)  # a new one, recorded by who uses it
    for made in (fallback, again):
        privdir.remove_fallback(made)
        assert not os.path.exists(made)
    # the runtime directory of this user, where it is private, is the fallback, and stays
    privdir._refused_said.clear()
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv(privdir.RUNTIME_DIR_ENV, str(runtime))
    with pytest.warns(privdir.PrivateDirectoryRefused, match=refusal(blocked, re.escape(str(runtime / "torchdist")))):
        assert privdir.usable_user_directory(shared_tmp) == str(runtime / "torchdist")
    assert not privdir.is_fallback(str(runtime / "torchdist"))
    # ... and not where it is open to others
    privdir._refused_said.clear()
    runtime.chmod(0o755)
    with pytest.warns(privdir.PrivateDirectoryRefused):
        fallback = privdir.usable_user_directory(shared_tmp)
    assert os.path.dirname(fallback) == shared_tmp
    privdir.remove_fallback(fallback)
    # processes that must meet derive one name: the same for each of them, said through ``say``
    privdir._refused_said.clear()
    said = []
    agreed = privdir.usable_user_directory(shared_tmp, agreed="0123abcd", say=said.append)
    assert agreed == f"{blocked}-0123abcd" and privdir.usable_user_directory(shared_tmp, agreed="0123abcd") == agreed
    assert len(said) == 1 and re.match(refusal(blocked, re.escape(agreed)), said[0])
    privdir.remove_fallback(agreed)


@NEEDS_ROOT
@pytest.mark.parametrize("options", [{"detach": True}, {"channel": "process"}], ids=["detach", "channel-process"])
def test_a_supervised_run_whose_temporary_directory_another_user_made_runs_with_a_fallback(home, shared_tmp, options):
    from helpers import assert_no_survivors
    from torchdist_magic import Distributor

    blocked = made_by_other_user(privdir.user_path(shared_tmp))
    # before, --detach and --channel process failed here: no place for the control socket
    with pytest.warns(privdir.PrivateDirectoryRefused, match=refusal(blocked, rf"{re.escape(blocked)}-\w+")):
        run = Distributor(2, local_mode=True, show=None, **options).submit(lambda: 42)
    control = run.record.control
    assert os.path.dirname(control).startswith(f"{blocked}-")
    assert run.result(timeout=120) == 42
    assert_no_survivors(run)
    from helpers import wait_until

    # the supervising process removes its socket and the fallback directory when it ends
    wait_until(lambda: os.listdir(shared_tmp) == [os.path.basename(blocked)], 30, "the fallback to go")


PIP_CELL = """
    %%torchdist --np 2 --local --timeout 120 --env TMPDIR={shared}
    %pip install --no-index --no-deps --disable-pip-version-check --target {{target}} {{wheel}}
    import sys
    sys.path.insert(0, target)
    import torchdist_tiny_blocked as tiny
    tiny.VALUE
"""


@NEEDS_ROOT
def test_pip_on_ranks_whose_temporary_directory_another_user_made_runs_once_in_the_runs_own(ip, shared_tmp, tmp_path):
    from helpers import cell
    from test_ipython_syntax import tiny_wheel

    blocked = made_by_other_user(privdir.user_path(shared_tmp))
    ip.user_ns.update(target=str(tmp_path / "site"), wheel=str(tiny_wheel(tmp_path, "torchdist_tiny_blocked")))
    result = cell(ip, PIP_CELL.format(shared=shared_tmp))
    run = ip.user_ns["_torchdist_run"]
    logs = [run.logs(r) for r in range(2)]
    assert result.error_in_exec is None, logs  # before, %pip failed on every rank: "not ... private"
    assert result.result == 41
    installed = [r for r, log in enumerate(logs) if "Successfully installed torchdist-tiny-blocked-0.1" in log]
    assert len(installed) == 1, logs  # once for the host: both ranks met in the run's own directory
    pattern = refusal(blocked, rf"{re.escape(blocked)}-[0-9a-f]{{24}}")
    for log in logs:  # each rank says it, once, in its log
        said = [line[len("[torchdist] ") :] for line in log.splitlines() if line.startswith("[torchdist] ")]
        assert len([line for line in said if re.match(pattern, line)]) == 1, log
    assert os.listdir(shared_tmp) == [os.path.basename(blocked)]  # the run's own directory went with the last rank
