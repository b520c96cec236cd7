"""Launch settings: one dataclass that the magic's flags, the panel's controls and the Python
API's keywords are all derived from.

Each field carries its command-line flag and help text in ``metadata``, so the ``%%torchdist``
argument parser (``flags``) and the launch panel are generated from this file and cannot drift
from it.
Construction validates values only; it never looks at the environment (no CUDA probe, no Spark
lookup): that happens when a run is resolved.

Errors name what the user typed: ``num_processes must be at least 1, got 0`` from Python,
``--np must be at least 1, got 0`` from the magic (``OptionError.for_flags``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

from .registry import backend_names, unknown_backend
from .timing import DEBUG_IDLE_LIMIT

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class OptionError(Exception):
    """A launch setting was refused.  ``str()`` names the Python keyword; ``for_flags()`` the
    magic's flag, so each caller shows the name its user typed."""

    def __init__(self, name: str, template: str):
        self.name = name
        self.template = template
        super().__init__(template.format(name=name))

    def for_flags(self) -> str:
        return self.template.format(name=flag_of(self.name))


class OptionValueError(OptionError, ValueError):
    pass


class OptionTypeError(OptionError, TypeError):
    pass


def _flag(flag: str, help: str, **extra: Any) -> dict:
    """A field's flag and help; ``negative=(flag, help)`` makes it a switch (a ``bool``, or an
    ``Optional[bool]`` whose ``None`` is the backend's choice: the flag sets True, the negative
    flag False, neither leaves the default)."""
    return {"flag": flag, "help": help, **extra}


class NpRangeError(argparse.ArgumentTypeError, ValueError):
    """``--np`` text that is neither N nor MIN:MAX (argparse shows it after the flag's name)."""


def np_range(text: str) -> Any:
    """``--np``'s value: ``"4"`` as 4, ``"2:4"`` as ``(2, 4)`` (checked by ``LaunchOptions``)."""
    low, colon, high = text.strip().partition(":")
    try:
        return (int(low), int(high)) if colon else int(low)
    except ValueError:
        raise NpRangeError(f"needs N or MIN:MAX (whole numbers), got {text!r}") from None


GPU_HELP = (
    "one GPU per rank and the nccl process group; rank r uses cuda:LOCAL_RANK (device). Local "
    "processes: the machine's GPUs, refused when it has fewer than --np. Spark: the GPU Spark "
    "assigns each task (needs spark.task.resource.gpu.amount=1), first in CUDA_VISIBLE_DEVICES "
    "(cuda:0), before the other GPUs of its host's ranks; without --gpu a Spark rank sees no GPU"
)


#: what ``--hang-timeout`` does when a run hangs (``LaunchOptions.on_hang``)
HANG_MODES = ("fail", "observe", "restart")

#: where a run's channel and state live (``LaunchOptions.channel``)
CHANNELS = ("auto", "process", "kernel")
#: from this many ranks, ``channel="auto"`` puts a run's channel in a process of its own: the
#: records of a few hundred ranks keep a core busy, and a view's refresh in the same
#: interpreter would delay them (``benchmarks/scale.py``)
PROCESS_CHANNEL_RANKS = 256


@dataclass
class LaunchOptions:
    """Every setting of one distributed launch.

    ``None`` for ``timeout`` and ``hang_timeout`` means "no deadline".  ``env`` is added to each
    rank's environment on top of the variables the launcher sets (``RANK``, ``MASTER_ADDR``, ...);
    its values may be secrets: the repr shows its names only (``masked_repr``), and a run's
    record keeps nothing more.

    Example:

    ```python
    from torchdist_magic import Distributor, LaunchOptions

    options = LaunchOptions(num_processes=4, backend="local", timeout=600, env={"NCCL_DEBUG": "INFO"})
    Distributor.from_options(options).run(train)   # the same as Distributor(4, timeout=600, ...)
    ```
    """

    num_processes: int = field(
        default=1,
        metadata=_flag(
            "--np",
            "number of ranks (processes) to start; MIN:MAX (num_processes=(MIN, MAX)) starts as many "
            "as the backend can place up to MAX, and a restart after a lost host or a machine fault "
            "goes on with fewer, down to MIN (world_size() tells the job)",
            metavar="N|MIN:MAX",
            type=np_range,
        ),
    )
    min_processes: Optional[int] = field(
        default=None,
        metadata=_flag(
            "--min-np",
            "the fewest ranks the run may go on with (what --np MIN:MAX sets); None: always --np",
            metavar="N",
            type=int,
        ),
    )
    use_gpu: bool = field(default=False, metadata=_flag("--gpu", GPU_HELP))
    backend: str = field(
        default="auto",
        metadata=_flag(
            "--backend",
            "where ranks run: 'local' processes, a 'spark' barrier stage on the active "
            "SparkSession, 'auto' (Spark when a SparkSession is active, local processes otherwise), "
            "or a backend a package registered (entry point group torchdist_magic.backends)",
            metavar="NAME",
            names=backend_names,
        ),
    )
    timeout: Optional[float] = field(
        default=None,
        metadata=_flag(
            "--timeout",
            "stop every rank and raise TimeoutError after SECONDS",
            metavar="SECONDS",
            type=float,
        ),
    )
    hang_timeout: Optional[float] = field(
        default=None,
        metadata=_flag(
            "--hang-timeout",
            "when no rank has sent progress, metrics or output for SECONDS: show every rank's "
            "Python stack, stop every rank and raise TimeoutError naming where each rank was",
            metavar="SECONDS",
            type=float,
        ),
    )
    max_restarts: int = field(
        default=0,
        metadata=_flag(
            "--max-restarts",
            "when a rank dies or raises, stop every rank and start the whole job again (a new "
            "process group), up to N times; restart_count() tells the job which attempt it is, "
            "load_checkpoint() gives it the last save_checkpoint()",
            metavar="N",
            type=int,
        ),
    )
    checkpoint_dir: Optional[str] = field(
        default=None,
        metadata=_flag(
            "--checkpoint-dir",
            "where save_checkpoint() writes and load_checkpoint() reads (every rank must see it: "
            "local processes, or shared storage such as /Volumes/... or /dbfs/... for Spark on "
            "several machines); "
            "default with --max-restarts: a directory of the run, removed with it",
            metavar="PATH",
        ),
    )
    keep_checkpoints: int = field(
        default=3,
        metadata=_flag(
            "--keep-checkpoints",
            "how many of the newest checkpoints to keep; older ones are removed",
            metavar="K",
            type=int,
        ),
    )
    restart_on: Any = field(
        default="any",
        metadata=_flag(
            "--restart-on",
            "with --max-restarts: which failures start the job again. 'any' (the default): every "
            "failure, except one that repeats the previous attempt's (the same exception type at the "
            "same line of your code, with no step or checkpoint gained: it would only fail again, so "
            "the run ends and says so); 'always': every failure, repeated or not; or exception type "
            "names, comma-separated (RuntimeError,DistBackendError; their class names, subclasses not "
            "included), with 'killed' for a rank killed by a signal (out of memory) and HangTimeout "
            "for a hang under --on-hang restart: only those, and not when repeated. From Python also "
            "a function of the root cause (a Failure: exc_type, message, rank, host, exit_code, "
            "traceback) that returns True to restart",
            metavar="WHEN",
            text=lambda value: value if isinstance(value, str) else getattr(value, "__name__", repr(value)),
        ),
    )
    on_hang: str = field(
        default="fail",
        metadata=_flag(
            "--on-hang",
            "what --hang-timeout does when no rank has sent anything for that long: 'fail' (the "
            "default) stops every rank and raises HangTimeout; 'observe' names the culprit, shows "
            "every rank's stack and collective record and keeps the ranks running, for you to look "
            "(the run's log says how to stop it: the view's Stop button, an interrupt, run.cancel()); "
            "'restart' stops every rank and starts the job again as after a failure, within "
            "--max-restarts",
            choices=HANG_MODES,
        ),
    )
    env: dict = field(
        default_factory=dict,
        metadata=_flag(
            "--env",
            "extra environment variable for every rank (repeatable)",
            metavar="KEY=VALUE",
            repeat=True,
        ),
    )
    backend_options: dict = field(
        default_factory=dict,
        metadata=_flag(
            "--backend-option",
            "a setting of the backend's own (repeatable), e.g. --backend slurm --backend-option "
            "partition=gpu --backend-option time=02:00:00; the backend checks them before anything "
            "starts and names the keys it knows",
            metavar="KEY=VALUE",
            repeat=True,
        ),
    )
    all_ranks: bool = field(
        default=False,
        metadata=_flag("--all-ranks", "return every rank's value as a list indexed by rank"),
    )
    warm: bool = field(
        default=False,
        metadata=_flag(
            "--warm",
            "run on a warm pool of live ranks: the first such run starts it, later ones with the "
            "same placement (np, backend, gpu) reuse it in a fraction of a second; names a cell "
            "defines stay on the ranks for the next warm cell, and the process group stays up. "
            "%torchdist_pool shows the pool, %torchdist_pool stop stops it",
        ),
    )
    ranks: Optional[Tuple[int, ...]] = field(
        default=None,
        metadata=_flag(
            "--ranks",
            "with --warm: run the cell on these ranks of the live pool only (1,3), to look at or "
            "change their state; the other ranks stay idle, their names untouched. Its value is "
            "the lowest chosen rank's (not rank 0's unless chosen); with --all-ranks a dict "
            "{rank: value} of the chosen ranks. Such a cell must not call collectives (all_reduce, "
            "barrier, DDP): the idle ranks never join them, and it hangs until --hang-timeout or "
            "an interrupt stops the pool",
            metavar="R,R",
            text=lambda ranks: ",".join(map(str, ranks)),
        ),
    )
    pool_idle_timeout: float = field(
        default=1800.0,
        metadata=_flag(
            "--pool-idle-timeout",
            "a warm pool that has run nothing for SECONDS stops (it holds its ranks, and on Spark "
            "its task slots, until then)",
            metavar="SECONDS",
            type=float,
        ),
    )
    pdb: bool = field(
        default=False,
        metadata=_flag(
            "--pdb",
            "when a rank raises, hold it and open a (Pdb rank r) post-mortem session on its frames "
            "in the cell, as %pdb on does (where, up, p x, interact; q ends it and the cell raises). "
            "Needs a notebook that can answer input (not nbval or nbconvert --execute) and, on "
            "Spark, executors that reach the notebook",
        ),
    )
    debug_idle_timeout: float = field(
        default=DEBUG_IDLE_LIMIT,
        metadata=_flag(
            "--debug-idle-timeout",
            "a debugger session on a rank (--pdb, breakpoint()) that gets no input for SECONDS "
            "ends, freeing the rank (a post-mortem's rank exits, a breakpoint's stops the run)",
            metavar="SECONDS",
            type=float,
        ),
    )
    tls: Optional[bool] = field(
        default=None,
        metadata=_flag(
            "--tls",
            "encrypt the event channel between the ranks and this notebook (logs, metrics, rank 0's "
            "value) with TLS, under a key and certificate made for the run. Default: on for Spark, "
            "off for local processes (loopback); always on when the cluster sets spark.ssl.enabled",
            negative=(
                "--no-tls",
                "leave the event channel unencrypted: anyone on the network between "
                "the ranks and this notebook reads their logs, metrics, the notebook values "
                "and rank 0's value (every record stays authenticated: nobody can change or "
                "inject one). Refused on a cluster with spark.ssl.enabled unless "
                "pytorch.spark.distributor.ignoreSsl=true",
            ),
        ),
    )

    system_metrics: bool = field(
        default=True,
        metadata=_flag(
            "--system-metrics",
            "sample each rank's CPU %, memory (RSS) and, with GPUs, device memory and utilisation "
            "every few seconds beside the rank (never in its training thread), shown per rank and "
            "in run.state.ranks[r].system; a rank killed near its memory limit is reported as out "
            "of memory (default: on)",
            negative=("--no-system-metrics", "do not sample the ranks' CPU, memory and GPUs"),
        ),
    )

    profile: int = field(
        default=0,
        metadata=_flag(
            "--profile",
            "run torch.profiler on every rank for its next STEPS steps (of its innermost progress() "
            "loop) and merge every rank's trace into one Chrome trace / Perfetto timeline, one "
            "process per rank (run.profile: its trace_path and per rank the top operators, the "
            "step split and the peak memory). 0: no profile",
            metavar="STEPS",
            type=int,
        ),
    )

    trace_collectives: bool = field(
        default=False,
        metadata=_flag(
            "--trace-collectives",
            "keep torch's Flight Recorder on every rank (the last 256 collectives of each process "
            "group with their sizes, state and Python stack): a hang's verdict then also names the "
            "collectives that ran in C++ (DDP's all-reduce) and their sizes. It costs each "
            "collective about 10 us of the rank's CPU, every step. Off: the ranks record what "
            "the verdict needs in about 1 us (docs/guide/long-runs.md)",
            negative=("--no-trace-collectives", "do not keep torch's Flight Recorder (the default)"),
        ),
    )

    mlflow: bool = field(
        default=False,
        metadata=_flag(
            "--mlflow",
            "log the run to MLflow as one MLflow run (nested under the notebook's active run): the "
            "options, rank 0's report() metrics, every rank's system metrics, each rank's log, the "
            "outcome. This notebook writes it, with its tracking URI and experiment: the ranks "
            "never reach the tracking server",
            negative=("--no-mlflow", "do not log the run to MLflow (when %config TorchdistMagics.mlflow = True)"),
        ),
    )

    preflight: bool = field(
        default=False,
        metadata=_flag(
            "--preflight",
            "before the job runs, every rank reports its Python, torch, CUDA, NCCL and GPU driver "
            "versions and its GPUs' health, and takes part in a short bandwidth probe: versions "
            "that differ between ranks refuse the run (naming the ranks, hosts and versions), a "
            "host far below the others' bandwidth is named; the figures are in run.preflight",
            negative=("--no-preflight", "skip the pre-flight check (when %config TorchdistMagics.preflight = True)"),
        ),
    )

    detach: bool = field(
        default=False,
        metadata=_flag(
            "--detach",
            "run under a supervising process of its own, outside this kernel: the cell returns at once "
            "with the run's handle, and the run goes on if the kernel dies, restarts or shuts down. "
            "%torchdist attach RUN_ID (from any kernel of this machine) shows it and returns its value, "
            "%torchdist stop RUN_ID stops it, %torchdist runs lists every run. Local processes, Spark Connect, and classic Spark where a process of its "
            "own can start a session on the same master",
        ),
    )

    channel: str = field(
        default="auto",
        metadata=_flag(
            "--channel",
            "where the run's channel and state live: 'process', a supervising process of the run's "
            "own that receives and applies every rank's records while this kernel's view reads only "
            "what it shows (the cell still waits and returns rank 0's value; Ctrl-C stops the run; "
            "if the kernel dies the run goes on, as with --detach); 'kernel', this kernel; 'auto' "
            f"(the default), 'process' from {PROCESS_CHANNEL_RANKS} ranks where nothing keeps the "
            "run in the kernel (--data, --warm, --pdb, a classic Spark session only the notebook can "
            "use), 'kernel' otherwise",
            choices=CHANNELS,
        ),
    )

    def __post_init__(self) -> None:
        self.num_processes, least = _np_bounds(self.num_processes)
        if least is not None:
            if self.min_processes is not None and self.min_processes != least:
                raise OptionValueError(
                    "min_processes",
                    f"{{name}} is {self.min_processes!r} but num_processes says {least}: give one of them",
                )
            self.min_processes = least
        if self.min_processes is not None:
            _check_count("min_processes", self.min_processes, 1)
            if self.min_processes > self.num_processes:
                raise OptionValueError(
                    "min_processes",
                    f"{{name}} ({self.min_processes}) must be at most num_processes ({self.num_processes})",
                )
        _check_bool("use_gpu", self.use_gpu)
        if self.backend not in backend_names():
            told = unknown_backend(self.backend)[len("backend") :]
            raise OptionValueError("backend", "{name}" + told.replace("{", "{{").replace("}", "}}"))
        _check_seconds("timeout", self.timeout)
        _check_seconds("hang_timeout", self.hang_timeout)
        _check_count("max_restarts", self.max_restarts, 0)
        if self.checkpoint_dir is not None:
            if not isinstance(self.checkpoint_dir, (str, os.PathLike)):
                raise OptionTypeError("checkpoint_dir", f"{{name}} must be a path, got {self.checkpoint_dir!r}")
            self.checkpoint_dir = os.fspath(self.checkpoint_dir)
            if (
                not isinstance(self.checkpoint_dir, str)
                or not self.checkpoint_dir.strip()
                or "\x00" in self.checkpoint_dir
            ):
                raise OptionValueError(
                    "checkpoint_dir", f"{{name}} must be a directory path, got {self.checkpoint_dir!r}"
                )
        _check_count("keep_checkpoints", self.keep_checkpoints, 1)
        self.restart_on = check_restart_on(self.restart_on)
        self._check_hang_mode()
        self.env = parse_env(self.env)
        self.backend_options = parse_backend_options(self.backend_options)
        _check_bool("all_ranks", self.all_ranks)
        _check_bool("warm", self.warm)
        _check_seconds("pool_idle_timeout", self.pool_idle_timeout)
        self.ranks = _chosen_ranks(self.ranks, self.num_processes)
        if self.ranks is not None and not self.warm:
            raise OptionValueError(
                "ranks",
                "{name} needs a warm pool: it runs a cell on some ranks of "
                "the live pool (--warm/warm=True), and a cold run starts every rank afresh",
            )
        _check_bool("pdb", self.pdb)
        if self.debug_idle_timeout is None:
            raise OptionTypeError("debug_idle_timeout", "{name} must be a number of seconds, got None")
        _check_seconds("debug_idle_timeout", self.debug_idle_timeout)
        if self.tls is not None:
            _check_bool("tls", self.tls, "True, False or None (the backend's default)")
        _check_bool("system_metrics", self.system_metrics)
        _check_count("profile", self.profile, 0)
        _check_bool("mlflow", self.mlflow)
        _check_bool("preflight", self.preflight)
        if self.warm and self.pdb:
            raise OptionValueError(
                "pdb",
                "{name} holds a failing rank for a debugger, which a warm pool's "
                "ranks cannot do yet: run it without --warm/warm=True",
            )
        if self.channel not in CHANNELS:
            raise OptionValueError(
                "channel", f"{{name}} must be one of {', '.join(map(repr, CHANNELS))}, got {self.channel!r}"
            )
        if self.channel == "process" and self.warm:
            raise OptionValueError(
                "channel",
                "{name} 'process' puts the run under a process of its own, and a warm pool's "
                "ranks belong to this kernel: use one or the other",
            )
        if self.channel == "process" and self.pdb:
            raise OptionValueError(
                "pdb",
                "{name} holds a failing rank for a debugger in this cell, which a run whose "
                "channel is in a process of its own cannot reach: run it with --channel kernel",
            )
        _check_bool("detach", self.detach)
        if self.detach and self.warm:
            raise OptionValueError(
                "detach",
                "{name} runs under a process of its own, and a warm pool's ranks "
                "belong to this kernel: use one or the other",
            )
        if self.detach and self.pdb:
            raise OptionValueError(
                "pdb",
                "{name} holds a failing rank for a debugger in the cell, and a "
                "detached run has no cell to debug in: run it without --detach/detach=True",
            )
        if self.warm and self.max_restarts:
            raise OptionValueError(
                "max_restarts",
                "{name} starts every rank again (a new process group) "
                "after a failure, and a warm pool keeps its ranks: use one or the other",
            )

    def _check_hang_mode(self) -> None:
        """``on_hang`` with what it needs, and a policy that can say yes to a hang's restart."""
        if self.on_hang not in HANG_MODES:
            raise OptionValueError(
                "on_hang", f"{{name}} must be one of {', '.join(map(repr, HANG_MODES))}, got {_literal(self.on_hang)}"
            )
        if self.on_hang != "fail" and self.hang_timeout is None:
            raise OptionValueError(
                "on_hang",
                f"{{name}} {self.on_hang} says what a hang does, and this run has no hang timeout: "
                "give it one (--hang-timeout SECONDS, hang_timeout=)",
            )
        if self.on_hang == "restart" and not self.max_restarts:
            raise OptionValueError(
                "on_hang",
                "{name} restart starts the job again after a hang, within --max-restarts, which is 0: "
                "give it restarts (--max-restarts N, max_restarts=)",
            )
        named = restart_names(self.restart_on)
        if self.on_hang == "restart" and named is not None and "HangTimeout" not in named:
            raise OptionValueError(
                "on_hang",
                f"{{name}} restart starts the job again after a hang, and --restart-on "
                f"{_literal(self.restart_on)} does not name HangTimeout: add it, or use --on-hang fail",
            )
        if callable(self.restart_on) and (self.detach or self.channel == "process"):
            raise OptionValueError(
                "restart_on",
                "{name} as a function decides in this kernel, and a run under a process of its own "
                "(--detach, --channel process) cannot call it: name exception types instead "
                "('RuntimeError,killed')",
            )

    def replace(self, **changes: Any) -> "LaunchOptions":
        """A copy with ``changes``, validated like a new one."""
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        return masked_repr(self)


#: what stands for an ``env`` value wherever the value itself is not shown or kept
MASKED = "***"


def masked_env(env: Mapping[str, Any]) -> dict:
    """``env``'s names, each with ``MASKED`` for its value."""
    return {name: MASKED for name in env}


def masked_repr(value: Any) -> str:
    """The dataclass ``value``'s repr as ``dataclasses`` writes it, its ``env`` masked
    (``masked_env``): a traceback, a log or a notebook's output shows the names, never a value."""
    parts = []
    for f in dataclasses.fields(value):
        if f.repr:
            shown = getattr(value, f.name)
            if f.name == "env" and isinstance(shown, Mapping):
                shown = masked_env(shown)
            parts.append(f"{f.name}={shown!r}")
    return f"{type(value).__qualname__}({', '.join(parts)})"


#: the words of ``--restart-on`` that stand alone (anything else is a list of names)
RESTART_WORDS = ("any", "always")
#: a name in ``--restart-on``: an exception class (``DistBackendError``, ``torch.cuda.OutOfMemoryError``)
#: or ``killed``
_RESTART_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def check_restart_on(value: Any) -> Any:
    """``restart_on`` as a run keeps it: ``"any"``, ``"always"``, names joined by commas
    (``"RuntimeError,killed"``; a list or tuple of names is joined), or a function, as given."""
    if callable(value) and not isinstance(value, type):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    if not isinstance(value, str):
        raise OptionTypeError(
            "restart_on",
            "{name} must be 'any', 'always', exception type names ('RuntimeError,killed') or a "
            f"function of the failure that returns True to restart, got {_literal(value)}",
        )
    names = [part.strip() for part in value.split(",")]
    if len(names) == 1 and names[0] in RESTART_WORDS:
        return names[0]
    if any(word in names for word in RESTART_WORDS):
        raise OptionValueError(
            "restart_on",
            f"{{name}} {_literal(value)}: 'any' and 'always' stand alone; "
            "to restart on some failures only, name their exception types",
        )
    bad = [name for name in names if not _RESTART_NAME.match(name)]
    if bad:
        raise OptionValueError(
            "restart_on",
            f"{{name}}: {_literal(bad[0] or value)} is not an exception type name; give 'any', 'always' "
            "or names separated by commas (RuntimeError,DistBackendError,killed)",
        )
    return ",".join(dict.fromkeys(names))


def restart_names(restart_on: Any) -> Optional[Tuple[str, ...]]:
    """The names a ``restart_on`` list gives, each its last dotted part (what a rank reports of
    its exception); ``None`` for a word (``any``, ``always``) or a function."""
    if not isinstance(restart_on, str) or restart_on in RESTART_WORDS:
        return None
    return tuple(name.rsplit(".", 1)[-1] for name in restart_on.split(","))


def _check_seconds(name: str, value: Any) -> None:
    """``None`` (no limit) or a positive, finite number of seconds."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionTypeError(name, f"{{name}} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise OptionValueError(name, f"{{name}} must be a positive number of seconds, got {value:g}")


def _np_bounds(value: Any) -> Tuple[int, Optional[int]]:
    """``num_processes`` as (MAX, MIN): a whole number (MIN ``None``), ``(MIN, MAX)`` or
    ``"MIN:MAX"``."""
    if isinstance(value, str) and ":" in value:
        try:
            value = np_range(value)
        except NpRangeError as exc:
            raise OptionValueError(
                "num_processes", "{name} " + str(exc).replace("{", "{{").replace("}", "}}")
            ) from None
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise OptionValueError(
                "num_processes", f"{{name}} as a range is (MIN, MAX), two numbers; got {_literal(value)}"
            )
        low, high = value
        _check_count("num_processes", low, 1)
        _check_count("num_processes", high, 1)
        if low > high:
            raise OptionValueError("num_processes", f"{{name}} MIN:MAX needs MIN <= MAX, got {low}:{high}")
        return high, low
    _check_count("num_processes", value, 1)
    return value, None


def _check_count(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(name, f"{{name}} must be a whole number, got {value!r}")
    if value < least:
        raise OptionValueError(name, f"{{name}} must be at least {least}, got {value}")


def _check_bool(name: str, value: Any, allowed: str = "True or False") -> None:
    if not isinstance(value, bool):
        raise OptionTypeError(name, f"{{name}} must be {allowed}, got {value!r}")


def _literal(value: Any) -> str:
    """``repr(value)`` for a message template (its braces kept as they are)."""
    return repr(value).replace("{", "{{").replace("}", "}}")


def _chosen_ranks(ranks: Any, num_processes: int) -> Optional[Tuple[int, ...]]:
    """``ranks`` (``None``, ``"1,3"`` or integers) as distinct ranks of ``num_processes``, in
    order; refuses an empty, garbled or repeated list and a rank out of range."""
    if ranks is None:
        return None
    if isinstance(ranks, str):
        parts = [p.strip() for p in ranks.split(",")] if ranks.strip() else []
        if not all(re.fullmatch(r"\d+", p) for p in parts):
            raise OptionValueError(
                "ranks", f"{{name}} must be rank numbers separated by commas (1,3), got {_literal(ranks)}"
            )
        ranks = [int(p) for p in parts]
    elif isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = [ranks]
    if not isinstance(ranks, (list, tuple, set, frozenset, range)) or any(
        isinstance(r, bool) or not isinstance(r, int) for r in ranks
    ):
        raise OptionTypeError(
            "ranks", f"{{name}} must be rank numbers (a list of ints, or '1,3'), got {_literal(ranks)}"
        )
    if not ranks:
        raise OptionValueError("ranks", "{name} must name at least one rank")
    seen = set()
    for r in ranks:
        if r in seen:
            raise OptionValueError("ranks", f"{{name}} names rank {r} more than once")
        seen.add(r)
        if not 0 <= r < num_processes:
            raise OptionValueError(
                "ranks", f"{{name}}: there is no rank {r} among {num_processes} ranks (0..{num_processes - 1})"
            )
    return tuple(sorted(ranks))


def parse_env(env: Any) -> dict:
    """Normalise ``env`` (a mapping, or ``KEY=VALUE`` strings) to ``{str: str}``.

    Raises ``OptionValueError``/``OptionTypeError`` naming the malformed entry.
    """
    if env is None:
        return {}
    if isinstance(env, str):
        env = [env]
    items: list
    if isinstance(env, Mapping):
        items = list(env.items())
    elif isinstance(env, (list, tuple)):
        items = []
        for entry in env:
            if not isinstance(entry, str) or "=" not in entry:
                raise OptionValueError("env", f"{{name}} entry {entry!r} is not of the form KEY=VALUE")
            key, _, value = entry.partition("=")
            items.append((key, value))
    else:
        raise OptionTypeError(
            "env", f"{{name}} must be a dict or a list of 'KEY=VALUE' strings, got {type(env).__name__}"
        )
    out = {}
    for key, value in items:
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise OptionValueError("env", f"{{name}}: {key!r} is not a valid environment variable name")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise OptionTypeError(
                "env", f"{{name}}: the value of {key} must be a string or number, got {type(value).__name__}"
            )
        value = str(value)
        if "\x00" in value:
            raise OptionValueError("env", f"{{name}}: the value of {key} contains a NUL byte")
        out[key] = value
    return out


_OPTION_KEY = re.compile(r"^[a-z][a-z0-9_-]*$")


def parse_backend_options(options: Any) -> dict:
    """Normalise ``backend_options`` (a mapping, or ``KEY=VALUE`` strings) to ``{str: str}``:
    keys as a backend names them (lower case, digits, ``_``, ``-``), values as text.  Which keys
    a backend knows, and what their values may be, the backend checks (``Backend.configure``).

    Raises ``OptionValueError``/``OptionTypeError`` naming the malformed entry.
    """
    if options is None:
        return {}
    if isinstance(options, str):
        options = [options]
    if isinstance(options, Mapping):
        items = list(options.items())
    elif isinstance(options, (list, tuple)):
        items = []
        for entry in options:
            if not isinstance(entry, str) or "=" not in entry:
                raise OptionValueError("backend_options", f"{{name}} entry {entry!r} is not of the form KEY=VALUE")
            key, _, value = entry.partition("=")
            items.append((key, value))
    else:
        raise OptionTypeError(
            "backend_options",
            f"{{name}} must be a dict or a list of 'KEY=VALUE' strings, got {type(options).__name__}",
        )
    out = {}
    for key, value in items:
        if not isinstance(key, str) or not _OPTION_KEY.match(key):
            raise OptionValueError(
                "backend_options",
                f"{{name}}: {key!r} is not a backend option's name (lower-case letters, digits, '_' and '-')",
            )
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise OptionTypeError(
                "backend_options",
                f"{{name}}: the value of {key} must be a string or number, got {type(value).__name__}",
            )
        value = str(value)
        if "\x00" in value:
            raise OptionValueError("backend_options", f"{{name}}: the value of {key} contains a NUL byte")
        out[key] = value
    return out


def option_fields() -> list:
    """The ``dataclasses.Field`` objects that have a user-facing flag, in declaration order."""
    return [f for f in dataclasses.fields(LaunchOptions) if "flag" in f.metadata]


def flag_of(name: str) -> str:
    """The magic's flag of the ``LaunchOptions`` field ``name`` (the name itself if it has none)."""
    for f in option_fields():
        if f.name == name:
            return f.metadata["flag"]
    return name
