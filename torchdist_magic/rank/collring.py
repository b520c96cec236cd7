"""A rank's own record of the collectives it calls: what the hang culprit needs, always on and cheap.

torch counts the collectives of each process group itself (its sequence number,
``ProcessGroup._get_sequence_number_for_group``: gloo's and NCCL's count every collective, those
that Python calls and those that run in C++, such as DDP's gradient all-reduce), at no cost to
the rank.  What torch's count lacks is which collective it was: each call of a synchronous
collective from Python (``stepsplit.patch_collectives``' wrapper) writes into ``RING``, a ring of
``RING_SIZE`` preallocated slots, its group's number, the sequence number it enters, its op (an
index into the wrapped names) and its input tensor's shape, and marks the slot when the call
returns.  No Python stack is taken and nothing is kept that the call made, so a call costs well
under a microsecond (``benchmarks/rank_overhead.py``); torch's Flight Recorder, which takes the
Python stack of every collective, costs about ten (``--trace-collectives`` turns it on).

The ring is read by the rank's channel thread when the driver asks (``collectives.record``); the
main thread may write meanwhile: a slot read as it is written costs that slot's op, no more.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

#: collectives kept in a rank's ring: the newest of each group is the one that matters, the others
#: say where a group was a moment before
RING_SIZE = 64


class CollectiveRing:
    """The last ``size`` collectives that Python called in this process, slot ``n % size`` for the
    n-th: ``groups`` (``id`` of the process group), ``seqs`` (the sequence number it entered),
    ``ops`` (an op code: the caller's index of its name), ``shapes`` (its input tensor's shape,
    or None), ``done`` (1 once the call returned).  Preallocated; a call writes five slots."""

    __slots__ = ("size", "groups", "seqs", "ops", "shapes", "done", "count")

    def __init__(self, size: int = RING_SIZE):
        self.size = size
        # lists, not arrays: a list's slot takes the int as it is, an array converts it
        self.groups: List[int] = [0] * size
        self.seqs: List[int] = [0] * size
        self.ops: List[int] = [0] * size
        self.shapes: List[Optional[Tuple[int, ...]]] = [None] * size
        self.done: List[int] = [0] * size
        self.count = 0  # collectives recorded so far

    def newest(self, group: int) -> Optional[Tuple[int, int, Optional[Tuple[int, ...]], bool]]:
        """The newest slot of ``group`` (its ``id``): ``(seq, op, shape, done)``; None for none."""
        count = self.count
        for n in range(count - 1, max(count - self.size, 0) - 1, -1):
            i = n % self.size
            if self.groups[i] == group:
                return self.seqs[i], self.ops[i], self.shapes[i], bool(self.done[i])
        return None

    def clear(self) -> None:
        """Forget every slot (a test's fresh start)."""
        self.count = 0
        for i in range(self.size):
            self.groups[i] = 0
            self.shapes[i] = None


#: this process's ring
RING = CollectiveRing()


def recorder(
    call: Any,
    code: int,
    group_at: Optional[int],
    input_at: Optional[int],
    input_name: str,
    world: Any,
    ring: CollectiveRing = RING,
):
    """``call``'s recording into ``ring``: a function of the call's ``(args, kwargs)`` that
    records it as op ``code`` and returns its slot number (-1 when it cannot be recorded: no
    process group, a group that keeps no count).  ``group_at``/``input_at``: the positions of the
    ``group`` and the input tensor arguments (None: it has none); ``world``: c10d's ``_world``
    (its ``default_pg``: the group of a call that names none)."""
    size = ring.size
    groups, seqs, ops, shapes, done = ring.groups, ring.seqs, ring.ops, ring.shapes, ring.done

    def record(args: tuple, kwargs: dict) -> int:
        if group_at is None:
            group = None
        else:
            group = args[group_at] if len(args) > group_at else kwargs.get("group")
        try:
            pg = world.default_pg if group is None else group
            seq = pg._get_sequence_number_for_group() + 1
        except Exception:  # noqa: BLE001  no group yet, or one without a count: not recorded
            return -1
        n = ring.count
        ring.count = n + 1
        i = n % size
        groups[i] = id(pg)
        seqs[i] = seq
        ops[i] = code
        if input_at is None:
            shapes[i] = None
        else:
            tensor = args[input_at] if len(args) > input_at else kwargs.get(input_name)
            shapes[i] = getattr(tensor, "shape", None)
        done[i] = 0
        return i

    return record
