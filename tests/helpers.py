"""Shared test helpers: find processes that belong to a run, by the run id in their environment."""

from __future__ import annotations

import os
import time


def _environ(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _is_zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def pids_of_run(run_id: str) -> list:
    """Live processes (any depth) whose environment carries ``TORCHDIST_RUN_ID=run_id``."""
    marker = b"TORCHDIST_RUN_ID=" + run_id.encode() + b"\x00"
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid() and marker in _environ(pid) and not _is_zombie(pid):
            found.append(int(pid))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not _is_zombie(str(pid))


def assert_no_survivors(run, extra_pids=(), wait: float = 5.0) -> None:
    """No process of ``run`` (ranks, their children) and none of ``extra_pids`` is alive."""
    deadline = time.monotonic() + wait
    while True:
        left = pids_of_run(run.run_id) + [p for p in extra_pids if alive(p)]
        left += [rs.pid for rs in run.state.ranks if rs.pid and alive(rs.pid)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes of run {run.run_id} survived: {sorted(set(left))}"
