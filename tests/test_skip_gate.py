"""The skip gate (``skip_gate``): a pytest run of a small test file made here, in a subprocess,
fails on a skip whose reason is not expected, naming the test and the missing piece, and passes
with only expected skips, xfails and passes."""

from __future__ import annotations

import os
import subprocess
import sys

import skip_gate

TESTS = os.path.dirname(os.path.abspath(__file__))


def run_pytest(tmp_path, source: str) -> subprocess.CompletedProcess:
    """``pytest -q -rs`` on a test file of ``source`` with the gate loaded, as README's test
    command runs it (a ``pytest.ini`` of its own: none of this repository's options)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["skip_gate"]\n')
    (tmp_path / "test_small.py").write_text(source)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]), PYTHONDONTWRITEBYTECODE="1"
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-c",
            str(tmp_path / "pytest.ini"),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_unexpected_skip_fails_the_run_and_names_the_missing_piece(tmp_path):
    done = run_pytest(
        tmp_path,
        (
            "import pytest\n"
            "def test_passes():\n    assert True\n"
            "def test_needs_a_tool():\n    pytest.skip('no frobnicator on PATH (apt-get install frobnicator)')\n"
        ),
    )
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "1 passed, 1 skipped" in out, out
    assert skip_gate.UNEXPECTED_HEADER in out, out
    assert ("SKIPPED test_small.py::test_needs_a_tool: no frobnicator on PATH (apt-get install frobnicator)") in out, (
        out
    )
    assert f"1 unexpected skip(s) fail this run: {skip_gate.HOW_TO_FIX}" in out, out


def test_a_module_skipped_for_a_missing_package_fails_the_run(tmp_path):
    done = run_pytest(
        tmp_path,
        (
            "import pytest\n"
            "pytest.importorskip('torchdist_no_such_package')\n"
            "def test_never_collected():\n    assert True\n"
        ),
    )
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "SKIPPED test_small.py: could not import 'torchdist_no_such_package'" in out, out


def test_expected_skips_and_xfails_leave_the_run_green(tmp_path):
    done = run_pytest(
        tmp_path,
        (
            "import pytest\n"
            "@pytest.mark.skipif(True, reason='needs a CUDA device')\n"
            "def test_on_a_gpu():\n    assert False\n"
            "@pytest.mark.xfail(reason='known', strict=True)\n"
            "def test_known_bug():\n    assert False\n"
            "def test_passes():\n    assert True\n"
        ),
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "1 passed, 1 skipped, 1 xfailed" in out, out
    assert "SKIPPED [1] test_small.py:2: needs a CUDA device" in out, out  # -rs shows it
    assert skip_gate.UNEXPECTED_HEADER not in out, out


def test_a_failing_run_keeps_its_failure_status(tmp_path):
    done = run_pytest(
        tmp_path,
        ("import pytest\ndef test_fails():\n    assert False\ndef test_skips():\n    pytest.skip('no frobnicator')\n"),
    )
    assert done.returncode == 1, done.stdout
    assert "1 failed, 1 skipped" in done.stdout and skip_gate.UNEXPECTED_HEADER in done.stdout, done.stdout


def test_connect_and_lightning_skips_are_expected_only_in_the_compat_venv():
    compat = skip_gate._pyspark_major() == 3
    assert skip_gate.is_expected("this pyspark (3.5.7) ships no Spark Connect server jar") is compat
    assert skip_gate.is_expected("needs lightning (the notebooks extra)") is compat
    assert skip_gate.is_expected("needs a CUDA device")
    assert skip_gate.is_expected("needs two CUDA devices (NCCL: one GPU per rank)")
    assert not skip_gate.is_expected("could not import 'mlflow': No module named 'mlflow'")
    assert not skip_gate.is_expected("no Chromium found (apt-get install chromium, or set TORCHDIST_CHROMIUM)")
