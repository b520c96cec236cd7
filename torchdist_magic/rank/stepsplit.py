"""Where a rank's steps go: waiting for data, computing, or waiting in collectives.

A synchronous job moves at the pace of its slowest rank, so every rank's step time is the same
and says nothing of who holds the others up.  The split does: measured in the rank's own
process while a ``progress()`` loop iterates (its steps), each step's time is

- **data**: the time ``progress()`` waited for the next item of its iterable (a data loader's
  batch);
- **comm**: the time the rank waited in collectives.  A synchronous collective that Python calls
  (``torch.distributed.all_reduce``, ``barrier``, ...) is timed around its call, the outermost
  one only (``all_gather_object`` calls ``all_gather``).  DDP's gradient all-reduce runs in C++
  inside ``backward()``, where Python cannot time it: its wait is DDP's own timers' (the time
  from the end of the backward computation to the end of the all-reduce, the part that no
  computation overlapped), which DDP keeps for every iteration once its sample rate is 1
  (``patch_ddp``); they are read at most every ``POLL_EVERY`` seconds (a read costs about
  0.1 ms), each read's iteration a sample of the wait's share of a step;
- **compute**: the rest.

Every ``SEND_EVERY`` seconds of steps the rank sends ``events.StepSplit``: the fractions over its
last ``WINDOW`` intervals and its totals since the job started.  Time outside any ``progress()``
loop (set-up, evaluation, checkpoints) is not a step and counts nowhere; nor do tqdm bars, whose
iterable this process does not drive.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
import weakref
from collections import deque
from typing import Any, Callable, Deque, List, Optional

from ..core import events
from . import collring

#: seconds of steps between two ``StepSplit`` records of a rank
SEND_EVERY = 1.0
#: intervals of ``SEND_EVERY`` that a record's fractions cover (the recent steps)
WINDOW = 3
#: seconds between two reads of DDP's timers
POLL_EVERY = 0.1
#: the collectives of ``torch.distributed`` whose synchronous calls are timed
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "monitored_barrier",
)

_clock = time.perf_counter


class _Interval:
    """What one interval of steps held: seconds of steps, of data waits, of Python collectives,
    the DDP samples (each a wait's share of its step) and the innermost loop's steps."""

    __slots__ = ("seconds", "data", "comm", "ddp", "steps")

    def __init__(self):
        self.seconds = self.data = self.comm = 0.0
        self.ddp: List[float] = []
        self.steps = 0

    def comm_seconds(self) -> float:
        ddp = sum(self.ddp) / len(self.ddp) * self.seconds if self.ddp else 0.0
        return min(self.comm + ddp, max(self.seconds - self.data, 0.0))


class StepSplit:
    """One rank's split (see the module's docstring); ``send`` gets each ``events.StepSplit``.
    Called from the job's threads: a lost update under a race costs a step's share, no more."""

    def __init__(
        self,
        send: Callable[[events.Event], None],
        rank: Callable[[], int],
        profiler: Optional[Callable[[], Any]] = None,
    ):
        """``profiler`` makes each job's profiler (``rankprofile.StepProfiler``, or None): its
        ``step`` is called as each step of the innermost loop begins, its ``finish`` when the
        outermost loop ends."""
        self._send = send
        self._rank = rank
        self._make_profiler = profiler
        self.reset()

    def reset(self) -> None:
        """A new job: nothing measured yet."""
        self.profiler = self._make_profiler() if self._make_profiler is not None else None
        self._depth = 0  # progress() loops iterating now
        self._innermost = 0  # the deepest loop seen since the outermost one began
        self._since: Optional[float] = None  # when the current run of loops began (or was last counted)
        self._step_began: Optional[float] = None  # when the innermost loop's current step began
        self._collective = 0  # collectives being called now (the outermost one is timed)
        self._interval = _Interval()
        self._window: Deque[_Interval] = deque(maxlen=WINDOW)
        self._sent = self._polled = _clock()
        self._totals = [0.0, 0.0, 0.0]  # seconds of steps, data, comm
        self._seen: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()

    def profile_now(self, profiler: Any) -> bool:
        """Profile from the next step with ``profiler`` (a ``rankprofile.StepProfiler``), unless
        a profile is under way; whether it will."""
        if self.profiler is not None and not self.profiler.done:
            return False
        self.profiler = profiler
        return True

    # -- progress() loops -----------------------------------------------------------------------
    def enter(self) -> int:
        """A ``progress()`` loop begins iterating; its depth (1: outermost), for ``step``."""
        self._depth += 1
        if self._depth == 1:
            self._since = _clock()
            self._innermost = 1
            self._step_began = None
        self._innermost = max(self._innermost, self._depth)
        return self._depth

    def leave(self) -> None:
        """The loop that began last ends: its time is counted; when it was the outermost, what is
        not sent yet is sent (a loop's bar sends two records anyway: this adds one)."""
        if self._depth <= 0:
            return
        self._count(_clock())
        self._depth -= 1
        if self._depth == 0:
            self._since = None
            self._flush()
            if self.profiler is not None:
                self.profiler.finish()

    def step(self, depth: int, waited: float, now: Optional[float] = None) -> None:
        """The loop at ``depth`` got its next item after waiting ``waited`` seconds for it (at
        ``now``, a reading of ``_clock`` the caller took: one call less a step; read here when
        None): a step of the innermost loop began when it asked for it."""
        if depth == self._innermost:
            if now is None:
                now = _clock()
            began = now - waited
            last, self._step_began = self._step_began, began
            if now - self._sent >= SEND_EVERY:
                self._count(began)
                self._flush()
            self._interval.steps += 1
            if self.profiler is not None:
                self.profiler.step()
            if last is not None and began > last and now - self._polled >= POLL_EVERY:
                self._polled = now
                self._poll_ddp(self._interval, began - last)
        self._interval.data += waited

    def _count(self, now: float) -> None:
        if self._since is not None:
            self._interval.seconds += now - self._since
            self._since = now

    # -- collectives ---------------------------------------------------------------------------
    def collective(self, call: Callable, *args, **kwargs):
        """``call(*args, **kwargs)``, a collective: its time counts as waiting when it is
        synchronous, the outermost one, and inside a loop.  (The patched collectives do the same
        in their own call: ``_timed``.)"""
        if self._collective or not self._depth or kwargs.get("async_op"):
            self._collective += 1
            try:
                return call(*args, **kwargs)
            finally:
                self._collective -= 1
        self._collective = 1
        start = _clock()
        try:
            return call(*args, **kwargs)
        finally:
            self._interval.comm += _clock() - start
            self._collective = 0

    def _poll_ddp(self, interval: _Interval, step: float) -> None:
        """A sample of each DDP module's newest iteration not sampled yet: its wait's share of
        the step that just ended (``step`` seconds long)."""
        for module in list(_DDP_MODULES):
            try:
                data = module._get_ddp_logging_data()
            except Exception:  # noqa: BLE001  a module without timers (destroyed, an older torch): no sample
                continue
            iteration = data.get("forward_compute_time_start")
            compute_end, comm_end = data.get("backward_compute_time_end"), data.get("backward_comm_time_end")
            if not iteration or not compute_end or not comm_end or self._seen.get(module) == iteration:
                continue
            self._seen[module] = iteration
            interval.ddp.append(min(max(comm_end - compute_end, 0) / 1e9 / step, 1.0))

    # -- records -------------------------------------------------------------------------------
    def _flush(self) -> None:
        """Send the split of the last ``WINDOW`` intervals; start the next interval."""
        interval, self._interval = self._interval, _Interval()
        self._sent = _clock()
        if interval.seconds <= 0:
            return
        comm = interval.comm_seconds()
        self._totals[0] += interval.seconds
        self._totals[1] += min(interval.data, interval.seconds)
        self._totals[2] += comm
        self._window.append(interval)
        seconds = sum(i.seconds for i in self._window)
        data = min(sum(i.data for i in self._window) / seconds, 1.0)
        comm_share = min(sum(i.comm_seconds() for i in self._window) / seconds, 1.0 - data)
        self._send(
            events.StepSplit(
                rank=self._rank(),
                data=data,
                compute=max(1.0 - data - comm_share, 0.0),
                comm=comm_share,
                seconds=seconds,
                steps=sum(i.steps for i in self._window),
                step_s=self._totals[0],
                data_s=self._totals[1],
                comm_s=self._totals[2],
                time=time.time(),
            )
        )


# -- what gets patched -----------------------------------------------------------------------------

#: the DDP modules of this process whose timers are read
_DDP_MODULES: "weakref.WeakSet[Any]" = weakref.WeakSet()


def patch_ddp(module) -> None:
    """Make every ``DistributedDataParallel`` of ``module`` (``torch.nn.parallel.distributed``)
    keep its timers for every iteration and be read for the split."""
    cls = module.DistributedDataParallel
    if cls.__dict__.get("_torchdist_split"):
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        setter = getattr(self, "_set_ddp_runtime_logging_sample_rate", None)
        if setter is not None:
            setter(1)
            _DDP_MODULES.add(self)

    cls.__init__ = __init__
    cls._torchdist_split = True


#: the input tensor argument of the collectives that take one (its shape goes into the ring)
_INPUTS = {
    "all_reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_to_all_single": "input",
    "broadcast": "tensor",
    "gather": "tensor",
    "reduce": "tensor",
    "reduce_scatter_tensor": "input",
    "scatter": "tensor",
}


def _position(function: Callable, name: str) -> Optional[int]:
    """The position of ``function``'s argument ``name`` (None: it has none, or it cannot be told)."""
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
    return names.index(name) if name in names else None


def patch_collectives(module, split: Callable[[], Optional[StepSplit]]) -> None:
    """Record the synchronous ``COLLECTIVES`` of ``module`` (``torch.distributed.distributed_c10d``)
    in the rank's ring (``collring``: what the hang culprit reads) and time them for ``split()``'s
    rank; where ``torch.distributed`` took its names from it already, there too."""
    package = sys.modules.get("torch.distributed")
    world = getattr(module, "_world", None)
    read = collring.count_reader(module)
    for code, name in enumerate(COLLECTIVES):
        original = getattr(module, name, None)
        if original is None or getattr(original, "_torchdist_split", False):
            continue
        input_name = _INPUTS.get(name, "")
        timed = _timed(
            original,
            code,
            _position(original, "group"),
            _position(original, input_name) if input_name else None,
            input_name,
            world,
            split,
            read,
        )
        functools.update_wrapper(timed, original)
        timed._torchdist_split = True
        setattr(module, name, timed)
        if package is not None and getattr(package, name, None) is original:
            setattr(package, name, timed)


def _timed(
    original: Callable,
    code: int,
    group_at: Optional[int],
    input_at: Optional[int],
    input_name: str,
    world: Any,
    split: Callable[[], Optional[StepSplit]],
    read: Callable[[Any], Optional[int]],
    ring: collring.CollectiveRing = collring.RING,
) -> Callable:
    """``original`` (collective ``COLLECTIVES[code]``) writing itself into ``ring`` and timed
    for ``split()``: ``group_at``/``input_at`` are the positions of its ``group`` and input tensor
    arguments (None: it has none); ``world`` is c10d's ``_world`` (None: no ring), whose default
    group is the group of a call that names none; ``read`` reads a group's count
    (``collring.count_reader``).

    Every Python-called collective of a rank comes here, FSDP's hundreds a step among them: what
    a recorder and ``StepSplit.collective`` would do in calls of their own is written out in this
    one (a Python call costs more than most of what they do; ``benchmarks/rank_overhead.py``
    counts the instructions of each part)."""
    size = ring.size
    groups, counts, ops, shapes, done = ring.groups, ring.counts, ring.ops, ring.shapes, ring.done
    count_of = collring.count_of
    # ``_World.default_pg`` is a property over ``_default_pg``: the attribute costs a fifth of it
    direct = world is not None and "_default_pg" in getattr(world, "__dict__", ())

    def timed(*args, **kwargs):
        slot = -1
        if world is not None:
            if group_at is not None and len(args) > group_at:
                group = args[group_at]
            else:
                group = kwargs.get("group") if kwargs else None
            if group is None:
                group = world._default_pg if direct else world.default_pg
            try:
                before = read(group)
            except Exception:  # noqa: BLE001  not torch's class of group, or no group yet
                before = count_of(group)
            if before is not None:  # else a group that keeps no count: not recorded
                slot = ring.next
                ring.next = slot + 1 if slot + 1 < size else 0
                groups[slot] = id(group)
                counts[slot] = before
                ops[slot] = code
                shape = None
                if input_at is not None:
                    try:
                        shape = (args[input_at] if len(args) > input_at else kwargs[input_name]).shape
                    except (KeyError, AttributeError):  # no input, or not a tensor: torch will say so
                        pass
                shapes[slot] = shape
                done[slot] = 0
        try:
            current = split()
            # timed as ``StepSplit.collective`` times a call: the outermost synchronous one in a loop
            if current is None:
                return original(*args, **kwargs)
            if current._collective or not current._depth or kwargs.get("async_op"):
                current._collective += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    current._collective -= 1
            current._collective = 1
            start = _clock()
            try:
                return original(*args, **kwargs)
            finally:
                current._interval.comm += _clock() - start
                current._collective = 0
        finally:
            if slot >= 0:
                done[slot] = 1

    return timed
