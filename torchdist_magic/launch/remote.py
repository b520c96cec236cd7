"""The launcher of one rank that reaches the driver over the run's event channel.

What a Spark barrier task runs inside its executor, and what any other backend runs where its
ranks start, as ``python -m torchdist_magic.launch.remote SPEC RANK`` (``launcher_command``: a
command line ``ssh host ...`` or ``srun ...`` can carry).  Both go through ``run_launcher``: it
joins the run's event channel as the rank's launcher (role ``launcher``, key
``rankenv.rank_key(launcher_secret, "launcher", rank)``), meets the other ranks (``Joined`` to
the driver, ``Peers`` back: ``rendezvous``), starts the rank's worker with the launcher every
backend uses (``launcher.start_rank``), forwards its records, obeys ``Stop`` and ``DumpStacks``,
and returns its outcome.  What only the backend knows (the address other ranks reach this
host at, its GPUs, a fallback way to meet, the rank's rows of a DataFrame) comes from a ``Site``.

Stopping.  When the driver sends ``events.Stop``, the launcher gives its worker SIGTERM, the
grace, then SIGKILL, reports the exit and returns.  A ``Stop`` may reach one rank alone (under
``--pdb`` the other ranks stop while a failed rank is held for a debugger).  A launcher can also
be killed outright (Spark kills the Python process of a cancelled task with SIGKILL), and then
no ``finally`` runs: so each launcher also starts a small guard process in a session of its own,
which notices the launcher's end and, unless it said "done", stops the worker's process group
and removes the launcher's files.

Notebook values.  Where the job names values to fetch (``RunSpec.values_fetch``), the launcher
joins its machine's users of their copy before anything else and hands that lock to its guard,
then, after the rendezvous, fetches them or waits for the launcher of its machine that does
(``hostcopy``); the guard, at the launcher's end or after its kill, removes the copy when it was
its machine's last user.

A rank's value comes back one way, chosen here (``value_route``): written by the rank into the
driver's value directory where this launcher sees it (``RemoteSpec.value_file``), else sent
there over the channel (``valueupload``) before the rank's exit is reported; only where the
channel is lost does it travel back with the outcome (through Spark, for a Spark task).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import hashlib
import hmac
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

from ..core import events, procs
from ..core.names import RESULT_FILE
from ..core.privdir import check_private, is_fallback, open_private
from ..core.rankenv import Placement, RunSpec, place_ranks, place_spark_tasks, rank_key
from ..core.timing import STOP_GRACE
from ..core.values import value_directory
from ..wire.batching import flush_every
from ..wire.client import ChannelClient
from . import hostcopy, hostrelay, valueupload
from .launcher import RankProcess, open_gpus, read_result, reserve_port, start_rank, stop_all, write_job_file

#: lines of a rank's output a launcher keeps, for when its channel to the driver is lost
LOG_TAIL = 20
#: how a command-line launcher's last line of output carries its rank's ``Exit``
EXIT_MARK = "torchdist-launcher-exit:"

# The guard: runs ``procs`` (standard library only) with this below it, and reads lines from the
# launcher on stdin: each rank's process group id and mark, then "done" once the launcher has cleaned
# up itself.  End of input without "done" means the launcher was killed: SIGTERM the worker's group, wait
# up to the grace for the worker to exit (an orphan may stay a zombie for a while: that counts as
# exited), SIGKILL what is left of the group, end what the rank started in a session of its own
# (its mark), remove the files.  Either way, it then leaves the users of the machine's copy of the
# notebook values (``hostcopy``: the shared lock it holds on fd ``users``, -1 for none) and removes
# the copy when it was the last, with the run's own directory of it where it is in one; and the
# users of the machine's host relay (``hostrelay``: a lock of its own on ``<relay>.users``), removing
# the relay's files when it is the last and the relay's owner is dead.
_GUARD_MAIN = r"""
import fcntl, shutil, sys
workdir, grace, users, copy = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
own_directory = sys.argv[5] == "1"  # the copy is in the run's own directory: it goes too
relay, relay_users = sys.argv[6], -1  # the machine's host relay's files ("": none)
if relay:  # a user of the relay of its own, beside its launcher (which is one while it runs)
    try:
        relay_users = os.open(relay + ".users", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(relay_users, fcntl.LOCK_SH)
    except OSError:
        relay_users = -1
def last_user(fd):
    # lets go of its shared lock on the users file ``fd``; whether it then took it exclusively
    # (no other user holds it), without waiting: of users leaving together, the last one does
    fcntl.flock(fd, fcntl.LOCK_UN)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True
def leave_relay():
    # the last of the machine's launchers to leave, where the relay's owner was killed (no live
    # pid in its address), removes the relay's files; a live owner removes them itself
    if relay_users < 0 or not last_user(relay_users):
        return
    try:
        with open(relay + ".address", "rb") as fh:
            pid = fh.read().split(b" ")[0]
    except OSError:
        pid = b""
    if pid.isdigit() and not process_exited(int(pid)):
        return
    for suffix in (".address", ".users", ".lock"):
        try:
            os.unlink(relay + suffix)
        except OSError:
            pass
def leave_copy():
    if users < 0 or not last_user(users):
        return  # another launcher of this machine uses the copy: the last one removes it
    try:
        last = os.stat(copy + ".users").st_ino == os.fstat(users).st_ino
    except OSError:
        last = False  # removed, and maybe made again for a later attempt, by another
    if last:
        for suffix in ("", ".tmp", ".lock", ".users"):
            try:
                os.unlink(copy + suffix)
            except OSError:
                pass
        if own_directory:
            try:
                os.rmdir(os.path.dirname(copy))
            except OSError:
                pass  # another launcher of this machine joined meanwhile: it removes it
ranks = []
for line in sys.stdin:
    if line.strip() == "done":
        leave_copy()
        leave_relay()
        sys.exit(0)
    pgid, _, mark = line.strip().partition(" ")
    ranks.append((int(pgid), mark))
def signal_all(sig):
    for pgid, _ in ranks:
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
signal_all(signal.SIGTERM)
deadline = time.monotonic() + grace
while time.monotonic() < deadline and not all(process_exited(pgid) for pgid, _ in ranks):
    time.sleep(0.05)
signal_all(signal.SIGKILL)
for _, mark in ranks:
    end_marked_processes(mark, grace)
shutil.rmtree(workdir, ignore_errors=True)
leave_copy()
leave_relay()
"""


def guard_source() -> str:
    """The guard's program: ``procs``' source, then ``_GUARD_MAIN``."""
    with open(procs.__file__, encoding="utf-8") as fh:
        return fh.read() + _GUARD_MAIN


@dataclass
class RemoteSpec:
    """Everything a launcher that joins the run's channel needs: travels to it inside a Spark
    stage's closure, or in a file its command line names (``write_spec``)."""

    run: RunSpec
    job_bytes: bytes
    #: the driver's directory for the ranks' values: a launcher that sees it (on the driver's
    #: machine, or a file system they share) has its rank write its value there, which the
    #: driver then maps; any other sends it there over the run's channel (``valueupload``)
    value_dir: str = ""
    #: every launcher sends its rank's value over the channel, even one that sees ``value_dir``
    #: (``TORCHDIST_VALUES_FETCH=1``: a cluster's path, tested on one machine)
    values_sent: bool = False
    #: the ``Site`` a command-line launcher runs under (``SITES``): what its backend knows of
    #: where it runs (a node's name, the ranks placed on it)
    site: str = "command-line"

    def value_path(self, rank: int) -> str:
        """The file of ``rank``'s value in the driver's value directory."""
        return os.path.join(self.value_dir, f"rank-{rank}.value")

    def value_file(self, rank: int) -> str:
        """Where ``rank`` writes its value for the driver to map; ``""`` when this launcher cannot
        see the driver's value directory (or ``values_sent``).  The directory must be this
        user's own (``privdir.check_private``) and hold the run's mark with the content only the
        driver and the run's launchers can make (``value_dir_token``): a directory of that name that
        another user made receives nothing."""
        if not self.value_dir or self.values_sent:
            return ""
        try:
            check_private(self.value_dir)
            fd = open_private(os.path.join(self.value_dir, value_dir_mark(self.run.run_id)), os.O_RDONLY)
        except OSError:  # not there (another machine), not ours, or a link: UnsafePath too
            return ""
        try:
            mark = os.read(fd, 256)
        finally:
            os.close(fd)
        return self.value_path(rank) if hmac.compare_digest(mark, value_dir_token(self.run)) else ""


def marked_value_directory(run: RunSpec) -> str:
    """A new directory of the driver's for the ranks' values of ``run`` (in shared memory where
    there is some), with the mark only the driver and the run's launchers can make
    (``value_dir_token``): a launcher that finds it has its rank write its value there."""
    directory = value_directory(f"torchdist-{run.run_id}-values-")
    mark = open_private(os.path.join(directory, value_dir_mark(run.run_id)), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(mark, value_dir_token(run))
    finally:
        os.close(mark)
    return directory


def value_dir_mark(run_id: str) -> str:
    """The file that marks the driver's value directory of run ``run_id``."""
    return f".torchdist-run-{run_id}"


def value_dir_token(run: RunSpec) -> bytes:
    """What the mark of the driver's value directory of ``run`` holds: derived from the run's
    launcher secret, which the driver and the run's launchers know, and a rank's worker does not."""
    return (
        hmac.new(run.launcher_secret.encode(), f"torchdist value directory {run.run_id}".encode(), hashlib.sha256)
        .hexdigest()
        .encode()
    )


class RunStopped(Exception):
    """The driver stopped the run before this launcher started its rank."""


class DriverMessages:
    """What the driver sends this launcher over the channel: ``Stop`` (``stopped()``, with the
    ``grace`` it gives the rank between SIGTERM and SIGKILL), ``Peers`` (``peers()``) and
    ``DumpStacks`` (answered by ``dump_stacks``, once the rank's process is there)."""

    def __init__(self):
        self._stop = threading.Event()
        self._peers = threading.Event()
        self.grace = STOP_GRACE
        self.peer_list: Optional[events.Peers] = None
        self.dump_stacks: Optional[Callable[[], None]] = None

    def on_message(self, record: events.Event) -> None:
        if isinstance(record, events.Stop):
            self.grace = max(record.grace, 0.0)
            self._stop.set()
        elif isinstance(record, events.Peers):
            self.peer_list = record
            self._peers.set()
        elif isinstance(record, events.DumpStacks) and self.dump_stacks is not None:
            self.dump_stacks()

    def stopped(self) -> bool:
        return self._stop.is_set()

    def peers(self, channel: ChannelClient) -> Optional[events.Peers]:
        """The driver's ``Peers`` once it sent them; ``None`` when the channel is lost first
        (the driver decides within ``SPARK_RENDEZVOUS_WAIT`` of the first launcher's ``Joined``)."""
        while not self._peers.wait(0.01):
            if channel.lost or self.stopped():
                return None
        return self.peer_list


@dataclass
class TaskOutcome:
    """What a launcher returns to the driver, for the ranks whose channel may have been lost."""

    rank: int
    value: Optional[bytes]  # the rank's value blob (``values``), when it is wanted
    exit_json: dict  # its ``Exit`` record, encoded
    channel_lost: bool = False  # the driver heard nothing live from this task
    log_tail: List[str] = field(default_factory=list)  # the rank's last lines of output
    value_file: str = ""  # where the value is instead, in the driver's value directory


class Site(abc.ABC):
    """Where one launcher runs: what its backend knows that the launcher cannot find out."""

    def __init__(self, rank: int):
        self.rank = rank

    def host(self) -> str:
        """What tells this machine apart from the other ranks' (ranks of one host share its
        GPUs and its copy of the notebook values)."""
        return socket.gethostname()

    def record_host(self) -> str:
        """The name the rank's records give its machine (``Started``, ``Exit``: what the view and a
        failure show); ``""``: its host name."""
        return ""

    @abc.abstractmethod
    def address(self) -> str:
        """The address the other ranks reach this machine at (rank 0's is ``MASTER_ADDR``)."""

    def gpus(self) -> Optional[str]:
        """The GPUs this rank may use (``CUDA_VISIBLE_DEVICES`` form), ``None`` for those of
        the machine."""
        return None

    def gather(self, mine: events.Joined) -> Optional[List[events.Joined]]:
        """Every rank's ``Joined`` in rank order, by the backend's own means, for when the
        driver tells the ranks to meet without it (``Peers.use_barrier``); ``None``: none."""
        return None

    def data_file(self, workdir: str, stopped: Callable[[], bool]) -> str:
        """A file of ``workdir`` holding this rank's rows of the run's DataFrame (``""``: the
        run trains on none, or its rows come by ``RunSpec.data_files``)."""
        return ""

    def placement(self, peers: List[events.Joined], use_gpu: bool) -> Placement:
        """This rank's placement among ``peers`` (every rank's ``Joined``, in rank order; rank
        0's address and port are the rendezvous'): Spark's, each task a node of one process
        (``place_spark_tasks``); a site whose backend places several ranks on a node says so."""
        return place_spark_tasks(
            [p.host for p in peers], peers[0].address, peers[0].port, use_gpu, [p.gpus for p in peers]
        )[self.rank]


def run_launcher(spec: RemoteSpec, site: Site) -> TaskOutcome:
    """One rank's launcher: run it, report it live over the channel, and return its outcome."""
    rank = site.rank
    driver = DriverMessages()
    relay, relay_lines = _join_relay(spec.run, rank)
    channel = ChannelClient(
        relay.address if relay is not None else spec.run.channel_address,
        rank_key(spec.run.launcher_secret, "launcher", rank),
        spec.run.run_id,
        rank,
        role="launcher",
        on_message=driver.on_message,
        certificate="" if relay is not None else spec.run.channel_cert,
        flush=flush_every(spec.run.num_processes),
    )
    exits: List[events.Exit] = []
    tail: "collections.deque[str]" = collections.deque(maxlen=LOG_TAIL)

    def emit(event: events.Event) -> None:
        if isinstance(event, events.Exit):
            exits.append(event)
        elif isinstance(event, events.Log):  # a read's lines are one record: its head and ``more``
            if not event.cr:
                tail.append(event.line)
            tail.extend(event.more)
        channel.send(event)

    for line in relay_lines:
        emit(events.Log(rank=rank, stream="stderr", line=line))
    try:
        value, value_file = _run_rank(spec, site, channel, emit, driver, relay)
    except Exception as exc:  # the launcher's own failure (not the rank's): report it as this rank's  # noqa: BLE001
        value, value_file = None, ""
        host = socket.gethostname()
        emit(
            events.Exit(
                rank=rank,
                code=1,
                time=time.time(),
                host=host,
                stopped=driver.stopped(),
                failure=events.Failure.from_exception(rank, exc, host=host, exit_code=1),
            )
        )
    lost = channel.lost
    channel.close()
    if relay is not None:  # the machine's relay's owner waits here for its other launchers
        relay.leave()
    final = exits[-1]
    if final.failure is not None:  # its output travels with it when nothing else carries it
        final = dataclasses.replace(final, failure=final.failure.for_rank(rank, log_tail=list(tail)))
    # the last lines go back with the outcome only when the channel did not carry them: at a
    # thousand ranks, long lines would otherwise fill spark.driver.maxResultSize with copies
    return TaskOutcome(
        rank, value, events.encode(final), channel_lost=lost, log_tail=list(tail) if lost else [], value_file=value_file
    )


def _join_relay(run: RunSpec, rank: int) -> Tuple[Optional[hostrelay.Membership], List[str]]:
    """This launcher's place among its machine's users of the run's host relay, where the run
    uses them (``RunSpec.host_relay``), and lines for the rank's log: the relay's owner says it
    started it; a private directory another user took first is named; where the relay's files
    cannot be made, the rank connects to the driver itself and says why."""
    if not run.host_relay:
        return None, []
    lines: List[str] = []
    try:
        relay = hostrelay.join(run, rank, say=lambda line: lines.append(f"[torchdist] {line}"))
    except OSError as exc:
        return None, [
            f"[torchdist] host relay: not used on {socket.gethostname()} ({exc}); "
            "this rank connects to the driver itself"
        ]
    if relay.owner:
        lines.append(
            "[torchdist] host relay: this machine's ranks reach the driver over one connection, "
            f"through the relay rank {rank}'s launcher started"
        )
    return relay, lines


def rendezvous(site: Site, channel: ChannelClient, driver: DriverMessages, mine: events.Joined) -> List[events.Joined]:
    """Every rank's ``Joined``, in rank order: through the driver (its ``Peers``), or, when some
    launcher could not reach it, by the site's own means (Spark's barrier ``allGather``, which
    waits in steps of a second, the reason it is not the first choice)."""
    channel.send(mine)
    peers = driver.peers(channel)
    if peers is not None and not peers.use_barrier:
        return peers.peers
    gathered = site.gather(mine)
    if gathered is None:
        raise RunStopped(
            f"rank {mine.rank} could not meet the other ranks: "
            + (
                "the driver's channel was lost"
                if channel.lost and not driver.stopped()
                else "the run was stopped first"
                if driver.stopped()
                else "not every rank reached the driver, and this backend has no other way to meet"
            )
        )
    return gathered


def value_route(returns_value: bool, value_file: str, channel_lost: bool) -> str:
    """How a rank's value comes back to the driver, the one place that chooses: ``"none"`` (the
    rank has none to give), ``"file"`` (the rank wrote it into the driver's value directory,
    ``value_file``), ``"channel"`` (this launcher sends it there, ``valueupload``), or
    ``"outcome"`` (the channel is lost: it travels back with the launcher's outcome)."""
    if not returns_value:
        return "none"
    if value_file:
        return "file"
    return "outcome" if channel_lost else "channel"


def _run_rank(
    spec: RemoteSpec,
    site: Site,
    channel: ChannelClient,
    emit: Callable[[events.Event], None],
    driver: DriverMessages,
    relay: Optional[hostrelay.Membership] = None,
) -> Tuple[Optional[bytearray], str]:
    """Start and watch the rank; its value blob, or the file in the driver's value directory
    that holds it (``RemoteSpec.value_path``), as ``value_route`` chose; the rank's ``Exit`` is
    held back until a value sent over the channel is there, and a value that could not be sent
    raises.  The site's rows of a DataFrame are written after the rendezvous, so that a large
    partition does not hold it up."""
    run, rank = spec.run, site.rank
    workdir = tempfile.mkdtemp(prefix=f"torchdist-{run.run_id}-rank{rank}-")
    refusals: List[str] = []  # a directory another user made, said in the rank's log (hostcopy.copy_path)
    copy = hostcopy.copy_path(run, say=refusals.append) if run.values_fetch else ""
    users = hostcopy.join(copy) if copy else -1
    own_directory = "1" if copy and is_fallback(os.path.dirname(copy)) else "0"
    guard_args = [workdir, str(STOP_GRACE), str(users), copy, own_directory, relay.base if relay is not None else ""]
    try:
        guard = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", guard_source(), *guard_args],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, TORCHDIST_RUN_ID=run.run_id),
            start_new_session=True,
            text=True,
            pass_fds=(users,) if users >= 0 else (),
        )
    finally:
        if users >= 0:
            os.close(users)  # the lock is the guard's now: it lets go of it when the launcher has ended
    port = reserve_port("") if rank == 0 else None
    proc: Optional[RankProcess] = None
    gpu_source = None
    try:
        mine = events.Joined(
            rank=rank,
            host=site.host(),
            address=site.address(),
            gpus=site.gpus() if run.use_gpu else None,
            port=port.getsockname()[1] if port is not None else None,
        )
        peers = rendezvous(site, channel, driver, mine)
        place = site.placement(peers, run.use_gpu)
        data_file = site.data_file(workdir, driver.stopped)
        value_file = spec.value_file(rank)
        held: List[events.Exit] = []  # the rank's exit, until its value is with the driver
        sends = value_route(run.returns_value(rank), value_file, False) == "channel"

        def rank_emit(event: events.Event) -> None:
            if sends and isinstance(event, events.Exit):
                held.append(event)
            else:
                emit(event)

        for line in refusals:
            emit(events.Log(rank=rank, stream="stderr", line=f"[torchdist] {line}"))
        if copy:
            line = hostcopy.fetch(run, copy, rank, driver.stopped)
            if line:
                emit(events.Log(rank=rank, stream="stderr", line=line))
        if driver.stopped():
            raise RunStopped(f"the run was stopped before rank {rank} started")
        job_file = os.path.join(workdir, "job.pkl")
        write_job_file(job_file, spec.job_bytes)
        gpu_source = open_gpus(run)
        proc = start_rank(
            # the worker connects where its launcher did: the machine's relay (without TLS), or the driver
            dataclasses.replace(run, channel_address=relay.address, channel_cert="") if relay is not None else run,
            place,
            job_file,
            os.path.join(workdir, f"rank-{rank}"),
            rank_emit,
            data_file=data_file,
            value_file=value_file,
            values_copy=copy,
            cleanup=[workdir],
            gpu_source=gpu_source,
            host=site.record_host(),
        )
        driver.dump_stacks = proc.dump_stacks
        guard.stdin.write(f"{proc.pgid} {proc.mark}\n")
        guard.stdin.flush()
        while not proc.exited.wait(0.05):
            if driver.stopped():
                stop_all([proc], driver.grace)
        value, where = None, ""
        route = value_route(proc.returncode == 0 and run.returns_value(rank), value_file, channel.lost)
        if route == "file":
            where = value_file if os.path.exists(value_file) else ""
        elif route == "outcome":
            value = read_result(proc.result_dir)
        elif route == "channel":
            result = os.path.join(proc.result_dir, RESULT_FILE)
            # the rank has ended; its exit waits for the value, GiBs maybe: the log says why
            emit(events.Log(rank=rank, stream="stderr", line=valueupload.sending_line(result, rank)))
            line = valueupload.send(run, result, rank)
            emit(events.Log(rank=rank, stream="stderr", line=line))
            where = spec.value_path(rank)
        for event in held:
            emit(event)
        return value, where
    finally:
        if proc is not None:
            stop_all([proc], STOP_GRACE)  # also reaches what the worker left in its group
        if gpu_source is not None:
            gpu_source.close()
        if port is not None:
            port.close()
        shutil.rmtree(workdir, ignore_errors=True)
        try:
            guard.stdin.write("done\n")
            guard.stdin.close()
        except OSError:
            pass
        guard.wait()


# -- a launcher started by a command line ---------------------------------------------------------


def write_spec(path: str, spec: RemoteSpec) -> None:
    """Write ``spec`` where a command-line launcher reads it: a new file, its owner's only (it
    holds the run's launcher secret)."""
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "wb") as fh:
        pickle.dump(spec, fh, protocol=pickle.HIGHEST_PROTOCOL)


def launcher_command(spec_file: str, rank: int, python: str = sys.executable) -> List[str]:
    """The command line that runs rank ``rank``'s launcher from ``spec_file`` (``write_spec``),
    with ``python`` (an interpreter that has torchdist_magic, torch and the job's packages)."""
    return [python, "-m", "torchdist_magic.launch.remote", spec_file, str(rank)]


class CommandLineSite(Site):
    """The site of a launcher started by ``launcher_command``: its address is the one this
    machine reaches the driver from; its GPUs those of its ``CUDA_VISIBLE_DEVICES``."""

    def __init__(self, rank: int, driver_host: str):
        super().__init__(rank)
        self.driver_host = driver_host

    def address(self) -> str:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((self.driver_host, 9))  # a datagram socket sends nothing on connect
            return probe.getsockname()[0]

    def gpus(self) -> Optional[str]:
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    def placement(self, peers: List[events.Joined], use_gpu: bool) -> Placement:
        """As torchrun places them: ranks of one host numbered locally in rank order
        (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), hosts in the order of their first rank
        (``GROUP_RANK``), rank 0's address as ``MASTER_ADDR``; a rank without ``--gpu`` sees no GPU."""
        gpus = [p.gpus for p in peers] if use_gpu else [""] * len(peers)
        return place_ranks([p.host for p in peers], peers[0].address, peers[0].port, gpus)[self.rank]


class SlurmSite(CommandLineSite):
    """A launcher started by ``srun`` as a step of the run's allocation: its node is the one
    Slurm names (``SLURMD_NODENAME``: several nodes may share a machine, as several ``slurmd
    -N`` do), and its GPUs those Slurm bound to the step (``CUDA_VISIBLE_DEVICES``)."""

    def host(self) -> str:
        return os.environ.get("SLURMD_NODENAME") or super().host()

    def record_host(self) -> str:
        return os.environ.get("SLURMD_NODENAME", "")


#: the sites a command-line launcher runs under, by ``RemoteSpec.site``
SITES = {"command-line": CommandLineSite, "slurm": SlurmSite}


def main(argv: Sequence[str]) -> int:
    """``python -m torchdist_magic.launch.remote SPEC RANK``: run the launcher, print the rank's
    ``Exit`` (``EXIT_MARK``) as the last line, and exit 0 when the rank did."""
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m torchdist_magic.launch.remote SPEC_FILE RANK", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as fh:  # written by this user's driver (write_spec), never a socket's
        spec = pickle.load(fh)
    site = SITES[spec.site](int(argv[1]), spec.run.channel_address.rpartition(":")[0])
    outcome = run_launcher(spec, site)
    print(EXIT_MARK + json.dumps(outcome.exit_json), flush=True)
    return 0 if outcome.exit_json.get("code") == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
