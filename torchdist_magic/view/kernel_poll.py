"""Widget messages while a cell blocks the kernel: what lets the Stop button stop a run that a
``%%torchdist`` cell is waiting for.

A kernel reads its shell channel between cells, so a click on a widget (a ``comm_msg`` from the
frontend) waits until the cell that shows the widget has ended: too late to stop what the cell
waits for.  ``KernelPoll.start(shell)``, called in the cell, gives a poller whose ``poll()``,
called from the cell while it waits, takes the shell messages that arrived since the last call,
in order:

- widget messages (``comm_open``, ``comm_msg``, ``comm_close``) are handled at once, by the
  comm manager (``comm.get_comm_manager()``), in the cell's thread;
- every other message (the next cell's ``execute_request``, a completion, ``kernel_info``...)
  goes to the handler the kernel registered for its shell messages, which queues it behind the
  running cell exactly as if nobody had looked: nothing is lost or reordered.

``close()``, or else the end of the cell (IPython's ``post_run_cell``), gives the stream back.

How, and why not jupyter-ui-poll: jupyter-ui-poll (1.1.0) drives ``Kernel.do_one_iteration()``,
which ipykernel 7.1 removed; there ``ui_events()`` handles nothing, silently
(Kirill888/jupyter-ui-poll#54).  This module reads the stream that receives the main shell's
messages through pyzmq's public ``ZMQStream.on_recv``/``flush``, the stream being
``ipykernel.eventloops.get_shell_stream(kernel)`` (ipykernel 7.1 and later: what its own GUI
event loops poll) or ``kernel.shell_stream`` (ipykernel 6, where the main thread reads the shell
socket itself).  Its one private name is ``ZMQStream._recv_callback``: the kernel's handler,
passed messages on and put back on the stream at the end.  ``tests/test_kernel_poll.py`` runs a
real kernel; CI runs it under ipykernel 6 and 7 so that a kernel release that changes any of
this is caught.  Where a kernel has none of it (ipykernel 7.0, another kernel), ``start`` gives
None and widgets answer when the cell ends.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, ClassVar, Optional, Tuple

log = logging.getLogger(__name__)

COMM_TYPES = frozenset({"comm_open", "comm_msg", "comm_close"})


def main_shell_stream(kernel) -> Optional[Any]:
    """The ``ZMQStream`` that receives the main shell's messages in the kernel's main thread,
    or None for a kernel that has none."""
    try:
        from ipykernel.eventloops import get_shell_stream
    except ImportError:
        if getattr(kernel, "shell_channel_thread", None) is not None:
            return None  # ipykernel 7.0: its shell stream belongs to the shell channel's thread
        return getattr(kernel, "shell_stream", None)  # ipykernel 6: the main thread reads it
    return get_shell_stream(kernel)


class KernelPoll:
    """Handles widget messages while the cell that created it runs (see the module docstring).

    One at a time: cells do not nest, and a second view in the same cell starts its own poller
    after the first one closed.
    """

    _active: ClassVar[Optional["KernelPoll"]] = None

    def __init__(self, shell, session, stream, deliver: Callable[[list], Any]):
        self._shell = shell
        self._session = session
        self._stream = stream
        self._deliver = deliver
        self._thread = threading.current_thread()
        self._handled = 0
        self._closed = False
        stream.on_recv(self._on_message, copy=False)
        shell.events.register("post_run_cell", self._after_cell)
        KernelPoll._active = self

    @classmethod
    def start(cls, shell) -> Optional["KernelPoll"]:
        """A poller for the cell ``shell``'s kernel is running, when called from the kernel's
        main thread; None outside a kernel, in another thread, while another poller is active,
        or for a kernel whose shell stream this module does not know."""
        kernel = getattr(shell, "kernel", None)
        session = getattr(kernel, "session", None)
        if session is None or threading.current_thread() is not threading.main_thread():
            return None
        if cls._active is not None:
            return None
        stream = main_shell_stream(kernel)
        deliver = getattr(stream, "_recv_callback", None)
        if deliver is None:
            return None
        return cls(shell, session, stream, deliver)

    def poll(self, limit: int = 100) -> int:
        """Take up to ``limit`` waiting shell messages; the number of widget messages handled.
        Does nothing after ``close()`` or from another thread than the one that started it."""
        if self._closed or threading.current_thread() is not self._thread:
            return 0
        import zmq

        self._handled = 0
        self._stream.flush(zmq.POLLIN, limit)
        return self._handled

    def _on_message(self, frames: list) -> Any:
        widget_message = self._widget_message(frames)
        if widget_message is None:
            # the kernel's own handler; an awaitable it returns is scheduled by the stream
            return self._deliver(frames)
        idents, msg = widget_message
        handler = getattr(self._comm_manager(), msg["header"]["msg_type"])
        try:
            handler(self._stream, idents, msg)
        except Exception:  # a widget callback's error must not end the wait for the run
            log.exception("torchdist: error in a widget message handler")
        self._handled += 1
        return None

    def _widget_message(self, frames: list) -> Optional[Tuple[list, dict]]:
        """``(idents, message)`` when ``frames`` are a widget message, else None (also for
        anything this poller cannot read: the kernel gets it unchanged)."""
        try:
            idents, parts = self._session.feed_identities(frames, copy=False)
            head = self._session.deserialize(parts, content=False, copy=False)
            if head["header"]["msg_type"] not in COMM_TYPES:
                return None
            msg = self._session.deserialize(parts, content=True, copy=False)
        except Exception:  # noqa: BLE001
            return None
        return idents, msg

    @staticmethod
    def _comm_manager():
        import comm

        return comm.get_comm_manager()

    def close(self) -> None:
        """Give the shell stream back to the kernel; messages not taken yet reach it as usual."""
        if self._closed:
            return
        self._closed = True
        # both ipykernel 6 and 7 register their handler with copy=False (and it got such frames
        # from this poller meanwhile)
        self._stream.on_recv(self._deliver, copy=False)
        self._shell.events.unregister("post_run_cell", self._after_cell)
        if KernelPoll._active is self:
            KernelPoll._active = None

    def _after_cell(self, *args) -> None:
        # a cell that ended without closing its view (an error in it) must not keep the stream;
        # post_run_cell, not post_execute: comm handlers trigger post_execute too
        self.close()
