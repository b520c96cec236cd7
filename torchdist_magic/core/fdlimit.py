"""Room for a run's open files in the driver's process (``RLIMIT_NOFILE``).

The driver holds a few descriptors per rank for as long as the run lasts: the rank's channel
connections (its worker's; on Spark its task's too), a file its log spills into, and with local
processes the two pipes of its output.  A desktop Jupyter starts with a soft limit of 1,024 open
files, below what a run of a few hundred ranks needs, and a kernel out of descriptors fails every
``open()``, not only the run's.  So before anything starts, ``make_room`` raises the soft limit
toward the hard one as far as the run needs (as Ray and most servers do), and says, before
anything starts, when even the hard limit cannot hold the run.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

_log = logging.getLogger("torchdist_magic")

#: descriptors the driver holds per rank of a run on this machine's processes: the worker's
#: channel connection, its stdout and stderr pipes, its log's spill file
PER_LOCAL_RANK = 4
#: per rank of a run on a cluster: the worker's and the task's connections, the spill file
PER_REMOTE_RANK = 3
#: what the rest of the kernel keeps for itself beyond the descriptors open now (a notebook
#: opens files, sockets to its frontend, Spark's connections)
HEADROOM = 256


def limits() -> Optional[Tuple[int, int]]:
    """The soft and hard limits on open files (``resource.RLIM_INFINITY`` for none), or ``None``
    where the platform has no such limit."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def open_now() -> int:
    """Descriptors this process has open (0 where the system does not say)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


def descriptors_needed(num_processes: int, local: bool, opened: Optional[int] = None) -> int:
    """Open files the driver needs for a run of ``num_processes`` ranks, with what it has open
    now (``opened``, else counted) and ``HEADROOM`` for the rest of the kernel."""
    per_rank = PER_LOCAL_RANK if local else PER_REMOTE_RANK
    return (open_now() if opened is None else opened) + per_rank * num_processes + HEADROOM


def make_room(num_processes: int, local: bool) -> int:
    """Raise this process's soft limit on open files to what a run of ``num_processes`` ranks
    needs (never lower it, never above the hard limit); the soft limit now (-1 where the platform
    has none).  ``ValueError``, naming what to set, when the hard limit is below the need."""
    current = limits()
    if current is None:
        return -1
    import resource

    soft, hard = current
    opened = open_now()
    need = descriptors_needed(num_processes, local, opened)
    unlimited = resource.RLIM_INFINITY
    if soft == unlimited or soft >= need:
        return soft
    if hard != unlimited and hard < need:
        raise ValueError(
            f"a run of {num_processes} ranks needs about {need} open files in this process "
            f"({PER_LOCAL_RANK if local else PER_REMOTE_RANK} per rank, {opened} open now and "
            f"{HEADROOM} to spare), and its hard limit is {hard}: raise "
            f"it before starting Jupyter (`ulimit -n {_round_up(need)}` in its shell, LimitNOFILE= "
            "in a systemd unit, nofile in /etc/security/limits.conf), or run fewer ranks"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    _log.info(
        "raised the limit on open files from %d to %d for a run of %d ranks (hard limit %s)",
        soft,
        need,
        num_processes,
        "none" if hard == unlimited else hard,
    )
    return need


def _round_up(need: int) -> int:
    """The power of two at or above ``need``: what an administrator would set."""
    return 1 << max(need - 1, 1).bit_length()
