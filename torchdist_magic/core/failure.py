"""One rank's failure (``Failure``), as the records carry it (``events.Exit``, ``events.JobDone``) and
the driver reports it: built in one place from an exception or from how a process ended."""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass, field
from time import time as _now
from traceback import format_exception as _format_exception
from typing import Any, List, Optional


@dataclass
class Failure:
    """One rank's failure: what it raised (or how its process ended) and where.

    Built in one place, as ipyparallel builds its remote errors: ``from_exception`` where the
    exception is at hand (the worker, a Spark task's own failure), ``from_exit`` where a process
    ended (a launcher, the run's state), ``for_rank`` for a copy that names the rank it concerns.
    """

    rank: int = 0
    host: str = ""
    exit_code: Optional[int] = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    time: float = 0.0
    log_tail: List[str] = field(default_factory=list)

    @classmethod
    def from_exception(
        cls,
        rank: int,
        exc: BaseException,
        *,
        host: str = "",
        exit_code: Optional[int] = None,
        exc_type: Optional[str] = None,
        message: Optional[str] = None,
        traceback_text: Optional[str] = None,
        time: Optional[float] = None,
    ) -> "Failure":
        """``rank``'s failure by ``exc``: its type (``exc_type``: the class's qualified name unless
        given), message (``str(exc)`` unless given) and traceback (``traceback_text``: the whole
        formatted exception unless given), at ``time`` (now unless given)."""
        if traceback_text is None:
            traceback_text = "".join(_format_exception(type(exc), exc, exc.__traceback__))
        return cls(
            rank=rank,
            host=host,
            exit_code=exit_code,
            exc_type=type(exc).__qualname__ if exc_type is None else exc_type,
            message=str(exc) if message is None else message,
            traceback=traceback_text,
            time=_now() if time is None else time,
        )

    @classmethod
    def from_exit(
        cls,
        rank: int,
        code: Optional[int],
        *,
        host: str = "",
        time: float = 0.0,
        reported: Optional["Failure"] = None,
        log_tail: Optional[List[str]] = None,
    ) -> "Failure":
        """``rank``'s failure from how its process ended, ``code`` (negative: killed by that
        signal, which ``summary`` names; ``None``: no process exit to report), and from what the
        rank itself reported, ``reported`` (its exception: the worker's ``error.json``, a warm
        job's ``JobDone``), when it reported anything.

        The exit code is the process's; the reported one only refines a plain exit (a positive
        code, or none).  ``host`` and ``time`` stand in where the report has none; ``log_tail``
        (the rank's last lines of output, seen here) where given and not empty replaces the
        report's."""
        reported = reported if reported is not None else cls()
        plain = code is None or code > 0
        return cls(
            rank=rank,
            host=reported.host or host,
            exit_code=reported.exit_code if plain and reported.exit_code is not None else code,
            exc_type=reported.exc_type,
            message=reported.message,
            traceback=reported.traceback,
            time=reported.time or time,
            log_tail=list(log_tail or reported.log_tail),
        )

    def for_rank(self, rank: int, **changes: Any) -> "Failure":
        """A copy of this failure as ``rank``'s, with ``changes`` (fields by name) made."""
        return dataclasses.replace(self, rank=rank, **changes)

    @property
    def signal_name(self) -> Optional[str]:
        if self.exit_code is not None and self.exit_code < 0:
            try:
                return signal.Signals(-self.exit_code).name
            except ValueError:
                return f"signal {-self.exit_code}"
        return None

    def summary(self) -> str:
        where = f"rank {self.rank}" + (f" on {self.host}" if self.host else "")
        if self.exc_type:
            return f"{where} raised {self.exc_type}: {self.message}".rstrip(": ")
        if self.signal_name:
            if self.message:  # what the launcher made of the kill (``sysmetrics.explain_kill``)
                return f"{where} was killed ({self.signal_name}), {self.message}"
            return f"{where} was killed by {self.signal_name}"
        if self.exit_code is not None:
            return f"{where} exited with code {self.exit_code}"
        return f"{where} failed: {self.message}"
