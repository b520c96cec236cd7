"""The notebooks (``notebooks/*.ipynb``) are stored with the outputs of one run (written by
``notebooks/execute.py``), which GitHub and the docs site show; and they run clean
(``execute.py``'s ``run_checked``: no cell raises or shows a ``UsageError`` unless tagged
``raises-exception``, and a tagged cell raises the error its ``"raises"`` metadata names; proven on
small notebooks made here)."""

from __future__ import annotations

import importlib.util
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
#: seconds one cell may run (a hung cell fails instead of blocking CI); a notebook, at most
CELL_TIMEOUT = 300
NOTEBOOK_TIMEOUT = 1800


def _execute_module():
    spec = importlib.util.spec_from_file_location("notebooks_execute", os.path.join(NOTEBOOKS, "execute.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


execute = _execute_module()


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
    assert all(c.get("execution_count") for c in code), f"notebooks/{name} has cells that did not run: " + FIX.format(
        name=name
    )
    assert any(c.get("outputs") for c in code), f"notebooks/{name} has no outputs: " + FIX.format(name=name)
    assert "widgets" not in nb.get("metadata", {}), "widget state left in the notebook (GitHub cannot render it)"
    views = [
        o for c in code for o in c.get("outputs", []) if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
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


@pytest.mark.notebook
@pytest.mark.timeout(NOTEBOOK_TIMEOUT)
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_and_each_cell_does_what_it_says(name):
    import nbformat

    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    execute.run_checked(nb, execute._kernel_manager_class(), CELL_TIMEOUT, name=name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"{name}: cells that did not run"


def small_notebook(*cells):
    """A notebook of code cells: each a source, or ``(source, "ErrorName")`` for a cell tagged
    ``raises-exception`` that says it raises that error (``(source, None)``: says nothing)."""
    import nbformat

    made = []
    for cell in cells:
        source, raises = cell if isinstance(cell, tuple) else (cell, False)
        made.append(nbformat.v4.new_code_cell(source))
        if raises is not False:
            made[-1].metadata["tags"] = ["raises-exception"]
            if raises is not None:
                made[-1].metadata["raises"] = raises
    return nbformat.v4.new_notebook(cells=made)


def run_small(nb, tmp_path):
    return execute.run_checked(nb, execute._kernel_manager_class(), 60, path=str(tmp_path), name="small.ipynb")


def printed(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


@pytest.mark.kernel
def test_the_check_passes_cells_that_raise_what_they_say_and_runs_on(tmp_path):
    nb = run_small(
        small_notebook(
            "x = 1",
            ("%no_such_magic", "UsageError"),
            ("raise ValueError('on purpose')", "ValueError"),
            "print('after', x)",
        ),
        tmp_path,
    )
    assert printed(nb.cells[1]) == "UsageError: Line magic function `%no_such_magic` not found.\n"
    assert [o.get("ename") for o in nb.cells[2].outputs] == ["ValueError"]
    assert printed(nb.cells[3]) == "after 1\n"


@pytest.mark.kernel
def test_a_cell_that_fails_with_a_usage_error_fails_the_notebook(tmp_path):
    nb = small_notebook("x = 1", "%no_such_magic", "print('after')")
    with pytest.raises(execute.NotebookFailed) as info:
        run_small(nb, tmp_path)
    assert info.value.problems == [
        "cell 1 ('%no_such_magic') raised UsageError: Line magic function `%no_such_magic` not found."
    ]
    assert "execution_count" not in nb.cells[2] or nb.cells[2].execution_count is None  # stopped there


@pytest.mark.kernel
def test_a_usage_error_shown_on_stderr_by_a_cell_that_ends_well_fails_the_notebook(tmp_path):
    # a cell that runs another (as a widget's callback or a helper may) shows the inner cell's
    # UsageError on stderr, and its own execute reply says "ok"
    with pytest.raises(execute.NotebookFailed) as info:
        run_small(small_notebook("get_ipython().run_cell('%no_such_magic'); print('ok')"), tmp_path)
    assert info.value.problems == [
        "cell 0 (\"get_ipython().run_cell('%no_such_magic'); print('ok')\") showed "
        "UsageError: Line magic function `%no_such_magic` not found."
    ]


@pytest.mark.kernel
@pytest.mark.parametrize(
    "cell, problem",
    [
        (("y = 1 + 1", "ValueError"), "cell 1 ('y = 1 + 1') should raise ValueError but raised nothing"),
        (
            ("raise KeyError('k')", "ValueError"),
            "cell 1 (\"raise KeyError('k')\") should raise ValueError but raised KeyError: 'k'",
        ),
        (
            ("%no_such_magic", "RankFailure"),
            "cell 1 ('%no_such_magic') should raise RankFailure but raised "
            "UsageError: Line magic function `%no_such_magic` not found.",
        ),
        (
            ("raise ValueError('v')", None),
            "cell 1 (\"raise ValueError('v')\") is tagged raises-exception but names no error in its metadata 'raises'",
        ),
    ],
    ids=["raises-nothing", "wrong-error", "usage-error-for-another", "says-nothing"],
)
def test_a_raises_exception_cell_that_breaks_its_promise_fails_the_notebook(cell, problem, tmp_path):
    with pytest.raises(execute.NotebookFailed) as info:
        run_small(small_notebook("x = 1", cell, "print('after')"), tmp_path)
    assert info.value.problems == [problem]
    assert str(info.value) == f"small.ipynb: {problem}"


def test_every_cell_that_raises_on_purpose_names_what_it_raises():
    for name in NAMES:
        for cell in _read(os.path.join(NOTEBOOKS, name))["cells"]:
            if execute.RAISES_TAG in cell.get("metadata", {}).get("tags", []):
                assert cell["metadata"].get(execute.RAISES_KEY), (name, cell.get("id"))
