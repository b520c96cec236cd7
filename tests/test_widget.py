"""The live widget view: coalesced updates, the Stop button, the log selector, what stays after
the run, the choice between widget and text views, and real runs shown in it.  (Stop while a cell
blocks a real kernel: test_kernel_poll.py.)"""

import sys
import threading
import time
import types
import warnings

import pytest

from helpers import assert_no_survivors
from view_helpers import Clock, FakeRun, bar, exit_, log, metrics, no_cpu, running
from torchdist_magic import progress, rank, report
from torchdist_magic.driver.distributor import submit
from torchdist_magic.handles.follow import follow
from torchdist_magic.core.options import LaunchOptions
from torchdist_magic.view import make_view
from torchdist_magic.view import widget as W
from torchdist_magic.view.model import metric_series, rank_rows
from torchdist_magic.panel import follow_in_background
from torchdist_magic.view.text import TextView


def values_sent(widget):
    """Count what the widget would send to the frontend (value changes)."""
    sent = []
    widget.observe(lambda change: sent.append(change["new"]), "value")
    return sent


def test_updates_are_coalesced_whatever_the_event_rate():
    run, clock = FakeRun(4), Clock()
    view = W.WidgetView(run, display=False, clock=clock, cpu_clock=no_cpu)
    rows_sent, logs_sent, plots_sent = values_sent(view.rows), values_sent(view.logs), values_sent(view.plots)
    assert view.renders == 1
    for i in range(2000):  # a flood: 2000 events between two refreshes
        r = i % 4
        bar(run.state, r, i // 4, 500, elapsed=1 + i / 100)
        metrics(run.state, r, i // 4, loss=1 / (i + 1))
        log(run.state, 0, f"line {i}")
        if i % 100 == 0:
            view.update()  # called far more often than UPDATE_EVERY, at the same instant
    assert view.renders == 1 and rows_sent == [] and logs_sent == []
    clock.now += W.UPDATE_EVERY
    for _ in range(50):
        view.update()
    assert view.renders == 2 and len(rows_sent) == 1 and len(logs_sent) == 1
    assert plots_sent == []  # plots are redrawn at most every PLOT_EVERY
    clock.now += W.PLOT_EVERY
    view.update()
    assert view.renders == 3 and len(plots_sent) == 1
    # ten seconds of calls every 10 ms: at most one refresh per UPDATE_EVERY, plots less often
    for i in range(1000):
        clock.now += 0.01
        bar(run.state, 0, 400, 500)
        metrics(run.state, 0, 500 + i, loss=0.1)
        view.update()
    assert 3 < view.renders <= 3 + 10 / W.UPDATE_EVERY + 1
    assert len(plots_sent) <= 1 + 10 / W.PLOT_EVERY + 1
    # nothing changed: nothing is sent, whatever the refresh rate
    clock.now += 1
    view.update()  # the plot catches up with the last metric
    before = (len(rows_sent), len(logs_sent), len(plots_sent))
    clock.now += 1
    view.update()
    assert (len(rows_sent), len(logs_sent), len(plots_sent)) == before


def test_a_view_that_costs_more_to_draw_refreshes_less_often():
    """Each refresh, and each redraw of the plots, may take ``VIEW_CPU_SHARE`` of a core: one
    that took 0.1 s of CPU waits 1 s before the next (at 1024 ranks the view would otherwise
    take the core that decodes the ranks' records)."""
    run, clock = FakeRun(4), Clock()
    cpu = Clock()

    def cpu_clock():
        cpu.now += 0.05  # every reading: 0.1 s between two readings around a part
        return cpu.now

    view = W.WidgetView(run, display=False, clock=clock, cpu_clock=cpu_clock)
    assert view.update_every == pytest.approx(0.05 / W.VIEW_CPU_SHARE)
    assert view.plot_every == pytest.approx(max(W.PLOT_EVERY, 0.05 / W.VIEW_CPU_SHARE))
    renders = view.renders
    for i in range(1000):  # ten seconds of calls every 10 ms, something new each time
        clock.now += 0.01
        metrics(run.state, 0, i, loss=1 / (i + 1))
        view.update()
    assert view.renders - renders <= 10 / view.update_every + 1
    assert view.renders - renders >= 10 / view.update_every - 1
    cheap = W.WidgetView(FakeRun(4), display=False, clock=clock, cpu_clock=no_cpu)
    assert cheap.update_every == W.UPDATE_EVERY and cheap.plot_every == W.PLOT_EVERY


def test_a_view_counts_what_its_reads_cost_the_process_that_holds_the_run(tmp_path):
    """A run held by another process (``--channel process``): each of the view's reads costs
    that process CPU (a large run's overview is worked out there), which the view counts as its
    own drawing's, so a cheap kernel does not make it ask too often."""
    import os

    from torchdist_magic.core.privdir import user_directory
    from torchdist_magic.handles.feed import HostedState
    from torchdist_magic.supervise.feed import FeedServer

    run = FakeRun(64)
    for r in range(64):
        running(run.state, r, f"node-{r // 8}")
    own = run.state.large_view

    def costly_large_view(*args):
        began = time.thread_time()
        while time.thread_time() - began < 0.03:  # 30 ms of CPU there, each time
            pass
        return own(*args)

    run.state.large_view = costly_large_view
    path = os.path.join(user_directory(str(tmp_path)), "feed.sock")
    server = FeedServer(path, "token", run.state, lambda by: None)
    try:
        hosted = FakeRun(64)
        hosted.state = HostedState(path, "token", 64, lambda: None)
        view = W.WidgetView(hosted, display=False, clock=Clock(), cpu_clock=no_cpu)  # the kernel: no CPU
        assert hosted.state.served_cpu >= 0.03
        assert view.update_every >= 0.03 / W.VIEW_CPU_SHARE  # what the reads cost there, not just here
        view.close()
    finally:
        server.close()


def test_stop_button_cancels_the_run():
    run = FakeRun()
    view = W.WidgetView(run, display=False)
    assert "torchdist-stop" in view.stop_button._dom_classes
    view.stop_button.click()
    assert run.cancelled == 1
    assert view.stop_button.disabled and view.stop_button.description == "Stopping…"


def test_log_selector_shows_any_rank_or_all():
    run = FakeRun(2)
    view = W.WidgetView(run, display=False, log_hint="_torchdist_run.logs(rank)")
    log(run.state, 0, "from zero")
    log(run.state, 1, "from one")
    view._render(0.0, force=True)
    assert "from zero" in view.logs.value and "from one" not in view.logs.value
    assert "full log: _torchdist_run.logs(0)" in view.logs.value
    view.log_select.value = 1
    assert "from one" in view.logs.value and "from zero" not in view.logs.value
    assert "full log: _torchdist_run.logs(1)" in view.logs.value
    view.log_select.value = W.ALL_RANKS
    assert "[rank 0]</span> from zero" in view.logs.value and "[rank 1]</span> from one" in view.logs.value
    assert "full logs: _torchdist_run.logs(rank)" in view.logs.value


def test_captions_name_no_variable_unless_given_one():
    run = FakeRun(1)
    view = W.WidgetView(run, display=False)
    assert "full log" not in view.logs.value and "rank 0" in view.logs.value


def test_a_failing_ranks_log_shows_unless_the_user_chose_one():
    run = FakeRun(3)
    view = W.WidgetView(run, display=False)
    log(run.state, 2, "loading shard 2")
    exit_(run.state, 2, 1, exc_type="OSError", message="disk full")
    view._render(0.0, force=True)
    assert view.log_select.value == 2 and "loading shard 2" in view.logs.value
    chosen = W.WidgetView(FakeRun(3), display=False)
    chosen.log_select.value = 1
    exit_(chosen.state, 2, 1)
    chosen._render(0.0, force=True)
    assert chosen.log_select.value == 1


def test_close_renders_the_end_hides_stop_and_keeps_an_embedded_widget():
    run = FakeRun(2)
    view = W.WidgetView(run, display=False, log_hint="_torchdist_run.logs(rank)")
    running(run.state, 0)
    log(run.state, 1, "rank one's last words")
    exit_(run.state, 0, 0)
    exit_(run.state, 1, 0)
    run.state.finish("succeeded")
    view.log_select.value = 1
    view.close()
    view.close()
    assert 'data-state="succeeded"' in view.header.value and 'data-state="done"' in view.rows.value
    assert view.stop_button.layout.display == "none"
    assert "rank one&#x27;s last words" in view.logs.value
    assert view.widget.comm is not None  # not closed: the panel keeps showing it
    summary = view.snapshot_html()
    assert "torchdist-summary" in summary and summary.count('class="torchdist-rank-row"') == 2
    assert summary.count('class="torchdist-rank-log"') == 2
    assert '<details class="torchdist-rank-log" data-rank="1" data-state="done" open' in summary  # as shown
    bundle = view._repr_mimebundle_()
    assert bundle["text/plain"].startswith("torchdist: succeeded")
    assert "  [rank 1] rank one's last words" in bundle["text/plain"]


# -- which view ------------------------------------------------------------------------------------
def test_text_view_outside_a_kernel_without_warnings():
    run = FakeRun()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(make_view(run, "auto"), TextView)
        assert isinstance(make_view(run, "text", log_hint="x.logs(rank)"), TextView)
    with pytest.warns(RuntimeWarning, match="needs a Jupyter kernel"):
        assert isinstance(make_view(run, "widget"), TextView)
    with pytest.raises(ValueError, match="view must be one of"):
        make_view(run, "fancy")


def test_widget_view_inside_a_kernel(monkeypatch, capsys):
    import IPython

    shell = types.SimpleNamespace(kernel=types.SimpleNamespace(session=None))
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    view = make_view(FakeRun(), "auto", log_hint="_torchdist_run.logs(rank)")
    assert isinstance(view, W.WidgetView) and view.log_hint == "_torchdist_run.logs(rank)"
    assert view._poll is None  # no kernel session to poll: widgets answer after the cell
    assert "torchdist: run cell In[3]" in capsys.readouterr().out  # text/plain of the display
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # installed but not importable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(make_view(FakeRun(), "auto"), TextView)


# -- real runs -------------------------------------------------------------------------------------
def train_steps(n):
    for i in progress(range(n), desc="step"):
        report(loss=1.0 / (i + 1))
        time.sleep(0.02)
    print(f"rank {rank()} finished")
    return rank()


def start(n_steps):
    return submit(train_steps, (n_steps,), {}, LaunchOptions(num_processes=2, backend="local"))


def test_widget_view_of_a_real_run():
    run = start(20)
    view = W.WidgetView(run, display=False)
    assert follow(run, view) == 0
    rows = rank_rows(run.state)
    assert [(r.state, r.bar_style) for r in rows] == [("done", "success")] * 2
    assert all((r.bars[0].n, r.bars[0].total) == (20, 20) for r in rows)
    assert view.rows.value.count('data-n="20" data-total="20"') == 2
    assert set(metric_series(run.state)["loss"]) == {0, 1}
    assert view.plots.value.count("torchdist-plot-line") == 2
    assert "rank 0 finished" in view.logs.value
    assert 'data-state="succeeded"' in view.header.value
    assert "rank 1 finished" in view.snapshot_html()
    assert_no_survivors(run)


def test_view_refreshed_from_a_background_thread():
    run = start(10)
    view = W.WidgetView(run, display=False)
    ended = threading.Event()
    thread = follow_in_background(run, view, on_done=lambda r: ended.set())
    assert thread is not threading.current_thread()
    assert run.result(timeout=120) == 0
    assert ended.wait(30)
    assert view._closed and 'data-state="succeeded"' in view.header.value
    assert view.rows.value.count('data-n="10" data-total="10"') == 2
    assert_no_survivors(run)
