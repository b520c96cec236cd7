"""What runs inside a Spark executor: one barrier task per rank (classic, Connect and data runs).

Every Spark flavour's task runs ``run_barrier_task``: it joins the run's event channel as the
rank's launcher, meets the other tasks (``rendezvous``), starts the rank's worker with the same
launcher as the local backend (``RankProcess``), forwards its records and returns its outcome.
A Connect stage and any data run's stage are ``mapInArrow`` functions (``run_arrow_task``): the
same task, its outcome as Arrow rows, and a failed rank raised with ``FAILURE_MARK`` so that the
barrier stage fails at once.

Stopping.  Each task holds a launcher connection on the run's event channel; when the driver
sends ``events.Stop`` over it, the task gives its worker SIGTERM, the grace, then SIGKILL,
reports the exit and returns.  A ``Stop`` may reach one task alone (under ``--pdb`` the other
ranks stop while a failed rank is held for a debugger): its rows or outcome then say "stopped",
which ends the task without failing the barrier stage, and the held rank's task goes on.  A task
can also be killed outright (Spark kills the Python process of a cancelled or failed stage's
task with SIGKILL after ``spark.python.task.killTimeout``), and then no ``finally`` runs: so
each task also starts a small guard process in a session of its own, which notices the task's
end and, unless the task said "done", stops the worker's process group and removes the task's
files.

Notebook values.  Where the job names values to fetch (``RunSpec.values_fetch``), the task joins
its machine's users of their copy before anything else and hands that lock to its guard, then,
after the rendezvous, fetches them or waits for the task of its machine that does (``hostcopy``);
the guard, at the task's end or after its kill, removes the copy when it was its machine's last
user.

A rank's value.  A task that sees the driver's value directory has its rank write its value
there (``BarrierTaskSpec.value_file``); any other sends the file its rank wrote to the driver over
the run's channel (``valueupload``), which writes it into that directory, before it reports the
rank's exit.  Either way the stage's outcome names the file, which the driver maps.  Only a task
that cannot reach the channel returns the value itself, through Spark.

Nothing here imports pyspark at module level, and nothing here is driver code: the driver's side
of the stage is ``spark_stage``.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple

from ..core import events, procs
from ..launch import hostcopy, valueupload
from ..wire.client import ChannelClient
from ..launch.gpu_metrics import open_gpu_source
from ..launch.launcher import RankProcess, read_result, reserve_port, stop_all, write_job_file
from ..core.privdir import check_private, open_private
from ..core.rankenv import RunSpec, place_spark_tasks, rank_environment, rank_key
from ..core.timing import STOP_GRACE
from ..core.values import host_copy_path
from ..core.names import RESULT_FILE, VALUE_FILE_ENV
from ..core.names import CLEANUP_ENV

#: lines of a rank's output a task keeps, for when its channel to the driver is lost
LOG_TAIL = 20
#: how a failed rank's task marks its ``Exit`` in the exception its stage fails with
FAILURE_MARK = "torchdist-rank-exit:"
#: bytes of a value per result row of an Arrow stage: well under Spark Connect's default gRPC
#: message limit (``spark.connect.grpc.maxInboundMessageSize``, 128 MiB) and its Arrow batch size
CHUNK = 4 * 1024 * 1024
#: the rows an Arrow stage's task yields
SCHEMA = "rank int, kind string, chunk binary"

# The guard: runs ``procs`` (standard library only) with this below it, and reads lines from the
# task on stdin: each rank's process group id and mark, then "done" once the task has cleaned up
# itself.  End of input without "done" means the task was killed: SIGTERM the worker's group, wait
# up to the grace for the worker to exit (an orphan may stay a zombie for a while: that counts as
# exited), SIGKILL what is left of the group, end what the rank started in a session of its own
# (its mark), remove the files.  Either way, it then leaves the users of the machine's copy of the
# notebook values (``hostcopy``: the shared lock it holds on fd ``users``, -1 for none) and removes
# the copy when it was the last.
_GUARD_MAIN = r"""
import fcntl, shutil, sys
workdir, grace, users, copy = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def leave_copy():
    if users < 0:
        return
    fcntl.flock(users, fcntl.LOCK_UN)
    try:
        fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another task of this machine uses the copy: the last one removes it
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
ranks = []
for line in sys.stdin:
    if line.strip() == "done":
        leave_copy()
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
"""


def guard_source() -> str:
    """The guard's program: ``procs``' source, then ``_GUARD_MAIN``."""
    with open(procs.__file__, encoding="utf-8") as fh:
        return fh.read() + _GUARD_MAIN


class RankExited(Exception):
    """Raised by an Arrow task whose rank failed: its message carries the rank's ``Exit`` as JSON."""


@dataclass
class BarrierTaskSpec:
    """Everything a barrier task needs; travels to the executors inside the stage's closure."""

    run: RunSpec
    job_bytes: bytes
    #: a data run's Arrow schema (serialized), for a task whose partition is empty; else None
    data_schema: Optional[bytes] = None
    #: the driver's directory for the ranks' values: a task that sees it (on the driver's
    #: machine, or a file system they share) has its rank write its value there, which the
    #: driver then maps; any other sends it there over the run's channel (``valueupload``)
    value_dir: str = ""
    #: every task sends its rank's value over the channel, even one that sees ``value_dir``
    #: (``TORCHDIST_VALUES_FETCH=1``: a cluster's path, tested on one machine)
    values_sent: bool = False

    def value_path(self, rank: int) -> str:
        """The file of ``rank``'s value in the driver's value directory."""
        return os.path.join(self.value_dir, f"rank-{rank}.value")

    def value_file(self, rank: int) -> str:
        """Where ``rank`` writes its value for the driver to map; ``""`` when this task cannot
        see the driver's value directory (or ``values_sent``).  The directory must be this
        user's own (``privdir.check_private``) and hold the run's mark with the content only the
        driver and the run's tasks can make (``value_dir_token``): a directory of that name that
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


def value_dir_mark(run_id: str) -> str:
    """The file that marks the driver's value directory of run ``run_id``."""
    return f".torchdist-run-{run_id}"


def value_dir_token(run: RunSpec) -> bytes:
    """What the mark of the driver's value directory of ``run`` holds: derived from the run's
    launcher secret, which the driver and the run's tasks know, and a rank's worker does not."""
    return hmac.new(run.launcher_secret.encode(), f"torchdist value directory {run.run_id}".encode(),
                    hashlib.sha256).hexdigest().encode()


class RunStopped(Exception):
    """The driver stopped the run before this task started its rank."""


class DriverMessages:
    """What the driver sends this task over the channel: ``Stop`` (``stopped()``, with the
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
        (the driver decides within ``SPARK_RENDEZVOUS_WAIT`` of the first task's ``Joined``)."""
        while not self._peers.wait(0.01):
            if channel.lost or self.stopped():
                return None
        return self.peer_list


@dataclass
class TaskOutcome:
    """What a barrier task returns to the driver, for the ranks whose channel may have been lost."""

    rank: int
    value: Optional[bytes]          # the rank's value blob (``values``), when it is wanted
    exit_json: dict                 # its ``Exit`` record, encoded
    channel_lost: bool = False      # the driver heard nothing live from this task
    log_tail: List[str] = field(default_factory=list)  # the rank's last lines of output
    value_file: str = ""            # where the value is instead, in the driver's value directory


def run_barrier_task(spec: BarrierTaskSpec, partition) -> List[TaskOutcome]:
    """One barrier task: run one rank, report it live over the channel, and return its outcome.
    A data run's ``partition`` (Arrow batches) is the rank's rows; otherwise it is ignored."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    rank = context.partitionId()
    driver = DriverMessages()
    channel = ChannelClient(spec.run.channel_address, rank_key(spec.run.launcher_secret, "launcher", rank),
                            spec.run.run_id, rank,
                            role="launcher", on_message=driver.on_message, certificate=spec.run.channel_cert)
    exits: List[events.Exit] = []
    tail: "collections.deque[str]" = collections.deque(maxlen=LOG_TAIL)

    def emit(event: events.Event) -> None:
        if isinstance(event, events.Exit):
            exits.append(event)
        elif isinstance(event, events.Log) and not event.cr:
            tail.append(event.line)
        channel.send(event)

    try:
        value, value_file = _run_rank(spec, context, rank, channel, emit, driver,
                                      partition if spec.data_schema is not None else None)
    except Exception as exc:  # the task's own failure (not the rank's): report it as this rank's
        value, value_file = None, ""
        host = socket.gethostname()
        emit(events.Exit(rank=rank, code=1, time=time.time(), host=host, stopped=driver.stopped(),
                         failure=events.Failure.from_exception(rank, exc, host=host, exit_code=1)))
    lost = channel.lost
    channel.close()
    final = exits[-1]
    if final.failure is not None:  # its output travels with it when nothing else carries it
        final = dataclasses.replace(final, failure=final.failure.for_rank(rank, log_tail=list(tail)))
    # the last lines go back through Spark only when the channel did not carry them: at a
    # thousand ranks, long lines would otherwise fill spark.driver.maxResultSize with copies
    return [TaskOutcome(rank, value, events.encode(final), channel_lost=lost,
                        log_tail=list(tail) if lost else [], value_file=value_file)]


def host_identity() -> str:
    """What tells this executor's machine apart from the others of the run: its host name, and
    the address its executor binds (``SPARK_LOCAL_IP``) when one is set."""
    bind = os.environ.get("SPARK_LOCAL_IP", "")
    return f"{socket.gethostname()}/{bind}" if bind else socket.gethostname()


def task_address(context, rank: int) -> str:
    """The address other ranks reach this task's host at: its executor's bind address when
    set, else the address Spark knows the executor by."""
    return os.environ.get("SPARK_LOCAL_IP") or context.getTaskInfos()[rank].address.rpartition(":")[0]


def rendezvous(context, channel: ChannelClient, driver: DriverMessages, mine: events.Joined) -> List[events.Joined]:
    """Every task's ``Joined``, in rank order: through the driver (its ``Peers``), or, when some
    task could not reach it, through Spark's barrier ``allGather`` (which waits in steps of a
    second, the reason it is not the first choice)."""
    channel.send(mine)
    peers = driver.peers(channel)
    if peers is not None and not peers.use_barrier:
        return peers.peers
    gathered = context.allGather(events.dumps(mine))
    return [events.loads(text) for text in gathered]


def _run_rank(spec: BarrierTaskSpec, context, rank: int, channel: ChannelClient,
              emit: Callable[[events.Event], None], driver: DriverMessages,
              batches=None) -> Tuple[Optional[bytearray], str]:
    """Start and watch the rank; its value blob, or the file in the driver's value directory
    that holds it (``BarrierTaskSpec.value_path``): written there by the rank, or sent there by
    this task (``valueupload``: the rank's ``Exit`` is held back until then, and a value that
    could not be sent raises).  The blob comes back through Spark only where this task cannot
    reach the driver's channel.  ``batches``: its rows, written to a file of the task's workdir as they arrive
    (after the rendezvous, so that a large partition does not hold it up)."""
    run = spec.run
    workdir = tempfile.mkdtemp(prefix=f"torchdist-{run.run_id}-rank{rank}-")
    copy = host_copy_path(run.values_fetch, run.values_fetch_size) if run.values_fetch else ""
    users = hostcopy.join(copy) if copy else -1
    try:
        guard = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", guard_source(), workdir, str(STOP_GRACE), str(users), copy],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, TORCHDIST_RUN_ID=run.run_id), start_new_session=True, text=True,
            pass_fds=(users,) if users >= 0 else ())
    finally:
        if users >= 0:
            os.close(users)  # the lock is the guard's now: it lets go of it when the task has ended
    port = reserve_port("") if rank == 0 else None
    proc: Optional[RankProcess] = None
    gpu_source = None
    try:
        gpus = None
        if run.use_gpu:
            resource = context.resources().get("gpu")
            gpus = ",".join(resource.addresses) if resource is not None else None
        mine = events.Joined(rank=rank, host=host_identity(), address=task_address(context, rank), gpus=gpus,
                             port=port.getsockname()[1] if port is not None else None)
        peers = rendezvous(context, channel, driver, mine)
        place = place_spark_tasks([p.host for p in peers], peers[0].address, peers[0].port,
                                  run.use_gpu, [p.gpus for p in peers])[rank]
        data_file = ""
        if batches is not None:
            from ..launch.partitions import write_batches

            data_file = os.path.join(workdir, "data.arrow")
            write_batches(data_file, batches, spec.data_schema, driver.stopped)
        env = rank_environment(os.environ, run, place, data_file=data_file)
        env[CLEANUP_ENV] = workdir  # the worker removes it if it outlives this task
        value_file = spec.value_file(rank)
        if value_file:
            env[VALUE_FILE_ENV] = value_file
        held: List[events.Exit] = []  # the rank's exit, until its value is with the driver
        sends = not value_file and run.returns_value(rank)

        def rank_emit(event: events.Event) -> None:
            if sends and isinstance(event, events.Exit):
                held.append(event)
            else:
                emit(event)

        if copy:
            line = hostcopy.fetch(run, copy, rank, driver.stopped)
            if line:
                emit(events.Log(rank=rank, stream="stderr", line=line))
        job_file = os.path.join(workdir, "job.pkl")
        write_job_file(job_file, spec.job_bytes)
        if driver.stopped():
            raise RunStopped(f"the run was stopped before rank {rank} started")
        result_dir = os.path.join(workdir, f"rank-{rank}")
        if run.system_metrics and run.use_gpu:
            gpu_source = open_gpu_source()
        proc = RankProcess(rank, job_file, result_dir, env, rank_emit, system_metrics=run.system_metrics,
                           gpu_source=gpu_source)
        driver.dump_stacks = proc.dump_stacks
        guard.stdin.write(f"{proc.pgid} {proc.mark}\n")
        guard.stdin.flush()
        while not proc.exited.wait(0.05):
            if driver.stopped():
                stop_all([proc], driver.grace)
        value, where = None, ""
        if proc.returncode == 0 and run.returns_value(rank):
            if value_file:
                where = value_file if os.path.exists(value_file) else ""
            elif channel.lost:  # through Spark: the driver's channel is out of this task's reach
                value = read_result(result_dir)
            else:
                result = os.path.join(result_dir, RESULT_FILE)
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
        if port is not None:
            port.close()
        if gpu_source is not None:
            gpu_source.close()
        shutil.rmtree(workdir, ignore_errors=True)
        try:
            guard.stdin.write("done\n")
            guard.stdin.close()
        except OSError:
            pass
        guard.wait()


def run_arrow_task(spec: BarrierTaskSpec, batches: Iterator) -> Iterator:
    """One barrier task of a ``mapInArrow`` stage (a Connect run, or any data run): run one rank
    and yield its exit, its output's last lines when the driver could not hear them, and its
    value in ``CHUNK``-sized rows.  The input rows are the rank's data in a data run."""
    import pyarrow as pa

    if spec.data_schema is None:
        for _ in batches:  # the input rows only make one task per rank
            pass
    outcome = run_barrier_task(spec, batches)[0]
    rank, value, exit_json = outcome.rank, outcome.value, outcome.exit_json
    exit_record = events.decode(exit_json)
    if exit_record.code not in (0, None) and not exit_record.stopped:
        raise RankExited(FAILURE_MARK + events.dumps(exit_record))
    rows = [(rank, "exit", events.dumps(exit_record).encode())]
    if outcome.channel_lost:
        rows += [(rank, "log", line.encode()) for line in outcome.log_tail]
    if outcome.value_file:
        rows.append((rank, "value_file", outcome.value_file.encode()))
    if value is not None:
        rows += [(rank, "value", value[i:i + CHUNK]) for i in range(0, len(value), CHUNK)] or [(rank, "value", b"")]
    for rank_, kind, chunk in rows:
        yield pa.RecordBatch.from_pydict({"rank": [rank_], "kind": [kind], "chunk": [chunk]},
                                         schema=pa.schema([("rank", pa.int32()), ("kind", pa.string()),
                                                           ("chunk", pa.binary())]))

