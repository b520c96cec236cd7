"""The view model and its renderers without a kernel: RunState -> header facts, rank rows, bars,
plots, logs; the HTML and text a notebook keeps after a run (every rank's last lines); the view
package's layering (no ipywidgets or IPython at import, nothing from the magic); the run state's
readers (snapshots, logs read while they spill, stacks awaited; nobody else takes its lock);
records without a handler; ``Run.result``'s own timeout; no dead code, one definition of styles."""

import ast
import io
import os
import re
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser

import pytest

from helpers import assert_no_survivors
from view_helpers import FakeRun, bar, exit_, feed, log, metrics, running
from torchdist_magic import ResultTimeout
from torchdist_magic.core import events
from torchdist_magic.driver import logstore
from torchdist_magic.driver.distributor import submit
from torchdist_magic.core.errors import JobTimeout, RunCancelled
from torchdist_magic.core.options import LaunchOptions
from torchdist_magic.view import html as H
from torchdist_magic.view import plots as P
from torchdist_magic.view import model as M
from torchdist_magic.driver import merged as G
from torchdist_magic.view.text import TextView, summary, summary_with_logs

VIEW_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchdist_magic", "view")


# -- header and rows -------------------------------------------------------------------------------
def test_rows_show_host_state_progress_and_metrics():
    run = FakeRun()
    running(run.state, 0, "node-a")
    running(run.state, 1, "node-b")
    bar(run.state, 0, 5, 10, elapsed=2.0)
    metrics(run.state, 0, 5, loss=0.25, acc=0.5)
    rows = M.rank_rows(run.state)
    assert [(r.rank, r.host, r.state) for r in rows] == [(0, "node-a", "running"), (1, "node-b", "running")]
    (b,) = rows[0].bars
    assert (b.desc, b.n, b.total, b.fraction) == ("epoch", 5, 10, 0.5)
    assert b.text == "5/10 [00:02<00:02, 2.50 it/s]"  # n/total [elapsed<ETA, rate]; the bar shows the %
    assert b.title == "epoch 5/10 (50%) [00:02<00:02, 2.50 it/s]"  # as the text view writes it
    assert rows[0].metrics == "loss=0.25 acc=0.5"
    assert rows[0].bar_style == rows[1].bar_style == "info"
    assert rows[1].bars == []
    html = H.rows_html(rows)
    assert html.count('class="torchdist-rank-row"') == 2
    assert 'data-n="5" data-total="10"' in html and "width:50.0%" in html
    assert "node-b" in html and "loss=0.25 acc=0.5" in html


def test_header_facts():
    run = FakeRun(3)
    facts = M.run_facts(run.state)
    assert (facts.run_id, facts.state, facts.job_name, facts.num_processes, facts.use_gpu, facts.finished) == (
        "7-cafe",
        "starting",
        "cell In[3]",
        3,
        False,
        False,
    )
    assert facts.outcome == ""
    header = H.header_html(facts)
    assert 'data-run-id="7-cafe"' in header and "np=3" in header and ">cpu<" in header
    run.state.finish("timed out", message="the run exceeded its timeout of 5 s")
    facts = M.run_facts(run.state)
    assert facts.finished and facts.outcome == "the run exceeded its timeout of 5 s"
    assert "exceeded its timeout" in H.failure_html(facts)


def test_bars_turn_green_on_success_and_red_on_failure():
    run = FakeRun(3)
    for r in range(3):
        running(run.state, r)
        bar(run.state, r, 3, 10)
    bar(run.state, 0, 10, 10, state_="done")
    exit_(run.state, 0, 0)
    exit_(run.state, 1, 1, exc_type="ValueError", message="bad batch")
    run.state.finish("failed", run.state.failures()[0])
    rows = M.rank_rows(run.state)
    assert [(r.state, r.bar_style) for r in rows] == [
        ("done", "success"),
        ("failed", "danger"),
        ("cancelled", "warning"),
    ]
    html = H.rows_html(rows)
    assert 'torchdist-bar-success" data-n="10" data-total="10"' in html
    assert "torchdist-bar-danger" in html and "torchdist-bar-warning" in html
    assert H.BAR_COLOURS["success"] in html and H.BAR_COLOURS["danger"] in html
    assert "(exit 1)" in html
    facts = M.run_facts(run.state)
    assert facts.outcome.startswith("root cause: rank 1") and "bad batch" in H.failure_html(facts)
    header = H.header_html(facts)
    assert 'data-state="failed"' in header and H.STATE_COLOURS["failed"] in header


def test_nested_loops_show_outer_and_inner_bar_then_the_outer_one():
    state = FakeRun(1).state
    running(state, 0)
    bar(state, 0, 1, 3, desc="epoch", bar_id="epoch#0", elapsed=0.0)
    bar(state, 0, 7, 20, desc="batch", bar_id="batch#1", state_="done", elapsed=1.0)
    bar(state, 0, 4, 20, desc="batch", bar_id="batch#2", elapsed=0.5)
    assert [(b.desc, b.n) for b in M.rank_row(state.ranks[0]).bars] == [("epoch", 1), ("batch", 4)]
    bar(state, 0, 20, 20, desc="batch", bar_id="batch#2", state_="done")
    bar(state, 0, 3, 3, desc="epoch", bar_id="epoch#0", state_="done")
    exit_(state, 0, 0)
    (only,) = M.rank_row(state.ranks[0]).bars
    assert (only.desc, only.n, only.total, only.fraction) == ("epoch", 3, 3, 1.0)


def test_bar_of_unknown_length_and_a_rank_without_progress():
    state = FakeRun(2).state
    running(state, 0)
    bar(state, 0, 42, None, desc="stream")
    (b,) = M.rank_row(state.ranks[0]).bars
    assert b.fraction is None and b.text.startswith("42 [")
    assert "repeating-linear-gradient" in H.rows_html([M.rank_row(state.ranks[0])])
    exit_(state, 1, 0)
    (done,) = M.rank_row(state.ranks[1]).bars
    assert done.fraction == 1.0  # a finished rank shows a full green bar even without progress()


def test_dropped_events_are_flagged_on_the_rank():
    state = FakeRun(1).state
    feed(state, events.Dropped(rank=0, count=17))
    (row,) = M.rank_rows(state)
    assert row.dropped == 17
    assert "17 progress or metric events the rank could not send" in H.rows_html([row])


# -- plots -----------------------------------------------------------------------------------------
def test_plot_data_one_line_per_rank_thinned_to_a_bound():
    state = FakeRun(2).state
    for step in range(1, 1001):
        metrics(state, 0, step, loss=1.0 / step)
    for step in range(1, 11):
        metrics(state, 1, step, loss=2.0 / step, acc=0.1 * step)
    series = M.metric_series(state, limit=100)
    assert list(series) == ["loss", "acc"]  # in order of first report
    assert set(series["loss"]) == {0, 1}
    loss0 = series["loss"][0]
    assert len(loss0) <= 100 and loss0[0] == (1, 1.0) and loss0[-1] == (1000, 0.001)
    assert series["loss"][1] == [(s, 2.0 / s) for s in range(1, 11)]
    assert series["acc"] == {1: [(s, 0.1 * s) for s in range(1, 11)]}
    svg = P.plot_svg("loss", series["loss"])
    assert len(re.findall(r'<polyline class="torchdist-plot-line" data-rank="(\d)"', svg)) == 2
    assert svg.count(H.rank_colour(0)) >= 2 and svg.count(H.rank_colour(1)) >= 2
    html = P.plots_html(M.metric_series(state))
    assert html.count("<svg") == 2 and 'data-metric="acc"' in html and "rank 1" in html


def test_system_plots_are_against_seconds_since_the_start_and_every_chart_of_a_row_is_as_wide():
    state = FakeRun(1).state
    for i in range(4):
        metrics(state, 0, i + 1, loss=1.0, acc=0.5, lr=0.1, grad=2.0)
    series = {"cpu %": {0: [(0.03664, 50.0), (4.2, 80.0), (12.5, 70.0)]}}
    html = P.plots_html({**M.metric_series(state), **series}, over_time=series)
    cpu = html[html.index('data-metric="cpu %"') :]
    labels = re.findall(r">([^<>]+)</text>", cpu[: cpu.index("</svg>")])
    assert "time since the start" in labels and "step" not in labels
    assert "0 s" in labels and "12 s" in labels and "0.03664" not in cpu
    loss = html[html.index('data-metric="loss"') :]
    assert ">step</text>" in loss[: loss.index("</svg>")]
    # a grid's cells: a chart alone on the last row is as wide as the others (no flex-grow)
    assert "grid-template-columns:repeat(auto-fill,minmax(260px,1fr))" in html and "flex:1 1" not in html
    assert P.plot_svg("cpu %", series["cpu %"], over_time=True).count("at 12 s</title>") == 1


def test_non_finite_values_are_shown_but_not_plotted():
    state = FakeRun(1).state
    metrics(state, 0, 1, loss=0.5)
    metrics(state, 0, 2, loss="nan")
    assert M.metric_series(state) == {"loss": {0: [(1, 0.5)]}}


def test_no_plot_without_metrics_and_a_single_point_plots():
    state = FakeRun(1).state
    assert M.metric_series(state) == {} and P.plots_html({}) == ""
    metrics(state, 0, 1, loss=0.5)
    svg = P.plots_html(M.metric_series(state))
    assert "<circle" in svg and "<polyline" not in svg


def test_thin_keeps_the_first_and_the_newest_point():
    points = [(i, float(i)) for i in range(1, 1001)]
    kept = M.thin(points, 50)
    assert len(kept) <= 50 and kept[0] == (1, 1.0) and kept[-1] == (1000, 1000.0)
    assert M.thin(points[:10], 50) == points[:10]


def test_nice_ticks_are_round_numbers_inside_the_range():
    assert P.nice_ticks(-0.1, 2.1) == [0.0, 1.0, 2.0]
    ticks = P.nice_ticks(0.03, 0.95)
    assert [round(t, 6) for t in ticks] == [0.2, 0.4, 0.6, 0.8]
    assert P.nice_ticks(5.0, 5.0) == [5.0]


# -- logs ------------------------------------------------------------------------------------------
def test_rank_log_collapses_carriage_return_lines_and_is_bounded():
    state = FakeRun(1).state
    log(state, 0, "start")
    for pct in range(0, 101, 10):
        log(state, 0, f"{pct}%|bar|", cr=True)
    log(state, 0, "100%|bar| done")
    log(state, 0, "epoch 1")
    log(state, 0, "", cr=True)
    log(state, 0, "30%|next|", cr=True)
    assert [l.text for l in M.rank_log(state, 0).lines] == ["start", "100%|bar| done", "epoch 1", "30%|next|"]
    for i in range(5000):
        log(state, 0, f"line {i}")  # the first one takes the \r-line's place, as on a terminal
    shown = M.rank_log(state, 0, limit=300)
    assert len(shown.lines) == 300 and shown.lines[-1].text == "line 4999" and shown.total == 5003
    assert len(state.ranks[0].logs) == 5003  # the state keeps every line: run.logs(rank)


def test_all_ranks_log_is_in_arrival_order():
    state = FakeRun(2).state
    merged = G.MergedLog(2, limit=4)
    log(state, 0, "a0")
    log(state, 1, "b0")
    log(state, 1, "50%", cr=True)
    assert merged.drain(state)
    assert not merged.drain(state)  # the bar's line, read again, is not a new line
    log(state, 0, "a1")
    merged.drain(state)
    assert [(r, l.text) for r, l in merged.shown()] == [(0, "a0"), (1, "b0"), (0, "a1"), (1, "50%")]
    log(state, 1, "b1")
    log(state, 0, "a2")
    log(state, 0, "a3")
    merged.drain(state)
    # lines that arrive between two refreshes are taken rank by rank; the oldest fall off
    assert [(r, l.text) for r, l in merged.shown()] == [(0, "a1"), (0, "a2"), (0, "a3"), (1, "b1")]
    assert not merged.drain(state)
    html = H.merged_log_html(merged.shown(), merged.limit, "_torchdist_run.logs(rank)")
    assert "[rank 1]</span> b1" in html and "[rank 0]</span> a3" in html
    assert "all ranks · last 4 lines; full logs: _torchdist_run.logs(rank)" in html


def test_logs_are_escaped_and_long_lines_cut():
    state = FakeRun(1).state
    log(state, 0, "<script>alert(1)</script>", stream="stderr")
    log(state, 0, "x" * (H.LOG_LINE_CHARS + 500))
    html = H.rank_log_html(M.rank_log(state, 0))
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "x" * H.LOG_LINE_CHARS + " …" in html and "x" * (H.LOG_LINE_CHARS + 1) not in html
    assert H.ERROR in html  # stderr in red


def test_log_captions_name_where_the_full_log_is_only_when_told():
    state = FakeRun(2).state
    for i in range(50):
        log(state, 1, f"line {i}")
    rank1 = M.rank_log(state, 1, limit=10)
    assert H.rank_log_caption(rank1, None) == "rank 1 · last 10 of 50 lines"
    assert (
        H.rank_log_caption(rank1, "_torchdist_run.logs(rank)")
        == "rank 1 · last 10 of 50 lines; full log: _torchdist_run.logs(1)"
    )
    assert H.rank_log_caption(M.rank_log(state, 0), "panel.run.logs(rank)") == "rank 0 · full log: panel.run.logs(0)"
    assert H.rank_log_caption(M.rank_log(state, 0), None) == "rank 0"


# -- what the notebook keeps after the run ---------------------------------------------------------
class DetailsParser(HTMLParser):
    """``{rank: {"open": bool, "summary": text, "lines": [text, ...]}}`` of the summary's
    per-rank ``<details>``."""

    def __init__(self):
        super().__init__()
        self.ranks = {}
        self._rank = None
        self._in = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "details" and "torchdist-rank-log" in attrs.get("class", ""):
            self._rank = int(attrs["data-rank"])
            self.ranks[self._rank] = {"open": "open" in attrs, "summary": "", "text": ""}
        elif self._rank is not None and tag in ("summary", "pre"):
            self._in = tag

    def handle_endtag(self, tag):
        if tag == "details":
            self._rank = None
        if tag in ("summary", "pre"):
            self._in = None

    def handle_data(self, data):
        if self._rank is not None and self._in:
            key = "summary" if self._in == "summary" else "text"
            self.ranks[self._rank][key] += data


def failed_run_with_output():
    run = FakeRun(3)
    for r in range(3):
        running(run.state, r, f"node-{r}")
        for i in range(100):
            log(run.state, r, f"rank {r} says {i}")
    log(run.state, 2, "Traceback: <ValueError> bad shard", stream="stderr")
    exit_(run.state, 2, 1, exc_type="ValueError", message="bad shard")
    exit_(run.state, 0, 0)
    run.state.finish("failed", run.state.failures()[0])
    return run


def test_static_summary_shows_every_ranks_last_lines_without_a_kernel():
    run = failed_run_with_output()
    html = H.summary_html(run.state, "_torchdist_run.logs(rank)")
    assert "torchdist-summary" in html and html.count('class="torchdist-rank-row"') == 3
    parser = DetailsParser()
    parser.feed(html)
    assert sorted(parser.ranks) == [0, 1, 2]
    assert [parser.ranks[r]["open"] for r in range(3)] == [False, False, True]  # the root cause's is open
    for r in range(3):
        lines = parser.ranks[r]["text"].splitlines()
        assert len(lines) == H.SUMMARY_LOG_LINES
        assert f"full log: _torchdist_run.logs({r})" in parser.ranks[r]["summary"]
    assert parser.ranks[0]["text"].splitlines()[-1] == "rank 0 says 99"
    assert parser.ranks[1]["text"].splitlines()[-1] == "rank 1 says 99"
    assert parser.ranks[2]["text"].splitlines()[-1] == "Traceback: <ValueError> bad shard"  # unescaped by the parser
    assert "(failed)" in parser.ranks[2]["summary"] and "(cancelled)" in parser.ranks[1]["summary"]
    assert "<script" not in html and "<style" not in html  # what nbviewer and GitHub keep


def test_static_summary_opens_the_rank_asked_for():
    run = failed_run_with_output()
    parser = DetailsParser()
    parser.feed(H.summary_html(run.state, open_rank=1))
    assert [parser.ranks[r]["open"] for r in range(3)] == [False, True, False]
    assert "full log" not in parser.ranks[1]["summary"]  # no hint given: no variable named
    ok = FakeRun(2)
    exit_(ok.state, 0, 0)
    exit_(ok.state, 1, 0)
    ok.state.finish("succeeded")
    parser = DetailsParser()
    parser.feed(H.summary_html(ok.state))
    assert [parser.ranks[r]["open"] for r in range(2)] == [True, False]  # rank 0's when none failed
    assert parser.ranks[1]["text"] == "(no output)"


def test_text_summary_lists_every_ranks_last_lines():
    run = failed_run_with_output()
    text = summary_with_logs(run.state, "_torchdist_run.logs(rank)")
    assert text.startswith(summary(run.state))
    assert "last lines of each rank (full logs: _torchdist_run.logs(rank)):" in text
    for r in range(3):
        mine = [line for line in text.splitlines() if line.startswith(f"  [rank {r}] ")]
        assert len(mine) == 5
    assert text.splitlines()[-1] == "  [rank 2] Traceback: <ValueError> bad shard"
    assert "  [rank 0] rank 0 says 99" in text
    quiet = FakeRun(1)
    quiet.state.finish("succeeded")
    assert summary_with_logs(quiet.state).endswith("last lines of each rank:\n  [rank 0] (no output)")


# -- restarts, hangs, tqdm bars --------------------------------------------------------------------
def test_a_run_that_restarts_shows_its_attempt_and_each_earlier_root_cause():
    run = FakeRun(2)
    run.state.max_attempts = 3
    assert M.run_facts(run.state).attempt_text == "attempt 1 of 3"
    running(run.state, 1)
    exit_(run.state, 1, -9)
    run.state.restart()
    facts = M.run_facts(run.state)
    assert (facts.state, facts.attempt_text) == ("restarting", "attempt 2 of 3")
    assert facts.earlier == ["attempt 1: rank 1 on node-a was killed by SIGKILL"]
    header = H.header_html(facts)
    assert 'class="torchdist-attempt" data-attempt="2">attempt 2 of 3<' in header
    assert H.STATE_COLOURS["restarting"] in header  # the restarting colour
    assert "attempt 1: rank 1 on node-a was killed by SIGKILL &rarr; restarted" in H.failure_html(facts)
    assert [r.state for r in M.rank_rows(run.state)] == ["starting", "starting"]
    assert M.run_facts(FakeRun(1).state).attempt_text == ""  # a run that cannot restart says nothing


def _stacks(rank, function, line):
    text = (
        f"Thread 0x0000000000000002 (most recent call first):\n  File \"/usr/lib/python3.11/threading.py\", "
        f"line 320 in wait\n\nCurrent thread 0x0000000000000001 (most recent call first):\n"
        f"  File \"/home/me/train.py\", line {line} in {function}\n"
    )
    return events.Stacks(rank=rank, text=text, main_thread=1)


def test_stacks_show_where_each_rank_was():
    run = FakeRun(2)
    assert M.rank_stacks(run.state) == [] and H.stacks_html([]) == ""
    feed(run.state, _stacks(1, "stuck_here", 12), _stacks(0, "wait_for_peer", 30))
    run.state.finish(
        "hung", message="no rank sent progress, metrics or output for 3 s (hang_timeout); every rank was stopped"
    )
    stacks = M.rank_stacks(run.state)
    assert [(s.rank, s.where) for s in stacks] == [
        (0, "wait_for_peer (/home/me/train.py, line 30)"),
        (1, "stuck_here (/home/me/train.py, line 12)"),
    ]
    page = H.stacks_html(stacks, open_rank=1)
    assert page.count('class="torchdist-rank-stack"') == 2 and 'data-rank="1" open' in page
    assert "threading.py" in page  # every thread is there, unfolded
    assert "torchdist-stacks" in H.summary_html(run.state)
    text = summary(run.state)
    assert "  no rank sent progress" in text
    assert text.endswith(
        "  where each rank was (innermost frame first):\n"
        "    rank 0: wait_for_peer (/home/me/train.py, line 30)\n"
        "    rank 1: stuck_here (/home/me/train.py, line 12)"
    )


def test_a_tqdm_bar_shows_its_postfix():
    run = FakeRun(1)
    feed(
        run.state,
        events.Progress(rank=0, bar="tqdm#0", desc="Epoch 0", n=4, total=8, elapsed=2.0, postfix="loss=0.31, v_num=0"),
    )
    (row,) = M.rank_rows(run.state)
    assert row.bars[0].title == "Epoch 0 4/8 (50%) [00:02<00:02, 2.00 it/s, loss=0.31, v_num=0]"


def test_readers_see_a_redrawn_line_that_the_log_replaced_after_they_read_it():
    run = FakeRun(1)
    out, err = io.StringIO(), io.StringIO()
    view = TextView(run.state, out, err)
    merged = G.MergedLog(1)
    log(run.state, 0, "10%", cr=True, stream="stderr")
    view.update()
    merged.drain(run.state)
    assert [l.text for _, l in merged.shown()] == ["10%"]
    log(run.state, 0, "100% done", stream="stderr")  # takes the 10% line's place in the log
    assert len(run.state.ranks[0].logs) == 1
    view.update()
    assert merged.drain(run.state) and [l.text for _, l in merged.shown()] == ["100% done"]
    assert not merged.drain(run.state)
    view.close()
    assert err.getvalue().count("[rank 0] 100% done") == 1


# -- layering --------------------------------------------------------------------------------------
def test_the_view_package_imports_neither_ipywidgets_nor_ipython():
    code = (
        "import sys\nimport torchdist_magic.view, torchdist_magic.view.model, torchdist_magic.view.html, "
        "torchdist_magic.view.text\nprint(sorted(m for m in ('ipywidgets', 'IPython', 'ipykernel') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_views_depend_on_the_run_not_on_the_magic_or_the_api():
    for name in sorted(os.listdir(VIEW_DIR)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(VIEW_DIR, name)) as fh:
            source = fh.read()
        for node in ast.walk(ast.parse(source, name)):
            if isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                assert not re.search(r"(^|\.)(magic|api)$", module), f"{name} imports {module}"
                assert not (module.strip(".") == "" and {a.name for a in node.names} & {"magic", "api"}), name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith(("torchdist_magic.magic", "torchdist_magic.api")), name
        assert "last_run" not in source, f"{name} refers to last_run()"


# -- records the state does not know ---------------------------------------------------------------
def test_a_record_type_without_a_handler_is_named_once_in_the_log_and_ignored():
    run = FakeRun(2)
    running(run.state, 0)
    feed(
        run.state,
        events.OutputEnd(rank=0, job_id="j1"),
        events.OutputEnd(rank=1, job_id="j1"),
        events.OutputEnd(rank=0, job_id="j2"),
        events.Joined(rank=1, host="h"),
    )
    log(run.state, 0, "after")
    assert run.state.logs(0) == (
        "torchdist: ignored a record of type output_end (OutputEnd): this version of the "
        "driver has no handler for it; later ones are ignored silently\nafter\n"
    )
    assert run.state.logs(1) == (
        "torchdist: ignored a record of type joined (Joined): this version of the "
        "driver has no handler for it; later ones are ignored silently\n"
    )
    assert [r.state for r in M.rank_rows(run.state)] == ["running", "starting"]  # nothing else changed


# -- the run handle --------------------------------------------------------------------------------
def _sleep_long():
    time.sleep(600)


def test_result_with_a_timeout_raises_its_own_timeout_error_and_the_run_goes_on():
    run = submit(_sleep_long, (), {}, LaunchOptions(num_processes=1, backend="local"))
    try:
        with pytest.raises(ResultTimeout) as info:
            run.result(timeout=0.2)
        assert isinstance(info.value, TimeoutError) and not isinstance(info.value, JobTimeout)
        assert str(info.value) == (
            "the run is still going after waiting 0.2 s (it keeps running; call cancel() to stop it)"
        )
        assert not run.done()
    finally:
        run.cancel()
        with pytest.raises(RunCancelled):
            run.result(timeout=120)
    # the view says who stopped it
    assert M.run_facts(run.state).outcome == "stopped by cancel(); every rank was stopped"
    assert_no_survivors(run)


# -- no dead code, no copies -----------------------------------------------------------------------
REPO = os.path.dirname(VIEW_DIR.rstrip(os.sep).rsplit(os.sep, 1)[0])


def _code_cells(path):
    """The Python of a notebook's code cells: a cell magic's body without its ``%%`` line, IPython
    syntax made Python; cells that are not Python even so are left out."""
    import json

    from IPython.core.inputtransformer2 import TransformerManager

    with open(path, encoding="utf-8") as fh:
        cells = [c for c in json.load(fh)["cells"] if c["cell_type"] == "code"]
    for c in cells:
        source = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        if source.startswith("%%"):
            source = source.partition("\n")[2]
        yield TransformerManager().transform_cell(source)


def _attribute_uses():
    """Where each attribute name is used (``x.name``) in the code of the repository's Python
    files and notebooks: ``{name: [(path, line), ...]}``; comments, docstrings and prose do not
    count."""
    uses = {}
    for sub in ("torchdist_magic", "tests", "notebooks", "benchmarks"):
        top = os.path.join(REPO, sub)
        for path in sorted(os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs):
            if path.endswith(".py"):
                with open(path, encoding="utf-8") as fh:
                    sources = [fh.read()]
            elif path.endswith(".ipynb"):
                sources = list(_code_cells(path))
            else:
                continue
            for source in sources:
                try:
                    tree = ast.parse(source)
                except SyntaxError:
                    continue
                for node in ast.walk(tree):
                    if isinstance(node, ast.Attribute):
                        uses.setdefault(node.attr, []).append((os.path.abspath(path), node.lineno))
    return uses


def test_every_public_method_of_the_run_state_module_is_used():
    """Each is used in code: an attribute of that name outside its own body (a mention in a
    comment, a docstring or the docs is no use)."""
    path = os.path.join(REPO, "torchdist_magic", "driver", "state.py")
    with open(path) as fh:
        source = fh.read()
    tree = ast.parse(source)
    uses = _attribute_uses()
    unused = []
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
        for fn in [n for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]:
            own_body = range(fn.lineno, fn.end_lineno + 1)
            if not [
                (p, line) for p, line in uses.get(fn.name, []) if not (p == os.path.abspath(path) and line in own_body)
            ]:
                unused.append(f"{cls.name}.{fn.name}")
    assert unused == []


def test_view_styles_are_defined_once():
    """Colours and fonts are constants of ``view/style.py`` alone: no other view module holds a
    colour or a theme variable at module level (they drifted apart when each had its own)."""
    colour = re.compile(r"#[0-9a-fA-F]{6}\b|var\(--jp-")
    for name in sorted(os.listdir(VIEW_DIR)):
        if not name.endswith(".py") or name == "style.py":
            continue
        with open(os.path.join(VIEW_DIR, name)) as fh:
            tree = ast.parse(fh.read(), name)
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for const in ast.walk(node):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        assert not colour.search(const.value), f"{name}:{node.lineno} defines a style: {const.value!r}"


# -- one owner of the run state --------------------------------------------------------------------
def test_a_snapshot_is_a_copy_that_names_the_ranks_changed_since_a_version():
    run = FakeRun(3)
    running(run.state, 0)
    bar(run.state, 0, 1, 10)
    first = run.state.snapshot()
    assert first.changed == {0, 1, 2} and first.version == run.state.version
    metrics(run.state, 2, 1, loss=0.5)
    bar(run.state, 0, 2, 10)
    later = run.state.snapshot(first.version)
    assert later.changed == {0, 2} and later.version > first.version
    assert first.ranks[0].progress["epoch#0"]["n"] == 1 and first.ranks[2].metrics == {}  # unchanged copies
    assert later.ranks[0].progress["epoch#0"]["n"] == 2 and later.ranks[2].metrics == {"loss": 0.5}
    assert run.state.snapshot(later.version).changed == frozenset()
    run.state.finish("cancelled")
    assert run.state.snapshot(later.version).changed == {0, 1, 2}  # the run's end changes every rank
    assert [r.state for r in M.rank_rows(later)] == ["running", "starting", "starting"]  # read from the copy


def test_stacks_are_awaited_for_the_running_ranks_only():
    state = FakeRun(3).state
    for r in range(3):
        running(state, r)
    exit_(state, 2, 0)
    assert state.begin_stacks() == [0, 1]
    assert state.stacks[2].note == "had exited with code 0"
    assert state.wait_stacks([0, 1], timeout=0.01).keys() == {2}  # none came: what there is
    sender = threading.Thread(target=feed, args=(state, _stacks(1, "f", 3), _stacks(0, "g", 4)))
    sender.start()
    try:
        stacks = state.wait_stacks([0, 1], timeout=120)
    finally:
        sender.join()
    assert sorted(stacks) == [0, 1, 2] and stacks[0].where() == "g (/home/me/train.py, line 4)"
    assert [s.rank for s in M.rank_stacks(state)] == [0, 1, 2]


def test_the_text_view_prints_every_line_once_while_another_thread_spills_the_log(monkeypatch):
    monkeypatch.setattr(logstore, "LOG_MEMORY_LINES", 40)  # spill to the file every few dozen lines
    monkeypatch.setattr(logstore, "SPILL_INDEX_EVERY", 16)
    run = FakeRun(2)
    out = io.StringIO()
    view = TextView(run.state, out, out)
    merged = G.MergedLog(2, limit=50)
    expected = {r: [f"r{r} line {i}" for i in range(3000)] for r in range(2)}

    def write(rank):
        for i, text in enumerate(expected[rank]):
            log(run.state, rank, text, stream="stderr" if i % 7 == 0 else "stdout")

    writers = [threading.Thread(target=write, args=(r,)) for r in range(2)]
    for w in writers:
        w.start()
    try:
        while any(w.is_alive() for w in writers):
            view.update()
            merged.drain(run.state)
    finally:
        for w in writers:
            w.join()
    view.close()
    merged.drain(run.state)
    assert run.state.ranks[0].logs.spilled > 0  # the log did spill meanwhile
    printed = out.getvalue().splitlines()
    for r in range(2):
        assert [line[len(f"[rank {r}] ") :] for line in printed if line.startswith(f"[rank {r}] ")] == expected[r]
        assert run.state.logs(r) == "".join(f"{text}\n" for text in expected[r])
    # the merged pane keeps the newest 50 lines of both ranks together: each rank's shown lines
    # are its newest ones (however the two writers were scheduled), 50 in all
    shown = {r: [line.text for rank, line in merged.shown() if rank == r] for r in range(2)}
    for r in range(2):
        assert shown[r] == expected[r][len(expected[r]) - len(shown[r]) :]
    assert sum(map(len, shown.values())) == 50


def _receivers_of_lock(path):
    """``(line, receiver)`` of every ``<receiver>._lock`` in ``path`` whose receiver is neither
    ``self`` (an object's own lock) nor a module the file imports (a module's lock)."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    modules = {
        alias.asname or alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    return [
        (node.lineno, ast.unparse(node.value))
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "_lock"
        and not (isinstance(node.value, ast.Name) and node.value.id in modules | {"self"})
    ]


def test_no_module_but_the_state_touches_the_run_states_lock():
    found = {}
    for sub in ("torchdist_magic", "tests", "benchmarks"):
        for folder, _, files in os.walk(os.path.join(REPO, sub)):
            for name in files:
                path = os.path.join(folder, name)
                if name.endswith(".py") and os.path.relpath(path, REPO) != os.path.join(
                    "torchdist_magic", "driver", "state.py"
                ):
                    if _receivers_of_lock(path):
                        found[os.path.relpath(path, REPO)] = _receivers_of_lock(path)
    assert found == {}
    with open(os.path.join(REPO, "torchdist_magic", "driver", "state.py")) as fh:
        assert "self._lock" in fh.read()  # the check looks at the right attribute


def test_errors_and_warnings_are_told_by_their_words_in_any_case():
    assert G.is_problem("RuntimeError: boom") and G.is_problem("a UserWarning here")
    assert G.is_problem("TRACEBACK (most recent call last)") and G.is_problem("an Exception was raised")
    assert not G.is_problem("epoch 3 loss 0.25") and not G.is_problem("")
    state = FakeRun(2).state
    merged = G.MergedLog(2)
    log(state, 0, "step 1")
    log(state, 1, "WARNING: slow step")
    log(state, 0, "plain words on stderr", stream="stderr")
    merged.drain(state)
    assert [(r, l.text) for r, l in merged.problems] == [(0, "plain words on stderr"), (1, "WARNING: slow step")]
