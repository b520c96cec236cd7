"""What a refresh of a large run's view reads and works out again (issue 35): the bands built from
the points that came since the last drawing give what building them from the whole history
gives; a rank's history is read from where the reader stopped, also after the history was
thinned or the run restarted; a snapshot copies only the ranks that changed; the merged log
reads a bounded number of lines per refresh and the rest at the next one, losing none.  A real
``RunState`` fed records, the widget on a fake clock."""

import math
import random
import statistics

from view_helpers import Clock, FakeRun, exit_, log, metrics, no_cpu, running
from torchdist_magic.driver.reading import MetricCursor
from torchdist_magic.driver import merged as G
from torchdist_magic.view import overview as O
from torchdist_magic.view import widget as W
from torchdist_magic.view.plots import bands_html


def bands_from_scratch(history, points=O.BAND_POINTS):
    """The bands ``BandBuilder`` promises, worked out from every point at once: the narrowest
    power-of-two bucket width whose buckets of the steps seen number at most ``points``; per
    bucket the largest step, the lowest and highest value and the median of each rank's value
    at its largest step there (the later point where a rank repeats a step)."""
    out = {}
    for name, by_rank in history.items():
        finite = [(r, s, v) for r, pts in by_rank.items() for s, v in pts if math.isfinite(v)]
        if not finite:
            continue
        first, last = min(s for _, s, _ in finite), max(s for _, s, _ in finite)
        width = 1
        while last // width - first // width >= points:
            width *= 2
        buckets = {}
        for r, s, v in finite:  # in each rank's order
            b = buckets.setdefault(s // width, {"x": s, "low": v, "high": v, "at_end": {}})
            b["x"], b["low"], b["high"] = max(b["x"], s), min(b["low"], v), max(b["high"], v)
            if r not in b["at_end"] or s >= b["at_end"][r][0]:
                b["at_end"][r] = (s, v)
        ordered = [buckets[k] for k in sorted(buckets)]
        out[name] = (
            [b["x"] for b in ordered],
            [b["low"] for b in ordered],
            [statistics.median(v for _, v in b["at_end"].values()) for b in ordered],
            [b["high"] for b in ordered],
            len(by_rank),
        )
    return out


def as_tuples(bands):
    return {name: (b.steps, b.low, b.median, b.high, b.ranks) for name, b in bands.items()}


def feed_rounds(state, ranks, rounds, seed=7):
    """Rounds of metric points at uneven paces (a rank's steps jump by 1 to 5), a rank that
    repeats a step with a nan; yields after each round."""
    rng = random.Random(seed)
    steps = [0] * ranks
    for _ in range(rounds):
        for r in range(ranks):
            for _ in range(rng.randint(0, 6)):
                steps[r] += rng.choice((1, 1, 2, 5)) if r % 5 else 1
                metrics(state, r, steps[r], loss=rng.gauss(1.0, 0.3), lr=0.1)
                if r == 3:
                    metrics(state, r, steps[r], loss=float("nan"), lr=0.2)
        yield


def test_bands_built_from_the_new_points_equal_bands_built_from_scratch():
    state = FakeRun(12).state
    builder, cursor = O.BandBuilder(points=10), MetricCursor()
    for _ in feed_rounds(state, 12, 60):
        builder.add(state.metric_points(cursor))
        assert as_tuples(builder.bands(state)) == bands_from_scratch(state.metric_history(), points=10)
    band = builder.bands(state)["loss"]
    assert 5 < len(band.steps) <= 10 and band.ranks == 12  # the buckets grew wider several times
    # a summary's bands, from scratch: the same, of each rank's history thinned to BAND_POINTS
    thinned = state.metric_history(O.BAND_POINTS)
    assert as_tuples(O.metric_bands(state, points=10)) == bands_from_scratch(thinned, points=10)


def test_a_drawing_works_out_again_only_the_buckets_that_got_points():
    state = FakeRun(4).state
    builder, cursor = O.BandBuilder(points=8), MetricCursor()
    for r in range(4):
        for step in range(8):
            metrics(state, r, step, loss=float(r + step))
    builder.add(state.metric_points(cursor))
    builder.bands(state)
    buckets = builder.metrics["loss"].buckets
    assert all(b.median is not None for b in buckets.values())
    metrics(state, 2, 7, loss=100.0)
    builder.add(state.metric_points(cursor))
    assert [k for k, b in buckets.items() if b.median is None] == [7]
    assert builder.bands(state)["loss"].high[-1] == 100.0
    assert state.metric_points(cursor) == {}  # nothing since


def test_a_rank_history_is_read_from_where_the_reader_stopped_also_once_thinned():
    state = FakeRun(2).state
    state.max_points = 16  # thinned often: every other point goes past 16
    cursor, read = MetricCursor(), []
    step = 0
    for size in (3, 5, 9, 2, 14, 1, 7, 30, 4):
        for _ in range(size):
            step += 1
            metrics(state, 0, step, loss=float(step))
        got = state.metric_points(cursor)["loss"][0]
        assert got[-1] == (step, float(step)) and (not read or got[0][0] > read[-1][0])
        assert got == [p for p in state.metric_history()["loss"][0] if not read or p[0] > read[-1][0]]
        read += got
    assert 1 not in state.metric_points(cursor).get("loss", {})
    metrics(state, 1, 1, loss=1.0)
    metrics(state, 1, 2, loss=2.0)
    metrics(state, 1, 3, loss=3.0)
    assert state.metric_points(cursor, points=1) == {"loss": {1: [(3, 3.0)]}}  # only the newest
    state.restart()
    metrics(state, 0, 1, loss=9.0)
    assert state.metric_points(cursor) == {"loss": {0: [(1, 9.0)]}}  # the new attempt's, from its start


def test_a_snapshot_copies_only_the_ranks_that_changed():
    state = FakeRun(3).state
    for r in range(3):
        running(state, r)
    first = state.snapshot()
    metrics(state, 1, 1, loss=0.5)
    later = state.snapshot(first.version)
    assert later.ranks[0] is first.ranks[0] and later.ranks[2] is first.ranks[2]
    assert later.ranks[1] is not first.ranks[1] and later.ranks[1].metrics == {"loss": 0.5}
    assert first.ranks[1].metrics == {}  # the earlier copy stays as it was
    state.finish("cancelled")
    ended = state.snapshot()
    assert all(a is not b for a, b in zip(ended.ranks, later.ranks)) and {r.state for r in ended.ranks} == {"cancelled"}


def test_the_merged_log_reads_about_its_budget_per_refresh_and_the_rest_at_the_next():
    state = FakeRun(4).state
    merged = G.MergedLog(4, limit=50, budget=5)
    for r in range(4):
        for i in range(3):
            log(state, r, f"r{r} line {i}")
    log(state, 3, "WARNING: slow")
    log(state, 2, "on stderr", stream="stderr")
    assert merged.drain(state) and merged.pending == 2  # ranks 0 and 1: six lines
    assert [(r, line.text) for r, line in merged.shown()][-1] == (1, "r1 line 2")
    log(state, 0, "r0 line 3")
    assert merged.drain(state, [0]) and merged.pending == 1  # ranks 2 and 3 first (their turn), then 0
    assert merged.drain(state, []) and merged.pending == 0
    texts = [(r, line.text) for r, line in merged.shown()]
    assert texts == (
        [(0, f"r0 line {i}") for i in range(3)]
        + [(1, f"r1 line {i}") for i in range(3)]
        + [(2, f"r2 line {i}") for i in range(3)]
        + [(2, "on stderr")]
        + [(3, f"r3 line {i}") for i in range(3)]
        + [(3, "WARNING: slow"), (0, "r0 line 3")]
    )
    assert [(r, line.text) for r, line in merged.problems] == [(2, "on stderr"), (3, "WARNING: slow")]
    assert not merged.drain(state)


def test_the_live_view_draws_the_bands_a_summary_would():
    run, clock = FakeRun(20), Clock()
    for r in range(20):
        running(run.state, r)
    view = W.WidgetView(run, display=False, clock=clock, cpu_clock=no_cpu)
    for _ in feed_rounds(run.state, 20, 12, seed=3):
        clock.now += W.PLOT_EVERY
        view.update()
        lines = [look.rank for look in view._overview.look][: O.LINE_RANKS]
        assert view.plots.value == bands_html(O.metric_bands(run.state, lines))
    assert "min to max of 20 ranks" in view.plots.value


def test_a_view_that_closes_reads_the_lines_its_budget_left():
    run = FakeRun(20)
    clock = Clock()
    view = W.WidgetView(run, display=False, clock=clock, cpu_clock=no_cpu)
    view._merged.budget = 10
    for r in range(20):
        running(run.state, r)
        log(run.state, r, f"rank {r} says hello")
        log(run.state, r, f"rank {r} warning: odd", stream="stderr")
    clock.now += W.PLOT_EVERY
    view.update()
    assert view._merged.pending == 15  # five ranks read, ten lines
    for r in range(20):
        exit_(run.state, r, 0)
    run.state.finish("succeeded")
    view.log_select.value = W.PROBLEMS
    view.close()
    assert view._merged.pending == 0 and len(view._merged.problems) == 20
    assert all(f"rank {r} warning: odd" in view.logs.value for r in range(20))
