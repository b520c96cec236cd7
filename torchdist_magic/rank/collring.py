"""A rank's own record of the collectives it calls: what the hang culprit needs, always on and cheap.

torch counts the collectives of each process group itself (its sequence number,
``ProcessGroup._get_sequence_number_for_group``: gloo's and NCCL's count every collective, those
that Python calls and those that run in C++, such as DDP's gradient all-reduce), at no cost to
the rank.  What torch's count lacks is which collective it was: each call of a synchronous
collective from Python (``stepsplit.patch_collectives``' wrapper) writes into ``RING``, a ring of
``RING_SIZE`` preallocated slots, its group's number, torch's count as it enters, its op (an
index into the wrapped names) and its input tensor's shape, and marks the slot when the call
returns.  No Python stack is taken, nothing is looked up per call that can be looked up once
(torch's reader of the count: ``count_reader``), and nothing the call makes is kept but the
input's ``torch.Size`` (a reference to the tensor itself would keep the last ``RING_SIZE``
inputs alive, gradient buckets included; a weak one costs as much as the ``Size`` and loses the
shape of a temporary input, which the mismatch verdict compares).  The wrapper with the ring
costs about 7,300 instructions a call more than torch's own, a quarter of them torch's reading of
its count (``benchmarks/rank_overhead.py``); torch's Flight Recorder, which takes the Python stack
of every collective, is off unless ``--trace-collectives`` turns it on.

The ring is read by the rank's channel thread when the driver asks (``collectives.record``); the
main thread may write meanwhile: a slot read as it is written costs that slot's op, no more.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

#: collectives kept in a rank's ring: the newest of each group is the one that matters, the others
#: say where a group was a moment before
RING_SIZE = 64


class CollectiveRing:
    """The last ``size`` collectives that Python called in this process, each in the slot
    ``next`` named as it began (``next`` then moves on by one, back to 0 after the last slot):
    ``groups`` (``id`` of the process group; 0 for a slot never written), ``counts`` (torch's
    count of the group's collectives as the call entered: its sequence number is one more),
    ``ops`` (an op code: the caller's index of its name), ``shapes`` (its input tensor's shape,
    or None), ``done`` (1 once the call returned).  Preallocated; a call writes six slots.
    ``next`` stays below ``size``: a growing count would make a new int at each call."""

    __slots__ = ("size", "groups", "counts", "ops", "shapes", "done", "next")

    def __init__(self, size: int = RING_SIZE):
        self.size = size
        # lists, not arrays: a list's slot takes the int as it is, an array converts it
        self.groups: List[int] = [0] * size
        self.counts: List[int] = [0] * size
        self.ops: List[int] = [0] * size
        self.shapes: List[Optional[Tuple[int, ...]]] = [None] * size
        self.done: List[int] = [0] * size
        self.next = 0

    def newest(self, group: int) -> Optional[Tuple[int, int, Optional[Tuple[int, ...]], bool]]:
        """The newest slot of ``group`` (its ``id``): ``(seq, op, shape, done)``; None for none."""
        start = self.next
        for back in range(1, self.size + 1):
            i = (start - back) % self.size
            if self.groups[i] == group:
                return self.counts[i] + 1, self.ops[i], self.shapes[i], bool(self.done[i])
        return None

    def clear(self) -> None:
        """Forget every slot (a test's fresh start)."""
        self.next = 0
        for i in range(self.size):
            self.groups[i] = 0
            self.shapes[i] = None


#: this process's ring
RING = CollectiveRing()


def count_of(group: Any) -> Optional[int]:
    """torch's count of ``group``'s collectives, read through the group's own method; None where
    it keeps none (no group, a group of a backend without a count)."""
    try:
        return group._get_sequence_number_for_group()
    except Exception:  # noqa: BLE001  what keeps no count is not recorded, whatever it raises
        return None


def count_reader(c10d: Any) -> Callable[[Any], Optional[int]]:
    """torch's reader of a process group's count, called as ``read(group)``: the method of c10d's
    ``ProcessGroup`` class, the class of every group of torch's backends, looked up once (looked
    up on each group it would cost a third more a call).  It raises for a group of another class:
    ``count_of`` reads that one.  ``count_of`` itself where c10d has no such class."""
    return getattr(getattr(c10d, "ProcessGroup", None), "_get_sequence_number_for_group", None) or count_of
