"""Pre-flight (``--preflight``, ``preflight=True``): before the job runs, every rank reports the
versions it runs with (Python, torch, CUDA, NCCL, the GPU driver), its GPUs' health (NVML: ECC
errors, throttling, free memory) and takes part in a short bandwidth probe (an ``all_reduce``
of every rank, and a ring in which each rank receives from the one before it).  The ranks
exchange their reports (``all_gather_object``) and each compares them (``compare``, a pure
function of the reports): versions or libraries that differ between ranks refuse the run on
every rank (``PreflightRefused``, naming the ranks, hosts and versions) before the job starts;
a host far below the others' bandwidth, or a GPU with ECC errors or throttled, is a warning in
the rank's output.  Each rank also sends its report to the driver (``events.Preflight``):
``Run.preflight`` and the view show the figures.

The process group the probe needs is the run's: where the job sets up its own (a cell, a
function written for TorchDistributor), the probe's group is destroyed before the job starts.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from . import events
from .culprit import rank_list
from .names import USE_GPU_ENV

#: bytes of the probe's tensors, and how many timed rounds of each probe (after one unmeasured)
PROBE_BYTES = 4 * 1024 * 1024
PROBE_ROUNDS = 3
#: a host whose link bandwidth is below this share of the other hosts' median is named
SLOW_HOST_SHARE = 0.5
#: the versions that must be the same on every rank, with the name a message gives them
VERSIONS = (("python", "Python"), ("torch", "torch"), ("cuda", "CUDA"), ("nccl", "NCCL"), ("driver", "GPU driver"))


class PreflightRefused(RuntimeError):
    """The ranks' pre-flight reports differ where a run needs them equal (versions, libraries)."""


@dataclass(frozen=True)
class PreflightResult:
    """What the reports say: ``refusal`` (why the run must not start; "" when it may),
    ``warnings`` (hosts far below the others' bandwidth, unhealthy GPUs), ``lines`` (the figures,
    one line per host: what ``Run.preflight`` and the view show)."""

    refusal: str = ""
    warnings: Tuple[str, ...] = ()
    lines: Tuple[str, ...] = field(default_factory=tuple)


def compare(reports: Sequence[events.Preflight]) -> PreflightResult:
    """Compare every rank's report (any order; one per rank)."""
    reports = sorted(reports, key=lambda r: r.rank)
    problems = []
    for key, name in VERSIONS:
        by_value: Dict[str, List[events.Preflight]] = {}
        for report in reports:
            by_value.setdefault(getattr(report, key), []).append(report)
        if len(by_value) > 1:
            parts = [
                f"{value or 'none'} on {_where(group)}"
                for value, group in sorted(by_value.items(), key=lambda kv: -len(kv[1]))
            ]
            problems.append(f"{name} differs: {'; '.join(parts)}")
    refusal = ""
    if problems:
        refusal = (
            "pre-flight: the ranks do not run the same software, so the run was refused before the job "
            "started: " + ". ".join(problems)
        )
    warnings = list(_slow_hosts(reports)) + list(_unhealthy_gpus(reports))
    return PreflightResult(refusal, tuple(warnings), tuple(_figures(reports)))


def _where(reports: List[events.Preflight]) -> str:
    hosts = sorted({r.host for r in reports if r.host})
    return rank_list(r.rank for r in reports) + (f" ({', '.join(hosts)})" if hosts else "")


def _hosts(reports: Sequence[events.Preflight]) -> Dict[str, List[events.Preflight]]:
    hosts: Dict[str, List[events.Preflight]] = {}
    for report in reports:
        hosts.setdefault(report.host, []).append(report)
    return hosts


def _slow_hosts(reports: Sequence[events.Preflight]):
    """Hosts whose slowest link is below ``SLOW_HOST_SHARE`` of the other hosts' median."""
    hosts = {host: min(r.link_gbps for r in group) for host, group in _hosts(reports).items()}
    if len(hosts) < 2:
        return
    for host, gbps in sorted(hosts.items(), key=lambda kv: kv[1]):
        others = statistics.median(v for h, v in hosts.items() if h != host)
        if others > 0 and gbps < SLOW_HOST_SHARE * others:
            yield (
                f"pre-flight: host {host} receives at {gbps:.2f} GB/s, far below the other hosts' "
                f"{others:.2f} GB/s (median): a slow link or a busy host holds every collective back"
            )


def _unhealthy_gpus(reports: Sequence[events.Preflight]):
    for report in reports:
        for gpu in report.gpus:
            if gpu.ecc_errors:
                yield (
                    f"pre-flight: rank {report.rank} on {report.host}: GPU {gpu.index} has {gpu.ecc_errors} "
                    "uncorrected ECC errors"
                )
            if gpu.throttled:
                yield f"pre-flight: rank {report.rank} on {report.host}: GPU {gpu.index} is throttled ({gpu.throttled})"


def _figures(reports: Sequence[events.Preflight]) -> List[str]:
    if not reports:
        return []
    first = reports[0]
    lines = [
        f"pre-flight: {len(reports)} ranks, Python {first.python}, torch {first.torch}"
        + (f", CUDA {first.cuda}" if first.cuda else "")
        + (f", NCCL {first.nccl}" if first.nccl else "")
        + f"; all_reduce bus bandwidth {first.bus_gbps:.2f} GB/s; "
        + f"{max(r.seconds for r in reports):.2f} s"
    ]
    hosts = _hosts(reports)
    slowest = min(hosts, key=lambda h: min(r.link_gbps for r in hosts[h]))
    for host, group in sorted(hosts.items()):
        note = " (slowest)" if len(hosts) > 1 and host == slowest else ""
        lines.append(
            f"  {host}: {rank_list(r.rank for r in group)}, ring link {min(r.link_gbps for r in group):.2f} GB/s{note}"
        )
    return lines


# -- on a rank -----------------------------------------------------------------------------------
class GpuHealthSource(Protocol):
    """Where a rank's GPU health comes from (NVML, or a fake in tests)."""

    def health(self, device_indices: Sequence[str]) -> List[events.GpuHealth]: ...


class NvmlHealth:
    """GPU health from NVML (``pynvml``)."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml

    def health(self, device_indices: Sequence[str]) -> List[events.GpuHealth]:
        nvml = self._nvml
        found = []
        for index in device_indices:
            handle = nvml.nvmlDeviceGetHandleByIndex(int(index))
            try:
                ecc = int(
                    nvml.nvmlDeviceGetTotalEccErrors(
                        handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                    )
                )
            except nvml.NVMLError:  # a GPU without ECC
                ecc = 0
            reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
            slow = [name for bit, name in _THROTTLES if reasons & getattr(nvml, bit, 0)]
            name = nvml.nvmlDeviceGetName(handle)
            found.append(
                events.GpuHealth(
                    index=int(index),
                    name=name.decode() if isinstance(name, bytes) else name,
                    ecc_errors=ecc,
                    throttled=", ".join(slow),
                    free_bytes=float(nvml.nvmlDeviceGetMemoryInfo(handle).free),
                )
            )
        return found


#: NVML throttle reasons that mean a GPU runs slower than it should (idle and application
#: clocks are not a problem)
_THROTTLES = (
    ("nvmlClocksThrottleReasonHwSlowdown", "hw_slowdown"),
    ("nvmlClocksThrottleReasonSwThermalSlowdown", "sw_thermal"),
    ("nvmlClocksThrottleReasonHwThermalSlowdown", "hw_thermal"),
    ("nvmlClocksThrottleReasonHwPowerBrakeSlowdown", "power_brake"),
)


def _versions(torch: Any) -> Dict[str, Any]:
    cuda = torch.version.cuda or ""
    nccl = ""
    if cuda and torch.cuda.is_available():
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": cuda, "nccl": nccl}


def report(rank: int, gpus: Optional[GpuHealthSource], devices: Sequence[str], driver: str = "") -> events.Preflight:
    """This rank's versions and GPUs (no probe yet)."""
    import torch

    return events.Preflight(
        rank=rank,
        host=socket.gethostname(),
        driver=driver,
        gpus=gpus.health(devices) if gpus is not None and devices else [],
        **_versions(torch),
    )


def probe(dist: Any, device: Any) -> Tuple[float, float]:
    """``(bus_gbps, link_gbps)``: an ``all_reduce`` of every rank (bus bandwidth, as nccl-tests
    reports it) and a ring where each rank receives ``PROBE_BYTES`` from the rank before it."""
    import torch

    n, rank = dist.get_world_size(), dist.get_rank()
    tensor = torch.ones(PROBE_BYTES // 4, device=device)
    into = torch.empty_like(tensor)

    def timed(step: Callable[[], None]) -> float:
        step()
        _sync(torch, device)
        start = time.perf_counter()
        for _ in range(PROBE_ROUNDS):
            step()
        _sync(torch, device)
        return (time.perf_counter() - start) / PROBE_ROUNDS

    reduce_s = timed(lambda: dist.all_reduce(tensor))
    bus = PROBE_BYTES * 2 * (n - 1) / n / reduce_s / 1e9 if n > 1 else 0.0
    if n < 2:
        return bus, 0.0

    def ring() -> None:
        for request in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, tensor, (rank + 1) % n), dist.P2POp(dist.irecv, into, (rank - 1) % n)]
        ):
            request.wait()

    return bus, PROBE_BYTES / timed(ring) / 1e9


def _sync(torch: Any, device: Any) -> None:
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def run(
    send: Callable[[events.Event], None], gpus: Optional[GpuHealthSource] = None, driver: str = ""
) -> PreflightResult:
    """The check on this rank, with every other rank: report, probe, exchange, compare; send
    this rank's report with ``send``; print the warnings; raise ``PreflightRefused`` when the
    reports refuse the run.  Uses the run's process group, set up for the check where the job
    has none yet (and then destroyed again, so that the job sets up its own)."""
    import torch
    import torch.distributed as dist

    started = time.perf_counter()
    use_gpu = os.environ.get(USE_GPU_ENV) == "1" and torch.cuda.is_available()
    created = not dist.is_initialized()
    if created:
        if use_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl" if use_gpu else "gloo")
    store_link = _store_probe() if created and dist.get_rank() != 0 else None
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
        devices = [str(device.index)] if use_gpu else []
        mine = report(dist.get_rank(), gpus, devices, driver)
        mine.bus_gbps, mine.link_gbps = probe(dist, device)
        mine.seconds = time.perf_counter() - started
        everyone: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, events.encode(mine))
        reports = [r for r in map(events.decode, everyone) if isinstance(r, events.Preflight)]  # each rank's
        send(mine)
        result = compare(reports)
    finally:
        if created:
            dist.destroy_process_group()
        if store_link is not None:
            _wait_until_closed(store_link)
    for warning in result.warnings:
        print(warning, flush=True)
    if result.refusal:
        raise PreflightRefused(result.refusal)
    return result


#: how long a rank waits for rank 0's store of the check to close (``_wait_until_closed``)
STORE_CLOSE_WAIT = 60.0


def _store_probe() -> Optional[socket.socket]:
    """A connection of this rank (not rank 0) to the check's store, on rank 0 at
    ``MASTER_ADDR:MASTER_PORT``, which says nothing: it ends when that store closes.  The job's
    own ``init_process_group`` on the same address must not reach the check's store, which rank 0
    is about to close (its handshake would then fail with "Failed to recv, got 0 bytes"), so this
    rank waits for its end (``_wait_until_closed``).  ``None`` where the store is not rank 0's
    (a launcher's, ``TORCHELASTIC_USE_AGENT_STORE``) or cannot be reached this way."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    try:
        return socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=10)
    except (KeyError, ValueError, OSError):
        return None


def _wait_until_closed(probe: socket.socket) -> None:
    """Return once rank 0's store of the check has closed (``probe`` reads its end), or after
    ``STORE_CLOSE_WAIT`` seconds."""
    with probe:
        probe.settimeout(STORE_CLOSE_WAIT)
        try:
            while probe.recv(4096):
                pass
        except OSError:  # reset, or the wait passed: the job's own set-up says what is wrong, if anything
            pass


def open_health() -> Optional[GpuHealthSource]:
    """NVML's health source, or ``None`` where there is no NVML (no GPU, no ``pynvml``)."""
    try:
        return NvmlHealth()
    except Exception:  # noqa: BLE001
        return None


def driver_version(health: Optional[GpuHealthSource]) -> str:
    """The GPU driver's version from NVML ("" without it)."""
    if isinstance(health, NvmlHealth):
        version = health._nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    return ""
