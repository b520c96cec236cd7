"""The step split: each rank's steps split into waiting for data, computing and waiting in
collectives (``run.state.ranks[r].step_split``), and stragglers that say why.  A fake clock for
the rank's measure and for the rules, then real runs of 3 DDP ranks where one rank's data loader,
or its computation, holds the others up."""

import types

import pytest

from helpers import assert_no_survivors
from view_helpers import Clock, running
from torchdist_magic.core import events
from torchdist_magic.core.options import LaunchOptions
from torchdist_magic.driver import stragglers as P
from torchdist_magic.driver.distributor import submit
from torchdist_magic.handles.follow import follow
from torchdist_magic.rank import stepsplit
from torchdist_magic.driver.state import RunState


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(stepsplit, "_clock", fake)
    return fake


def loop(split, clock, steps, data, compute, comm=0.0, collective=None):
    """``steps`` steps of one progress() loop: waiting ``data`` s for each item, then ``compute``
    s of work and a collective of ``comm`` s (through ``split.collective``)."""
    depth = split.enter()
    for _ in range(steps):
        clock.now += data
        split.step(depth, data)
        clock.now += compute
        if comm:
            split.collective(collective or (lambda: setattr(clock, "now", clock.now + comm)))
    split.leave()


def test_a_loop_that_waits_for_its_data_sends_the_shares_of_its_steps(clock):
    sent = []
    split = stepsplit.StepSplit(sent.append, lambda: 3)
    loop(split, clock, 40, data=0.06, compute=0.01, comm=0.03)
    assert sent and all(isinstance(r, events.StepSplit) and r.rank == 3 for r in sent)
    last = sent[-1]
    assert last.data == pytest.approx(0.6) and last.comm == pytest.approx(0.3) and last.compute == pytest.approx(0.1)
    assert last.step_s == pytest.approx(4.0) and last.data_s == pytest.approx(2.4) and last.comm_s == pytest.approx(1.2)
    # one record a second of steps, and the rest when the loop ends
    assert len(sent) == 4


def test_only_synchronous_outermost_collectives_inside_loops_count(clock):
    sent = []
    split = stepsplit.StepSplit(sent.append, lambda: 0)
    split.collective(lambda: setattr(clock, "now", clock.now + 5))  # before any loop: not a step

    def nested():  # all_gather_object calling all_gather: counted once
        clock.now += 0.02
        split.collective(lambda: setattr(clock, "now", clock.now + 0.02))

    depth = split.enter()
    for _ in range(30):
        clock.now += 0.01
        split.step(depth, 0.01)
        clock.now += 0.02
        split.collective(nested)
        split.collective(lambda async_op: setattr(clock, "now", clock.now + 0.03), async_op=True)  # compute
    split.leave()
    last = sent[-1]
    assert last.data == pytest.approx(0.1) and last.comm == pytest.approx(0.4) and last.compute == pytest.approx(0.5)


def test_an_outer_loop_counts_its_waits_and_the_inner_loop_its_steps(clock):
    sent = []
    split = stepsplit.StepSplit(sent.append, lambda: 0)
    outer = split.enter()
    for _ in range(2):
        clock.now += 0.5  # the next epoch's item took half a second
        split.step(outer, 0.5)
        loop(split, clock, 10, data=0.0, compute=0.1)
    split.leave()
    # the outer loop's first item is a step: no inner loop had been seen yet
    assert sent[-1].data == pytest.approx(1.0 / 3.0) and sent[-1].steps == 21


def test_the_wait_in_ddps_allreduce_is_read_from_its_timers(clock, monkeypatch):
    sent = []
    split = stepsplit.StepSplit(sent.append, lambda: 0)
    iteration = [0]

    class FakeDDP:  # what DDP's timers say: 40 ms of waiting after the backward computation
        def _get_ddp_logging_data(self):
            start = 10**18 + iteration[0] * 10**8
            return {
                "forward_compute_time_start": start,
                "backward_compute_time_end": start + 50 * 10**6,
                "backward_comm_time_end": start + 90 * 10**6,
            }

    module = FakeDDP()
    monkeypatch.setattr(stepsplit, "_DDP_MODULES", [module])
    depth = split.enter()
    for _ in range(40):
        iteration[0] += 1
        clock.now += 0.1
        split.step(depth, 0.0)
    split.leave()
    assert sent[-1].comm == pytest.approx(0.4) and sent[-1].data == 0.0


def test_patched_collectives_time_their_calls_for_the_current_split(clock):
    calls = []
    module = types.SimpleNamespace(all_reduce=lambda t, async_op=False: calls.append(t) or "work")
    split = stepsplit.StepSplit(lambda record: None, lambda: 0)
    current = [None]
    stepsplit.patch_collectives(module, lambda: current[0])
    assert module.all_reduce(1) == "work"  # no split: the call as it was
    current[0] = split
    split.enter()
    assert module.all_reduce(2) == "work" and calls == [1, 2]
    assert module.all_reduce.__name__ == "<lambda>" and module.all_reduce._torchdist_split
    stepsplit.patch_collectives(module, lambda: current[0])  # patched once only
    assert module.all_reduce(3) == "work" and calls == [1, 2, 3]


# -- the driver's side: the state and the stragglers ------------------------------------------------


def split_state(ranks=3):
    clock = Clock()
    state = RunState("9-split", ranks, clock=clock)
    for r in range(ranks):
        running(state, r, f"node-{r}")
    return state, clock


def send_splits(state, clock, seconds, splits):
    for _ in range(int(seconds / 0.5)):
        clock.now += 0.5
        for r, (data, compute, comm) in enumerate(splits):
            state.apply(
                events.StepSplit(
                    rank=r,
                    data=data,
                    compute=compute,
                    comm=comm,
                    seconds=3.0,
                    steps=30,
                    step_s=clock.now,
                    data_s=data * clock.now,
                    comm_s=comm * clock.now,
                )
            )


def test_a_rank_waiting_for_data_is_named_with_its_share_and_the_others():
    state, clock = split_state()
    send_splits(state, clock, P.SLOW_FOR + 1, [(0.03, 0.07, 0.9), (0.62, 0.35, 0.03), (0.02, 0.08, 0.9)])
    (slow,) = state.stragglers()
    assert slow.rank == 1 and slow.why.startswith("waiting for data: 62 % of its step (others 2 %), for ")
    assert state.ranks[1].step_split == {"data": 0.62, "compute": 0.35, "comm": 0.03}
    assert state.snapshot().ranks[1].step_split == state.ranks[1].step_split


def test_a_rank_that_computes_while_the_others_wait_is_slow_compute_and_the_waiters_are_not_listed():
    state, clock = split_state(4)
    send_splits(
        state, clock, P.SLOW_FOR + 1, [(0.01, 0.2, 0.79), (0.01, 0.2, 0.79), (0.01, 0.95, 0.04), (0.01, 0.2, 0.79)]
    )
    (slow,) = state.stragglers()
    assert slow.rank == 2 and slow.why.startswith(
        "slow compute: 95 % of its step computing (others 20 %), while the others wait in communication "
        "(79 % of their step)"
    )


def test_equal_splits_list_nobody_also_when_every_rank_waits_for_data():
    state, clock = split_state()
    send_splits(state, clock, P.SLOW_FOR + 1, [(0.5, 0.3, 0.2)] * 3)
    assert state.stragglers() == []


# -- real ranks ---------------------------------------------------------------------------------------


def ddp_train(slow, steps):
    """3 DDP ranks over a data loader, ``steps`` steps; rank 1's items take 15 ms each
    (``slow="data"``) or its steps 60 ms more computation (``slow="compute"``)."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchdist_magic import progress, rank

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            if slow == "data" and rank() == 1:
                time.sleep(0.015)
            return torch.ones(8)

    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(8, 1))
    for step, x in enumerate(progress(torch.utils.data.DataLoader(Items(), batch_size=4), desc="step")):
        if slow == "compute" and rank() == 1:
            end = time.perf_counter() + 0.06
            while time.perf_counter() < end:  # computing, as far as anything can tell
                pass
        model(x).sum().backward()
        if step == steps:  # every rank at the same step: one more would wait for a peer gone
            break
    dist.destroy_process_group()
    return rank()


@pytest.mark.parametrize("slow, why", [("data", "waiting for data: "), ("compute", "slow compute: ")])
def test_real_ranks_name_the_rank_that_holds_the_others_up_and_why(monkeypatch, slow, why):
    monkeypatch.setattr(P, "SLOW_FOR", 1.5)  # the rules as they are, on a shorter time scale
    run = submit(ddp_train, (slow, 80), {}, LaunchOptions(num_processes=3, backend="local"))
    assert follow(run) == 0
    splits = [rs.step_split for rs in run.state.ranks]
    assert all(s is not None and sum(s.values()) == pytest.approx(1.0) for s in splits), splits
    share = "data" if slow == "data" else "compute"
    assert splits[1][share] > 0.5 and splits[1]["comm"] < 0.3, splits
    assert all(splits[r]["comm"] > 0.5 for r in (0, 2)), splits  # the others wait in DDP's all-reduce
    listed = run.state.stragglers()
    assert [s.rank for s in listed] == [1] and listed[0].why.startswith(why), listed
    assert_no_survivors(run)


def test_the_views_show_each_ranks_split_and_the_extremes_across_ranks():
    from torchdist_magic.view.model import system_text
    from torchdist_magic.driver.summary import overview
    from torchdist_magic.view.text import summary

    state, clock = split_state()
    send_splits(state, clock, 1.0, [(0.03, 0.07, 0.9), (0.62, 0.35, 0.03), (0.02, 0.08, 0.9)])
    snap = state.snapshot()
    assert system_text(snap.ranks[1]) == "data 62% compute 35% comm 3%"
    assert "data 62% compute 35% comm 3%" in summary(state)  # the small view's row of rank 1
    shown = {item.key: item.text for item in overview(snap).system}
    assert shown["data"] == "waiting for data: min 2% (rank 2), median 3%, max 62% (rank 1), 3 ranks"
    assert shown["comm"] == "waiting in communication: min 3% (rank 1), median 90%, max 90% (rank 2), 3 ranks"
    assert shown["compute"].startswith("computing: min 7% (rank 0)")


@pytest.mark.spark
def test_on_spark_the_rank_waiting_for_data_is_named_and_the_run_has_its_goodput(spark_local2, monkeypatch):
    from helpers import assert_nothing_left
    from torchdist_magic import Distributor

    monkeypatch.setattr(P, "SLOW_FOR", 1.5)
    run = Distributor(2, local_mode=False, show=None).submit(ddp_train, "data", 80)
    assert run.result(timeout=300) == 0
    splits = [rs.step_split for rs in run.state.ranks]
    assert splits[1]["data"] > 0.5 and splits[0]["comm"] > 0.5, splits
    listed = run.state.stragglers()
    assert [s.rank for s in listed] == [1] and listed[0].why.startswith("waiting for data: "), listed
    parts = run.goodput
    assert parts["data_stall_s"] == run.state.ranks[1].step_totals["data_s"] > 80 * 4 * 0.015
    assert_nothing_left(run)
