"""The live run view in a notebook (ipywidgets 8): widget plumbing only.

What it shows is computed by ``model`` and drawn by ``html`` (the same HTML as the static
summary); this module holds the widgets (header, Stop button, rank rows, the ranks' stacks after
a hang or a timeout, plots, a log pane with a rank selector), refreshes them at a bounded rate
and, for a view shown as a cell's output, replaces it by the static summary when it closes.

Updates are coalesced: whatever the event rate, the view refreshes at most every
``UPDATE_EVERY`` seconds and redraws plots at most every ``PLOT_EVERY`` seconds, from whichever
thread calls ``update()``.  While a cell blocks the kernel waiting for the run, ``update()`` also
lets the kernel handle widget messages (``kernel_poll``), so Stop and the log selector answer
during the cell.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import ipywidgets as widgets

from ..state import RunState
from .html import (BORDER, failure_html, header_html, merged_log_html, plots_html, rank_log_html, rows_html,
                   stacks_html, summary_html)
from .kernel_poll import KernelPoll
from .model import MergedLog, metric_series, rank_log, rank_rows, rank_stacks, root_cause_rank, run_facts
from .text import header, summary_with_logs

UPDATE_EVERY = 0.1    # seconds between refreshes of the view (every part of it together)
PLOT_EVERY = 0.5      # seconds between redraws of the metric plots
ALL_RANKS = -1        # log selector value for "all ranks"


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

    def __init__(self, run, *, display: bool = True, stop: bool = True, log_hint: Optional[str] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.run = run
        self.state: RunState = run.state
        self.log_hint = log_hint
        self.clock = clock
        self.renders = 0
        self._lock = threading.RLock()
        self._last_render: Optional[float] = None
        self._last_plot: Optional[float] = None
        self._seen_version = -1
        self._plot_version = -1
        self._closed = False
        self._merged = MergedLog(self.state.num_processes)
        self._selecting = False   # the view, not the user, is changing the log selector
        self._log_chosen = False  # the user picked a log; until then the root cause's log shows

        self.header = widgets.HTML(layout=widgets.Layout(flex="1 1 auto"))
        self.stop_button = widgets.Button(description="Stop", icon="stop", button_style="danger",
                                          tooltip="stop every rank (like interrupting the kernel)",
                                          layout=widgets.Layout(width="auto", height="28px",
                                                                display="" if stop else "none"))
        self.stop_button.add_class("torchdist-stop")
        self.stop_button.on_click(self._on_stop)
        self.rows = widgets.HTML()
        self.rows.add_class("torchdist-rows-view")
        self.failure = widgets.HTML()
        self.stacks = widgets.HTML()
        self.stacks.add_class("torchdist-stacks-view")
        self.plots = widgets.HTML(layout=widgets.Layout(margin="6px 0 0 0"))
        self.plots.add_class("torchdist-plots-view")
        options = [(f"rank {r}", r) for r in range(self.state.num_processes)] + [("all ranks", ALL_RANKS)]
        self.log_select = widgets.Dropdown(options=options, value=0, description="logs",
                                           layout=widgets.Layout(width="190px"),
                                           style={"description_width": "36px"})
        self.log_select.add_class("torchdist-log-select")
        self.log_select.observe(self._on_log_select, "value")
        self.logs = widgets.HTML()
        self.logs.add_class("torchdist-logs-view")
        self.widget = widgets.VBox(
            [widgets.HBox([self.header, self.stop_button],
                          layout=widgets.Layout(align_items="center", justify_content="space-between")),
             self.rows, self.failure, self.stacks, self.plots,
             widgets.VBox([self.log_select, self.logs], layout=widgets.Layout(margin="6px 0 0 0"))],
            layout=widgets.Layout(border=f"1px solid {BORDER}", padding="6px 12px 8px 12px",
                                  max_width="1100px"))
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
        self.run.cancel()

    def _on_log_select(self, _change=None) -> None:
        with self._lock:
            self._log_chosen = not self._selecting
            self._render_logs(self.state.finished)

    # -- rendering ------------------------------------------------------------------------------
    def update(self) -> None:
        """Refresh if ``UPDATE_EVERY`` has passed since the last refresh.  Called from the cell
        that blocks the kernel, it first lets the kernel handle the widget messages waiting."""
        if self._poll is not None:
            self._poll.poll()
        now = self.clock()
        with self._lock:
            if self._closed or (self._last_render is not None and now - self._last_render < UPDATE_EVERY):
                return
            self._render(now)

    def _render(self, now: float, force: bool = False) -> None:
        self._last_render = now
        self.renders += 1
        state = self.state
        snap = state.snapshot(self._seen_version)  # one moment for every part; later changes show next time
        version = snap.version
        facts = run_facts(snap)
        _set(self.header, header_html(facts))
        if version != self._seen_version or force:
            self._seen_version = version
            _set(self.rows, rows_html(rank_rows(snap)))
            _set(self.failure, failure_html(facts))
            _set(self.stacks, stacks_html(rank_stacks(snap)))
            self._merged.drain(state, snap.changed)
            cause = root_cause_rank(snap)
            if cause is not None and not self._log_chosen and self.log_select.value != cause:
                self._selecting = True
                try:
                    self.log_select.value = cause  # the root cause's output
                finally:
                    self._selecting = False
            self._render_logs(facts.finished)
        if self._plot_version != version and (force or self._last_plot is None or now - self._last_plot >= PLOT_EVERY):
            self._last_plot = now
            self._plot_version = version
            _set(self.plots, plots_html(metric_series(state)))
        if facts.finished:
            self.stop_button.layout.display = "none"

    def _render_logs(self, finished: bool) -> None:
        selected = self.log_select.value
        if selected == ALL_RANKS:
            value = merged_log_html(self._merged.shown(), self._merged.limit, self.log_hint, finished)
        else:
            value = rank_log_html(rank_log(self.state, selected), self.log_hint, finished)
        _set(self.logs, value)

    def snapshot_html(self) -> str:
        """The view as static HTML: every rank's last lines, the one shown now unfolded."""
        with self._lock:
            selected = self.log_select.value
        return summary_html(self.state, self.log_hint, None if selected == ALL_RANKS else selected)

    def close(self) -> None:
        """Final refresh; a displayed view is replaced by the static summary and its widgets
        closed.  The kernel gets its shell messages back."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._render(self.clock(), force=True)
        if self._poll is not None:
            self._poll.poll()
            self._poll.close()
        if self._handle is not None:
            self._handle.update({"text/html": self.snapshot_html(),
                                 "text/plain": summary_with_logs(self.state, self.log_hint)}, raw=True)
            close_tree(self.widget)

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = summary_with_logs(self.state, self.log_hint) if self.state.finished \
            else header(self.state)
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
