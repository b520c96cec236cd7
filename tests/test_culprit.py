"""Which rank holds the others up: the verdict over the ranks' collective records (pure), the
records themselves (torch's Flight Recorder on gloo), and real runs where a rank is behind, a
rank calls another collective, a collective times out on the others, and a rank left."""

import datetime
import os
import pickle
import re
import time

import pytest

from helpers import assert_no_survivors, rank_failure_of
from torchdist_magic import HangTimeout, JobTimeout, RankFailure, rank
from torchdist_magic.rank.collectives import collective_in_stack, groups_from_trace
from torchdist_magic.core.culprit import is_collective_timeout, rank_list, verdict
from torchdist_magic.core.events import Collectives, GroupCollectives, Stacks
from torchdist_magic.core.failure import Failure


def fr(rank, entered, finished, op="all_reduce", sizes=((10,),), group="default group"):
    return Collectives(
        rank=rank,
        source="flight recorder",
        time=1.0,
        groups=[
            GroupCollectives(group=group, entered=entered, finished=finished, op=op, sizes=[list(s) for s in sizes])
        ],
    )


# -- the verdict, from records ---------------------------------------------------------------------
def test_a_rank_behind_is_named_with_where_the_others_wait():
    records = {0: fr(0, 4, 3), 1: fr(1, 4, 3), 2: fr(2, 3, 3), 3: fr(3, 4, 3)}
    found = verdict(records, range(4))
    assert found.kind == "behind" and found.suspects == (2,)
    assert found.sentence == (
        "rank 2 is behind: its last collective was #3 all_reduce; ranks 0, 1, 3 wait in #4 all_reduce (default group)"
    )
    assert found.summary == (
        "ranks 0, 1, 3: in #4 all_reduce [10], finished #3 (default group)",
        "rank 2: last collective #3 all_reduce [10], finished (default group)",
    )


def test_a_rank_that_entered_no_collective_is_behind():
    found = verdict({0: fr(0, 1, 0), 1: Collectives(rank=1, source="flight recorder", time=1.0)}, range(2))
    assert found.suspects == (1,)
    assert (
        found.sentence
        == "rank 1 is behind: it entered no collective yet; rank 0 waits in #1 all_reduce (default group)"
    )


def test_a_timed_out_collective_still_counts_as_where_the_ranks_wait():
    """The recorder marks a collective that timed out as finished; the rank behind is still behind."""
    found = verdict({0: fr(0, 4, 4), 1: fr(1, 3, 3), 2: fr(2, 4, 4)}, range(3))
    assert found.suspects == (1,) and "ranks 0, 2 wait in #4 all_reduce" in found.sentence


def test_a_mismatch_names_the_odd_rank():
    records = {0: fr(0, 4, 3), 1: fr(1, 4, 3, op="broadcast"), 2: fr(2, 4, 3)}
    found = verdict(records, range(3))
    assert found.kind == "mismatch" and found.suspects == (1,)
    assert found.sentence == "collective mismatch at #4: rank 1 in broadcast, ranks 0, 2 in all_reduce (default group)"


def test_a_mismatch_of_sizes_shows_the_sizes():
    records = {0: fr(0, 2, 1), 1: fr(1, 2, 1), 2: fr(2, 2, 1, sizes=((20,),))}
    found = verdict(records, range(3))
    assert found.suspects == (2,)
    assert found.sentence == (
        "collective mismatch at #2: rank 2 in all_reduce [20], ranks 0, 1 in all_reduce [10] (default group)"
    )


def test_a_rank_that_left_is_named_with_how_it_left():
    records = {0: fr(0, 4, 3), 1: fr(1, 4, 3), 2: fr(2, 3, 3)}
    found = verdict(records, range(4), exited={2: "exited with code 0", 3: "exited with code 0"})
    assert found.kind == "exited" and found.suspects == (2, 3)
    assert found.sentence == (
        "ranks 2, 3 have left (exited with code 0); ranks 0, 1 wait in #4 all_reduce (default group)"
    )


def test_ranks_in_step_point_at_nobody():
    found = verdict({r: fr(r, 5, 5) for r in range(4)}, range(4))
    assert not found and found.suspects == () and found.sentence == ""
    assert found.summary == ("ranks 0-3: last collective #5 all_reduce [10], finished (default group)",)
    assert not verdict({}, range(2))


def test_another_group_is_named_when_the_default_one_is_in_step():
    records = {
        r: Collectives(
            rank=r,
            source="flight recorder",
            time=1.0,
            groups=[
                GroupCollectives(group="default group", entered=2, finished=2, op="barrier"),
                GroupCollectives(group="tp", entered=7 if r != 1 else 6, finished=6, op="all_gather"),
            ],
        )
        for r in range(3)
    }
    found = verdict(records, range(3))
    assert found.suspects == (1,)
    assert (
        found.sentence
        == "rank 1 is behind: its last collective was #6 all_gather; ranks 0, 2 wait in #7 all_gather (tp)"
    )


def test_stack_records_name_the_rank_outside_any_collective_and_a_mismatch():
    def stack(r, op):
        return Collectives(rank=r, source="stack", in_collective=op, time=1.0)

    found = verdict({0: stack(0, "all_reduce"), 1: stack(1, ""), 2: stack(2, "all_reduce")}, range(3))
    assert found.suspects == (1,)
    assert found.sentence == "rank 1 is in no collective; ranks 0, 2 wait in all_reduce (from the ranks' stacks)"
    found = verdict({0: stack(0, "all_reduce"), 1: stack(1, "broadcast"), 2: stack(2, "all_reduce")}, range(3))
    assert found.kind == "mismatch" and found.suspects == (1,)
    assert (
        found.sentence == "collective mismatch: rank 1 in broadcast, ranks 0, 2 in all_reduce (from the ranks' stacks)"
    )


def test_at_1024_ranks_the_sentence_and_the_summary_stay_short():
    records = {r: fr(r, 100, 99) for r in range(1024)}
    records[700] = fr(700, 99, 99)
    found = verdict(records, range(1024))
    assert found.suspects == (700,)
    assert found.sentence == (
        "rank 700 is behind: its last collective was #99 all_reduce; "
        "ranks 0-699, 701-1023 wait in #100 all_reduce (default group)"
    )
    assert len(found.summary) == 2


def test_rank_lists():
    assert rank_list([3]) == "rank 3"
    assert rank_list([0, 1, 3]) == "ranks 0, 1, 3"
    assert rank_list([5, 0, 1, 2, 7, 8]) == "ranks 0-2, 5, 7, 8"


def test_collective_timeouts_are_recognised():
    def failure(message):
        return Failure(rank=0, exc_type="RuntimeError", message=message)

    assert is_collective_timeout(
        failure("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation to complete")
    )
    assert is_collective_timeout(failure("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(...)"))
    assert not is_collective_timeout(failure("bad batch"))
    aborted = Failure(
        rank=1,
        exit_code=-6,
        log_tail=[
            "[rank1]:[E ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=4, OpType=ALLREDUCE, Timeout(ms)=10000) ran for 10005 milliseconds before timing out."
        ],
    )
    assert is_collective_timeout(aborted) and not is_collective_timeout(Failure(rank=1, exit_code=-6))


def test_the_flight_recorders_dump_becomes_each_groups_state():
    def entry(seq, retired, op="all_reduce", group=("0", "default_pg"), p2p=False):
        return {
            "collective_seq_id": seq,
            "profiling_name": f"gloo:{op}",
            "process_group": list(group),
            "input_sizes": [[4, 2]],
            "retired": retired,
            "is_p2p": p2p,
        }

    trace = {
        "entries": [
            entry(1, True),
            entry(2, True),
            entry(3, False, "broadcast"),
            entry(0, False, "send", p2p=True),
            entry(1, False, "all_gather", ("1", "tp")),
        ]
    }
    assert groups_from_trace(trace) == [
        GroupCollectives(group="default group", entered=3, finished=2, op="broadcast", sizes=[[4, 2]]),
        GroupCollectives(group="tp", entered=1, finished=0, op="all_gather", sizes=[[4, 2]]),
    ]
    assert groups_from_trace({}) == []


def test_a_stack_names_the_outermost_collective():
    assert collective_in_stack(None) == ""
    import sys

    assert collective_in_stack(sys._getframe()) == ""


# -- the errors lead with the verdict --------------------------------------------------------------
def _stacks(n, where):
    return {
        r: Stacks(
            rank=r,
            text=f'Current thread 0x1 (most recent call first):\n  File "/a/t.py", line {where(r)} in f\n',
            main_thread=1,
        )
        for r in range(n)
    }


def test_a_hang_leads_with_the_verdict_and_groups_the_other_ranks():
    found = verdict({0: fr(0, 4, 3), 1: fr(1, 4, 3), 2: fr(2, 3, 3), 3: fr(3, 4, 3)}, range(4))
    err = HangTimeout(8, _stacks(4, lambda r: 9 if r == 2 else 5), 4, verdict=found)
    assert err.suspects == (2,)
    text = str(err)
    assert text.startswith(
        "Rank 2 is behind: its last collective was #3 all_reduce; ranks 0, 1, 3 wait in "
        "#4 all_reduce (default group). No rank sent progress, metrics or output for 8 s "
        "(hang_timeout); every rank was stopped. Where each rank was"
    )
    assert "\n  rank 2: f (/a/t.py, line 9)\n  ranks 0, 1, 3: f (/a/t.py, line 5)\n" in text
    rendered = err._render_traceback_()
    assert rendered.count("--- rank 2, main thread (most recent call last) ---") == 1
    assert not any(line.startswith("--- rank 0") for line in rendered)
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == text and again.suspects == (2,)
    timeout = JobTimeout(30, "", _stacks(4, lambda r: 5), 4, verdict=found)
    assert str(timeout).startswith("Rank 2 is behind: ") and timeout.suspects == (2,)
    assert str(pickle.loads(pickle.dumps(timeout))) == str(timeout)
    assert HangTimeout(8, {}, 2).suspects == ()


def test_at_many_ranks_a_hang_shows_a_few_suspects_stacks_and_groups_the_rest():
    records = {r: fr(r, 9 if r < 1000 else 8, 8) for r in range(1024)}
    found = verdict(records, range(1024))
    assert found.suspects == tuple(range(1000, 1024))
    err = HangTimeout(8, _stacks(1024, lambda r: 9 if r >= 1000 else 5), 1024, verdict=found)
    text = str(err)
    assert text.startswith(
        "Ranks 1000-1023 are behind: their last collective was #8 all_reduce; ranks 0-999 wait "
        "in #9 all_reduce (default group)."
    )
    assert "\n  ranks 0-999: f (/a/t.py, line 5)\n  ranks 1008-1023: f (/a/t.py, line 9)\n" in text
    assert len(text.splitlines()) < 20
    assert sum(line.startswith("--- rank ") for line in err._render_traceback_()) == 8


def test_a_rank_failure_leads_with_the_verdict():
    found = verdict({0: fr(0, 4, 4), 1: fr(1, 3, 3)}, range(2))
    behind = Failure(rank=1, host="h", message=found.sentence, traceback='  File "/a/t.py", line 9, in load')
    timed_out = Failure(rank=0, host="h", exc_type="RuntimeError", message="Timed out waiting 8000ms for recv")
    err = RankFailure(behind, [timed_out], verdict=found)
    assert err.rank == 1 and err.suspects == (1,)
    text = str(err)
    assert text.startswith(
        "RankFailure: rank 1 is behind: its last collective was #3 all_reduce; rank 0 waits "
        "in #4 all_reduce (default group)\n\n--- stack of rank 1 ---\n"
    )
    assert "  rank 0 on h raised RuntimeError: Timed out waiting 8000ms for recv" in text
    assert pickle.loads(pickle.dumps(err)).suspects == (1,)
    assert RankFailure(timed_out).suspects == ()


# -- real ranks (gloo) -----------------------------------------------------------------------------
STEPS_BEFORE = 3


def one_rank_behind(behind, seconds=600.0, timeout_s=0.0):
    """Every rank does three all_reduces; rank ``behind`` then sits in its "data loader"
    while the others enter a fourth.  ``timeout_s``: the process group's own timeout."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s or 600))
    t = torch.ones(10)
    for _ in range(STEPS_BEFORE):
        dist.all_reduce(t)
    print("three done", flush=True)  # the hang watchdog's quiet counts from here
    if rank() == behind:
        load_next_batch(seconds)
    dist.all_reduce(t)


def load_next_batch(seconds):
    time.sleep(seconds)


def until_every_rank_waits(run, ranks, suspects):
    """Wait until each of ``ranks`` is past its three all_reduces and the records name
    ``suspects``: where the test wants the ranks before their quiet passes ``hang_timeout``."""
    from helpers import wait_until

    wait_until(
        lambda: all("three done" in run.logs(r) for r in range(ranks)) and run.culprit().suspects == suspects,
        180,
        f"the ranks' records to name {suspects} as the ranks behind",
        interval=0.5,
    )


def test_a_hang_names_the_rank_behind(local_distributor, run_clock):
    run = local_distributor(4, hang_timeout=600).submit(one_rank_behind, 2)
    until_every_rank_waits(run, 4, (2,))
    run_clock.expire()
    with pytest.raises(HangTimeout) as info:
        run.result(timeout=240)
    err = info.value
    assert err.suspects == (2,)
    assert str(err).startswith(
        "Rank 2 is behind: its last collective was #3 all_reduce; ranks 0, 1, 3 wait in "
        "#4 all_reduce (default group). No rank sent progress"
    ), str(err)
    assert "  rank 2: load_next_batch (" in str(err)
    assert re.search(r"\n  ranks 0, 1, 3: all_reduce \(torch/distributed/distributed_c10d\.py", str(err)), str(err)
    snap = run.state.snapshot()
    assert snap.verdict.suspects == (2,) and run.state.collectives[0].source == "flight recorder"
    assert_no_survivors(run)


def test_the_user_asks_which_rank_holds_the_others_up_while_the_run_goes_on(local_distributor):
    from helpers import wait_until

    run = local_distributor(3).submit(one_rank_behind, 1)
    wait_until(lambda: all("three done" in run.logs(r) for r in range(3)), 120, "every rank past three all_reduces")
    found = wait_until(lambda: run.culprit() or None, 30, "the ranks' records to say who is behind")
    assert found.suspects == (1,) and found.sentence.startswith("rank 1 is behind: its last collective was #3")
    assert not run.done() and run.state.snapshot().verdict == found and set(run.stacks) == {0, 1, 2}
    run.cancel()
    run.wait(60)
    assert_no_survivors(run)


def mismatched(odd):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(10)
    for _ in range(STEPS_BEFORE):
        dist.all_reduce(t)
    print("three done", flush=True)  # the hang watchdog's quiet counts from here
    if rank() == odd:
        dist.broadcast(t, src=0)
    else:
        dist.all_reduce(t)


def test_a_hang_in_mismatched_collectives_says_mismatch(local_distributor, run_clock):
    run = local_distributor(3, hang_timeout=600).submit(mismatched, 1)
    until_every_rank_waits(run, 3, (1,))
    run_clock.expire()
    with pytest.raises(HangTimeout) as info:
        run.result(timeout=240)
    err = info.value
    assert err.suspects == (1,), str(err)
    assert str(err).startswith(
        "Collective mismatch at #4: rank 1 in broadcast, ranks 0, 2 in all_reduce "
        "(default group). No rank sent progress"
    ), str(err)
    assert_no_survivors(run)


def test_a_collective_timeout_blames_the_rank_behind_not_the_first_to_time_out(local_distributor):
    run = local_distributor(4).submit(one_rank_behind, 2, 600.0, 5.0)
    failure = rank_failure_of(run, timeout=240)
    assert failure.rank == 2 and failure.suspects == (2,), str(failure)
    assert str(failure).startswith(
        "RankFailure: rank 2 is behind: its last collective was #3 all_reduce; "
        "ranks 0, 1, 3 wait in #4 all_reduce (default group)"
    ), str(failure)
    assert 'in load_next_batch' in failure.traceback
    assert any("Timed out waiting" in f.message for f in failure.failures[1:])
    assert run.state.snapshot().failure.rank == 2
    assert_no_survivors(run)


def leave_early(leaver):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(10)
    for _ in range(STEPS_BEFORE):
        dist.all_reduce(t)
    if rank() == leaver:
        os._exit(0)
    dist.all_reduce(t)


def test_a_rank_that_left_while_the_others_wait_is_named(local_distributor):
    run = local_distributor(3).submit(leave_early, 1)
    failure = rank_failure_of(run, timeout=240)
    assert failure.rank == 1 and failure.suspects == (1,), str(failure)
    # it left no record (os._exit): how it left is what is known
    assert str(failure).startswith(
        "RankFailure: rank 1 has left (exited with code 0); ranks 0, 2 wait in #4 all_reduce (default group)"
    ), str(failure)
    assert "  rank 1: no collective record; exited with code 0" in str(failure)
    assert_no_survivors(run)


def test_a_warm_pools_hang_names_the_rank_behind(local_distributor, run_clock):
    from torchdist_magic import pools, shutdown_pools

    try:
        local_distributor(3, warm=True).run(rank)  # the pool's start is no part of the hang
        (info,) = pools()
        run = local_distributor(3, warm=True, hang_timeout=600).submit(one_rank_behind, 1)
        until_every_rank_waits(run, 3, (1,))
        run_clock.expire()
        with pytest.raises(HangTimeout) as hung:
            run.result(timeout=240)
        assert hung.value.suspects == (1,), str(hung.value)
        assert re.match(
            r"Rank 1 is behind: its last collective was #\d+ all_reduce; ranks 0, 2 wait in #\d+ "
            r"all_reduce \(default group\)\. No rank sent progress",
            str(hung.value),
        ), str(hung.value)
    finally:
        shutdown_pools()
    assert_no_survivors(run, extra_pids=info.pids)


@pytest.mark.spark
def test_on_spark_a_collective_timeout_blames_the_rank_behind(spark_local2):
    from helpers import assert_nothing_left
    from torchdist_magic import Distributor

    run = Distributor(2, local_mode=False, show=None).submit(one_rank_behind, 1, 600.0, 5.0)
    failure = rank_failure_of(run, timeout=240)
    assert failure.rank == 1 and failure.suspects == (1,), str(failure)
    assert str(failure).startswith(
        "RankFailure: rank 1 is behind: its last collective was #3 all_reduce; "
        "rank 0 waits in #4 all_reduce (default group)"
    ), str(failure)
    assert "Timed out waiting" in failure.failures[1].message
    assert_nothing_left(run)


# -- the view, the summary and MLflow --------------------------------------------------------------
def test_the_failure_pane_and_the_summary_lead_with_the_culprit():
    from view_helpers import FakeRun
    from torchdist_magic.view import html as H
    from torchdist_magic.view import model as M
    from torchdist_magic.view.text import summary

    run = FakeRun(3)
    assert M.run_facts(run.state).culprit == ""
    found = verdict({0: fr(0, 4, 3), 1: fr(1, 3, 3), 2: fr(2, 4, 3)}, range(3))
    run.state.set_verdict(found)
    run.state.finish(
        "hung", message="no rank sent progress, metrics or output for 8 s (hang_timeout); every rank was stopped"
    )
    facts = M.run_facts(run.state)
    assert facts.culprit == found.sentence
    pane = H.failure_html(facts)
    assert pane.startswith('<div class="torchdist-culprit"')
    assert pane.index("Rank 1 is behind: its last collective was #3 all_reduce") < pane.index("no rank sent progress")
    assert "torchdist-culprit" in H.summary_html(run.state)
    text = summary(run.state)
    assert (
        "\n  culprit: rank 1 is behind: its last collective was #3 all_reduce; ranks 0, 2 wait in #4 "
        "all_reduce (default group)\n  no rank sent progress"
    ) in text


# -- NCCL (GPUs) -----------------------------------------------------------------------------------
def _cuda_count():
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_rank_behind(behind, timeout_s):
    import torch
    import torch.distributed as dist
    from torchdist_magic import local_rank

    torch.cuda.set_device(local_rank())
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=timeout_s))
    t = torch.ones(10, device="cuda")
    for _ in range(STEPS_BEFORE):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    if rank() == behind:
        load_next_batch(600)
    dist.all_reduce(t)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() < 2, reason="needs two CUDA devices (NCCL: one GPU per rank)")
def test_nccl_a_hang_and_a_watchdog_timeout_name_the_rank_behind(local_distributor):
    run = local_distributor(2, use_gpu=True, hang_timeout=8).submit(nccl_rank_behind, 1, 600)
    with pytest.raises(HangTimeout) as hung:
        run.result(timeout=300)
    assert hung.value.suspects == (1,), str(hung.value)
    assert str(hung.value).startswith("Rank 1 is behind: its last collective was #3 all_reduce"), str(hung.value)
    assert_no_survivors(run)
    run = local_distributor(2, use_gpu=True).submit(nccl_rank_behind, 1, 10)
    failure = rank_failure_of(run, timeout=300)
    assert failure.rank == 1 and failure.suspects == (1,), str(failure)
    assert_no_survivors(run)
