"""The skip gate: a test run that skipped a test for a reason not on ``EXPECTED_SKIPS`` fails.

A skip says that something this machine lacks (a package, Chromium, Java, ``unshare``, a cgroup)
kept a test from running; left green, a CI run or a newcomer's run would pass without testing
what that piece is needed for.  So every skip is collected (a test's, and a whole module's from
``importorskip``), and at the end of the session each one whose reason no entry of
``EXPECTED_SKIPS`` allows here is listed under "unexpected skips" with its reason (which names
the missing piece) and the run's exit status becomes 1.  Expected are only the skips that no
set-up can avoid: GPU tests on a machine without CUDA devices, and Spark Connect and Lightning
in ``.venv-compat`` (pyspark 3.5's wheel has no Connect server; that venv has no ``notebooks``
extra).  README's test command passes ``-rs``, so every skip, expected or not, is also listed
with its reason.  A pytest plugin, loaded by ``conftest.py``'s ``pytest_plugins``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, List, Tuple


def _pyspark_major() -> int:
    from importlib import metadata

    try:
        return int(metadata.version("pyspark").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return 0


def _compat_venv() -> bool:
    """The run is ``.venv-compat``'s: pyspark 3 (``.venv`` has pyspark 4)."""
    return _pyspark_major() == 3


def _always() -> bool:
    return True


@dataclass(frozen=True)
class ExpectedSkip:
    """Skips whose reason matches ``reason`` (a regex, searched) are expected where ``applies()``."""

    reason: str
    applies: Callable[[], bool]
    why: str


#: the only skips a run may have and still pass
EXPECTED_SKIPS = (
    # the GPU tests check for themselves how many devices they need and that CUDA lacks them
    ExpectedSkip(r"needs (a|two) CUDA device|needs CUDA\b", _always, "GPU tests on a machine without CUDA"),
    ExpectedSkip(r"checks the error on a machine without CUDA", _always, "the no-CUDA test on a GPU machine"),
    ExpectedSkip(r"ships no Spark Connect server jar", _compat_venv, "Spark Connect in the compat venv"),
    ExpectedSkip(r"needs lightning \(the notebooks extra\)", _compat_venv, "Lightning in the compat venv"),
)

UNEXPECTED_HEADER = "unexpected skips"
HOW_TO_FIX = (
    "each of these skipped because this machine lacks what its reason names: install it "
    "(`bash .ci/setup` sets up everything the tests need) and run again; "
    "the skips a run may have are EXPECTED_SKIPS in tests/skip_gate.py"
)


def is_expected(reason: str, expected=EXPECTED_SKIPS) -> bool:
    return any(re.search(e.reason, reason) and e.applies() for e in expected)


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    return reason[len("Skipped: ") :] if reason.startswith("Skipped: ") else reason


class SkipGate:
    """Collects the session's skips; the unexpected ones fail it."""

    def __init__(self):
        self.unexpected: List[Tuple[str, str]] = []

    def _note(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _reason(report)
            if not is_expected(reason):
                self.unexpected.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report):
        self._note(report)

    def pytest_collectreport(self, report):
        self._note(report)

    def pytest_sessionfinish(self, session, exitstatus):
        # 5 is "no tests collected": what a file that skips as a whole leaves when run alone
        if self.unexpected and exitstatus in (0, 5):
            session.exitstatus = 1

    def pytest_terminal_summary(self, terminalreporter):
        if not self.unexpected:
            return
        terminalreporter.section(UNEXPECTED_HEADER, sep="=", red=True, bold=True)
        for nodeid, reason in self.unexpected:
            terminalreporter.line(f"SKIPPED {nodeid}: {reason}", red=True)
        terminalreporter.line(f"{len(self.unexpected)} unexpected skip(s) fail this run: {HOW_TO_FIX}")


def pytest_configure(config):
    config.pluginmanager.register(SkipGate(), "torchdist_skip_gate")
