"""Text renderer of a RunState: what a terminal, CI and a frontend without widgets see.

Output lines are printed as they arrive, prefixed ``[rank N]``; ``\\r``-terminated progress
lines are collapsed to their latest state; progress from ``progress()`` and tqdm is summarised
per rank at a bounded rate; a restart is announced with the failure that caused it; a summary
table ends the run (with where each rank was, when a hang or a timeout stopped it).  ``summary_with_logs`` adds each
rank's last lines: the ``text/plain`` a notebook keeps of a widget view.

On a terminal (``out`` is a TTY, ``TERM`` not ``dumb``) the progress is a live block under the
output instead: a line per rank (a large run: its one-line ``status``), redrawn in place at each
update, each line cut to the terminal's width so that the redraw knows how many lines to go back.
Piped, the same view prints plain lines, as before.

Like the widget, it reads the run through the view model (``model``: one snapshot per update,
a ``LogCursor`` for the lines): one meter, several renderers.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import List, Optional, TextIO, Tuple, Union

from ..driver.goodput import describe as describe_goodput, says_something
from ..driver.snapshot import RunSnapshot
from ..driver.state import RunState
from .model import (
    State,
    format_duration,
    metrics_text,
    rank_log,
    rank_logs,
    rank_progress_text,
    system_text,
    rank_stacks,
    run_facts,
    snapshot,
)
from ..driver.merged import LogCursor
from ..driver.summary import LOOK_RANKS, LargeView, large_view, overview
from .overview import is_large

PROGRESS_EVERY = 5.0  # seconds between progress summaries
CR_EVERY = 5.0  # seconds between showings of a rank's \r-progress line
SUMMARY_LOG_LINES = 5  # of each rank in ``summary_with_logs``
SUMMARY_LINE_CHARS = 300  # longer lines are cut there
READ_LINES = 2000  # of a rank's log read at once: the state's lock is never held for long
FOLLOW_BACKLOG = 20  # lines of a large run's rank printed from before it failed or straggled
STACK_GROUPS = 5  # of a large run's stacks: the most common places, with their ranks

__all__ = ["TextView", "header", "rank_progress_text", "summary", "summary_with_logs"]


def header(state: State) -> str:
    facts = run_facts(state)
    gpu = ", gpu" if facts.use_gpu else ""
    name = f" {facts.job_name}" if facts.job_name else ""
    line = f"torchdist: run{name} on {facts.backend}, np={facts.num_processes}{gpu}"
    return f"{line}\ntorchdist: {facts.tracking_text}" if facts.tracking_text else line


def _rank_line(rs) -> str:
    bits = [f"  rank {rs.rank}", rs.state]
    if rs.host:
        bits.append(f"host={rs.host}")
    if rs.exit_code is not None:
        bits.append(f"exit={rs.exit_code}")
    p = rank_progress_text(rs)
    if p:
        bits.append(p)
    if rs.metrics:
        bits.append(metrics_text(rs.metrics))
    system = system_text(rs)
    if system:
        bits.append(system)
    return "  ".join(bits)


def _ranks_text(ranks: List[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def status(state: Union[State, LargeView]) -> str:
    """A large run in one line: elapsed, ranks by state and hosts, each bar across ranks, the
    stragglers."""
    view = state if isinstance(state, LargeView) else large_view(snapshot(state))
    snap, ov = view.snap, view.overview
    parts = [f"torchdist: {format_duration(snap.elapsed())}", ov.counts_text]
    parts += [f"{bar.desc or 'progress'} {bar.text}" for bar in ov.bars]
    parts += [item.text for item in ov.system if item.key in ("rss_bytes", "step_time")]
    if snap.stragglers:
        parts.append("stragglers: " + _ranks_text([s.rank for s in snap.stragglers]))
    return " · ".join(parts)


def summary(state: State) -> str:
    """The final table: one row per rank, then the outcome (each attempt's root cause when the
    run restarted; where each rank was after a hang or a timeout; a state's profile, which a
    snapshot does not carry).  A large run: its counts, its bars across ranks and the ranks worth
    a look, with why."""
    snap = snapshot(state)
    facts = run_facts(snap)
    attempt = f", {facts.attempt_text}" if facts.attempt_text else ""
    rows: List[str] = [
        f"torchdist: {facts.state} after {format_duration(facts.elapsed)}"
        f" ({facts.elapsed:.1f} s), np={facts.num_processes} on {facts.backend}{attempt}"
    ]
    large = is_large(snap.num_processes)
    if large:
        ov = overview(snap)
        rows.append(f"  {ov.counts_text}")
        rows += [f"  {bar.desc or 'progress'}: {bar.text}" for bar in ov.bars]
        rows += [f"  {item.text}" for item in ov.system]
        if ov.look:
            rows.append("  worth a look:")
            for look in ov.look:
                rows += [f"  {_rank_line(snap.ranks[look.rank])}", f"      {look.why}"]
    else:
        rows += [_rank_line(rs) for rs in snap.ranks]
        rows += [f"  straggler: rank {s.rank} ({s.why})" for s in snap.stragglers]
    rows += [f"  {line}" for line in facts.preflight]
    if facts.culprit:
        rows.append(f"  culprit: {facts.culprit}")
    rows += [f"  {line} (restarted)" for line in facts.earlier]
    rows += [f"  {line}" for line in facts.excluded]
    if facts.refused_text:
        rows.append(f"  {facts.refused_text}")
    if facts.outcome:
        rows.append(f"  {facts.outcome}")
    if snap.finished and snap.goodput and says_something(snap.goodput):
        rows.append(f"  goodput: {describe_goodput(snap.goodput)}")
    profile = None if isinstance(state, RunSnapshot) else state.profile()
    if profile is not None:
        rows += [f"  {line}" for line in profile.lines()]
    stacks = rank_stacks(snap)
    if stacks:
        rows.append("  where each rank was (innermost frame first):")
        if large:  # the same place for most ranks: grouped
            places: dict = {}
            for item in stacks:
                places.setdefault(item.where, []).append(item.rank)
            groups = sorted(places.items(), key=lambda kv: -len(kv[1]))
            rows += [f"    ranks {_ranks_text(ranks)}: {where}" for where, ranks in groups[:STACK_GROUPS]]
            if len(groups) > STACK_GROUPS:
                rows.append(f"    … {len(groups) - STACK_GROUPS} more places")
        else:
            rows += [f"    rank {item.rank}: {item.where}" for item in stacks]
    return "\n".join(rows)


def summary_with_logs(state: RunState, log_hint: Optional[str] = None, lines: int = SUMMARY_LOG_LINES) -> str:
    """``summary`` then each rank's last ``lines`` lines (a large run: rank 0's and those of the
    ranks worth a look): the ``text/plain`` a notebook keeps of a widget view, for readers
    without a kernel or without HTML.  ``log_hint`` names where the full logs are
    (``_torchdist_run.logs(rank)``)."""
    snap = snapshot(state)
    if is_large(snap.num_processes):
        chosen = list(dict.fromkeys([0] + [look.rank for look in overview(snap).look]))[: LOOK_RANKS + 1]
        logs = [rank_log(state, r, lines) for r in chosen]
        title = "last lines of rank 0 and of the ranks worth a look"
    else:
        logs = rank_logs(state, lines)
        title = "last lines of each rank"
    out = [summary(snap), title + (f" (full logs: {log_hint})" if log_hint else "") + ":"]
    for log in logs:
        texts = [line.text for line in log.lines] or ["(no output)"]
        out += [
            f"  [rank {log.rank}] " + (text if len(text) <= SUMMARY_LINE_CHARS else text[:SUMMARY_LINE_CHARS] + " …")
            for text in texts
        ]
    return "\n".join(out)


class TextView:
    """Prints a run as it goes; call ``update()`` from the thread that owns the output.  ``out``
    and ``err`` default to ``sys.stdout``/``sys.stderr`` as they are when printing (so that a
    notebook or pytest capturing them gets the lines)."""

    def __init__(
        self, state: RunState, out: Optional[TextIO] = None, err: Optional[TextIO] = None, live: Optional[bool] = None
    ):
        self.state = state
        self.out = out
        self.err = err
        #: a live block redrawn in place (``None``: when ``out`` is a terminal)
        self.live = is_terminal(out or sys.stdout) if live is None else live
        self._block = 0  # lines of the live block on the screen now
        self._drawn = ""  # and their text
        snap = state.snapshot()
        self._seen = -1  # the state's version at the last update
        self._logs = LogCursor(snap.num_processes)
        self._attempt = snap.attempt
        self._pending_cr: List[Optional[str]] = [None] * snap.num_processes
        self._cr_shown = [0.0] * snap.num_processes
        self._progress_shown = 0.0
        self._progress_seen = [None] * snap.num_processes
        self.large = is_large(snap.num_processes)
        self._followed = {0}  # a large run's ranks whose lines are printed
        self._closed = False
        self._print(header(snap))

    def _print(self, text: str, stream: str = "stdout") -> None:
        self._erase()
        target = (self.err or sys.stderr) if stream == "stderr" else (self.out or sys.stdout)
        print(text, file=target, flush=True)

    def _erase(self) -> None:
        """Take the live block off the screen (the cursor back to where it began)."""
        if self._block:
            (self.out or sys.stdout).write(f"\x1b[{self._block}F\x1b[J")
            self._block = 0

    def _draw(self, view: Optional[LargeView], snap: RunSnapshot) -> None:
        """The live block: a line per rank, or a large run's one line, cut to the width."""
        lines = [status(view)] if view is not None else [_rank_line(rs).strip() for rs in snap.ranks]
        width = max(shutil.get_terminal_size().columns - 1, 20)
        text = "".join(line[:width] + "\n" for line in lines)
        if self._block and text == self._drawn:
            return  # nothing new: no redraw, no flicker
        out = self.out or sys.stdout
        self._erase()
        out.write(text)
        out.flush()
        self._block, self._drawn = len(lines), text

    def update(self) -> None:
        now = time.monotonic()
        view, snap = self._moment()
        self._announce_restart(snap)
        changed = snap.changed
        if view is not None:
            changed = changed & self._follow(view)
        for r in sorted(changed):
            self._drain_logs(r)
        self._show_pending_cr(now)
        if self.live:
            self._draw(view, snap)
            return
        if now - self._progress_shown >= PROGRESS_EVERY:
            self._progress_shown = now
            if view is not None:
                self._print(status(view))
            else:
                self._show_progress(snap)

    def _moment(self) -> Tuple[Optional[LargeView], RunSnapshot]:
        """The run now, changes since the last look (a large run: its overview and the few ranks
        it shows too, worked out where the state is; None otherwise), and its snapshot."""
        view = self.state.large_view(self._seen) if self.large else None
        snap = view.snap if view is not None else self.state.snapshot(self._seen)
        self._seen = snap.version
        return view, snap

    def _follow(self, view: LargeView) -> set:
        """A large run's ranks to print: rank 0, and each rank that failed or straggles, from its
        last ``FOLLOW_BACKLOG`` lines when it starts being followed."""
        failed = {failure.rank for failure in view.failures}
        wanted = failed | {s.rank for s in view.snap.stragglers}
        for r in sorted(wanted - self._followed):
            self._followed.add(r)
            skipped = self._logs.skip(self.state, r, FOLLOW_BACKLOG)
            why = "failed" if r in failed else "straggles"
            more = f"; {skipped} earlier lines in logs({r})" if skipped else ""
            self._print(f"torchdist: rank {r} {why}: its lines follow{more}")
        return self._followed

    def _announce_restart(self, snap: RunSnapshot) -> None:
        while self._attempt < snap.attempt and self._attempt <= len(snap.attempts):
            ended = snap.attempts[self._attempt - 1]
            cause = ended.failure.summary() if ended.failure else "a rank failed"
            self._attempt += 1
            self._print(
                f"torchdist: attempt {ended.number} failed ({cause}); restarting: attempt "
                f"{self._attempt} of {snap.max_attempts}"
            )

    def _drain_logs(self, r: int) -> None:
        """Print ``r``'s new finished lines; keep its newest \\r-line for ``_show_pending_cr``."""
        while True:
            for line in self._logs.read(self.state, r, READ_LINES):
                if line.cr:
                    self._pending_cr[r] = line.text
                    continue
                self._pending_cr[r] = None
                self._print(f"[rank {r}] {line.text}", line.stream)
            if not self._logs.unread[r]:
                return

    def _show_pending_cr(self, now: float) -> None:
        for r, text in enumerate(self._pending_cr):
            if text is not None and now - self._cr_shown[r] >= CR_EVERY:
                self._flush_cr(r)

    def _flush_cr(self, r: int) -> None:
        if self._pending_cr[r] is not None:
            self._print(f"[rank {r}] {self._pending_cr[r]}", "stderr")
            self._pending_cr[r] = None
            self._cr_shown[r] = time.monotonic()

    def _show_progress(self, snap: RunSnapshot) -> None:
        for rs in snap.ranks:
            text = rank_progress_text(rs)
            if rs.metrics:
                text = f"{text}  {metrics_text(rs.metrics)}".strip()
            if text and text != self._progress_seen[rs.rank]:
                self._progress_seen[rs.rank] = text
                self._print(f"[rank {rs.rank}] {text}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        view, snap = self._moment()
        self._announce_restart(snap)
        for r in sorted(self._follow(view)) if view is not None else range(snap.num_processes):
            self._drain_logs(r)
            self._flush_cr(r)
        self._print(summary(self.state))


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal that takes cursor movements (not ``TERM=dumb``)."""
    try:
        return stream.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
