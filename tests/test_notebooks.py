"""The notebooks (``notebooks/*.ipynb``) are stored with the outputs of one run (written by
``notebooks/execute.py``), which GitHub and the docs site show: nothing here executes anything."""

from __future__ import annotations

import json
import re
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
NAMES = sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb"))
#: GitHub renders a notebook this large slowly or not at all
MAX_NOTEBOOK_BYTES = 1_000_000
FIX = "run `.venv/bin/python notebooks/execute.py {name}` and commit notebooks/{name}"


def _read(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _text(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_there_are_notebooks():
    assert len(NAMES) >= 9, NAMES


def test_one_copy_of_each_notebook():
    """The executed copies that ``docs/notebooks/`` once held are gone: the notebooks carry
    their outputs themselves."""
    assert not os.path.exists(os.path.join(ROOT, "docs", "notebooks"))


@pytest.mark.parametrize("name", NAMES)
def test_notebook_was_run_and_is_readable_without_a_kernel(name):
    path = os.path.join(NOTEBOOKS, name)
    nb = _read(path)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in code), f"notebooks/{name} has cells that did not run: " + FIX.format(name=name)
    assert any(c.get("outputs") for c in code), f"notebooks/{name} has no outputs: " + FIX.format(name=name)
    assert "widgets" not in nb.get("metadata", {}), "widget state left in the notebook (GitHub cannot render it)"
    views = [o for c in code for o in c.get("outputs", [])
             if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert not views, f"{len(views)} widget views left in notebooks/{name}"
    assert os.path.getsize(path) < MAX_NOTEBOOK_BYTES, f"notebooks/{name} is over 1 MB"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_says_what_it_needs_and_links_its_neighbours(name):
    text = _text(_read(os.path.join(NOTEBOOKS, name))["cells"][0])
    assert "**Needs:**" in text and "**Previous:**" in text and "**Next:**" in text, name


@pytest.mark.parametrize("name", NAMES)
def test_notebook_links_only_what_exists(name):
    """Relative links in the markdown point at files of the repository (the docs site rewrites
    them for its own layout, ``docs/hooks.py``)."""
    missing = []
    for cell in _read(os.path.join(NOTEBOOKS, name))["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)", _text(cell)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not os.path.exists(os.path.join(NOTEBOOKS, target)):
                missing.append(target)
    assert not missing, f"notebooks/{name} links to files that are not there: {missing}"
