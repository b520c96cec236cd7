"""How numbers read in every view and message: durations, byte counts, step times."""

from __future__ import annotations

from typing import Optional


def format_duration(seconds: Optional[float]) -> str:
    """``01:05``, or ``1:00:05`` past an hour; ``?`` when unknown."""
    if seconds is None:
        return "?"
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def format_bytes(value: float) -> str:
    """``812 MiB``, ``11.8 GiB``"""
    if value < 1 << 30:
        return f"{value / (1 << 20):.0f} MiB"
    return f"{value / (1 << 30):.3g} GiB"


def format_step_time(seconds: float) -> str:
    """``120 ms/step``, ``2.5 s/step``"""
    return f"{seconds * 1000:.3g} ms/step" if seconds < 1 else f"{seconds:.3g} s/step"
