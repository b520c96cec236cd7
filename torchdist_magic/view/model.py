"""The view model: what a run view shows, computed from a ``RunState``.

Pure functions and plain records, no ipywidgets and no IPython, so that every renderer (text,
HTML, the live widget) shows the same facts and tests read them without a kernel:

- ``run_facts``: the header (state, job, backend, np, gpu, elapsed, attempt) and the outcome
  line, with the root cause of each earlier attempt of a run that restarted;
- ``rank_rows``: one row per rank (host, state, bars, metrics, exit code, dropped events);
- ``rank_stacks``: where each rank was when a hang or a timeout stopped it (every thread);
- ``metric_series``: each metric against step, one line per rank, thinned for plotting;
- ``system_text``, ``system_series``: each rank's CPU, memory, GPU and step time, and their
  samples against time;
- ``rank_log`` / ``rank_logs``: a rank's last lines as a terminal would show them;
(Each rank's new lines, ``LogCursor``, and all ranks' lines merged in arrival order with every
rank's errors and warnings, ``MergedLog``, are ``driver.merged``'s: a run's supervising process
keeps a kernel's merged log.)

A run of many ranks is summarised by ``overview`` from the same snapshots.

Each reader takes what it needs through the ``RunState``'s own methods (``snapshot``,
``read_log``, ``recent_log``, ``metric_history``), which copy under its lock, so it may run in
any thread while events arrive.  The functions that take a ``state`` also take a
``RunSnapshot``: a renderer that draws several parts from one snapshot shows one moment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

from ..core.formats import format_bytes, format_duration, format_step_time
from ..core.names import ROWS_BAR
from ..core.preflight import compare
from ..driver.logstore import LogLine
from ..driver.snapshot import RankSnapshot, RunSnapshot
from ..driver.state import RankState, RunState

LOG_LINES = 300  # lines of a log pane; the complete logs stay on the run's ``logs(rank)``
LOG_SCAN = 20_000  # lines looked at from the end of a rank's log to fill a pane
PLOT_POINTS = 400  # points per line in a plot; longer histories are thinned


#: run states after which nothing more happens but a message says why
STOPPED_STATES = ("failed", "timed out", "hung", "cancelled")
#: bar style of a rank (ipywidgets' ``bar_style`` names) by rank state
BAR_STYLES = {"starting": "info", "running": "info", "done": "success", "failed": "danger", "cancelled": "warning"}

Series = Dict[int, List[Tuple[int, float]]]  # {rank: [(step, value), ...]}
Rank = Union[RankState, RankSnapshot]
State = Union[RunState, RunSnapshot]


def snapshot(state: State) -> RunSnapshot:
    """``state`` as one consistent copy (a snapshot is returned as it is)."""
    return state if isinstance(state, RunSnapshot) else state.snapshot()


# -- text shared by every renderer (as tqdm shares ``format_meter``) ---------------------------
def progress_text(bar: Optional[dict]) -> str:
    """``epoch 2/3 (66%) [00:04<00:02, 0.52 it/s, loss=0.3]``, as tqdm writes it (the postfix
    of a tqdm bar last)."""
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
    if bar.get("desc") == ROWS_BAR:  # a rank's rows of a DataFrame (torchdist_magic.shard)
        rate_text = f", {rate:,.0f} rows/s" if rate else ""
    else:
        rate_text = f", {rate:.2f} it/s" if rate else ""
    postfix = f", {bar['postfix']}" if bar.get("postfix") else ""
    return f"{head} [{timing}{rate_text}{postfix}]"


def metrics_text(metrics: dict) -> str:
    """``loss=0.31 acc=0.9``"""
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def system_text(rs: Rank) -> str:
    """A rank's machine and pace, as its row shows them: ``cpu 153% · rss 1.21 GiB · gpu 3.2/16 GiB
    87% · 120 ms/step · data 62% compute 35% comm 3%`` (what is known of it)."""
    system, parts = rs.system, []
    if "cpu_percent" in system:
        parts.append(f"cpu {system['cpu_percent']:.0f}%")
    if "rss_bytes" in system:
        parts.append(f"rss {format_bytes(system['rss_bytes'])}")
    if "gpu_memory_used_bytes" in system:
        gpu = f"gpu {format_bytes(system['gpu_memory_used_bytes'])}"
        if system.get("gpu_memory_total_bytes"):
            gpu += f"/{format_bytes(system['gpu_memory_total_bytes'])}"
        if "gpu_util_percent" in system:
            gpu += f" {system['gpu_util_percent']:.0f}%"
        parts.append(gpu)
    if rs.step_time is not None:
        parts.append(format_step_time(rs.step_time))
    if rs.step_split:
        parts.append(format_step_split(rs.step_split))
    return " · ".join(parts)


def format_step_split(split: dict) -> str:
    """``data 62% compute 35% comm 3%``: where a rank's recent steps went (``stepsplit``)."""
    return " ".join(f"{name} {split.get(name, 0.0) * 100:.0f}%" for name in ("data", "compute", "comm"))


def rank_progress_text(rs: Rank) -> str:
    """Every bar a rank shows, outer loop first: ``epoch 1/3 [...] · batch 8/10 [...]``."""
    return " · ".join(progress_text(bar) for bar in rs.shown_progress())


# -- the header -----------------------------------------------------------------------------------
@dataclass
class RunFacts:
    """The run as a whole, as the header shows it."""

    run_id: str
    state: str  # starting, running, succeeded, failed, cancelled, timed out
    job_name: str
    backend: str
    num_processes: int
    use_gpu: bool
    elapsed: float  # seconds
    finished: bool
    outcome: str  # "root cause: rank 1 raised ...", or why it stopped; "" else
    attempt: int = 1  # the current attempt, of ``max_attempts`` (1 + max_restarts)
    max_attempts: int = 1
    earlier: List[str] = field(default_factory=list)  # "attempt 1: rank 1 was killed by SIGKILL"
    #: the hosts the restarts left out, and why ("executor 2 on vm left out after attempt 1: ...")
    excluded: List[str] = field(default_factory=list)
    tracking_url: str = ""  # the page of the run's MLflow run, when its server has a UI
    tracking_text: str = ""  # "MLflow run <id>: <page, or where it is>"; "" when not tracked
    refused_text: str = ""  # what the run's channel refused, "" when nothing
    #: which rank held the others up, from their collective records ("rank 2 is behind: ...");
    #: "" when they were not compared or point at no rank (``culprit``)
    culprit: str = ""
    #: the pre-flight check's figures and warnings (``--preflight``), one line each; [] without one
    preflight: List[str] = field(default_factory=list)

    @property
    def attempt_text(self) -> str:
        """``attempt 2 of 3``, for a run that may restart; empty otherwise."""
        return f"attempt {self.attempt} of {self.max_attempts}" if self.max_attempts > 1 else ""


def run_facts(state: State) -> RunFacts:
    snap = snapshot(state)
    if snap.failure is not None:
        outcome = f"root cause: {snap.failure.summary()}"
        if snap.message:  # why a run with restarts left did not restart (``restarts``)
            outcome += f"; {snap.message}"
    elif snap.state in STOPPED_STATES:
        outcome = snap.message
    else:
        outcome = ""
    earlier = [
        f"attempt {a.number}: {a.failure.summary() if a.failure else 'failed'}"
        + (f" [{a.fault.kind} fault, {a.world_size} ranks]" if a.fault else "")
        for a in snap.attempts
    ]
    return RunFacts(
        run_id=snap.run_id,
        state=snap.state,
        job_name=snap.job_name,
        backend=snap.backend,
        num_processes=snap.num_processes,
        use_gpu=snap.use_gpu,
        elapsed=snap.elapsed(),
        finished=snap.finished,
        outcome=outcome,
        attempt=snap.attempt,
        max_attempts=snap.max_attempts,
        earlier=earlier,
        excluded=[e.sentence() for e in snap.excluded],
        tracking_url=snap.tracking.url if snap.tracking is not None else "",
        tracking_text=snap.tracking.text() if snap.tracking is not None else "",
        refused_text=refused_text(snap),
        culprit=snap.verdict.sentence if snap.verdict else "",
        preflight=_preflight_lines(snap),
    )


def _preflight_lines(snap: RunSnapshot) -> List[str]:
    if not snap.preflight:
        return []
    result = compare(list(snap.preflight.values()))
    return [*result.lines, *result.warnings]


def refused_text(snap) -> str:
    """``the run's channel refused ...`` for each kind of record it refused; "" when none."""
    if not snap.refusals:
        return ""
    total = sum(r.count for r in snap.refusals)
    return f"the run's channel refused {total} record{'s' if total > 1 else ''}: " + "; ".join(
        r.text() for r in snap.refusals
    )


# -- one row per rank -----------------------------------------------------------------------------
@dataclass
class BarView:
    """One progress bar, as shown."""

    desc: str
    n: int
    total: Optional[int]
    fraction: Optional[float]  # 0..1 of the bar that is filled; None: no total known
    text: str  # tqdm-like "2/3 [00:04<00:02, 0.52 it/s]" (desc and % apart)
    title: str  # all of it: "epoch 2/3 (66%) [00:04<00:02, 0.52 it/s]"


@dataclass
class RankRow:
    """One rank's row, as shown."""

    rank: int
    host: str
    state: str
    bar_style: str  # info (running), success, danger (failed), warning (cancelled)
    bars: List[BarView]  # outer loop first; at most two (outer and innermost)
    metrics: str  # "loss=0.31 acc=0.9"
    exit_code: Optional[int]
    dropped: int  # progress or metric events the rank could not send
    system: str = ""  # "cpu 153% · rss 1.21 GiB · 120 ms/step" (``system_text``)


def bar_view(bar: dict) -> BarView:
    n, total = bar.get("n") or 0, bar.get("total")
    fraction = min(max(n / total, 0.0), 1.0) if total else None
    text = progress_text(dict(bar, desc=""))
    if total:  # the bar itself shows the percentage
        text = text.replace(f" ({100 * n // total}%)", "", 1)
    return BarView(
        desc=str(bar.get("desc") or ""), n=n, total=total, fraction=fraction, text=text, title=progress_text(bar)
    )


def rank_row(rs: Rank) -> RankRow:
    bars = [bar_view(b) for b in rs.shown_progress()]
    if not bars and rs.state == "done":
        # finished without progress(): a full (green) bar says "done"
        bars = [BarView(desc="", n=0, total=None, fraction=1.0, text="", title="done")]
    return RankRow(
        rank=rs.rank,
        host=rs.host,
        state=rs.state,
        bar_style=BAR_STYLES.get(rs.state, "info"),
        bars=bars,
        metrics=metrics_text(rs.metrics),
        exit_code=rs.exit_code,
        dropped=rs.dropped,
        system=system_text(rs),
    )


def rank_rows(state: State) -> List[RankRow]:
    return [rank_row(rs) for rs in snapshot(state).ranks]


# -- stacks ---------------------------------------------------------------------------------------
@dataclass
class RankStacks:
    """Where one rank was when a hang or a timeout stopped it."""

    rank: int
    where: str  # the main thread's innermost frames (``events.Stacks.where``)
    text: str  # every thread, as faulthandler wrote it ("" when there was none)


def rank_stacks(state: State) -> List[RankStacks]:
    """Every rank's stacks, by rank; empty unless stacks were captured."""
    stacks = snapshot(state).stacks
    return [RankStacks(rank=r, where=s.where(), text=s.text) for r, s in sorted(stacks.items())]


# -- plots ----------------------------------------------------------------------------------------
def thin(points: List[Tuple[int, float]], limit: int = PLOT_POINTS) -> List[Tuple[int, float]]:
    """At most ``limit`` of ``points``, evenly spread, always keeping the newest."""
    if len(points) <= limit:
        return list(points)
    stride = math.ceil(len(points) / (limit - 1))
    kept = points[::stride]
    if kept[-1] != points[-1]:
        kept.append(points[-1])
    return kept


def metric_series(state: RunState, limit: int = PLOT_POINTS) -> Dict[str, Series]:
    """``{metric: {rank: [(step, value), ...]}}``, metrics in order of first report, ranks
    that reported the metric only, non-finite values left out, ``limit`` points per rank."""
    series = {}
    for name, by_rank in state.metric_history(limit).items():
        kept = {r: thin([(x, y) for x, y in pts if math.isfinite(y)], limit) for r, pts in by_rank.items()}
        kept = {r: pts for r, pts in sorted(kept.items()) if pts}
        if kept:
            series[name] = kept
    return series


#: the system samples a small run plots, by the plot's name: (key of a sample, scale)
SYSTEM_PLOTS = {
    "rss (GiB)": ("rss_bytes", 1 / (1 << 30)),
    "cpu %": ("cpu_percent", 1.0),
    "gpu memory (GiB)": ("gpu_memory_used_bytes", 1 / (1 << 30)),
}


def system_series(state: RunState, limit: int = PLOT_POINTS) -> Dict[str, Series]:
    """``{plot: {rank: [(seconds since the run started, value), ...]}}`` of each rank's system
    samples (``SYSTEM_PLOTS``; the GPU's only where ranks have one), ``limit`` points per rank."""
    series: Dict[str, Series] = {}
    started = state.started  # one read (a state held by another process: one round trip)
    for r in range(state.num_processes):
        for sample in state.system_history(r, limit):
            x = sample["time"] - started
            for name, (key, scale) in SYSTEM_PLOTS.items():
                if key in sample:
                    series.setdefault(name, {}).setdefault(r, []).append((x, sample[key] * scale))
    return series


# -- logs -----------------------------------------------------------------------------------------
@dataclass
class RankLog:
    """The last lines of one rank's output."""

    rank: int
    state: str
    lines: List[LogLine]
    total: int  # lines the rank wrote in all (``\\r``-lines included)
    traceback: str = ""  # a failed rank's traceback, when its lines do not hold it


def terminal_lines(tail: List[LogLine], limit: int = LOG_LINES) -> List[LogLine]:
    """The last ``limit`` of a rank's lines ``tail`` as a terminal would show them: a
    ``\\r``-line is replaced by whatever comes after it, so only a trailing one (a bar in
    progress) shows."""
    shown = [line for line in tail[:-1] if not line.cr][-limit:]
    if tail:
        last = tail[-1]
        if not last.cr or last.text:
            shown.append(last)
    return shown[-limit:]


def rank_log(state: RunState, rank: int, limit: int = LOG_LINES) -> RankLog:
    read = state.recent_log(rank, LOG_SCAN)
    lines = terminal_lines(read.lines, limit)
    traceback = ""
    if read.state == "failed":
        # the rank's own traceback travels with its failure; a rank whose stderr did not reach
        # the driver (or went elsewhere) shows it from there
        failure = next((f for f in state.failures() if f.rank == rank), None)
        last = failure.traceback.strip().splitlines()[-1:] if failure and failure.traceback else []
        if last and not any(last[0] in line.text for line in lines):
            traceback = failure.traceback
    return RankLog(rank=rank, state=read.state, lines=lines, total=read.total, traceback=traceback)


def rank_logs(state: RunState, limit: int = LOG_LINES) -> List[RankLog]:
    """Every rank's ``rank_log``, by rank."""
    return [rank_log(state, r, limit) for r in range(state.num_processes)]


def root_cause_rank(state: State) -> Optional[int]:
    """The rank whose output explains the run's failure (the root cause's), if one failed."""
    failed = state.failures()
    return failed[0].rank if failed else None
