"""The widget run view: RunState -> rows, bars, colours, plots, logs; coalesced updates; the Stop
button (also while a cell blocks a real kernel); the choice between widget and text views."""

import re
import sys
import threading
import time
import types
import warnings

import pytest

from helpers import alive, assert_no_survivors, pids_of_run
from torchdist_magic import Distributor, progress, rank, report
from torchdist_magic.distributor import follow
from torchdist_magic.state import RunState
from torchdist_magic.view import make_view
from torchdist_magic.view import widget as W
from torchdist_magic.view.text import TextView


class FakeRun:
    """What a view needs of a ``Run``: its state and ``cancel()``."""

    def __init__(self, num_processes=2):
        self.state = RunState("7-cafe", num_processes, backend="local processes on testhost",
                              job_name="cell In[3]")
        self.cancelled = 0

    def cancel(self):
        self.cancelled += 1


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def feed(state, *events):
    for e in events:
        state.apply(e)


def running(state, rank, host="node-a"):
    feed(state, {"type": "status", "rank": rank, "state": "running", "host": host, "pid": 100 + rank})


def bar(state, rank, n, total, desc="epoch", bar_id=None, state_="running", elapsed=2.0):
    feed(state, {"type": "progress", "rank": rank, "bar": bar_id or f"{desc}#0", "desc": desc, "n": n,
                 "total": total, "elapsed": elapsed, "state": state_})


def exit_(state, rank, code, **extra):
    feed(state, {"type": "exit", "rank": rank, "code": code, "time": time.time(), **extra})


# -- rows, bars, colours ---------------------------------------------------------------------------
def test_rows_show_host_state_progress_and_metrics():
    run = FakeRun()
    running(run.state, 0, "node-a")
    running(run.state, 1, "node-b")
    bar(run.state, 0, 5, 10, elapsed=2.0)
    feed(run.state, {"type": "metrics", "rank": 0, "step": 5, "values": {"loss": 0.25, "acc": 0.5}})
    rows = W.rank_rows(run.state)
    assert [(r.rank, r.host, r.state) for r in rows] == [(0, "node-a", "running"), (1, "node-b", "running")]
    (b,) = rows[0].bars
    assert (b.desc, b.n, b.total, b.fraction) == ("epoch", 5, 10, 0.5)
    assert b.text == "5/10 [00:02<00:02, 2.50 it/s]"  # n/total [elapsed<ETA, rate]; the bar shows the %
    assert b.title == "epoch 5/10 (50%) [00:02<00:02, 2.50 it/s]"  # as the text view writes it
    assert rows[0].metrics == "loss=0.25 acc=0.5"
    assert rows[0].bar_style == rows[1].bar_style == "info"
    assert rows[1].bars == []
    html = W.rows_html(rows)
    assert html.count('class="torchdist-rank-row"') == 2
    assert 'data-n="5" data-total="10"' in html and "width:50.0%" in html
    assert "node-b" in html and "loss=0.25 acc=0.5" in html


def test_bars_turn_green_on_success_and_red_on_failure():
    run = FakeRun(3)
    for r in range(3):
        running(run.state, r)
        bar(run.state, r, 3, 10)
    bar(run.state, 0, 10, 10, state_="done")
    exit_(run.state, 0, 0)
    exit_(run.state, 1, 1, failure={"exc_type": "ValueError", "message": "bad batch"})
    run.state.finish("failed", run.state.failures()[0])
    rows = W.rank_rows(run.state)
    assert [(r.state, r.bar_style) for r in rows] == [("done", "success"), ("failed", "danger"),
                                                       ("cancelled", "warning")]
    html = W.rows_html(rows)
    assert 'torchdist-bar-success" data-n="10" data-total="10"' in html
    assert "torchdist-bar-danger" in html and "torchdist-bar-warning" in html
    assert W.BAR_COLOURS["success"] in html and W.BAR_COLOURS["danger"] in html
    assert "(exit 1)" in html
    assert "root cause: rank 1" in W.failure_html(run.state) and "bad batch" in W.failure_html(run.state)
    header = W.header_html(run.state)
    assert 'data-state="failed"' in header and W.STATE_COLOURS["failed"] in header


def test_nested_loops_show_outer_and_inner_bar_then_the_outer_one():
    state = FakeRun(1).state
    running(state, 0)
    bar(state, 0, 1, 3, desc="epoch", bar_id="epoch#0", elapsed=0.0)
    bar(state, 0, 7, 20, desc="batch", bar_id="batch#1", state_="done", elapsed=1.0)
    bar(state, 0, 4, 20, desc="batch", bar_id="batch#2", elapsed=0.5)
    assert [(b.desc, b.n) for b in W.rank_row(state.ranks[0]).bars] == [("epoch", 1), ("batch", 4)]
    bar(state, 0, 20, 20, desc="batch", bar_id="batch#2", state_="done")
    bar(state, 0, 3, 3, desc="epoch", bar_id="epoch#0", state_="done")
    exit_(state, 0, 0)
    (only,) = W.rank_row(state.ranks[0]).bars
    assert (only.desc, only.n, only.total, only.fraction) == ("epoch", 3, 3, 1.0)


def test_bar_of_unknown_length_and_a_rank_without_progress():
    state = FakeRun(2).state
    running(state, 0)
    bar(state, 0, 42, None, desc="stream")
    (b,) = W.rank_row(state.ranks[0]).bars
    assert b.fraction is None and b.text.startswith("42 [")
    assert "repeating-linear-gradient" in W.rows_html([W.rank_row(state.ranks[0])])
    exit_(state, 1, 0)
    (done,) = W.rank_row(state.ranks[1]).bars
    assert done.fraction == 1.0  # a finished rank shows a full green bar even without progress()


# -- plots -----------------------------------------------------------------------------------------
def test_plot_data_one_line_per_rank_thinned_to_a_bound():
    state = FakeRun(2).state
    for step in range(1, 1001):
        feed(state, {"type": "metrics", "rank": 0, "step": step, "values": {"loss": 1.0 / step}})
    for step in range(1, 11):
        feed(state, {"type": "metrics", "rank": 1, "step": step, "values": {"loss": 2.0 / step, "acc": 0.1 * step}})
    assert W.metric_names(state) == ["loss", "acc"]
    series = W.plot_series(state, "loss", limit=100)
    assert set(series) == {0, 1}
    assert len(series[0]) <= 100 and series[0][0] == (1, 1.0) and series[0][-1] == (1000, 0.001)
    assert series[1] == [(s, 2.0 / s) for s in range(1, 11)]
    assert W.plot_series(state, "acc") == {1: [(s, 0.1 * s) for s in range(1, 11)]}
    svg = W.plot_svg("loss", series)
    assert len(re.findall(r'<polyline class="torchdist-plot-line" data-rank="(\d)"', svg)) == 2
    assert svg.count(W.rank_colour(0)) >= 2 and svg.count(W.rank_colour(1)) >= 2
    html = W.plots_html(state)
    assert html.count("<svg") == 2 and 'data-metric="acc"' in html and "rank 1" in html


def test_no_plot_without_metrics_and_a_single_point_plots():
    state = FakeRun(1).state
    assert W.plots_html(state) == ""
    feed(state, {"type": "metrics", "rank": 0, "step": 1, "values": {"loss": 0.5}})
    svg = W.plots_html(state)
    assert "<circle" in svg and "<polyline" not in svg


def test_nice_ticks_are_round_numbers_inside_the_range():
    assert W.nice_ticks(-0.1, 2.1) == [0.0, 1.0, 2.0]
    ticks = W.nice_ticks(0.03, 0.95)
    assert [round(t, 6) for t in ticks] == [0.2, 0.4, 0.6, 0.8]
    assert W.nice_ticks(5.0, 5.0) == [5.0]


# -- logs ------------------------------------------------------------------------------------------
def log(state, rank, text, cr=False, stream="stdout"):
    feed(state, {"type": "log", "rank": rank, "stream": stream, "line": text, "cr": cr})


def test_rank_log_collapses_carriage_return_lines_and_is_bounded():
    state = FakeRun(1).state
    log(state, 0, "start")
    for pct in range(0, 101, 10):
        log(state, 0, f"{pct}%|bar|", cr=True)
    log(state, 0, "100%|bar| done")
    log(state, 0, "epoch 1")
    log(state, 0, "", cr=True)
    log(state, 0, "30%|next|", cr=True)
    assert [l.text for l in W.log_lines(state.ranks[0])] == ["start", "100%|bar| done", "epoch 1", "30%|next|"]
    for i in range(5000):
        log(state, 0, f"line {i}")
    shown = W.log_lines(state.ranks[0], limit=300)
    assert len(shown) == 300 and shown[-1].text == "line 4999"
    assert len(state.ranks[0].logs) == 5016  # the state keeps everything: run.logs(rank)


def test_all_ranks_log_is_prefixed_in_arrival_order():
    state = FakeRun(2).state
    merged = W.MergedLog(2, limit=4)
    log(state, 0, "a0")
    log(state, 1, "b0")
    log(state, 1, "50%", cr=True)
    assert merged.drain(state)
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
    html = W.merged_logs_html(merged)
    assert "[rank 1]</span> b1" in html and "[rank 0]</span> a3" in html


def test_logs_are_escaped_and_long_lines_cut():
    state = FakeRun(1).state
    log(state, 0, "<script>alert(1)</script>", stream="stderr")
    log(state, 0, "x" * (W.LOG_LINE_CHARS + 500))
    html = W.rank_logs_html(state, 0)
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "x" * W.LOG_LINE_CHARS + " …" in html and "x" * (W.LOG_LINE_CHARS + 1) not in html
    assert "#c62828" in html  # stderr in red


# -- the widget: coalescing, Stop, selector, close -------------------------------------------------
def values_sent(widget):
    """Count what the widget would send to the frontend (value changes)."""
    sent = []
    widget.observe(lambda change: sent.append(change["new"]), "value")
    return sent


def test_updates_are_coalesced_whatever_the_event_rate():
    run, clock = FakeRun(4), Clock()
    view = W.WidgetView(run, display=False, clock=clock)
    rows_sent, logs_sent, plots_sent = values_sent(view.rows), values_sent(view.logs), values_sent(view.plots)
    assert view.renders == 1
    for i in range(2000):  # a flood: 2000 events between two refreshes
        r = i % 4
        bar(run.state, r, i // 4, 500, elapsed=1 + i / 100)
        feed(run.state, {"type": "metrics", "rank": r, "step": i // 4, "values": {"loss": 1 / (i + 1)}})
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
    for _ in range(1000):
        clock.now += 0.01
        bar(run.state, 0, 400, 500)
        feed(run.state, {"type": "metrics", "rank": 0, "values": {"loss": 0.1}})
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


def test_stop_button_cancels_the_run():
    run = FakeRun()
    view = W.WidgetView(run, display=False)
    assert "torchdist-stop" in view.stop_button._dom_classes
    view.stop_button.click()
    assert run.cancelled == 1
    assert view.stop_button.disabled and view.stop_button.description == "Stopping…"


def test_log_selector_shows_any_rank_or_all():
    run = FakeRun(2)
    view = W.WidgetView(run, display=False)
    log(run.state, 0, "from zero")
    log(run.state, 1, "from one")
    view._render(0.0, force=True)
    assert "from zero" in view.logs.value and "from one" not in view.logs.value
    view.log_select.value = 1
    assert "from one" in view.logs.value and "from zero" not in view.logs.value
    view.log_select.value = W.ALL_RANKS
    assert "[rank 0]</span> from zero" in view.logs.value and "[rank 1]</span> from one" in view.logs.value


def test_a_failing_ranks_log_shows_unless_the_user_chose_one():
    run = FakeRun(3)
    view = W.WidgetView(run, display=False)
    log(run.state, 2, "loading shard 2")
    exit_(run.state, 2, 1, failure={"exc_type": "OSError", "message": "disk full"})
    view._render(0.0, force=True)
    assert view.log_select.value == 2 and "loading shard 2" in view.logs.value
    chosen = W.WidgetView(FakeRun(3), display=False)
    chosen.log_select.value = 1
    exit_(chosen.state, 2, 1)
    chosen._render(0.0, force=True)
    assert chosen.log_select.value == 1


def test_dropped_events_are_flagged_on_the_rank():
    state = FakeRun(1).state
    feed(state, {"type": "dropped", "rank": 0, "count": 17})
    assert "17 progress or metric events the rank could not send" in W.rows_html(W.rank_rows(state))


def test_close_renders_the_end_hides_stop_and_keeps_an_embedded_widget():
    run = FakeRun(1)
    view = W.WidgetView(run, display=False)
    running(run.state, 0)
    exit_(run.state, 0, 0)
    run.state.finish("succeeded")
    view.close()
    view.close()
    assert 'data-state="succeeded"' in view.header.value and 'data-state="done"' in view.rows.value
    assert view.stop_button.layout.display == "none"
    assert "(no output)" in view.logs.value and "yet" not in view.logs.value
    assert view.widget.comm is not None  # not closed: the panel keeps showing it
    summary = view.snapshot_html()
    assert "torchdist-summary" in summary and 'class="torchdist-rank-row"' in summary
    bundle = view._repr_mimebundle_()
    assert bundle["text/plain"].startswith("torchdist: succeeded")


# -- which view ------------------------------------------------------------------------------------
def test_text_view_outside_a_kernel_without_warnings():
    run = FakeRun()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(make_view(run, "auto"), TextView)
        assert isinstance(make_view(run, "text"), TextView)
    with pytest.warns(RuntimeWarning, match="needs a Jupyter kernel"):
        assert isinstance(make_view(run, "widget"), TextView)
    with pytest.raises(ValueError, match="view must be one of"):
        make_view(run, "fancy")


def test_widget_view_inside_a_kernel(monkeypatch, capsys):
    import IPython

    shell = types.SimpleNamespace(kernel=types.SimpleNamespace(session=None))
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    view = make_view(FakeRun(), "auto")
    assert isinstance(view, W.WidgetView) and view._pump is None
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


def test_widget_view_of_a_real_run():
    run = Distributor(2, local_mode=True, show=None).submit(train_steps, 20)
    view = W.WidgetView(run, display=False)
    assert follow(run, view=view) == 0
    rows = W.rank_rows(run.state)
    assert [(r.state, r.bar_style) for r in rows] == [("done", "success")] * 2
    assert all((r.bars[0].n, r.bars[0].total) == (20, 20) for r in rows)
    assert view.rows.value.count('data-n="20" data-total="20"') == 2
    assert set(W.plot_series(run.state, "loss")) == {0, 1}
    assert view.plots.value.count("torchdist-plot-line") == 2
    assert "rank 0 finished" in view.logs.value
    assert 'data-state="succeeded"' in view.header.value
    assert_no_survivors(run)


def test_view_refreshed_from_a_background_thread():
    run = Distributor(2, local_mode=True, show=None).submit(train_steps, 10)
    view = W.WidgetView(run, display=False)
    ended = threading.Event()
    thread = W.follow_in_background(run, view, on_done=lambda r: ended.set())
    assert thread is not threading.current_thread()
    assert run.result(timeout=120) == 0
    assert ended.wait(30)
    assert view._closed and 'data-state="succeeded"' in view.header.value
    assert view.rows.value.count('data-n="10" data-total="10"') == 2
    assert_no_survivors(run)


# -- Stop while a cell blocks a real kernel --------------------------------------------------------
class Kernel:
    """A real ipykernel through jupyter_client, collecting iopub messages by parent."""

    def __init__(self):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel()
        self.pid = self.km.provisioner.process.pid
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def iopub(self, timeout=60):
        return self.kc.get_iopub_msg(timeout=timeout)

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def _widget_state(msg):
    return msg["content"].get("data", {}).get("state", {})


def test_stop_button_works_while_the_cell_blocks_the_kernel():
    pytest.importorskip("jupyter_client")
    kernel = Kernel()
    run_ids = set()
    try:
        kc = kernel.kc
        assert kc.execute_interactive("%load_ext torchdist_magic", timeout=60)["content"]["status"] == "ok"
        long_cell = kc.execute("%%torchdist --np 2\nimport time\nfor i in progress(range(30000), desc='step'):\n"
                               "    time.sleep(0.02)\n")
        queued = kc.execute("print('queued cell ran')")  # waits behind the blocking cell
        stop_comm, clicked, outputs = None, False, []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            msg = kernel.iopub()
            state = _widget_state(msg)
            if "torchdist-stop" in state.get("_dom_classes", ()):
                stop_comm = msg["content"]["comm_id"]
            run_ids.update(re.findall(r'data-run-id="([^"]+)"', str(state.get("value", ""))))
            if not clicked and stop_comm and 'data-state="running"' in str(state.get("value", "")):
                kc.shell_channel.send(kc.session.msg("comm_msg", {
                    "comm_id": stop_comm, "data": {"method": "custom", "content": {"event": "click"}}}))
                clicked = True
            if msg["parent_header"].get("msg_id") == long_cell:
                outputs.append(msg)
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    break
        assert clicked, "the run view never showed a running rank"
        errors = [m["content"] for m in outputs if m["msg_type"] == "error"]
        assert [e["ename"] for e in errors] == ["RunCancelled"]
        summary = [m["content"]["data"] for m in outputs if m["msg_type"] == "update_display_data"]
        assert summary and 'data-state="cancelled"' in summary[-1]["text/html"]
        assert summary[-1]["text/plain"].startswith("torchdist: cancelled")
        # the cell queued behind the blocking one was kept and answered in order (aborted, as
        # Jupyter aborts what was queued behind a failing cell)
        replies = [kc.get_shell_msg(timeout=30) for _ in range(2)]
        assert [r["parent_header"]["msg_id"] for r in replies] == [long_cell, queued]
        assert [r["content"]["status"] for r in replies] == ["error", "aborted"]
        # a request that arrives while a cell blocks, behind a successful cell, runs after it
        short = kc.execute("%%torchdist --np 2\nimport time\ntime.sleep(2)\n'done'")
        after = kc.execute("print('after', 6 * 7)")
        replies = [kc.get_shell_msg(timeout=120) for _ in range(2)]
        assert [r["parent_header"]["msg_id"] for r in replies] == [short, after]
        assert [r["content"]["status"] for r in replies] == ["ok", "ok"]
        assert replies[1]["content"]["execution_count"] == replies[0]["content"]["execution_count"] + 1
        while True:
            msg = kernel.iopub()
            run_ids.update(re.findall(r'data-run-id="([^"]+)"', str(_widget_state(msg).get("value", ""))))
            if msg["parent_header"].get("msg_id") == after and msg["msg_type"] == "stream":
                assert msg["content"]["text"] == "after 42\n"
                break
    finally:
        kernel.close()
    assert len(run_ids) == 2
    deadline = time.monotonic() + 10
    while alive(kernel.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(kernel.pid)
    for run_id in run_ids:
        assert not pids_of_run(run_id), f"processes of run {run_id} survived"
