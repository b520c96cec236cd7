"""Following a run in the calling thread: a view's updates, the ranks' debugger sessions, Ctrl-C."""

from __future__ import annotations

from typing import Any, Optional, Protocol

from ..driver.distributor import Run


class Observer(Protocol):
    """What ``follow`` notifies while it waits: a view."""

    def update(self) -> None: ...

    def close(self) -> None: ...


def follow(run: Run, observer: Optional[Observer] = None, interval: float = 0.1) -> Any:
    """Wait for ``run`` in the calling thread, calling ``observer.update()`` every ``interval``
    seconds and ``observer.close()`` at the end, and serving the ranks' debugger sessions
    (``debugger.Console.serve``: their output here, the user's lines by ``input()``); Ctrl-C
    cancels the run and re-raises (at a debugger's prompt, it ends that session instead).
    Returns rank 0's value or raises the run's error."""
    try:
        while not run.wait(interval):
            if observer is not None:
                observer.update()
            run.debugger.serve(run.done)  # a rank's debugger session, in this thread's output
        run.debugger.serve(run.done)  # what a session printed last
    except KeyboardInterrupt:
        run.cancel(by="an interrupt (Ctrl-C, or the kernel's interrupt)")
        run.wait()
        if observer is not None:
            observer.close()
        raise
    if observer is not None:
        observer.close()
    return run.result()
