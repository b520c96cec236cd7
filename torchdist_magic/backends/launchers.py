"""A run whose ranks' launchers are started by a command line: what a backend that starts ranks
on other machines (ssh, Slurm's srun, a cluster's job API) builds on.

Such a backend subclasses ``CommandLineBackend`` and says one thing, ``command``: the command
line that runs a given program for one rank where that rank goes (``["ssh", host, ...]``,
``["srun", "--nodes=1", ...]``).  The program is the launcher every backend's ranks run under
(``launch.remote``): it reaches the driver over the run's event channel, meets the other ranks
through the driver (``rendezvous.DriverRendezvous``), starts the rank's worker, obeys ``Stop`` and
``DumpStacks``, and sends the rank's value into the driver's value directory (or writes it
there, where that directory is on a file system it shares).  Its machines need the same Python
with torchdist_magic, torch and the job's packages, and the spec file it is given (``command``
may copy it there first: ``write_spec`` makes it on the driver, private to its user).

A launcher that ends without its rank's ``Exit`` having reached the driver (killed, lost) is
reported from what it printed last (``remote.EXIT_MARK``), else from its exit status and the
last lines of its error output.
"""

from __future__ import annotations

import abc
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Collection, Dict, List, Optional, Set

from ..core import events
from ..core.names import VALUES_FETCH_ENV
from ..core.timing import CLOSE_GRACE, REAP_WAIT, SPARK_STAGE_END_WAIT
from ..core.values import map_value
from ..launch.remote import EXIT_MARK, RemoteSpec, launcher_command, marked_value_directory, write_spec
from .base import Backend, BackendRun, LaunchContext
from .rendezvous import DriverRendezvous

#: lines of a launcher's error output kept for the failure of a launcher that ended unreported
STDERR_TAIL = 20


class CommandLineBackend(Backend):
    """A backend whose ranks' launchers are started by ``command``."""

    needs_channel = True
    #: each machine fetches a job's large notebook values once from the driver's channel
    fetches_values = True

    #: the launcher's ``Site`` on the ranks' machines (``launch.remote.SITES``): how a rank
    #: learns its node and is placed among the others
    site = "command-line"

    @abc.abstractmethod
    def command(self, rank: int, argv: List[str]) -> List[str]:
        """The command line that runs ``argv`` (the launcher of rank ``rank``) where that rank
        goes; ``argv`` names the spec file in ``spec_directory()`` and starts with ``python()``
        (``checked_python`` refuses it clearly on a machine that lacks it)."""

    def python(self) -> str:
        """The interpreter of the ranks' machines (with torchdist_magic, torch and the job's
        packages): this driver's own by default, where its path exists there too."""
        return sys.executable

    def spec_directory(self) -> Optional[str]:
        """The directory the run's spec file (the launcher secret and the job) is written to,
        which every rank's machine must read at the same path: a shared file system on a cluster;
        ``None``: the driver's temporary directory (its ranks run on this machine, or ``command``
        stages the file)."""
        return None

    def channel_host(self) -> str:
        """The address the driver's channel listens on; a backend whose ranks run on other
        machines gives one they reach."""
        return "127.0.0.1"

    def start(self, ctx: LaunchContext) -> "CommandLineRun":
        run = CommandLineRun(self, ctx)
        try:
            run.launch()
        except BaseException:
            run.close()
            raise
        return run


#: how a launcher's command line says that it could not start the launcher (``checked_python``)
REFUSED_MARK = "torchdist-launcher-refused:"

# argv[0] is the interpreter, the rest its arguments; the node's name where the machine has one
_CHECK_PYTHON = (
    'if [ -x "$0" ]; then exec "$0" "$@"; fi; '
    'echo "%s the interpreter $0 does not exist on ${SLURMD_NODENAME:-$(hostname)}: give one that does '
    '(with torchdist_magic, torch and the job\'s packages) as the backend option python=PATH"'
)


def checked_python(argv: List[str]) -> List[str]:
    """``argv`` (a launcher's command line, ``python ...``) run by ``/bin/sh``, which refuses it
    clearly where its interpreter does not exist (``REFUSED_MARK``: the rank's failure says so)."""
    return ["/bin/sh", "-c", _CHECK_PYTHON % REFUSED_MARK, *argv]


class CommandLineRun(BackendRun):
    """The launchers of one attempt, each a process of the driver's machine (``command``'s)."""

    def __init__(self, backend: CommandLineBackend, ctx: LaunchContext):
        self._backend = backend
        self._ctx = ctx
        self._n = ctx.spec.num_processes
        self._workdir = tempfile.mkdtemp(prefix=f"torchdist-{ctx.spec.run_id}-launchers-", dir=backend.spec_directory())
        self._value_dir = ""
        self._spec: Optional[RemoteSpec] = None
        self._procs: Dict[int, subprocess.Popen] = {}
        self._watchers: List[threading.Thread] = []
        self._reported: Set[int] = set()  # ranks whose Exit reached the driver
        self._lock = threading.Lock()
        self._rendezvous = DriverRendezvous(ctx, self._n)
        ctx.routes[events.Exit] = self._on_exit

    def launch(self) -> None:
        ctx = self._ctx
        self._value_dir = marked_value_directory(ctx.spec)
        self._spec = RemoteSpec(
            run=ctx.spec,
            job_bytes=ctx.job_bytes,
            value_dir=self._value_dir,
            values_sent=os.environ.get(VALUES_FETCH_ENV) == "1",
            site=self._backend.site,
        )
        ctx.receive_values(
            {rank: self._spec.value_path(rank) for rank in range(self._n) if ctx.spec.returns_value(rank)}
        )
        spec_file = os.path.join(self._workdir, "launcher.spec")
        write_spec(spec_file, self._spec)
        for rank in range(self._n):
            proc = subprocess.Popen(
                self._backend.command(rank, launcher_command(spec_file, rank, self._backend.python())),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            self._procs[rank] = proc
            watcher = threading.Thread(
                target=self._watch, args=(rank, proc), daemon=True, name=f"torchdist-launcher-rank{rank}"
            )
            watcher.start()
            self._watchers.append(watcher)

    def _on_exit(self, record: events.Exit) -> None:
        with self._lock:
            self._reported.add(record.rank)
        self._ctx.emit(record)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        """Wait for the launcher; report its rank's exit where the channel did not."""
        stderr: "collections.deque[str]" = collections.deque(maxlen=STDERR_TAIL)
        reader = threading.Thread(
            target=lambda: stderr.extend(line.decode("utf-8", "replace").rstrip("\n") for line in proc.stderr),
            daemon=True,
        )
        reader.start()
        last = ""
        for line in proc.stdout:
            text = line.decode("utf-8", "replace").strip()
            if text:
                last = text
        code = proc.wait()
        reader.join(REAP_WAIT)
        with self._lock:
            if rank in self._reported:
                return
            self._reported.add(rank)
        if last.startswith(REFUSED_MARK):  # checked_python: the machine has no such interpreter
            failure = events.Failure.from_exit(rank, None, time=time.time()).for_rank(
                rank, exc_type="LauncherRefused", message=last[len(REFUSED_MARK) :].strip()
            )
            self._ctx.emit(events.Exit(rank=rank, code=code or 1, time=time.time(), failure=failure))
            return
        if last.startswith(EXIT_MARK):
            try:
                self._ctx.emit(events.loads(last[len(EXIT_MARK) :]))
                return
            except ValueError:  # a malformed line: reported as below
                pass
        # no exit status of the rank's own to report: the launcher's is not the worker's
        failure = events.Failure.from_exit(rank, None, time=time.time(), log_tail=list(stderr)).for_rank(
            rank,
            exc_type="LauncherLost",
            message=f"the launcher of rank {rank} ended (exit status {code}) without reporting its rank's exit",
        )
        self._ctx.emit(events.Exit(rank=rank, code=code if code else 1, time=time.time(), failure=failure))

    def stop(self, grace: float) -> None:
        """Tell every launcher to stop its rank and wait for them; end those still there after
        the grace (their guards then end the workers)."""
        stop = events.Stop(rank=-1, grace=grace)
        deadline = time.monotonic() + max(grace, 0.0) + SPARK_STAGE_END_WAIT
        while time.monotonic() < deadline and self._alive():
            self._ctx.to_ranks(stop)  # again while waiting: a launcher that connects late gets it too
            self._join(min(0.2, max(0.0, deadline - time.monotonic())))
        self._end_launchers(grace)

    def stop_ranks(self, ranks: Collection[int], grace: float) -> Set[int]:
        return {r for r in ranks if self._ctx.to_rank(r, events.Stop(rank=r, grace=grace))}

    def dump_stacks(self) -> None:
        self._ctx.to_ranks(events.DumpStacks(rank=-1))

    def result(self, rank: int) -> Optional[bytes]:
        self._join(None)
        return map_value(self._spec.value_path(rank), self._value_dir) if self._spec is not None else None

    def ranks_alive(self) -> bool:
        return len(self._procs) == self._n and all(p.poll() is None for p in self._procs.values())

    def close(self) -> None:
        if self._alive():
            self.stop(CLOSE_GRACE)
        self._join(REAP_WAIT)
        self._rendezvous.close()
        shutil.rmtree(self._workdir, ignore_errors=True)
        if self._value_dir:
            shutil.rmtree(self._value_dir, ignore_errors=True)

    def _alive(self) -> bool:
        return any(p.poll() is None for p in self._procs.values())

    def _join(self, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for watcher in self._watchers:
            watcher.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _end_launchers(self, grace: float) -> None:
        """SIGTERM what is left of the launchers' process groups, then SIGKILL after ``grace``."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in self._procs.values():
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        pass
            if sig == signal.SIGTERM:
                end = time.monotonic() + max(grace, 0.0)
                while self._alive() and time.monotonic() < end:
                    time.sleep(0.02)
        for proc in self._procs.values():
            try:
                proc.wait(REAP_WAIT)
            except subprocess.TimeoutExpired:
                pass
