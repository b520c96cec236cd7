"""Text renderer of a RunState: what a terminal, CI and a frontend without widgets see.

Output lines are printed as they arrive, prefixed ``[rank N]``; ``\\r``-terminated progress
lines (tqdm) are collapsed to their latest state; progress from ``progress()`` is summarised
per rank at a bounded rate; a summary table ends the run.
"""

from __future__ import annotations

import sys
import time
from typing import List, Optional, TextIO

from ..state import RankState, RunState

PROGRESS_EVERY = 5.0   # seconds between progress summaries
CR_EVERY = 5.0         # seconds between showings of a rank's \r-progress line


def format_duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def progress_text(bar: Optional[dict]) -> str:
    """``epoch 2/3 [00:04<00:02, 0.52 it/s]``, as tqdm writes it."""
    if not bar:
        return ""
    n, total, elapsed = bar.get("n") or 0, bar.get("total"), bar.get("elapsed") or 0.0
    rate = n / elapsed if elapsed > 0 else None
    desc = f"{bar['desc']} " if bar.get("desc") else ""
    if total:
        eta = (total - n) / rate if rate else None
        timing = f"{format_duration(elapsed)}<{format_duration(eta)}"
        head = f"{desc}{n}/{total} ({100 * n // total}%)"
    else:
        timing = format_duration(elapsed)
        head = f"{desc}{n}"
    rate_text = f", {rate:.2f} it/s" if rate else ""
    return f"{head} [{timing}{rate_text}]"


def rank_progress_text(rs: RankState) -> str:
    """Every bar a rank shows, outer loop first: ``epoch 1/3 [...] · batch 8/10 [...]``."""
    return " · ".join(progress_text(bar) for bar in rs.shown_progress())


def metrics_text(metrics: dict) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def header(state: RunState) -> str:
    gpu = ", gpu" if state.use_gpu else ""
    name = f" {state.job_name}" if state.job_name else ""
    return f"torchdist: run{name} on {state.backend}, np={state.num_processes}{gpu}"


def summary(state: RunState) -> str:
    """The final table: one row per rank, then the outcome."""
    rows: List[str] = [f"torchdist: {state.state} after {format_duration(state.elapsed())}"
                       f" ({state.elapsed():.1f} s), np={state.num_processes} on {state.backend}"]
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
    if state.failure is not None:
        rows.append(f"  root cause: {state.failure.summary()}")
    return "\n".join(rows)


class TextView:
    """Prints a run as it goes; call ``update()`` from the thread that owns the output."""

    def __init__(self, state: RunState, out: Optional[TextIO] = None, err: Optional[TextIO] = None,
                 show_header: bool = True):
        self.state = state
        self.out = out
        self.err = err
        self._cursor = [0] * state.num_processes
        self._pending_cr: List[Optional[str]] = [None] * state.num_processes
        self._cr_shown = [0.0] * state.num_processes
        self._progress_shown = 0.0
        self._progress_seen = [None] * state.num_processes
        self._closed = False
        if show_header:
            self._print(header(state))

    def _print(self, text: str, stream: str = "stdout") -> None:
        target = (self.err or sys.stderr) if stream == "stderr" else (self.out or sys.stdout)
        print(text, file=target, flush=True)

    def update(self) -> None:
        now = time.monotonic()
        for rs in self.state.ranks:
            self._drain_logs(rs, now)
        if now - self._progress_shown >= PROGRESS_EVERY:
            self._progress_shown = now
            self._show_progress()

    def _drain_logs(self, rs: RankState, now: float) -> None:
        r = rs.rank
        new = rs.logs[self._cursor[r]:]
        self._cursor[r] += len(new)
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
        for rs in self.state.ranks:
            self._drain_logs(rs, now)
            self._flush_cr(rs.rank)
        self._print(summary(self.state))
