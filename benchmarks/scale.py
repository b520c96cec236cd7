"""The driver at scale, by simulation: a real ``ChannelServer`` (TLS by default, as on Spark), a
real ``RunState`` and a real view, fed by a few load-generator processes that stand in for many
ranks on hosts of ``--ranks-per-host`` ranks (8 by default), each host's ranks reaching the driver
over one real authenticated connection, as its host relay's (``wire.relay``); with
``--ranks-per-host 1``, each rank over two of its own (role worker and role launcher, as a Spark
task and its worker have).

    python benchmarks/scale.py --ranks 1024 --rate 100 --seconds 60 --view widget
                               [--ranks-per-host 8] [--tls/--no-tls] [--generators 3]
                               [--driver process|kernel] [--repeat N] [--busy both|off|on]
                               [--json benchmarks/results/scale.json]

Every simulated rank sends the project's own records at ``--rate`` records/s: per 10 records, 1
progress update, 5 metrics of 3 values and 4 log lines; progress and metrics on its worker
connection, the log lines on its launcher connection (a launcher forwards its worker's output).
The generators send what the client's own code (``batching.encode_batch``) sends, batched once
every ``batching.flush_every(ranks)`` seconds as a rank's client does (longer from
``batching.LARGE_RUN_RANKS`` ranks), but written from a template
(``batch_bytes``): they stand in for a thousand machines on a few cores, so they must cost
little.  In their first flushes they check their bytes against ``encode_batch``'s, byte for byte.

How the ranks reach the driver.  With ``--ranks-per-host N`` above 1 (the default: 8) the ranks are
grouped into hosts of N consecutive ranks (the last host may have fewer), as a cluster's machines
hold them, the generators share out whole hosts, and each host reaches the driver over one
connection: role ``relay`` of the host's first rank, with a key of the launchers' secret, its hello
naming the host's ranks.  On it the generator writes what the host's relay (``relay.HostRelay``)
would send (``fanin``): each rank's worker and launcher joined (``JOINED``), then at each flush
every frame of the host's ranks (the worker's and the launcher's above, each a segment of its rank
and role: ``relay_segments``) in one write per host (``fanin.bundle``), checked in the first
flushes against the real relay's way of splitting the client's own bytes (``relay_bytes``), and at
the end each rank's ``LEFT``.  The relay itself is not simulated: it runs on the ranks' hosts, not
the driver's, so its CPU, the ranks' loopback connections to it and its gathering (up to
``relay.RELAY_WINDOW`` more on a record's way, which the latencies here leave out) are not what
this measures; nor does a host's write here ever split a flush of its ranks in two, as a real
relay's window, which its ranks' flushes do not keep in step with, may.  ``--ranks-per-host 1`` is
the run without relays: two connections per rank, each written as that rank's client writes it.
``connections``: the connections to the driver the generators opened (one per host, or two per
rank); ``driver_connections`` (``conns``): those the driver held once all were in;
``authenticated``: the driver's count, which includes each role and rank joined through a relay.

Measured in the driver: by default (``--driver process``) a process of its own that holds the
run's channel and state, as a run's supervising process does (``--channel process``,
``--detach``: it also keeps the run's journal and serves the run's feed), this process being the
kernel, whose view reads the state through the feed (``feed.HostedState``); with ``--driver
kernel`` this process, as a run in the kernel.  ``--journal`` adds the journal a detached run
keeps (``--detach``), which a run whose kernel follows it does not.

* ``lost`` / ``out_of_order``: every log line and every metric point carries its rank's sequence
  number; progress updates are coalesced by design (only a bar's newest state counts), so they
  are counted apart (``progress_sent`` / ``progress_received``);
* latency: each log line and metric point carries the time it was made; the time from then to
  the moment ``RunState.apply`` returned (one clock: the generators run on this machine);
* ``driver_cpu_pct``: the driver's CPU time over the window (from the start signal to the last
  record applied), 100 = one core; ``driver_us_per_record`` (``us/rec``): the driver's own CPU
  microseconds (its whole process, from ``getrusage``) per record it took (a log line, a metric
  point, a progress update), next to p99 in the table: a cost per record, which a shared
  machine's load moves less than the latencies (with ``--driver kernel`` it includes the view);
  ``channel_us_per_record`` (``chan``): its channel thread's alone (receive, TLS, decode, the
  run state), from the thread's own CPU clock; ``kernel_cpu_pct``: this process's (the view's, with
  ``--driver process``); ``rss_mb_start`` / ``rss_mb_end``: the driver's, around it;
* the view: ``widget`` is ``view.widget.WidgetView`` with its own throttles, updated every
  ``SUPERVISE_POLL`` as a run's supervisor does, over a comm that serialises every message as
  ipykernel does (the JSON of the comm message): ``frame_bytes_max`` is the largest message it
  sent, ``view_mb_per_s`` their rate, ``render_ms_max`` the longest ``update()`` (wall time: it
  includes waiting for the interpreter's lock, which the channel thread holds between its
  switches), ``render_cpu_ms_max`` its CPU time (``render_cpu_ms_p50``: the median refresh's),
  ``render_gc_ms_of_longest`` the garbage collector's part of it (a full collection scans this
  process's whole heap, whoever filled it, and lands in whichever refresh allocates then:
  ``--kernel-imports torch,IPython,ipywidgets`` gives this process a notebook's heap;
  ``render_own_cpu_ms_max`` is the longest refresh less its collections), ``view_refresh_s`` the
  period the view had come to (``WidgetView.update_every``: longer where a refresh costs more); ``text`` is
  ``view.text.TextView`` writing to a counting sink (lines, bytes); ``none`` is no view.

Each run names its ranks per host (``ranks_per_host``), its machine (``machine``: CPU model and
usable cores) and the 1-minute load average before and after it (``load_before``,
``load_after``), in the table and in the JSON: a table of runs gathered from several machines
says which ran where, under what load, with or without host relays.

The machine: the generators and the driver share its cores (two on the machine these figures
were taken on, also shared with other work), so the generators' own cost, and whatever else
runs, takes from the driver's.  ``gen_cpu_pct`` and ``gen_behind_s`` say how much the generators
took and how far behind their schedule they fell (then the driver was offered less than
``--rate``, and ``offered_rate`` says how much).
"""

from __future__ import annotations

import argparse
import contextlib
import array
import gc
import importlib
import io
import json
import multiprocessing
import os
import resource
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))

from report import BusyCore, describe_machine, end_processes, load, machine, short_machine, write_json  # noqa: E402  (this script's folder is on sys.path)

sys.path.insert(0, os.path.dirname(HERE))

from torchdist_magic.wire import fanin, tls  # noqa: E402
from torchdist_magic.wire.batching import encode_batch, flush_every  # noqa: E402
from torchdist_magic.wire.frames import LENGTH, MAX_FRAME, take_frames  # noqa: E402
from torchdist_magic.wire.handshake import MAX_RELAY_RANKS, open_connection  # noqa: E402
from torchdist_magic.wire.server import ChannelServer  # noqa: E402
from torchdist_magic.core.rankenv import rank_key  # noqa: E402
from torchdist_magic.core import events, fdlimit  # noqa: E402
from torchdist_magic.core.errors import NotAvailable  # noqa: E402
from torchdist_magic.driver.handle import StateAnswers  # noqa: E402
from torchdist_magic.driver.state import RunState  # noqa: E402
from torchdist_magic.core.timing import SUPERVISE_POLL  # noqa: E402

WORKER_SECRET, LAUNCHER_SECRET = "scale-worker-secret", "scale-launcher-secret"
#: the records of every 10 a rank sends, in order: P progress, M metrics (3 values), L a log line
PATTERN = "PMLMLMLMLM"
#: how long after the last record was sent the driver may take to catch up before giving up
CATCH_UP_LIMIT = 300.0
#: how long all connections may take to authenticate
CONNECT_LIMIT = 120.0
#: per generator process: threads that open its connections at once
CONNECT_THREADS = 32


def _cpu_seconds(who=resource.RUSAGE_SELF) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _thread_cpu_seconds(thread: threading.Thread) -> float:
    """The CPU seconds ``thread`` (of this process) has used so far."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# -- load generator (a process of its own) -------------------------------------------------------


def generate(address, certificate, run_id, ranks, rate, seconds, every, go, results, hosts=None) -> None:
    """Connect two clients per rank of ``ranks`` (or, with ``hosts``, lists of ranks that cover
    ``ranks``: one host relay's connection per host), wait for ``go``, then send ``rate``
    records/s per rank for ``seconds``; put what was sent on ``results``."""
    from concurrent.futures import ThreadPoolExecutor

    context = tls.client_context(certificate) if certificate else None
    host, _, port = address.rpartition(":")
    where = (host, int(port))

    def connect(key):
        rank, role = key
        secret = LAUNCHER_SECRET if role == "launcher" else WORKER_SECRET
        return open_connection(where, rank_key(secret, role, rank), run_id, rank, role, context)

    def connect_relay(first):
        """A host relay's connection, its ranks' workers and launchers joined (``fanin``)."""
        named = of_host[first]
        sock = open_connection(
            where, rank_key(LAUNCHER_SECRET, "relay", first), run_id, first, "relay", context, ranks=named
        )
        sock.sendall(fanin.bundle(relay_joined(named, fanin.JOINED)))
        return sock

    if hosts is None:  # two connections per rank, each its own
        keys = [(r, role) for r in ranks for role in ("worker", "launcher")]
        opener = connect
    else:  # one per host, its relay's: keyed by the host's first rank
        of_host = {named[0]: named for named in hosts}
        keys = list(of_host)
        opener = connect_relay
    started = time.monotonic()
    with ThreadPoolExecutor(CONNECT_THREADS) as pool:
        socks = dict(zip(keys, pool.map(opener, keys)))
    connect_s = time.monotonic() - started
    results.put(("connected", connect_s))
    go.wait()
    cpu0 = _cpu_seconds()
    seq = {r: 0 for r in ranks}  # records made so far, per rank
    log_seq = {r: 0 for r in ranks}
    metric_seq = {r: 0 for r in ranks}
    sent = {"logs": 0, "points": 0, "progress": 0}
    behind = 0.0
    start = time.time()
    end = start + seconds
    total = int(rate * seconds)

    def make(r, upto):
        """The records rank ``r`` makes in this flush: (kind, its numbers), in order."""
        made = []
        while seq[r] < upto:
            kind = PATTERN[seq[r] % len(PATTERN)]
            seq[r] += 1
            if kind == "P":
                made.append(("P", seq[r]))
                sent["progress"] += 1
            elif kind == "M":
                metric_seq[r] += 1
                made.append(("M", metric_seq[r]))
                sent["points"] += 1
            else:
                log_seq[r] += 1
                made.append(("L", log_seq[r], seq[r]))
                sent["logs"] += 1
        return made

    tick = 0
    while True:
        tick += 1
        due_at = start + tick * every
        now = time.time()
        if due_at > now:
            time.sleep(due_at - now)
        now = time.time()
        behind = max(behind, now - due_at)
        upto = int(rate * (min(now, end) - start))  # records each rank should have made by now
        for group in hosts if hosts is not None else [ranks]:
            segments = []  # with hosts: what the host's relay sends in this flush
            expected_flushes = []  # and the client's own bytes for it, in the first flushes
            for r in group:
                made = make(r, upto)
                if not made:
                    continue
                to_worker, to_launcher = batch_bytes(made, r, now, start, total)
                if tick <= 3:  # the same bytes as the client's own encoding, or this benchmark is wrong
                    expected = client_bytes(made, r, now, start, total)
                    if (to_worker, to_launcher) != expected:
                        raise AssertionError(
                            f"scale.py's frames differ from batching.encode_batch's: "
                            f"{(to_worker, to_launcher)!r:.400} != {expected!r:.400}"
                        )
                    expected_flushes.append((r, *expected))
                if hosts is not None:
                    segments += relay_segments(r, to_worker, to_launcher)
                    continue
                if to_worker:
                    socks[(r, "worker")].sendall(to_worker)
                if to_launcher:
                    socks[(r, "launcher")].sendall(to_launcher)
            if segments:
                data = fanin.bundle(segments)
                if tick <= 3:  # the same bytes as the real relay's, or this benchmark is wrong
                    expected_data = relay_bytes(expected_flushes)
                    if data != expected_data:
                        raise AssertionError(
                            f"scale.py's relay bundle differs from the relay's: {data!r:.400} != {expected_data!r:.400}"
                        )
                socks[group[0]].sendall(data)
        if now >= end:
            break
    if hosts is not None:  # the ranks' connections to their relays end: it says so (``fanin.LEFT``)
        for first, sock in socks.items():
            sock.sendall(fanin.bundle(relay_joined(of_host[first], fanin.LEFT)))
    for sock in socks.values():
        sock.shutdown(socket.SHUT_WR)
    results.put(
        ("sent", {**sent, "behind_s": behind, "send_cpu_s": _cpu_seconds() - cpu0, "send_s": time.time() - start})
    )
    for sock in socks.values():  # the driver closes a connection once it has handled all of it
        try:
            while sock.recv(65536):
                pass
        except OSError:
            pass
        sock.close()


def frame_bodies(data: bytes) -> list:
    """The bodies of the frames of ``data`` (whole frames, each behind its ``LENGTH``), in order."""
    bodies, offset, size = [], 0, len(data)
    while offset < size:
        (length,) = LENGTH.unpack_from(data, offset)
        offset += LENGTH.size
        if offset + length > size:
            raise ValueError(f"a frame of {length} bytes cut short at {size - offset}")
        bodies.append(data[offset : offset + length])
        offset += length
    return bodies


def relay_segments(r: int, to_worker: bytes, to_launcher: bytes) -> list:
    """What a host relay sends the driver for the frames that rank ``r``'s worker (``to_worker``)
    and launcher (``to_launcher``) sent it: one segment per frame, its body, its rank and role."""
    return [fanin.segment(fanin.WORKER, r, body) for body in frame_bodies(to_worker)] + [
        fanin.segment(fanin.LAUNCHER, r, body) for body in frame_bodies(to_launcher)
    ]


def relay_joined(ranks, kind: int) -> list:
    """The segments of ``kind`` (``fanin.JOINED``, ``fanin.LEFT``) for the worker and the
    launcher of each of ``ranks``."""
    return [fanin.segment(kind, r, bytes([fanin.KINDS[role]])) for r in ranks for role in ("worker", "launcher")]


def relay_bytes(flushes) -> bytes:
    """What the real host relay sends for ``flushes`` (each ``(rank, worker's bytes, launcher's
    bytes)``, as the rank's client wrote them to it): the frames split as the relay's local server
    splits them (``frames.take_frames``), each a segment (``relay._Forward.frames``), all in one
    write (``fanin.bundle``)."""
    segments = []
    for r, to_worker, to_launcher in flushes:
        for kind, data in ((fanin.WORKER, to_worker), (fanin.LAUNCHER, to_launcher)):
            buf = bytearray(data)
            bodies, whole = take_frames(buf, MAX_FRAME)
            if not whole or buf:
                raise AssertionError(f"the client's bytes are not whole frames: {data!r:.400}")
            segments += [fanin.segment(kind, r, body) for body in bodies]
    return fanin.bundle(segments)


def _values(r: int, step: int) -> dict:
    return {"loss": 1.0 / step, "lr": 3e-4, "tokens_per_s": 12345.0 + r}


def _line(number: int, now: float, record: int) -> str:
    return f"{number} {now:.6f} step {record} loss {1.0 / record:.6f} lr 3.0e-4 tokens/s 123456"


def client_records(made, r: int, now: float, start: float, total: int):
    """The records of one flush of rank ``r`` (``made``: what ``generate`` made), for the worker
    connection and for the launcher connection, as a rank's client holds them."""
    worker, launcher = [], []
    for item in made:
        if item[0] == "P":
            worker.append(
                events.Progress(rank=r, bar="train#0", desc="train", n=item[1], total=total, elapsed=now - start)
            )
        elif item[0] == "M":
            worker.append(events.Metrics.point(r, item[1], _values(r, item[1]), now))
        else:
            launcher.append(events.Log(rank=r, line=_line(item[1], now, item[2])))
    return worker, launcher


def client_bytes(made, r: int, now: float, start: float, total: int):
    """What the client's own code (``batching.encode_batch``) sends for one flush."""
    worker, launcher = client_records(made, r, now, start, total)
    return (encode_batch(worker, r) if worker else b"", encode_batch(launcher, r) if launcher else b"")


def _frame(parts) -> bytes:
    body = ('{"events":[' + ",".join(parts) + "]}").encode("utf-8")
    return LENGTH.pack(len(body)) + body


def batch_bytes(made, r: int, now: float, start: float, total: int):
    """``client_bytes``, written straight from a template: the generators stand in for a
    thousand machines on two cores, so they must cost little (``generate`` checks the first
    flush against ``client_bytes`` byte for byte).  Holds for this benchmark's records: one
    bar, one flush's lines far below ``batching.MERGED_LOG_CHARS``, no value JSON would refuse."""
    points, lines, progress, progress_at, metrics_at = [], [], None, -1, -1
    for i, item in enumerate(made):
        if item[0] == "P":  # only a bar's newest state is sent, where it was made
            progress, progress_at = item[1], i
        elif item[0] == "M":  # every point, in one record where the first was made
            points.append(item[1])
            if metrics_at < 0:
                metrics_at = i
        else:
            lines.append(item)
    worker = []
    if progress is not None:
        worker.append(
            f'{{"rank":{r},"bar":"train#0","desc":"train","n":{progress},"total":{total},'
            f'"elapsed":{float.__repr__(now - start)},"state":"running","postfix":"","type":"progress"}}'
        )
    if points:  # column by column: the names once, then the steps, the times, each name's values
        when = float.__repr__(now)
        losses = ",".join(float.__repr__(1.0 / p) for p in points)
        count = len(points)
        metrics = (
            f'{{"rank":{r},"names":["loss","lr","tokens_per_s"],"steps":[{",".join(map(str, points))}],'
            f'"times":[{",".join([when] * count)}],"values":[[{losses}],'
            f'[{",".join([float.__repr__(3e-4)] * count)}],[{",".join([float.__repr__(12345.0 + r)] * count)}]],'
            f'"type":"metrics"}}'
        )
        worker.insert(0 if metrics_at < progress_at else len(worker), metrics)
    launcher = b""
    if lines:
        texts = [_line(item[1], now, item[2]) for item in lines]
        more = ",".join(f'"{t}"' for t in texts[1:])
        launcher = _frame(
            [f'{{"rank":{r},"stream":"stdout","line":"{texts[0]}","cr":false,"more":[{more}],"type":"log"}}']
        )
    return (_frame(worker) if worker else b""), launcher


# -- driver side -----------------------------------------------------------------------------


class Meter:
    """The driver's ``on_event``: applies each record to the run state, then counts it and the
    latency of its log lines and metric points (a histogram of 1 ms buckets: bounded memory).

    It runs on the channel thread, so it is counted in the driver's CPU: it looks at a record's
    ends, not at each of its items.  A generator makes a record's lines (and its points) in one
    flush, at one time, numbered one after the other: the first one's number and the last one's
    say whether the record follows the rank's previous one, and each item is counted at the age of
    the record's oldest (the first line's time; the earliest point's).  A record whose numbers do
    not run on is looked at item by item, so that ``out_of_order`` counts items."""

    def __init__(self, state: RunState):
        self.state = state
        self.ranks = state.num_processes
        self.last_log = [0] * self.ranks
        self.last_step = [0] * self.ranks
        self.logs = self.points = self.progress = self.out_of_order = 0
        self.buckets = array.array("q", bytes(8 * 1000 * 600))  # not a list: no work for the collector
        self.last_applied = 0.0

    def __call__(self, record) -> None:
        self.state.apply(record)
        now = time.time()
        self.last_applied = now
        kind = type(record)
        if kind is events.Log:  # the record's texts as they are: the meter must cost little
            more = record.more
            first, made, _ = record.line.split(" ", 2)
            first = int(first)
            final = int(more[-1].split(" ", 1)[0]) if more else first
            count = 1 + len(more)
            if first == self.last_log[record.rank] + 1 and final - first == count - 1:
                self.last_log[record.rank] = final
            else:
                self._each(self.last_log, record.rank, [int(text.split(" ", 1)[0]) for text in (record.line, *more)])
            self._aged(now - float(made), count)
            self.logs += count
        elif kind is events.Metrics:
            steps = record.steps
            count = len(steps)
            if not count:
                return
            if steps[0] == self.last_step[record.rank] + 1 and steps[-1] - steps[0] == count - 1:
                self.last_step[record.rank] = steps[-1]
            else:
                self._each(self.last_step, record.rank, steps)
            self._aged(now - min(record.times), count)
            self.points += count
        elif kind is events.Progress:
            self.progress += 1

    def _each(self, last, rank, numbers) -> None:
        """The items of a record one by one: each one not the next of its rank is out of order."""
        for seq in numbers:
            if seq != last[rank] + 1:
                self.out_of_order += 1
            last[rank] = max(last[rank], seq)

    def _aged(self, age: float, count: int) -> None:
        self.buckets[min(max(int(age * 1000), 0), len(self.buckets) - 1)] += count

    def percentile(self, q: float) -> float:
        total = sum(self.buckets)
        if not total:
            return float("nan")
        want, seen = q * total, 0
        for ms, count in enumerate(self.buckets):
            seen += count
            if seen >= want:
                return float(ms + 1)
        return float(len(self.buckets))


def _median(values) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


class IopubComm:
    """A widget's comm that serialises every message as ipykernel puts it on iopub: the JSON of
    the whole message (header, parent header, metadata, content).  Counts their bytes."""

    sizes = []

    @classmethod
    def install(cls):
        import comm
        from comm.base_comm import BaseComm

        class Comm(BaseComm):
            def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
                content = {"data": data or {}, "comm_id": self.comm_id, **keys}
                msg = {
                    "header": {
                        "msg_id": uuid.uuid4().hex,
                        "msg_type": msg_type,
                        "username": "bench",
                        "session": "s",
                        "date": time.time(),
                        "version": "5.3",
                    },
                    "parent_header": {},
                    "metadata": metadata or {},
                    "content": content,
                }
                cls.sizes.append(len(json.dumps(msg, default=str).encode("utf-8")))

        comm.create_comm = Comm


class SimulatedRun(StateAnswers):
    """A run handle (``RunHandle``) over a simulated state, whose Stop does nothing here."""

    can_profile = False
    exception = None

    def __init__(self, state: RunState):
        self.run_id, self.state = state.run_id, state

    def cancel(self, by: str = "cancel()") -> None:
        pass

    def done(self) -> bool:
        return self.state.finished

    def wait(self, timeout=None) -> bool:
        return self.state.finished

    def result(self, timeout=None):
        return None

    def logs(self, rank: int = 0, attempt=None) -> str:
        return self.state.logs(rank, attempt)

    def culprit(self):
        return self.last_verdict()

    def start_profile(self, steps: int) -> None:
        raise NotAvailable("a simulated run has no ranks to profile")


class CountingSink(io.TextIOBase):
    def __init__(self):
        self.bytes = self.lines = 0

    def write(self, text: str) -> int:
        self.bytes += len(text.encode("utf-8", "replace"))
        self.lines += text.count("\n")
        return len(text)


def make_view(kind: str, state: RunState):
    if kind == "widget":
        IopubComm.install()
        from torchdist_magic.view.widget import WidgetView

        return WidgetView(SimulatedRun(state), display=False), None
    if kind == "text":
        from torchdist_magic.view.text import TextView

        sink = CountingSink()
        return TextView(state, out=sink, err=sink), sink
    return None, None


class Host:
    """The driver's side that holds the run: a real ``ChannelServer`` whose records a real
    ``RunState`` takes (through the ``Meter``) and the run's feed (``feed.FeedServer``), as the
    supervising process of a run whose kernel follows it has them (``--driver process``: in a
    process of its own; with ``journal``, also the journal a detached run keeps,
    ``supervisor.Journal``), or as a run in the kernel has them (``--driver kernel``: this
    process, no feed)."""

    def __init__(self, ranks: int, use_tls: bool, hosted: bool, journal: bool = False):
        self.run_id = f"scale-{uuid.uuid4().hex[:8]}"
        self.identity = tls.new_identity() if use_tls else None
        self.state = RunState(self.run_id, ranks, backend="simulated")
        self.meter = Meter(self.state)
        self.nofile_before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        fdlimit.make_room(ranks, local=False)  # as a run does before its channel listens
        self.nofile_run = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.server = ChannelServer(
            self.meter,
            self.run_id,
            secret=WORKER_SECRET,
            launcher_secret=LAUNCHER_SECRET,
            identity=self.identity,
            ranks=ranks,
        )
        self.directory = self.journal = self.feed = None
        self.token = uuid.uuid4().hex
        if hosted:
            from torchdist_magic.supervise.feed import FeedServer
            from torchdist_magic.supervise.supervisor import Journal

            self.directory = tempfile.mkdtemp(prefix="torchdist-scale-")
            if journal:
                self.journal = Journal(self.directory)
                self.journal.state = self.state
                self.state.listen(self.journal.put)
            self.feed = FeedServer(os.path.join(self.directory, "feed.sock"), self.token, self.state, lambda by: None)

    def where(self) -> dict:
        return {
            "address": f"{self.server.address[0]}:{self.server.address[1]}",
            "certificate": self.identity.certificate if self.identity is not None else "",
            "run_id": self.run_id,
            "feed": self.feed.path if self.feed is not None else None,
            "token": self.token,
        }

    def begin(self) -> None:
        # the connections the driver holds once every generator's are in (a host relay's
        # ranks join on its connection after it: ``results`` counts them)
        self.connections = len(self.server._authed)
        self.rss_start = _rss_mb()
        self.cpu0 = _cpu_seconds()
        self.channel_cpu0 = _thread_cpu_seconds(self.server._thread)
        self.t0 = time.time()

    def caught_up(self, expected: int, sent_at: float) -> bool:
        return self.meter.logs + self.meter.points >= expected or time.time() - sent_at > CATCH_UP_LIMIT

    def results(self, sent_at: float) -> dict:
        """What the driver measured, once the records are in."""
        meter = self.meter
        done = max(meter.last_applied, self.t0)
        window = done - self.t0
        cpu = _cpu_seconds() - self.cpu0
        channel_cpu = _thread_cpu_seconds(self.server._thread) - self.channel_cpu0
        received = meter.logs + meter.points
        records = max(received + meter.progress, 1)
        return {
            "received": received,
            "out_of_order": meter.out_of_order,
            "progress_received": meter.progress,
            "p50_ms": meter.percentile(0.5),
            "p99_ms": meter.percentile(0.99),
            "window_s": window,
            "t0": self.t0,
            "catch_up_s": max(0.0, done - sent_at),
            "driver_cpu_pct": 100 * cpu / window if window else 0.0,
            "driver_cpu_s": cpu,
            # the driver's own CPU seconds (its whole process: the channel, the state, the feed
            # and journal with --driver process) over the log lines, metric points and progress
            # updates it took: less sensitive to a shared machine's load than the latencies
            "driver_us_per_record": 1e6 * cpu / records,
            # the channel thread's alone (receive, TLS, decode, apply to the state)
            "channel_us_per_record": 1e6 * channel_cpu / records,
            "rss_mb_start": self.rss_start,
            "rss_mb_end": _rss_mb(),
            "driver_connections": self.connections,
            # connections, and each role and rank joined through a host relay's
            "authenticated": self.server.stats["authenticated"],
            "evicted": self.server.stats["evicted"],
            "malformed": self.server.stats["malformed"],
            "forbidden": self.server.stats["forbidden"],
            "claims_refused": self.server.stats["claims_refused"],
            "forged": self.server.stats["forged"],
            "nofile_soft_before": self.nofile_before,
            "nofile_soft_run": self.nofile_run,
        }

    def close(self) -> None:
        self.server.close()
        if self.feed is not None:
            self.feed.linger(5.0, quiet=0.5)  # the kernel's view takes its last look
            self.feed.close()
            if self.journal is not None:
                self.journal.close()
            shutil.rmtree(self.directory, ignore_errors=True)


def host_process(ranks: int, use_tls: bool, journal: bool, pipe) -> None:
    """A run's supervising process, simulated: a ``Host`` that answers the benchmark's
    questions on ``pipe`` (``begin``, ``finish EXPECTED SENT_AT``, ``close``).  In a session of
    its own, as ``supervisor.start_detached`` starts the real one (``start_new_session``): the
    kernel's signals and job control do not reach it, and Linux's scheduler (with autogroups)
    shares the cores between it and the kernel's session as between two programs."""
    os.setsid()
    host = Host(ranks, use_tls, hosted=True, journal=journal)
    try:
        pipe.send(host.where())
        while True:
            ask = pipe.recv()
            if ask[0] == "begin":
                host.begin()
            elif ask[0] == "finish":
                while not host.caught_up(ask[1], ask[2]):
                    time.sleep(0.01)
                pipe.send(host.results(ask[2]))
            elif ask[0] == "close":
                break
    finally:
        host.close()
        pipe.send("closed")


def simulate(
    ranks: int,
    rate: float,
    seconds: float,
    view_kind: str,
    use_tls: bool,
    generators: int,
    driver: str = "process",
    journal: bool = False,
    per_host: int = 1,
) -> dict:
    """One run of ``ranks`` on hosts of ``per_host`` ranks (1: no host relays), what it measured."""
    context = multiprocessing.get_context("spawn")
    host = hosting = None
    if driver == "process":
        pipe, child_end = context.Pipe()
        hosting = context.Process(target=host_process, args=(ranks, use_tls, journal, child_end), daemon=True)
        hosting.start()
        while not pipe.poll(0.5):  # its channel listens, or it failed (its traceback is above)
            if hosting.exitcode is not None:
                raise RuntimeError("the simulated supervising process failed before it listened")
        where = pipe.recv()
        from torchdist_magic.handles.feed import HostedState

        state = HostedState(where["feed"], where["token"], ranks, fallback=_no_fallback)
    else:
        host = Host(ranks, use_tls, hosted=False)
        where = host.where()
        state = host.state
    view, sink = make_view(view_kind, state)
    go, results = context.Event(), context.Queue()
    if per_host > 1:  # each generator its share of whole hosts, one relay's connection each
        hosts = [list(range(first, min(first + per_host, ranks))) for first in range(0, ranks, per_host)]
        shares = [(sum(hosts[i::generators], []), hosts[i::generators]) for i in range(generators)]
        connections = len(hosts)
    else:  # each generator its share of ranks, two connections each
        shares = [(list(range(ranks))[i::generators], None) for i in range(generators)]
        connections = 2 * ranks
    every = flush_every(ranks)
    procs = [
        context.Process(
            target=generate,
            args=(
                where["address"],
                where["certificate"],
                where["run_id"],
                share,
                rate,
                seconds,
                every,
                go,
                results,
                share_hosts,
            ),
            daemon=True,
        )
        for share, share_hosts in shares
        if share
    ]
    render_ms, render_cpu_ms, render_gc_ms = [], [], []
    collector = CollectorClock()
    try:
        started = time.monotonic()
        for p in procs:
            p.start()
        connects = [results.get(timeout=CONNECT_LIMIT)[1] for _ in procs]
        connect_s = time.monotonic() - started
        if host is not None:
            host.begin()
        else:
            pipe.send(("begin",))
        kernel_cpu0 = _cpu_seconds()
        go.set()
        sent = None
        expected = None
        measured = None
        reports = []
        while True:
            if view is not None:
                before, before_cpu, before_gc = time.perf_counter(), time.thread_time(), collector.seconds
                view.update()
                render_ms.append(1000 * (time.perf_counter() - before))
                render_cpu_ms.append(1000 * (time.thread_time() - before_cpu))
                render_gc_ms.append(1000 * (collector.seconds - before_gc))
            while not results.empty() and len(reports) < len(procs):
                reports.append(results.get()[1])
            if len(reports) < len(procs) and any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a load generator failed (its traceback is above)")
            if len(reports) == len(procs) and expected is None:
                sent = {k: sum(r[k] for r in reports) for k in ("logs", "points", "progress")}
                expected = sent["logs"] + sent["points"]
                sent_at = time.time()
                if host is None:
                    pipe.send(("finish", expected, sent_at))
            if expected is not None:
                if host is not None and host.caught_up(expected, sent_at):
                    measured = host.results(sent_at)
                    break
                if host is None and pipe.poll():
                    measured = pipe.recv()
                    break
            if hosting is not None and hosting.exitcode is not None:
                raise RuntimeError("the simulated supervising process failed (its traceback is above)")
            time.sleep(SUPERVISE_POLL)
        kernel_cpu = _cpu_seconds() - kernel_cpu0
        if view is not None:
            view.update()
    finally:
        collector.close()
        end_processes(procs, 30)
        if view is not None:
            view.close()
        if host is not None:
            host.close()
        else:
            state.close()
            with contextlib.suppress(OSError, EOFError):
                pipe.send(("close",))
                pipe.recv()
            end_processes([hosting], 30)
    window = measured["window_s"]
    received = measured["received"]
    frames = IopubComm.sizes if view_kind == "widget" else []
    IopubComm.sizes = []
    view_bytes = sum(frames) if view_kind == "widget" else (sink.bytes if sink else 0)
    return {
        "ranks": ranks,
        "rate": rate,
        "seconds": seconds,
        "view": view_kind,
        "tls": use_tls,
        "driver": driver,
        "journal": journal,
        "generators": len(procs),
        "ranks_per_host": per_host,
        "host_relays": connections if per_host > 1 else 0,
        # to the driver: one per host relay, or a worker's and a launcher's per rank
        "connections": connections,
        "connect_s": connect_s,
        "gen_connect_s_max": max(connects),
        "sent": expected,
        "lost": expected - received,
        "progress_sent": sent["progress"],
        "offered_rate": (expected + sent["progress"]) / ranks / max(max(r["send_s"] for r in reports), 1e-9),
        **measured,
        "kernel_cpu_pct": 100 * kernel_cpu / window if window else 0.0,
        "gen_cpu_pct": 100 * sum(r["send_cpu_s"] for r in reports) / window if window else 0.0,
        "gen_behind_s": max(r["behind_s"] for r in reports),
        "frame_bytes_max": max(frames, default=0),
        "view_messages": len(frames),
        "view_mb_per_s": view_bytes / 1e6 / window if window else 0.0,
        "text_lines": sink.lines if sink else None,
        "render_ms_max": max(render_ms, default=0.0),
        "render_cpu_ms_max": max(render_cpu_ms, default=0.0),
        # the five longest refreshes: (which update() call, its CPU ms, of how many calls)
        "render_cpu_ms_top": sorted(enumerate(render_cpu_ms), key=lambda item: -item[1])[:5],
        "render_calls": len(render_cpu_ms),
        # the collector's part of the refreshes: a full collection scans the whole heap of this
        # process (the kernel's), whoever made it, and lands in whichever refresh allocates then
        "render_gc_ms_max": max(render_gc_ms, default=0.0),
        "render_gc_ms_of_longest": render_gc_ms[render_cpu_ms.index(max(render_cpu_ms))] if render_cpu_ms else 0.0,
        "render_own_cpu_ms_max": max((c - g for c, g in zip(render_cpu_ms, render_gc_ms)), default=0.0),
        "full_collections": collector.full,
        "kernel_objects": len(gc.get_objects()),
        # the refreshes' own (update() calls that found the view's period not yet over cost ~nothing)
        "render_cpu_ms_p50": _median([ms for ms in render_cpu_ms if ms >= 1.0]),
        "view_refresh_s": getattr(view, "update_every", None),
    }


class CollectorClock:
    """The time this thread spent in the garbage collector (``seconds``), and how many full
    collections it ran (``full``), from now until ``close``."""

    def __init__(self):
        self.seconds = 0.0
        self.full = 0
        self._thread = threading.get_ident()
        self._began = None  # thread_time at the start of a collection
        gc.callbacks.append(self._on_collect)

    def _on_collect(self, phase: str, info: dict) -> None:
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._began = time.thread_time()
        elif self._began is not None:
            self.seconds += time.thread_time() - self._began
            self.full += info.get("generation") == 2
            self._began = None

    def close(self) -> None:
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)


def _no_fallback():
    raise RuntimeError("the simulated supervising process went away while the view read its state")


def describe_connections(r: dict) -> str:
    """How run ``r``'s ranks reached the driver, in words."""
    if r["ranks_per_host"] > 1:
        return (
            f"{r['host_relays']} host relays of up to {r['ranks_per_host']} ranks, each rank's worker and "
            f"launcher joined through its host's"
        )
    return "a worker's and a launcher's per rank"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument(
        "--ranks-per-host",
        type=int,
        default=8,
        help="ranks per host (default 8, as on a cluster of 8-GPU machines): each host's ranks reach the "
        "driver over one connection, their host relay's (the last host may have fewer ranks); 1: no "
        "relays, each rank over two connections of its own (its worker's, its launcher's)",
    )
    parser.add_argument("--rate", type=float, default=10, help="records per second per rank")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--view", choices=("widget", "text", "none"), default="widget")
    parser.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the channel over TLS, as on Spark (default), or plain, as locally",
    )
    parser.add_argument("--generators", type=int, default=3, help="load-generator processes")
    parser.add_argument(
        "--journal",
        action="store_true",
        help="with --driver process: keep the journal, as a detached run's supervising process does (--detach)",
    )
    parser.add_argument(
        "--driver",
        choices=("process", "kernel"),
        default="process",
        help="the run's channel and state in a supervising process of their own, the kernel's view "
        "reading them through the run's feed, as --channel process runs (default); or all in this "
        "process, as a run in the kernel (--channel kernel)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs in a row (a goal holds when it holds three)")
    parser.add_argument(
        "--busy",
        choices=("both", "off", "on"),
        default="both",
        help="each run quiet (off), beside a busy loop on one core (on), or one of each "
        "(both, the default): the second shows the driver's headroom",
    )
    parser.add_argument(
        "--kernel-imports",
        default="",
        help="modules this process (the kernel) imports first, comma-separated (e.g. torch,IPython,"
        "ipywidgets, as a notebook that trains has them): a full collection then scans that heap",
    )
    parser.add_argument("--json", default=os.path.join(HERE, "results", "scale.json"))
    parser.add_argument(
        "--nofile",
        type=int,
        default=0,
        help="start under this soft limit on open files (a desktop Jupyter's is 1024); "
        "the run raises it toward the hard one as a run does (fdlimit)",
    )
    args = parser.parse_args()
    if not 1 <= args.ranks_per_host <= MAX_RELAY_RANKS:
        parser.error(f"--ranks-per-host: from 1 to {MAX_RELAY_RANKS} (the most one host relay speaks for)")
    for name in filter(None, args.kernel_imports.split(",")):
        importlib.import_module(name.strip())
    if args.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    m = machine()
    where = short_machine(m)
    runs = []
    for _ in range(args.repeat):
        for busy in (False, True) if args.busy == "both" else (args.busy == "on",):
            load_before = load()
            with BusyCore() if busy else contextlib.nullcontext():
                r = simulate(
                    args.ranks,
                    args.rate,
                    args.seconds,
                    args.view,
                    args.tls,
                    args.generators,
                    args.driver,
                    args.journal,
                    args.ranks_per_host,
                )
            runs.append({**r, "busy_core": busy, "machine": where, "load_before": load_before, "load_after": load()})
    print(
        f"\n{describe_machine(m)}; load average {m['load']:g} at the start; "
        f"{args.ranks_per_host} rank{'s' if args.ranks_per_host > 1 else ''} per host"
    )
    print(
        f"\n{'machine':<18} {'load':>9} {'busy':>4} {'driver':>7} {'ranks':>5} {'r/host':>6} {'conns':>5} "
        f"{'rate':>5} {'view':>6} {'tls':>3} "
        f"{'sent':>9} {'lost':>5} {'ooo':>4} {'p50 ms':>8} {'p99 ms':>8} {'us/rec':>6} {'chan':>5} "
        f"{'catch-up':>8} {'cpu %':>6} {'kern %':>6} {'gen %':>6} {'rss MB':>13} "
        f"{'frame KB':>8} {'render ms':>13} {'gc ms':>5} {'conn s':>6}"
    )
    for r in runs:
        print(
            f"{r['machine']:<18.18} {r['load_before']:>4.1f}>{r['load_after']:<4.1f} {'yes' if r['busy_core'] else 'no':>4} "
            f"{r['driver']:>7} {r['ranks']:>5} {r['ranks_per_host']:>6} {r['driver_connections']:>5} "
            f"{r['rate']:>5g} {r['view']:>6} {'on' if r['tls'] else 'off':>3} "
            f"{r['sent']:>9,} {r['lost']:>5} {r['out_of_order']:>4} {r['p50_ms']:>8.0f} {r['p99_ms']:>8.0f} "
            f"{r['driver_us_per_record']:>6.1f} {r['channel_us_per_record']:>5.1f} "
            f"{r['catch_up_s']:>7.1f}s {r['driver_cpu_pct']:>6.0f} {r['kernel_cpu_pct']:>6.0f} "
            f"{r['gen_cpu_pct']:>6.0f} {r['rss_mb_start']:>6.0f}->{r['rss_mb_end']:<6.0f} "
            f"{r['frame_bytes_max'] / 1e3:>8.1f} {r['render_ms_max']:>6.0f}/{r['render_cpu_ms_max']:<3.0f}cpu "
            f"{r['render_gc_ms_of_longest']:>5.0f} {r['connect_s']:>6.1f}"
        )
    r = runs[-1]
    print(
        f"load: the 1-minute load average before>after each run; busy: a loop spinning on one core beside "
        f"it; r/host: ranks per host, each host's over one connection (its host relay's; 1: none, each rank "
        f"over two of its own); conns: the connections to the driver, as it counted them; us/rec: the "
        f"driver's own CPU microseconds per record taken (its whole process), chan: its "
        f"channel thread's alone.  Last run: offered {r['offered_rate']:.1f} records/s per rank (asked {args.rate:g}); generators "
        f"fell up to {r['gen_behind_s']:.2f} s behind; {r['driver_connections']}/{r['connections']} connections "
        f"({describe_connections(r)}), {r['authenticated']} authenticated, "
        f"{r['evicted']} handshakes evicted; refused: {r['malformed']} malformed, {r['forbidden']} forbidden, "
        f"{r['claims_refused']} claims, {r['forged']} forged.  {m['cores']} cores shared by the driver and "
        f"{r['generators']} generator processes (and whatever else runs here); open files: soft limit "
        f"{r['nofile_soft_before']} before the run, {r['nofile_soft_run']} during it"
    )
    write_json(
        args.json,
        {
            "benchmark": "the driver at scale, simulated ranks",
            "machine": m,
            "ranks_per_host": args.ranks_per_host,
            "connections": runs[-1]["connections"],
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
