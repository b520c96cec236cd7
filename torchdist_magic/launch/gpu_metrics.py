"""A rank's GPUs as its launcher samples them: memory used and total, and utilisation.

``GpuSource`` is the one interface (``sample(device_indices) -> dict``); ``NvmlGpuSource`` reads
NVML through the ``nvidia-ml-py`` package (``pynvml``, an optional dependency: ``pip install
torchdist-magic[gpu]``), imported when a run with GPUs first samples, never at import time.
``open_gpu_source()`` gives ``None`` where NVML is missing (no package, no driver): the samples
then have no GPU keys.  Unit tests use a fake source of their own; the real one is tested on a
machine with CUDA (``tests/test_gpu.py``, marked ``gpu``).

Devices are named as ``CUDA_VISIBLE_DEVICES`` names them for the rank: indices (NVML's order,
which is CUDA's with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, the order Spark and NVML list GPUs in) or
UUIDs (``GPU-...``).  A launcher samples the device its rank trains on (``rank_device``: a rank
sees its host's other GPUs too, for NCCL); a source given several sums their memory and
averages their utilisation.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Protocol, Sequence

#: the keys a GPU sample has
GPU_KEYS = ("gpu_memory_used_bytes", "gpu_memory_total_bytes", "gpu_util_percent")


class GpuSource(Protocol):
    """Where a launcher reads its rank's GPUs from."""

    def sample(self, device_indices: Sequence[str]) -> Dict[str, float]:
        """``GPU_KEYS`` of the devices named (see the module's docstring); ``{}`` when none of
        them can be read."""
        ...


def visible_devices(env: Dict[str, str]) -> List[str]:
    """The devices a rank with environment ``env`` sees (its ``CUDA_VISIBLE_DEVICES``)."""
    return [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]


def rank_device(env: Dict[str, str]) -> List[str]:
    """The device a rank with environment ``env`` trains on, as ``rank.device()`` picks it
    (``cuda:LOCAL_RANK`` of those it sees), named as ``CUDA_VISIBLE_DEVICES`` names it; with no
    ``CUDA_VISIBLE_DEVICES`` (a local run sees every GPU) its index; ``[]`` where it sees none."""
    local = int(env.get("LOCAL_RANK", "0") or 0)
    if "CUDA_VISIBLE_DEVICES" not in env:
        return [str(local)]
    visible = visible_devices(env)
    return [visible[local % len(visible)]] if visible else []


class NvmlGpuSource:
    """``GpuSource`` from NVML (``pynvml``); ``NVMLError`` of a device leaves that device out."""

    _init_lock = threading.Lock()

    def __init__(self):
        import pynvml  # nvidia-ml-py

        with self._init_lock:
            pynvml.nvmlInit()  # counted by NVML: each source shuts down its own (``close``)
        self.nvml = pynvml
        self._handles: Dict[str, object] = {}

    def _handle(self, device: str):
        handle = self._handles.get(device)
        if handle is None:
            if device.isdigit():
                handle = self.nvml.nvmlDeviceGetHandleByIndex(int(device))
            else:
                handle = self.nvml.nvmlDeviceGetHandleByUUID(device)
            self._handles[device] = handle
        return handle

    def sample(self, device_indices: Sequence[str]) -> Dict[str, float]:
        used = total = 0.0
        utils: List[float] = []
        for device in device_indices:
            try:
                handle = self._handle(device)
                memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
            except self.nvml.NVMLError:
                continue
            used += float(memory.used)
            total += float(memory.total)
            utils.append(float(rates.gpu))
        if not utils:
            return {}
        return {
            "gpu_memory_used_bytes": used,
            "gpu_memory_total_bytes": total,
            "gpu_util_percent": sum(utils) / len(utils),
        }

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def open_gpu_source() -> Optional[GpuSource]:
    """NVML's source, or ``None`` where ``nvidia-ml-py`` or the NVIDIA driver is missing."""
    try:
        return NvmlGpuSource()
    except ImportError:
        return None
    except Exception as exc:  # pynvml.NVMLError (no driver, no device): no GPU keys
        if type(exc).__name__.startswith("NVMLError"):
            return None
        raise
