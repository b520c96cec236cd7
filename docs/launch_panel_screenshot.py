"""Take ``docs/launch-panel.png``: the launch panel of ``notebooks/04-launch-panel.ipynb`` in
JupyterLab, set up as that notebook's cells set it (function ``train``, 2 ranks, local), after
its run finished (rank 0's value, a state dict, cut to its first lines in the picture).

    python docs/launch_panel_screenshot.py [--output docs/launch-panel.png]

Runs the notebook's own cells (up to the panel, then the cell that fills it in, then Launch) in
JupyterLab on a loopback port with headless Chromium (Playwright), as the browser tests do
(``tests/browser/lab.py``), and screenshots the panel. Needs the `test` extra (jupyterlab,
playwright) and Chromium. Not a test; re-run it after the panel or the run view changes.
"""

from __future__ import annotations

import argparse
import os
import sys

import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests")]

from browser.lab import ALL_BARS_FULL, JupyterLab, launch_chromium, run_all_cells, write_notebook  # noqa: E402

NOTEBOOK = os.path.join(ROOT, "notebooks", "04-launch-panel.ipynb")
PANEL = ".torchdist-panel"


def panel_cells() -> list:
    """The notebook's code cells up to ``%torchdist_panel``, then the one that fills the panel
    in (``panel = _torchdist_panel`` ...), then Launch."""
    code = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
    upto = next(i for i, src in enumerate(code) if src.strip() == "%torchdist_panel")
    fill = next(src for src in code if src.startswith("panel = _torchdist_panel"))
    return code[: upto + 1] + [fill, "run = panel.launch()"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.path.join(ROOT, "docs", "launch-panel.png"))
    args = parser.parse_args(argv)

    from playwright.sync_api import sync_playwright

    with JupyterLab() as lab, sync_playwright() as playwright:
        write_notebook(os.path.join(lab.root, "panel.ipynb"), panel_cells())
        context = launch_chromium(playwright, os.path.join(lab.tmp, "chromium-profile"))
        try:
            context.set_default_timeout(120_000)
            page = context.new_page()
            # tall enough for the whole panel: JupyterLab draws only the cells in view
            page.set_viewport_size({"width": 1300, "height": 3000})
            page.goto(lab.url("panel.ipynb"))
            page.wait_for_selector(".jp-Notebook .jp-Cell")
            run_all_cells(page)
            # the file browser closed: the notebook, and so the panel, gets the page's width
            page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
            page.wait_for_selector(f"{PANEL} .torchdist-view .torchdist-rank-row")
            page.wait_for_function(ALL_BARS_FULL, arg=[f"{PANEL} .torchdist-view", 2])
            page.wait_for_selector(f"{PANEL} .torchdist-value")
            # the value (a state dict of ~100 lines) cut to its first lines, for the picture only
            page.add_style_tag(content=f"{PANEL} .torchdist-value {{ max-height: 5.5em; overflow: hidden; }}")
            page.locator(PANEL).scroll_into_view_if_needed()
            page.locator(PANEL).screenshot(path=args.output)
        finally:
            context.close()
    print(f"launch_panel_screenshot.py: wrote {args.output} ({os.path.getsize(args.output) / 1000:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
