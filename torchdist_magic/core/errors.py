"""Errors a run can end with, as values with structure.

``RankFailure`` carries what a user needs to fix the bug (which rank, where, what it raised,
the traceback in the rank's own terms) and renders itself in a notebook through
``_render_traceback_`` so IPython shows the rank's traceback instead of the driver's.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from .events import Failure, Stacks

#: lines of a failing rank's last output that its ``RankFailure`` text shows
LAST_WORDS = 10


class RankFailure(RuntimeError):
    """A rank of a distributed run failed; the first failing rank is the root cause.

    Attributes: ``rank``, ``host``, ``exit_code``, ``exc_type``, ``message``,
    ``traceback`` (the rank's own traceback text), ``failures`` (every failed rank of the last
    attempt, root cause first) and ``earlier`` (the root cause of each earlier attempt of a run
    that restarted, oldest first; ``None`` for an attempt whose cause is unknown).
    """

    def __init__(self, failure: Failure, others: Optional[List[Failure]] = None,
                 earlier: Optional[List[Optional[Failure]]] = None):
        self.failure = failure
        self.failures = [failure] + list(others or [])
        self.earlier = list(earlier or [])
        super().__init__(failure.summary())

    rank = property(lambda self: self.failure.rank)
    host = property(lambda self: self.failure.host)
    exit_code = property(lambda self: self.failure.exit_code)
    exc_type = property(lambda self: self.failure.exc_type)
    message = property(lambda self: self.failure.message)
    traceback = property(lambda self: self.failure.traceback)

    @property
    def attempts(self) -> List[Optional[Failure]]:
        """The root cause of every attempt, the last one's (``failure``) last."""
        return self.earlier + [self.failure]

    def __reduce__(self):
        return (RankFailure, (self.failure, self.failures[1:], self.earlier))

    def details(self) -> str:
        """The text a user reads: root cause with its traceback, then the other ranks."""
        f = self.failure
        lines = [f"RankFailure: {f.summary()}"]
        body = f.traceback.rstrip()
        if body:
            lines += ["", f"--- traceback of rank {f.rank} ---", body]
        said = last_words(f)
        if said:
            lines += ["", f"--- last output of rank {f.rank} ---", *said]
        if len(self.failures) > 1:
            lines += ["", "Other ranks stopped after the root cause:"]
            lines += [f"  {o.summary()}" for o in self.failures[1:]]
        if self.earlier:
            lines += ["", f"Every attempt failed ({len(self.attempts)} in all; each failure restarted the job):"]
            lines += [f"  attempt {n}: {cause.summary() if cause else 'failed'}"
                      for n, cause in enumerate(self.attempts, start=1)]
        return "\n".join(lines)

    def _render_traceback_(self) -> List[str]:
        return self.details().splitlines()

    def __str__(self) -> str:
        return self.details()


def last_words(failure: Failure, limit: int = LAST_WORDS) -> List[str]:
    """The failing rank's last lines of output that its traceback does not already show (what a
    script printed before it exited: argparse's usage error, a message before ``sys.exit(1)``),
    at most ``limit`` of them."""
    shown = {line.strip() for line in failure.traceback.splitlines()}
    said = [line for line in failure.log_tail if line.strip() and line.strip() not in shown]
    return said[-limit:]


class _PlainRender:
    """Shown in a notebook as its message alone: the driver's stack says nothing useful."""

    def _render_traceback_(self) -> List[str]:
        return f"{type(self).__name__}: {self}".splitlines()


def where_ranks_were(stacks: Dict[int, Stacks], num_processes: int = 0) -> List[str]:
    """One line per rank (of ``num_processes``; 0: those in ``stacks``): its main thread's
    innermost frames (``Stacks.where``)."""
    ranks = range(num_processes) if num_processes else sorted(stacks)
    return [f"  rank {r}: " + (stacks[r].where() if r in stacks else "no stack came back") for r in ranks]


def stack_text(record: Stacks) -> str:
    """A rank's main thread as Python prints a traceback (most recent call last)."""
    thread = record.main()
    if thread is None:
        return f"  ({record.note or 'no Python stack'})"
    return "\n".join(f'  File "{f.filename}", line {f.line}, in {f.function}'
                     for f in reversed(thread.job_frames()))


class _WithStacks(_PlainRender):
    """An error that shows where every rank was: each rank's main-thread stack below the message.
    ``stacks``: rank -> ``events.Stacks`` (every thread), as captured before the ranks were stopped;
    ``headline``: the message's first sentence."""

    stacks: Dict[int, Stacks]
    headline: str

    def _render_traceback_(self) -> List[str]:
        lines = super()._render_traceback_()
        for rank, record in sorted(self.stacks.items()):
            lines += ["", f"--- rank {rank}, main thread (most recent call last) ---",
                      *stack_text(record).splitlines()]
        return lines


class JobTimeout(_WithStacks, TimeoutError):
    """The run passed its ``timeout``; every rank was stopped.  ``stacks`` are every rank's
    stacks at that moment (empty when none were captured)."""

    def __init__(self, seconds: float, state_summary: str = "", stacks: Optional[Dict[int, Stacks]] = None,
                 num_processes: int = 0):
        self.seconds = seconds
        self.state_summary = state_summary
        self.stacks = dict(stacks or {})
        self.num_processes = num_processes
        self.headline = text = f"distributed run timed out after {seconds:g} s; every rank was stopped"
        if state_summary:
            text += f"\n{state_summary}"
        if self.stacks:
            text += "\nWhere each rank was (innermost frame first):\n" + "\n".join(
                where_ranks_were(self.stacks, num_processes))
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.seconds, self.state_summary, self.stacks, self.num_processes))


class HangTimeout(_WithStacks, TimeoutError):
    """No rank sent progress, metrics or output for ``hang_timeout`` seconds: every rank's
    stacks were captured (``stacks``), then every rank was stopped.  The message names each
    rank's innermost frames."""

    def __init__(self, seconds: float, stacks: Dict[int, Stacks], num_processes: int, hint: str = ""):
        self.seconds = seconds
        self.stacks = dict(stacks)
        self.num_processes = num_processes
        self.hint = hint  # what probably hung it (a collective in a cell on some ranks)
        self.headline = (f"no rank sent progress, metrics or output for {seconds:g} s (hang_timeout); "
                         "every rank was stopped")
        if hint:
            self.headline += f". {hint[:1].upper()}{hint[1:]}"
        super().__init__(f"{self.headline}. Where each rank was (innermost frame first):\n"
                         + "\n".join(where_ranks_were(self.stacks, num_processes)))

    def __reduce__(self):
        return (type(self), (self.seconds, self.stacks, self.num_processes, self.hint))


class ResultTimeout(_PlainRender, TimeoutError):
    """``Run.result(timeout)`` waited ``seconds`` and the run had not ended: it keeps running
    (``Run.cancel()`` stops it).  Unlike ``JobTimeout``, nothing was stopped."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        super().__init__(f"the run is still going after waiting {seconds:g} s (it keeps running; call cancel() "
                         "to stop it)")

    def __reduce__(self):
        return (type(self), (self.seconds,))


class RunCancelled(_PlainRender, RuntimeError):
    """The run was cancelled (``Run.cancel()`` or the Stop button); every rank was stopped."""
