"""Pre-flight (``--preflight``): the comparison of the ranks' reports (pure: reports are data),
a rank's report with a fake NVML, and the check end to end on real ranks (gloo)."""

import socket

import pytest

from helpers import assert_no_survivors
from torchdist_magic import rank
from torchdist_magic.core.events import GpuHealth, Preflight
from torchdist_magic.core.preflight import compare, report


def rep(rank, host="a", torch="2.13.0", link=1.0, gpus=(), **versions):
    return Preflight(
        rank=rank,
        host=host,
        python=versions.get("python", "3.11.9"),
        torch=torch,
        cuda=versions.get("cuda", "12.8"),
        nccl=versions.get("nccl", "2.27.3"),
        driver=versions.get("driver", "570.1"),
        gpus=list(gpus),
        bus_gbps=4.0,
        link_gbps=link,
        seconds=0.5,
    )


def test_the_same_software_everywhere_is_no_refusal_and_the_figures_are_by_host():
    result = compare([rep(r, host="a" if r < 2 else "b") for r in range(4)])
    assert result.refusal == "" and result.warnings == ()
    assert result.lines == (
        "pre-flight: 4 ranks, Python 3.11.9, torch 2.13.0, CUDA 12.8, NCCL 2.27.3; "
        "all_reduce bus bandwidth 4.00 GB/s; 0.50 s",
        "  a: ranks 0, 1, ring link 1.00 GB/s (slowest)",
        "  b: ranks 2, 3, ring link 1.00 GB/s",
    )


def test_versions_that_differ_refuse_the_run_naming_ranks_hosts_and_versions():
    reports = [rep(0, "a"), rep(1, "a"), rep(2, "b", torch="2.12.1", nccl="2.21.5")]
    result = compare(reports)
    assert result.refusal == (
        "pre-flight: the ranks do not run the same software, so the run was refused before the job started: "
        "torch differs: 2.13.0 on ranks 0, 1 (a); 2.12.1 on rank 2 (b). "
        "NCCL differs: 2.27.3 on ranks 0, 1 (a); 2.21.5 on rank 2 (b)"
    )


def test_a_host_far_below_the_others_bandwidth_is_named():
    reports = [rep(0, "a", link=10.0), rep(1, "b", link=9.0), rep(2, "c", link=2.0), rep(3, "d", link=11.0)]
    result = compare(reports)
    assert result.refusal == ""
    assert result.warnings == (
        "pre-flight: host c receives at 2.00 GB/s, far below the other hosts' 10.00 GB/s "
        "(median): a slow link or a busy host holds every collective back",
    )
    assert "  c: rank 2, ring link 2.00 GB/s (slowest)" in result.lines


def test_gpus_with_ecc_errors_or_throttled_are_named():
    sick = [GpuHealth(index=0, name="H100", ecc_errors=3), GpuHealth(index=1, name="H100", throttled="hw_slowdown")]
    result = compare([rep(0, "a", gpus=sick), rep(1, "a")])
    assert result.warnings == (
        "pre-flight: rank 0 on a: GPU 0 has 3 uncorrected ECC errors",
        "pre-flight: rank 0 on a: GPU 1 is throttled (hw_slowdown)",
    )


class FakeHealth:
    """What NVML would say of a rank's GPUs."""

    def health(self, devices):
        return [GpuHealth(index=int(d), name="Fake GPU", free_bytes=8e9) for d in devices]


def test_a_ranks_report_has_its_versions_and_its_gpus_health():
    import platform

    import torch

    mine = report(3, FakeHealth(), ["1"], driver="570.1")
    assert (mine.rank, mine.python, mine.torch, mine.driver) == (
        3,
        platform.python_version(),
        torch.__version__,
        "570.1",
    )
    assert mine.gpus == [GpuHealth(index=1, name="Fake GPU", free_bytes=8e9)]
    assert report(0, None, []).gpus == []


# -- real ranks ------------------------------------------------------------------------------------
def own_group_all_reduce():
    """A TorchDistributor-style function: it sets up its own process group after the check."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return float(t)


def test_a_rank_waits_for_rank_0s_store_of_the_check_to_close_before_the_job_sets_up_its_own(monkeypatch):
    """The job's own ``init_process_group`` uses the check's address: a rank that reached the
    check's store, which rank 0 was about to close, failed with "Failed to recv, got 0 bytes"."""
    import threading
    import time

    import torch.distributed as dist

    from helpers import free_port
    from torchdist_magic.core import preflight

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    link = preflight._store_probe()
    assert link is not None
    closed = []

    def close_later():
        time.sleep(0.5)
        closed.append(time.monotonic())
        del closing[0]  # the last reference: the store's server stops

    closing = [store]
    del store
    threading.Thread(target=close_later).start()
    preflight._wait_until_closed(link)
    assert closed and time.monotonic() >= closed[0]  # not before the store closed
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # nothing listens there now

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # a launcher's store, never rank 0's
    assert preflight._store_probe() is None


def test_preflight_end_to_end_on_real_ranks(local_distributor):
    run = local_distributor(3, preflight=True).submit(own_group_all_reduce)
    assert run.result(timeout=240) == 3.0
    reports = run.preflight_reports
    assert sorted(reports) == [0, 1, 2]
    import torch

    assert {r.torch for r in reports.values()} == {torch.__version__}
    assert all(r.bus_gbps > 0 and r.link_gbps > 0 and r.seconds > 0 for r in reports.values())
    result = run.preflight
    assert result.refusal == "" and result.lines[0].startswith("pre-flight: 3 ranks, Python ")
    from torchdist_magic.view.text import summary

    assert "\n  pre-flight: 3 ranks, Python " in summary(run.state)
    from torchdist_magic.view import html as H
    from torchdist_magic.view import model as M

    assert M.run_facts(run.state).preflight == list(result.lines)
    assert H.failure_html(M.run_facts(run.state)).count('class="torchdist-preflight"') == len(result.lines)
    assert_no_survivors(run)


def test_without_preflight_no_rank_reports(local_distributor):
    run = local_distributor(2).submit(rank)
    assert run.result(timeout=240) == 0
    assert run.preflight is None and run.preflight_reports == {}


def test_a_cell_runs_after_the_check_in_its_own_process_group_and_config_turns_it_on(ip):
    from helpers import cell

    ip.run_line_magic("config", "TorchdistMagics.preflight = True")
    try:
        cell(
            ip,
            "%%torchdist --np 2\nimport torch\nimport torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)",
        )
    finally:
        ip.run_line_magic("config", "TorchdistMagics.preflight = False")
    run = ip.user_ns["_torchdist_run"]
    assert run.result() == 2.0 and sorted(run.preflight_reports) == [0, 1]
    cell(ip, "%%torchdist --np 2 --preflight\nrank")
    assert sorted(ip.user_ns["_torchdist_run"].preflight_reports) == [0, 1]
    cell(ip, "%%torchdist --np 2 --no-preflight\nrank")
    assert ip.user_ns["_torchdist_run"].preflight is None


def _cuda_count():
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() < 1, reason="needs a CUDA device")
def test_on_gpus_the_report_has_cuda_nccl_the_driver_and_each_gpus_health(local_distributor):
    pytest.importorskip("pynvml")
    n = _cuda_count()
    run = local_distributor(n, use_gpu=True, preflight=True).submit(rank)
    assert run.result(timeout=300) == 0
    for mine in run.preflight_reports.values():
        assert mine.cuda and mine.nccl and mine.driver, mine
        assert len(mine.gpus) == 1 and mine.gpus[0].free_bytes > 0 and mine.gpus[0].name
    assert run.preflight.refusal == ""
    assert_no_survivors(run)
