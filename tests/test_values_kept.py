"""A run's notebook tensors kept for the next run: a second run with the same tensors, unchanged,
maps the first run's file and writes nothing; any change (torch's own, or most of the bytes
behind torch's back) writes a new one; the file goes with its tensors, with the process, and
what a killed process left is removed by the next one."""

import gc
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from helpers import assert_no_survivors
from torchdist_magic import Distributor
from torchdist_magic.core import values
from torchdist_magic.driver import sent
from torchdist_magic.driver.sent import KEEP_ENV, KEPT_PREFIX, KeptValues

MIB = 2**20


@pytest.fixture(autouse=True)
def _no_kept_file():
    KeptValues.forget_current()
    yield
    KeptValues.forget_current()


def total(tensor):
    import torch

    from torchdist_magic import rank

    return rank(), float(torch.as_tensor(tensor).sum(dtype=torch.float64))


def run_total(tensor, **options):
    run = Distributor(2, local_mode=True, show=None, all_ranks=True, **options).submit(total, tensor)
    result = run.result(timeout=300)
    assert_no_survivors(run)
    return run, result


def kept_file():
    kept = KeptValues.current
    assert kept is not None, "no run's values were kept"
    return kept.buffers.path, os.stat(kept.buffers.path).st_ino


def test_a_second_run_with_the_same_unchanged_tensor_maps_the_first_runs_file():
    tensor = torch.ones(8 * MIB // 4)
    first, result = run_total(tensor)
    assert result == [(0, float(tensor.numel())), (1, float(tensor.numel()))]
    path, inode = kept_file()
    assert os.path.basename(os.path.dirname(path)).startswith(f"{KEPT_PREFIX}{os.getpid()}-")
    second, result = run_total(tensor)
    assert result == [(0, float(tensor.numel())), (1, float(tensor.numel()))]
    assert path.encode() in second._job_bytes  # the job names the kept file: nothing was written
    assert kept_file() == (path, inode)
    assert not [
        n for n in os.listdir(os.path.dirname(os.path.dirname(path))) if n.startswith(f"torchdist-{second.run_id}-")
    ]


def test_a_tensor_changed_in_place_is_written_again_and_the_old_file_goes():
    tensor = torch.ones(8 * MIB // 4)
    run_total(tensor)
    old_path, _ = kept_file()
    tensor.add_(1.0)  # bumps its version counter
    second, result = run_total(tensor)
    assert result == [(0, 2.0 * tensor.numel()), (1, 2.0 * tensor.numel())]
    assert old_path.encode() not in second._job_bytes
    assert not os.path.exists(old_path)
    assert kept_file()[0] != old_path


def test_a_tensor_filled_again_behind_torchs_back_is_seen_by_its_fingerprint():
    tensor = torch.ones(8 * MIB // 4)
    run_total(tensor)
    version = tensor._version
    tensor.numpy()[:] = 3.0  # through NumPy: torch's version counter does not move
    assert tensor._version == version
    _, result = run_total(tensor)
    assert result == [(0, 3.0 * tensor.numel()), (1, 3.0 * tensor.numel())]


def test_a_new_tensor_of_the_same_size_is_not_taken_for_the_old_one():
    tensor = torch.ones(8 * MIB // 4)
    run_total(tensor)
    path, _ = kept_file()
    other = torch.full((8 * MIB // 4,), 5.0)
    second, result = run_total(other)
    assert result == [(0, 5.0 * other.numel()), (1, 5.0 * other.numel())]
    assert path.encode() not in second._job_bytes


def test_the_kept_file_goes_when_its_tensor_is_freed():
    tensor = torch.ones(8 * MIB // 4)
    run, _ = run_total(tensor)
    path, _ = kept_file()
    del tensor, run  # the run's job held the tensor too
    gc.collect()
    assert KeptValues.current is None
    assert not os.path.exists(os.path.dirname(path))


def test_a_numpy_array_is_not_kept_nothing_counts_its_changes():
    array = np.ones(8 * MIB // 8)
    _, result = run_total(array)
    assert result == [(0, float(array.size)), (1, float(array.size))]
    assert KeptValues.current is None


def test_keep_values_0_keeps_nothing_and_another_value_is_refused(monkeypatch):
    tensor = torch.ones(8 * MIB // 4)
    monkeypatch.setenv(KEEP_ENV, "0")
    run_total(tensor)
    assert KeptValues.current is None
    monkeypatch.setenv(KEEP_ENV, "yes")
    with pytest.raises(
        ValueError,
        match=r"^TORCHDIST_KEEP_VALUES must be 1 \(keep a run's notebook tensors for the next run\) or 0, got 'yes'$",
    ):
        Distributor(2, local_mode=True, show=None).submit(total, tensor)


def test_a_warm_pools_second_run_maps_the_kept_file_too():
    from torchdist_magic import shutdown_pools

    tensor = torch.ones(8 * MIB // 4)
    try:
        d = Distributor(2, local_mode=True, show=None, all_ranks=True, warm=True)
        assert d.submit(total, tensor).result(timeout=300) == [(0, float(tensor.numel())), (1, float(tensor.numel()))]
        path, inode = kept_file()
        second = d.submit(total, tensor)
        assert second.result(timeout=300) == [(0, float(tensor.numel())), (1, float(tensor.numel()))]
        assert path.encode() in second._job_bytes and kept_file() == (path, inode)
    finally:
        shutdown_pools()


def test_a_kept_file_in_use_by_a_run_stays_until_that_run_ends(tmp_path):
    tensor = torch.ones(2 * MIB // 4)
    other = torch.zeros(2 * MIB // 4)

    def keep(t, name):
        stream, buffers = values.pickled_apart(t)
        directory = tmp_path / name
        directory.mkdir(mode=0o700)
        in_file = buffers.in_file(str(directory))
        KeptValues.keep(str(directory), in_file, buffers.marks, buffers.fingerprint())
        return KeptValues.current

    first = keep(tensor, "first")
    _, again = values.pickled_apart(tensor)
    taken = KeptValues.reuse(again)
    assert taken is first and first.users == 1
    keep(other, "second")  # another run's file replaces it while a run maps it
    assert first.dropped and os.path.exists(first.buffers.path)
    taken.release()
    assert not os.path.exists(first.directory)


def test_what_a_killed_process_kept_is_removed_by_the_next_one_to_keep(tmp_path):
    shm = values.SHARED_MEMORY if values.fits_shared_memory(0) else tempfile.gettempdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        left = os.path.join(shm, f"{KEPT_PREFIX}{dead.pid}-torchdist-x-values-{dead.pid}-abc")
        kept_by_living = os.path.join(shm, f"{KEPT_PREFIX}{living.pid}-torchdist-y-values-{living.pid}-abc")
        for directory in (left, kept_by_living):
            os.mkdir(directory, 0o700)
        sent._sweep(shm)
        assert not os.path.exists(left)
        assert os.path.isdir(kept_by_living)  # its process is alive: it is its own
        os.rmdir(kept_by_living)
    finally:
        living.kill()
        living.wait()
