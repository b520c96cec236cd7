"""One run handle (driver/handle.py): a run held in this kernel (``Run``) and one attached from
its record and its supervising process's feed (``AttachedRun``, a real ``--detach`` run) answer
the same protocol, and every view (the text view, the widget's model, the summary a notebook
keeps) draws either one without asking which it holds."""

import io
import typing

import pytest

from torchdist_magic import Distributor, NotAvailable, RunHandle
from torchdist_magic.core.culprit import Verdict
from torchdist_magic.driver.distributor import Run
from torchdist_magic.handles.attach import AttachedRun
from torchdist_magic.view import widget as W
from torchdist_magic.view.text import TextView, summary_with_logs

from helpers import assert_no_survivors, assert_nothing_survives, touch, wait_until
from view_helpers import FakeRun, no_cpu


def steps_then_returns(marker):
    import os
    import time

    from torchdist_magic import progress, rank, report

    print(f"rank {rank()} says hello", flush=True)
    for step in progress(range(3), desc="steps"):
        report(loss=1.0 / (step + 1))
    while not os.path.exists(marker):
        time.sleep(0.05)
    return {"rank": rank(), "value": 42}


def protocol_members():
    """The names ``RunHandle`` declares: its methods and properties, and its attributes."""
    names = {name for name in vars(RunHandle) if not name.startswith("_")}
    return names | set(typing.get_type_hints(RunHandle))


def test_the_protocol_names_what_the_issue_asks_and_each_handle_has_every_member():
    asked = {"result", "exception", "cancel", "done", "wait", "logs", "state", "attempts", "culprit"}
    asked |= {"goodput", "preflight", "profile", "stacks"}
    assert asked <= protocol_members()
    for handle in (Run, AttachedRun, FakeRun):
        missing = {name for name in protocol_members() - {"run_id", "state"} if not hasattr(handle, name)}
        assert not missing, f"{handle.__name__} lacks {sorted(missing)}"


@pytest.fixture(params=["in the kernel", "attached"])
def handle(request, home, tmp_path):
    """A real run of two ranks, stopped before its end: in this kernel, or detached and
    attached to from its record and its supervising process's feed (a handle of its own, as
    another kernel would make)."""
    marker = str(tmp_path / "go")
    detach = request.param == "attached"
    run = Distributor(num_processes=2, show=None, detach=detach).submit(steps_then_returns, marker)
    handle = AttachedRun(run.run_id) if detach else run
    wait_until(lambda: "rank 1 says hello" in handle.logs(1), 120, "rank 1's first line")
    wait_until(lambda: all(rs.metrics for rs in handle.state.snapshot().ranks), 60, "both ranks' metrics")
    yield handle, marker
    touch(marker)  # the test's own checks may have failed before it let the ranks end
    assert handle.wait(120) and run.wait(60)
    if detach:
        assert_nothing_survives(run.run_id, run.record.pid)
    else:
        assert_no_survivors(run)


def test_every_view_draws_either_handle_and_each_answers_the_protocol(handle):
    run, marker = handle
    assert isinstance(run, RunHandle)
    # the protocol's answers, alike for both
    assert not run.done() and run.exception is None and run.wait(0) is False
    assert run.attempts == [] and run.stacks == {} and run.preflight is None and run.profile is None
    assert set(run.goodput) >= {"wall_s", "training_s"} and run.goodput["wall_s"] > 0
    assert isinstance(run.culprit(), Verdict)
    assert "rank 0 says hello" in run.logs(0)
    if isinstance(run, AttachedRun):
        assert run.can_profile is False
        with pytest.raises(NotAvailable, match="its ranks can be profiled from the start only"):
            run.start_profile(3)
    else:
        assert run.can_profile is True
    # the text view
    out = io.StringIO()
    text = TextView(run.state, out=out, err=io.StringIO())
    text.update()
    text.close()
    printed = out.getvalue()
    assert "np=2" in printed and "rank 1 says hello" in printed
    # the widget's model (drawn once as it is made)
    view = W.WidgetView(run, display=False, cpu_clock=no_cpu)
    assert view.renders == 1 and "np=2" in view.header.value and "loss" in view.rows.value
    assert (view.profile_button.layout.display == "") is run.can_profile
    view.close()
    # the summary a notebook keeps
    kept = summary_with_logs(run.state, log_hint="_torchdist_run.logs(rank)")
    assert kept.startswith("torchdist: running after ") and "_torchdist_run.logs(rank)" in kept
    assert "[rank 1] rank 1 says hello" in kept
    touch(marker)
    assert run.result(120) == {"rank": 0, "value": 42}
    assert run.done() and run.exception is None
    assert summary_with_logs(run.state).startswith("torchdist: succeeded after ")
