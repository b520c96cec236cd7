"""Which rank holds the others up: a verdict from the ranks' collective records.

``verdict(records, ranks, exited)`` compares where each rank is in each process group
(``events.Collectives``, sent by the ranks: ``collectives``) and names the suspects:

- **behind**: ranks whose last collective has a lower sequence number than the others' (a rank
  stuck in its data loader while the others wait in the next ``all_reduce``);
- **exited**: ranks that left (their process ended) while the others wait in a collective they
  never reached;
- **mismatch**: ranks in a different collective (op or sizes) at the same sequence number as
  the others (``broadcast`` where the others call ``all_reduce``).

Where a rank's record comes from its stack (no Flight Recorder), there are no sequence numbers:
a rank in no collective while the others wait in one is behind, and ranks in different
collectives are mismatched.  A pure function of the records: the driver calls it at a hang, a
timeout, and when a rank fails with a collective timeout (``is_collective_timeout``), which is
then collateral to the rank behind.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .events import Collectives, GroupCollectives
from .failure import Failure

#: what a rank raises when a collective it waits in timed out (gloo's send/recv timeouts, NCCL's
#: watchdog): collateral whenever another rank is behind
COLLECTIVE_TIMEOUT = re.compile(
    r"Timed out waiting \d+ ?ms for (recv|send) operation|collective operation timeout"
    r"|Watchdog caught collective operation timeout|DistBackendError.*timed? ?out"
)


def is_collective_timeout(failure: Failure) -> bool:
    """Whether ``failure`` is a collective that timed out waiting for its peers: what the rank
    raised, or, for a rank that NCCL's watchdog aborted (no exception of its own), its last
    output."""
    if failure.exc_type:
        return bool(COLLECTIVE_TIMEOUT.search(failure.message))
    return any(COLLECTIVE_TIMEOUT.search(line) for line in failure.log_tail)


@dataclass(frozen=True)
class Verdict:
    """What the records say: ``kind`` (``"behind"``, ``"exited"``, ``"mismatch"``, or ``""``
    when they point at no rank), ``suspects`` (sorted rank numbers), ``sentence`` (one line that
    names them and why), ``summary`` (every rank's state, ranks in the same state on one line:
    its length does not grow with the number of ranks)."""

    kind: str = ""
    suspects: Tuple[int, ...] = ()
    sentence: str = ""
    summary: Tuple[str, ...] = field(default_factory=tuple)

    def __bool__(self) -> bool:
        return bool(self.suspects)


def rank_list(ranks: Iterable[int]) -> str:
    """``rank 2`` / ``ranks 0, 1, 3`` / ``ranks 0-255, 257-1023``: runs of three or more as
    ranges, so that the text stays short at 1024 ranks."""
    ranks = sorted(set(ranks))
    parts: List[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
            i = j + 1
        else:
            parts.append(str(ranks[i]))
            i += 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _collective(seq: int, op: str, sizes: Sequence[Sequence[int]] = (), with_sizes: bool = False) -> str:
    if seq <= 0:
        return "none"
    text = f"#{seq} {op or '?'}"
    if with_sizes and sizes:
        text += " " + ", ".join("[" + ", ".join(map(str, s)) + "]" for s in sizes)
    return text


def _where_group(group: str) -> str:
    return f" ({group})"


def verdict(records: Dict[int, Collectives], ranks: Iterable[int], exited: Optional[Dict[int, str]] = None) -> Verdict:
    """Compare the collective records of ``ranks`` (``records``: rank -> its latest record;
    a rank may have none) and name the suspects.  ``exited``: rank -> how it left (``"exited
    with code 0"``) for the ranks whose process has ended."""
    ranks = sorted(set(ranks))
    exited = dict(exited or {})
    summary = tuple(_summary(records, ranks, exited))
    groups = sorted(
        {g.group for r in ranks if r in records for g in records[r].groups},
        key=lambda name: (name != "default group", name),
    )
    for group in groups:
        found = _group_verdict(group, records, ranks, exited)
        if found is not None:
            kind, suspects, sentence = found
            return Verdict(kind, tuple(sorted(suspects)), sentence, summary)
    found = _stack_verdict(records, ranks, exited)
    if found is not None:
        kind, suspects, sentence = found
        return Verdict(kind, tuple(sorted(suspects)), sentence, summary)
    return Verdict(summary=summary)


def _group_verdict(
    name: str, records: Dict[int, Collectives], ranks: List[int], exited: Dict[int, str]
) -> Optional[Tuple[str, List[int], str]]:
    """Behind, exited or mismatch in the process group ``name``, from Flight Recorder records."""
    states: Dict[int, GroupCollectives] = {}
    for r in ranks:
        record = records.get(r)
        if record is not None and record.source == "flight recorder":
            states[r] = record.group(name) or GroupCollectives(group=name)
    if not states:
        return None
    front = max(g.entered for g in states.values())
    if front <= 0:
        return None
    # the ranks at the front wait there for the others (a collective that timed out counts as
    # finished in the recorder, so whether it finished says nothing here)
    ahead = sorted(r for r, g in states.items() if g.entered == front)
    usual_op = Counter(states[r].op for r in ahead).most_common(1)[0][0]
    waits = f"{rank_list(ahead)} wait{'s' if len(ahead) == 1 else ''} in {_collective(front, usual_op)}"
    gone = sorted(r for r in ranks if r in exited and (r not in states or states[r].entered < front))
    behind = sorted(r for r, g in states.items() if g.entered < front and r not in exited)
    if behind:
        return "behind", behind, f"{_behind(behind, states)}; {waits}{_where_group(name)}"
    if gone:
        how = Counter(exited[r] for r in gone).most_common(1)[0][0]
        last = {_collective(states[r].entered, states[r].op) for r in gone if r in states}
        after = f" after {last.pop()}" if len(last) == 1 and all(r in states for r in gone) else ""
        verb = "has" if len(gone) == 1 else "have"
        return "exited", gone, f"{rank_list(gone)} {verb} left ({how}){after}; {waits}{_where_group(name)}"
    kinds = Counter((states[r].op, _sizes(states[r])) for r in ahead)
    if len(kinds) < 2:
        return None
    # the most common collective is the one meant; ties go to the one of the lowest rank
    usual = max(kinds, key=lambda k: (kinds[k], -min(r for r in ahead if (states[r].op, _sizes(states[r])) == k)))
    odd = [r for r in ahead if (states[r].op, _sizes(states[r])) != usual]
    with_sizes = len({op for op, _ in kinds}) == 1
    by_kind: Dict[Tuple[str, Tuple], List[int]] = {}
    for r in ahead:
        by_kind.setdefault((states[r].op, _sizes(states[r])), []).append(r)
    parts = [
        f"{rank_list(rs)} in {_op_text(op, sizes, with_sizes)}"
        for (op, sizes), rs in sorted(by_kind.items(), key=lambda kv: (kv[0] == usual, kv[1][0]))
    ]
    return "mismatch", odd, f"collective mismatch at #{front}: {', '.join(parts)}{_where_group(name)}"


def _sizes(group: GroupCollectives) -> Tuple:
    return tuple(tuple(s) for s in group.sizes)


def _op_text(op: str, sizes: Tuple, with_sizes: bool) -> str:
    if not with_sizes:
        return op or "?"
    return f"{op} " + (", ".join("[" + ", ".join(map(str, s)) + "]" for s in sizes) or "[]")


def _behind(behind: List[int], states: Dict[int, GroupCollectives]) -> str:
    lasts = {_collective(states[r].entered, states[r].op) for r in behind}
    if len(behind) == 1:
        last = lasts.pop()
        return f"{rank_list(behind)} is behind: " + (
            "it entered no collective yet" if last == "none" else f"its last collective was {last}"
        )
    if len(lasts) == 1:
        last = lasts.pop()
        return f"{rank_list(behind)} are behind: " + (
            "they entered no collective yet" if last == "none" else f"their last collective was {last}"
        )
    return f"{rank_list(behind)} are behind"


def _stack_verdict(
    records: Dict[int, Collectives], ranks: List[int], exited: Dict[int, str]
) -> Optional[Tuple[str, List[int], str]]:
    """Behind, exited or mismatch from stack records (no sequence numbers)."""
    stack = {r: records[r] for r in ranks if r in records and records[r].source == "stack"}
    inside = {r: rec.in_collective for r, rec in stack.items() if rec.in_collective}
    if not inside:
        return None
    ops = Counter(inside.values())
    usual = max(ops, key=lambda op: (ops[op], -min(r for r, o in inside.items() if o == op)))
    waiting = sorted(r for r, op in inside.items() if op == usual)
    waits = f"{rank_list(waiting)} wait{'s' if len(waiting) == 1 else ''} in {usual}"
    outside = sorted(r for r in stack if r not in inside and r not in exited)
    if outside:
        verb = "is" if len(outside) == 1 else "are"
        return "behind", outside, f"{rank_list(outside)} {verb} in no collective; {waits} (from the ranks' stacks)"
    gone = sorted(r for r in ranks if r in exited and r not in inside)
    if gone:
        how = Counter(exited[r] for r in gone).most_common(1)[0][0]
        verb = "has" if len(gone) == 1 else "have"
        return "exited", gone, f"{rank_list(gone)} {verb} left ({how}); {waits} (from the ranks' stacks)"
    if len(ops) > 1:
        odd = sorted(r for r, op in inside.items() if op != usual)
        by_op: Dict[str, List[int]] = {}
        for r, op in sorted(inside.items()):
            by_op.setdefault(op, []).append(r)
        parts = [
            f"{rank_list(rs)} in {op}" for op, rs in sorted(by_op.items(), key=lambda kv: (kv[0] == usual, kv[1][0]))
        ]
        return "mismatch", odd, f"collective mismatch: {', '.join(parts)} (from the ranks' stacks)"
    return None


def _summary(records: Dict[int, Collectives], ranks: List[int], exited: Dict[int, str]) -> List[str]:
    """Every rank's state in one line per distinct state: ``ranks 0, 1, 3: in #4 all_reduce
    [10] (default group)``."""
    by_state: Dict[str, List[int]] = {}
    for r in ranks:
        by_state.setdefault(_state_text(records.get(r), exited.get(r)), []).append(r)
    return [f"{rank_list(rs)}: {text}" for text, rs in sorted(by_state.items(), key=lambda kv: kv[1][0])]


def _state_text(record: Optional[Collectives], gone: Optional[str]) -> str:
    parts = []
    if record is None:
        parts.append("no collective record")
    elif record.source == "flight recorder":
        for g in record.groups:
            if g.finished < g.entered:
                where = (
                    f"in {_collective(g.entered, g.op, g.sizes, True)}, finished #{g.finished}"
                    if g.finished
                    else f"in {_collective(g.entered, g.op, g.sizes, True)}"
                )
            else:
                where = f"last collective {_collective(g.entered, g.op, g.sizes, True)}, finished"
            parts.append(f"{where} ({g.group})")
    elif record.source == "stack":
        parts.append(
            f"in {record.in_collective} (its stack)" if record.in_collective else "in no collective (its stack)"
        )
    else:
        parts.append(record.note or "no collective record")
    if gone:
        parts.append(gone)
    return "; ".join(parts)
