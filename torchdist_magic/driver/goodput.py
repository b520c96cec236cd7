"""Goodput: where a run's wall time went (``Run.goodput``, ``RunState.goodput``).

The run's wall time, from its start to its end (or now), split into

- ``startup_s``: until the first attempt's first work (any rank's start of the user's own code,
  ``events.CodeStarted``, or else its first ``progress()`` step, ``report()`` or step split):
  starting processes, imports, the process group;
- ``lost_to_restarts_s``: for each attempt that failed and restarted, its work after its last
  checkpoint (all of its work without one: ``runtime.save_checkpoint`` sends
  ``events.Checkpoint``), and the restart itself, up to the next attempt's first work;
- ``lost_to_hangs_s``: a run that ended hung, from the last sign of life of any rank to the end;
- ``data_stall_s``: the time the job waited for data: per attempt, the longest any rank waited
  in ``progress()`` for its next item (in a synchronous job the others wait for that rank);
- ``training_s``: the rest (steps, evaluation, writing the value);

plus ``rank_seconds`` (the wall time times the run's ranks) and, when the run asked for GPUs,
``gpu_hours`` (a GPU per rank).  Every job that reaches its own code has a first work, also one
that never steps nor reports (a plain function that trains and checkpoints): its start-up, and
every restart's, is measured, not counted as training.  An attempt whose ranks never reached
the job's code (an import that failed first) has no first work: its startup counts as training.
Such a split is "training 100 %" whatever happened; ``says_something`` is false for it, and the
run's summary leaves the line out (``run.goodput`` and MLflow keep the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

#: the keys of ``goodput``'s dict that split the wall time, in the order a summary shows them
PARTS = ("training_s", "startup_s", "data_stall_s", "lost_to_restarts_s", "lost_to_hangs_s")


@dataclass(frozen=True)
class AttemptTimes:
    """One attempt as goodput needs it (wall-clock seconds, the driver's clock)."""

    started: float
    ended: float  # its end, or now for a current attempt still running
    first_work: Optional[float]  # its first sign of work (None: none)
    checkpoint: Optional[float]  # when its newest checkpoint arrived (None: none)
    data_stall_s: float  # the longest any rank of it waited for data


def goodput(
    started: float,
    ended: float,
    attempts: Sequence[AttemptTimes],
    *,
    ranks: int,
    use_gpu: bool,
    hang_lost_s: float = 0.0,
) -> Dict[str, float]:
    """The run's wall time from ``started`` to ``ended`` split as the module's docstring says;
    ``attempts`` oldest first (every one but the last failed and restarted)."""
    wall = max(ended - started, 0.0)
    first = attempts[0] if attempts else None
    startup = max((first.first_work or first.started) - started, 0.0) if first else 0.0
    lost = 0.0
    for attempt, following in zip(attempts, attempts[1:]):
        kept = attempt.checkpoint or attempt.first_work or attempt.started
        resumed = following.first_work or following.ended
        lost += max(resumed - kept, 0.0)
    data = sum(a.data_stall_s for a in attempts)
    hangs = min(max(hang_lost_s, 0.0), wall)
    # a rank's first step may wait for data before its first sign of work arrives: that wait is
    # the data stall's, counted once, so the startup is what the other parts leave of it
    startup = min(startup, max(wall - lost - hangs - data, 0.0))
    out = {"startup_s": startup, "lost_to_restarts_s": lost, "lost_to_hangs_s": hangs, "data_stall_s": data}
    out["training_s"] = max(wall - sum(out.values()), 0.0)
    out["wall_s"] = wall
    out["rank_seconds"] = wall * ranks
    if use_gpu:
        out["gpu_hours"] = wall * ranks / 3600.0
    return out


def says_something(parts: Dict[str, float]) -> bool:
    """Whether a split tells more than the wall time: some of it went to startup, data stalls,
    restarts or hangs.  Without a first sign of work (no rank reached the job's code) and nothing
    lost, everything is "training", which a reader takes as a measurement."""
    return any(parts.get(key, 0.0) > 0 for key in PARTS if key != "training_s")


def describe(parts: Dict[str, float]) -> str:
    """``training 82% (7m12s) · startup 31 s · data stall 12 s · lost to restarts 0 s ·
    lost to hangs 0 s · 1,236 rank-s``: a run's goodput in one line."""
    wall = parts.get("wall_s") or 0.0
    shown = []
    for key in PARTS:
        label = key[:-2].replace("_", " ")
        seconds = parts.get(key, 0.0)
        if key == "training_s":
            share = f"{seconds / wall * 100:.0f}% " if wall > 0 else ""
            shown.append(f"{label} {share}({_seconds(seconds)})")
        else:
            shown.append(f"{label} {_seconds(seconds)}")
    shown.append(f"{parts.get('rank_seconds', 0.0):,.0f} rank-s")
    if "gpu_hours" in parts:
        shown.append(f"{parts['gpu_hours']:.3g} GPU-h")
    return " · ".join(shown)


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.1f} min"
