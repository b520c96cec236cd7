"""One run handle: what every handle on a run answers alike (``RunHandle``), whether the run is
held in this process (``distributor.Run``) or by another one that a kernel attached to
(``handles.attach.AttachedRun``).

The views, the panel and the Python API take a ``RunHandle`` and never ask which one they hold.
A feature a handle cannot give where it is returns ``None`` (an empty answer where the type is a
collection) or raises ``errors.NotAvailable``; none is missing.  The answers read from the run's
state are worked out once here (``StateAnswers``), from the handle's ``state``: a ``RunState``
in this process, or a ``HostedState`` read through the feed of the process that holds it.  The
protocol is open: a later member (a versioned ``status()``) is added here and to both handles."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, runtime_checkable

from ..core.culprit import Verdict
from ..core.events import Preflight, Stacks
from ..core.preflight import PreflightResult, compare


@runtime_checkable
class RunHandle(Protocol):
    """A run, in progress or finished, wherever it is held.

    Example:

    ```python
    from torchdist_magic import Distributor, RunHandle, attach

    def summary(run: RunHandle) -> str:     # a run of this kernel, or one attached to
        run.wait()
        return f"{run.run_id}: {run.state.state}, {len(run.attempts)} restart(s)"

    summary(Distributor(num_processes=2).submit(train))
    summary(attach("3-1a2b3c4d"))
    ```
    """

    run_id: str
    #: the run's state, read by the views (a ``RunState``, or a ``HostedState``)
    state: Any

    def result(self, timeout: Optional[float] = None) -> Any:
        """Rank 0's value, or the run's error raised here; ``ResultTimeout`` first."""

    @property
    def exception(self) -> Optional[BaseException]:
        """The run's error once it ended; None while it runs, and when it succeeded."""

    def cancel(self, by: str = "cancel()") -> None:
        """Stop every rank."""

    def done(self) -> bool:
        """Whether the run has ended."""

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the run's end, at most ``timeout`` seconds; whether it ended."""

    def logs(self, rank: int = 0, attempt: Optional[int] = None) -> str:
        """Everything ``rank`` printed (of ``attempt``; the last one by default)."""

    @property
    def attempts(self) -> list:
        """The attempts before the current one, each with the root cause that ended it."""

    def culprit(self) -> Verdict:
        """Where the ranks are, compared: a fresh look where the handle reaches the ranks, the
        run's last verdict otherwise."""

    @property
    def goodput(self) -> Dict[str, float]:
        """Where the run's wall time went so far, in seconds."""

    @property
    def preflight(self) -> Optional[PreflightResult]:
        """What the ranks' pre-flight reports say, or None when no report came."""

    @property
    def profile(self) -> Any:
        """The run's profile so far (``profiles.Profile``), or None."""

    @property
    def stacks(self) -> Dict[int, Stacks]:
        """Every rank's stacks as captured at a hang or a timeout; else empty."""

    @property
    def can_profile(self) -> bool:
        """Whether ``start_profile`` may profile the ranks from this handle."""

    def start_profile(self, steps: int) -> None:
        """Profile every rank's next ``steps`` steps; ``NotAvailable`` where the handle cannot."""

    def status(self) -> Dict[str, Any]:
        """The run's status as JSON values, one versioned schema for every handle
        (``driver.status.run_status``): what ``torchdist status --json`` prints."""


class StateAnswers:
    """The answers of ``RunHandle`` that its ``state`` holds, for both handles."""

    def status(self) -> Dict[str, Any]:
        """The run's status as a dict of JSON values (``driver.status.run_status``, schema
        ``SCHEMA_VERSION``), the same keys for either handle: what ``torchdist status --json``
        prints (from the supervising process while a detached run goes on)."""
        from .status import run_status

        return run_status(self.state)

    state: Any

    @property
    def attempts(self) -> List[Any]:
        """The attempts before the current one (``snapshot.Attempt``), each with the root cause
        that ended it."""
        return list(self.state.attempts)

    @property
    def goodput(self) -> Dict[str, float]:
        """Where the run's wall time went so far, in seconds (``goodput``): ``startup_s``,
        ``training_s``, ``lost_to_restarts_s``, ``lost_to_hangs_s``, ``data_stall_s``, ``wall_s``,
        ``rank_seconds``, and with ``use_gpu`` ``gpu_hours``."""
        return self.state.goodput()

    @property
    def profile(self) -> Any:
        """With ``profile=STEPS`` (``--profile``): the profile of every rank's steps so far, its
        ``trace_path`` (one Chrome trace of every rank, in the run's directory, once every rank's
        profile came) and its ``summary`` by rank; None without, or before any rank's came."""
        return self.state.profile()

    @property
    def stacks(self) -> Dict[int, Stacks]:
        """Every rank's stacks (all threads) as captured at a hang or a timeout; else empty."""
        return dict(self.state.snapshot().stacks)

    @property
    def preflight(self) -> Optional[PreflightResult]:
        """What the ranks' pre-flight reports say (``--preflight``: ``refusal``, ``warnings``,
        ``lines`` with the figures by host), or ``None`` when no report came."""
        reports = self.state.snapshot().preflight
        return compare(list(reports.values())) if reports else None

    @property
    def preflight_reports(self) -> Dict[int, Preflight]:
        """Each rank's pre-flight report (``events.Preflight``), by rank; empty without one."""
        return dict(self.state.snapshot().preflight)

    def last_verdict(self) -> Verdict:
        """The run's verdict as last worked out (an empty one when none was)."""
        return self.state.snapshot().verdict or Verdict()
