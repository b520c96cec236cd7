"""The copies of the notebooks with their outputs (``docs/notebooks/``, written by
``notebooks/execute.py``) match the notebooks: nothing here executes anything."""

from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = os.path.join(ROOT, "notebooks")
COPIES = os.path.join(ROOT, "docs", "notebooks")
NAMES = sorted(n for n in os.listdir(SOURCES) if n.endswith(".ipynb"))
#: GitHub renders a notebook this large slowly or not at all
MAX_COPY_BYTES = 1_000_000
FIX = "run `.venv/bin/python notebooks/execute.py {name}` and commit docs/notebooks/{name}"


def _read(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _code_cells(nb: dict) -> list:
    return [("".join(c["source"]) if isinstance(c["source"], list) else c["source"],
             sorted(c.get("metadata", {}).get("tags", [])))
            for c in nb["cells"] if c["cell_type"] == "code"]


def test_there_are_notebooks():
    assert len(NAMES) >= 9, NAMES


def test_no_copy_without_a_notebook():
    stale = sorted(set(n for n in os.listdir(COPIES) if n.endswith(".ipynb")) - set(NAMES))
    assert not stale, f"copies in docs/notebooks/ whose notebook is gone: {stale}"


@pytest.mark.parametrize("name", NAMES)
def test_copy_has_the_same_code_cells(name):
    copy_path = os.path.join(COPIES, name)
    assert os.path.exists(copy_path), f"docs/notebooks/{name} is missing: " + FIX.format(name=name)
    source, copy = _read(os.path.join(SOURCES, name)), _read(copy_path)
    assert _code_cells(copy) == _code_cells(source), (
        f"docs/notebooks/{name} has other code cells than notebooks/{name}: " + FIX.format(name=name))


@pytest.mark.parametrize("name", NAMES)
def test_copy_was_run_and_is_readable_without_a_kernel(name):
    path = os.path.join(COPIES, name)
    if not os.path.exists(path):
        pytest.skip("no copy (the test above says so)")
    copy = _read(path)
    code = [c for c in copy["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in code), f"docs/notebooks/{name} has cells that did not run"
    assert any(c.get("outputs") for c in code), f"docs/notebooks/{name} has no outputs"
    assert "widgets" not in copy.get("metadata", {}), "widget state left in the copy (GitHub cannot render it)"
    views = [o for c in code for o in c.get("outputs", [])
             if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert not views, f"{len(views)} widget views left in docs/notebooks/{name}"
    assert os.path.getsize(path) < MAX_COPY_BYTES, f"docs/notebooks/{name} is over 1 MB"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_says_what_it_needs_and_links_its_neighbours(name):
    first = _read(os.path.join(SOURCES, name))["cells"][0]
    text = "".join(first["source"]) if isinstance(first["source"], list) else first["source"]
    assert "**Needs:**" in text and "**Previous:**" in text and "**Next:**" in text, name
    assert f"../docs/notebooks/{name}" in text, f"{name} does not link its copy with outputs"
