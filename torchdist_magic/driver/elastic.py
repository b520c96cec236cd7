"""How many ranks an attempt runs, and which hosts it leaves out: ``--np MIN:MAX``
(``LaunchOptions.min_processes``) and the exclusions that follow a machine fault or a lost host.

The first attempt starts as many ranks as the backend can place, up to MAX (``first_world``);
below MIN the run is refused before anything starts.  After a failed attempt (``next_world``),
the root cause's host is left out where its class says so (``faults.EXCLUDING``) and the backend
can (``Backend.exclude``), and the next attempt goes on with the ranks that can be placed now:
one fewer for each place left out, and no more than the backend has at this moment
(``Backend.placeable``).  Below MIN the run ends instead, saying why.  A world never grows again
within a run: capacity that joins later (a replacement executor) is not waited for, and the
ranks left running keep their numbers 0..N-1 (``world_size()`` and ``RESTART_COUNT`` tell the
job; it reshards from its checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..core import faults
from ..core.options import LaunchOptions, flag_of


@dataclass(frozen=True)
class NextWorld:
    """The next attempt's world size and what it leaves out; ``refusal``: why there is none."""

    num_processes: int
    excluded: Tuple[faults.Exclusion, ...] = ()
    refusal: str = ""


def _range(options: LaunchOptions) -> str:
    return f"{options.min_processes}:{options.num_processes}"


def first_world(options: LaunchOptions, backend: Any) -> LaunchOptions:
    """``options`` for the first attempt: with ``min_processes``, as many ranks as ``backend``
    has slots for, up to ``num_processes``; ``ValueError`` below ``min_processes``."""
    if options.min_processes is None:
        return options
    slots = backend.slots()
    if slots is None or slots >= options.num_processes:
        return options
    if slots < options.min_processes:
        raise ValueError(
            f"{flag_of('num_processes')}/num_processes {_range(options)} needs at least {options.min_processes} ranks, but "
            f"{backend.describe()} has room for {slots}: lower MIN, or add executors/hosts"
        )
    return options.replace(num_processes=slots)


def next_world(
    options: LaunchOptions, backend: Any, cause: Any, fault: Optional[faults.Fault], attempt: int, host: str = ""
) -> NextWorld:
    """The attempt after ``attempt``, whose root cause ``cause`` (a ``Failure``) was of class
    ``fault`` on ``host`` (its rank's, as the backend placed it): the exclusion ``backend``
    took for it, and the ranks the next attempt runs."""
    excluded: Tuple[faults.Exclusion, ...] = ()
    n = options.num_processes
    if cause is not None and fault is not None:
        exclusion = faults.exclusion(cause, fault, attempt, host)
        if exclusion is not None and backend.exclude(exclusion):
            excluded = (exclusion,)
            # a machine that faulted still runs: where the next attempt would not fit without it
            # (a fixed --np, or below MIN), it is used again rather than the run ended for it
            need = n if options.min_processes is None else options.min_processes
            placeable = backend.placeable()
            if fault.kind == faults.MACHINE and placeable is not None and placeable < need:
                if backend.readmit(exclusion):
                    excluded = ()
    if options.min_processes is None:
        return NextWorld(n, excluded)
    wanted = n - len(excluded)  # the place left out is not taken again
    placeable = backend.placeable()
    can = wanted if placeable is None else min(wanted, placeable)
    if can >= options.min_processes:
        return NextWorld(can, excluded)
    left = options.max_restarts - attempt + 1
    why = f"{excluded[0].sentence()}; " if excluded else ""
    return NextWorld(
        can,
        excluded,
        refusal=(
            f"{why}the next attempt could place {can} ranks, fewer than MIN {options.min_processes} of "
            f"{flag_of('num_processes')}/num_processes MIN:MAX; {left} restart{'s' if left != 1 else ''} left"
        ),
    )
