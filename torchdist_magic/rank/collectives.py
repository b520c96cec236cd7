"""A rank's collective record: where it is in each process group (``events.Collectives``).

By default the record comes from what the rank keeps at no measurable cost: torch's own count of
each process group's collectives (its sequence number) and the rank's ring of the collectives
Python called (``collring``: their op, input shape and whether they returned).  A collective that
ran in C++ (DDP's gradient all-reduce) is counted but not named.  With ``--trace-collectives``
(``TORCHDIST_TRACE_COLLECTIVES=1``) the run turns torch's Flight Recorder on for every rank
(``enable_flight_recorder``: a bounded ring of ``FLIGHT_RECORDER_ENTRIES`` entries, unless the
user set ``TORCH_FR_BUFFER_SIZE``), which names those too, at about ten microseconds of the
rank's CPU per collective (it takes the Python stack of each: ``benchmarks/rank_overhead.py``);
its record is then the recorder's.  Both are sequence-numbered records (``source``
``"flight recorder"``; ``note`` says whose).

The record is read when the driver asks (``DumpCollectives``) and when a rank's job fails with a
process group up, from a thread of its own while the main thread waits in a collective (the wait
releases the GIL).  Where neither keeps a record (no group counts its collectives), the rank's
main-thread stack says which collective it is in, without sequence numbers.  The driver compares
the records (``culprit``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from types import FrameType
from typing import Any, Dict, List, Optional

from ..core import events
from ..core.names import TRACE_COLLECTIVES_ENV
from .collring import RING, CollectiveRing
from .stepsplit import COLLECTIVES

#: what turns torch's Flight Recorder on, and how many collectives it keeps per rank
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
FLIGHT_RECORDER_ENTRIES = 256
#: the name of the default process group in a record (the Flight Recorder's is ``default_pg``)
DEFAULT_GROUP = "default group"
#: the functions of ``torch.distributed`` that a stack names as the collective a rank is in
COLLECTIVE_FUNCTIONS = frozenset(
    COLLECTIVES
    + (
        "send",
        "recv",
        "batch_isend_irecv",
        "_all_gather_base",
        "_reduce_scatter_base",
        "new_group",
        "init_process_group",
    )
)
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


#: what the note of a record from the rank's own ring says
RING_NOTE = "torchdist_magic's record; collectives that ran in C++ are unnamed (--trace-collectives names them)"


def enable_flight_recorder(environ: Optional[Dict[str, str]] = None) -> None:
    """Turn torch's Flight Recorder on for this process (before its first process group) when the
    run asks (``--trace-collectives``), unless the user chose its size (``TORCH_FR_BUFFER_SIZE``;
    0 turns it off)."""
    environ = os.environ if environ is None else environ
    if environ.get(TRACE_COLLECTIVES_ENV) == "1":
        environ.setdefault(FLIGHT_RECORDER_ENV, str(FLIGHT_RECORDER_ENTRIES))


def groups_from_trace(trace: Dict[str, Any]) -> List[events.GroupCollectives]:
    """Each process group's state in a Flight Recorder dump (``_dump_fr_trace_json``): the last
    collective entered and the last finished (``retired``), by sequence number; point-to-point
    operations are left out (they have sequence numbers of their own)."""
    groups: Dict[str, events.GroupCollectives] = {}
    for entry in trace.get("entries") or []:
        if entry.get("is_p2p"):
            continue
        seq = int(entry.get("collective_seq_id") or 0)
        names = entry.get("process_group") or ["", ""]
        desc = names[1] if len(names) > 1 else ""
        name = DEFAULT_GROUP if desc == "default_pg" or not (desc or names[0]) else (desc or names[0])
        group = groups.setdefault(name, events.GroupCollectives(group=name))
        if seq >= group.entered:
            group.entered = seq
            group.op = str(entry.get("profiling_name") or "").rpartition(":")[2]
            group.sizes = [list(map(int, s)) for s in entry.get("input_sizes") or []]
        if entry.get("retired") and seq > group.finished:
            group.finished = seq
    return sorted(groups.values(), key=lambda g: (g.group != DEFAULT_GROUP, g.group))


def groups_from_ring(c10d: Any, ring: CollectiveRing) -> List[events.GroupCollectives]:
    """Each live process group's state from torch's count of its collectives and ``ring``: the
    last collective entered (torch's sequence number), named with its op and input shape when
    Python called it (the ring's newest slot of the group has that number), and finished unless
    that call has not returned.  Groups that keep no count are left out."""
    found = []
    default = c10d._world.default_pg
    for pg, pg_name in list(c10d._world.pg_names.items()):
        try:
            entered = int(pg._get_sequence_number_for_group())
        except Exception:  # noqa: BLE001  a group that keeps no count (a fake, an old backend)
            continue
        if pg is default:
            name = DEFAULT_GROUP
        else:
            desc = getattr(pg, "group_desc", "") or ""
            name = desc if desc and desc != "undefined" else pg_name
        group = events.GroupCollectives(group=name, entered=entered, finished=entered)
        slot = ring.newest(id(pg))
        if slot is not None and slot[0] == entered:
            seq, op, shape, done = slot
            group.op = COLLECTIVES[op] if 0 <= op < len(COLLECTIVES) else ""
            group.sizes = [list(map(int, shape))] if shape is not None else []
            if not done:
                group.finished = entered - 1
        found.append(group)
    return sorted(found, key=lambda g: (g.group != DEFAULT_GROUP, g.group))


def collective_in_stack(frame: Optional[FrameType]) -> str:
    """The outermost ``torch.distributed`` collective that ``frame``'s stack is in ("" for none)."""
    found = ""
    while frame is not None:
        code = frame.f_code
        if code.co_name in COLLECTIVE_FUNCTIONS and code.co_filename.endswith(_C10D_FILE):
            found = code.co_name
        frame = frame.f_back
    return found


def record(rank: int) -> events.Collectives:
    """This rank's collective record now: from torch's Flight Recorder when it keeps one
    (``--trace-collectives``), else from its groups' counts and the rank's ring, else from the
    main thread's stack."""
    now = time.time()
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return events.Collectives(rank=rank, time=now, note="no process group")
    trace = _flight_recorder_trace()
    if trace is not None and trace.get("entries"):
        return events.Collectives(rank=rank, source="flight recorder", groups=groups_from_trace(trace), time=now)
    main = sys._current_frames().get(threading.main_thread().ident)
    try:
        groups = groups_from_ring(dist.distributed_c10d, RING)
    except Exception:  # noqa: BLE001  a torch whose c10d keeps its groups elsewhere: the stack still says
        groups = []
    if groups:
        return events.Collectives(rank=rank, source="flight recorder", groups=groups, time=now, note=RING_NOTE)
    return events.Collectives(
        rank=rank,
        source="stack",
        in_collective=collective_in_stack(main),
        time=now,
        note="" if trace is not None else "torch keeps no Flight Recorder here",
    )


def _flight_recorder_trace() -> Optional[Dict[str, Any]]:
    if os.environ.get(FLIGHT_RECORDER_ENV, "0") in ("", "0"):
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
    except ImportError:  # a torch without the Flight Recorder
        return None
    try:
        return json.loads(_dump_fr_trace_json(True, False))
    except Exception:  # a dump that failed says nothing of the rank: its stack still does  # noqa: BLE001
        return None


def send_record(send, rank: int) -> None:
    """Send ``record(rank)`` with ``send`` (the worker's channel client's) from a thread of its
    own: the caller (the channel's reading thread) must not wait for torch."""
    threading.Thread(target=lambda: send(record(rank)), name="torchdist-collectives", daemon=True).start()
