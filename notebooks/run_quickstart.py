"""Run the quick-start notebook headless and print what its ranks reported.

    python notebooks/run_quickstart.py [--output executed.ipynb] [--timeout SECONDS]

Executes ``notebooks/01-quickstart.ipynb`` top to bottom with nbclient in a kernel of this
interpreter (two local processes, CPU), echoes each cell's output as it arrives (the run view's
text lines: ``[rank N] ...`` and the per-rank summary), then prints the test accuracy the
notebook computed.  Exits 1 when a cell fails, the accuracy is missing, or a process the run
started is still alive afterwards.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOK = os.path.join(HERE, "01-quickstart.ipynb")
ACCURACY = re.compile(r"test accuracy: ([0-9.]+)")
#: set in the kernel's environment, inherited by every rank: finds what the run left behind
MARKER = "TORCHDIST_QUICKSTART_RUN"


def _kernel_manager_class():
    """Kernels of ``sys.executable -m ipykernel_launcher``: the notebook runs in this
    interpreter's environment, whatever kernelspec named "python3" is installed."""
    from ipykernel.kernelspec import RESOURCES, get_kernel_dict
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class ThisInterpreterSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=RESOURCES, **get_kernel_dict())

    class ThisInterpreterKernel(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _kernel_spec_manager_default(self):
            return ThisInterpreterSpecs(data_dir=self.data_dir)

    return ThisInterpreterKernel


def _client_class():
    from nbclient import NotebookClient

    class EchoingClient(NotebookClient):
        """Prints every cell's text output the moment the kernel sends it."""

        def output(self, outs, msg, display_id, cell_index):
            content = msg.get("content", {})
            if msg["msg_type"] == "stream":
                stream = sys.stderr if content.get("name") == "stderr" else sys.stdout
                stream.write(content.get("text", ""))
                stream.flush()
            elif msg["msg_type"] in ("display_data", "execute_result"):
                text = content.get("data", {}).get("text/plain")
                if text:
                    print(text, flush=True)
            return super().output(outs, msg, display_id, cell_index)

    return EchoingClient


def _marked_processes(marker: str) -> list:
    """Live processes whose environment carries ``MARKER=marker`` (the kernel's descendants)."""
    needle = f"{MARKER}={marker}".encode() + b"\x00"
    found = []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                marked = needle in fh.read()
            with open(f"/proc/{pid}/stat", "rb") as fh:
                zombie = fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except (OSError, IndexError):
            continue
        if marked and not zombie:
            found.append(int(pid))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", metavar="PATH", help="also write the executed notebook to PATH")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one cell may run (default: 600)")
    args = parser.parse_args(argv)

    import nbformat
    from nbclient.exceptions import CellExecutionError, DeadKernelError

    nb = nbformat.read(NOTEBOOK, as_version=4)
    marker = uuid.uuid4().hex
    os.environ[MARKER] = marker
    client = _client_class()(
        nb,
        kernel_manager_class=_kernel_manager_class(),
        timeout=int(args.timeout),
        allow_errors=False,
        # the text view: its lines are the output a terminal can show
        extra_arguments=["--TorchdistMagics.view=text"],
        resources={"metadata": {"path": HERE}},
    )
    print(f"run_quickstart: executing {os.path.relpath(NOTEBOOK)} with {sys.executable}", flush=True)
    started = time.monotonic()
    failed = None
    try:
        client.execute()
    except CellExecutionError as exc:
        failed = f"a cell failed:\n{exc}"
    except DeadKernelError as exc:
        failed = f"the kernel died: {exc}"
    except TimeoutError as exc:
        failed = f"a cell ran longer than {args.timeout:g} s: {exc}"
    elapsed = time.monotonic() - started

    if args.output:
        nbformat.write(nb, args.output)
    deadline = time.monotonic() + 5.0
    while _marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _marked_processes(marker)
    if failed:
        print(f"run_quickstart: FAILED after {elapsed:.0f} s: {failed}", file=sys.stderr)
        return 1
    if left:
        print(f"run_quickstart: FAILED: processes left behind: {left}", file=sys.stderr)
        return 1
    texts = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    found = [float(m.group(1)) for t in texts for m in ACCURACY.finditer(t)]
    if not found:
        print("run_quickstart: FAILED: the notebook printed no test accuracy", file=sys.stderr)
        return 1
    print(f"run_quickstart: test accuracy {found[-1]:.3f}; the notebook ran in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
