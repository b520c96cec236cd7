"""The event contract: every message between a rank (or the launcher of a rank) and the driver.

Each message is a typed record defined here and nowhere else, with one JSON encoding
(``encode``/``decode``: a JSON object whose ``"type"`` names the record) and a protocol
version that both ends of the channel compare at the handshake.  Records are validated when
decoded: a field of the wrong type, a missing field or an unknown type raises
``MalformedEvent``, so a receiver either gets a well-formed record or nothing.

Who may send what (the channel enforces it, ``SENDERS``):

- a **worker** (the rank's own process): ``Started``, ``Progress``, ``Metrics``, ``StepSplit``,
  ``Checkpoint``, ``CodeStarted`` (its job's own code began), ``ProfilePiece``, ``ProfileDone``, ``Dropped``,
  ``DebugOutput`` (its debugger's output and prompts), ``SystemMetrics`` (what only the
  rank's process knows: torch's peak GPU memory), ``Collectives`` (where it is in each process
  group: when the driver asked, and when its job failed), ``Preflight`` (its versions, GPUs and
  bandwidth, before its job: ``--preflight``), and in a warm pool ``JobValue`` and
  ``JobDone`` after each job;
- a **launcher** (what starts and watches a worker: the local backend in the driver, or a
  Spark task on an executor): ``Log`` (the worker's output), ``Exit`` (what the process
  did), ``SystemMetrics`` (the rank's processes and machine, sampled every few seconds),
  ``Stacks`` (every thread's stack, when the driver asked), ``OutputEnd`` (a warm rank's
  job output has all been read), and anything a worker may send;
- a **kernel** to a detached run's supervising process, on its control socket: ``StopRun``;
- the **driver** to ranks: ``Stop`` (stop the rank, with a grace period before the kill),
  ``DumpStacks`` (capture every thread's Python stack), ``RunJob`` (the next job of a warm
  pool's ranks, in pieces) and, to a worker, ``DebugInput`` (a line for its debugger) and
  ``DumpCollectives`` (send the rank's collective record), ``StartProfile`` (profile the next steps).

A rank's ``Exit`` is what its launcher saw the process do, never what the worker claims.

Start here: this module holds every record type, who may send it and its encoding.  A record's
parts live beside it: ``failure`` (``Failure``, a rank's failure), ``stacks`` (the threads and
frames of ``Stacks``), ``recordcheck`` (how ``decode`` checks a record field by field, with the
standard library alone: a rank needs nothing more) and ``recorddecoder`` (the driver's channel's
decoder of the same JSON, compiled: msgspec).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Type, Union

from .failure import Failure
from .recordcheck import MalformedEvent, builder, check, to_json_value
from .stacks import ThreadStack, is_library_file, parse_stacks

#: bumped whenever a record changes shape; the channel refuses a peer with another version
PROTOCOL_VERSION = 10  # 10: the hello's MAC covers its every field (``wire.frames.hello_proof``)


# -- records ----------------------------------------------------------------------------------


@dataclass
class Event:
    """Base of every record; ``rank`` is the rank it concerns (set by the channel from the
    authenticated connection, whatever the sender wrote)."""

    type: ClassVar[str] = ""
    rank: int


@dataclass
class Started(Event):
    """The worker process is up and about to run the job."""

    type: ClassVar[str] = "started"
    host: str = ""
    pid: int = 0
    time: float = 0.0


@dataclass
class OutputLine:
    """One line of a rank's output, as ``Log.lines`` gives it."""

    stream: str = "stdout"
    line: str = ""
    cr: bool = False


@dataclass
class Log(Event):
    """One line of a rank's output; ``cr`` when it ended with ``\\r`` (a redrawn progress line).
    ``more``: the lines that followed it on the same stream, in order, none of them redrawn, sent
    in the same record as plain texts (a client puts such lines of one flush into one record:
    ``wire.batching.merge_logs``; the driver decodes a flush's lines as one list of texts)."""

    type: ClassVar[str] = "log"
    stream: str = "stdout"
    line: str = ""
    cr: bool = False
    more: List[str] = field(default_factory=list)

    def lines(self) -> List[OutputLine]:
        """Every line this record carries, in the order the rank wrote them."""
        return [OutputLine(self.stream, self.line, self.cr), *(OutputLine(self.stream, text) for text in self.more)]


@dataclass
class Progress(Event):
    """The state of one progress bar of a rank (``progress()``, tqdm)."""

    type: ClassVar[str] = "progress"
    bar: str = ""
    desc: str = ""
    n: int = 0
    total: Optional[int] = None
    elapsed: float = 0.0
    state: str = "running"  # running, done, stopped; cleared: the bar is gone (tqdm's leave=False)
    postfix: str = ""  # what tqdm shows after the bar (``loss=0.31``)


@dataclass
class MetricPoint:
    """One ``report()`` as a reader sees it: its step, its named numbers and when it was made
    (``Metrics.points``)."""

    step: int = 0
    values: Dict[str, Union[float, str]] = field(default_factory=dict)
    time: float = 0.0


@dataclass
class Metrics(Event):
    """Named numbers from ``report()``, the points of one or more calls column by column: each
    name once (``names``), each point's ``steps[i]`` and ``times[i]``, and per name its value
    at each point (``values[j][i]`` is name ``j`` at point ``i``): a number, its text where it
    is not finite (``"nan"``), or ``None`` where that point did not report that name.  One
    ``report()`` is one point (``Metrics.point``); a rank's client puts every point of one flush
    into one record (``batching``), so the driver decodes each name once per flush and checks a
    column of numbers in one loop.  A record whose columns do not line up is malformed
    (``malformed``, checked as it is decoded)."""

    type: ClassVar[str] = "metrics"
    names: List[str] = field(default_factory=list)
    steps: List[int] = field(default_factory=list)
    times: List[float] = field(default_factory=list)
    values: List[List[Optional[Union[float, str]]]] = field(default_factory=list)

    @classmethod
    def point(
        cls, rank: int, step: int = 0, values: Optional[Dict[str, Union[float, str]]] = None, time: float = 0.0
    ) -> "Metrics":
        """The record of one ``report()``: ``values`` at ``step``, made at ``time``."""
        values = values or {}
        return cls(rank=rank, names=list(values), steps=[step], times=[time], values=[[v] for v in values.values()])

    def points(self) -> List[MetricPoint]:
        """Every point this record carries, in the order they were reported, each with the
        values it has."""
        rows = zip(*self.values) if self.values else ((),) * len(self.steps)
        return [
            MetricPoint(step, {name: v for name, v in zip(self.names, row) if v is not None}, time)
            for step, time, row in zip(self.steps, self.times, rows)
        ]

    def malformed(self) -> str:
        """What makes the columns not line up ("" for nothing): a time per step, a column per
        name, each name once, a value (or ``None``) per point in every column."""
        count = len(self.steps)
        if len(self.times) != count:
            return f"{count} steps but {len(self.times)} times"
        if len(self.values) != len(self.names):
            return f"{len(self.names)} names but {len(self.values)} columns of values"
        if len(set(self.names)) != len(self.names):
            return "a metric name twice"
        for name, column in zip(self.names, self.values):
            if len(column) != count:
                return f"{len(column)} values of {name!r:.60} for {count} points"
        return ""


@dataclass
class SystemMetrics(Event):
    """What the machine under a rank looked like at ``time``: named numbers (``cpu_percent``,
    ``rss_bytes``, ``host_memory_available_bytes``, ``gpu_memory_used_bytes``, ...; see
    ``sysmetrics``).  Its launcher samples the rank's processes every ``SYSTEM_METRICS_INTERVAL``;
    the worker adds what only the rank's process knows (``torch_max_allocated_bytes``)."""

    type: ClassVar[str] = "system"
    values: Dict[str, float] = field(default_factory=dict)
    time: float = 0.0


@dataclass
class StepSplit(Event):
    """Where a rank's recent steps went (``stepsplit``): the fractions of their ``seconds``
    (``steps`` steps of its innermost ``progress()`` loop) spent waiting for ``data``, in
    ``compute`` and waiting in collectives (``comm``), which add up to 1; and its totals since
    the job began: seconds of steps (``step_s``), of data waits (``data_s``), of collective
    waits (``comm_s``)."""

    type: ClassVar[str] = "step_split"
    data: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    seconds: float = 0.0
    steps: int = 0
    step_s: float = 0.0
    data_s: float = 0.0
    comm_s: float = 0.0
    time: float = 0.0


@dataclass
class ProfilePiece(Event):
    """One piece of a rank's profile trace (``--profile``: torch.profiler's Chrome trace JSON
    text), in order, before its ``ProfileDone``."""

    type: ClassVar[str] = "profile_piece"
    data: str = ""


@dataclass
class ProfileOp:
    """One operator of a rank's profile: its name, its own CPU seconds, its calls."""

    name: str = ""
    self_cpu_s: float = 0.0
    calls: int = 0


@dataclass
class ProfileDone(Event):
    """A rank's profile is complete: ``steps`` steps profiled; its trace came in ``ProfilePiece``
    records unless it was too large to send, then ``kept_at`` says where it stays
    (``host:path``); its ``top`` operators by own CPU time; its process's ``peak_memory_bytes``
    (with CUDA, the GPU's peak allocated bytes in ``peak_gpu_memory_bytes``); ``error`` when
    profiling failed."""

    type: ClassVar[str] = "profile_done"
    steps: int = 0
    size: int = 0
    kept_at: str = ""
    top: List[ProfileOp] = field(default_factory=list)
    peak_memory_bytes: float = 0.0
    peak_gpu_memory_bytes: Optional[float] = None
    error: str = ""
    time: float = 0.0


@dataclass
class CodeStarted(Event):
    """The rank began to run the user's code (a cell after the notebook's imports, its values and
    the run's process group; a function as it is called; a script), at ``time``: the job's first
    sign of work even where it never steps nor reports (``goodput``: its start-up ends here)."""

    type: ClassVar[str] = "code_started"
    time: float = 0.0


@dataclass
class Checkpoint(Event):
    """The rank wrote a complete checkpoint (``runtime.save_checkpoint``): its ``step``, at
    ``time``.  Work done before it survives a restart (``goodput``)."""

    type: ClassVar[str] = "checkpoint"
    step: int = 0
    time: float = 0.0


@dataclass
class Dropped(Event):
    """The worker could not queue ``count`` events (its channel was full)."""

    type: ClassVar[str] = "dropped"
    count: int = 0


@dataclass
class Exit(Event):
    """The rank's process ended with ``code`` (negative: killed by that signal; ``None``: its
    task ended without a process exit to report).  ``stopped``: the launcher stopped it."""

    type: ClassVar[str] = "exit"
    code: Optional[int] = None
    time: float = 0.0
    host: str = ""
    stopped: bool = False
    failure: Optional[Failure] = None


@dataclass
class Stop(Event):
    """Driver to a rank's launcher: stop the rank, ``grace`` seconds between SIGTERM and SIGKILL."""

    type: ClassVar[str] = "stop"
    grace: float = 0.0


@dataclass
class DumpStacks(Event):
    """Driver to a rank's launcher: capture every thread's Python stack of the rank and send it
    back as ``Stacks``."""

    type: ClassVar[str] = "dump_stacks"


@dataclass
class DumpCollectives(Event):
    """Driver to a rank's worker: send back where the rank is in each process group
    (``Collectives``)."""

    type: ClassVar[str] = "dump_collectives"


@dataclass
class GroupCollectives:
    """Where a rank is in one process group (``group``: its name, ``default group`` for the
    default one): the sequence number of the last collective it entered (``entered``) and of the
    last one it finished (``finished``), 0 for none, and what the last entered one was: its op
    (``all_reduce``) and its input tensors' sizes."""

    group: str
    entered: int = 0
    finished: int = 0
    op: str = ""
    sizes: List[List[int]] = field(default_factory=list)


@dataclass
class Collectives(Event):
    """A rank's collective record (``collectives``), sent when the driver asks
    (``DumpCollectives``) and when the rank's job fails with a process group up.  ``source``:
    ``"flight recorder"`` (torch's, per process group in ``groups``), or ``"stack"`` where torch
    keeps none: then ``groups`` is empty and ``in_collective`` names the collective the rank's
    main thread is in ("" for none), from its stack.  ``note`` says why a rank has no record
    (no process group)."""

    type: ClassVar[str] = "collectives"
    source: str = ""
    groups: List[GroupCollectives] = field(default_factory=list)
    in_collective: str = ""
    time: float = 0.0
    note: str = ""

    def group(self, name: str) -> Optional[GroupCollectives]:
        return next((g for g in self.groups if g.group == name), None)


@dataclass
class GpuHealth:
    """One GPU of a rank at its pre-flight check (NVML): its index, name, uncorrected ECC errors
    (volatile), the throttle reasons that slow it (``"hw_slowdown, sw_thermal"``; "" for none)
    and its free memory in bytes."""

    index: int
    name: str = ""
    ecc_errors: int = 0
    throttled: str = ""
    free_bytes: float = 0.0


@dataclass
class Preflight(Event):
    """A rank's pre-flight report (``--preflight``), sent before its job runs: the versions it
    runs with ("" where there is none: ``cuda``, ``nccl`` and ``driver`` on a CPU rank), its GPUs'
    health, and what it measured: ``bus_gbps``, the bus bandwidth of an ``all_reduce`` of every
    rank (GB/s), ``link_gbps``, the bandwidth of what it received from the rank before it in a
    ring (GB/s), and ``seconds``, how long the check took on it."""

    type: ClassVar[str] = "preflight"
    host: str = ""
    python: str = ""
    torch: str = ""
    cuda: str = ""
    nccl: str = ""
    driver: str = ""
    gpus: List[GpuHealth] = field(default_factory=list)
    bus_gbps: float = 0.0
    link_gbps: float = 0.0
    seconds: float = 0.0


@dataclass
class Stacks(Event):
    """Every thread's Python stack of a rank, as ``faulthandler`` wrote it (also while the
    thread was blocked in a C call, such as a collective).  ``main_thread``: the ident of the
    thread that runs the job (0: unknown); ``text`` is empty when the rank had no stack to give
    (not started yet, or already gone), and ``note`` then says why."""

    type: ClassVar[str] = "stacks"
    text: str = ""
    main_thread: int = 0
    time: float = 0.0
    note: str = ""

    def threads(self) -> List[ThreadStack]:
        """The threads in ``text``, in the order faulthandler listed them."""
        return parse_stacks(self.text)

    def main(self) -> Optional[ThreadStack]:
        """The thread that runs the job: ``main_thread``, else the one listed last (the oldest
        thread: CPython lists the newest first)."""
        threads = self.threads()
        chosen = [t for t in threads if t.ident == self.main_thread]
        picked = chosen or threads[-1:]
        return picked[0] if picked else None

    def where(self, depth: int = 3) -> str:
        """The main thread's innermost ``depth`` frames, innermost first, and the innermost frame
        of the user's own code when those are all library frames: ``all_reduce
        (torch/distributed/distributed_c10d.py, line 2950) < wrapper (...) < train (/w/t.py,
        line 12)``."""
        thread = self.main()
        frames = thread.job_frames() if thread is not None else []
        if not frames:
            return self.note or "no Python stack"
        shown = frames[:depth]
        own = next((f for f in frames if not is_library_file(f.filename)), None)
        text = " < ".join(f.describe() for f in shown)
        if own is not None and own not in shown:
            text += f" < ... < {own.describe()}"
        return text


@dataclass
class StartProfile(Event):
    """Driver to a worker: profile the next ``steps`` steps now (``Run.start_profile``, the
    view's Profile button), as ``--profile`` does from the first."""

    type: ClassVar[str] = "start_profile"
    steps: int = 0


@dataclass
class RunJob(Event):
    """Driver to the workers of a warm pool: one piece of the next job (``Job``, cloudpickled,
    base64 in ``data``), in order; the last piece (``last``) also carries what the job sets in
    the ranks' environment (``env``) and whether this rank's value is wanted (``all_ranks``; rank
    0's always is).  A run on some ranks (``--ranks``) sends its job to those ranks only."""

    type: ClassVar[str] = "run_job"
    job_id: str = ""
    data: str = ""
    last: bool = False
    env: Dict[str, str] = field(default_factory=dict)
    all_ranks: bool = False


@dataclass
class JobValue(Event):
    """A warm rank's value for job ``job_id``: one piece (base64), in order, before its ``JobDone``."""

    type: ClassVar[str] = "job_value"
    job_id: str = ""
    data: str = ""


@dataclass
class JobDone(Event):
    """A warm rank finished job ``job_id`` and waits for the next: ``code`` 0, or its
    ``failure``; ``has_value``: its ``JobValue`` pieces came before this."""

    type: ClassVar[str] = "job_done"
    job_id: str = ""
    code: int = 0
    time: float = 0.0
    has_value: bool = False
    failure: Optional[Failure] = None


#: what a warm rank writes on stdout and on stderr after each job: its launcher turns the line
#: into ``OutputEnd``, so the driver knows that the job's output has all arrived
OUTPUT_END_MARK = "\x00torchdist-output-end:"


@dataclass
class OutputEnd(Event):
    """A warm rank's launcher read the end of job ``job_id``'s output on ``stream``."""

    type: ClassVar[str] = "output_end"
    job_id: str = ""
    stream: str = "stdout"


@dataclass
class Joined(Event):
    """A rank's launcher on another machine (a Spark task) is up: where it runs, for the
    tasks to place their ranks (``rankenv.place_spark_tasks``)."""

    type: ClassVar[str] = "joined"
    host: str = ""  # what tells its machine apart from the others'
    address: str = ""  # where the other ranks reach that machine
    port: Optional[int] = None  # rank 0's reserved MASTER_PORT
    gpus: Optional[str] = None  # the GPU addresses Spark gave the task


@dataclass
class Peers(Event):
    """Driver to every launcher, once all ranks' launchers joined: all of them, in rank order.
    ``use_barrier``: some launcher could not reach the driver, so they all exchange their
    ``Joined`` through Spark's barrier instead (slower, but every task takes the same path)."""

    type: ClassVar[str] = "peers"
    peers: List[Joined] = field(default_factory=list)
    use_barrier: bool = False


@dataclass
class DebugOutput(Event):
    """A worker's debugger (``rank_debugger``): ``text`` it wrote in session ``session``; with a
    ``prompt``, the session now waits for a ``DebugInput`` line; ``end``: the session is over.
    ``kind`` is ``"post-mortem"`` (the rank raised, ``--pdb``) or ``"breakpoint"``; ``time``
    when the session opened (a post-mortem's: when the rank raised; the earliest is debugged)."""

    type: ClassVar[str] = "debug_output"
    session: str = ""
    kind: str = "breakpoint"
    text: str = ""
    prompt: str = ""
    end: bool = False
    time: float = 0.0


@dataclass
class DebugInput(Event):
    """Driver to a worker: the ``line`` the user typed for debugger session ``session``, or
    ``end`` (the session is to end: the user interrupted, or another rank is debugged)."""

    type: ClassVar[str] = "debug_input"
    session: str = ""
    line: str = ""
    end: bool = False


@dataclass
class StopRun(Event):
    """A kernel to a detached run's supervising process (its control socket, ``supervisor``):
    stop the run.  ``token`` is the run's own (in its private record directory); ``by`` says who
    stopped it (the view's outcome line).  ``rank`` is unused (-1)."""

    type: ClassVar[str] = "stop_run"
    token: str = ""
    by: str = ""


@dataclass
class ReadState(Event):
    """A kernel to the process that holds a run's state (its view feed, ``supervise.feed``): one
    read of that state, ``read`` one of ``feed.READS``, with that read's arguments (``at``: the
    rank read, for a rank's log or system samples).  ``token`` is the run's own.  ``rank`` is
    unused (-1)."""

    type: ClassVar[str] = "read_state"
    token: str = ""
    read: str = ""
    at: int = -1
    since: Optional[int] = None
    start: int = 0
    limit: Optional[int] = None
    newest: bool = False
    points: Optional[int] = None
    ranks: Optional[List[int]] = None
    names: Optional[List[str]] = None
    attempt: Optional[int] = None
    #: for ``read_logs``: ``[rank, start, limit, newest]`` each
    reads: List[List[Optional[Union[int, bool]]]] = field(default_factory=list)


@dataclass
class AttemptBegan(Event):
    """In a detached run's journal (``supervisor``), never on a socket: the records after it are
    of attempt ``attempt`` (the run restarted).  ``rank`` is unused (-1)."""

    type: ClassVar[str] = "attempt_began"
    attempt: int = 1


RANK_TO_DRIVER = (
    Started,
    Log,
    Progress,
    Metrics,
    Dropped,
    Exit,
    Stacks,
    SystemMetrics,
    Collectives,
    Preflight,
    StepSplit,
    Checkpoint,
    CodeStarted,
)
DRIVER_TO_RANK = (Stop, DumpStacks, RunJob, Peers, DebugInput, DumpCollectives, StartProfile)
#: records that a backend takes for itself, never a RunState
LAUNCHER_TO_DRIVER = (Joined,)
#: records that a warm pool takes for itself (``pool``), never a RunState
POOL_TO_DRIVER = (JobValue, JobDone, OutputEnd)
#: records that the run's debugger console takes for itself (``debugger``), never a RunState
DEBUG_TO_DRIVER = (DebugOutput,)
#: records that the run's profile takes for itself (``profiles``), never a RunState
PROFILE_TO_DRIVER = (ProfilePiece, ProfileDone)
#: records a kernel sends a detached run's supervising process on its control socket
KERNEL_TO_SUPERVISOR = (StopRun, ReadState)
#: records a detached run's supervising process writes in its journal for the kernels that attach
SUPERVISOR_TO_KERNEL = (AttemptBegan,)
RECORDS: Dict[str, Type[Event]] = {
    cls.type: cls
    for cls in RANK_TO_DRIVER
    + DRIVER_TO_RANK
    + LAUNCHER_TO_DRIVER
    + POOL_TO_DRIVER
    + DEBUG_TO_DRIVER
    + PROFILE_TO_DRIVER
    + KERNEL_TO_SUPERVISOR
    + SUPERVISOR_TO_KERNEL
}

#: which records each role of connection may send to the driver
SENDERS: Dict[str, frozenset] = {
    "worker": frozenset(
        {
            Started,
            Progress,
            Metrics,
            StepSplit,
            Checkpoint,
            CodeStarted,
            ProfilePiece,
            ProfileDone,
            Dropped,
            JobValue,
            JobDone,
            DebugOutput,
            SystemMetrics,
            Collectives,
            Preflight,
        }
    ),
    "launcher": frozenset(RANK_TO_DRIVER + LAUNCHER_TO_DRIVER + POOL_TO_DRIVER + DEBUG_TO_DRIVER + PROFILE_TO_DRIVER),
    #: a kernel on a detached run's control socket (never on a run's channel)
    "kernel": frozenset(KERNEL_TO_SUPERVISOR),
}


# -- encoding ---------------------------------------------------------------------------------


def encode(event: Event) -> dict:
    """The JSON object of a record: its fields and ``"type"``."""
    data = to_json_value(event)
    data["type"] = event.type
    return data


def dumps(event: Event) -> str:
    return json.dumps(encode(event), separators=(",", ":"), allow_nan=False)


def decode(data: Any) -> Event:
    """The record a JSON object encodes; ``MalformedEvent`` for anything else.

    Unknown fields are ignored (a newer peer of the same protocol version may add optional
    ones); unknown types, missing or ill-typed fields are refused.
    """
    if not isinstance(data, dict):
        raise MalformedEvent(f"an event is a JSON object, got {type(data).__name__}")
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in RECORDS:
        raise MalformedEvent(f"unknown event type {kind!r:.40}")
    return BUILDERS[kind](data, kind)


class _Builders(dict):
    """Each record type's builder (``recordcheck.builder``) by its ``type``, made on first use;
    ``KeyError`` for a name that is no record's (nothing is kept for it)."""

    def __missing__(self, kind: str) -> Callable[[dict, str], Event]:
        build = self[kind] = builder(RECORDS[kind])
        return build


#: ``{type: build(data, where)}``: what ``decode`` does once it knows the type;
#: ``build(item, item["type"])`` raises ``MalformedEvent`` for a record that is not well formed.
#: (The driver's channel decodes the ranks' records with msgspec instead, ``recorddecoder``,
#: which leaves to ``decode`` what it does not take.)
BUILDERS: Dict[str, Callable[[dict, str], Event]] = _Builders()


def loads(text: Union[str, bytes]) -> Event:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MalformedEvent(f"not JSON: {exc}") from None
    return decode(data)


def failure_from_json(data: Any) -> Failure:
    """A ``Failure`` from its JSON object (the worker's ``error.json``)."""
    return check(data, Failure, "failure")


def failure_to_json(failure: Failure) -> dict:
    return to_json_value(failure)
