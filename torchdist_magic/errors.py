"""Errors a run can end with, as values with structure.

``RankFailure`` carries what a user needs to fix the bug (which rank, where, what it raised,
the traceback in the rank's own terms) and renders itself in a notebook through
``_render_traceback_`` so IPython shows the rank's traceback instead of the driver's.
"""

from __future__ import annotations

from typing import List, Optional

from .events import Failure


class RankFailure(RuntimeError):
    """A rank of a distributed run failed; the first failing rank is the root cause.

    Attributes: ``rank``, ``host``, ``exit_code``, ``exc_type``, ``message``,
    ``traceback`` (the rank's own traceback text) and ``failures`` (every failed rank,
    root cause first).
    """

    def __init__(self, failure: Failure, others: Optional[List[Failure]] = None):
        self.failure = failure
        self.failures = [failure] + list(others or [])
        super().__init__(failure.summary())

    rank = property(lambda self: self.failure.rank)
    host = property(lambda self: self.failure.host)
    exit_code = property(lambda self: self.failure.exit_code)
    exc_type = property(lambda self: self.failure.exc_type)
    message = property(lambda self: self.failure.message)
    traceback = property(lambda self: self.failure.traceback)

    def __reduce__(self):
        return (RankFailure, (self.failure, self.failures[1:]))

    def details(self) -> str:
        """The text a user reads: root cause with its traceback, then the other ranks."""
        f = self.failure
        lines = [f"RankFailure: {f.summary()}"]
        body = f.traceback.rstrip()
        if body:
            lines += ["", f"--- traceback of rank {f.rank} ---", body]
        elif f.log_tail:
            lines += ["", f"--- last output of rank {f.rank} ---", *f.log_tail]
        if len(self.failures) > 1:
            lines += ["", "Other ranks stopped after the root cause:"]
            lines += [f"  {o.summary()}" for o in self.failures[1:]]
        return "\n".join(lines)

    def _render_traceback_(self) -> List[str]:
        return self.details().splitlines()

    def __str__(self) -> str:
        return self.details()


class _PlainRender:
    """Shown in a notebook as its message alone: the driver's stack says nothing useful."""

    def _render_traceback_(self) -> List[str]:
        return f"{type(self).__name__}: {self}".splitlines()


class JobTimeout(_PlainRender, TimeoutError):
    """The run passed its ``timeout``; every rank was stopped."""

    def __init__(self, seconds: float, state_summary: str = ""):
        self.seconds = seconds
        text = f"distributed run timed out after {seconds:g} s; every rank was stopped"
        if state_summary:
            text += f"\n{state_summary}"
        super().__init__(text)


class RunCancelled(_PlainRender, RuntimeError):
    """The run was cancelled (``Run.cancel()`` or the Stop button); every rank was stopped."""
