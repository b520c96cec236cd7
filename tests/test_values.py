"""Values at memory speed: one blob, its pickle stream and its large buffers apart; the loaded
tensors are views into it; rank 0's value of several GiB comes back from local processes; large
values come back from Spark; large notebook values reach the ranks."""

import os
import pickle
import re

import numpy as np
import pytest
import torch

from helpers import assert_no_survivors, assert_nothing_left
from torchdist_magic import Distributor
from torchdist_magic.core import values

GIB = 2**30


def test_a_value_round_trips_with_its_tensors_arrays_and_functions(tmp_path):
    weight = torch.randn(3, 4)
    value = {
        "weight": weight,
        "tied": weight,
        "param": torch.nn.Parameter(torch.ones(2)),
        "bf16": torch.arange(5, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.0),
        "empty": torch.empty(0, 3),
        "view": torch.arange(10)[2:5],
        "array": np.arange(6.0).reshape(2, 3),
        "fn": lambda x: x + 1,
        "grad": torch.ones(2, requires_grad=True),
    }
    path = str(tmp_path / "value")
    values.dump(value, path)
    for back in (values.loads(values.read(path)), values.loads(values.dumps(value))):
        assert back["tied"] is back["weight"] and torch.equal(back["weight"], weight)
        assert isinstance(back["param"], torch.nn.Parameter) and back["param"].requires_grad
        assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], value["bf16"])
        assert back["scalar"].shape == () and back["scalar"].item() == 3.0
        assert back["empty"].shape == (0, 3)
        assert torch.equal(back["view"], torch.tensor([2, 3, 4]))
        assert (back["array"] == value["array"]).all() and back["array"].shape == (2, 3)
        assert back["fn"](1) == 2 and back["grad"].requires_grad


def test_large_buffers_travel_apart_and_load_as_views_into_the_blob():
    big = torch.arange(2**20, dtype=torch.float32)
    blob = bytearray(values.dumps({"big": big}))
    assert len(blob) < big.nbytes + 4096  # the bytes once, plus a small pickle stream
    back = values.loads(blob)["big"]
    start = bytes(blob).find(big.numpy().tobytes()[:64])
    assert start > 0 and start % values.ALIGN == 0
    blob[start : start + 4] = np.float32(-1.0).tobytes()  # the tensor is a view into the blob
    assert back[0].item() == -1.0


def test_a_view_keeps_torchs_pickling_which_keeps_the_sharing():
    base = torch.arange(10.0)
    back = values.loads(values.dumps({"base": base, "half": base[:5]}))
    back["half"][0] = 99.0
    assert back["base"][0].item() == 99.0


def test_what_is_not_a_value_blob_is_refused():
    with pytest.raises(ValueError, match="^not a torchdist value: the blob does not start with its mark$"):
        values.loads(pickle.dumps(1))


def test_many_small_buffers_and_one_large_one_load_back_both_ways(tmp_path):
    """Each part at its aligned place, in a file as in memory (``dumps``); so too for the values
    sent to the ranks (``Buffers.in_file`` writes into the file it made)."""
    value = {f"small{i}": torch.full((i % 37 + 1,), float(i)) for i in range(500)}
    value["large"] = torch.arange(3 * 2**20, dtype=torch.float64)
    value["bytes"] = np.frombuffer(os.urandom(1001), dtype=np.uint8)
    path = str(tmp_path / "value")
    values.dump(value, path)
    with open(path, "rb") as fh:
        assert fh.read() == values.dumps(value)
    stream, buffers = values.pickled_apart(value)
    for back in (values.loads(values.read(path)), values.loads_apart(stream, buffers.in_file(str(tmp_path)))):
        assert sorted(back) == sorted(value)
        assert all(torch.equal(back[k], v) for k, v in value.items() if k != "bytes")
        assert (back["bytes"] == value["bytes"]).all()


def _unshare_flags():
    """The ``unshare`` flags that give a process a mount of its own here (as root, or in a user
    namespace), or ``None``."""
    import shutil
    import subprocess

    for flags in (["-m"], ["-rm"]):
        if (
            shutil.which("unshare")
            and subprocess.run(
                ["unshare", *flags, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True
            ).returncode
            == 0
        ):
            return flags
    return None


UNSHARE = _unshare_flags()

FULL_SHM_RUN = """
import os, sys
sys.path.insert(0, sys.argv[1])
from helpers import assert_no_survivors
from torchdist_magic import Distributor
from torchdist_magic.core.errors import RankFailure

def value_of(size):
    import torch
    from torchdist_magic import rank
    return torch.full((size // 4,), 7.0) if rank() == 0 else None

run = Distributor(2, local_mode=True, show=None).submit(value_of, int(sys.argv[2]))
try:
    value = run.result(timeout=300)
except RankFailure as exc:
    print(exc.exc_type, exc.message, sep="\\n")
else:
    shm = os.statvfs("/dev/shm")
    print(value.numel() * 4, bool((value == 7.0).all()), shm.f_blocks * shm.f_frsize)
assert_no_survivors(run)
"""


#: rank 0's value in ``FULL_SHM_RUN``: more than the 8 MiB of its small mounts
FULL_SHM_VALUE = 32 * 2**20


def _run_with_small_mounts(tmp: bool) -> str:
    """What ``FULL_SHM_RUN`` prints where /dev/shm (and with ``tmp`` the temporary directory,
    where the ranks' result dirs are) is an 8 MiB tmpfs of its own: a private mount, in a
    process this test starts."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    mounts = "mount -t tmpfs -o size=8m tmpfs /dev/shm"
    if tmp:
        mounts += " && mount -t tmpfs -o size=8m tmpfs /mnt && export TMPDIR=/mnt"
    script = f'{mounts} && exec {sys.executable} -c "$0" "$@"'
    done = subprocess.run(
        ["unshare", *UNSHARE, "sh", "-c", script, FULL_SHM_RUN, tests, str(FULL_SHM_VALUE)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.path.dirname(tests)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(UNSHARE is None, reason="a full /dev/shm needs a mount of its own (unshare)")
def test_a_value_too_large_for_shared_memory_comes_back_through_the_result_dir():
    """Rank 0's value fills the ranks' /dev/shm (ENOSPC) and comes back from its result dir."""
    assert _run_with_small_mounts(tmp=False).split() == [str(FULL_SHM_VALUE), "True", str(8 * 2**20)]


@pytest.mark.skipif(UNSHARE is None, reason="a full /dev/shm needs a mount of its own (unshare)")
def test_a_value_too_large_for_both_places_is_the_ranks_failure():
    exc_type, message = _run_with_small_mounts(tmp=True).splitlines()
    assert exc_type == "OSError"
    assert re.fullmatch(
        r"the value of rank 0 could not be written to /mnt/torchdist-[^/]+/rank-0/result\.pkl: "
        r"\[Errno 28\] No space left on device",
        message,
    ), message


def rank0_value_of(size):
    import torch

    from torchdist_magic import rank

    return torch.full((size // 4,), 7.0) if rank() == 0 else None


def test_a_value_over_4_gib_comes_back_from_local_processes():
    size = 4 * GIB + 64 * 2**20  # past 4 GiB by a partial chunk (values.CHUNK is 1 GiB)
    run = Distributor(2, local_mode=True, show=None).submit(rank0_value_of, size)
    value = run.result(timeout=600)
    assert value.shape == (size // 4,) and value.dtype == torch.float32
    assert bool((value == 7.0).all())
    assert_no_survivors(run)
    del value
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"torchdist-{run.run_id}-")]


def sum_of(tensor):
    import torch

    from torchdist_magic import rank

    return rank(), float(tensor.sum(dtype=torch.float64))


def test_a_512_mib_notebook_tensor_reaches_two_ranks():
    tensor = torch.ones(512 * 2**20 // 4)
    run = Distributor(2, local_mode=True, show=None, all_ranks=True).submit(sum_of, tensor)
    assert run.result(timeout=600) == [(0, float(tensor.numel())), (1, float(tensor.numel()))]
    assert_no_survivors(run)


def checksum(tensor):
    import torch

    from torchdist_magic import rank

    return rank(), float(tensor.sum(dtype=torch.float64)), tensor.data_ptr() % values.ALIGN


def test_a_512_mib_notebook_tensor_in_a_cell_reaches_two_ranks_from_one_file():
    """The cell's notebook tensor goes into one file, written once, that both ranks map: the
    job itself stays small."""
    from torchdist_magic.capture import capture_cell
    from torchdist_magic.core.job import cell_job

    big = torch.arange(512 * 2**20 // 4, dtype=torch.float32)
    cell = capture_cell(
        "rank, float(big.sum(dtype=torch.float64)), big[-1].item()",
        {"big": big, "torch": torch},
        ["import torch"],
        warn_bytes=2**40,
    )
    assert cell.buffers.nbytes == big.nbytes and len(cell.values) < 4096
    run = Distributor(2, local_mode=True, show=None, all_ranks=True).submit(cell_job(cell, "cell"))
    assert len(run._job_bytes) < 2**20  # the tensor is in the run's file, not in the job
    expected = float(big.sum(dtype=torch.float64))
    assert run.result(timeout=600) == [(0, expected, big[-1].item()), (1, expected, big[-1].item())]
    assert_no_survivors(run)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"torchdist-{run.run_id}-")]


def test_notebook_values_reach_a_warm_pools_ranks_from_a_file():
    from torchdist_magic import shutdown_pools

    tensor = torch.ones(16 * 2**20 // 4)
    try:
        d = Distributor(2, local_mode=True, show=None, all_ranks=True, warm=True)
        for _ in range(2):
            run = d.submit(checksum, tensor)
            assert len(run._job_bytes) < 2**20
            assert run.result(timeout=300) == [(0, float(tensor.numel()), 0), (1, float(tensor.numel()), 0)]
            assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"torchdist-{run.run_id}-")]
    finally:
        shutdown_pools()


def test_buffers_not_in_a_file_travel_inside_the_job():
    """Where the ranks may be on other machines (a Spark cluster), the bytes are in the job."""
    import cloudpickle

    arrays = {"a": np.arange(300_000.0), "t": torch.arange(5.0)}
    stream, buffers = values.pickled_apart(arrays)
    back = values.loads_apart(stream, pickle.loads(cloudpickle.dumps(buffers)))
    assert (back["a"] == arrays["a"]).all() and torch.equal(back["t"], arrays["t"])
    back["t"][0] = 9.0  # the rank's own copy
    assert arrays["t"][0].item() == 0.0


def test_a_rank_that_cannot_see_the_values_file_says_so(tmp_path):
    stream, buffers = values.pickled_apart({"a": np.arange(10.0)})
    in_file = buffers.in_file(str(tmp_path))
    assert (values.loads_apart(stream, in_file)["a"] == np.arange(10.0)).all()
    os.remove(in_file.path)
    with pytest.raises(
        FileNotFoundError,
        match=r"^the notebook values sent to the ranks are in "
        + str(tmp_path)
        + r"/sent.values on the driver's machine, which this rank's "
        r"machine \(.+\) cannot see$",
    ):
        values.loads_apart(stream, pickle.loads(pickle.dumps(in_file)))


def mib_of_sevens(mib):
    import torch

    return torch.full((mib * 2**18,), 7.0)


@pytest.mark.spark
@pytest.mark.big_values
@pytest.mark.parametrize("session", ["spark_local2", "spark_connect"])
def test_a_512_mib_value_comes_back_from_spark_without_passing_through_it(session, request):
    """On the driver's machine the rank writes its value where the driver maps it: nothing goes
    through Spark's result path (whose driver here has Spark's default 1 GiB of heap)."""
    request.getfixturevalue(session)
    run = Distributor(2, local_mode=False, show=None).submit(mib_of_sevens, 512)
    value = run.result(timeout=600)
    assert value.shape == (512 * 2**18,) and bool((value == 7.0).all())
    assert_nothing_left(run)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"torchdist-{run.run_id}-")]


def test_a_small_value_through_sparks_own_result_path_still_loads():
    """What a task on another machine sends through Spark is the same blob."""
    from torchdist_magic.backends.spark_stage import sort_rows

    blob = values.dumps({"w": torch.arange(4.0)})
    rows = sort_rows(
        [{"rank": 0, "kind": "value", "chunk": blob[:10]}, {"rank": 0, "kind": "value", "chunk": blob[10:]}]
    )
    assert torch.equal(values.loads(rows.values[0])["w"], torch.arange(4.0))


@pytest.mark.spark
@pytest.mark.big_values
@pytest.mark.parametrize("session", ["spark_local2", "spark_connect"])
def test_a_512_mib_notebook_tensor_reaches_spark_tasks_through_the_file(session, request):
    request.getfixturevalue(session)
    tensor = torch.ones(512 * 2**20 // 4)
    run = Distributor(2, local_mode=False, show=None, all_ranks=True).submit(checksum, tensor)
    assert len(run._job_bytes) < 2**20
    assert run.result(timeout=600) == [(0, float(tensor.numel()), 0), (1, float(tensor.numel()), 0)]
    assert_nothing_left(run)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"torchdist-{run.run_id}-")]


# -- values out to the ranks: written while the ranks start --------------------------------


def _blob_file(directory, value):
    """``value``'s buffers as the ranks read them: the file's path, the pickle stream, the
    whole file's bytes and the ``Buffers`` that name it."""
    stream, buffers = values.pickled_apart(value)
    in_file = buffers.in_file(str(directory))
    with open(in_file.path, "rb") as fh:
        return in_file.path, stream, fh.read(), in_file


def _waiting_for_lock_on(path: str) -> bool:
    """Whether a ``flock`` of this process waits for the file at ``path`` (``/proc/locks``
    lists a waiter with ``->``)."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as fh:
        return any(
            "->" in line and f" {os.getpid()} " in line and line.split()[-3].endswith(f":{inode}") for line in fh
        )


def test_a_rank_that_loads_the_values_while_the_driver_writes_them_waits_for_the_whole_file(tmp_path):
    """The driver holds the file's lock while it writes (``FileWriter``): a rank that maps it
    meanwhile waits, and then reads every byte, never a part."""
    import fcntl
    import threading

    from helpers import wait_until

    value = {"t": torch.arange(2**20, dtype=torch.float64)}
    os.makedirs(tmp_path / "whole")
    os.makedirs(tmp_path / "being-written")
    path, stream, whole, in_file = _blob_file(tmp_path / "whole", value)
    half = str(tmp_path / "being-written" / values.SENT_FILE)
    with open(half, "wb", buffering=0) as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        writer.write(whole[: len(whole) // 2])
        loaded = []
        reader = threading.Thread(target=lambda: loaded.append(values.loads_apart(stream, in_file._named(half))))
        reader.start()
        wait_until(lambda: _waiting_for_lock_on(half), 30, "the rank to wait for the file's lock")
        assert not loaded
        writer.write(whole[len(whole) // 2 :])
    reader.join(30)
    assert torch.equal(loaded[0]["t"], value["t"])


def test_a_values_file_the_driver_could_not_write_names_its_reason_on_the_rank(tmp_path):
    """``FileWriter`` leaves the reason in the file (here a file size limit, as a full disk
    does): the driver's ``error`` has it, and a rank that loads the file raises it."""
    import subprocess
    import sys

    script = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
import numpy as np
from torchdist_magic.core import values
stream, buffers = values.pickled_apart({"a": np.ones(1 << 20)})
writer = values.FileWriter(buffers, sys.argv[1])
writer.wait()
print(writer.error)
try:
    values.loads_apart(stream, writer.buffers)
except OSError as exc:
    print(exc)
"""
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert done.returncode == 0, done.stderr
    error, message = done.stdout.splitlines()
    assert error == "[Errno 27] File too large"
    assert message == (
        f"the driver could not write the notebook values sent to the ranks into "
        f"{tmp_path / values.SENT_FILE}: [Errno 27] File too large"
    )


def test_a_values_file_that_is_not_whole_is_refused_by_the_rank(tmp_path):
    """What a driver stopped while it wrote leaves: a part of the file, or nothing."""
    path, stream, whole, in_file = _blob_file(tmp_path, {"t": torch.ones(2**18)})
    with open(path, "wb") as fh:
        fh.write(whole[: len(whole) - 4096])
    with pytest.raises(
        OSError,
        match=rf"^the notebook values sent to the ranks in {path} are not whole: not a whole torchdist value: "
        rf"it ends after {len(whole) - 4096} of its {len(whole)} bytes$",
    ):
        values.loads_apart(stream, in_file)
    open(path, "wb").close()
    with pytest.raises(
        OSError,
        match=rf"^the notebook values sent to the ranks in {path} are not whole: it does not start with a "
        r"value's mark$",
    ):
        values.loads_apart(stream, in_file)


def test_a_blob_cut_short_is_refused():
    blob = values.dumps({"t": torch.ones(1000)})
    with pytest.raises(
        ValueError, match=rf"^not a whole torchdist value: it ends after {len(blob) - 8} of its {len(blob)} bytes$"
    ):
        values.loads(blob[:-8])


def test_a_notebook_tensor_changed_once_the_run_started_reaches_the_ranks_as_it_was():
    """``submit`` returns once the file the ranks map is written: what the notebook does to the
    tensor after that is not what the ranks read."""
    tensor = torch.zeros(64 * 2**20 // 4)
    run = Distributor(2, local_mode=True, show=None, all_ranks=True).submit(sum_of, tensor)
    tensor.fill_(1.0)
    assert run.result(timeout=300) == [(0, 0.0), (1, 0.0)]
    assert_no_survivors(run)


def test_the_values_files_memory_is_given_back_once_its_name_is_gone(tmp_path):
    """``SentValues.remove``: the name at once, the memory by a thread of its own, which lets go
    of the file it held open."""
    import shutil

    from helpers import wait_until
    from torchdist_magic.backends.local import LocalProcessBackend
    from torchdist_magic.core.job import build_job
    from torchdist_magic.driver.sent import SentValues

    def held():
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(os.path.join("/proc/self/fd", fd))
            except OSError:
                continue
            if values.SENT_FILE in target and "torchdist-test-values" in target:
                found.append(target)
        return found

    sent = SentValues("test", LocalProcessBackend())
    job_bytes = sent.pickle(build_job(sum_of, (torch.ones(2**20),), {}))
    directory = sent.directory
    sent.wait()
    job = pickle.loads(job_bytes)
    assert job.buffers.path == os.path.join(directory, values.SENT_FILE) and os.path.exists(job.buffers.path)
    sent.remove()
    assert not os.path.exists(directory) and sent.directory == ""
    wait_until(lambda: not held(), 30, "the thread that gives the file's memory back to close it")
    sent.remove()  # idempotent

    again = SentValues("test", LocalProcessBackend())
    again.pickle(build_job(sum_of, (torch.ones(2**20),), {}))
    again.wait()
    shutil.rmtree(again.directory)  # by someone else
    again.remove()
    assert again.directory == ""


FULL_SHM_OUT = """
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
from helpers import assert_no_survivors
from torchdist_magic import Distributor
from torchdist_magic.core.errors import RankFailure

with open("/dev/shm/filler", "wb") as fh:  # leaves 2 MiB of the mount's 8
    fh.write(b"x" * (6 * 2**20))
run = Distributor(2, local_mode=True, show=None).submit(len, torch.ones(3 * 2**20 // 4))
try:
    run.result(timeout=300)
except RankFailure as exc:
    print(exc.exc_type, exc.message, sep="\\n")
assert_no_survivors(run)
"""


@pytest.mark.skipif(UNSHARE is None, reason="a full /dev/shm needs a mount of its own (unshare)")
def test_notebook_values_that_fill_shared_memory_fail_the_ranks_with_the_drivers_reason():
    """The values' file is written while the ranks start: where /dev/shm fills up, each rank
    that maps it fails with what the driver's write raised."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    script = f'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec {sys.executable} -c "$0" "$@"'
    done = subprocess.run(
        ["unshare", *UNSHARE, "sh", "-c", script, FULL_SHM_OUT, tests],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.path.dirname(tests)},
    )
    assert done.returncode == 0, done.stderr
    exc_type, message = done.stdout.splitlines()
    assert exc_type == "OSError"
    assert re.fullmatch(
        r"the driver could not write the notebook values sent to the ranks into "
        r"/dev/shm/torchdist-[^/]+-values-\d+-[^/]+/sent\.values: \[Errno 28\] No space left on device",
        message,
    ), message
