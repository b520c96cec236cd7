"""The event contract: every message between a rank (or the launcher of a rank) and the driver.

Each message is a typed record defined here and nowhere else, with one JSON encoding
(``encode``/``decode``: a JSON object whose ``"type"`` names the record) and a protocol
version that both ends of the channel compare at the handshake.  Records are validated when
decoded: a field of the wrong type, a missing field or an unknown type raises
``MalformedEvent``, so a receiver either gets a well-formed record or nothing.

Who may send what (the channel enforces it, ``SENDERS``):

- a **worker** (the rank's own process): ``Started``, ``Progress``, ``Metrics``, ``StepSplit``,
  ``Checkpoint``, ``ProfilePiece``, ``ProfileDone``, ``Dropped``,
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
- the **driver** to ranks: ``Stop`` (stop the rank, with a grace period before the kill),
  ``DumpStacks`` (capture every thread's Python stack), ``RunJob`` (the next job of a warm
  pool's ranks, in pieces) and, to a worker, ``DebugInput`` (a line for its debugger) and
  ``DumpCollectives`` (send the rank's collective record), ``StartProfile`` (profile the next steps).

A rank's ``Exit`` is what its launcher saw the process do, never what the worker claims.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import signal
import typing
from dataclasses import dataclass, field
from time import time as _now
from traceback import format_exception as _format_exception
from typing import Any, Callable, ClassVar, Dict, List, Optional, Type, Union

#: bumped whenever a record changes shape; the channel refuses a peer with another version
PROTOCOL_VERSION = 8


class MalformedEvent(ValueError):
    """A message that is not a well-formed record of this protocol."""


# -- records ----------------------------------------------------------------------------------

@dataclass
class Failure:
    """One rank's failure: what it raised (or how its process ended) and where.

    Built in one place, as ipyparallel builds its remote errors: ``from_exception`` where the
    exception is at hand (the worker, a Spark task's own failure), ``from_exit`` where a process
    ended (a launcher, the run's state), ``for_rank`` for a copy that names the rank it concerns.
    """

    rank: int = 0
    host: str = ""
    exit_code: Optional[int] = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    time: float = 0.0
    log_tail: List[str] = field(default_factory=list)

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException, *, host: str = "",
                       exit_code: Optional[int] = None, exc_type: Optional[str] = None,
                       message: Optional[str] = None, traceback_text: Optional[str] = None,
                       time: Optional[float] = None) -> "Failure":
        """``rank``'s failure by ``exc``: its type (``exc_type``: the class's qualified name unless
        given), message (``str(exc)`` unless given) and traceback (``traceback_text``: the whole
        formatted exception unless given), at ``time`` (now unless given)."""
        if traceback_text is None:
            traceback_text = "".join(_format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank=rank, host=host, exit_code=exit_code,
                   exc_type=type(exc).__qualname__ if exc_type is None else exc_type,
                   message=str(exc) if message is None else message, traceback=traceback_text,
                   time=_now() if time is None else time)

    @classmethod
    def from_exit(cls, rank: int, code: Optional[int], *, host: str = "", time: float = 0.0,
                  reported: Optional["Failure"] = None, log_tail: Optional[List[str]] = None) -> "Failure":
        """``rank``'s failure from how its process ended, ``code`` (negative: killed by that
        signal, which ``summary`` names; ``None``: no process exit to report), and from what the
        rank itself reported, ``reported`` (its exception: the worker's ``error.json``, a warm
        job's ``JobDone``), when it reported anything.

        The exit code is the process's; the reported one only refines a plain exit (a positive
        code, or none).  ``host`` and ``time`` stand in where the report has none; ``log_tail``
        (the rank's last lines of output, seen here) where given and not empty replaces the
        report's."""
        reported = reported if reported is not None else cls()
        plain = code is None or code > 0
        return cls(rank=rank, host=reported.host or host,
                   exit_code=reported.exit_code if plain and reported.exit_code is not None else code,
                   exc_type=reported.exc_type, message=reported.message, traceback=reported.traceback,
                   time=reported.time or time, log_tail=list(log_tail or reported.log_tail))

    def for_rank(self, rank: int, **changes: Any) -> "Failure":
        """A copy of this failure as ``rank``'s, with ``changes`` (fields by name) made."""
        return dataclasses.replace(self, rank=rank, **changes)

    @property
    def signal_name(self) -> Optional[str]:
        if self.exit_code is not None and self.exit_code < 0:
            try:
                return signal.Signals(-self.exit_code).name
            except ValueError:
                return f"signal {-self.exit_code}"
        return None

    def summary(self) -> str:
        where = f"rank {self.rank}" + (f" on {self.host}" if self.host else "")
        if self.exc_type:
            return f"{where} raised {self.exc_type}: {self.message}".rstrip(": ")
        if self.signal_name:
            if self.message:  # what the launcher made of the kill (``sysmetrics.explain_kill``)
                return f"{where} was killed ({self.signal_name}), {self.message}"
            return f"{where} was killed by {self.signal_name}"
        if self.exit_code is not None:
            return f"{where} exited with code {self.exit_code}"
        return f"{where} failed: {self.message}"


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
    """One line of a rank's output after the first of a ``Log`` record."""

    stream: str = "stdout"
    line: str = ""
    cr: bool = False


@dataclass
class Log(Event):
    """One line of a rank's output; ``cr`` when it ended with ``\\r`` (a redrawn progress line).
    ``more``: the lines that followed it, in order, sent in the same record (a client puts the
    lines of one flush into one record: ``wire.batching.merge_logs``)."""

    type: ClassVar[str] = "log"
    stream: str = "stdout"
    line: str = ""
    cr: bool = False
    more: List[OutputLine] = field(default_factory=list)

    def lines(self) -> List[OutputLine]:
        """Every line this record carries, in the order the rank wrote them."""
        return [OutputLine(self.stream, self.line, self.cr), *self.more]


@dataclass
class Progress(Event):
    """The state of one progress bar of a rank (``progress()``, tqdm)."""

    type: ClassVar[str] = "progress"
    bar: str = ""
    desc: str = ""
    n: int = 0
    total: Optional[int] = None
    elapsed: float = 0.0
    state: str = "running"          # running, done, stopped; cleared: the bar is gone (tqdm's leave=False)
    postfix: str = ""               # what tqdm shows after the bar (``loss=0.31``)


@dataclass
class MetricPoint:
    """One ``report()``: its step, its named numbers and when it was made."""

    step: int = 0
    values: Dict[str, Union[float, str]] = field(default_factory=dict)
    time: float = 0.0


@dataclass
class Metrics(Event):
    """Named numbers from ``report()``; non-finite values travel as their text (``"nan"``).
    ``more``: the points reported after this one, in order, sent in the same record (a rank's
    client puts every point of one flush into one record: ``merge_metrics``)."""

    type: ClassVar[str] = "metrics"
    step: int = 0
    values: Dict[str, Union[float, str]] = field(default_factory=dict)
    time: float = 0.0
    more: List[MetricPoint] = field(default_factory=list)

    def points(self) -> List[MetricPoint]:
        """Every point this record carries, in the order they were reported."""
        return [MetricPoint(self.step, self.values, self.time), *self.more]


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
class Frame:
    """One frame of a stack: where a thread was."""

    function: str
    filename: str
    line: int

    def describe(self) -> str:
        return f"{self.function} ({_short_path(self.filename)}, line {self.line})"


@dataclass
class ThreadStack:
    """One thread's frames, innermost first."""

    ident: int
    current: bool
    frames: List[Frame]

    def job_frames(self) -> List[Frame]:
        """The frames without those of the process around the job (the worker, ``runpy``)."""
        return [f for f in self.frames if not f.filename.endswith(_RUNNER_FILES)]


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
        return (chosen or threads[-1:] or [None])[0]

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
    host: str = ""                  # what tells its machine apart from the others'
    address: str = ""               # where the other ranks reach that machine
    port: Optional[int] = None      # rank 0's reserved MASTER_PORT
    gpus: Optional[str] = None      # the GPU addresses Spark gave the task


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


RANK_TO_DRIVER = (Started, Log, Progress, Metrics, Dropped, Exit, Stacks, SystemMetrics, Collectives, Preflight,
                  StepSplit, Checkpoint)
DRIVER_TO_RANK = (Stop, DumpStacks, RunJob, Peers, DebugInput, DumpCollectives, StartProfile)
#: records that a backend takes for itself, never a RunState
LAUNCHER_TO_DRIVER = (Joined,)
#: records that a warm pool takes for itself (``pool``), never a RunState
POOL_TO_DRIVER = (JobValue, JobDone, OutputEnd)
#: records that the run's debugger console takes for itself (``debugger``), never a RunState
DEBUG_TO_DRIVER = (DebugOutput,)
#: records that the run's profile takes for itself (``profiles``), never a RunState
PROFILE_TO_DRIVER = (ProfilePiece, ProfileDone)
RECORDS: Dict[str, Type[Event]] = {
    cls.type: cls for cls in RANK_TO_DRIVER + DRIVER_TO_RANK + LAUNCHER_TO_DRIVER + POOL_TO_DRIVER
    + DEBUG_TO_DRIVER + PROFILE_TO_DRIVER}

#: which records each role of connection may send to the driver
SENDERS: Dict[str, frozenset] = {
    "worker": frozenset({Started, Progress, Metrics, StepSplit, Checkpoint, ProfilePiece, ProfileDone, Dropped,
                         JobValue, JobDone, DebugOutput, SystemMetrics, Collectives, Preflight}),
    "launcher": frozenset(RANK_TO_DRIVER + LAUNCHER_TO_DRIVER + POOL_TO_DRIVER + DEBUG_TO_DRIVER
                          + PROFILE_TO_DRIVER),
}


# -- encoding ---------------------------------------------------------------------------------

def _to_json_value(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_json_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json_value(v) for v in value]
    return value


def encode(event: Event) -> dict:
    """The JSON object of a record: its fields and ``"type"``."""
    data = _to_json_value(event)
    data["type"] = event.type
    return data


def dumps(event: Event) -> str:
    return json.dumps(encode(event), separators=(",", ":"), allow_nan=False)


#: the JSON values each plain annotation takes
_JSON_TYPES: Dict[Any, tuple] = {float: (float, int), int: (int,), str: (str,), bool: (bool,)}


def _fail(where: str, expected: str, value: Any) -> MalformedEvent:
    return MalformedEvent(f"{where}: expected {expected}, got {value!r:.80}")


def _checker(annotation: Any) -> Callable[[Any, str], Any]:
    """A function ``(value, where)`` that returns ``value`` if it has the type ``annotation``
    describes (recursively; floats as finite floats), else raises ``MalformedEvent`` naming
    ``where``.  Built once per annotation: decoding then costs no type introspection."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Union:
        options = [a for a in args if a is not type(None)]
        nullable = len(options) < len(args)
        if len(options) == 1:  # Optional[X]: X's own message says what is wrong
            inner = _checker(options[0])

            def check_optional(value, where):
                return None if value is None else inner(value, where)
            return check_optional
        checks = [_checker(option) for option in options]
        # the option a JSON value's own type points at is tried first (a float for
        # Union[float, str]), so that the common case costs one check
        likely = {}
        for option, check in zip(options, checks):
            for kind in _JSON_TYPES.get(option, (typing.get_origin(option),)):
                likely.setdefault(kind, check)

        def check_union(value, where):
            if value is None and nullable:
                return None
            first = likely.get(type(value))
            if first is not None:
                try:
                    return first(value, where)
                except MalformedEvent:
                    pass
            for check in checks:
                try:
                    return check(value, where)
                except MalformedEvent:
                    continue
            raise MalformedEvent(f"{where}: {value!r} is none of {annotation}")
        return check_union
    if annotation is type(None):
        def check_none(value, where):
            if value is None:
                return None
            raise _fail(where, "NoneType", value)
        return check_none
    if annotation is bool:
        def check_bool(value, where):
            if isinstance(value, bool):
                return value
            raise _fail(where, "bool", value)
        return check_bool
    if annotation is int:
        def check_int(value, where):
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise _fail(where, "int", value)
        return check_int
    if annotation is float:
        def check_float(value, where):
            if isinstance(value, float) and value - value == 0.0:
                return value  # the common case: a finite float (inf - inf and nan - nan are nan)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    number = float(value)
                except OverflowError:  # an integer beyond any float
                    number = math.inf
                if math.isfinite(number):
                    return number
            raise _fail(where, "float", value)
        return check_float
    if annotation is str:
        def check_str(value, where):
            if isinstance(value, str):
                return value
            raise _fail(where, "str", value)
        return check_str
    if origin is list:
        item = _checker(args[0])

        def check_list(value, where):
            if not isinstance(value, list):
                raise _fail(where, "list", value)
            try:
                return [item(v, where) for v in value]
            except MalformedEvent:  # again, for the message: where the bad item is
                return [item(v, f"{where}[]") for v in value]
        return check_list
    if origin is dict:
        key_check, value_check = _checker(args[0]), _checker(args[1])
        # a dict of str to floats and texts (metric values, system samples) passes as it came
        # when every key is a str and every value a finite float or a str: one loop, no calls
        kinds = set(typing.get_args(args[1]) or (args[1],))
        plain, floats, texts = args[0] is str and kinds <= {float, str}, float in kinds, str in kinds

        def check_dict(value, where):
            if not isinstance(value, dict):
                raise _fail(where, "dict", value)
            if plain:
                for k, v in value.items():
                    kind = type(v)
                    if type(k) is not str or not ((kind is float and floats and v - v == 0.0) or (kind is str and texts)):
                        break
                else:
                    return value
            out = {}
            for k, v in value.items():
                try:
                    out[key_check(k, where)] = value_check(v, where)
                except MalformedEvent:  # again, for the message: which key or which value
                    out[key_check(k, f"{where} key")] = value_check(v, f"{where}[{k!r}]")
            return out
        return check_dict
    if dataclasses.is_dataclass(annotation):
        def check_record(value, where):
            if isinstance(value, dict):
                return _build(annotation, value, where)
            raise _fail(where, annotation.__name__, value)
        return check_record
    raise TypeError(f"no check for {annotation!r}")  # a record field of a type added above


def _check(value: Any, annotation: Any, where: str) -> Any:
    """``value`` if it has the type ``annotation`` describes (recursively), else raise."""
    return _checker(annotation)(value, where)


_BUILDERS: Dict[type, Callable[[dict, str], Any]] = {}


#: the field types whose check the code of ``_builder`` writes inline, as its common case
_INLINE_CHECKS = {int: "type({v}) is int", str: "type({v}) is str", bool: "type({v}) is bool",
                  float: "type({v}) is float and {v} - {v} == 0.0"}


def _builder(cls: type) -> Callable[[dict, str], Any]:
    """The function that builds a ``cls`` from its JSON object, checking every field; made once
    per record type (``typing.get_type_hints`` and the fields' checkers).

    It is written as code for ``cls`` (as ``dataclasses`` writes ``__init__``): one line per
    field, a plain field's common case (an int that is an int, a finite float) checked inline,
    its checker called only otherwise; a field that is absent takes its default.  The channel
    runs it for every record of every rank, a hundred thousand times a second at 1024 ranks."""
    hints = typing.get_type_hints(cls)
    own_where = getattr(cls, "type", "") or None
    names = {"cls": cls, "MISSING": dataclasses.MISSING, "MalformedEvent": MalformedEvent, "own_where": own_where}
    lines = ["def build(data, where):", "    get = data.get"]
    args = []
    for i, f in enumerate(dataclasses.fields(cls)):
        v, check, path = f"v{i}", f"check{i}", f"path{i}"
        names[check] = _checker(hints[f.name])
        names[path] = f"{own_where}.{f.name}"
        where = f"({path} if where == own_where else where + {'.' + f.name!r})"
        lines.append(f"    {v} = get({f.name!r}, MISSING)")
        lines.append(f"    if {v} is MISSING:")
        if f.default is not dataclasses.MISSING:
            names[f"default{i}"] = f.default
            lines.append(f"        {v} = default{i}")
        elif f.default_factory is not dataclasses.MISSING:
            names[f"factory{i}"] = f.default_factory
            lines.append(f"        {v} = factory{i}()")
        else:
            lines.append(f"        raise MalformedEvent(f\"{{where}}: missing field {f.name!r}\")")
        inline = _INLINE_CHECKS.get(hints[f.name])
        lines.append("    else:" if inline is None else f"    elif not ({inline.format(v=v)}):")
        lines.append(f"        {v} = {check}({v}, {where})")
        args.append(f"{f.name}={v}")
    lines.append(f"    return cls({', '.join(args)})")
    exec("\n".join(lines), names)  # noqa: S102  code made above from the record's own fields
    return names["build"]


def _build(cls: type, data: dict, where: str):
    build = _BUILDERS.get(cls)
    if build is None:
        build = _BUILDERS[cls] = _builder(cls)
    return build(data, where)


def decode(data: Any) -> Event:
    """The record a JSON object encodes; ``MalformedEvent`` for anything else.

    Unknown fields are ignored (a newer peer of the same protocol version may add optional
    ones); unknown types, missing or ill-typed fields are refused.
    """
    if not isinstance(data, dict):
        raise MalformedEvent(f"an event is a JSON object, got {type(data).__name__}")
    kind = data.get("type")
    cls = RECORDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedEvent(f"unknown event type {kind!r:.40}")
    return _build(cls, data, kind)


def loads(text: Union[str, bytes]) -> Event:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MalformedEvent(f"not JSON: {exc}") from None
    return decode(data)


def failure_from_json(data: Any) -> Failure:
    """A ``Failure`` from its JSON object (the worker's ``error.json``)."""
    return _check(data, Failure, "failure")


def failure_to_json(failure: Failure) -> dict:
    return _to_json_value(failure)


# -- stacks -----------------------------------------------------------------------------------

_THREAD_LINE = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME_LINE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_LIBRARY_PARTS = ("site-packages", "dist-packages", "<frozen ")
#: the files of the process around the job, and of what wraps its calls (the step split's
#: timing of collectives): never where a rank "was"
_RUNNER_FILES = ("torchdist_magic/rank/worker.py", "<frozen runpy>", "torchdist_magic/rank/stepsplit.py")


def parse_stacks(text: str) -> List[ThreadStack]:
    """Threads and frames of a ``faulthandler`` dump (``dump_traceback(all_threads=True)``)."""
    threads: List[ThreadStack] = []
    for line in text.splitlines():
        m = _THREAD_LINE.match(line)
        if m:
            threads.append(ThreadStack(ident=int(m.group(2), 16), current=m.group(1) == "Current thread",
                                       frames=[]))
            continue
        m = _FRAME_LINE.match(line)
        if m and threads:
            threads[-1].frames.append(Frame(function=m.group(3), filename=m.group(1), line=int(m.group(2))))
    return threads


def is_library_file(filename: str) -> bool:
    """Whether ``filename`` belongs to an installed package or the standard library rather than
    to the user's own code (judged by its path alone: it may be another machine's)."""
    if any(part in filename for part in _LIBRARY_PARTS):
        return True
    return bool(re.search(r"/lib(64)?/python\d+\.\d+/", filename))


def _short_path(filename: str) -> str:
    """A library file from its package on (``torch/distributed/distributed_c10d.py``)."""
    for part in ("site-packages/", "dist-packages/"):
        if part in filename:
            return filename.split(part, 1)[1]
    return filename
