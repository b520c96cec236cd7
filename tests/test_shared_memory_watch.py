"""The session's guard against leftovers in shared memory (``helpers.SharedMemoryWatch``, which
the ``conftest`` fixture ``_nothing_left_in_shared_memory`` fails a session with): what a process
of the session makes there under torchdist_magic's names is named, another session's never."""

import os
import subprocess
import sys
import uuid

from helpers import SESSION_VARIABLE, SharedMemoryWatch, alive, wait_until
from torchdist_magic.core.values import SHARED_MEMORY

#: makes a value directory of its own in shared memory and lives until its stdin closes; with
#: "away" it leaves that to a child of its own in a new session, then exits: the child is left to
#: init, with no process of the test session above it
MAKER = """
import os, subprocess, sys, time
folder, tag, where, source = sys.argv[1:]
if where == "away":
    left = f"left-by-{os.getpid()}"
    subprocess.Popen([sys.executable, "-c", source, folder, tag, left, source], start_new_session=True)
    sys.exit(0)
if where.startswith("left-by-"):  # made once its parent is gone (on a busy machine it may exit late)
    while os.getppid() == int(where[len("left-by-"):]):
        time.sleep(0.01)
path = os.path.join(folder, f"torchdist-{tag}-values-{os.getpid()}-left")
os.mkdir(path)
print(path, flush=True)
sys.stdin.read()
"""


def test_what_the_sessions_processes_leave_is_named_and_another_sessions_is_not():
    session = int(os.environ[SESSION_VARIABLE])
    tag = f"test{uuid.uuid4().hex[:8]}"
    watch = SharedMemoryWatch(session)
    makers, made = [], []
    try:
        # a child of this session; a process of another session's (its mark, and not below this one)
        for where, env in (("here", os.environ), ("away", {**os.environ, SESSION_VARIABLE: "0"})):
            maker = subprocess.Popen(
                [sys.executable, "-c", MAKER, SHARED_MEMORY, tag, where, MAKER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            makers.append(maker)
            made.append(maker.stdout.readline().strip())
        makers[1].wait()  # its child is left to init
        own = os.path.join(SHARED_MEMORY, f"torchdist-{tag}-values-{os.getpid()}-own")  # this process's
        os.mkdir(own)
        made.append(own)
        watch.look()
        child, stranger, own = made
        assert all(os.path.isdir(path) for path in made)
        assert watch.left() == sorted([child, own])
        os.rmdir(child)
        os.rmdir(own)
        assert watch.left() == []
    finally:
        watch.stop()
        for maker in makers:
            maker.stdin.close()  # the makers (and the one left to init, which shares the pipe) end
            maker.wait()
        pids = [int(os.path.basename(path).split("-")[-2]) for path in made[:2]]
        wait_until(lambda: not any(alive(pid) for pid in pids), 30, "the makers to end")
        for path in made:
            if os.path.isdir(path):
                os.rmdir(path)
