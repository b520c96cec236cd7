"""Launch settings: one dataclass that the magic's flags, the panel's controls and the
Python API's keywords are all derived from.

Each field carries its command-line flag and help text in ``metadata`` so that the
``%%torchdist`` argument parser and the launch panel are generated from this file and
cannot drift from it.  Construction validates values only; it never looks at the
environment (no CUDA probe, no Spark lookup): that happens when a run is resolved.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

BACKENDS = ("auto", "local", "spark")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _flag(flag: str, help: str, **extra: Any) -> dict:
    return {"flag": flag, "help": help, **extra}


@dataclass
class LaunchOptions:
    """Every setting of one distributed launch.

    ``None`` for ``timeout`` means "no deadline".  ``env`` is added to each rank's
    environment on top of the variables the launcher sets (``RANK``, ``MASTER_ADDR``, ...).
    """

    num_processes: int = field(
        default=1,
        metadata=_flag("--np", "number of ranks (processes) to start", metavar="N", type=int),
    )
    use_gpu: bool = field(
        default=False,
        metadata=_flag("--gpu", "one GPU per rank (CUDA_VISIBLE_DEVICES) and the nccl backend"),
    )
    backend: str = field(
        default="auto",
        metadata=_flag(
            "--backend",
            "where ranks run: 'local' processes, a 'spark' barrier stage, or 'auto' "
            "(Spark when a SparkSession is active, local processes otherwise)",
            choices=BACKENDS,
        ),
    )
    timeout: Optional[float] = field(
        default=None,
        metadata=_flag(
            "--timeout", "stop every rank and raise TimeoutError after SECONDS",
            metavar="SECONDS", type=float,
        ),
    )
    env: dict = field(
        default_factory=dict,
        metadata=_flag(
            "--env", "extra environment variable for every rank (repeatable)",
            metavar="KEY=VALUE", repeat=True,
        ),
    )
    all_ranks: bool = field(
        default=False,
        metadata=_flag("--all-ranks", "return every rank's value as a list indexed by rank"),
    )

    def __post_init__(self) -> None:
        n = self.num_processes
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"num_processes must be an int, got {type(n).__name__} {n!r}")
        if n < 1:
            raise ValueError(f"num_processes must be at least 1, got {n}")
        if not isinstance(self.use_gpu, bool):
            raise TypeError(f"use_gpu must be True or False, got {self.use_gpu!r}")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}"
            )
        if self.timeout is not None:
            if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
                raise TypeError(f"timeout must be a number of seconds, got {self.timeout!r}")
            if not math.isfinite(self.timeout) or self.timeout <= 0:
                raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout}")
        self.env = parse_env(self.env)
        if not isinstance(self.all_ranks, bool):
            raise TypeError(f"all_ranks must be True or False, got {self.all_ranks!r}")

    def replace(self, **changes: Any) -> "LaunchOptions":
        return dataclasses.replace(self, **changes)


def parse_env(env: Any) -> dict:
    """Normalise ``env`` (a mapping, or ``KEY=VALUE`` strings) to ``{str: str}``.

    Raises ``ValueError``/``TypeError`` naming the malformed entry.
    """
    if env is None:
        return {}
    if isinstance(env, str):
        env = [env]
    items: list
    if isinstance(env, Mapping):
        items = list(env.items())
    elif isinstance(env, (list, tuple)):
        items = []
        for entry in env:
            if not isinstance(entry, str) or "=" not in entry:
                raise ValueError(f"env entry {entry!r} is not of the form KEY=VALUE")
            key, _, value = entry.partition("=")
            items.append((key, value))
    else:
        raise TypeError(f"env must be a dict or a list of 'KEY=VALUE' strings, got {type(env).__name__}")
    out = {}
    for key, value in items:
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise ValueError(f"env name {key!r} is not a valid environment variable name")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise TypeError(f"env value for {key} must be a string or number, got {type(value).__name__}")
        value = str(value)
        if "\x00" in value:
            raise ValueError(f"env value for {key} contains a NUL byte")
        out[key] = value
    return out


def option_fields() -> list:
    """The ``dataclasses.Field`` objects that have a user-facing flag, in declaration order."""
    return [f for f in dataclasses.fields(LaunchOptions) if "flag" in f.metadata]
