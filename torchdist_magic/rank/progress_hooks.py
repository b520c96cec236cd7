"""A rank's hooks into the libraries a job imports: every ``tqdm`` bar and ``rich`` progress task
reports as the rank's progress (see ``runtime``'s docstring), torch's collectives write themselves
into the rank's ring (``collring``, what the hang culprit reads) and, like DDP, time their waits for
the step split (``stepsplit``), each patched once it is imported (an import hook,
``_ProgressImportHook``).  ``runtime`` installs them with the rank's sink (``install``)."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import math
import sys
from typing import Any, Callable, Dict, List, Optional

from ..core import events
from . import stepsplit

# what the patched classes report through: set by ``install``, before it patches any
_emit: Callable[[events.Event], None]
_rank: Callable[[], int]
_split: Callable[[], Optional[stepsplit.StepSplit]]
_bar_id: Callable[[], int]


def install(
    emit: Callable[[events.Event], None],
    rank: Callable[[], int],
    split: Callable[[], Optional[stepsplit.StepSplit]],
    bar_id: Callable[[], int],
) -> None:
    """Make every tqdm bar and rich progress task of this process report as this rank's
    progress (each an ``events.Progress`` to ``emit``, of ``rank()``, its id numbered by
    ``bar_id()``), and torch's collectives and DDP time their waits for the step split
    (``split()``, ``None`` while there is none): now for what is imported already, else when it
    is imported (importing them here would cost every rank their import time)."""
    global _emit, _rank, _split, _bar_id
    _emit, _rank, _split, _bar_id = emit, rank, split, bar_id
    waiting = []
    for name, patch in _PROGRESS_MODULES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            waiting.append(name)
    if waiting and not any(isinstance(finder, _ProgressImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ProgressImportHook(waiting))


class _ProgressImportHook(importlib.abc.MetaPathFinder):
    """Patches a progress module (``_PROGRESS_MODULES``) as soon as it is imported: every tqdm
    class, also ``tqdm.auto``'s outside a notebook, derives from ``tqdm.std.tqdm``."""

    def __init__(self, names: List[str]):
        self.names = set(names)

    def find_spec(self, name, path, target=None):
        if name not in self.names:
            return None
        self.names.discard(name)
        sys.meta_path.remove(self)  # find_spec below must not find this hook again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if self.names:
                sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchAfterLoading(spec.loader, _PROGRESS_MODULES[name])
        return spec


class _PatchAfterLoading(importlib.abc.Loader):
    def __init__(self, loader, patch: Callable[[Any], None]):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):  # get_source, get_filename, ...: the real loader's
        return getattr(self._loader, name)


class _Discard:
    """Where a bar that tqdm would have turned off (``disable=None``, no terminal) writes: nowhere."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class _TqdmReport:
    """What one tqdm bar sends: its id, and whether it is to stay silent on the terminal."""

    def __init__(self, silent: bool):
        self.bar = f"tqdm#{_bar_id()}"
        self.silent = silent
        self.closing = False
        self.sent = False

    def send(self, bar, state: str) -> None:
        n = bar.n
        total = bar.total if bar.total is not None and math.isfinite(bar.total) else None
        if not self.sent and not n and total is None:
            return  # a placeholder bar (Lightning makes some) that never counted anything
        self.sent = True
        elapsed = bar._time() - bar.start_t if hasattr(bar, "start_t") else 0.0
        _emit(
            events.Progress(
                rank=_rank(),
                bar=self.bar,
                desc=str(bar.desc or "").rstrip(": "),
                n=int(n),
                total=None if total is None else int(total),
                elapsed=max(float(elapsed), 0.0),
                state=state,
                postfix=str(bar.postfix or ""),
            )
        )


def _patch_tqdm(cls) -> None:
    """Route ``cls``'s bars (and its subclasses') to the run view; see ``runtime``'s docstring."""
    if cls.__dict__.get("_torchdist_reports"):
        return
    init, display, close = cls.__init__, cls.display, cls.close

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if kwargs.get("disable") is True:  # turned off on purpose (Lightning's off rank 0): no bar at all
            init(self, *args, **kwargs)
            return
        # disable=None turns a bar off where the output is not a terminal, as a rank's is not:
        # the run view shows it, and its final line stays off the output too
        silent = "disable" in kwargs and kwargs["disable"] is None
        kwargs["disable"] = False
        if silent:
            kwargs["file"] = _Discard()
        self._torchdist = _TqdmReport(silent)
        init(self, *args, **kwargs)

    @functools.wraps(display)
    def display_(self, msg=None, pos=None):
        report = self.__dict__.get("_torchdist")
        if report is None:
            return display(self, msg, pos)
        if not report.closing:
            report.send(self, "running")
            return True
        if msg is None and not report.silent:  # the final line of a bar that stays (leave=True)
            return display(self, msg, pos)
        return False  # nothing was drawn, so there is nothing to clear

    @functools.wraps(close)
    def close_(self):
        report = self.__dict__.get("_torchdist")
        if report is None or self.disable:  # not ours, or closed already
            return close(self)
        report.closing = True
        close(self)
        leave = abs(getattr(self, "pos", 0)) == 0 if self.leave is None else self.leave
        total = self.total
        if not leave:
            state = "cleared"
        elif total is None or self.n >= total:
            state = "done"
        else:
            state = "stopped"
        report.send(self, state)

    original_clear = cls.clear

    @functools.wraps(original_clear)
    def clear(self, nolock=False):
        if self.__dict__.get("_torchdist") is None:
            return original_clear(self, nolock)
        return None  # nothing was drawn, so there is nothing to clear

    cls.__init__, cls.display, cls.close, cls.clear = __init__, display_, close_, clear
    cls._torchdist_reports = True


def _send_rich_task(progress, task_id, state: str) -> None:
    """One task of a rich ``Progress`` as this rank's ``events.Progress`` (a hidden task: gone)."""
    task = progress._tasks.get(task_id)
    if task is None:
        return
    ids = progress.__dict__.setdefault("_torchdist_bars", {})
    if task_id not in ids:
        ids[task_id] = f"rich#{_bar_id()}"
    total = task.total if task.total is not None and math.isfinite(task.total) else None
    if not task.visible:
        state = "cleared"
    elif state != "running":
        state = "done" if total is None or task.completed >= total else "stopped"
    from rich.text import Text

    desc = task.description if isinstance(task.description, str) else str(task.description)
    _emit(
        events.Progress(
            rank=_rank(),
            bar=ids[task_id],
            desc=Text.from_markup(desc).plain.strip(),
            n=int(task.completed),
            total=None if total is None else int(total),
            elapsed=float(task.elapsed or 0.0),
            state=state,
        )
    )


def _patch_rich(cls) -> None:
    """Route the tasks of rich's ``Progress`` (``cls``) to the run view: each task is a bar."""
    if cls.__dict__.get("_torchdist_reports"):
        return

    def reporting(method, task_of):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            result = method(self, *args, **kwargs)
            _send_rich_task(self, task_of(result, args, kwargs), "running")
            return result

        return wrapper

    def task_argument(_result, args, kwargs):
        return args[0] if args else kwargs.get("task_id")

    for name in ("update", "advance", "reset", "start_task"):
        setattr(cls, name, reporting(getattr(cls, name), task_argument))
    cls.add_task = reporting(cls.add_task, lambda result, _args, _kwargs: result)
    remove_task, stop = cls.remove_task, cls.stop

    @functools.wraps(remove_task)
    def remove_task_(self, task_id):
        progress_task = self._tasks.get(task_id)
        if progress_task is not None:
            progress_task.visible = False
            _send_rich_task(self, task_id, "cleared")
        return remove_task(self, task_id)

    @functools.wraps(stop)
    def stop_(self):
        result = stop(self)
        for task_id in list(self._tasks):
            _send_rich_task(self, task_id, "ended")
        return result

    cls.remove_task, cls.stop = remove_task_, stop_
    cls._torchdist_reports = True


#: the modules whose progress bars report as the rank's progress, or whose waits the step split
#: times, and how each is patched
_PROGRESS_MODULES: Dict[str, Callable[[Any], None]] = {
    "tqdm.std": lambda module: _patch_tqdm(module.tqdm),
    "rich.progress": lambda module: _patch_rich(module.Progress),
    # the step split's waits in collectives (``stepsplit``)
    # (``install``'s getter itself, set before any patch: one call less per collective)
    "torch.distributed.distributed_c10d": lambda module: stepsplit.patch_collectives(module, _split),
    "torch.nn.parallel.distributed": stepsplit.patch_ddp,
}
