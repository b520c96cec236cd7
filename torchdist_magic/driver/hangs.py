"""What a hang, a timeout or a collective's timeout is made into: every rank's stacks and
collective records, the culprit they name, and the words of the error."""

from __future__ import annotations

import time

from typing import Callable, Dict, Iterable, List, Optional, Sequence

from ..core import culprit
from ..core.errors import grouped_where, stack_text, where_ranks_were
from ..core.events import Failure, Stacks
from ..core.timing import COLLECTIVES_WAIT, STACKS_COLLECT_WAIT
from .restarts import HANG
from .state import RunState


def capture(
    state: RunState, dump_stacks: Callable[[], None], dump_collectives: Callable[[], None], ranks: Iterable[int]
) -> Dict[int, Stacks]:
    """Every running rank's stacks (all threads) and collective record, as far as they come
    within ``STACKS_COLLECT_WAIT``; the stacks are also the state's ``stacks``, and what the
    records say of ``ranks`` its ``verdict`` (the view shows both)."""
    state.begin_collectives()
    running = state.begin_stacks()
    dump_stacks()
    stacks = state.wait_stacks(running, STACKS_COLLECT_WAIT)
    # the records are asked for once the stacks came, not while faulthandler walks a rank's
    # threads (a rank asked for both at once was seen to end with SIGSEGV, once)
    dump_collectives()
    # a rank without a process group never answers: its peers' records say enough then
    records = state.wait_collectives(running, COLLECTIVES_WAIT)
    state.set_verdict(culprit.verdict(records, ranks, state.exits()))
    return stacks


def suspect_failure(state: RunState, verdict: "culprit.Verdict", stacks: Dict[int, Stacks], when: float) -> Failure:
    """The root cause where a collective timed out because of ``verdict``'s first suspect:
    that rank, the verdict as its message, its stack as its traceback."""
    rank = verdict.suspects[0]
    host = next((rs.host for rs in state.snapshot().ranks if rs.rank == rank), "")
    return Failure(
        rank=rank,
        host=host,
        message=verdict.sentence,
        traceback=stack_text(stacks[rank]) if rank in stacks and stacks[rank].text else "",
        time=when,
    )


def hang_hint(ranks: Sequence[int]) -> str:
    """What a hang of a run on some ranks of a warm pool (``ranks``) adds: why it may hang."""
    if not ranks:
        return ""
    chosen = ", ".join(map(str, ranks))
    return (
        f"this cell ran on rank{'s' if len(ranks) > 1 else ''} {chosen} of the pool only "
        "(--ranks): a collective (all_reduce, barrier, broadcast, DDP) waits for every rank of the "
        "process group, and the other ranks were idle; run such a cell without --ranks"
    )


def progress_summary(state: RunState) -> str:
    """Where every rank was (a timeout's message): its state and its innermost progress bar."""
    parts = []
    for rs in state.snapshot().ranks:
        bar = rs.current_progress()
        where = f" at {bar['desc'] or 'step'} {bar['n']}/{bar['total'] or '?'}" if bar else ""
        parts.append(f"rank {rs.rank}: {rs.state}{where}")
    return "; ".join(parts)


def _silence(seconds: float) -> str:
    return f"no rank sent progress, metrics or output for {seconds:g} s (hang_timeout)"


def hang_failure(
    state: RunState, verdict: Optional["culprit.Verdict"], stacks: Dict[int, Stacks], running: List[int], seconds: float
) -> Failure:
    """A hang as the failure of its culprit (``--on-hang restart``): the verdict's first suspect,
    else the lowest rank that was running; the verdict (or the silence) as its message, its stack
    as its traceback, ``HANG`` as its exception type (``restarts`` compares it as any other)."""
    rank = verdict.suspects[0] if verdict and verdict.suspects else min(running or [0])
    host = next((rs.host for rs in state.snapshot().ranks if rs.rank == rank), "")
    return Failure(
        rank=rank,
        host=host,
        exc_type=HANG,
        message=verdict.sentence if verdict else _silence(seconds),
        traceback=stack_text(stacks[rank]) if rank in stacks and stacks[rank].text else "",
        time=time.time(),
    )


def observed_notice(
    state: RunState, stacks: Dict[int, Stacks], verdict: Optional["culprit.Verdict"], seconds: float, ranks: int
) -> List[str]:
    """What ``--on-hang observe`` says in the culprit's log: the silence and the verdict, where
    each rank is (the suspects first), their collective records, and what the user can do."""
    silence = _silence(seconds)
    said = f"{verdict.sentence}. {silence[:1].upper()}{silence[1:]}" if verdict else silence
    lines = [
        f"[torchdist] --on-hang observe: {said}; the ranks keep running. Where each rank is (innermost frame first):"
    ]
    if verdict and verdict.suspects:
        shown = {r: stacks[r] for r in verdict.suspects if r in stacks}
        lines += where_ranks_were(shown)
        lines += grouped_where(stacks, [r for r in range(ranks) if r not in verdict.suspects])
    else:
        lines += where_ranks_were(stacks, ranks)
    if verdict:
        lines += ["Where each rank is in its collectives:", *(f"  {line}" for line in verdict.summary)]
    pids = [
        f"rank {rs.rank}: pid {rs.pid} on {rs.host}"
        for rs in state.snapshot().ranks
        if rs.pid and rs.state == "running"
    ]
    lines.append(
        "[torchdist] the run goes on until you stop it: the view's Stop button, interrupting the "
        "kernel (Ctrl-C) or run.cancel(); run.culprit() asks the ranks again, run.stacks has "
        "their stacks; a debugger attaches to a rank's process"
        + (f" ({'; '.join(pids[:8])}: py-spy dump --pid PID, gdb -p PID)" if pids else "")
    )
    return lines
