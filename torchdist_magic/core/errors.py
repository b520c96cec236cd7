"""Errors a run can end with, as values with structure.

``RankFailure`` carries what a user needs to fix the bug (which rank, where, what it raised,
the traceback in the rank's own terms) and renders itself in a notebook through
``_render_traceback_`` so IPython shows the rank's traceback instead of the driver's.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .culprit import Verdict, rank_list
from .events import Stacks
from .failure import Failure

#: lines of a failing rank's last output that its ``RankFailure`` text shows
LAST_WORDS = 10
#: suspects (``culprit``) whose stacks a hang or a timeout shows in full; the rest are grouped
SHOWN_SUSPECTS = 8


class RankFailure(RuntimeError):
    """A rank of a distributed run failed; the first failing rank is the root cause.

    Attributes: ``rank``, ``host``, ``exit_code``, ``exc_type``, ``message``,
    ``traceback`` (the rank's own traceback text), ``failures`` (every failed rank of the last
    attempt, root cause first) and ``earlier`` (the root cause of each earlier attempt of a run
    that restarted, oldest first; ``None`` for an attempt whose cause is unknown).
    ``verdict`` (a ``culprit.Verdict``, ``None`` when the ranks' collective records were not
    compared) and ``suspects`` (its sorted ranks): where a collective timed out because a rank
    was behind, that rank is the root cause (``rank``) and the verdict leads the message.
    ``reason``: why a run with restarts left did not restart (the failure repeated the previous
    attempt's, ``--restart-on`` did not ask for it, or fewer ranks than ``--np MIN:MAX``'s MIN
    could be placed); ``""`` otherwise.

    Example:

    ```python
    from torchdist_magic import Distributor, RankFailure

    def train():
        from torchdist_magic import rank
        if rank() == 1:
            raise ValueError("bad batch")

    try:
        Distributor(num_processes=2, show=None).run(train)
    except RankFailure as failure:
        print(failure.rank, failure.exc_type, failure.message)   # 1 ValueError bad batch
        print(failure.traceback)                                  # rank 1's own traceback
    ```
    """

    def __init__(
        self,
        failure: Failure,
        others: Optional[List[Failure]] = None,
        earlier: Optional[List[Optional[Failure]]] = None,
        verdict: Optional[Verdict] = None,
        reason: str = "",
    ):
        self.failure = failure
        self.failures = [failure] + list(others or [])
        self.earlier = list(earlier or [])
        self.verdict = verdict
        self.reason = reason
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

    @property
    def suspects(self) -> Tuple[int, ...]:
        """The ranks the collective records point at (sorted); empty when they point at none."""
        return self.verdict.suspects if self.verdict else ()

    def __reduce__(self):
        return (RankFailure, (self.failure, self.failures[1:], self.earlier, self.verdict, self.reason))

    def details(self) -> str:
        """The text a user reads: the verdict when there is one, the root cause with its
        traceback (a rank behind: its stack), then the other ranks."""
        f = self.failure
        lines = [f"RankFailure: {self.verdict.sentence}" if self.verdict else f"RankFailure: {f.summary()}"]
        if self.reason:
            lines.append(f"Not restarted: {self.reason}")
        body = f.traceback.rstrip()
        if body:
            what = "stack" if self.verdict and not f.exc_type else "traceback"
            lines += ["", f"--- {what} of rank {f.rank} ---", body]
        said = last_words(f)
        if said:
            lines += ["", f"--- last output of rank {f.rank} ---", *said]
        if len(self.failures) > 1:
            lines += ["", "Other ranks stopped after the root cause:"]
            lines += [f"  {o.summary()}" for o in self.failures[1:]]
        if self.verdict:
            lines += ["", "Where each rank was in its collectives:", *(f"  {line}" for line in self.verdict.summary)]
        if self.earlier:
            lines += ["", f"Every attempt failed ({len(self.attempts)} in all; each failure restarted the job):"]
            lines += [
                f"  attempt {n}: {cause.summary() if cause else 'failed'}"
                for n, cause in enumerate(self.attempts, start=1)
            ]
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
    return "\n".join(f'  File "{f.filename}", line {f.line}, in {f.function}' for f in reversed(thread.job_frames()))


def grouped_where(stacks: Dict[int, Stacks], ranks) -> List[str]:
    """One line per distinct innermost place (``Stacks.where``) of ``ranks``: ranks in the same
    place on one line, however many they are."""
    by_place: Dict[str, List[int]] = {}
    for r in ranks:
        by_place.setdefault(stacks[r].where() if r in stacks else "no stack came back", []).append(r)
    return [f"  {rank_list(rs)}: {place}" for place, rs in sorted(by_place.items(), key=lambda kv: kv[1][0])]


class _WithStacks(_PlainRender):
    """An error that shows where every rank was: each rank's main-thread stack below the message;
    with a verdict (``culprit``), the suspects' stacks only, the other ranks grouped by where
    they were.  ``stacks``: rank -> ``events.Stacks`` (every thread), as captured before the
    ranks were stopped; ``headline``: the message's first sentence; ``verdict``: what the ranks'
    collective records say (``None``: not compared), ``suspects`` its ranks."""

    stacks: Dict[int, Stacks]
    headline: str
    verdict: Optional[Verdict] = None

    @property
    def suspects(self) -> Tuple[int, ...]:
        return self.verdict.suspects if self.verdict else ()

    def _render_traceback_(self) -> List[str]:
        lines = super()._render_traceback_()
        shown = [r for r in self.suspects if r in self.stacks][:SHOWN_SUSPECTS] if self.verdict else sorted(self.stacks)
        for rank in shown:
            lines += [
                "",
                f"--- rank {rank}, main thread (most recent call last) ---",
                *stack_text(self.stacks[rank]).splitlines(),
            ]
        return lines

    def _where(self, num_processes: int) -> List[str]:
        """Where each rank was: one line per rank, or with a verdict the suspects' lines, then
        the others grouped, then their collective states."""
        if not self.verdict:
            return where_ranks_were(self.stacks, num_processes)
        ranks = range(num_processes) if num_processes else sorted(self.stacks)
        shown = self.suspects[:SHOWN_SUSPECTS]
        others = [r for r in ranks if r not in shown]
        return (
            where_ranks_were({r: self.stacks[r] for r in shown if r in self.stacks})
            + grouped_where(self.stacks, others)
            + ["Where each rank was in its collectives:"]
            + [f"  {line}" for line in self.verdict.summary]
        )


class JobTimeout(_WithStacks, TimeoutError):
    """The run passed its ``timeout``; every rank was stopped.  ``stacks`` are every rank's
    stacks at that moment (empty when none were captured).

    Example:

    ```python
    from torchdist_magic import Distributor, JobTimeout

    try:
        Distributor(num_processes=2, timeout=600).run(train)
    except JobTimeout as timeout:
        print(sorted(timeout.stacks))   # the ranks whose stacks were captured when it stopped
    ```
    """

    def __init__(
        self,
        seconds: float,
        state_summary: str = "",
        stacks: Optional[Dict[int, Stacks]] = None,
        num_processes: int = 0,
        verdict: Optional[Verdict] = None,
    ):
        self.seconds = seconds
        self.state_summary = state_summary
        self.stacks = dict(stacks or {})
        self.num_processes = num_processes
        self.verdict = verdict
        self.headline = text = f"distributed run timed out after {seconds:g} s; every rank was stopped"
        if verdict:
            self.headline = text = f"{_capitalized(verdict.sentence)}. {_capitalized(self.headline)}"
        if state_summary:
            text += f"\n{state_summary}"
        if self.stacks:
            text += "\nWhere each rank was (innermost frame first):\n" + "\n".join(self._where(num_processes))
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.seconds, self.state_summary, self.stacks, self.num_processes, self.verdict))


class HangTimeout(_WithStacks, TimeoutError):
    """No rank sent progress, metrics or output for ``hang_timeout`` seconds: every rank's
    stacks were captured (``stacks``), then every rank was stopped.  The message names each
    rank's innermost frames.

    Example:

    ```python
    from torchdist_magic import Distributor, HangTimeout

    try:
        Distributor(num_processes=2, hang_timeout=300).run(train)   # %%torchdist --hang-timeout 300
    except HangTimeout as hang:
        print(hang)   # where each rank was when nothing moved for 300 s
    ```
    """

    def __init__(
        self,
        seconds: float,
        stacks: Dict[int, Stacks],
        num_processes: int,
        hint: str = "",
        verdict: Optional[Verdict] = None,
    ):
        self.seconds = seconds
        self.stacks = dict(stacks)
        self.num_processes = num_processes
        self.hint = hint  # what probably hung it (a collective in a cell on some ranks)
        self.verdict = verdict
        self.headline = (
            f"no rank sent progress, metrics or output for {seconds:g} s (hang_timeout); every rank was stopped"
        )
        if verdict:
            self.headline = f"{_capitalized(verdict.sentence)}. {_capitalized(self.headline)}"
        if hint:
            self.headline += f". {_capitalized(hint)}"
        super().__init__(
            f"{self.headline}. Where each rank was (innermost frame first):\n" + "\n".join(self._where(num_processes))
        )

    def __reduce__(self):
        return (type(self), (self.seconds, self.stacks, self.num_processes, self.hint, self.verdict))


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


class ResultTimeout(_PlainRender, TimeoutError):
    """``Run.result(timeout)`` waited ``seconds`` and the run had not ended: it keeps running
    (``Run.cancel()`` stops it).  Unlike ``JobTimeout``, nothing was stopped.

    Example:

    ```python
    from torchdist_magic import Distributor, ResultTimeout

    run = Distributor(num_processes=2).submit(train)
    try:
        value = run.result(timeout=5)
    except ResultTimeout:
        print("still running:", not run.done())   # it goes on; run.cancel() would stop it
    ```
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        super().__init__(
            f"the run is still going after waiting {seconds:g} s (it keeps running; call cancel() to stop it)"
        )

    def __reduce__(self):
        return (type(self), (self.seconds,))


class RunCancelled(_PlainRender, RuntimeError):
    """The run was cancelled (``Run.cancel()`` or the Stop button); every rank was stopped.

    Example:

    ```python
    from torchdist_magic import Distributor, RunCancelled

    run = Distributor(num_processes=2).submit(train)
    run.cancel()
    try:
        run.result()
    except RunCancelled:
        print("stopped, no rank left")
    ```
    """


class NotAvailable(_PlainRender, ValueError):
    """What a run handle cannot do where it is (``RunHandle``): e.g. profiling a run from a
    kernel attached to it (only its supervising process reaches the ranks), or profiling a warm
    pool's run.  Every handle answers each of the protocol's features, with a value, ``None``,
    or this error; never ``AttributeError``.

    Example:

    ```python
    from torchdist_magic import NotAvailable, attach

    run = attach("3-1a2b3c4d")
    try:
        run.start_profile(5)
    except NotAvailable as exc:
        print(exc)   # a detached run is profiled from its start only (--profile STEPS)
    ```
    """
