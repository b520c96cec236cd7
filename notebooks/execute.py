"""Execute the notebooks and store them with their outputs, in place.

    python notebooks/execute.py                      # every notebook in notebooks/
    python notebooks/execute.py 01-quickstart 11     # some: names, with or without .ipynb, or prefixes
    python notebooks/execute.py --output-dir DIR     # write them elsewhere (binder/check.sh)

Each notebook runs top to bottom with nbclient in a kernel of this interpreter, in
``notebooks/`` as its working directory (``tests/test_notebooks.py`` runs them the same way, with
``run_checked``).  A cell tagged ``raises-exception`` must raise the error named by its metadata
``"raises"`` (``"RankFailure"``, ``"UsageError"``: the one its text promises; its traceback is kept
as output); a tagged cell that raises nothing or another error, and any other cell that raises or
shows a ``UsageError`` (IPython prints a user's mistake on stderr, with no traceback), fail the
notebook, and nothing is written for it.  What is stored is what a reader wants to see without a
kernel, on GitHub and in the docs site (which renders these outputs and executes nothing): the run
view's static summary (HTML with bars, plots and each rank's last lines, and its text form),
printed output, tracebacks and hang stacks.  What GitHub cannot render is dropped: widget views
and the saved widget state (every run view replaces itself with its static summary when its run
ends, so no information is lost), and the per-cell timing metadata.  Running it again rewrites
the outputs (same cells; only the outputs of the new run differ).

There is one copy of each notebook: the one here, with its outputs.  The tests run it and check
what its cells do, never the stored outputs (which are read by people); ``tests/test_notebooks.py``
checks that every notebook here was run and is readable without a kernel.  Exits 1 if any
notebook failed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT_DIR = HERE
#: a notebook larger than this gets a warning: GitHub renders big notebooks slowly or not at all
SIZE_WARNING = 1_000_000
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
#: stderr lines of a Spark session's start that say nothing about the notebook (the JVM's and
#: log4j's start-up chatter, Spark's own WARNs before the notebook sets a log level)
SPARK_CHATTER = re.compile(
    r"^(WARNING: Using incubator modules: .*"
    r"|Using Spark's default log4j profile: .*"
    r"|Setting default log level to .*"
    r"|To adjust logging level use sc\.setLogLevel\(newLevel\)\..*"
    r"|\d\d/\d\d/\d\d \d\d:\d\d:\d\d WARN (Utils|NativeCodeLoader): .*)$"
)


def sources() -> list:
    return sorted(n for n in os.listdir(HERE) if n.endswith(".ipynb"))


def select(names: list) -> list:
    """The source notebooks named (``01-quickstart``, ``01-quickstart.ipynb`` or ``01``)."""
    every = sources()
    if not names:
        return every
    chosen = []
    for name in names:
        name = os.path.basename(name)
        hits = [n for n in every if n == name or n == f"{name}.ipynb" or n.startswith(name)]
        if not hits:
            raise SystemExit(f"execute.py: no notebook in {HERE} matches {name!r}; there are: {', '.join(every)}")
        chosen += [h for h in hits if h not in chosen]
    return chosen


def _kernel_manager_class():
    """Kernels of ``sys.executable -m ipykernel_launcher``, whatever kernelspec "python3" names."""
    sys.path.insert(0, HERE)
    try:
        from run_quickstart import _kernel_manager_class as this_interpreter
    finally:
        sys.path.remove(HERE)
    return this_interpreter()


def readable(nb) -> None:
    """Drop what GitHub and nbviewer cannot show, and what no reader wants: widget views,
    widget state, per-cell timings, Spark's start-up chatter on stderr."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data is not None and WIDGET_VIEW in data:
                data.pop(WIDGET_VIEW)
                # a live widget's text/plain is only its repr ("VBox(children=...)"); a view that
                # is still a widget at the end of its cell has nothing else worth keeping
                if set(data) <= {"text/plain"} and data.get("text/plain", "").startswith(
                    ("VBox(", "HBox(", "Output(", "HTML(", "Box(")
                ):
                    continue
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                lines = [
                    line
                    for line in out.get("text", "").splitlines(keepends=True)
                    if not SPARK_CHATTER.match(line.rstrip("\n"))
                ]
                if not "".join(lines).strip():
                    continue
                out["text"] = "".join(lines)
            out.get("metadata", {}).pop("transient", None)
            kept.append(out)
        cell.outputs = kept


#: the tag of a cell that raises on purpose, and the key of its metadata naming what it raises
RAISES_TAG = "raises-exception"
RAISES_KEY = "raises"


class NotebookFailed(Exception):
    """A notebook whose cells did not do what they say: ``problems``, one line each."""

    def __init__(self, name: str, problems: list):
        self.problems = problems
        super().__init__(f"{name}: " + "; ".join(problems))


def _usage_errors(cell) -> list:
    """The ``UsageError: ...`` lines a cell showed on stderr."""
    return [
        line
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream" and out.get("name") == "stderr"
        for line in out.get("text", "").splitlines()
        if line.startswith("UsageError:")
    ]


def cell_problems(index: int, cell, reply: dict) -> list:
    """What is wrong with code cell ``index`` (of the notebook's cells) after it ran, given the
    content of its execute reply: an error it was not tagged to raise, a ``UsageError`` on stderr,
    or, tagged ``raises-exception``, not raising the error its ``"raises"`` metadata names."""
    first_line = cell.source.splitlines()[0] if cell.source else ""
    where = f"cell {index} ({first_line!r})"
    raised = reply.get("ename") if reply.get("status") == "error" else None
    if RAISES_TAG not in cell.metadata.get("tags", []):
        if raised is not None:
            return [f"{where} raised {raised}: {reply.get('evalue', '')}"]
        return [f"{where} showed {line}" for line in _usage_errors(cell)]
    promised = cell.metadata.get(RAISES_KEY)
    if not promised:
        return [f"{where} is tagged {RAISES_TAG} but names no error in its metadata {RAISES_KEY!r}"]
    if raised is None:
        return [f"{where} should raise {promised} but raised nothing"]
    if raised != promised:
        return [f"{where} should raise {promised} but raised {raised}: {reply.get('evalue', '')}"]
    return []


def run_checked(nb, kernel_manager_class, timeout: int, path: str = HERE, name: str = "notebook"):
    """Run ``nb`` top to bottom in ``path``, checking each code cell as it ends
    (``cell_problems``): the first cell with a problem stops the run with ``NotebookFailed``."""
    from nbclient import NotebookClient

    def check(cell, cell_index, execute_reply):
        # called before nbclient's own check, which would let a tagged cell pass whatever it did
        problems = cell_problems(cell_index, cell, execute_reply["content"])
        if problems:
            raise NotebookFailed(name, problems)

    NotebookClient(
        nb,
        kernel_manager_class=kernel_manager_class,
        timeout=timeout,
        allow_errors=False,
        record_timing=False,
        resources={"metadata": {"path": path}},
        on_cell_executed=check,
    ).execute()
    return nb


def execute(name: str, timeout: int, kernel_manager_class, out_dir: str = OUT_DIR) -> tuple:
    import nbformat

    nb = nbformat.read(os.path.join(HERE, name), as_version=4)
    run_checked(nb, kernel_manager_class, timeout, name=name)
    readable(nb)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    text = nbformat.writes(nb)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text if text.endswith("\n") else text + "\n")
    return path, os.path.getsize(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks to run (default: all of notebooks/*.ipynb)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one cell may run (default: 600)")
    parser.add_argument(
        "--output-dir",
        default=OUT_DIR,
        metavar="DIR",
        help="where the executed notebooks go (default: notebooks/ itself; binder/check.sh uses a temporary one)",
    )
    args = parser.parse_args(argv)

    from nbclient.exceptions import CellExecutionError, DeadKernelError

    manager = _kernel_manager_class()
    failed = []
    started = time.monotonic()
    for name in select(args.names):
        print(f"execute.py: {name} ...", end=" ", flush=True)
        t0 = time.monotonic()
        try:
            path, size = execute(name, args.timeout, manager, args.output_dir)
        except (NotebookFailed, CellExecutionError, DeadKernelError, TimeoutError) as exc:
            print(f"FAILED after {time.monotonic() - t0:.0f} s", flush=True)
            print(str(exc)[-3000:], file=sys.stderr)
            failed.append(name)
            continue
        note = "  (over 1 MB: look at what made it so big)" if size > SIZE_WARNING else ""
        print(f"{time.monotonic() - t0:.0f} s, {path} {size / 1000:.0f} kB{note}", flush=True)
    print(
        f"execute.py: {'FAILED: ' + ', '.join(failed) if failed else 'all written'} "
        f"in {time.monotonic() - started:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
