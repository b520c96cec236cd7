"""What a rank keeps always on, kept cheap: its collective record from torch's per-group count and
the rank's ring (``collring``) rather than torch's Flight Recorder (now ``--trace-collectives``),
and its ``report()`` points sent in one record per interval (``runtime._ReportBatch``).  Real
ranks where the record matters; a collecting sink for the batch.  Costs are measured in
``benchmarks/rank_overhead.py``, never asserted here."""

import os
import threading

from helpers import assert_no_survivors, wait_until
from torchdist_magic.core import events
from torchdist_magic.rank import runtime
from torchdist_magic.rank.collectives import RING_NOTE


def records_after_python_and_ddp_collectives():
    import torch
    import torch.distributed as dist

    from torchdist_magic.rank import collectives, runtime

    dist.init_process_group("gloo")
    t = torch.ones(3, 2)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    after_python = collectives.record(runtime.rank())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.ones(5, 4)).sum().backward()  # DDP's broadcast and all-reduce run in C++
    after_ddp = collectives.record(runtime.rank())
    return os.environ.get("TORCH_FR_BUFFER_SIZE"), after_python, after_ddp


def test_the_record_names_what_python_called_and_counts_what_ran_in_cpp(local_distributor):
    run = local_distributor(2).submit(records_after_python_and_ddp_collectives)
    recorder, after_python, after_ddp = run.result(timeout=180)
    assert recorder is None  # torch's Flight Recorder stays off unless asked
    assert after_python.source == "flight recorder" and after_python.note == RING_NOTE
    (group,) = after_python.groups
    assert group == events.GroupCollectives(
        group="default group", entered=2, finished=2, op="broadcast", sizes=[[3, 2]]
    )
    (group,) = after_ddp.groups
    assert group.entered > 2 and group.op == "" and group.sizes == []  # counted, not named
    assert_no_survivors(run)


def test_trace_collectives_keeps_torchs_flight_recorder(local_distributor):
    run = local_distributor(2, trace_collectives=True).submit(records_after_python_and_ddp_collectives)
    recorder, after_python, after_ddp = run.result(timeout=180)
    assert recorder == "256" and after_python.note == "" and after_python.source == "flight recorder"
    assert after_python.groups[0].entered == 2 and after_python.groups[0].op == "broadcast"
    assert after_ddp.groups[0].op != ""  # the recorder names what ran in C++ too
    assert_no_survivors(run)


def one_waits(waiter):
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(10)
    for _ in range(3):
        dist.all_reduce(t)
    print("three done", flush=True)
    if runtime.rank() != waiter:
        time.sleep(600)
    dist.all_reduce(t)


def test_a_rank_inside_a_collective_is_in_it_and_the_rank_outside_finished_its_last(local_distributor):
    run = local_distributor(2).submit(one_waits, 0)
    wait_until(lambda: all("three done" in run.logs(r) for r in range(2)), 120, "both ranks past three all_reduces")
    found = wait_until(lambda: run.culprit() or None, 60, "the records to name the rank behind")
    assert found.suspects == (1,)
    assert found.summary == (
        "rank 0: in #4 all_reduce [10], finished #3 (default group)",
        "rank 1: last collective #3 all_reduce [10], finished (default group)",
    ), found.summary
    run.cancel()
    run.wait(60)
    assert_no_survivors(run)


class Collect:
    def __init__(self):
        self.records = []

    def send(self, record):
        self.records.append(record)


def test_report_points_go_as_one_record_per_interval_and_a_lone_point_goes_too():
    sink = Collect()
    runtime._install_sink(sink)
    try:
        runtime.report(loss=1.0)
        runtime.report(loss=float("nan"), lr=0.1)
        runtime.report(step=9, lr=0.2)
        runtime.flush_reports()
        (record,) = [r for r in sink.records if isinstance(r, events.Metrics)]
        assert record.names == ["loss", "lr"] and record.steps == [1, 2, 9] and not record.malformed()
        assert record.values == [[1.0, "nan", None], [None, 0.1, 0.2]]
        runtime.report(loss=0.5)  # nothing else follows: the batch's thread sends it
        wait_until(lambda: len([r for r in sink.records if isinstance(r, events.Metrics)]) == 2, 10, "the lone point")
        assert sink.records[-1].steps == [3] and sink.records[-1].values == [[0.5]]
        assert any(t.name == "torchdist-report" for t in threading.enumerate())
    finally:
        runtime._install_sink(None)
    runtime.report(loss=2.0)  # no run: nothing kept, nothing sent
    assert len([r for r in sink.records if isinstance(r, events.Metrics)]) == 2


def test_points_with_the_same_names_go_as_one_column_each_with_nan_and_inf_as_text():
    sink = Collect()
    runtime._install_sink(sink)
    try:
        runtime.report(loss=1.0, lr=0.5)
        runtime.report(loss=float("inf"), lr=0.25)
        runtime.report(lr=0.125, loss=2)  # the same names in another order, an int
        runtime.report(loss=1e308, lr=1e308)  # finite values whose sum is not
        runtime.flush_reports()
        (record,) = [r for r in sink.records if isinstance(r, events.Metrics)]
    finally:
        runtime._install_sink(None)
    assert record.names == ["loss", "lr"] and record.steps == [1, 2, 3, 4] and not record.malformed()
    assert record.values == [[1.0, "inf", 2.0, 1e308], [0.5, 0.25, 0.125, 1e308]]
