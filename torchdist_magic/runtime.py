"""What a job calls: rank information, progress and metric reporting.

Usable from any code a rank runs (a ``%%torchdist`` cell, a function given to
``Distributor.run``, a script).  Outside a run the helpers behave as rank 0 of 1 and reporting
does nothing, so the same code runs unchanged in a plain notebook cell.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from typing import Any, Iterable, Iterator, Optional

from . import events

#: names a cell gets from the run, in place of any notebook value of the same name
CELL_PROVIDED = ("rank", "local_rank", "world_size", "device", "progress", "report", "is_main")

_sink_lock = threading.Lock()
_sink = None  # set by the worker: an object with .send(dict)
_report_step = itertools.count(1)
_bar_ids = itertools.count()
PROGRESS_INTERVAL = 0.1


def _install_sink(sink) -> None:
    """Called by the worker to route events (``events`` records) to the driver (``None`` to
    detach)."""
    global _sink, _report_step
    with _sink_lock:
        _sink = sink
        _report_step = itertools.count(1)


def _emit(event: events.Event) -> None:
    sink = _sink
    if sink is not None:
        sink.send(event)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def rank() -> int:
    """This process's global rank (0 outside a run)."""
    return _env_int("RANK", 0)


def world_size() -> int:
    """Number of ranks in the run (1 outside a run)."""
    return _env_int("WORLD_SIZE", 1)


def local_rank() -> int:
    """Rank among the processes on this host (0 outside a run)."""
    return _env_int("LOCAL_RANK", 0)


def local_world_size() -> int:
    """Number of ranks on this host (1 outside a run)."""
    return _env_int("LOCAL_WORLD_SIZE", 1)


def is_main() -> bool:
    """True on rank 0: the rank whose value the notebook gets."""
    return rank() == 0


def uses_gpu() -> bool:
    """Whether the run asked for GPUs (``--gpu`` / ``use_gpu=True``)."""
    return os.environ.get("TORCHDIST_USE_GPU") == "1"


def device():
    """``cuda:<local_rank>`` when the run asked for GPUs and CUDA is there, else ``cpu``."""
    import torch

    if uses_gpu() and torch.cuda.is_available():
        return torch.device("cuda", local_rank() % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def _number(name: str, value: Any) -> float:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"report({name}=...) needs a number, got {type(value).__name__}")
    return float(value)


def report(step: Optional[int] = None, **metrics: Any) -> None:
    """Send named numbers (``report(loss=0.3, acc=0.9)``) to the run view.

    ``step`` defaults to a counter of ``report`` calls on this rank.  Tensors with one element
    are accepted.  Does nothing outside a run.
    """
    values = {name: _number(name, v) for name, v in metrics.items()}
    if _sink is None:
        return
    if step is None:
        step = next(_report_step)
    clean = {k: (v if math.isfinite(v) else str(v)) for k, v in values.items()}
    _emit(events.Metrics(rank=rank(), step=int(step), values=clean, time=time.time()))


class progress:
    """Iterate like ``tqdm``: yields the items and reports step n/total to the run view.

    Updates are rate-limited at the source (every ``PROGRESS_INTERVAL`` seconds and at the
    end), so wrapping a tight loop costs next to nothing.
    """

    def __init__(self, iterable: Iterable, total: Optional[int] = None, desc: Optional[str] = None):
        self.iterable = iterable
        if total is None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.total = total
        self.desc = desc or ""
        self.bar = f"{self.desc}#{next(_bar_ids)}"
        self.n = 0

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("progress over an iterable of unknown length")
        return self.total

    def _send(self, start: float, state: str) -> None:
        _emit(events.Progress(rank=rank(), bar=self.bar, desc=self.desc, n=self.n, total=self.total,
                              elapsed=time.time() - start, state=state))

    def __iter__(self) -> Iterator:
        start = last = time.time()
        self._send(start, "running")
        try:
            for item in self.iterable:
                yield item
                self.n += 1
                now = time.time()
                if _sink is not None and now - last >= PROGRESS_INTERVAL:
                    last = now
                    self._send(start, "running")
        finally:
            self._send(start, "done" if self.total is None or self.n >= self.total else "stopped")


def cell_names() -> dict:
    """What a ``%%torchdist`` cell finds defined: the ``CELL_PROVIDED`` names."""
    return dict(rank=rank(), local_rank=local_rank(), world_size=world_size(), progress=progress,
                report=report, is_main=is_main(), device=device())
