"""A rank's debugger, served over the run's channel (DESIGN: "Interactive sessions with a rank").

The worker installs it (``install``): ``breakpoint()`` then opens a ``(Pdb rank r)`` session, and
``post_mortem(exc)`` opens one on the frames of a job that raised when the run asked for it
(``--pdb``).  A session is a ``RankPdb`` whose stdin and stdout are the run's channel: what pdb
writes goes to the driver as ``events.DebugOutput`` records (with the prompt when it waits for a
line), and each line it reads comes back as an ``events.DebugInput``.  The driver
(``debugger.Console``) shows the session in the cell and asks the notebook's user for the lines.

The driver says what this rank may do in its environment (``debugger.rank_env``):

- ``TORCHDIST_DEBUG``: ``"1"`` when someone can answer a prompt (the notebook has stdin), else
  ``breakpoint()`` prints one warning line and returns: nothing waits for input that cannot come;
- ``TORCHDIST_PDB``: ``"1"``: hold a failing rank in a post-mortem session (``--pdb``);
- ``TORCHDIST_DEBUG_IDLE``: seconds a session waits for a line before it ends by itself (the rank
  then goes on: a post-mortem's rank exits with its failure, a breakpoint's ends the run, as ``q``).

``PYTHONBREAKPOINT`` is respected: ``0`` turns ``breakpoint()`` off, another hook is called as
Python would call it, except a framework's own that a rank merely inherited (``NOT_A_RANKS_HOOK``:
Ray's, once the notebook called ``ray.init``).
"""

from __future__ import annotations

import io
import os
import pdb
import queue
import socket
import sys
import threading
import uuid
from typing import Dict, Optional

from torchdist_magic.core import events
from torchdist_magic.core.timing import HANDSHAKE_DEADLINE
from ..core.names import DEBUG_ENV, PDB_ENV, IDLE_ENV


_debugger: Optional["RankDebugger"] = None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _Output(io.TextIOBase):
    """pdb's stdout in a session: gathers what it writes; the session sends it."""

    def __init__(self, session: "Session"):
        self._session = session

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._session.write(text)
        return len(text)

    def flush(self) -> None:
        self._session.flush()


class _Input(io.TextIOBase):
    """pdb's stdin in a session: each line the driver sends."""

    def __init__(self, session: "Session"):
        self._session = session

    def readable(self) -> bool:
        return True

    def readline(self, size: int = -1) -> str:
        return self._session.readline()


class Session:
    """One debugger session on this rank: its output to the driver, its input from the driver."""

    def __init__(self, owner: "RankDebugger", kind: str, time: float):
        self.id = uuid.uuid4().hex[:12]
        self.kind = kind
        self.time = time
        self.ended = False
        self._owner = owner
        self._pending = []
        self._lock = threading.Lock()
        self.lines: "queue.Queue[events.DebugInput]" = queue.Queue()
        self.stdout = _Output(self)
        self.stdin = _Input(self)

    def write(self, text: str) -> None:
        with self._lock:
            self._pending.append(text)

    def _take(self) -> str:
        with self._lock:
            text, self._pending = "".join(self._pending), []
        return text

    def _send(self, text: str = "", prompt: str = "", end: bool = False) -> None:
        self._owner.client.send(
            events.DebugOutput(
                rank=_rank(), session=self.id, kind=self.kind, text=text, prompt=prompt, end=end, time=self.time
            )
        )

    def flush(self) -> None:
        """Send the complete lines written so far; an unfinished one may be a prompt, which
        ``readline`` sends as such."""
        with self._lock:
            text = "".join(self._pending)
            head, newline, tail = text.rpartition("\n")
            self._pending = [tail] if tail else []
        if newline:
            self._send(head + newline)

    def readline(self) -> str:
        """The next line the user typed; ``""`` (end of input: pdb quits, ``interact`` returns)
        once the session ended, was told to end, or waited ``idle`` seconds for a line."""
        text = self._take()
        if self.ended:
            if text:
                self._send(text)
            return ""
        head, _, prompt = text.rpartition("\n")
        head += "\n" if _ else ""
        self._send(head, prompt=prompt or "> ")
        idle = self._owner.idle
        try:
            record = self.lines.get(timeout=idle)
        except queue.Empty:
            self.ended = True
            self._send(
                f"torchdist: no input for {idle:g} s: the debugger session on rank {_rank()} "
                "ends (--debug-idle-timeout)\n"
            )
            return ""
        if record.end:
            self.ended = True
            return ""
        return record.line + "\n"

    def end(self) -> None:
        """The session is over: the driver stops showing it."""
        self.ended = True
        self._send(self._take(), end=True)
        self._owner.forget(self)


class RankPdb(pdb.Pdb):
    """``pdb.Pdb`` reading and writing through a ``Session``; the prompt names the rank.  While
    it waits at a prompt, the rank's own ``sys.stdin``/``sys.stdout`` are the session too, so that
    ``interact`` and what expressions print reach the notebook."""

    def __init__(self, session: Session):
        super().__init__(stdin=session.stdin, stdout=session.stdout, nosigint=True)
        self.use_rawinput = False
        self.prompt = f"(Pdb rank {_rank()}) "
        self.session = session

    def interaction(self, frame, traceback):
        saved = sys.stdin, sys.stdout
        sys.stdin, sys.stdout = self.session.stdin, self.session.stdout
        try:
            super().interaction(frame, traceback)
        finally:
            sys.stdin, sys.stdout = saved

    def set_continue(self):
        super().set_continue()
        if not self.breaks:  # nothing will stop here again: the session is over
            self.session.end()

    def set_quit(self):
        super().set_quit()
        self.session.end()


class RankDebugger:
    """This rank's sessions, and the lines the driver sends them."""

    def __init__(self, client, enabled: bool, post_mortem: bool, idle: float):
        self.client = client
        self.enabled = enabled
        self.post_mortem_on = post_mortem
        self.idle = idle
        self._sessions: Dict[str, Session] = {}
        self._lock = threading.Lock()
        self._warned = False

    def on_message(self, record: events.Event) -> None:
        """The channel's thread: a ``DebugInput`` for one of this rank's sessions."""
        if isinstance(record, events.DebugInput):
            with self._lock:
                session = self._sessions.get(record.session)
            if session is not None:
                session.lines.put(record)

    def open(self, kind: str, time: float) -> Session:
        session = Session(self, kind, time)
        with self._lock:
            self._sessions[session.id] = session
        return session

    def forget(self, session: Session) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)

    def unreachable(self) -> bool:
        """Whether the driver cannot be reached (a Spark task behind a firewall)."""
        return self.client is None or not self.client.reaches_driver(HANDSHAKE_DEADLINE + 5.0)

    def breakpoint(self, frame) -> None:
        if not self.enabled or self.unreachable():
            if not self._warned:
                self._warned = True
                why = (
                    "the notebook has no input to debug with (nbval, nbconvert --execute, a script, "
                    "a run followed in the background, a warm pool)"
                    if not self.enabled
                    else "its task cannot reach the notebook's event channel"
                )
                print(f"torchdist: breakpoint() skipped on rank {_rank()}: {why}", file=sys.stderr, flush=True)
            return
        import time

        RankPdb(self.open("breakpoint", time.time())).set_trace(frame)

    def post_mortem(self, exc: BaseException, time: float) -> None:
        """Hold this rank in a post-mortem session on ``exc``'s frames until the user quits it,
        the driver ends it, or it sits idle."""
        if self.unreachable():
            print(
                f"torchdist: --pdb: rank {_rank()} ({socket.gethostname()}) cannot reach the notebook's "
                "event channel, so its failure is not held for a debugger",
                file=sys.stderr,
                flush=True,
            )
            return
        session = self.open("post-mortem", time)
        debugger = RankPdb(session)
        session.write(f"torchdist: rank {_rank()} raised {type(exc).__qualname__}: {exc}\n")
        try:
            debugger.reset()
            debugger.interaction(None, exc.__traceback__)
        finally:
            with self._lock:
                open_still = session.id in self._sessions
            if open_still:  # ended by the driver or the idle limit, not by q
                session.end()


def install(client) -> Optional[RankDebugger]:
    """Set this rank up for debugging over ``client`` (the rank's ``ChannelClient``, or ``None``):
    ``sys.breakpointhook`` opens a session; the debugger, whose ``on_message`` takes the
    driver's ``DebugInput`` records."""
    global _debugger
    _debugger = RankDebugger(
        client,
        enabled=os.environ.get(DEBUG_ENV) == "1",
        post_mortem=os.environ.get(PDB_ENV) == "1",
        idle=float(os.environ.get(IDLE_ENV) or 600.0),
    )
    sys.breakpointhook = _breakpointhook
    return _debugger


#: hooks ``PYTHONBREAKPOINT`` may name that are not the user's choice but a framework's, set in
#: its own processes' environment and inherited by a rank that is none of them: ``ray.init``
#: sets Ray's driver hook in the kernel's environment, and it fails in any process that is not
#: Ray's driver or worker (a rank is neither)
NOT_A_RANKS_HOOK = ("ray.util.rpdb.",)


def _breakpointhook(*args, **kwargs) -> None:
    hook = os.environ.get("PYTHONBREAKPOINT")
    if hook == "0":
        return None
    if hook and hook.startswith(NOT_A_RANKS_HOOK):
        hook = None
    if hook and hook != "pdb.set_trace" or _debugger is None:
        return sys.__breakpointhook__(*args, **kwargs)
    _debugger.breakpoint(sys._getframe(1))
    return None


def post_mortem(exc: BaseException, time: float) -> None:
    """When the run asked for ``--pdb``: debug ``exc`` (raised at ``time``) on this rank before
    it reports its failure.  Not for what ends a rank on purpose (a stop, ``q`` in a debugger)."""
    import bdb

    if _debugger is None or not _debugger.post_mortem_on or isinstance(exc, (bdb.BdbQuit, KeyboardInterrupt)):
        return
    if type(exc).__name__ == "RankStopped":
        return
    _debugger.post_mortem(exc, time)
