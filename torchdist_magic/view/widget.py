"""The live run view in a notebook (ipywidgets 8): widget plumbing only.

What it shows is computed by ``model`` and drawn by ``html`` (the same HTML as the static
summary); this module holds the widgets (header, Stop button, rank rows, the ranks' stacks after
a hang or a timeout, plots, a log pane with a rank selector), refreshes them at a bounded rate
and, for a view shown as a cell's output, replaces it by the static summary when it closes.

A large run (``overview.is_large``) shows its overview and the ranks worth a look instead of a
row per rank, plots with a band across ranks, and two ways to reach any rank: a box to type its
number (its row and its log show) and a page per host.  Each update then sends HTML whose size
depends on what is shown, not on the number of ranks.

Updates are coalesced: whatever the event rate, the view refreshes at most every
``UPDATE_EVERY`` seconds and redraws plots at most every ``PLOT_EVERY`` seconds, from whichever
thread calls ``update()``.  Those periods stretch where drawing costs more: each of the two
takes at most ``VIEW_CPU_SHARE`` of a core (the CPU time of its last drawing, over that share;
for a run held by another process, with what its reads cost there: ``HostedState.served_cpu``),
so that at a thousand ranks (a refresh of 20 to 100 ms of CPU) the view refreshes every few
tenths of a second instead of taking the core that decodes the ranks' records.  While a cell
blocks the kernel waiting for the run, ``update()`` also lets the kernel handle widget messages
(``kernel_poll``), so Stop and the log selector answer during the cell.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Callable, Optional

import ipywidgets as widgets

from ..driver.handle import RunHandle
from ..driver.merged import MergedLog
from ..handles.feed import FedMergedLog
from ..driver.reading import MetricCursor
from ..driver.state import RunState
from ..driver.summary import PAGE_RANKS, LargeView, Overview
from .html import (
    BORDER,
    MUTED,
    failure_html,
    header_html,
    large_rows_html,
    merged_log_html,
    problems_html,
    profile_html,
    rank_log_html,
    rows_html,
    stacks_html,
    straggler_notes,
    summary_html,
)
from .kernel_poll import KernelPoll
from .model import metric_series, system_series, rank_log, rank_rows, rank_stacks, root_cause_rank, run_facts
from .overview import BAND_BUDGET, BAND_READ, LINE_RANKS, BandBuilder, band_share, is_large
from .plots import bands_html, plots_html
from .text import header, summary_with_logs

UPDATE_EVERY = 0.1  # seconds between refreshes of the view (every part of it together)
PLOT_EVERY = 0.5  # seconds between redraws of the metric plots
VIEW_CPU_SHARE = 0.1  # of a core, at most, for the refreshes, and as much for the plots
ALL_RANKS = -1  # log selector value for "all ranks"
PROBLEMS = -2  # log selector value for every rank's errors and warnings
WORTH_A_LOOK = ""  # host page value: no host's page, the ranks worth a look only
PROFILE_STEPS = 5  # steps of every rank that the Profile button profiles


class WidgetView:
    """The live view of ``run`` as ipywidgets; ``update()`` and ``close()`` like ``TextView``.

    ``display=True`` shows it as an output of the running cell, replaced after the run by the
    static summary (HTML with every rank's last lines, and text) so that a saved notebook,
    nbconvert or a frontend without widgets keeps the outcome.  ``display=False`` leaves placing
    ``view.widget`` to the caller (the launch panel) and keeps the live widget after the run.
    ``stop=False`` leaves out the Stop button.  ``log_hint`` says in captions where the complete
    logs are, the word ``rank`` standing for a rank's number (``_torchdist_run.logs(rank)``);
    None leaves that out.
    """

    def __init__(
        self,
        run: RunHandle,
        *,
        display: bool = True,
        stop: bool = True,
        log_hint: Optional[str] = None,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.thread_time,
    ):
        self.run = run
        self.state: RunState = run.state
        self.log_hint = log_hint
        self.clock = clock
        self.cpu_clock = cpu_clock
        #: seconds between refreshes and between plot redraws now (``VIEW_CPU_SHARE``)
        self.update_every, self.plot_every = UPDATE_EVERY, PLOT_EVERY
        self.renders = 0
        self._lock = threading.RLock()
        self._last_render: Optional[float] = None
        self._last_plot: Optional[float] = None
        self._seen_version = -1
        self._plot_version = -1
        self._closed = False
        # a run held by another process keeps this view's merged log there: a refresh gets the
        # lines it shows, not every line a thousand ranks wrote since the last one
        self._merged = (FedMergedLog if self.state.hosted else MergedLog)(self.state.num_processes)
        self._selecting = False  # the view, not the user, is changing the log selector
        self._log_chosen = False  # the user picked a log; until then the root cause's log shows
        self.large = is_large(self.state.num_processes)
        self._overview: Optional[Overview] = None
        self._typed: Optional[int] = None  # the rank typed in the rank box (a large run)
        # a large run's bands, built from the points that came since each drawing (per attempt)
        self._bands: Optional[BandBuilder] = None
        self._bands_cursor = MetricCursor()
        self._bands_attempt = 0

        self.header = widgets.HTML(layout=widgets.Layout(flex="1 1 200px", min_width="0"))
        self.stop_button = widgets.Button(
            description="Stop",
            icon="stop",
            button_style="danger",
            tooltip="stop every rank (like interrupting the kernel)",
            layout=widgets.Layout(
                width="auto", min_width="76px", height="28px", flex="0 0 auto", display="" if stop else "none"
            ),
        )
        self.stop_button.add_class("torchdist-stop")
        self.stop_button.on_click(self._on_stop)
        # beside Stop, for a run of its own (a warm pool's ranks have no profiler)
        profiles = stop and run.can_profile
        self.profile_button = widgets.Button(
            description="Profile",
            icon="tachometer",
            tooltip=f"profile every rank's next {PROFILE_STEPS} steps (torch.profiler), merged into one trace",
            layout=widgets.Layout(
                width="auto", min_width="76px", height="28px", flex="0 0 auto", display="" if profiles else "none"
            ),
        )
        self.profile_button.add_class("torchdist-profile")
        self.profile_button.on_click(self._on_profile)
        self.profile_note = widgets.HTML(layout=widgets.Layout(min_width="0"))
        self.profile_note.add_class("torchdist-profile-view")
        self.rows = widgets.HTML(layout=widgets.Layout(min_width="0"))
        self.rows.add_class("torchdist-rows-view")
        self.failure = widgets.HTML(layout=widgets.Layout(min_width="0"))
        self.stacks = widgets.HTML(layout=widgets.Layout(min_width="0"))
        self.stacks.add_class("torchdist-stacks-view")
        self.plots = widgets.HTML(layout=widgets.Layout(margin="6px 0 0 0", min_width="0"))
        self.plots.add_class("torchdist-plots-view")
        self.log_select = widgets.Dropdown(
            options=self._log_options(None),
            value=0,
            description="logs",
            layout=widgets.Layout(width="auto", max_width="260px", min_width="0"),
            style={"description_width": "36px"},
        )
        self.log_select.add_class("torchdist-log-select")
        self.log_select.observe(self._on_log_select, "value")
        # a large run: any rank by its number, or a host's page of ranks
        last = self.state.num_processes - 1
        self.rank_box = widgets.Text(
            placeholder=f"0 to {last}",
            description="rank",
            continuous_update=False,
            layout=widgets.Layout(width="150px", min_width="0", display="" if self.large else "none"),
            style={"description_width": "36px"},
        )
        self.rank_box.add_class("torchdist-rank-box")
        self.rank_box.observe(self._on_rank_typed, "value")
        self.rank_note = widgets.HTML(layout=widgets.Layout(min_width="0"))
        self.host_page = widgets.Dropdown(
            options=[("ranks worth a look", WORTH_A_LOOK)],
            value=WORTH_A_LOOK,
            description="page",
            style={"description_width": "36px"},
            layout=widgets.Layout(width="auto", max_width="260px", min_width="0", display="" if self.large else "none"),
        )
        self.host_page.add_class("torchdist-host-page")
        self.host_page.observe(self._on_host_page, "value")
        self.logs = widgets.HTML(layout=widgets.Layout(min_width="0"))
        self.logs.add_class("torchdist-logs-view")
        wrap = widgets.Layout(flex_flow="row wrap", align_items="center", min_width="0")
        self.widget = widgets.VBox(
            [
                widgets.HBox(
                    [self.header, self.profile_button, self.stop_button],
                    layout=widgets.Layout(
                        flex_flow="row wrap", align_items="center", justify_content="space-between", min_width="0"
                    ),
                ),
                widgets.HBox([self.rank_box, self.host_page, self.rank_note], layout=wrap),
                self.rows,
                self.profile_note,
                self.failure,
                self.stacks,
                self.plots,
                widgets.VBox([self.log_select, self.logs], layout=widgets.Layout(margin="6px 0 0 0", min_width="0")),
            ],
            layout=widgets.Layout(
                border=f"1px solid {BORDER}",
                padding="6px 12px 8px 12px",
                max_width="1100px",
                min_width="0",
                width="auto",
            ),
        )
        self.widget.add_class("torchdist-view")
        self._render(self.clock(), force=True)

        self._handle = None
        self._poll: Optional[KernelPoll] = None
        if display:
            from IPython import get_ipython
            from IPython.display import display as show

            bundle = self.widget._repr_mimebundle_()
            bundle["text/plain"] = header(self.state)
            self._handle = show(bundle, raw=True, display_id=True)
            self._poll = KernelPoll.start(get_ipython())

    # -- events from the frontend ---------------------------------------------------------------
    def _on_stop(self, _button=None) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping…"
        self.run.cancel(by="the Stop button")

    def _on_profile(self, _button=None) -> None:
        self.profile_button.disabled = True
        try:
            self.run.start_profile(PROFILE_STEPS)
        except (RuntimeError, ValueError) as exc:  # the run ended meanwhile: said where the button was
            _set(self.profile_note, f'<div style="color:{MUTED}">{html.escape(str(exc))}</div>')
            return
        self.profile_button.description = "Profiling…"

    def _on_log_select(self, _change=None) -> None:
        with self._lock:
            self._log_chosen = not self._selecting
            self._render_logs(self.state.finished)

    def _on_rank_typed(self, change) -> None:
        """A rank number typed: its row shows on the page and its log in the pane."""
        text = str(change["new"]).strip()
        last = self.state.num_processes - 1
        with self._lock:
            if not text:
                self._typed = None
                self.rank_note.value = ""
            elif text.isdigit() and int(text) <= last:
                self._typed = int(text)
                self.rank_note.value = ""
                self._show_log(self._typed)
                self._log_chosen = True  # typed by the user: a failure elsewhere does not take the pane
            else:
                self.rank_note.value = (
                    f'<span class="torchdist-rank-note" style="color:{MUTED};font-size:12px">'
                    f'no rank {html.escape(text)} in this run: ranks are 0 to {last}</span>'
                )
            self._render(self.clock(), force=True)

    def _on_host_page(self, _change=None) -> None:
        with self._lock:
            if self.host_page.value != WORTH_A_LOOK:
                self._typed = None
            self._render(self.clock(), force=True)

    def _log_options(self, ov: Optional[Overview]):
        """Every rank in a small run; in a large one rank 0, the ranks worth a look and the rank
        typed (any other is a number away); then all ranks and every rank's errors and warnings."""
        if not self.large:
            ranks = range(self.state.num_processes)
        else:
            chosen = ([self._typed] if self._typed is not None else []) + [
                look.rank for look in (ov.look if ov else [])
            ]
            ranks = sorted(set([0] + chosen))
        return [(f"rank {r}", r) for r in ranks] + [("all ranks", ALL_RANKS), ("errors and warnings", PROBLEMS)]

    def _show_log(self, rank: int) -> None:
        """Show ``rank``'s log in the pane (the view's choice, not the user's)."""
        options = self._log_options(self._overview)
        if rank not in [value for _, value in options]:
            options.append((f"rank {rank}", rank))
        self._selecting = True
        try:
            if list(self.log_select.options) != options:
                self.log_select.options = options
            self.log_select.value = rank
        finally:
            self._selecting = False

    # -- rendering ------------------------------------------------------------------------------
    def update(self) -> None:
        """Refresh if ``update_every`` has passed since the last refresh.  Called from the cell
        that blocks the kernel, it first lets the kernel handle the widget messages waiting."""
        if self._poll is not None:
            self._poll.poll()
        now = self.clock()
        with self._lock:
            if self._closed or (self._last_render is not None and now - self._last_render < self.update_every):
                return
            self._render(now)

    def _cost(self) -> float:
        """CPU seconds so far of this thread, and of the process that holds the run's state for
        the reads this view made there (a run held by another process): a drawing costs both."""
        return self.cpu_clock() + self.state.served_cpu

    def _render(self, now: float, force: bool = False) -> None:
        started = self._cost()
        self._last_render = now
        self.renders += 1
        state = self.state
        # one moment for every part; later changes show next time.  A large run's overview and
        # the few ranks shown are worked out where the state is (``large_view``): a run held by
        # another process sends those, not a thousand ranks' snapshots
        if self.large:
            # a typed rank's page wins over a host's (``summary.page_ranks``)
            view = state.large_view(self._seen_version, self.host_page.value or None, self._typed)
            snap, cause = view.snap, (view.failures[0].rank if view.failures else None)
        else:
            snap = state.snapshot(self._seen_version)
            cause = root_cause_rank(snap)
        version = snap.version
        facts = run_facts(snap)
        _set(self.header, header_html(facts))
        if version != self._seen_version or force:
            self._seen_version = version
            if self.large:
                self._overview = view.overview
                self._update_pickers(view.overview)
                _set(self.rows, large_rows_html(view, self._page_title(view)))
            else:
                _set(self.rows, rows_html(rank_rows(snap), straggler_notes(snap)))
            _set(self.failure, failure_html(facts))
            _set(self.stacks, stacks_html(rank_stacks(snap)))
            profile = state.profile()
            if profile is not None:
                _set(self.profile_note, profile_html(profile))
                if not profile.waiting:
                    self.profile_button.disabled, self.profile_button.description = False, "Profile"
            self._merged.drain(state, snap.changed)
            if cause is not None and not self._log_chosen and self.log_select.value != cause:
                self._show_log(cause)  # the root cause's output
            self._render_logs(facts.finished)
        drawn = self._cost()
        self.update_every = max(UPDATE_EVERY, (drawn - started) / VIEW_CPU_SHARE)
        if self._plot_version != version and (
            force or self._last_plot is None or now - self._last_plot >= self.plot_every
        ):
            self._last_plot = now
            self._plot_version = version
            if self.large:
                lines = [look.rank for look in self._overview.look][:LINE_RANKS]
                _set(self.plots, bands_html(self._metric_bands(snap.attempt, lines)))
            else:
                system = system_series(state)
                _set(self.plots, plots_html({**metric_series(state), **system}, over_time=system))
            self.plot_every = max(PLOT_EVERY, (self._cost() - drawn) / VIEW_CPU_SHARE)
        if facts.finished:
            self.stop_button.layout.display = "none"
            self.profile_button.layout.display = "none"

    def _metric_bands(self, attempt: int, lines):
        """The bands of a large run, from what this view drew before plus the points that came
        since (``BAND_READ`` of them at most, all ranks together); anew for a new attempt."""
        if self._bands is None or attempt != self._bands_attempt:
            self._bands, self._bands_cursor, self._bands_attempt = BandBuilder(), MetricCursor(), attempt
            first = True
        else:
            first = False
        ranks = self.state.num_processes
        per_rank = band_share(ranks, BAND_BUDGET) if first else band_share(ranks, BAND_READ, least=1)
        self._bands.add(self.state.metric_points(self._bands_cursor, per_rank))
        return self._bands.bands(self.state, lines)

    def _update_pickers(self, ov: Overview) -> None:
        """The host pages and the log choices of a large run, sent only when they change."""
        hosts = [("ranks worth a look", WORTH_A_LOOK)] + [
            (f"{host} ({len(ranks)} ranks)", host) for host, ranks in ov.hosts
        ]
        if list(self.host_page.options) != hosts:
            chosen = self.host_page.value
            self.host_page.options = hosts
            self.host_page.value = chosen if chosen in [value for _, value in hosts] else WORTH_A_LOOK
        options = self._log_options(ov)
        selected = self.log_select.value
        if selected not in [value for _, value in options]:
            options.append((f"rank {selected}", selected))
        if list(self.log_select.options) != options:
            self._selecting = True
            try:
                self.log_select.options = options
                self.log_select.value = selected
            finally:
                self._selecting = False

    def _page_title(self, view: LargeView) -> str:
        """The title of the ranks shown below those worth a look (``view.page``): the rank
        typed, or a host's (at most ``PAGE_RANKS``)."""
        if self._typed is not None:
            return f"rank {self._typed}"
        host = self.host_page.value
        if host == WORTH_A_LOOK:
            return ""
        ranks = view.overview.host_ranks(host)
        title = f"{host}: {len(ranks)} ranks"
        if len(ranks) > PAGE_RANKS:
            title += f", the first {PAGE_RANKS} (type a rank's number for another)"
        return title

    def _render_logs(self, finished: bool) -> None:
        selected = self.log_select.value
        if selected == ALL_RANKS:
            value = merged_log_html(self._merged.shown(), self._merged.limit, self.log_hint, finished)
        elif selected == PROBLEMS:
            value = problems_html(list(self._merged.problems), self._merged.limit, self.log_hint, finished)
        else:
            value = rank_log_html(rank_log(self.state, selected), self.log_hint, finished)
        _set(self.logs, value)

    def snapshot_html(self) -> str:
        """The view as static HTML: every rank's last lines, the one shown now unfolded."""
        with self._lock:
            selected = self.log_select.value
            problems = list(self._merged.problems)
        return summary_html(self.state, self.log_hint, selected if selected >= 0 else None, problems=problems)

    def close(self) -> None:
        """Final refresh; a displayed view is replaced by the static summary and its widgets
        closed.  The kernel gets its shell messages back."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._render(self.clock(), force=True)
            if self._merged.pending:  # the lines a refresh's budget left: the last view has them all
                while self._merged.pending:
                    self._merged.drain(self.state, ())
                self._render_logs(self.state.finished)
        if self._poll is not None:
            self._poll.poll()
            self._poll.close()
        if self._handle is not None:
            self._handle.update(
                {"text/html": self.snapshot_html(), "text/plain": summary_with_logs(self.state, self.log_hint)},
                raw=True,
            )
            close_tree(self.widget)

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = (
            summary_with_logs(self.state, self.log_hint) if self.state.finished else header(self.state)
        )
        return bundle


def _set(widget, value: str) -> None:
    """Send ``value`` only when it differs from what the frontend has."""
    if widget.value != value:
        widget.value = value


def close_tree(widget) -> None:
    """Close ``widget`` and every widget under it (their comms with the frontend)."""
    for child in getattr(widget, "children", ()):
        close_tree(child)
    widget.close()
