"""What every benchmark script here writes next to its table: the machine it ran on, and the
JSON file of its figures."""

from __future__ import annotations

import json
import os
import platform


def machine(**versions: str) -> dict:
    """Platform, Python, usable cores, and the versions given (``torch=torch.__version__``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "python": platform.python_version(), "cores": cores, **versions}


def write_json(path: str, result: dict) -> None:
    """Write ``result`` to ``path`` (making its folder) and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    print(f"\nwrote {path}")
