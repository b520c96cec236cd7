"""Stragglers: a rank that steps well below the median pace, or falls behind, for several
seconds is listed by ``RunState.stragglers()`` with why; the others are not.  Fake clocks for the
rules, then a real run where one rank sleeps in its loop."""

import re
import time

from helpers import assert_no_survivors
from view_helpers import Clock, bar, exit_, running
from torchdist_magic import progress, rank
from torchdist_magic.driver import stragglers as P
from torchdist_magic.driver.distributor import submit
from torchdist_magic.handles.follow import follow
from torchdist_magic.core.options import LaunchOptions
from torchdist_magic.driver.state import RunState


def paced_state(ranks=4):
    clock = Clock()
    state = RunState("9-pace", ranks, clock=clock)
    for r in range(ranks):
        running(state, r, f"node-{r // 2}")
    return state, clock


def step_all(state, clock, seconds, rates, total=1000):
    """Every rank steps at its rate (steps/s) for ``seconds``, reporting every 0.5 s."""
    counts = getattr(state, "_test_counts", [0.0] * len(rates))
    for _ in range(int(seconds / 0.5)):
        clock.now += 0.5
        for r, rate in enumerate(rates):
            if rate is not None:
                counts[r] += rate * 0.5
                bar(state, r, int(counts[r]), total, desc="batch", bar_id="batch#1")
    state._test_counts = counts


def test_a_rank_slower_than_the_median_for_several_seconds_is_listed_with_why():
    state, clock = paced_state()
    step_all(state, clock, P.SLOW_FOR - 1, [10, 10, 10, 2])
    assert state.stragglers() == []  # slow, but not for long enough yet
    step_all(state, clock, P.SLOW_FOR + P.RATE_WINDOW, [10, 10, 10, 2])
    (slow,) = state.stragglers()
    assert (slow.rank, slow.host) == (3, "node-1")
    # rates as sampled when records arrive (the others' newest report may be half a second old)
    why = re.fullmatch(r"(\d\.\d\d) it/s against a median of (\d+\.\d\d) it/s \(batch\), for (\d+) s", slow.why)
    assert why, slow.why
    assert abs(float(why[1]) / float(why[2]) - 0.2) < 0.02 and int(why[3]) >= P.SLOW_FOR
    assert state.snapshot().stragglers == (slow,)


def test_a_rank_that_falls_behind_is_listed_and_one_that_catches_up_is_not_any_more():
    state, clock = paced_state()
    bar(state, 3, 0, 1000, desc="batch", bar_id="batch#1")
    state._test_counts = [400.0, 400.0, 400.0, 0.0]  # rank 3 started late: same pace, far behind
    step_all(state, clock, P.SLOW_FOR + 1, [10, 10, 10, 10])
    (behind,) = state.stragglers()
    assert behind.rank == 3 and behind.why.startswith("at step ")
    assert "where the median is" in behind.why
    state._test_counts[3] = 410.0  # caught up
    step_all(state, clock, P.SLOW_FOR + 1, [10, 10, 10, 10])
    assert state.stragglers() == []


def test_equal_paces_list_nobody_and_few_ranks_are_not_compared():
    state, clock = paced_state()
    step_all(state, clock, 3 * P.SLOW_FOR, [10, 9, 11, 10])
    assert state.stragglers() == []
    pair, pair_clock = paced_state(2)
    step_all(pair, pair_clock, 3 * P.SLOW_FOR, [10, 1])
    assert pair.stragglers() == []  # below MIN_PEERS ranks a median says nothing


def test_a_rank_that_goes_quiet_slows_down_and_stragglers_stay_named_after_the_run():
    state, clock = paced_state()
    step_all(state, clock, 2, [10, 10, 10, 10])
    step_all(state, clock, P.SLOW_FOR + P.RATE_WINDOW, [10, 10, 10, None])  # rank 3 sends nothing
    assert [s.rank for s in state.stragglers()] == [3]
    assert state.snapshot().quiet[3] >= P.SLOW_FOR
    for r in range(4):
        exit_(state, r, 0)
    state.finish("succeeded")
    clock.now += 60
    assert [s.rank for s in state.stragglers()] == [3]


def test_an_inner_bar_renewed_every_epoch_compares_ranks_in_different_epochs():
    state, clock = paced_state()
    counts = [0.0] * 4
    for _ in range(int((P.SLOW_FOR + P.RATE_WINDOW) / 0.5)):
        clock.now += 0.5
        for r, rate in enumerate([15, 15, 15, 3]):
            before = int(counts[r]) // 10
            counts[r] += rate * 0.5
            epoch, n = divmod(int(counts[r]), 10)  # a new "batch" bar (a new id) every 10 steps
            if epoch != before:  # the bar's end, as progress() sends it when its loop ends
                bar(state, r, 10, 10, desc="batch", bar_id=f"batch#{before}", state_="done")
            bar(state, r, n, 10, desc="batch", bar_id=f"batch#{epoch}")
    (slow,) = state.stragglers()
    assert slow.rank == 3 and "(batch)" in slow.why


def test_a_restart_forgets_the_pace_of_the_attempt_before():
    state, clock = paced_state()
    step_all(state, clock, P.SLOW_FOR + P.RATE_WINDOW, [10, 10, 10, 2])
    assert state.stragglers()
    state.restart()
    assert state.stragglers() == []


def _one_rank_sleeps(seconds, marks):
    """Every rank steps from when all four are up (a rank that started late is not behind)."""
    import os

    open(os.path.join(marks, f"up-{rank()}"), "w").close()
    while len(os.listdir(marks)) < 4:
        time.sleep(0.01)
    start = time.monotonic()
    for _ in progress(range(100_000), desc="step"):
        time.sleep(0.2 if rank() == 2 else 0.01)
        if time.monotonic() - start > seconds:
            break
    return rank()


def test_a_real_run_lists_the_rank_that_sleeps_in_its_loop(monkeypatch, tmp_path):
    # the rules as they are, on a shorter time scale: the run lasts seconds, not minutes
    monkeypatch.setattr(P, "RATE_WINDOW", 1.5)
    monkeypatch.setattr(P, "SLOW_FOR", 1.5)
    run = submit(_one_rank_sleeps, (6.0, str(tmp_path)), {}, LaunchOptions(num_processes=4, backend="local"))
    assert follow(run) == 0
    listed = run.state.stragglers()
    assert [s.rank for s in listed] == [2], listed
    assert listed[0].host and "median" in listed[0].why
    assert_no_survivors(run)
