"""Many real ranks at once: 64 local processes, each printing, reporting and moving a progress
bar 100 times a second for 5 s.  No torch: the job is a plain function, which a rank runs
without a process group (``runners._run_function``), so the test measures the driver's side."""

import pytest

from helpers import assert_no_survivors
from torchdist_magic import Distributor

RANKS, STEPS_PER_S, SECONDS = 64, 100, 5


def chatty(steps, per_second):
    """Each step: a line on stdout, a metric point and a progress step, on a fixed schedule."""
    import time

    from torchdist_magic import progress, rank, report

    me = rank()
    start = time.monotonic()
    for i in progress(range(steps), desc="train"):
        print(f"rank {me} step {i}", flush=True)
        report(step=i, loss=1.0 / (i + 1))
        time.sleep(max(0.0, start + (i + 1) / per_second - time.monotonic()))
    return me


@pytest.mark.scale
def test_64_ranks_each_100_records_a_second_lose_nothing_and_leave_nothing():
    steps = STEPS_PER_S * SECONDS
    run = Distributor(RANKS, local_mode=True, show=None).submit(chatty, steps, STEPS_PER_S)
    try:
        assert run.result(timeout=300) == 0
    finally:
        assert_no_survivors(run)
    snap = run.state.snapshot()
    assert snap.state == "succeeded" and [rs.state for rs in snap.ranks] == ["done"] * RANKS
    for r in range(RANKS):
        assert run.logs(r).splitlines() == [f"rank {r} step {i}" for i in range(steps)], f"rank {r}"
        rs = run.state.ranks[r]
        assert [step for step, _ in rs.history["loss"]] == list(range(steps)), f"rank {r}"
        assert rs.dropped == 0
        (bar,) = rs.progress.values()
        assert (bar["n"], bar["total"], bar["state"]) == (steps, steps, "done")
