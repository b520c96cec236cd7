"""What a job calls: rank information, progress and metric reporting, checkpoints.

Usable from any code a rank runs (a ``%%torchdist`` cell, a function given to
``Distributor.run``, a script).  Outside a run the helpers behave as rank 0 of 1 and reporting
does nothing, so the same code runs unchanged in a plain notebook cell.

Inside a run, every ``tqdm`` bar of the rank (Hugging Face's, Lightning's ``TQDMProgressBar``,
the user's own) reports to the run view as this rank's progress, like ``progress()``, instead of
redrawing its line on the rank's output; a bar left on screen (``leave=True``) writes its final
line once.  The tasks of a ``rich`` progress display (Lightning's ``RichProgressBar``, its
default when rich is installed) report the same way (``progress_hooks``).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import threading
import time
from collections import deque
from typing import Any, Iterable, Iterator, List, Optional, Tuple

from ..core import events
from ..core.names import (
    CHECKPOINT_DIR_ENV,
    HOST_RANKS_ENV,
    KEEP_CHECKPOINTS_ENV,
    RESTART_COUNT_ENV,
    RUN_ID_ENV,
    USE_GPU_ENV,
)
from . import profile as rankprofile, progress_hooks, stepsplit


_sink_lock = threading.Lock()
_sink = None  # set by the worker: an object with .send(dict)
_split: Optional[stepsplit.StepSplit] = None  # the rank's step split, while it has a sink
_report_step = itertools.count(1)
_bar_ids = itertools.count()
PROGRESS_INTERVAL = 0.1
#: seconds a ``report()`` point waits in the rank before it goes out with the others of that
#: interval, as one ``events.Metrics`` record (``_ReportBatch``)
REPORT_INTERVAL = 0.1


class _ReportBatch:
    """The ``report()`` points of a rank not sent yet.  A call appends ``(step, time, values)``
    (a deque: appended and drained from different threads without a lock) and, when it is the
    first of an interval, wakes the batch's thread, which sends every point of the interval as one
    ``events.Metrics`` record ``REPORT_INTERVAL`` later: a call costs about what it costs outside
    a run (no record, no queue, no lock per call; ``benchmarks/rank_overhead.py``)."""

    def __init__(self, send):
        self.points: deque = deque()
        self.wake = threading.Event()
        self._send = send
        self._flushing = threading.Lock()  # two flushes at once would send their records out of order
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def first_point(self) -> None:
        """A point comes to an empty batch (``report`` appends it to ``points`` itself, one call
        less): the batch's thread sends the interval's points ``REPORT_INTERVAL`` from now."""
        self.wake.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="torchdist-report", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            self.wake.wait()
            time.sleep(REPORT_INTERVAL)
            self.wake.clear()
            self.flush()

    def flush(self) -> None:
        """Send the points gathered so far (from any thread: each point goes once, in order)."""
        with self._flushing:
            self._flush()

    def _flush(self) -> None:
        points = []
        while True:
            try:
                points.append(self.points.popleft())
            except IndexError:
                break
        if not points:
            return
        record = events.Metrics(rank=rank())
        steps, times, points_values = zip(*points)
        record.steps.extend(steps)
        record.times.extend(times)
        first = points_values[0]
        width = len(first)
        columns = None
        if all(len(values) == width for values in points_values):
            try:  # every point has the first one's names (the usual case): a column a name
                columns = [[values[name] for values in points_values] for name in first]
            except KeyError:
                pass
        if columns is not None:
            record.names.extend(first)
            for column in columns:
                if not math.isfinite(sum(column)):  # a nan or an inf among them (or a sum that overflows)
                    column[:] = [value if math.isfinite(value) else str(value) for value in column]
            record.values.extend(columns)
        else:
            self._columns_by_point(record, points_values)
        self._send(record)

    @staticmethod
    def _columns_by_point(record: events.Metrics, points_values: Tuple[dict, ...]) -> None:
        """``record``'s names and columns from points whose names differ (None where a point lacks one)."""
        columns: dict = {}
        for n, values in enumerate(points_values):
            for name, value in values.items():
                column = columns.get(name)
                if column is None:
                    column = columns[name] = [None] * n
                    record.names.append(name)
                    record.values.append(column)
                column.append(value if math.isfinite(value) else str(value))
            for column in record.values:  # a name this point lacks
                if len(column) <= n:
                    column.append(None)

    def close(self) -> None:
        self._closed = True
        self.wake.set()
        self.flush()


_reports: Optional[_ReportBatch] = None  # the rank's unsent report() points, while it has a sink


class RankStopped(KeyboardInterrupt):
    """Raised in a rank's main thread when the run stops it (cancel, interrupt, timeout, a peer's
    failure: the rank got SIGTERM), so that its ``finally`` blocks and ``atexit`` handlers run
    before the kill that follows the grace period.  A ``KeyboardInterrupt``: code that handles
    Ctrl-C (Lightning's graceful shutdown) handles it too, and ``except Exception`` does not
    swallow it.

    Example:

    ```python
    %%torchdist --np 2 --timeout 600
    from torchdist_magic import RankStopped
    try:
        train()
    except RankStopped:
        writer.flush()   # the run is stopping this rank: finish quickly, then let it go
        raise
    ```
    """


def _install_sink(sink) -> None:
    """Called by the worker to route events (``events`` records) to the driver (``None`` to
    detach).  With a sink, tqdm bars report to it too."""
    global _sink, _split, _reports
    with _sink_lock:
        if _reports is not None:
            _reports.close()
        _reports = None if sink is None else _ReportBatch(_emit)
        _sink = sink
        _split = (
            None
            if sink is None
            else stepsplit.StepSplit(_emit, rank, profiler=lambda: rankprofile.from_env(_emit, rank))
        )
    _new_job()
    if sink is not None:
        progress_hooks.install(_emit, rank, lambda: _split, lambda: next(_bar_ids))


def _new_job() -> None:
    """Called by a warm pool's rank before each job: the job's ``report()`` steps count from 1,
    as a cold run's do (its plots must not start where the previous job's ended)."""
    global _report_step
    flush_reports()
    with _sink_lock:
        _report_step = itertools.count(1)
        if _split is not None:
            _split.reset()


def flush_reports() -> None:
    """Send the ``report()`` points not sent yet (the worker calls it as a job ends)."""
    batch = _reports
    if batch is not None:
        batch.flush()


def _start_profile(steps: int) -> None:
    """Called by the worker when the driver asks (``events.StartProfile``): profile the next
    ``steps`` steps of this rank's innermost ``progress()`` loop."""
    split = _split
    if split is not None:
        split.profile_now(rankprofile.StepProfiler(steps, _emit, rank))


def _emit(event: events.Event) -> None:
    sink = _sink
    if sink is not None:
        sink.send(event)


def _code_started() -> None:
    """Tell the driver that the job's own code begins now (``events.CodeStarted``)."""
    _emit(events.CodeStarted(rank=_env_int("RANK", 0), time=time.time()))


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def rank() -> int:
    """This process's global rank (0 outside a run).

    Example:

    ```python
    from torchdist_magic import rank, world_size

    def train():
        if rank() == 0:
            print("rank 0 of", world_size())
    ```
    """
    return _env_int("RANK", 0)


def world_size() -> int:
    """Number of ranks in the run (1 outside a run).

    Example:

    ```python
    from torchdist_magic import world_size

    def train(global_batch):
        per_rank_batch = global_batch // world_size()
    ```
    """
    return _env_int("WORLD_SIZE", 1)


def local_rank() -> int:
    """Rank among the processes on this host (0 outside a run).

    Example:

    ```python
    from torchdist_magic import local_rank

    def train():
        import torch
        torch.cuda.set_device(local_rank())   # what device() does for you with --gpu
    ```
    """
    return _env_int("LOCAL_RANK", 0)


def local_world_size() -> int:
    """Number of ranks on this host (1 outside a run).

    Example:

    ```python
    import lightning.pytorch as pl
    from torchdist_magic import local_world_size, world_size

    trainer = pl.Trainer(devices=local_world_size(), num_nodes=world_size() // local_world_size(), strategy="ddp")
    ```
    """
    return _env_int("LOCAL_WORLD_SIZE", 1)


def host_ranks() -> List[int]:
    """The ranks on this rank's machine, in rank order (``[rank()]`` outside a run).  For work
    done once per machine (a download to local disk, a cache): ``if rank() == host_ranks()[0]``.
    Not ``local_rank() == 0``: on Spark every rank is a node of its own (``LOCAL_RANK`` 0), as
    under TorchDistributor, whichever machine it shares.

    Example:

    ```python
    from torchdist_magic import host_ranks, rank

    def train():
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if rank() == host_ranks()[0]:
            download_dataset("/local_disk0/data")   # once per machine
        dist.barrier()
    ```
    """
    text = os.environ.get(HOST_RANKS_ENV, "")
    try:
        return [int(r) for r in text.split(",")] if text else [rank()]
    except ValueError:
        return [rank()]


def is_main() -> bool:
    """True on rank 0: the rank whose value the notebook gets.

    Example:

    ```python
    from torchdist_magic import is_main

    def train():
        ...
        if is_main():
            torch.save(model.state_dict(), "/Volumes/main/default/models/model.pt")
    ```
    """
    return rank() == 0


def uses_gpu() -> bool:
    """Whether the run asked for GPUs (``--gpu`` / ``use_gpu=True``)."""
    return os.environ.get(USE_GPU_ENV) == "1"


def device():
    """``cuda:<local_rank>`` when the run asked for GPUs and CUDA is there, else ``cpu``.

    Example:

    ```python
    %%torchdist --np 2 --gpu
    # in a cell `device` is a value; functions and scripts call torchdist_magic.device()
    model = DDP(Net().to(device))   # the rank's GPU with --gpu, else the cpu
    ```
    """
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

    Example:

    ```python
    %%torchdist --np 2
    for step, batch in enumerate(loader):
        loss = train_step(batch)
        report(loss=loss, lr=scheduler.get_last_lr()[0])   # a tensor of one element is fine
    ```
    """
    # a float is taken as it is (the usual value: ``loss.item()``), without a call of its own
    values = {name: v if type(v) is float else _number(name, v) for name, v in metrics.items()}
    batch = _reports
    if batch is None:
        return
    points = batch.points
    if not points:
        batch.first_point()
    points.append((next(_report_step) if step is None else int(step), time.time(), values))


class progress:
    """Iterate like ``tqdm``: yields the items and reports step n/total to the run view.

    Without an iterable it is a bar that code moves itself, like tqdm's: shown at once,
    ``update(n)`` counts n more steps, ``close()`` ends it (done once it reached ``total``,
    else stopped).  Updates are rate-limited at the source (every ``PROGRESS_INTERVAL`` seconds
    and at the end), so wrapping a tight loop costs next to nothing.  In a run, the time it
    waits for each next item is the step's data wait (``stepsplit``: ``step_split``).

    Example:

    ```python
    %%torchdist --np 2
    for epoch in progress(range(3), desc="epoch"):
        for batch in progress(loader, desc="batch"):
            ...

    bar = progress(total=1000, desc="tokens")   # a bar the code moves itself
    bar.update(250)
    bar.close()
    ```
    """

    def __init__(self, iterable: Optional[Iterable] = None, total: Optional[int] = None, desc: Optional[str] = None):
        self.iterable = iterable
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.total = total
        self.desc = desc or ""
        self.bar = f"{self.desc}#{next(_bar_ids)}"
        self.n = 0
        self._start = self._last = time.time()
        if iterable is None:
            self._send("running")

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("progress over an iterable of unknown length")
        return self.total

    def _send(self, state: str) -> None:
        _emit(
            events.Progress(
                rank=rank(),
                bar=self.bar,
                desc=self.desc,
                n=self.n,
                total=self.total,
                elapsed=time.time() - self._start,
                state=state,
            )
        )

    def update(self, n: int = 1) -> None:
        """Count ``n`` more steps."""
        self.n += n
        if _sink is not None:
            now = time.time()
            if now - self._last >= PROGRESS_INTERVAL:
                self._last = now
                self._send("running")

    def close(self) -> None:
        """The bar's end: done when it reached ``total`` (or has none), else stopped."""
        self._send("done" if self.total is None or self.n >= self.total else "stopped")

    def __iter__(self) -> Iterator:
        self._start = self._last = time.time()  # each pass over the iterable times its own
        self._send("running")
        split = _split
        if split is None:
            try:
                for item in self.iterable:
                    yield item
                    self.update()
            finally:
                self.close()
            return
        # in a run, the wait for each next item is the step's data wait (``stepsplit``)
        items = iter(self.iterable)
        depth = split.enter()
        clock = stepsplit._clock
        try:
            while True:
                asked = clock()
                try:
                    item = next(items)
                except StopIteration:
                    break
                got = clock()
                split.step(depth, got - asked, got)
                yield item
                self.update()
        finally:
            split.leave()
            self.close()


def cell_names() -> dict:
    """What a ``%%torchdist`` cell finds defined: the ``CELL_PROVIDED`` names."""
    return dict(
        rank=rank(),
        local_rank=local_rank(),
        world_size=world_size(),
        progress=progress,
        report=report,
        is_main=is_main(),
        device=device(),
        restart_count=restart_count,
        save_checkpoint=save_checkpoint,
        load_checkpoint=load_checkpoint,
    )


# -- restarts and checkpoints -------------------------------------------------------------------

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)\.pt$")
_CHECKPOINT_TMP = re.compile(r"^\.checkpoint-\d+\.pt\.tmp-a(\d+)-\d+$")


def restart_count() -> int:
    """0 on a run's first attempt, n after its n-th restart (``max_restarts``).  Also right
    under torchrun (``TORCHELASTIC_RESTART_COUNT``); 0 outside a run.

    Example:

    ```python
    %%torchdist --np 4 --max-restarts 2
    if restart_count():
        print(f"attempt {restart_count() + 1}, from the last checkpoint")
    ```
    """
    return _env_int(RESTART_COUNT_ENV, _env_int("TORCHELASTIC_RESTART_COUNT", 0))


def checkpoint_dir() -> Optional[str]:
    """The run's checkpoint directory (``checkpoint_dir``, or the run's own); ``None`` outside
    a run.  Frameworks with checkpoints of their own can write there too."""
    return os.environ.get(CHECKPOINT_DIR_ENV) or None


def _checkpoints(directory: str) -> List[Tuple[int, str]]:
    """``[(step, path)]`` of the complete checkpoints in ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [
        (int(m.group(1)), os.path.join(directory, name)) for name, m in ((n, _CHECKPOINT.match(n)) for n in names) if m
    ]
    return sorted(found)


def save_checkpoint(
    obj: Any, step: Optional[int] = None, *, rank: int = 0, directory: Optional[str] = None
) -> Optional[str]:
    """Save ``obj`` (anything ``torch.save`` takes: state dicts, step counters) as the newest
    checkpoint, on rank ``rank`` only (rank 0 by default: other ranks return ``None`` at once).

    The write is atomic: a temporary file, flushed to disk, then renamed, so a rank killed
    mid-write never leaves a half-written checkpoint.  ``step`` numbers it (default: one more
    than the newest); the newest ``keep_checkpoints`` are kept, older ones removed.
    ``directory`` defaults to the run's checkpoint directory (``checkpoint_dir``, or with
    ``max_restarts`` a directory of the run's own); outside a run it must be given.
    Returns the file's path.

    Example:

    ```python
    %%torchdist --np 4 --max-restarts 2 --checkpoint-dir /Volumes/main/default/runs/demo
    start = (load_checkpoint() or {"epoch": -1})["epoch"] + 1
    for epoch in range(start, 10):
        ...
        save_checkpoint({"epoch": epoch, "model": model.state_dict()}, step=epoch)   # rank 0 writes
    ```
    """
    import torch

    global_rank = _env_int("RANK", 0)
    if global_rank != rank:
        return None
    directory = directory or checkpoint_dir()
    if not directory and os.environ.get(RUN_ID_ENV):
        raise ValueError(
            "save_checkpoint: this run has no checkpoint directory; give it one "
            "(--checkpoint-dir, checkpoint_dir=), or restarts (--max-restarts: the run "
            "then has one of its own), or pass directory=..."
        )
    if not directory:
        raise ValueError(
            "save_checkpoint needs a directory outside a run: pass "
            "directory=..., or run it under %%torchdist / Distributor"
        )
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"save_checkpoint: step must be a whole number of at least 0, got {step!r}")
    os.makedirs(directory, exist_ok=True)
    existing = _checkpoints(directory)
    if step is None:
        step = existing[-1][0] + 1 if existing else 0
    path = os.path.join(directory, f"checkpoint-{step:09d}.pt")
    attempt = restart_count()
    tmp = os.path.join(directory, f".checkpoint-{step:09d}.pt.tmp-a{attempt}-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    _sync_directory(directory)
    _emit(events.Checkpoint(rank=global_rank, step=step, time=time.time()))
    _prune(directory, _env_int(KEEP_CHECKPOINTS_ENV, 3), attempt)
    return path


def load_checkpoint(map_location: Any = "cpu", *, directory: Optional[str] = None) -> Any:
    """The newest checkpoint's object, or ``None`` when there is none yet (the first attempt;
    outside a run, unless ``directory`` is given).  Tensors load onto ``map_location``
    (``torch.load``'s; ``"cpu"`` by default: move them to ``device()`` yourself, or pass it).

    Example:

    ```python
    %%torchdist --np 4 --max-restarts 2
    state = load_checkpoint(map_location=device)   # None on the first attempt
    if state is not None:
        model.load_state_dict(state["model"])
    ```
    """
    import torch

    directory = directory or checkpoint_dir()
    if not directory:
        return None
    for _step, path in reversed(_checkpoints(directory)):
        try:
            with open(path, "rb") as fh:
                return torch.load(fh, map_location=map_location, weights_only=False)
        except FileNotFoundError:  # pruned by a newer save meanwhile: the next one is newer still
            continue
    return None


def _prune(directory: str, keep: int, attempt: int) -> None:
    """Keep the newest ``keep`` checkpoints; remove older ones and the temporary files of
    earlier attempts (a rank killed while writing leaves one)."""
    for _step, path in _checkpoints(directory)[: -max(keep, 1)]:
        _remove(path)
    for name in os.listdir(directory):
        m = _CHECKPOINT_TMP.match(name)
        if m and int(m.group(1)) < attempt:
            _remove(os.path.join(directory, name))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _sync_directory(directory: str) -> None:
    """Make the rename itself durable (not every file system can: then it is skipped)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
