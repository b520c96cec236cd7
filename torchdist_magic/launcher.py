"""Start one rank's worker process, forward its output line by line, report its exit.

Shared by the local backend (on the driver) and the Spark backend (inside each barrier task),
so a rank's logs, exit code and failure look the same wherever it ran.  The worker runs in a
process group of its own so that stopping it reaches its children (DataLoader workers, ...).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Optional

from .worker import ERROR_FILE, RESULT_FILE

_LINE_END = re.compile(rb"\r\n|\n|\r")
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def rank_environment(base: Dict[str, str], *, rank: int, local_rank: int, world_size: int,
                     local_world_size: int, master_addr: str, master_port: int,
                     extra: Dict[str, str], channel: str, secret: str, run_id: str,
                     use_gpu: bool) -> Dict[str, str]:
    """The environment of one rank: the launcher's, the user's extras, then the run's own."""
    env = dict(base)
    env.update(extra)
    if "OMP_NUM_THREADS" not in extra and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = str(max(1, cores_available() // max(local_world_size, 1)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _PACKAGE_PARENT not in paths:
        env["PYTHONPATH"] = os.pathsep.join(paths + [_PACKAGE_PARENT])
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": "0",
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHDIST_CHANNEL": channel, "TORCHDIST_SECRET": secret, "TORCHDIST_RUN_ID": run_id,
        "TORCHDIST_USE_GPU": "1" if use_gpu else "0",
    })
    return env


def reserve_port(host: str = "") -> socket.socket:
    """Bind (without listening) a free port with SO_REUSEADDR and keep it.

    While this socket is open no other process can bind the port or be given it as an
    ephemeral port, yet rank 0's TCPStore (which binds with SO_REUSEADDR) can listen on it:
    the port cannot be stolen between choosing it and using it.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


def read_failure(result_dir: str) -> Optional[dict]:
    path = os.path.join(result_dir, ERROR_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_result(result_dir: str) -> Optional[bytes]:
    try:
        with open(os.path.join(result_dir, RESULT_FILE), "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


class RankProcess:
    """One worker process.  Emits ``log`` events while it runs and one ``exit`` event at the end."""

    def __init__(self, rank: int, job_file: str, result_dir: str, env: Dict[str, str],
                 emit: Callable[[dict], None], cwd: Optional[str] = None):
        self.rank = rank
        self.result_dir = result_dir
        self.emit = emit
        self.host = socket.gethostname()
        self.stopping = False
        self.exited = threading.Event()
        self.returncode: Optional[int] = None
        os.makedirs(result_dir, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torchdist_magic.worker", job_file, result_dir],
            env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
        )
        self.pgid = self.proc.pid
        self._readers = [
            threading.Thread(target=self._forward, args=(self.proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._forward, args=(self.proc.stderr, "stderr"), daemon=True),
        ]
        for t in self._readers:
            t.start()
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _forward(self, pipe, stream: str) -> None:
        fd = pipe.fileno()
        pending = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            pending += chunk
            hold_cr = pending.endswith(b"\r")  # may be the first half of \r\n
            if hold_cr:
                pending = pending[:-1]
            parts = _LINE_END.split(pending)
            ends = _LINE_END.findall(pending)
            for text, end in zip(parts, ends):
                self._line(stream, text, end == b"\r")
            pending = parts[-1] + (b"\r" if hold_cr else b"")
        if pending:
            self._line(stream, pending.rstrip(b"\r"), pending.endswith(b"\r"))
        pipe.close()

    def _line(self, stream: str, text: bytes, cr: bool) -> None:
        self.emit({"type": "log", "rank": self.rank, "stream": stream,
                   "line": text.decode("utf-8", "replace"), "cr": cr})

    def _wait(self) -> None:
        code = self.proc.wait()
        when = time.time()
        self.returncode = code
        for t in self._readers:
            t.join(timeout=2.0)  # a grandchild holding the pipe must not delay the exit report
        event = {"type": "exit", "rank": self.rank, "code": code, "time": when,
                 "host": self.host, "stopped": self.stopping and code != 0}
        if code != 0:
            failure = read_failure(self.result_dir) or {}  # its "time" is when the exception was caught
            failure.setdefault("exc_type", "")
            failure.setdefault("message", "")
            failure["exit_code"] = failure.get("exit_code", code) if code > 0 else code
            failure["host"] = self.host
            event["failure"] = failure
        self.emit(event)
        self.exited.set()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def alive(self) -> bool:
        return self.proc.poll() is None


def stop_all(procs, grace: float) -> None:
    """SIGTERM every live process group, one shared deadline, then SIGKILL what is left."""
    for p in procs:
        if p.alive():
            p.stopping = True
            p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + max(grace, 0.0)
    for p in procs:
        p.exited.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        # the group, not just the leader: children of an exited worker must not survive either
        p.signal_group(signal.SIGKILL)
    for p in procs:
        p.exited.wait(timeout=5.0)
