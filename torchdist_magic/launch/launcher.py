"""Start one rank's worker process, forward its output line by line, report its exit.

Every backend starts its ranks here (``start_rank``): the local backend from threads of the
driver, every other through ``remote``'s launcher (a Spark task, a command line), so a rank's
logs, exit code and failure look the same wherever it ran.  The worker runs in a
process group of its own so that stopping it reaches its children (DataLoader workers, ...).
The launcher is what reports a rank's ``Exit``: what the process did, read from the operating
system and the worker's ``error.json``, never what a message claims.  Asked for the rank's stacks
(a hang, a timeout), it signals the worker and reports what ``faulthandler`` wrote as ``Stacks``.

A process the rank started in a session of its own has left that group: the launcher marks the
rank's environment (``procs.MARK_VARIABLE``, a value of this rank's alone) and, once the rank's
process has ended, ends whatever still carries the mark (``procs.end_marked_processes``).
Every signal sent to a rank, and every stop that failed, is logged to the ``torchdist_magic``
logger (silent unless the application turns logging on).

System metrics.  Unless told not to, the launcher samples the rank's process group every
``timing.SYSTEM_METRICS_INTERVAL`` seconds from a thread of its own (``sysmetrics.RankSampler``,
with the rank's GPUs through a ``gpu_metrics.GpuSource`` when it has any) and emits
``SystemMetrics``.  The last sample explains the rank's end: a SIGKILL near its memory limit is
reported as "probably out of memory", a CUDA out-of-memory error gets the device memory.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..core import events, timing, values
from .gpu_metrics import GpuSource, open_gpu_source, rank_device
from ..core.procs import MARK_VARIABLE, end_marked_processes, group_members, marked_processes
from .sysmetrics import RankSampler, explain_cuda_oom, is_cuda_oom
from ..core.timing import OUTPUT_GATHER, PIPE_DRAIN_WAIT, REAP_WAIT, STACKS_SETTLE, STACKS_WAIT, STOP_GRACE
from ..core.names import ERROR_FILE, RESULT_FILE, STACKS_FILE, STACKS_HEADER, STACKS_SIGNAL
from ..core.names import CLEANUP_ENV, LAUNCHER_PID_ENV, RUN_ID_ENV, VALUE_FILE_ENV, VALUES_COPY_ENV
from ..core.rankenv import Placement, RunSpec, rank_environment
from ..wire.batching import MERGED_LOG_CHARS

_LINE_END = re.compile(rb"\r\n|\n|\r")
_OUTPUT_END = events.OUTPUT_END_MARK.encode()
#: a read of a rank's output shorter than this is followed by a pause (``OUTPUT_GATHER``)
_GATHER_BELOW = 16 * 1024
#: of one stack dump sent to the driver (faulthandler caps threads and frames; this caps the rest)
MAX_STACKS_CHARS = 256 * 1024

log = logging.getLogger("torchdist_magic")
if not log.handlers:  # the application decides where the package's log goes; by default nowhere
    log.addHandler(logging.NullHandler())


#: the lowest port a run's store is given: above the ports services are set up on (Ray's workers
#: take 10002-19999 by default), below the system's ephemeral range (``reserve_port``)
PORT_FLOOR = 20000
#: how many ports below the ephemeral range ``reserve_port`` tries before it takes one in it
PORT_TRIES = 64


def reserve_port(host: str = "") -> socket.socket:
    """A port for rank 0's store, bound (without listening) and kept: the socket.

    The port is chosen below the system's ephemeral range (``PORT_FLOOR`` up), where no
    ``bind(0)`` and no outgoing connection is given a port.  A bound socket that does not listen
    cannot keep out another that binds with ``SO_REUSEADDR`` (a kernel's ZeroMQ sockets do), and
    those who pick a "free" port by binding port 0 and closing it (Jupyter's kernel launcher)
    pick from that range: a port there could be taken between now and rank 0's listen, which
    then fails with EADDRINUSE.  The port is bound first without ``SO_REUSEADDR``, which fails
    wherever any other socket holds it (another run's reservation included), and then with it,
    so that rank 0's TCPStore (which binds with ``SO_REUSEADDR``) can listen on it.  Where the
    system leaves no room below its ephemeral range, a port in it (``bind(0)``).
    """
    low = _ephemeral_low()
    if low - PORT_FLOOR >= 1024:
        excluded = _reserved_ports()
        choose = random.SystemRandom()
        for _ in range(PORT_TRIES):
            port = choose.randrange(PORT_FLOOR, low)
            if port in excluded:
                continue
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            return sock
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


def _ephemeral_low() -> int:
    """The lowest port of the system's ephemeral range (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _reserved_ports() -> set:
    """The ports the system keeps for services (``ip_local_reserved_ports``: "8080,9000-9010")."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_reserved_ports") as fh:
            text = fh.read().strip()
    except OSError:
        return set()
    ports: set = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        try:
            ports.update(range(int(first), int(last or first) + 1))
        except ValueError:
            continue
    return ports


def write_job_file(path: str, job_bytes: bytes) -> None:
    """Write a pickled job where its ranks read it: a new file, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(job_bytes)


def start_rank(
    run: RunSpec,
    place: Placement,
    job_file: str,
    result_dir: str,
    emit: Callable[[events.Event], None],
    *,
    data_file: str = "",
    value_file: str = "",
    values_copy: str = "",
    cleanup: Sequence[str] = (),
    gpu_source: Optional[GpuSource] = None,
    host: str = "",
) -> "RankProcess":
    """Start the worker of ``place.rank`` for ``run``, the way every backend does: its
    environment (``rankenv.rank_environment``), the files it removes itself if its launcher
    dies (``cleanup``), where it writes its value (``value_file``: a file the driver maps; else
    its ``result_dir``), its system metrics (with the GPUs of ``gpu_source``, ``open_gpus``),
    the machine's copy of the notebook values that this launcher fetched or found whole
    (``values_copy``, ``hostcopy``: the one file the rank maps for them), the name its
    records give its machine (``host``: the backend's, e.g. a Slurm node's; "": the host name)."""
    env = rank_environment(os.environ, run, place, data_file=data_file)
    env[CLEANUP_ENV] = os.pathsep.join(cleanup)
    if value_file:
        env[VALUE_FILE_ENV] = value_file
    env.pop(VALUES_COPY_ENV, None)  # never one this launcher inherited
    if values_copy:
        env[VALUES_COPY_ENV] = values_copy
    return RankProcess(
        place.rank,
        job_file,
        result_dir,
        env,
        emit,
        system_metrics=run.system_metrics,
        gpu_source=gpu_source,
        host=host,
    )


def open_gpus(run: RunSpec) -> Optional[GpuSource]:
    """NVML, for the ranks' GPU metrics: a run with GPUs and system metrics, where NVML is there."""
    return open_gpu_source() if run.system_metrics and run.use_gpu else None


def read_failure(result_dir: str) -> Optional[events.Failure]:
    """The failure the worker wrote, or ``None`` when there is none or it is unreadable."""
    try:
        with open(os.path.join(result_dir, ERROR_FILE), encoding="utf-8") as fh:
            return events.failure_from_json(json.load(fh))
    except (OSError, ValueError):  # MalformedEvent is a ValueError
        return None


def read_result(result_dir: str) -> Optional[bytearray]:
    """The value blob a worker wrote into ``result_dir`` (``values.read``), or ``None``."""
    try:
        return values.read(os.path.join(result_dir, RESULT_FILE))
    except FileNotFoundError:
        return None


def rank_mark(env: Dict[str, str], rank: int) -> str:
    """The value of ``MARK_VARIABLE`` for ``rank`` started with ``env``: its run, attempt and
    rank, so that ending one rank's processes never touches another's."""
    run_id = env.get(RUN_ID_ENV) or uuid.uuid4().hex  # no run: a mark of its own
    return f"{run_id}:{env.get('TORCHDIST_RESTART_COUNT', '0')}:{rank}"


class RankProcess:
    """One worker process.  Emits ``Log`` records while it runs and one ``Exit`` at the end,
    once what the rank left running (``mark``) has been ended too."""

    def __init__(
        self,
        rank: int,
        job_file: str,
        result_dir: str,
        env: Dict[str, str],
        emit: Callable[[events.Event], None],
        python: str = sys.executable,
        *,
        system_metrics: bool = True,
        gpu_source: Optional[GpuSource] = None,
        host: str = "",
    ):
        """``system_metrics``: sample the rank's processes (and, with ``gpu_source``, the GPUs of
        its ``CUDA_VISIBLE_DEVICES``) and emit ``SystemMetrics``."""
        self.rank = rank
        self.result_dir = result_dir
        self.emit = emit
        self.host = host or socket.gethostname()
        self.stopping = False
        #: between SIGTERM and SIGKILL for what the rank left running (a stop's own grace)
        self.grace = STOP_GRACE
        self.exited = threading.Event()
        self.returncode: Optional[int] = None
        self.mark = rank_mark(env, rank)
        os.makedirs(result_dir, exist_ok=True)
        self.proc = subprocess.Popen(
            [python, "-m", "torchdist_magic.rank.worker", job_file, result_dir],
            env={**env, MARK_VARIABLE: self.mark, LAUNCHER_PID_ENV: str(os.getpid())},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.pgid = self.proc.pid
        self._readers = [
            threading.Thread(target=self._forward, args=(self.proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._forward, args=(self.proc.stderr, "stderr"), daemon=True),
        ]
        for t in self._readers:
            t.start()
        self._ended = threading.Event()  # the process has exited: sampling stops
        self.sampler: Optional[RankSampler] = None
        if system_metrics:
            devices = rank_device(env) if gpu_source is not None else []
            self.sampler = RankSampler(self.pgid, gpu=(gpu_source, devices) if devices else None)
            threading.Thread(target=self._sample, name=f"torchdist-system-rank{rank}", daemon=True).start()
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _sample(self) -> None:
        """Emit the rank's system metrics until it exits: every ``SYSTEM_METRICS_INTERVAL``, and
        more often while its memory is near its limit (``sysmetrics.NEAR_LIMIT_FAST``)."""
        interval = 0.0  # the first sample at once: a short rank is seen too
        while not self._ended.wait(interval):
            try:
                values = self.sampler.sample()
            except Exception:  # a sample is never worth the rank: log it, go on
                log.exception("rank %d: sampling its system metrics failed", self.rank)
                values = {}
            if values and not self._ended.is_set():
                self.emit(events.SystemMetrics(rank=self.rank, values=values, time=time.time()))
            interval = (
                timing.SYSTEM_METRICS_FAST_INTERVAL if self.sampler.near_limit() else timing.SYSTEM_METRICS_INTERVAL
            )

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
            self._lines(stream, [(text, end == b"\r") for text, end in zip(parts, ends) if text or end != b"\r"])
            # (a \r at a line's start, as tqdm's redraws begin, moves nothing)
            pending = parts[-1] + (b"\r" if hold_cr else b"")
            if len(chunk) < _GATHER_BELOW:
                # A rank that prints a line per training step would otherwise wake this thread
                # once a line, and on a busy machine each wake-up takes a core from the ranks
                # for a moment: after a short read, let lines gather in the pipe a little, so
                # that one wake-up reads many.  The first line after a quiet spell is read at
                # once; a rank printing fast fills its reads and is read without a pause.
                time.sleep(OUTPUT_GATHER)
        if pending:
            self._line(stream, pending.rstrip(b"\r"), pending.endswith(b"\r"))
        pipe.close()

    def _lines(self, stream: str, lines: Sequence[Tuple[bytes, bool]]) -> None:
        """The lines of one read, ``(text, cr)`` in order, in as few ``Log`` records as keep
        them apart: a line and the plain lines that follow it are one record (``Log.more``), as
        a client's flush is, so that the driver takes a read of a rank that prints every step
        at once and not a line at a time; a redrawn line (``cr``) or a warm job's end mark is a
        record of its own."""
        group: List[str] = []
        size = 0
        for text, cr in lines:
            if cr or _OUTPUT_END in text:
                self._group(stream, group)
                group, size = [], 0
                self._line(stream, text, cr)
                continue
            line = text.decode("utf-8", "replace")
            if group and size + len(line) > MERGED_LOG_CHARS:
                self._group(stream, group)
                group, size = [], 0
            group.append(line)
            size += len(line)
        self._group(stream, group)

    def _group(self, stream: str, group: List[str]) -> None:
        if group:
            self.emit(events.Log(rank=self.rank, stream=stream, line=group[0], more=group[1:]))

    def _line(self, stream: str, text: bytes, cr: bool) -> None:
        mark = text.find(_OUTPUT_END) if not cr else -1
        if mark >= 0:  # a warm rank's job ended; what it wrote before on the same line is a line
            if mark:
                self._line(stream, text[:mark], False)
            job_id = text[mark + len(_OUTPUT_END) :].decode("utf-8", "replace")
            self.emit(events.OutputEnd(rank=self.rank, job_id=job_id, stream=stream))
            return
        self.emit(events.Log(rank=self.rank, stream=stream, line=text.decode("utf-8", "replace"), cr=cr))

    def _wait(self) -> None:
        code = self.proc.wait()
        when = time.time()
        self._ended.set()
        self.returncode = code
        try:
            # what the rank started in a session of its own outlives its group: it goes with the rank
            end_marked_processes(self.mark, self.grace, REAP_WAIT)
        except Exception:  # never at the cost of the exit report
            log.exception("rank %d: ending the processes it left running failed", self.rank)
        for t in self._readers:
            t.join(timeout=PIPE_DRAIN_WAIT)  # a grandchild holding the pipe must not delay the exit report
        failure = None
        if code != 0:
            failure = events.Failure.from_exit(
                self.rank, code, host=self.host, time=when, reported=read_failure(self.result_dir)
            )
            if self.sampler is not None and not self.stopping:
                failure = self._explain(failure, code)
        self.emit(
            events.Exit(
                rank=self.rank,
                code=code,
                time=when,
                host=self.host,
                stopped=self.stopping and code != 0,
                failure=failure,
            )
        )
        self.exited.set()

    def _explain(self, failure: events.Failure, code: int) -> events.Failure:
        """``failure`` with what the rank's last system metrics say about it: a SIGKILL near its
        memory limit, a CUDA out-of-memory error's device memory."""
        if not failure.exc_type:
            why = self.sampler.explain_kill(code)
            return failure.for_rank(self.rank, message=why) if why else failure
        if is_cuda_oom(failure.exc_type, failure.message):
            return failure.for_rank(self.rank, message=explain_cuda_oom(failure.message, self.sampler.last))
        return failure

    def dump_stacks(self) -> None:
        """Ask the worker for every thread's stack; one ``Stacks`` record follows, from a thread
        of its own (within ``STACKS_WAIT``), with a note instead of stacks when there are none."""
        threading.Thread(target=self._dump_stacks, name=f"torchdist-stacks-rank{self.rank}", daemon=True).start()

    def _dump_stacks(self) -> None:
        try:
            record = self._read_stacks()
        except OSError as exc:  # the rank ended meanwhile, and its files with it
            record = events.Stacks(rank=self.rank, time=time.time(), note=f"no stack: {exc}")
        self.emit(record)

    def _read_stacks(self) -> events.Stacks:
        path = os.path.join(self.result_dir, STACKS_FILE)
        try:
            with open(path, "rb") as fh:
                header = fh.readline()
                start = fh.seek(0, os.SEEK_END)
        except FileNotFoundError:
            header, start = b"", 0
        prefix = STACKS_HEADER.encode()
        if not self.alive():
            return events.Stacks(rank=self.rank, time=time.time(), note="the rank had exited")
        if not (header.startswith(prefix) and header.endswith(b"\n")):
            # before the worker's handler is in place the signal would kill it
            return events.Stacks(rank=self.rank, time=time.time(), note="the rank had not started its job yet")
        self.proc.send_signal(STACKS_SIGNAL)
        size, changed = start, time.monotonic()
        deadline = changed + STACKS_WAIT
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now_size = os.path.getsize(path)
            if now_size != size:
                size, changed = now_size, time.monotonic()
            elif size > start and time.monotonic() - changed >= STACKS_SETTLE:
                break
        with open(path, "rb") as fh:
            fh.seek(start)
            text = fh.read(size - start).decode("utf-8", "replace")
        if len(text) > MAX_STACKS_CHARS:
            text = text[:MAX_STACKS_CHARS] + "\n  ... (cut)\n"
        return events.Stacks(
            rank=self.rank,
            text=text,
            main_thread=int(header[len(prefix) :]),
            time=time.time(),
            note="" if text else "the rank did not answer",
        )

    def signal_group(self, sig: int, why: str) -> bool:
        """Send ``sig`` to the rank's process group; whether it reached any process."""
        name = signal.Signals(sig).name
        if self._ended.is_set() or self.proc.returncode is not None:
            # the worker, the group's leader, is reaped: once the rest of its group is gone, the
            # group's id is free for any process of the machine (a stop may come long after, while
            # --pdb holds another rank), so only members that carry the rank's mark are signalled
            members = set(group_members(self.pgid)) & set(marked_processes(self.mark))
            for pid in members:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if members:
                log.info(
                    "rank %d: sent %s to what is left of its process group %d (%s), %s",
                    self.rank,
                    name,
                    self.pgid,
                    ", ".join(map(str, sorted(members))),
                    why,
                )
            return bool(members)
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:  # none of the group is left
            return False
        except OSError as exc:
            log.warning("rank %d: could not send %s to its process group %d: %s", self.rank, name, self.pgid, exc)
            return False
        log.info("rank %d: sent %s to its process group %d, %s", self.rank, name, self.pgid, why)
        return True

    def alive(self) -> bool:
        return self.proc.poll() is None


def stop_all(procs, grace: float) -> None:
    """SIGTERM every live process group, one shared deadline, then SIGKILL what is left.  Each
    rank's end also ends what it left running in a session of its own (``RankProcess._wait``),
    with the same grace."""
    for p in procs:
        if p.alive():
            p.stopping = True
            p.grace = grace
            p.signal_group(signal.SIGTERM, f"stopping the rank ({grace:g} s before SIGKILL)")
    deadline = time.monotonic() + max(grace, 0.0)
    for p in procs:
        p.exited.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        # the group, not just the leader: children of an exited worker must not survive either
        p.signal_group(signal.SIGKILL, f"what was left of it {grace:g} s after the stop began")
    for p in procs:
        if not p.exited.wait(timeout=REAP_WAIT + p.grace):  # its end: SIGKILL's, then its leftovers'
            log.warning(
                "rank %d: process %d has not ended (or not been reported) %g s after SIGKILL",
                p.rank,
                p.pgid,
                REAP_WAIT + p.grace,
            )
