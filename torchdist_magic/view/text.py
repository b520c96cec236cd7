"""Text renderer of a RunState: what a terminal, CI and a frontend without widgets see.

Output lines are printed as they arrive, prefixed ``[rank N]``; ``\\r``-terminated progress
lines are collapsed to their latest state; progress from ``progress()`` and tqdm is summarised
per rank at a bounded rate; a restart is announced with the failure that caused it; a summary
table ends the run (with where each rank was, when a hang or a timeout stopped it).  ``summary_with_logs`` adds each
rank's last lines: the ``text/plain`` a notebook keeps of a widget view.
"""

from __future__ import annotations

import sys
import time
from typing import List, Optional, TextIO

from ..state import LogLine, RankState, RunState
from .model import format_duration, metrics_text, progress_text, rank_logs, rank_stacks, run_facts

PROGRESS_EVERY = 5.0   # seconds between progress summaries
CR_EVERY = 5.0         # seconds between showings of a rank's \r-progress line
SUMMARY_LOG_LINES = 5  # of each rank in ``summary_with_logs``
SUMMARY_LINE_CHARS = 300  # longer lines are cut there


def rank_progress_text(rs: RankState) -> str:
    """Every bar a rank shows, outer loop first: ``epoch 1/3 [...] · batch 8/10 [...]``."""
    return " · ".join(progress_text(bar) for bar in rs.shown_progress())


def header(state: RunState) -> str:
    gpu = ", gpu" if state.use_gpu else ""
    name = f" {state.job_name}" if state.job_name else ""
    return f"torchdist: run{name} on {state.backend}, np={state.num_processes}{gpu}"


def summary(state: RunState) -> str:
    """The final table: one row per rank, then the outcome (each attempt's root cause when the
    run restarted; where each rank was after a hang or a timeout)."""
    facts = run_facts(state)
    attempt = f", {facts.attempt_text}" if facts.attempt_text else ""
    rows: List[str] = [f"torchdist: {state.state} after {format_duration(state.elapsed())}"
                       f" ({state.elapsed():.1f} s), np={state.num_processes} on {state.backend}{attempt}"]
    for rs in state.ranks:
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
        rows.append("  ".join(bits))
    rows += [f"  {line} (restarted)" for line in facts.earlier]
    if facts.outcome:
        rows.append(f"  {facts.outcome}")
    stacks = rank_stacks(state)
    if stacks:
        rows.append("  where each rank was (innermost frame first):")
        rows += [f"    rank {item.rank}: {item.where}" for item in stacks]
    return "\n".join(rows)


def summary_with_logs(state: RunState, log_hint: Optional[str] = None, lines: int = SUMMARY_LOG_LINES) -> str:
    """``summary`` then each rank's last ``lines`` lines: the ``text/plain`` a notebook keeps of
    a widget view, for readers without a kernel or without HTML.  ``log_hint`` names where the
    full logs are (``_torchdist_run.logs(rank)``)."""
    out = [summary(state), "last lines of each rank" + (f" (full logs: {log_hint})" if log_hint else "") + ":"]
    for log in rank_logs(state, lines):
        texts = [line.text for line in log.lines] or ["(no output)"]
        out += [f"  [rank {log.rank}] " + (text if len(text) <= SUMMARY_LINE_CHARS else text[:SUMMARY_LINE_CHARS] + " …")
                for text in texts]
    return "\n".join(out)


class TextView:
    """Prints a run as it goes; call ``update()`` from the thread that owns the output.  ``out``
    and ``err`` default to ``sys.stdout``/``sys.stderr`` as they are when printing (so that a
    notebook or pytest capturing them gets the lines)."""

    def __init__(self, state: RunState, out: Optional[TextIO] = None, err: Optional[TextIO] = None):
        self.state = state
        self.out = out
        self.err = err
        self._cursor = [0] * state.num_processes
        self._trailing: List[Optional[LogLine]] = [None] * state.num_processes  # the \r-line read last
        self._attempt = state.attempt
        self._pending_cr: List[Optional[str]] = [None] * state.num_processes
        self._cr_shown = [0.0] * state.num_processes
        self._progress_shown = 0.0
        self._progress_seen = [None] * state.num_processes
        self._closed = False
        self._print(header(state))

    def _print(self, text: str, stream: str = "stdout") -> None:
        target = (self.err or sys.stderr) if stream == "stderr" else (self.out or sys.stdout)
        print(text, file=target, flush=True)

    def update(self) -> None:
        now = time.monotonic()
        self._announce_restart()
        for rs in self.state.ranks:
            self._drain_logs(rs, now)
        if now - self._progress_shown >= PROGRESS_EVERY:
            self._progress_shown = now
            self._show_progress()

    def _announce_restart(self) -> None:
        attempts = self.state.attempts
        while self._attempt < self.state.attempt and self._attempt <= len(attempts):
            ended = attempts[self._attempt - 1]
            cause = ended.failure.summary() if ended.failure else "a rank failed"
            self._attempt += 1
            self._print(f"torchdist: attempt {ended.number} failed ({cause}); restarting: attempt "
                        f"{self._attempt} of {self.state.max_attempts}")

    def _drain_logs(self, rs: RankState, now: float) -> None:
        r = rs.rank
        start = self._cursor[r]
        new = rs.logs[start:]
        if new and new[0] is self._trailing[r]:  # read last time, and not replaced since
            new, start = new[1:], start + 1
        if new:
            # a trailing \r-line may still be replaced by the log: read its place again next time
            self._trailing[r] = new[-1] if new[-1].cr else None
            self._cursor[r] = start + len(new) - (1 if self._trailing[r] is not None else 0)
        for line in new:
            if line.cr:
                self._pending_cr[r] = line.text
                continue
            self._pending_cr[r] = None
            self._print(f"[rank {r}] {line.text}", line.stream)
        if self._pending_cr[r] is not None and now - self._cr_shown[r] >= CR_EVERY:
            self._flush_cr(r)

    def _flush_cr(self, r: int) -> None:
        if self._pending_cr[r] is not None:
            self._print(f"[rank {r}] {self._pending_cr[r]}", "stderr")
            self._pending_cr[r] = None
            self._cr_shown[r] = time.monotonic()

    def _show_progress(self) -> None:
        for rs in self.state.ranks:
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
        now = time.monotonic()
        self._announce_restart()
        for rs in self.state.ranks:
            self._drain_logs(rs, now)
            self._flush_cr(rs.rank)
        self._print(summary(self.state))
