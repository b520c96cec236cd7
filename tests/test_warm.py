"""Warm pools (``--warm``, ``warm=True``): ranks that stay up from run to run.

The contract part runs on local processes, Spark ``local[2]``, ``local-cluster`` and Spark
Connect (``dist``); the rest on local processes.  After every test no pool and no process of a
pool is left.
"""

import os
import re
import signal
import sys

import pytest

from helpers import alive, cell, pids_of_run, wait_until
import torchdist_magic
from torchdist_magic import HangTimeout, JobTimeout, RankFailure, RunCancelled, pools, shutdown_pools
from torchdist_magic.core.options import OptionError


@pytest.fixture(autouse=True)
def _pools_end():
    """Stop every pool a test left, and check that their processes are gone."""
    yield
    left = pools()
    shutdown_pools()
    for info in left:
        wait_until(
            lambda: not pids_of_run(info.run_id) and not any(alive(p) for p in info.pids),  # noqa: B023
            15,
            f"the processes of {info.id} to end",
        )


def _stopped(info) -> bool:
    return not pids_of_run(info.run_id) and not any(alive(p) for p in info.pids)


# -- jobs ---------------------------------------------------------------------------------------


def where_and_keep(value):
    import os
    import sys

    import torch
    import torch.distributed as dist

    sys.torchdist_kept = value  # state on the rank, for the next job
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return os.getpid(), t.item()


def kept_and_group():
    import os
    import sys

    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return os.getpid(), getattr(sys, "torchdist_kept", None), t.item()


def torchdistributor_style():
    """What a function written for TorchDistributor does: its own init and destroy."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.tolist()


def raise_everywhere():
    import torch.distributed as dist

    raise ValueError(f"bad input on rank {dist.get_rank()}")


def test_warm_runs_reuse_the_ranks_keep_their_state_and_the_process_group(dist):
    d = dist(2, warm=True, all_ranks=True)
    first = d.submit(where_and_keep, "kept")
    values = first.result(timeout=180)
    pids = [pid for pid, _ in values]
    assert [total for _, total in values] == [3.0, 3.0]
    assert "(started for this run)" in first.state.backend
    (info,) = pools()
    assert info.num_processes == 2 and sorted(info.pids) == sorted(pids) and info.runs == 1

    second = d.submit(kept_and_group)
    assert second.result(timeout=60) == [(pids[0], "kept", 2.0), (pids[1], "kept", 2.0)]
    assert "(reused, run 2)" in second.state.backend
    for _ in range(2):  # init/destroy of its own, twice: the pool's group stays up
        assert d.run(torchdistributor_style) == [[2.0, 2.0], [2.0, 2.0]]

    # a job that raises on every rank: the error as on a cold run, and the pool stays
    with pytest.raises(RankFailure) as err:
        d.run(raise_everywhere)
    assert err.value.exc_type == "ValueError" and "bad input on rank" in err.value.message
    assert [pid for pid, _, _ in d.run(kept_and_group)] == pids
    assert pools()[0].runs == 6

    assert shutdown_pools() == [info.id]
    assert pools() == []
    wait_until(lambda: _stopped(info), 30, "the pool's processes to end")


def test_rank0_value_only_by_default_and_large_jobs_and_values_travel_in_pieces(local_distributor):
    import numpy as np

    data = np.arange(3 * 2**20 // 8, dtype=np.float64)  # 3 MiB: several pieces each way

    def echo(array):
        import torch.distributed as dist

        return array * (dist.get_rank() + 1)

    d = local_distributor(2, warm=True)
    for _ in range(2):
        out = d.run(echo, data)
        assert isinstance(out, np.ndarray) and np.array_equal(out, data)


def test_each_run_gets_its_own_output_complete_and_in_order(local_distributor):
    def chatter(tag, n):
        import sys

        for i in range(n):
            print(f"{tag} {i}")
        sys.stderr.write(f"{tag} done")  # no newline: the job's end still ends the line
        return n

    d = local_distributor(2, warm=True)
    runs = [d.submit(chatter, tag, 2000) for tag in ("one",)]
    assert runs[0].result(timeout=60) == 2000
    runs.append(d.submit(chatter, "two", 500))
    assert runs[1].result(timeout=60) == 500
    for run, tag, n in zip(runs, ("one", "two"), (2000, 500)):
        for rank in range(2):
            logs = run.state.ranks[rank].logs
            assert [line.text for line in logs if line.stream == "stdout"] == [f"{tag} {i}" for i in range(n)]
            assert [line.text for line in logs if line.stream == "stderr"] == [f"{tag} done"]
            assert "torchdist-output-end" not in run.logs(rank)


def mid_collective_failure():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 gave up before the all_reduce")
    dist.all_reduce(torch.ones(1))  # waits for rank 1 forever


def test_a_rank_left_in_a_collective_tears_the_pool_down(local_distributor):
    d = local_distributor(2, warm=True)
    d.run(kept_and_group)
    (info,) = pools()
    run = d.submit(mid_collective_failure)
    with pytest.raises(RankFailure) as err:
        run.result(timeout=60)
    assert err.value.rank == 1 and "gave up" in err.value.message  # the root cause, not the waiting rank
    assert f"[torchdist] warm {info.id} stopped (rank 0 was still in the job)" in run.logs(0)
    assert pools() == []
    wait_until(lambda: _stopped(info), 15, "the torn-down pool's processes to end")
    fresh = d.submit(kept_and_group)
    assert {pid for pid, _, _ in [fresh.result(timeout=120)]}.isdisjoint(info.pids)
    assert "(started for this run)" in fresh.state.backend


def append_line(path):
    import os

    with open(path, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    return os.getpid()


def test_ranks_that_died_between_runs_are_noticed_and_the_run_runs_once_on_a_fresh_pool(local_distributor, tmp_path):
    d = local_distributor(2, warm=True)
    d.run(kept_and_group)
    (info,) = pools()
    os.kill(info.pids[1], signal.SIGKILL)
    wait_until(lambda: not alive(info.pids[1]), 10, "the killed rank to end")
    log = tmp_path / "runs.txt"
    run = d.submit(append_line, str(log))
    pid = run.result(timeout=120)
    assert len(log.read_text().splitlines()) == 2  # once on each rank, not twice
    assert pid not in info.pids
    # the run's header says why it is on a fresh pool (the death was seen at once, or at this run)
    assert re.search(
        rf"warm pool-\d+ \(started for this run; {info.id} stopped: .* since its last run\)", run.state.backend
    ), run.state.backend
    wait_until(lambda: _stopped(info), 15, "the broken pool's other rank to end")


def sleep_long():
    import time

    time.sleep(600)


@pytest.mark.parametrize("how", ["timeout", "hang", "cancel"])
def test_a_timeout_hang_or_cancel_stops_the_pool_with_no_process_left(local_distributor, how):
    local_distributor(2, warm=True).run(kept_and_group)  # the pool's start is no part of the deadline
    (info,) = pools()
    d = local_distributor(
        2, warm=True, timeout=3.0 if how == "timeout" else None, hang_timeout=3.0 if how == "hang" else None
    )
    run = d.submit(sleep_long)
    if how == "cancel":
        wait_until(lambda: all(rs.state == "running" for rs in run.state.ranks), 30, "the ranks to run the job")
        run.cancel()
    with pytest.raises({"timeout": JobTimeout, "hang": HangTimeout, "cancel": RunCancelled}[how]) as err:
        run.result(timeout=60)
    if how != "cancel":  # every rank's stack, from the pool's ranks, says where they were
        assert "rank 0: sleep_long" in str(err.value) and "rank 1: sleep_long" in str(err.value)
    assert pools() == []
    wait_until(lambda: _stopped(info), 15, "the pool's processes to end")


def _run_dirs():
    import tempfile

    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("torchdist-")]


def test_an_idle_pool_stops_after_its_idle_timeout(local_distributor):
    from torchdist_magic.backends.pool import _pools

    d = local_distributor(2, warm=True, pool_idle_timeout=1.0)
    d.run(kept_and_group)
    (info,) = pools()
    pool = _pools[0]
    assert _run_dirs()
    # the timer's stop runs on its own thread: the pool stays listed (idle, then stopping) until
    # its ranks and its run directory are gone
    wait_until(lambda: pools() == [], 20, "the idle pool to stop")
    assert _stopped(info) and _run_dirs() == []
    assert pool.stop_reason == "it had run nothing for 1 s (pool_idle_timeout)"


def test_a_second_stop_returns_once_the_first_is_done(local_distributor):
    import threading

    from torchdist_magic.backends.pool import _pools

    local_distributor(2, warm=True).run(kept_and_group)
    (info,) = pools()
    pool = _pools[0]
    first = threading.Thread(target=pool.stop, args=("the first stop",))
    first.start()
    wait_until(lambda: pool.state != "idle", 10, "the first stop to begin")
    assert shutdown_pools() in ([info.id], [])  # [] only when the first stop was already done
    assert pools() == [] and _stopped(info) and _run_dirs() == []
    assert pool.stop_reason == "the first stop"
    first.join(10)
    assert not first.is_alive()


def test_another_placement_is_refused_naming_the_live_pool(local_distributor):
    local_distributor(2, warm=True).run(kept_and_group)
    (info,) = pools()
    with pytest.raises(
        ValueError,
        match=rf"a warm pool with another placement is live: {info.id}: np=2 .*"
        r"%torchdist_pool stop, or torchdist_magic.shutdown_pools\(\)",
    ):
        local_distributor(1, warm=True).run(kept_and_group)
    assert pools()[0].id == info.id  # untouched, and still serving its placement
    local_distributor(2, warm=True).run(kept_and_group)


def test_a_busy_pool_is_refused(local_distributor):
    d = local_distributor(2, warm=True)
    run = d.submit(sleep_long)
    try:
        with pytest.raises(ValueError, match=r"warm pool-\d+ is running another run"):
            d.submit(kept_and_group)
    finally:
        run.cancel()
        with pytest.raises(RunCancelled):
            run.result(timeout=60)


def test_bad_warm_settings_are_refused_before_anything_starts(local_distributor):
    with pytest.raises(OptionError, match="max_restarts starts every rank again"):
        local_distributor(2, warm=True, max_restarts=2)
    with pytest.raises(OptionError, match="pool_idle_timeout must be a positive number of seconds"):
        local_distributor(2, warm=True, pool_idle_timeout=0)
    with pytest.raises(OptionError, match="warm must be True or False"):
        local_distributor(2, warm="yes")
    assert pools() == []


# -- the magic ----------------------------------------------------------------------------------


def test_warm_cells_keep_rank_side_names_and_notebook_values_win(ip, capsys):
    for name in ("warm_weights", "warm_pid"):  # names only the ranks have (the shell is shared)
        ip.user_ns.pop(name, None)
    cell(ip, "import torch\nwarm_scale = 10")
    first = cell(
        ip,
        """
        %%torchdist --np 2 --warm --quiet
        warm_weights = torch.arange(3.0) * (rank + 1)   # defined on the ranks
        warm_scale = -1                                 # a rank-side name the notebook also has
        import os
        warm_pid = os.getpid()
        warm_weights.sum().item()
    """,
    )
    assert first.error_in_exec is None and first.result == 3.0
    second = cell(
        ip,
        """
        %%torchdist --np 2 --warm --all-ranks --quiet
        torch.distributed.all_reduce(warm_weights)
        (warm_weights.tolist(), warm_scale, warm_pid == os.getpid())
    """,
    )
    assert second.error_in_exec is None
    assert second.result == [([0.0, 3.0, 6.0], 10, True)] * 2  # notebook's warm_scale, rank-side warm_weights
    capsys.readouterr()
    ip.run_line_magic("torchdist_pool", "")
    shown = capsys.readouterr().out
    (info,) = pools()
    assert shown.startswith(f"{info.id}: np=2 on local processes") and "2 runs" in shown and "MiB" in shown
    ip.run_line_magic("torchdist_pool", "stop")
    assert capsys.readouterr().out.strip() == f"stopped {info.id}"
    assert pools() == []
    ip.run_line_magic("torchdist_pool", "")
    assert "no warm pool is running" in capsys.readouterr().out
    wait_until(lambda: _stopped(info), 15, "the stopped pool's processes to end")


def test_pool_magic_usage_and_placement_errors(ip):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="%torchdist_pool takes nothing, or 'stop'; got 'halt'"):
        ip.run_line_magic("torchdist_pool", "halt")
    assert cell(ip, "%%torchdist --np 2 --warm --quiet\n1").result == 1
    result = cell(ip, "%%torchdist --np 1 --warm --quiet\n1")
    assert isinstance(result.error_in_exec, UsageError)
    assert "a warm pool with another placement is live" in str(result.error_in_exec)
    result = cell(ip, "%%torchdist --np 2 --warm --max-restarts 1 --quiet\n1")
    assert "--max-restarts starts every rank again" in str(result.error_in_exec)


def test_unload_ext_stops_the_pools(ip):
    shell = ip  # the module's shell (started before this test's temp dir: its history file lives on)
    try:
        assert cell(shell, "%%torchdist --np 2 --warm --quiet\n2").result == 2
        (info,) = pools()
    finally:
        shell.run_line_magic("unload_ext", "torchdist_magic")
    try:
        assert pools() == []
        wait_until(lambda: _stopped(info), 15, "the pool's processes to end")
    finally:  # the shell is shared by every test module: leave it as the ``ip`` fixture made it
        shell.run_line_magic("load_ext", "torchdist_magic")
        shell.run_line_magic("config", "TorchdistMagics.view = 'text'")


def test_a_pool_does_not_outlive_its_python_process(tmp_path):
    """Kernel shutdown: the interpreter exits and takes its pools along (atexit)."""
    import subprocess

    script = tmp_path / "k.py"
    script.write_text(
        "from torchdist_magic import Distributor, pools\n"
        "Distributor(2, local_mode=True, show=None, warm=True).run(lambda: 1)\n"
        "info, = pools()\n"
        "print(info.run_id, *info.pids, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(
            os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(torchdist_magic.__file__))
        ),  # the copy under test
    )
    assert out.returncode == 0, out.stderr
    run_id, *pids = out.stdout.split()
    assert len(pids) == 2
    wait_until(
        lambda: not pids_of_run(run_id) and not any(alive(int(p)) for p in pids), 15, "the exited kernel's pool to end"
    )


# -- Spark: the pool is one long-lived barrier stage ----------------------------------------------


@pytest.mark.spark
def test_a_spark_pool_holds_its_slots_and_gives_them_back_when_torn_down(spark_local2):
    from torchdist_magic import Distributor

    warm = Distributor(2, local_mode=False, show=None, warm=True)
    cold = Distributor(1, local_mode=False, show=None)
    warm.run(kept_and_group)
    (info,) = pools()
    assert info.where.startswith("Spark job tag torchdist-") and info.memory_bytes is None
    # local[2] has two slots and the pool holds both: a cold run would wait for them forever
    with pytest.raises(
        ValueError,
        match=rf"1 ranks need 1 free Spark task slots, but warm {info.id} holds 2 "
        r"of this cluster's 2; stop it first",
    ):
        cold.run(kept_and_group)
    run = warm.submit(mid_collective_failure)
    with pytest.raises(RankFailure) as err:
        run.result(timeout=120)
    assert err.value.rank == 1 and "gave up" in err.value.message
    assert pools() == []
    wait_until(lambda: _stopped(info), 30, "the Spark pool's ranks to end")
    assert cold.run(lambda: 7) == 7  # the slots are free again


# -- the views say warm or cold ---------------------------------------------------------------------


def test_the_text_view_and_the_panel_say_whether_a_run_was_warm(ip, capsys):
    from torchdist_magic.core.options import LaunchOptions
    from torchdist_magic import panel as P

    cell(ip, "%%torchdist --np 2 --warm\n1")
    out = capsys.readouterr().out
    assert "on warm pool-" in out and "(started for this run) of local processes" in out
    cell(ip, "%%torchdist --np 2\n1")
    assert "warm" not in capsys.readouterr().out  # a cold run is on its backend only

    panel = P.LaunchPanel(ip, LaunchOptions())
    panel.controls["num_processes"].value = 2
    panel.controls["warm"].value = True
    panel.code.value = "rank + 40"
    assert "%%torchdist --np 2 --warm" in panel.command.value  # the equivalent cell
    run = panel.launch()
    assert run is not None and panel.wait(60) and panel.value == 40
    assert "reused, run 2" in panel._view.header.value and "torchdist-backend" in panel._view.header.value


def test_a_warm_run_with_a_dataframe_or_columns_without_data_is_refused(local_distributor):
    import pandas as pd

    from torchdist_magic.driver.distributor import submit

    with pytest.raises(ValueError, match="a warm run cannot train on a DataFrame: the pool's ranks were started"):
        local_distributor(2, warm=True).train_on_dataframe(kept_and_group, pd.DataFrame({"x": [1.0, 2.0]}))
    with pytest.raises(ValueError, match="columns name columns of the data to train on, and no data was given"):
        submit(kept_and_group, (), {}, local_distributor(2).options, columns=["x"])
    assert pools() == []


def test_a_pool_stopped_before_its_first_run_started_fails_that_run_clearly(local_distributor):
    from torchdist_magic.core.job import build_job
    from torchdist_magic.driver.distributor import Run
    from torchdist_magic.backends.pool import warm_backend

    options = local_distributor(2, warm=True).options
    backend = warm_backend(options)
    shutdown_pools()  # e.g. from another thread, between the reservation and the start
    run = Run(build_job(kept_and_group, (), {}), options, backend, backend.check(options))
    run._start()
    with pytest.raises(RuntimeError, match=r"warm pool-\d+ was stopped: shutdown_pools\(\)"):
        run.result(timeout=30)
    assert pools() == []


def test_a_reservation_released_unused_leaves_no_pool(local_distributor):
    """A run that ends before its start (a bad argument, a cancel) gives back the new pool."""
    from torchdist_magic.backends.pool import warm_backend

    backend = warm_backend(local_distributor(2, warm=True).options)
    assert [info.state for info in pools()] == ["new"]
    backend.release()
    assert pools() == []
    local_distributor(2, warm=True).run(kept_and_group)
    (info,) = pools()
    assert info.id != backend.pool.id and info.runs == 1


def test_a_serving_worker_without_a_channel_says_what_it_needs(tmp_path):
    import subprocess

    import cloudpickle

    from torchdist_magic.core.job import serve_job

    job = tmp_path / "job.pkl"
    job.write_bytes(cloudpickle.dumps(serve_job()))
    env = {k: v for k, v in os.environ.items() if k != "TORCHDIST_CHANNEL"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-m", "torchdist_magic.rank.worker", str(job), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    assert "a warm pool's rank needs the driver's event channel (TORCHDIST_CHANNEL)" in out.stderr


# -- what one warm run leaves for the next ----------------------------------------------------------

ENV_NAMES = ("TORCHDIST_TEST_EXTRA", "TORCHDIST_TEST_OVERRIDDEN", "TORCHDIST_TEST_OWN", "TORCHDIST_ENV_BEFORE")


def environment_and_own_variable():
    """The job's view of ``ENV_NAMES``; then it sets a variable of its own."""
    import os

    seen = {name: os.environ.get(name) for name in ENV_NAMES}
    os.environ["TORCHDIST_TEST_OWN"] = "set by a job"
    return os.getpid(), seen


def test_env_of_a_warm_run_is_set_for_its_job_only(local_distributor, monkeypatch):
    monkeypatch.setenv("TORCHDIST_TEST_OVERRIDDEN", "notebook")  # the ranks' own environment
    monkeypatch.delenv("TORCHDIST_TEST_EXTRA", raising=False)
    monkeypatch.delenv("TORCHDIST_TEST_OWN", raising=False)
    with_env = local_distributor(
        2, warm=True, all_ranks=True, env={"TORCHDIST_TEST_EXTRA": "1", "TORCHDIST_TEST_OVERRIDDEN": "run"}
    )
    plain = local_distributor(2, warm=True, all_ranks=True)

    def seen(distributor):
        values = distributor.run(environment_and_own_variable)
        return [pid for pid, _ in values], [env for _, env in values]

    # the run that starts the pool: its --env is in the ranks' environment from their start
    pids, envs = seen(with_env)
    assert (
        envs
        == [
            {
                "TORCHDIST_TEST_EXTRA": "1",
                "TORCHDIST_TEST_OVERRIDDEN": "run",
                "TORCHDIST_TEST_OWN": None,
                "TORCHDIST_ENV_BEFORE": None,
            }
        ]
        * 2
    )
    # the next run has no --env: neither the variable nor the override is left; what the job's own
    # code set stays, like the names it defines
    expected = [
        {
            "TORCHDIST_TEST_EXTRA": None,
            "TORCHDIST_TEST_OVERRIDDEN": "notebook",
            "TORCHDIST_TEST_OWN": "set by a job",
            "TORCHDIST_ENV_BEFORE": None,
        }
    ] * 2
    assert seen(plain) == (pids, expected)
    # a later run's --env is undone after its job too
    assert seen(with_env)[1] == [dict(expected[0], TORCHDIST_TEST_EXTRA="1", TORCHDIST_TEST_OVERRIDDEN="run")] * 2
    assert seen(plain) == (pids, expected)
    (info,) = pools()
    assert info.runs == 4
    assert shutdown_pools() == [info.id]
    wait_until(lambda: _stopped(info), 30, "the pool's processes to end")


def rank_variables():
    import os

    return os.environ["RANK"], os.environ["TORCHDIST_RUN_ID"], os.environ.get("TORCHDIST_TEST_EXTRA")


def test_a_warm_runs_env_cannot_override_the_runs_own_variables(local_distributor):
    """As on a cold run, where ``env`` never wins over ``RANK`` and the like."""
    plain = local_distributor(2, warm=True, all_ranks=True)
    first = plain.run(rank_variables)
    meddling = local_distributor(
        2, warm=True, all_ranks=True, env={"RANK": "9", "TORCHDIST_RUN_ID": "x", "TORCHDIST_TEST_EXTRA": "1"}
    )
    assert meddling.run(rank_variables) == [(r, first[0][1], "1") for r in ("0", "1")]
    (info,) = pools()
    assert shutdown_pools() == [info.id]
    wait_until(lambda: _stopped(info), 30, "the pool's processes to end")


def report_three(first_loss):
    from torchdist_magic import report

    for i in range(3):
        report(loss=first_loss + i)


def test_report_steps_start_again_in_each_warm_run(local_distributor):
    d = local_distributor(2, warm=True)
    runs = []
    for first_loss in (10.0, 20.0):
        runs.append(d.submit(report_three, first_loss))
        runs[-1].result(timeout=120)
    for run, first_loss in zip(runs, (10.0, 20.0)):
        for rs in run.state.ranks:
            assert rs.history["loss"].pairs() == [(1, first_loss), (2, first_loss + 1), (3, first_loss + 2)]
    (info,) = pools()
    assert info.runs == 2
    assert shutdown_pools() == [info.id]
    wait_until(lambda: _stopped(info), 30, "the pool's processes to end")


# -- cells on some ranks of a warm pool (--ranks, ranks=) ------------------------------------------


def keep_rank_state():
    import os
    import sys

    import torch.distributed as dist

    sys.torchdist_kept = dist.get_rank() * 10
    return os.getpid()


def bump_and_say():
    import os
    import sys

    import torch.distributed as dist

    sys.torchdist_kept += 1
    print(f"bumped on rank {dist.get_rank()}")
    return dist.get_rank(), sys.torchdist_kept, os.getpid()


def kept_value():
    import sys

    return sys.torchdist_kept


def raise_on_this_rank():
    import torch.distributed as dist

    raise KeyError(f"nothing here on rank {dist.get_rank()}")


def all_reduce_alone():
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))  # the idle ranks never join it


def test_a_run_on_some_ranks_runs_there_only_and_leaves_the_others_untouched(local_distributor):
    pids = local_distributor(3, warm=True, all_ranks=True).run(keep_rank_state)
    (info,) = pools()
    run = local_distributor(3, warm=True, ranks=[2, 1]).submit(bump_and_say)
    assert run.result(timeout=120) == (1, 11, pids[1])  # the lowest chosen rank's value, not rank 0's
    assert [rs.state for rs in run.state.snapshot().ranks] == ["idle", "done", "done"]
    assert run.logs(0) == "" and "bumped on rank 2" in run.logs(2)
    both = local_distributor(3, warm=True, ranks="1,2", all_ranks=True).run(bump_and_say)
    assert both == {1: (1, 12, pids[1]), 2: (2, 22, pids[2])}  # a dict by chosen rank
    # the idle rank kept its state, every rank is the pool's, the pool served every run
    assert local_distributor(3, warm=True, all_ranks=True).run(kept_value) == [0, 12, 22]
    (again,) = pools()
    assert again.id == info.id and again.pids == pids and again.runs == 4


def test_a_failure_on_a_chosen_rank_raises_and_the_pool_stays(local_distributor):
    pids = local_distributor(2, warm=True, all_ranks=True).run(keep_rank_state)
    run = local_distributor(2, warm=True, ranks=[1]).submit(raise_on_this_rank)
    with pytest.raises(RankFailure) as err:
        run.result(timeout=120)
    assert err.value.rank == 1 and err.value.exc_type == "KeyError" and "nothing here on rank 1" in err.value.message
    assert [rs.state for rs in run.state.snapshot().ranks] == ["idle", "failed"]
    (info,) = pools()  # every chosen rank finished its job: the pool is as after any cell that raised
    assert info.pids == pids
    assert local_distributor(2, warm=True, all_ranks=True).run(kept_value) == [0, 10]


def test_a_collective_on_some_ranks_hangs_and_the_watchdog_says_why(local_distributor):
    local_distributor(2, warm=True).run(keep_rank_state)
    (info,) = pools()
    run = local_distributor(2, warm=True, ranks=[1], hang_timeout=3.0).submit(all_reduce_alone)
    with pytest.raises(HangTimeout) as err:
        run.result(timeout=120)
    message = str(err.value)
    assert "This cell ran on rank 1 of the pool only (--ranks): a collective" in message, message
    assert "rank 0: idle: not one of the run's --ranks" in message and re.search(
        r"rank 1: all_reduce .* < all_reduce_alone", message
    ), message
    import pickle

    assert str(pickle.loads(pickle.dumps(err.value))) == message
    assert pools() == []  # a rank left in the job ends the pool, as for any warm cell
    wait_until(lambda: _stopped(info), 15, "the hung pool's processes to end")


def test_bad_ranks_are_refused_before_anything_starts(local_distributor):
    for ranks, message in [
        ("1,,x", r"ranks must be rank numbers separated by commas \(1,3\), got '1,,x'"),
        ("", "ranks must name at least one rank"),
        ([], "ranks must name at least one rank"),
        ([1, 1], "ranks names rank 1 more than once"),
        ([2], r"ranks: there is no rank 2 among 2 ranks \(0..1\)"),
        ([-1], r"ranks: there is no rank -1 among 2 ranks"),
        ([0.5], "ranks must be rank numbers"),
        ({"a": 1}, r"ranks must be rank numbers \(a list of ints, or '1,3'\), got \{'a': 1\}"),
    ]:
        with pytest.raises(OptionError, match=message):
            local_distributor(2, warm=True, ranks=ranks)
    with pytest.raises(
        OptionError,
        match=r"ranks needs a warm pool: it runs a cell on some ranks of the live "
        r"pool \(--warm/warm=True\), and a cold run starts every rank afresh",
    ):
        local_distributor(2, ranks=[1])
    with pytest.raises(
        ValueError,
        match=r"--ranks needs a warm pool: .* \(np=2\), and none is live; start one "
        "with a --warm cell on every rank first",
    ):
        local_distributor(2, warm=True, ranks=[1]).run(kept_value)
    assert pools() == []
    local_distributor(2, warm=True).run(keep_rank_state)
    (info,) = pools()
    with pytest.raises(
        ValueError,
        match=rf"--ranks needs a warm pool: .* \(np=3\), and the live one is {info.id}: "
        r"np=2 on local processes.*; give its --np",
    ):
        local_distributor(3, warm=True, ranks=[1]).run(kept_value)
    assert [p.id for p in pools()] == [info.id]


def test_ranks_cells_in_the_notebook(ip, capsys):
    from IPython.core.error import UsageError

    ip.user_ns.pop("only_here", None)
    assert cell(ip, "%%torchdist --np 2 --warm --quiet\nrank").result == 0
    (info,) = pools()
    shown = cell(
        ip,
        """
        %%torchdist --np 2 --warm --ranks 1
        only_here = rank * 100   # a name on rank 1 only
        print("hello from", rank)
        (rank, world_size)
    """,
    )
    assert shown.error_in_exec is None and shown.result == (1, 2)
    out = capsys.readouterr().out
    assert f"on warm {info.id} (reused, run 2; on rank 1 only)" in out and "[rank 1] hello from 1" in out
    assert re.search(r"rank 0 +idle", out) and re.search(r"rank 1 +done", out)
    result = cell(ip, "%%torchdist --np 2 --warm --all-ranks --quiet\nglobals().get('only_here')")
    assert result.error_in_exec is None and result.result == [None, 100]
    result = cell(ip, "%%torchdist --np 2 --warm --ranks 0,1 --all-ranks --quiet\nrank + 1")
    assert result.result == {0: 1, 1: 2}
    for flags, message in [
        ("--np 2 --warm --ranks 1,,x", "--ranks must be rank numbers separated by commas"),
        ("--np 2 --ranks 1", "--ranks needs a warm pool: it runs a cell on some ranks"),
        ("--np 2 --warm --ranks 2", r"--ranks: there is no rank 2 among 2 ranks"),
        ("--np 2 --warm --ranks 1,1", "--ranks names rank 1 more than once"),
        ("--np 3 --warm --ranks 1", rf"the live one is {info.id}: np=2"),
    ]:
        result = cell(ip, f"%%torchdist {flags} --quiet\nrank")
        assert isinstance(result.error_in_exec, UsageError), flags
        assert re.search(message, str(result.error_in_exec)), (flags, str(result.error_in_exec))
    assert [p.id for p in pools()] == [info.id] and pools()[0].runs == 4


@pytest.mark.spark
def test_a_run_on_some_ranks_of_a_spark_pool(spark_local2):
    from torchdist_magic import Distributor

    pids = Distributor(2, local_mode=False, show=None, warm=True, all_ranks=True).run(keep_rank_state)
    (info,) = pools()
    some = Distributor(2, local_mode=False, show=None, warm=True, ranks=[1], all_ranks=True)
    assert some.run(bump_and_say) == {1: (1, 11, pids[1])}
    assert Distributor(2, local_mode=False, show=None, warm=True, all_ranks=True).run(kept_value) == [0, 11]
    assert [p.id for p in pools()] == [info.id]


@pytest.mark.kernel
def test_ranks_cells_in_a_real_kernel():
    """The magic in a kernel (the view is the widget there): a value from rank 1, a refusal
    shown as the kernel's UsageError, and no rank left once the kernel is gone."""
    import json

    pytest.importorskip("jupyter_client")
    from test_kernel_poll import Kernel

    def execute(code):
        outputs = []
        reply = kernel.kc.execute_interactive(code, timeout=120, output_hook=outputs.append)
        results = [m["content"]["data"]["text/plain"] for m in outputs if m["msg_type"] == "execute_result"]
        printed = "".join(m["content"]["text"] for m in outputs if m["msg_type"] == "stream")
        return reply["content"], results, printed

    run_id, pids = "", []
    kernel = Kernel()
    try:
        execute("%load_ext torchdist_magic")
        status, results, _ = execute("%%torchdist --np 2 --warm --quiet\nkept = rank * 7\nrank")
        assert status["status"] == "ok" and results == ["0"]
        status, results, _ = execute("%%torchdist --np 2 --warm --ranks 1\nkept")
        assert status["status"] == "ok" and results == ["7"]
        status, _, _ = execute("%%torchdist --np 2 --ranks 1\nkept")
        assert status["status"] == "error" and status["ename"] == "UsageError"
        assert status["evalue"].startswith("--ranks needs a warm pool")
        _, _, printed = execute(
            "import json, torchdist_magic\n"
            "print(json.dumps([(p.run_id, p.pids, p.runs) for p in torchdist_magic.pools()]))"
        )
        ((run_id, pids, runs),) = json.loads(printed)
        assert runs == 2
    finally:
        kernel.close()
    wait_until(
        lambda: not pids_of_run(run_id) and not any(alive(p) for p in pids),
        30,
        "the kernel's pool to end with the kernel",
    )
