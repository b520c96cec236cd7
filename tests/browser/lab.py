"""JupyterLab on a loopback port and headless Chromium driven by Playwright, for the browser tests.

``JupyterLab`` starts the server on 127.0.0.1 with a random free port, a token, a temporary root
and config directories, and stops it by pid, remembering every process it had under it so a test
can check that none survives.  ``chromium_and_playwright()`` says what is missing, if anything.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional, Set

from helpers import alive, free_port

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
ARTIFACTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "artifacts")


#: every rank row of a cell's (or the panel's) view has a bar at its total; ``scope`` is a CSS selector
ALL_BARS_FULL = """([scope, count]) => {
    const rows = document.querySelectorAll(scope + ' .torchdist-rank-row');
    return rows.length === count && Array.from(rows).every(row => {
        const bars = row.querySelectorAll('.torchdist-bar');
        return bars.length > 0 && Array.from(bars).every(b => b.dataset.total && b.dataset.n === b.dataset.total);
    });
}"""


def find_chromium() -> Optional[str]:
    found = os.environ.get("TORCHDIST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    return next((p for p in CHROMIUM_PATHS if os.access(p, os.X_OK)), None)


def chromium_and_playwright() -> Optional[str]:
    """Why the browser tests cannot run here, or None when they can."""
    try:
        import playwright.sync_api  # noqa: F401  (only whether it imports)
    except ImportError:
        return "playwright is not installed (pip install playwright; it brings its own driver)"
    if find_chromium() is None:
        return "no Chromium found (apt-get install chromium, or set TORCHDIST_CHROMIUM)"
    return None


def _children() -> dict:
    """``{pid: ppid}`` of every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if stat[0] != b"Z":
            table[int(entry)] = int(stat[1])
    return table


def descendants(pid: int) -> Set[int]:
    table = _children()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in table.items() if parent in frontier} - found
        found |= frontier
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def write_notebook(path: str, cells: List[str]) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


class JupyterLab:
    """``with JupyterLab() as lab:`` ... ``lab.url("nb.ipynb")``; ``lab.seen`` maps every pid seen
    under the server (kernels, ranks) to its command line."""

    def __init__(self, workdir: Optional[str] = None, startup_timeout: float = 60.0):
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.tmp = tempfile.mkdtemp(prefix="tdlab-", dir=workdir)
        self.root = os.path.join(self.tmp, "root")
        self.startup_timeout = startup_timeout
        self.proc: Optional[subprocess.Popen] = None
        self.seen: Dict[int, str] = {}
        self.log_path = os.path.join(self.tmp, "lab.log")

    def __enter__(self) -> "JupyterLab":
        os.makedirs(self.root)
        config = os.path.join(self.tmp, "config")
        os.makedirs(os.path.join(config, "labconfig"))
        with open(os.path.join(config, "labconfig", "page_config.json"), "w") as fh:
            # no "news" toast over the notebook
            json.dump({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}, fh)
        env = dict(
            os.environ,
            JUPYTER_CONFIG_DIR=config,
            JUPYTER_RUNTIME_DIR=os.path.join(self.tmp, "runtime"),
            JUPYTERLAB_SETTINGS_DIR=os.path.join(self.tmp, "settings"),
            JUPYTERLAB_WORKSPACES_DIR=os.path.join(self.tmp, "workspaces"),
        )
        cmd = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            "--ServerApp.terminals_enabled=False",
        ]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, cwd=self.root, env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                self.api("GET", "/api/status")
                return self
            except OSError:
                time.sleep(0.3)
        why = "exited" if self.proc.poll() is not None else f"did not answer within {self.startup_timeout:g} s"
        log = self.log_tail()
        self.stop()
        raise RuntimeError(f"JupyterLab {why} at start-up:\n{log}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path, "rb") as fh:
            return b"\n".join(fh.read().splitlines()[-n:]).decode(errors="replace")

    def api(self, method: str, path: str, body: Optional[dict] = None):
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            data = resp.read()
        return json.loads(data) if data else None

    def url(self, notebook: str) -> str:
        return f"http://127.0.0.1:{self.port}/lab/tree/{notebook}?token={self.token}&reset"

    def note_processes(self) -> None:
        """Remember the processes under the server now (kernels and what they started)."""
        if self.proc is not None and self.proc.poll() is None:
            for pid in descendants(self.proc.pid) - set(self.seen):
                self.seen[pid] = cmdline(pid)

    def stop(self, grace: float = 15.0) -> None:
        """Stop the server by its pid: SIGTERM (it shuts its kernels down), SIGKILL after
        ``grace`` seconds."""
        if self.proc is None:
            return
        self.note_processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.seen.setdefault(self.proc.pid, "jupyter-lab")
        shutil.rmtree(self.tmp, ignore_errors=True)

    def survivors(self, wait: float = 10.0) -> List[int]:
        deadline = time.monotonic() + wait
        while True:
            left = sorted(p for p in self.seen if alive(p))
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


def launch_chromium(playwright, user_data_dir: str):
    """A headless Chromium context on its own fresh profile."""
    return playwright.chromium.launch_persistent_context(
        user_data_dir,
        executable_path=find_chromium(),
        headless=True,
        args=CHROMIUM_ARGS,
        viewport={"width": 1280, "height": 1000},
        device_scale_factor=1,
    )


def run_all_cells(page) -> None:
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
        " && window.jupyterapp.shell.currentWidget.sessionContext"
        " && window.jupyterapp.shell.currentWidget.sessionContext.session"
        " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
        timeout=60_000,
    )
    # not awaited: the command's promise settles only when every cell has run
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
