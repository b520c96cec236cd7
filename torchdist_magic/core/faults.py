"""What a failure's root cause was: the user's code, the machine, a lost host, or a hang
(``classify``), and which host (or Spark executor) a restart leaves out for it (``Exclusion``).

Pure functions of what a run already records: the root cause's ``Failure`` (its exception type,
message, exit code, last lines of output), the rank's pre-flight report (``events.Preflight``)
and its last system-metrics sample.  (The system metrics carry no ECC or throttle reading yet: the pre-flight is where those are
seen.)  The classes, by what they mean for a restart:

- ``user``: the job's own code raised or exited; the same machines may run it again.
- ``machine``: the machine failed the rank (a CUDA, NCCL or ECC error, a GPU the pre-flight or the
  metrics saw throttled or with ECC errors, a full disk, a process killed by SIGKILL as the
  kernel's OOM killer does); the next attempt leaves that host out where the backend can.
- ``lost``: what ran the rank is gone (a Spark executor lost, a launcher the driver stopped
  hearing from); its host is left out as well.
- ``hang``: no rank moved for ``--hang-timeout``.

A CUDA *out of memory* error is the job's (its batch or model does not fit), not the machine's.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Any, Iterable, Optional

USER = "user"
MACHINE = "machine"
LOST = "lost"
HANG = "hang"
#: every class, in the order ``classify`` tries them
CLASSES = (HANG, LOST, MACHINE, USER)
#: classes after which the next attempt leaves the failing host out
EXCLUDING = (MACHINE, LOST)

#: (pattern over the failure's text, why) for the machine's faults; the first match names it
_MACHINE_PATTERNS = (
    (re.compile(r"uncorrectable ECC|ECC error|\bXid\b", re.I), "an ECC error on its GPU"),
    (re.compile(r"\bNCCL (?:error|WARN)|nccl\w*Error|ncclSystemError|ncclUnhandledCudaError", re.I), "an NCCL error"),
    (
        re.compile(
            r"CUDA error|CUDA driver error|cudaError\w*|CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|"
            r"device-side assert|an illegal memory access",
            re.I,
        ),
        "a CUDA error",
    ),
    (re.compile(r"No space left on device|ENOSPC|Disk quota exceeded", re.I), "its disk is full"),
)
_CUDA_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError", re.I)
#: Spark's words for an executor that went away under its task, and the executor's id
_LOST_PATTERNS = re.compile(
    r"ExecutorLostFailure|executor \S+ exited|Executor heartbeat timed out|Slave lost|Worker lost|"
    r"Remote RPC client disassociated|Container killed|channel to its launcher was lost|launcher (?:was )?lost",
    re.I,
)
_EXECUTOR_ID = re.compile(r"ExecutorLostFailure \(executor (\S+?) exited|executor (\S+?)\)? exited", re.I)


@dataclass(frozen=True)
class Fault:
    """A root cause's class (``kind``: one of ``CLASSES``) and one line of why."""

    kind: str
    why: str

    @property
    def excludes_host(self) -> bool:
        """Whether the next attempt leaves the failing host out."""
        return self.kind in EXCLUDING


@dataclass(frozen=True)
class Exclusion:
    """A host (and, on Spark, the executor) a restart leaves out, and why: ``attempt`` is the
    attempt whose root cause it was."""

    host: str
    executor: str
    kind: str
    why: str
    attempt: int
    rank: int = 0  # the failing rank, in that attempt (a backend that places by rank reads it)

    def sentence(self) -> str:
        what = f"executor {self.executor} on {self.host}" if self.executor else self.host
        return f"{what} left out after attempt {self.attempt}: {self.kind} fault, {self.why}"


def _text(failure: Any) -> str:
    return "\n".join(
        [failure.exc_type or "", failure.message or "", failure.traceback or "", *(failure.log_tail or ())]
    )


def classify(
    failure: Any,
    *,
    hung: bool = False,
    preflight: Any = None,
) -> Fault:
    """The class of ``failure`` (a ``Failure``; ``None`` with ``hung``), from what it says and,
    where given, the failing rank's pre-flight report (``preflight``: a GPU with ECC errors or
    throttled points at the machine)."""
    if hung:
        return Fault(HANG, "no rank sent progress, metrics or output for the hang timeout")
    if failure is None:
        return Fault(USER, "no failure was recorded")
    text = _text(failure)
    if _LOST_PATTERNS.search(text):
        executor = executor_of(failure)
        return Fault(LOST, f"executor {executor} was lost" if executor else "the process that ran the rank was lost")
    cuda_oom = bool(_CUDA_OOM.search(text)) and "killed" not in text.lower()
    for pattern, why in _MACHINE_PATTERNS:
        if pattern.search(text) and not (cuda_oom and why == "a CUDA error"):
            return Fault(MACHINE, why)
    if failure.exit_code == -signal.SIGKILL and not failure.exc_type:
        said = f" ({failure.message})" if failure.message else ""
        return Fault(MACHINE, f"its process was killed by SIGKILL, as the kernel's OOM killer does{said}")
    gpu = _gpu_trouble(preflight)
    if gpu:
        return Fault(MACHINE, gpu)
    if cuda_oom:
        return Fault(USER, "CUDA ran out of memory for the job's own tensors")
    return Fault(USER, f"the job raised {failure.exc_type}" if failure.exc_type else "the job's process failed")


def _gpu_trouble(preflight: Any) -> str:
    for gpu in getattr(preflight, "gpus", None) or ():
        if gpu.ecc_errors:
            return f"its GPU {gpu.index} had {gpu.ecc_errors} uncorrected ECC errors at the pre-flight check"
        if gpu.throttled:
            return f"its GPU {gpu.index} was throttled ({gpu.throttled}) at the pre-flight check"
    return ""


def executor_of(failure: Any) -> str:
    """The Spark executor id a lost-executor failure names ("" when it names none)."""
    m = _EXECUTOR_ID.search(_text(failure))
    return (m.group(1) or m.group(2) or "") if m else ""


def exclusion(failure: Any, fault: Fault, attempt: int, host: str = "") -> Optional[Exclusion]:
    """What the next attempt leaves out for ``failure`` of class ``fault``: ``None`` when the
    class keeps the host, or nothing names a host or executor to leave out.  ``host``: the
    failing rank's host as its backend places ranks (a Slurm node's name, where the rank's own
    report has the machine's host name), else the failure's."""
    if not fault.excludes_host:
        return None
    executor = executor_of(failure)
    host = host or failure.host or ""
    if not (host or executor):
        return None
    return Exclusion(host, executor, fault.kind, fault.why, attempt, failure.rank)


def excluded_hosts(exclusions: Iterable[Exclusion]) -> list:
    """The distinct host names of ``exclusions``, in order."""
    return list(dict.fromkeys(e.host for e in exclusions if e.host))
