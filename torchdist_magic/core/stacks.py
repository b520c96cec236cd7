"""A rank's Python stacks as the records carry them: ``faulthandler``'s text parsed into threads and
frames (``parse_stacks``), and which frames are the user's own code (``is_library_file``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List

_THREAD_LINE = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME_LINE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_LIBRARY_PARTS = ("site-packages", "dist-packages", "<frozen ")
#: the files of the process around the job, and of what wraps its calls (the step split's
#: timing of collectives): never where a rank "was"
_RUNNER_FILES = (
    "torchdist_magic/rank/worker.py",
    "torchdist_magic/rank/jobrun.py",
    "torchdist_magic/rank/serving.py",
    "torchdist_magic/rank/runners.py",
    "<frozen runpy>",
    "torchdist_magic/rank/stepsplit.py",
)


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


def parse_stacks(text: str) -> List[ThreadStack]:
    """Threads and frames of a ``faulthandler`` dump (``dump_traceback(all_threads=True)``)."""
    threads: List[ThreadStack] = []
    for line in text.splitlines():
        m = _THREAD_LINE.match(line)
        if m:
            threads.append(ThreadStack(ident=int(m.group(2), 16), current=m.group(1) == "Current thread", frames=[]))
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
