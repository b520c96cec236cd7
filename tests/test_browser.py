"""End to end in a real browser: JupyterLab (started here on a loopback port) driven by headless
Chromium through Playwright.  A ``%%torchdist --np 2`` cell shows two live rank rows whose bars
reach their total, the Stop button stops a cell that blocks the kernel, and the launch panel
refuses a bad setting and launches a run.  Screenshots go to ``artifacts/``."""

import os

import pytest

from browser.lab import (
    ALL_BARS_FULL,
    ARTIFACTS,
    JupyterLab,
    chromium_and_playwright,
    launch_chromium,
    run_all_cells,
    write_notebook,
)
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
    lab.run_ids.update(
        page.eval_on_selector_all(".torchdist-header[data-run-id]", "els => els.map(e => e.dataset.runId)")
    )
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
        assert (
            "stopped by the Stop button" in page.locator(f"{long} .torchdist-summary .torchdist-failure").inner_text()
        )
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
        # in a 600 px pane: flags whole, help cut at a word (two lines, whole in the tooltip),
        # the options a screen tall
        page.evaluate("() => { window.jupyterapp.shell.collapseLeft(); window.jupyterapp.shell.collapseRight(); }")
        page.set_viewport_size({"width": 700, "height": 1500})
        page.wait_for_timeout(400)
        assert 550 <= page.locator(panel).bounding_box()["width"] <= 620
        top = page.locator(panel).bounding_box()["y"]
        # the first options, the folded rest, the code and Launch: a screen tall
        assert page.locator(f"{panel} .torchdist-launch").bounding_box()["y"] - top < 900  # was 2,100 px
        page.locator(panel).screenshot(path=artifact("browser-panel-600.png"))
        page.locator(f"{panel} .torchdist-more-options").get_by_text("more options").click()
        page.wait_for_selector(f"{panel} .torchdist-option-hang_timeout input", state="visible")
        flags = page.eval_on_selector_all(f"{panel} code", "els => els.map(e => e.getClientRects().length)")
        assert flags and set(flags) == {1}, flags  # each flag on one line
        notes = page.eval_on_selector_all(
            f"{panel} .torchdist-option-note span",
            "els => els.map(e => [e.scrollWidth <= e.clientWidth + 1,"
            " e.getBoundingClientRect().height, e.title.length > 0])",
        )
        assert all(fits and height <= 40 and titled for fits, height, titled in notes), notes
        page.set_viewport_size({"width": 1280, "height": 1500})
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
    ranks = [pid for pid, cmd in own.seen.items() if "torchdist_magic.rank.worker" in cmd]
    assert len(kernels) == 1 and len(ranks) >= 2, f"expected a kernel and its ranks under JupyterLab: {own.seen}"
    assert len(own.run_ids) == 1
    assert_lab_left_nothing(own)


# -- a large run, a narrow pane, the dark theme -------------------------------------------------------
SIMULATED = """import sys
sys.path.insert(0, {tests!r})
from IPython.display import HTML
from view_helpers import simulated_run
from torchdist_magic.view.widget import WidgetView

def live_and_kept(ranks):
    run, clock = simulated_run(ranks, steps=200)
    view = WidgetView(run, display=False, clock=clock)
    return view.widget, HTML(view.snapshot_html())
"""

#: every piece of text under ``scope`` whose contrast with what is behind it is below 4.5:1
#: (WCAG AA), from computed styles: its colour (an SVG text's fill) over the backgrounds of its
#: ancestors, composited, and the page's background at the bottom
LOW_CONTRAST = """(scope) => {
    const canvas = document.createElement('canvas').getContext('2d');
    const rgba = (css) => {  // any CSS colour the browser computed -> [r, g, b, a]
        canvas.clearRect(0, 0, 1, 1); canvas.fillStyle = '#000'; canvas.fillStyle = css;
        canvas.fillRect(0, 0, 1, 1);
        const d = canvas.getImageData(0, 0, 1, 1).data;
        return [d[0], d[1], d[2], d[3] / 255];
    };
    const over = (top, under) => top.slice(0, 3).map((c, i) => c * top[3] + under[i] * (1 - top[3])).concat([1]);
    const lum = (c) => { const l = c.slice(0, 3).map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
                         return 0.2126 * l[0] + 0.7152 * l[1] + 0.0722 * l[2]; };
    const background = (el) => {
        const layers = [];
        for (let e = el; e; e = e.parentElement) {
            const bg = getComputedStyle(e).backgroundColor;
            if (bg) { const c = rgba(bg); if (c[3] > 0) layers.push(c); if (c[3] >= 1) break; }
        }
        let colour = rgba(getComputedStyle(document.body).backgroundColor);
        if (colour[3] < 1) colour = [255, 255, 255, 1];
        for (const layer of layers.reverse()) colour = over(layer, colour);
        return colour;
    };
    const low = [];
    for (const root of document.querySelectorAll(scope)) {
        const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            const el = node.parentElement;
            if (!node.textContent.trim() || !el.getClientRects().length) continue;
            if (/^[\\u2580-\\u25ff\\u2500-\\u257f]+$/.test(node.textContent.trim())) continue;  // marks, not text
            const style = getComputedStyle(el);
            if (style.visibility === 'hidden' || style.display === 'none') continue;
            const isSvg = el instanceof SVGElement;
            let fg = rgba(isSvg ? style.fill : style.color);
            const bg = background(isSvg ? el.closest('svg') : el);
            fg = over(fg, bg);
            const [a, b] = [lum(fg), lum(bg)];
            const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
            if (ratio < 4.5) low.push(`${ratio.toFixed(2)}: ${node.textContent.trim().slice(0, 40)}`);
        }
    }
    return low;
}"""

#: what sticks out of a view's box, or is cut: elements wider than the view, Stop not whole
OVERFLOW = """(scope) => {
    const problems = [];
    for (const view of document.querySelectorAll(scope)) {
        const box = view.getBoundingClientRect();
        const output = view.closest('.jp-OutputArea-output') || view.parentElement;
        if (box.right > output.getBoundingClientRect().right + 1) problems.push(`view ${box.width}px wider than its output`);
        for (const el of view.querySelectorAll('*')) {
            const r = el.getBoundingClientRect();
            if (r.width && r.right > box.right + 1 && !el.closest('[style*="overflow"]')) {
                problems.push(`${el.className || el.tagName} ends at ${r.right.toFixed(0)} past ${box.right.toFixed(0)}`);
                if (problems.length > 8) break;
            }
        }
        const stop = view.querySelector('.torchdist-stop');
        if (stop && stop.offsetParent && (stop.scrollWidth > stop.clientWidth + 1 || stop.getBoundingClientRect().right > box.right + 1))
            problems.push('Stop is cut');
    }
    return problems;
}"""


def test_views_of_4_64_and_1024_ranks_read_well_narrow_wide_light_and_dark(browser, lab):
    tests = os.path.dirname(os.path.abspath(__file__))
    cells = [SIMULATED.format(tests=tests)]
    for ranks in (4, 64, 1024):
        cells += [f"live_{ranks}, kept_{ranks} = live_and_kept({ranks})\nlive_{ranks}", f"kept_{ranks}"]
    page = open_and_run(browser, lab, "scale.ipynb", cells)
    cell = ".jp-Notebook .jp-Cell:nth-child({})".format
    views = ".torchdist-view, .torchdist-summary"
    try:
        # the notebook alone: at 400 px the file browser would leave it a sliver
        page.evaluate("() => { window.jupyterapp.shell.collapseLeft(); window.jupyterapp.shell.collapseRight(); }")
        page.wait_for_selector(f"{cell(7)} .torchdist-summary", timeout=120_000)
        page.wait_for_selector(f"{cell(6)} .torchdist-view .torchdist-overview")
        assert page.locator(f"{cell(2)} .torchdist-view .torchdist-rank-row").count() == 4
        assert page.locator(f"{cell(4)} .torchdist-view .torchdist-overview[data-ranks='64']").count() == 1
        assert page.locator(f"{cell(6)} .torchdist-view .torchdist-rank-row").count() <= 8
        assert page.locator(f"{cell(7)} .torchdist-summary .torchdist-plot-band").count() == 3
        # the contrast check sees faint text (it is not vacuous)
        page.evaluate(
            f"() => document.querySelector('{cell(2)} .torchdist-header').insertAdjacentHTML("
            "'beforeend', '<span id=faint style=\"color:#bbb\">faint</span>')"
        )
        assert [low.split(": ")[1] for low in page.evaluate(LOW_CONTRAST, views)] == ["faint"]
        page.evaluate("() => document.getElementById('faint').remove()")
        for theme in ("light", "dark"):
            if theme == "dark":
                page.evaluate(
                    "() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})"
                )
                page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'")
                page.wait_for_timeout(500)
            for width in (1280, 400):
                page.set_viewport_size({"width": width, "height": 2800})  # a whole view on screen
                page.wait_for_timeout(400)
                low = page.evaluate(LOW_CONTRAST, views)
                assert low == [], f"{theme} at {width} px: {low}"
                cut = page.evaluate(OVERFLOW, views)
                assert cut == [], f"{theme} at {width} px: {cut}"
                # the header wraps between its parts, never inside one (one word per line)
                broken = page.eval_on_selector_all(
                    ".torchdist-header > span",
                    "els => els.filter(e => e.getClientRects().length > 1).map(e => e.textContent)",
                )
                assert broken == [], f"{theme} at {width} px: {broken}"
                for n, ranks in ((2, 4), (4, 64), (6, 1024)):
                    page.locator(f"{cell(n)} .jp-OutputArea").screenshot(
                        path=artifact(f"view-{ranks}-live-{theme}-{width}.png")
                    )
                    page.locator(f"{cell(n + 1)} .jp-OutputArea").screenshot(
                        path=artifact(f"view-{ranks}-kept-{theme}-{width}.png")
                    )
    except Exception:
        page.screenshot(path=artifact("browser-scale-failure.png"), full_page=True)
        raise
    finally:
        page.close()
