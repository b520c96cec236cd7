"""torchdist_magic: a notebook cell or a function as distributed PyTorch, on local processes
or a Spark cluster.

``%load_ext torchdist_magic`` registers ``%%torchdist``; ``Distributor(...).run(fn, *args)`` is
the Python API.  Heavy modules (torch, pyspark, ipywidgets, IPython) are imported only when used.
"""

from __future__ import annotations

from .rank.shard import shard
from .core.errors import HangTimeout, JobTimeout, NotAvailable, RankFailure, ResultTimeout, RunCancelled
from .core.options import LaunchOptions
from .core.registry import register_backend, unregister_backend
from .core.version import __version__ as __version__
from .rank.runtime import (
    RankStopped,
    device,
    host_ranks,
    is_main,
    load_checkpoint,
    local_rank,
    local_world_size,
    progress,
    rank,
    report,
    restart_count,
    save_checkpoint,
    world_size,
)

__all__ = [
    "Distributor",
    "LaunchOptions",
    "RankFailure",
    "JobTimeout",
    "HangTimeout",
    "RunCancelled",
    "ResultTimeout",
    "NotAvailable",
    "Run",
    "RunHandle",
    "last_run",
    "progress",
    "report",
    "rank",
    "world_size",
    "local_rank",
    "local_world_size",
    "host_ranks",
    "is_main",
    "device",
    "restart_count",
    "save_checkpoint",
    "load_checkpoint",
    "RankStopped",
    "shard",
    "load_ipython_extension",
    "unload_ipython_extension",
    "pools",
    "shutdown_pools",
    "MlflowUnavailable",
    "TrackingError",
    "register_backend",
    "unregister_backend",
    "runs",
    "attach",
    "stop",
]

_LAZY = {
    "Distributor": "api",
    "Run": "driver.distributor",
    "RunHandle": "driver.handle",
    "last_run": "driver.distributor",
    "pools": "backends.pool",
    "shutdown_pools": "backends.pool",
    "MlflowUnavailable": "driver.tracking",
    "TrackingError": "driver.tracking",
    "runs": "driver.history",
    "attach": "handles.attach",
    "stop": "handles.attach",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'torchdist_magic' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    """``%load_ext torchdist_magic``: register ``%%torchdist`` and ``%torchdist_panel``.

    Example:

    ```python
    %load_ext torchdist_magic
    ```
    """
    from .magic import load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext torchdist_magic``: stop the warm pools and remove the magics again.

    Example:

    ```python
    %unload_ext torchdist_magic
    ```
    """
    from .magic import unload

    unload(ipython)
