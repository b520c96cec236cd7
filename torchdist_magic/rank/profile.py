"""A profile of a rank's next steps (``--profile STEPS``), sent to the driver.

``torch.profiler`` starts at the first step of the rank's innermost ``progress()`` loop (the step
boundaries are the step split's, ``stepsplit``) and stops after ``STEPS`` steps, or when the
loop ends sooner.  Its Chrome trace goes to the driver in ``events.ProfilePiece`` records of
``PIECE`` characters, then ``events.ProfileDone`` with the top operators and the peak memory.  A
trace larger than ``MAX_TRACE_CHARS`` stays on the rank's machine (``ProfileDone.kept_at``).
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import tempfile
import time
import traceback
from typing import Callable, List, Optional

from ..core import events
from ..core.names import PROFILE_STEPS_ENV

#: characters of a trace per ``ProfilePiece`` (a record is well under the channel's frame limit)
PIECE = 1024 * 1024
#: a trace larger than this stays on the rank's machine
MAX_TRACE_CHARS = 64 * 1024 * 1024
#: operators named in a rank's profile summary
TOP_OPERATORS = 10


class StepProfiler:
    """Profiles ``steps`` steps of the rank (``step`` at each boundary, ``finish`` when the
    loops end) and sends the profile with ``send``."""

    def __init__(self, steps: int, send: Callable[[events.Event], None], rank: Callable[[], int]):
        self.steps = steps
        self._send = send
        self._rank = rank
        self._profiler = None
        self._counted = 0
        self.done = False

    def step(self) -> None:
        """A step of the innermost loop begins."""
        if self.done:
            return
        if self._profiler is None:
            self._start()
            return
        self._counted += 1
        self._profiler.step()
        if self._counted >= self.steps:
            self.finish()

    def _start(self) -> None:
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(activities=activities, profile_memory=True)
            self._profiler.__enter__()
        except Exception as exc:  # noqa: BLE001  no profile, said in the rank's ProfileDone
            self._fail(exc)

    def finish(self) -> None:
        """Stop profiling (after its steps, or when the loop ended sooner) and send the profile."""
        if self.done or self._profiler is None:
            return
        self.done = True
        profiler, self._profiler = self._profiler, None
        try:
            profiler.__exit__(None, None, None)
            fd, path = tempfile.mkstemp(prefix=f"torchdist-profile-rank{self._rank()}-", suffix=".json")
            os.close(fd)
            profiler.export_chrome_trace(path)
            top = _top_operators(profiler)
        except Exception as exc:  # noqa: BLE001  no profile, said in the rank's ProfileDone
            self._fail(exc)
            return
        size = os.path.getsize(path)
        kept_at = ""
        if size > MAX_TRACE_CHARS:
            kept_at = f"{socket.gethostname()}:{path}"
        else:
            with open(path, encoding="utf-8") as fh:
                while True:
                    piece = fh.read(PIECE)
                    if not piece:
                        break
                    self._send(events.ProfilePiece(rank=self._rank(), data=piece))
            os.remove(path)
        self._send(
            events.ProfileDone(
                rank=self._rank(),
                steps=self._counted,
                size=size,
                kept_at=kept_at,
                top=top,
                peak_memory_bytes=_peak_memory(),
                peak_gpu_memory_bytes=_peak_gpu(),
                time=time.time(),
            )
        )

    def _fail(self, exc: BaseException) -> None:
        self.done = True
        self._profiler = None
        self._send(
            events.ProfileDone(
                rank=self._rank(),
                error="".join(traceback.format_exception_only(type(exc), exc)).strip(),
                time=time.time(),
            )
        )


def _top_operators(profiler) -> List[events.ProfileOp]:
    averages = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return [
        events.ProfileOp(name=e.key, self_cpu_s=e.self_cpu_time_total / 1e6, calls=int(e.count))
        for e in averages[:TOP_OPERATORS]
    ]


def _peak_memory() -> float:
    """The rank's process's peak resident memory, in bytes (Linux counts kibibytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)


def _peak_gpu() -> Optional[float]:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return float(sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())))


def from_env(send: Callable[[events.Event], None], rank: Callable[[], int]) -> Optional[StepProfiler]:
    """The rank's profiler when the run asked for one (``TORCHDIST_PROFILE_STEPS``), else None."""
    try:
        steps = int(os.environ.get(PROFILE_STEPS_ENV, "0"))
    except ValueError:
        return None
    return StepProfiler(steps, send, rank) if steps > 0 else None
