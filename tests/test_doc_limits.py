"""The limits page (``docs/limits.md``) says what the code does: each number of a row that names
a constant is that constant's value, and the declared versions are the package's metadata."""

from __future__ import annotations

import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "limits.md")
UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "MB": 1, "lines": 1, "a": 1}


def _page() -> str:
    with open(PAGE, encoding="utf-8") as fh:
        return fh.read()


def _rows():
    """``(what, limit, dotted path)`` of each table row whose last cell names a constant."""
    for line in _page().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`torchdist_magic(\.\w+)+`", cells[2]):
            yield cells[0], cells[1], cells[2].strip("`")


def _constant(path: str):
    """The value at ``path``: a module's attribute, or a class's (a traitlet's default)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            value = getattr(value, name)
        return getattr(value, "default_value", value)
    raise ImportError(path)


def _stated(limit: str) -> float:
    """The first number of a limit cell, in bytes where it has a unit: ``64 MiB`` -> 67108864."""
    found = re.match(r"^([\d,]+(?:\.\d+)?)\s*(KiB|MiB|GiB|MB|lines|a)?\b", limit)
    assert found, f"no number at the start of {limit!r}"
    return float(found.group(1).replace(",", "")) * UNITS[found.group(2) or ""]


def test_the_page_names_constants():
    assert len(list(_rows())) >= 20


@pytest.mark.parametrize("what,limit,path", list(_rows()), ids=[row[2].rsplit(".", 1)[1] for row in _rows()])
def test_each_stated_limit_is_the_code_s(what, limit, path):
    assert _stated(limit) == _constant(path), f"{what}: the page says {limit!r}, {path} is {_constant(path)!r}"


def test_a_wrong_number_would_be_caught():
    assert _stated("64 MiB (past its share ...)") == 64 << 20
    assert _stated("20,000 lines") == 20_000
    assert _stated("1 GiB") != _constant("torchdist_magic.supervise.supervisor.JOURNAL_MAX_BYTES") + 1


def test_the_declared_versions_are_the_metadata():
    metadata = ""
    for name in ("setup.cfg", "pyproject.toml"):
        path = os.path.join(ROOT, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                metadata += fh.read()
    table = re.search(r"^## Versions\n(.*?)^## ", _page(), re.S | re.M).group(1)
    python = re.search(r"^\| Python \| ([\d.]+) or later", table, re.M).group(1)
    torch = re.search(r"^\| torch \| ([\d.]+) or later", table, re.M).group(1)
    pyspark = re.search(r"^\| pyspark \| ([\d.]+) or later", table, re.M).group(1)
    assert re.search(rf"python_requires\s*=\s*\"?>={re.escape(python)}\b", metadata)
    assert re.search(rf"\btorch>={re.escape(torch)}\b", metadata)
    assert re.search(rf"\bpyspark(\[[\w,]+\])?>={re.escape(pyspark)}\b", metadata)
