"""The view of a large run (issue 19): above ``LARGE_RUN`` ranks an overview (counts by state,
hosts, bars across ranks), the ranks worth a look first with why, any rank by its number or its
host's page, bands across ranks in the plots, every rank's errors and warnings; an update and the
summary a notebook keeps have sizes that do not grow with the ranks; the text view follows rank
0, the failing and the straggling ranks.  Simulated runs through the real ``RunState``."""

import io
import re

import pytest

from test_view_model import _stacks
from view_helpers import FakeRun, bar, exit_, feed, log, metrics, no_cpu, running, simulated_run
from torchdist_magic.core import events
from torchdist_magic.view import html as H
from torchdist_magic.view.plots import plots_html
from torchdist_magic.driver import summary as S
from torchdist_magic.view import overview as O
from torchdist_magic.view import widget as W
from torchdist_magic.view.text import TextView, summary, summary_with_logs


def sent_bytes(view, act):
    """Bytes of every widget value and option list that ``act`` changed: one update's size."""
    sizes = []
    parts = [
        (view.header, "value"),
        (view.rows, "value"),
        (view.failure, "value"),
        (view.stacks, "value"),
        (view.plots, "value"),
        (view.logs, "value"),
        (view.log_select, "options"),
        (view.host_page, "options"),
    ]
    for widget, trait in parts:
        widget.observe(lambda change: sizes.append(len(str(change["new"]).encode())), trait)
    act()
    return sum(sizes)


@pytest.fixture(scope="module")
def run_64():
    return simulated_run(64)


@pytest.fixture(scope="module")
def run_1024():
    return simulated_run(1024, steps=200, lines=10)


def test_a_large_run_shows_counts_hosts_bars_and_the_ranks_worth_a_look_first(run_64):
    run, _clock = run_64
    ov = S.overview(run.state)
    assert ov.counts_text == "64 ranks on 8 hosts: 63 running, 1 failed"
    epoch, batch = ov.bars
    assert (epoch.desc, batch.desc, batch.total, batch.ranks) == ("epoch", "batch", 50, 64)
    assert batch.n_min <= batch.n_median <= batch.n_max
    kinds = [(look.rank, look.kind) for look in ov.look]
    assert kinds[0] == (63, "failed") and (21, "straggler") in kinds  # failed first, then stragglers
    straggler = next(look for look in ov.look if look.rank == 21)
    assert re.fullmatch(r"\u26a0 straggler: .+ \((batch|epoch)\), for \d+ s", straggler.why)
    assert len(ov.look) <= S.LOOK_RANKS
    view = run.state.large_view()
    assert view.overview == ov and view.page == []
    assert sorted(view.shown) == sorted(look.rank for look in ov.look)  # only the ranks shown travel
    assert view.snap.ranks == () and view.snap.num_processes == 64
    assert [f.rank for f in view.failures] == [63]
    html = H.large_rows_html(view)
    assert html.count('class="torchdist-rank-row"') == len(ov.look)  # not 64 rows
    assert "64 ranks on 8 hosts" in html and 'data-state="failed"' in html
    assert "raised RuntimeError: CUDA error" in html and "straggler" in html


def test_a_large_view_carries_the_page_of_a_host_or_of_a_rank_asked_for(run_64):
    run, _clock = run_64
    ov = S.overview(run.state)
    host, ranks = ov.hosts[2]
    by_host = run.state.large_view(host="gpu-node-002")
    assert host == "gpu-node-002" and by_host.page == ranks[: S.PAGE_RANKS]
    assert set(by_host.page) <= set(by_host.shown) and by_host.shown[ranks[0]].host == host
    by_rank = run.state.large_view(host="gpu-node-002", rank=40)
    assert by_rank.page == [40] and by_rank.shown[40].rank == 40  # a rank asked for wins over a host
    assert run.state.large_view(rank=64).page == []  # no such rank: no page
    assert run.state.large_view(host="no-such-host").page == []


def test_a_silent_rank_is_worth_a_look():
    run = FakeRun(20)
    clock = run.state._pace.clock = type("C", (), {"now": 0.0, "__call__": lambda self: self.now})()
    for r in range(20):
        running(run.state, r)
    clock.now += S.SILENT_AFTER + 5
    for r in range(20):
        if r != 7:
            log(run.state, r, "alive")
    look = {item.rank: item for item in S.overview(run.state).look}
    assert look[7].kind == "silent" and look[7].why == "silent for 00:15"


def test_up_to_16_ranks_keep_a_row_per_rank_and_mark_stragglers():
    run, _clock = simulated_run(16)
    view = W.WidgetView(run, display=False)
    assert not view.large and view.rows.value.count('class="torchdist-rank-row"') == 16
    assert "torchdist-overview" not in view.rows.value
    assert "\u26a0 straggler: " in view.rows.value  # rank 5 steps at a fifth of the others' pace
    assert 'data-rank="5" data-state="running" data-why' in view.rows.value
    assert view.rank_box.layout.display == "none"
    assert "straggler: rank 5 (" in summary(run.state)


def test_an_update_and_the_kept_summary_do_not_grow_with_the_ranks(run_1024):
    run, clock = run_1024
    view = W.WidgetView(run, display=False, clock=clock, cpu_clock=no_cpu)
    assert view.large
    clock.now += W.PLOT_EVERY

    def one_round():
        for r in range(1024):
            feed(
                run.state,
                events.Progress(rank=r, bar="batch#9", desc="batch", n=40, total=50, elapsed=30.0),
                events.Log(rank=r, stream="stdout", line=f"rank {r} again"),
            )
        view.update()

    size = sent_bytes(view, one_round)
    assert 0 < size < 100 * 1024
    assert view.rows.value.count('class="torchdist-rank-row"') <= S.LOOK_RANKS
    html = view.snapshot_html()
    assert len(html.encode()) < 1024 * 1024
    assert html.count('class="torchdist-rank-log"') <= S.LOOK_RANKS + 1
    assert len(summary_with_logs(run.state).encode()) < 64 * 1024
    # the plots: a band and the median across ranks, lines for a few, points bounded
    assert view.plots.value.count("torchdist-plot-band") == 3
    assert view.plots.value.count("torchdist-plot-median") == 3
    assert 0 < view.plots.value.count("torchdist-plot-line") <= 3 * O.LINE_RANKS
    for points in re.findall(r'class="torchdist-plot-(?:median|line)"[^>]* points="([^"]*)"', view.plots.value):
        assert len(points.split()) <= O.BAND_POINTS
    assert "min to max of 1024 ranks" in view.plots.value


def test_bands_are_the_median_min_and_max_across_ranks():
    run = FakeRun(20)
    for r in range(20):
        for step in range(500):
            metrics(run.state, r, step, loss=float(r))
    metrics(run.state, 3, 500, loss=float("nan"))
    band = O.metric_bands(run.state, lines=[3])["loss"]
    assert band.ranks == 20 and len(band.steps) <= O.BAND_POINTS
    assert set(band.low) == {0.0} and set(band.high) == {19.0}
    assert all(9 <= m <= 10 for m in band.median)  # the middle of 0..19 (rank 3's nan left out)
    assert list(band.lines) == [3] and len(band.lines[3]) <= O.BAND_POINTS + 1


def test_any_rank_by_its_number_and_any_host_by_its_page(run_64):
    run, clock = run_64
    view = W.WidgetView(run, display=False, clock=clock)
    assert view.rank_box.layout.display == "" and len(view.log_select.options) < 16
    view.rank_box.value = "42"
    assert 'class="torchdist-page"' in view.rows.value and 'data-rank="42"' in view.rows.value
    assert view.log_select.value == 42 and "rank 42 epoch" in view.logs.value
    view.rank_box.value = "64"
    assert "no rank 64 in this run: ranks are 0 to 63" in view.rank_note.value
    view.rank_box.value = ""
    view.host_page.value = "gpu-node-003"
    assert view.host_page.options[0] == ("ranks worth a look", W.WORTH_A_LOOK)
    assert ("gpu-node-003 (8 ranks)", "gpu-node-003") in view.host_page.options
    assert "gpu-node-003: 8 ranks" in view.rows.value
    page = view.rows.value[view.rows.value.index('class="torchdist-page"') :]
    assert re.findall(r'data-rank="(\d+)"', page) == [str(r) for r in range(24, 32)]


def test_every_ranks_errors_and_warnings_in_one_pane(run_64):
    run, clock = run_64
    view = W.WidgetView(run, display=False, clock=clock)
    view.log_select.value = W.PROBLEMS
    pane = view.logs.value
    assert "errors and warnings of every rank" in pane
    assert "[rank 62]" in pane and "UserWarning: rank 62 step 14" in pane
    assert "epoch 0 batch 0:" not in pane  # an ordinary stdout line


def test_the_text_view_of_a_large_run_follows_rank_0_the_failed_and_the_straggling():
    run = FakeRun(40)
    out = io.StringIO()
    view = TextView(run.state, out=out, err=out)
    for r in range(40):
        running(run.state, r, f"node-{r // 8}")
        bar(run.state, r, 5, 10)
        for i in range(30):
            log(run.state, r, f"rank {r} line {i}")
    view._progress_shown = -1e9  # a status line is due
    view.update()
    exit_(run.state, 9, 1, exc_type="ValueError", message="bad batch")
    log(run.state, 9, "after the failure")
    view.update()
    view.close()
    printed = out.getvalue()
    assert "[rank 0] rank 0 line 29" in printed and "[rank 5]" not in printed
    assert "torchdist: rank 9 failed: its lines follow; 11 earlier lines in logs(9)" in printed
    assert "[rank 9] rank 9 line 11" in printed and "[rank 9] rank 9 line 10\n" not in printed
    assert re.search(r"torchdist: 00:0\d · 40 ranks on 5 hosts: 40 running · epoch median 5/10", printed)
    assert "worth a look:" in printed and "rank 9 on node-1 raised ValueError: bad batch" in printed
    assert printed.count("\n  rank ") <= S.LOOK_RANKS  # not a row per rank
    assert run.state.logs(5).count("\n") == 30  # every line stays in the run


def test_a_failed_ranks_pane_shows_the_traceback_it_sent():
    run = FakeRun(2)
    running(run.state, 1)
    log(run.state, 1, "loading")
    tb = "Traceback (most recent call last):\n  File \"x.py\", line 3, in f\nKeyError: 'w'\n"
    feed(
        run.state, events.Exit(rank=1, code=1, failure=events.Failure(exc_type="KeyError", message="'w'", traceback=tb))
    )
    pane = H.rank_log_html(H.rank_log(run.state, 1))
    assert "the traceback rank 1 sent with its failure" in pane and "KeyError: &#x27;w&#x27;" in pane
    log(run.state, 0, "fine")
    assert "traceback" not in H.rank_log_html(H.rank_log(run.state, 0))


def test_the_stop_button_says_who_stopped_the_run():
    run = FakeRun(2)
    view = W.WidgetView(run, display=False)
    view.stop_button.click()
    assert run.cancelled_by == "the Stop button"


def test_the_legend_wraps_between_entries_and_colours_do_not_repeat():
    run = FakeRun(16)
    for r in range(16):
        metrics(run.state, r, 1, loss=1.0)
    legend = plots_html(H.metric_series(run.state))
    assert "rank 0</span> <span" in legend  # whitespace between entries: the legend wraps there
    assert len({H.rank_colour(r) for r in range(1024)}) > 300
    assert H.rank_colour(0) != H.rank_colour(10)


def test_the_slowest_and_the_furthest_behind_are_worth_a_look_with_their_numbers():
    run = FakeRun(20)
    for r in range(20):
        running(run.state, r)
        bar(run.state, r, 1 if r == 4 else 2, 3, desc="epoch", bar_id="epoch#0", elapsed=10.0)
        # rank 4 is an epoch behind (its batch further along); rank 9 steps slowest
        bar(run.state, r, 40 if r == 4 else 5, 50, desc="batch", bar_id="batch#1", elapsed=1.0 if r != 9 else 5.0)
    look = {item.rank: item for item in S.overview(run.state).look}
    assert look[4].kind == "behind" and look[4].why == "furthest behind: epoch 1.8, median 2.1"
    assert look[9].kind == "slowest" and look[9].why == "slowest: 1.00 it/s, median 5.00"
    assert S.overview(run.state).bars[0].behind == 0  # 1 of 3 is not 2 steps short of 2


def test_the_text_view_names_a_straggler_it_follows_and_groups_stacks_of_a_large_run():
    run, _clock = simulated_run(20)
    out = io.StringIO()
    view = TextView(run.state, out=out, err=out)
    view.update()
    printed = out.getvalue()
    assert "torchdist: rank 6 straggles: its lines follow; 0 earlier lines" not in printed
    assert "torchdist: rank 6 straggles: its lines follow\n" in printed  # 20 lines: none passed over
    assert "torchdist: rank 19 failed: its lines follow" in printed
    run.state.begin_stacks()
    for r in range(19):  # most ranks in one collective, rank 6 elsewhere, 6 more places besides
        line, function = (40, "all_reduce") if r < 12 and r != 6 else (12 + r, "load_shard")
        feed(run.state, _stacks(r, function, line))
    text = summary(run.state)
    assert (
        "\n  where each rank was (innermost frame first):\n    ranks 0, 1, 2, 3, 4, 5, 7, 8 and 3 more: all_reduce"
        in text
    )
    # 10 places (rank 19 had exited: a place of its own): the 5 most common, then a count
    assert text.endswith("\n    … 5 more places") and text.count("\n    ranks ") == 5
    assert "last lines of rank 0 and of the ranks worth a look" in summary_with_logs(run.state)


def test_a_hosts_page_names_the_ranks_it_leaves_out_and_an_empty_problem_pane_says_so():
    run, clock = simulated_run(40, per_host=20)
    view = W.WidgetView(run, display=False, clock=clock)
    view.host_page.value = "gpu-node-001"
    assert (
        f"gpu-node-001: 20 ranks, the first {S.PAGE_RANKS} (type a rank&#x27;s number for another)" in view.rows.value
    )
    assert "logs of rank 0 and of the ranks worth a look" in view.snapshot_html()
    quiet = FakeRun(20)
    quiet_view = W.WidgetView(quiet, display=False)
    quiet_view.log_select.value = W.PROBLEMS
    assert "(no errors or warnings)" in quiet_view.logs.value
