"""End to end in a real browser: JupyterLab (started here on a loopback port) driven by headless
Chromium through Playwright.  A ``%%torchdist --np 2`` cell shows two live rank rows whose bars
reach their total, the Stop button stops a cell that blocks the kernel, and the launch panel
refuses a bad setting and launches a run.  Screenshots go to ``artifacts/``."""

import os

import pytest

from browser.lab import ARTIFACTS, JupyterLab, chromium_and_playwright, launch_chromium, run_all_cells, write_notebook
from helpers import pids_of_run

MISSING = chromium_and_playwright()
pytestmark = [pytest.mark.browser, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

TRAIN_CELL = """%%torchdist --np 2
import math, time
for epoch in progress(range(2), desc="epoch"):
    for step in progress(range(15), desc="batch"):
        time.sleep(0.08)
        report(loss=math.exp(-(epoch * 15 + step) / 10) + 0.02 * rank)
    print(f"epoch {epoch} done on rank {rank}")
f"rank {rank} of {world_size}"
"""
LONG_CELL = """%%torchdist --np 2
import time
for i in progress(range(30000), desc="step"):  # ten minutes unless stopped
    time.sleep(0.02)
"""
PANEL_CODE = "import time\nfor i in progress(range(20), desc='step'):\n    time.sleep(0.05)\nrank + 40"

#: every rank row of a cell's (or the panel's) view has a bar at its total; ``scope`` is a CSS selector
ALL_BARS_FULL = """([scope, count]) => {
    const rows = document.querySelectorAll(scope + ' .torchdist-rank-row');
    return rows.length === count && Array.from(rows).every(row => {
        const bars = row.querySelectorAll('.torchdist-bar');
        return bars.length > 0 && Array.from(bars).every(b => b.dataset.total && b.dataset.n === b.dataset.total);
    });
}"""

#: both ranks of a view have made progress
STEPPING = """(scope) => {
    const bars = document.querySelectorAll(scope + ' .torchdist-rank-row .torchdist-bar');
    return bars.length === 2 && Array.from(bars).every(b => Number(b.dataset.n) >= 10);
}"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The JupyterLab the tests share; once stopped, nothing it ran may be left."""
    with JupyterLab(workdir=str(tmp_path_factory.mktemp("lab"))) as server:
        server.run_ids = set()
        yield server
    assert_lab_left_nothing(server)


def assert_lab_left_nothing(lab):
    """No process seen under the stopped ``lab`` and none of the runs it noted is alive."""
    assert lab.survivors() == [], f"left running after JupyterLab stopped: {lab.survivors()}"
    for run_id in lab.run_ids:
        assert not pids_of_run(run_id), f"processes of run {run_id} survived"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = launch_chromium(playwright, str(tmp_path_factory.mktemp("chromium-profile")))
        context.set_default_timeout(60_000)
        yield context
        context.close()


def artifact(name):
    os.makedirs(ARTIFACTS, exist_ok=True)
    path = os.path.join(ARTIFACTS, name)
    print(f"screenshot: {path}")
    return path


def note_runs(page, lab):
    lab.run_ids.update(page.eval_on_selector_all(".torchdist-header[data-run-id]",
                                                 "els => els.map(e => e.dataset.runId)"))
    lab.note_processes()


def open_and_run(browser, lab, name, cells):
    write_notebook(os.path.join(lab.root, name), cells)
    page = browser.new_page()
    page.set_viewport_size({"width": 1280, "height": 1500})
    page.goto(lab.url(name))
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    run_all_cells(page)
    return page


def test_run_view_shows_every_rank_and_stop_ends_a_blocking_cell(browser, lab):
    page = open_and_run(browser, lab, "run-view.ipynb", ["%load_ext torchdist_magic", TRAIN_CELL, LONG_CELL])
    train, long = ".jp-Notebook .jp-Cell:nth-child(2)", ".jp-Notebook .jp-Cell:nth-child(3)"
    try:
        # live: the widget with one row per rank, while the ranks run
        page.wait_for_selector(f"{train} .torchdist-view .torchdist-rank-row[data-state=running]")
        assert page.locator(f"{train} .torchdist-view .torchdist-rank-row").count() == 2
        page.wait_for_selector(f"{train} .torchdist-view svg.torchdist-plot")
        note_runs(page, lab)
        page.locator(f"{train} .jp-OutputArea").screenshot(path=artifact("browser-run-live.png"))
        # the end: the static summary, both ranks done with full bars, rank 0's value as Out
        page.wait_for_function(ALL_BARS_FULL, arg=[f"{train} .torchdist-summary", 2])
        assert page.locator(f"{train} .torchdist-summary .torchdist-rank-row[data-state=done]").count() == 2
        assert page.locator(f"{train} .torchdist-summary .torchdist-header[data-state=succeeded]").count() == 1
        assert page.locator(f"{train} .torchdist-summary .torchdist-bar-success").count() == 2
        assert "'rank 0 of 2'" in page.locator(f"{train} .jp-OutputArea-executeResult").inner_text()
        # every rank's last lines stay in the notebook, rank 0's unfolded, the others folded
        rank_logs = f"{train} .torchdist-summary details.torchdist-rank-log"
        assert page.locator(rank_logs).count() == 2
        assert page.locator(f"{rank_logs}[open]").get_attribute("data-rank") == "0"
        assert "epoch 1 done on rank 1" in page.locator(f"{rank_logs}[data-rank='1']").text_content()
        assert "_torchdist_run.logs(1)" in page.locator(f"{rank_logs}[data-rank='1'] summary").inner_text()
        page.locator(f"{train} .jp-OutputArea").screenshot(path=artifact("browser-run-done.png"))

        # Stop while the next cell blocks the kernel, once both ranks are stepping
        page.wait_for_function(STEPPING, arg=f"{long} .torchdist-view")
        note_runs(page, lab)
        page.locator(f"{long} .jp-OutputArea").screenshot(path=artifact("browser-run-before-stop.png"))
        page.locator(f"{long} .torchdist-view .torchdist-stop").click()
        page.wait_for_selector(f"{long} .torchdist-summary .torchdist-header[data-state=cancelled]", timeout=30_000)
        page.wait_for_selector(f"{long} .jp-RenderedText[data-mime-type='application/vnd.jupyter.stderr']")
        assert "RunCancelled" in page.locator(f"{long} .jp-OutputArea").inner_text()
        assert page.locator(f"{long} .torchdist-summary .torchdist-rank-row[data-state=cancelled]").count() == 2
        page.locator(f"{long} .jp-OutputArea").screenshot(path=artifact("browser-run-stopped.png"))
        note_runs(page, lab)
    except Exception:
        page.screenshot(path=artifact("browser-run-view-failure.png"), full_page=True)
        raise
    finally:
        page.close()


def test_launch_panel_refuses_bad_settings_and_launches(browser, lab):
    page = open_and_run(browser, lab, "panel.ipynb", ["%load_ext torchdist_magic", "%torchdist_panel"])
    panel = ".torchdist-panel"
    try:
        page.wait_for_selector(f"{panel} .torchdist-option-num_processes input")
        np_input = page.locator(f"{panel} .torchdist-option-num_processes input")
        page.locator(f"{panel} .torchdist-code textarea").fill(PANEL_CODE)
        np_input.fill("0")
        np_input.press("Tab")
        page.wait_for_selector(f"{panel} .torchdist-option-error")
        assert "at least 1" in page.locator(f"{panel} .torchdist-option-error").inner_text()
        assert page.locator(f"{panel} .torchdist-launch").is_disabled()
        page.locator(panel).screenshot(path=artifact("browser-panel-invalid.png"))
        np_input.fill("2")
        np_input.press("Tab")
        page.wait_for_selector(f"{panel} .torchdist-launch:not([disabled])")
        assert page.locator(f"{panel} .torchdist-option-error").count() == 0
        command = page.locator(f"{panel} .torchdist-command pre").inner_text()
        assert command.startswith("%%torchdist --np 2\nimport time")
        page.locator(f"{panel} .torchdist-launch").click()
        page.wait_for_selector(f"{panel} .torchdist-view .torchdist-rank-row")
        assert page.locator(f"{panel} .torchdist-view .torchdist-rank-row").count() == 2
        note_runs(page, lab)
        page.wait_for_function(ALL_BARS_FULL, arg=[f"{panel} .torchdist-view", 2])
        page.wait_for_selector(f"{panel} .torchdist-value")
        assert page.locator(f"{panel} .torchdist-value").inner_text().strip() == "40"
        assert page.locator(f"{panel} .torchdist-header[data-state=succeeded]").count() == 1
        assert page.locator(f"{panel} .torchdist-launch").is_enabled()
        page.locator(panel).screenshot(path=artifact("browser-panel.png"))
        note_runs(page, lab)
    except Exception:
        page.screenshot(path=artifact("browser-panel-failure.png"), full_page=True)
        raise
    finally:
        page.close()


def test_jupyterlab_stops_with_no_kernel_or_rank_left(browser, tmp_path):
    """A JupyterLab of its own: one notebook whose cell ran ranks (stopped with its Stop button),
    then the server stops."""
    with JupyterLab(workdir=str(tmp_path)) as own:
        own.run_ids = set()
        page = open_and_run(browser, own, "stop.ipynb", ["%load_ext torchdist_magic", LONG_CELL])
        cell = ".jp-Notebook .jp-Cell:nth-child(2)"
        try:
            page.wait_for_function(STEPPING, arg=f"{cell} .torchdist-view")
            note_runs(page, own)  # the kernel and its ranks, while they run
            page.locator(f"{cell} .torchdist-view .torchdist-stop").click()
            page.wait_for_selector(f"{cell} .torchdist-summary .torchdist-header[data-state=cancelled]")
        finally:
            page.close()
    kernels = [pid for pid, cmd in own.seen.items() if "ipykernel" in cmd]
    ranks = [pid for pid, cmd in own.seen.items() if "torchdist_magic.worker" in cmd]
    assert len(kernels) == 1 and len(ranks) >= 2, f"expected a kernel and its ranks under JupyterLab: {own.seen}"
    assert len(own.run_ids) == 1
    assert_lab_left_nothing(own)
