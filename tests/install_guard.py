"""The install guard: the tests run against the package as installed, or say why they cannot.

CI tests the wheel that ``.ci/setup`` built and installed (not editable), so that a module the
wheel lacks fails the run: README's test command (``.venv/bin/pytest``) leaves the source tree
off ``sys.path``.  Two ways to test something else are caught when the session starts, before a
test runs:

- in CI (``CI`` set, as CI sets it), ``torchdist_magic`` imported from this checkout's source
  tree (``python -m pytest`` puts the working directory first on ``sys.path``; so does a
  ``PYTHONPATH`` that names the checkout);
- anywhere, an installed copy that differs from the source tree (a stale install: the source
  changed since the wheel was installed), with the one command that reinstalls it.

Outside CI a developer may test the working tree itself: ``PYTHONPATH=$PWD .venv/bin/pytest``
(docs/contributing.md).  Either way, the processes the tests start (ranks, kernels, supervisors,
``python -c`` children) import the same copy as the test session: ``PYTHONSAFEPATH`` keeps their
working directory (often the checkout) off their ``sys.path``, and a session that imports the
source tree passes it on in ``PYTHONPATH``.  A pytest plugin, loaded by ``conftest.py``.
"""

from __future__ import annotations

import filecmp
import os
import pathlib
from typing import List, Optional

#: the checkout's package, beside ``tests/``
SOURCE = pathlib.Path(__file__).resolve().parent.parent / "torchdist_magic"
#: what reinstalls the wheel of the working tree into the venvs (.ci/setup's quick mode)
REINSTALL = "bash .ci/setup wheel"


def in_ci(environ=os.environ) -> bool:
    return environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _sources(package: pathlib.Path) -> List[str]:
    """The package's files that the wheel carries, relative to it (no byte code)."""
    return sorted(
        str(p.relative_to(package))
        for p in package.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    )


def differences(installed: pathlib.Path, source: pathlib.Path) -> List[str]:
    """The files in which ``installed`` and ``source`` (two copies of the package) differ: one
    copy's only, or different in content."""
    mine, theirs = set(_sources(installed)), set(_sources(source))
    changed = [
        name for name in sorted(mine & theirs) if not filecmp.cmp(installed / name, source / name, shallow=False)
    ]
    return sorted(mine ^ theirs) + changed


def install_problem(imported: pathlib.Path, source: pathlib.Path = SOURCE, ci: bool = False) -> Optional[str]:
    """Why a session whose ``torchdist_magic`` is ``imported`` (its package directory) must not
    run, or None."""
    imported = imported.resolve()
    if not source.is_dir():  # tests run away from a checkout: nothing to compare with
        return None
    if imported == source.resolve():
        if ci:
            return (
                f"CI tests the installed wheel, but torchdist_magic was imported from the source tree "
                f"({imported}). Run the tests as README.md says (.venv/bin/pytest ...), which leaves the "
                f"source tree off sys.path; not python -m pytest, nor with the checkout on PYTHONPATH"
            )
        return None
    changed = differences(imported, source)
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        return (
            f"the installed torchdist_magic ({imported}) is not this checkout's source: {shown} differ. "
            f"Reinstall it with `{REINSTALL}`, or test the working tree itself outside CI with "
            f"PYTHONPATH=$PWD (docs/contributing.md)"
        )
    return None


def pytest_configure(config):
    import pytest

    import torchdist_magic

    imported = pathlib.Path(torchdist_magic.__file__).parent
    problem = install_problem(imported, ci=in_ci())
    if problem:
        raise pytest.UsageError(f"install guard: {problem}")
    # the processes the tests start import this same copy: not the working directory's
    os.environ["PYTHONSAFEPATH"] = "1"
    if imported.resolve() == SOURCE.resolve():
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(SOURCE.parent) not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([str(SOURCE.parent), *paths])
