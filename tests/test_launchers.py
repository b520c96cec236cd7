"""The launcher contract from outside the package: a backend that starts each rank's launcher by
a command line (``tests/shell_backend.py``, registered by name as a package would) runs jobs as
the built-in backends do (``test_contract`` runs the whole contract on it); what it adds is
checked here: the command lines, a launcher that dies unreported, the launcher's own usage."""

import os
import re
import signal
import subprocess
import sys
import time

from helpers import assert_no_survivors, rank_failure_of
from torchdist_magic import Distributor, rank


def pid_and_rank():
    return os.getpid(), rank()


def test_each_rank_s_launcher_is_started_by_its_command_line(shell_backend):
    run = Distributor(3, backend="shell", show=None, all_ranks=True).submit(pid_and_rank)
    values = run.result(timeout=120)
    assert [r for _, r in values] == [0, 1, 2] and len({pid for pid, _ in values}) == 3
    assert sorted(shell_backend.commands) == [0, 1, 2]
    for r, line in shell_backend.commands.items():
        assert line.startswith(f"{sys.executable} -m torchdist_magic.launch.remote ") and line.endswith(f" {r}")
    assert run.state.snapshot().backend == "launchers started by /bin/sh command lines"
    assert_no_survivors(run)


def kill_my_launcher(bad_rank):
    if rank() == bad_rank:
        os.kill(os.getppid(), signal.SIGKILL)  # the worker's parent is its launcher
    time.sleep(600)


def test_a_launcher_that_dies_unreported_is_the_rank_s_failure(shell_backend):
    run = Distributor(2, backend="shell", show=None).submit(kill_my_launcher, 1)
    failure = rank_failure_of(run)
    # /bin/sh stays the launcher's parent and says 128 + 9 for the SIGKILL (dash, bash)
    # (the rank's host is named once its worker's Started came)
    assert re.fullmatch(
        r"rank 1( on \S+)? raised LauncherLost: the launcher of rank 1 ended \(exit status 137\) "
        r"without reporting its rank's exit",
        failure.args[0],
    )
    assert_no_survivors(run)  # its guard ended the worker the launcher left behind


def test_the_launcher_says_how_to_call_it():
    done = subprocess.run(
        [sys.executable, "-m", "torchdist_magic.launch.remote", "only-one-argument"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "usage: python -m torchdist_magic.launch.remote SPEC_FILE RANK"
