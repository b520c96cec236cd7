"""System metrics of one rank, read beside it: its processes' CPU and memory, its machine's
free memory, its GPUs (``gpu_metrics``), and what an end by SIGKILL says about memory.

A rank's launcher (``launcher.RankProcess``, on the driver or in a Spark task) owns one
``RankSampler`` and calls ``sample()`` every ``timing.SYSTEM_METRICS_INTERVAL`` seconds from a
thread of its own: the training thread is never touched.  One sample reads ``/proc`` once per
process of this machine (to find the rank's process group), ``/proc/meminfo`` and the rank's
memory cgroup; its numbers, by name:

- ``cpu_percent``: CPU time of the rank's process group since the last sample, per second of
  wall time, in percent (several busy threads make more than 100, as ``top`` shows it);
- ``rss_bytes``: resident memory of the group's processes, summed;
- ``host_memory_available_bytes``, ``host_memory_total_bytes``: the machine's ``MemAvailable``
  and ``MemTotal``;
- ``memory_limit_bytes``: what the rank's memory may reach: its memory cgroup's limit (the
  tightest along the cgroup's ancestors) when there is one below the machine's memory, else the
  machine's memory;
- with GPUs: ``gpu_memory_used_bytes``, ``gpu_memory_total_bytes``, ``gpu_util_percent``.

Out of memory.  The kernel's OOM killer ends a process with SIGKILL and leaves no message; the
launcher asks ``RankSampler.explain_kill`` what its samples say: the rank's cgroup counted an
OOM kill since the rank started (cgroup v1 ``memory.oom_control``, v2 ``memory.events``), or
the last RSS seen was within ``NEAR_LIMIT`` of the limit, or the machine had almost no memory
left.  Past ``NEAR_LIMIT_FAST`` of the limit the launcher samples more often
(``timing.SYSTEM_METRICS_FAST_INTERVAL``), so that a rank growing towards the limit is seen
close to it.  ``RLIMIT_AS`` is not a cause: a process that reaches it gets ``MemoryError`` (an
exception the worker reports), not SIGKILL.

Only the standard library and ``/proc``: off Linux a sample has the host's memory unknown and
the processes' numbers at 0.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

#: less resident memory than any running interpreter has: a process being started (in exec) or
#: ending, not a rank at work; its sample is not taken
MIN_PROCESS_RSS = 1 << 20
#: a SIGKILLed rank whose last RSS was at least this fraction of its limit probably ran out
NEAR_LIMIT = 0.9
#: ... and past this fraction its launcher samples it more often
NEAR_LIMIT_FAST = 0.6
#: a machine with less than this fraction of its memory available is out of memory
HOST_NEARLY_FULL = 0.05
#: what a cgroup v1 memory limit reads when there is none (a page-rounded 2**63 - 1)
_NO_LIMIT = 1 << 62

GIB = float(1 << 30)

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CGROUP_ROOT = "/sys/fs/cgroup"


def gib(value: float) -> str:
    """Bytes as GiB, as a message shows them: ``11.8 GiB``."""
    return f"{value / GIB:.3g} GiB" if value < 10 * GIB else f"{value / GIB:.1f} GiB"


def host_memory() -> Tuple[int, int]:
    """``(available, total)`` bytes of this machine's memory (``/proc/meminfo``); 0 when unknown."""
    found: Dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "MemTotal"):
                    found[name] = int(rest.split()[0]) * 1024
                    if len(found) == 2:
                        break
    except (OSError, ValueError, IndexError):
        pass
    return found.get("MemAvailable", 0), found.get("MemTotal", 0)


def _group_usage(pgid: int) -> Dict[int, Tuple[int, int]]:
    """``{pid: (cpu ticks, rss bytes)}`` of the live processes of group ``pgid``: one read of
    ``/proc/<pid>/stat`` per process of the machine."""
    found: Dict[int, Tuple[int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    wanted = str(pgid).encode()
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        # after the name: state(0) ppid(1) pgrp(2) ... utime(11) stime(12) ... rss(21), in pages
        if len(fields) > 21 and fields[2] == wanted and fields[0] != b"Z":
            found[int(name)] = (int(fields[11]) + int(fields[12]), int(fields[21]) * _PAGE)
    return found


def memory_cgroup(pid: int) -> Optional[str]:
    """The directory of process ``pid``'s memory cgroup (v2, or v1's ``memory`` hierarchy);
    ``None`` when it has none that this machine shows."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            directory = os.path.join(_CGROUP_ROOT, "memory", path.lstrip("/"))
            if os.path.isdir(directory):
                return directory
    for line in lines:
        if line.startswith("0::"):
            for root in (_CGROUP_ROOT, os.path.join(_CGROUP_ROOT, "unified")):
                directory = os.path.join(root, line[3:].lstrip("/"))
                if os.path.exists(os.path.join(root, "cgroup.controllers")) and os.path.isdir(directory):
                    return directory
    return None


def _read_number(path: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None  # v2's "max": no limit


def cgroup_limit(directory: str) -> Optional[int]:
    """The memory limit of cgroup ``directory``: the tightest of its own and its ancestors'
    (``memory.max``, v1 ``memory.limit_in_bytes``); ``None`` when there is none."""
    limits = []
    while directory.startswith(_CGROUP_ROOT + "/") and os.path.isdir(directory):
        for name in ("memory.max", "memory.limit_in_bytes"):
            value = _read_number(os.path.join(directory, name))
            if value is not None and value < _NO_LIMIT:
                limits.append(value)
        directory = os.path.dirname(directory)
    return min(limits) if limits else None


def cgroup_oom_kills(directory: str) -> Optional[int]:
    """How many processes the OOM killer ended in cgroup ``directory`` (v2 ``memory.events``,
    v1 ``memory.oom_control``); ``None`` when the cgroup does not say."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            with open(os.path.join(directory, name), encoding="ascii") as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def cgroup_peak(directory: str) -> Optional[int]:
    """The most memory cgroup ``directory`` has used (v2 ``memory.peak``, v1
    ``memory.max_usage_in_bytes``)."""
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        value = _read_number(os.path.join(directory, name))
        if value is not None:
            return value
    return None


class RankSampler:
    """The system metrics of one rank's process group ``pgid`` (its worker leads it), sampled
    when asked (``sample``), and what they say about its end (``explain_kill``).

    ``gpu``: a ``gpu_metrics.GpuSource`` and the rank's device indices, for its GPU keys.
    Not thread-safe: one thread samples (the launcher's)."""

    def __init__(
        self, pgid: int, gpu: Optional[Tuple[object, Sequence[str]]] = None, clock: Callable[[], float] = time.monotonic
    ):
        self.pgid = pgid
        self.gpu = gpu
        self.clock = clock
        self.last: Dict[str, float] = {}
        self._ticks: Dict[int, int] = {}
        self._at = clock()
        self._cgroup: Optional[str] = None
        self._oom_kills_before: Optional[int] = None
        for pid, (ticks, _) in _group_usage(pgid).items():
            self._ticks[pid] = ticks
        self._watch_cgroup()

    def _watch_cgroup(self) -> None:
        """Follow the rank's memory cgroup (it may move, as a container's process can), and the
        OOM kills it counted before the rank was seen in it."""
        directory = memory_cgroup(self.pgid)
        if directory is not None and directory != self._cgroup:
            self._cgroup = directory
            self._oom_kills_before = cgroup_oom_kills(directory)

    def sample(self) -> Dict[str, float]:
        """One sample of the rank's numbers (see the module's docstring); also kept as ``last``.
        ``{}`` once no process of the group is alive with memory: an exiting rank (whose
        ``/proc`` entries say nothing of its cgroup any more) leaves ``last`` as it was, to
        explain its end."""
        now = self.clock()
        usage = _group_usage(self.pgid)
        if sum(rss for _, rss in usage.values()) < MIN_PROCESS_RSS:
            # the rank has exited, or is exiting: its memory is gone and /proc shows it in the root
            # cgroup already; its last sample is what it was.  Or it is not a rank yet: a process
            # between fork and its interpreter's start, whose "rss 0 MiB" a reader would take for
            # a measurement (the first sample is taken at once, so that a short rank is seen too)
            return {}
        spent = sum(ticks - self._ticks.get(pid, 0) for pid, (ticks, _) in usage.items())
        self._ticks = {pid: ticks for pid, (ticks, _) in usage.items()}
        wall, self._at = now - self._at, now
        available, total = host_memory()
        self._watch_cgroup()
        limit = cgroup_limit(self._cgroup) if self._cgroup is not None else None
        values = {
            "cpu_percent": round(100.0 * max(spent, 0) / _CLOCK_TICKS / wall, 1) if wall > 0 else 0.0,
            "rss_bytes": float(sum(rss for _, rss in usage.values())),
            "host_memory_available_bytes": float(available),
            "host_memory_total_bytes": float(total),
            "memory_limit_bytes": float(limit if limit is not None and (not total or limit < total) else total),
        }
        if self.gpu is not None:
            source, devices = self.gpu
            values.update(source.sample(devices))
        self.last = values
        return values

    def near_limit(self) -> bool:
        """Whether the last sample's RSS was past ``NEAR_LIMIT_FAST`` of its limit."""
        limit = self.last.get("memory_limit_bytes", 0.0)
        return limit > 0 and self.last.get("rss_bytes", 0.0) >= NEAR_LIMIT_FAST * limit

    def explain_kill(self, code: Optional[int]) -> str:
        """What ended a rank whose process exited with ``code``, when its memory says so:
        ``"probably out of memory: RSS 11.8 GiB of 12 GiB"``; ``""`` otherwise (not SIGKILL, or
        nothing points at memory).  Called once the process is gone: the cgroup it was last
        seen in still counts its OOM kills."""
        if code != -signal.SIGKILL or not self.last:
            return ""
        rss = self.last.get("rss_bytes", 0.0)
        limit = self.last.get("memory_limit_bytes", 0.0)
        total = self.last.get("host_memory_total_bytes", 0.0)
        where = "its cgroup's limit" if limit and total and limit < total else "the machine's memory"
        if self._cgroup is not None and self._oom_kills_before is not None:
            kills = cgroup_oom_kills(self._cgroup)
            if kills is not None and kills > self._oom_kills_before:
                peak = cgroup_peak(self._cgroup)
                return (
                    f"probably out of memory: RSS {gib(rss)} of {gib(limit)} when last sampled; the "
                    f"kernel's OOM killer fired in its cgroup" + (f", whose memory reached {gib(peak)}" if peak else "")
                )
        if limit and rss >= NEAR_LIMIT * limit:
            return f"probably out of memory: RSS {gib(rss)} of {gib(limit)} ({where})"
        available = self.last.get("host_memory_available_bytes", 0.0)
        if total and available < HOST_NEARLY_FULL * total:
            return (
                f"probably out of memory: the machine had {gib(available)} of {gib(total)} available (RSS {gib(rss)})"
            )
        return ""


def explain_cuda_oom(message: str, sample: Dict[str, float]) -> str:
    """``message`` of a CUDA out-of-memory error with the rank's device memory at the time
    appended, when the last sample has it; else ``message`` as it was."""
    used, total = sample.get("gpu_memory_used_bytes"), sample.get("gpu_memory_total_bytes")
    if used is None or not total:
        return message
    return f"{message} [device memory when last sampled: {gib(used)} of {gib(total)} used]"


def is_cuda_oom(exc_type: str, message: str) -> bool:
    """Whether a rank's exception is CUDA's out of memory (``torch.cuda.OutOfMemoryError``, or a
    ``RuntimeError`` of older torch saying so)."""
    return exc_type.endswith("OutOfMemoryError") or (
        exc_type.endswith("RuntimeError") and "CUDA out of memory" in message
    )
