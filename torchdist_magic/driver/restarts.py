"""Whether a failed attempt starts the job again (``--max-restarts``): not when its failure repeats
the previous attempt's, nor when ``--restart-on`` does not ask for it.

A failure repeats the previous attempt's (``repeats``) when both raised the same exception type
at the same line of the user's code (the innermost frame of the traceback outside installed
packages, the standard library and this package: ``user_frame``) and the later attempt got no
further: it saved no checkpoint of a later step than any attempt before it (``save_checkpoint``'s
step), and where the job keeps none (each attempt starts from scratch) it failed at the same
step (its failing rank's innermost progress bar; none on both counts as the same).  Such a failure would only come again: the run ends with the remaining
restarts unspent, and its ``RankFailure`` says why (``reason``).  A failure without an exception
type or a frame of the user's (a rank killed by a signal, a process that exited) is never taken
for a repeat: the same signal twice may be two machines' faults.

``--restart-on`` (``LaunchOptions.restart_on``) then says which failures are worth a retry:
``any`` (every failure not repeated), ``always`` (every failure, the repeat check left out),
names of exception types with ``killed`` for a rank killed by a signal (only those, not when
repeated), or a function of the root cause ``Failure`` that returns True to restart.  A hang that
``--on-hang restart`` treats as a failure is a ``HangTimeout`` of the culprit (``hang_failure``),
its stack as its traceback (``hangs.hang_failure``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..core.failure import Failure
from ..core.options import restart_names
from ..core.stacks import is_library_file

#: a traceback's frame line (``traceback`` and ``errors.stack_text`` write it so)
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+), in ')
#: files of this package, installed or not: never "the user's code"
_OURS = os.sep + "torchdist_magic" + os.sep
#: what a hang under ``--on-hang restart`` is named, as a failure (``hang_failure``)
HANG = "HangTimeout"


def user_frame(traceback_text: str) -> Optional[Tuple[str, int]]:
    """The innermost frame of the user's own code in ``traceback_text`` (most recent call last),
    as ``(filename, line)``; None when it names none."""
    found = None
    for line in traceback_text.splitlines():
        m = _FRAME.match(line)
        if m and not is_library_file(m.group(1)) and _OURS not in m.group(1):
            found = (m.group(1), int(m.group(2)))
    return found


@dataclass(frozen=True)
class Ending:
    """How one attempt ended, as the decision compares attempts: its root cause, where in the
    user's code it was raised, the failing rank's step and the step of the attempt's newest
    checkpoint (None: it saved none)."""

    attempt: int
    failure: Failure
    where: Optional[Tuple[str, int]]
    step: Optional[int]
    checkpoint: Optional[int]

    @classmethod
    def of(cls, attempt: int, failure: Failure, step: Optional[int], checkpoint: Optional[int]) -> "Ending":
        return cls(attempt, failure, user_frame(failure.traceback), step, checkpoint)


def failing_step(state: Any, rank: int) -> Optional[int]:
    """``rank``'s step in ``state`` (a ``RunState``): the count of its innermost progress bar, or
    None without one."""
    for rs in state.snapshot().ranks:
        if rs.rank == rank:
            bar = rs.current_progress()
            return bar["n"] if bar else None
    return None


def _place(where: Tuple[str, int]) -> str:
    filename, line = where
    shown = filename if filename.startswith("<") else os.path.basename(filename)
    return f"{shown}, line {line}"


def _restarts_left(left: int) -> str:
    return f"not restarting; {left} restart{'' if left == 1 else 's'} left"


def _what(failure: Failure) -> str:
    """What ``failure``'s rank did, in a few words (``rank 1 raised KeyError``)."""
    who = f"rank {failure.rank}"
    if failure.exc_type == HANG:
        return f"{who} hung"
    if failure.exc_type:
        return f"{who} raised {failure.exc_type}"
    if failure.signal_name:
        return f"{who} was killed by {failure.signal_name}"
    if failure.exit_code is not None:
        return f"{who} exited with code {failure.exit_code}"
    return f"{who} failed"


def repeats(earlier: Ending, later: Ending, saved_before: Optional[int] = None) -> bool:
    """Whether ``later`` is ``earlier`` again (the module's docstring says when); ``saved_before``:
    the step of the newest checkpoint any attempt before ``later`` saved (None: none did)."""
    if not later.failure.exc_type or later.where is None:
        return False
    if (later.failure.exc_type, later.where) != (earlier.failure.exc_type, earlier.where):
        return False
    if later.checkpoint is not None and (saved_before is None or later.checkpoint > saved_before):
        return False  # it got further than where it resumed from
    if saved_before is None and later.checkpoint is None:  # no checkpoint: each started from scratch
        return later.step == earlier.step
    return True


def _policy_name(policy: Any) -> str:
    return getattr(policy, "__name__", None) or type(policy).__name__


class RestartDecision:
    """The run's restart decisions, attempt by attempt: ``decide`` is told how each failed
    attempt ended, and says whether to start the job again."""

    def __init__(self, restart_on: Any):
        self.restart_on = restart_on
        self._previous: Optional[Ending] = None
        self._saved: Optional[int] = None  # the newest checkpoint's step of the attempts so far

    def decide(self, ending: Ending, restarts_left: int) -> Optional[str]:
        """None to restart; else the sentence that says why not (``RankFailure.reason``)."""
        previous, self._previous = self._previous, ending
        saved = self._saved
        if ending.checkpoint is not None:
            self._saved = max(ending.checkpoint, saved if saved is not None else ending.checkpoint)
        policy = self.restart_on
        if policy != "always" and previous is not None and repeats(previous, ending, saved):
            ranks = sorted({previous.failure.rank, ending.failure.rank})
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]} and {ranks[1]}"
            did = "hung" if ending.failure.exc_type == HANG else f"raised the same {ending.failure.exc_type}"
            return (
                f"{who} {did} at the same line ({_place(ending.where)}) in attempts {previous.attempt} "
                f"and {ending.attempt}: {_restarts_left(restarts_left)}"
            )
        if policy in ("any", "always"):
            return None
        failure = ending.failure
        names = restart_names(policy)
        if names is not None:
            kind = failure.exc_type.rsplit(".", 1)[-1] if failure.exc_type else ""
            if kind in names or (not kind and failure.signal_name and "killed" in names):
                return None
            return f"{_what(failure)}, which --restart-on ({policy}) does not name: {_restarts_left(restarts_left)}"
        name = _policy_name(policy)
        try:
            answer = policy(dataclasses.replace(failure))
        except Exception as exc:  # noqa: BLE001 - the user's policy: whatever it raises ends the run, said
            return (
                f"the restart_on policy {name} raised {type(exc).__name__}: {exc} (asked about "
                f"{_what(failure)}): {_restarts_left(restarts_left)}"
            )
        if answer is True:
            return None
        if answer is False:
            return f"the restart_on policy {name} returned False for {_what(failure)}: {_restarts_left(restarts_left)}"
        return (
            f"the restart_on policy {name} returned {answer!r:.80}, not True or False (asked about "
            f"{_what(failure)}): {_restarts_left(restarts_left)}"
        )
