"""The notebook's side of a rank's debugger (the rank's side is ``rank_debugger``).

A rank's ``breakpoint()``, or its failure under ``--pdb``, opens a session: the rank's pdb sends
its output and prompts as ``events.DebugOutput`` records, which ``Console.on_output`` (the
channel's thread) gathers.  The thread that follows the run (``follow.follow``: the cell's
own, in a notebook) calls ``Console.serve`` between its view updates: it prints the session's
output in the cell and reads the user's line with ``input()``, which a kernel turns into an
``input_request`` as it does for ``%debug``; the line goes back as an ``events.DebugInput``.

One session at a time: the one being served keeps the prompt until it ends; then a post-mortem
session comes first (the earliest failure: the root cause), then the breakpoint that stopped
first.  Once a post-mortem session ends, the other ranks' post-mortem sessions are ended unseen:
only the root cause is debugged.  An interrupt (Ctrl-C, the kernel's interrupt) at a prompt ends
the session, as ``q`` does.  When a session ends on the rank's side while a prompt waits (the idle
limit, the rank stopped), the prompt is given up.

Where nobody can answer (no stdin: ``nbval``, ``nbconvert --execute``, a script not on a
terminal, a run followed in the background), the ranks are told so (``rank_env``) and nothing
waits: ``breakpoint()`` is skipped with one line, and ``--pdb`` says once that it cannot hold a rank.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ..core import events
from ..core.options import LaunchOptions
from ..core.names import DEBUG_ENV, IDLE_ENV, PDB_ENV

NO_STDIN_PDB = (
    "torchdist: --pdb: this notebook cannot read input here (no stdin: nbval, nbconvert "
    "--execute, a script, a run followed in the background), so a failing rank is not "
    "held for a debugger"
)


def stdin_available() -> bool:
    """Whether ``input()`` in this thread reaches a person: in a kernel, one whose current
    request allows stdin (a frontend, not ``nbval`` or ``nbconvert --execute``); elsewhere, a
    terminal.  Only the main thread reads a kernel's stdin."""
    if threading.current_thread() is not threading.main_thread():
        return False
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:
        return bool(getattr(kernel, "_allow_stdin", False))
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stdin
        return False


def rank_env(options: LaunchOptions, interactive: bool) -> Dict[str, str]:
    """What every rank's environment gets to debug as this run allows."""
    return {
        DEBUG_ENV: "1" if interactive else "0",
        PDB_ENV: "1" if options.pdb and interactive else "0",
        IDLE_ENV: repr(float(options.debug_idle_timeout)),
    }


@dataclass
class _Session:
    rank: int
    session: str
    kind: str
    time: float
    order: int
    text: List[str] = field(default_factory=list)
    prompt: str = ""
    ended: threading.Event = field(default_factory=threading.Event)
    announced: bool = False


class Console:
    """The run's debugger sessions, served one at a time in the thread that follows the run.
    ``write`` shows text in the cell (``sys.stdout`` by default); ``read`` asks for a line
    (``input``)."""

    def __init__(self, write: Optional[Callable[[str], None]] = None, read: Optional[Callable[[str], str]] = None):
        self._write = write or self._print
        self._read = read or input
        self._lock = threading.Lock()
        self._sessions: Dict[Tuple[int, str], _Session] = {}
        self._current: Optional[_Session] = None
        self._send: Callable[[int, events.Event], bool] = lambda rank, record: False
        self._count = 0
        self._post_mortem_done = False
        self._reading = False
        self._abandoned = False
        self._last_activity = time.monotonic()
        self.changed = threading.Event()

    @staticmethod
    def _print(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def attach(self, send: Callable[[int, events.Event], bool]) -> None:
        """Where ``DebugInput`` records go: the current attempt's channel, to the rank's worker."""
        self._send = send

    # -- the channel's thread ------------------------------------------------------------
    def on_output(self, record: events.DebugOutput) -> None:
        self._last_activity = time.monotonic()
        end_it = False
        with self._lock:
            key = (record.rank, record.session)
            session = self._sessions.get(key)
            if session is None:
                self._count += 1
                session = self._sessions[key] = _Session(
                    record.rank, record.session, record.kind, record.time, self._count
                )
                # only the root cause is debugged: a later post-mortem ends unseen
                end_it = record.kind == "post-mortem" and self._post_mortem_done
            if record.text:
                session.text.append(record.text)
            if record.prompt:
                session.prompt = record.prompt
            if record.end:
                session.ended.set()
        if end_it:
            self._end(session)
        self.changed.set()

    # -- what the run's supervisor asks ----------------------------------------------------
    def held_ranks(self) -> List[int]:
        """The ranks with a post-mortem session open, the earliest failure (the root cause, the
        one debugged) first: they are not stopped (nor timed out, nor declared hung) until their
        sessions end; the other ranks are stopped meanwhile."""
        with self._lock:
            held = [s for s in self._sessions.values() if s.kind == "post-mortem" and not s.ended.is_set()]
        return [s.rank for s in sorted(held, key=lambda s: s.time)]

    def active(self) -> bool:
        """Whether any session is open (someone may be reading a prompt: no hang, no timeout)."""
        with self._lock:
            return any(not s.ended.is_set() for s in self._sessions.values())

    def idle(self) -> float:
        """Seconds since a session last said or was told something (the hang watchdog's clock
        starts again after a session)."""
        return time.monotonic() - self._last_activity

    def ranks_gone(self, ranks) -> None:
        """The ranks ``ranks`` exited: their sessions are over, whatever they last said."""
        with self._lock:
            for s in self._sessions.values():
                if s.rank in ranks:
                    s.ended.set()

    # -- the following thread ---------------------------------------------------------------
    def serve(self, finished: Callable[[], bool]) -> None:
        """Show the current session's output and, when it waits for a line, read one from the
        user and send it.  Returns at once when no session has anything to show."""
        self.changed.clear()
        session = self._pick()
        if session is None:
            return
        with self._lock:
            text, session.text = "".join(session.text), []
            prompt, session.prompt = session.prompt, ""
            ended = session.ended.is_set()
            announce = not session.announced
            session.announced = True
            waiting = sorted(
                s.rank
                for s in self._sessions.values()
                if s is not session and not s.ended.is_set() and s.kind == "breakpoint"
            )
        if announce and session.kind == "breakpoint":
            more = (
                f" (rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} wait{'' if len(waiting) > 1 else 's'} for "
                "their turn)"
                if waiting
                else ""
            )
            self._write(
                f"torchdist: rank {session.rank} stopped at breakpoint(): c continues it, q stops the run{more}\n"
            )
        if text:
            self._write(text)
        if ended:
            self._finish(session)
            return
        if prompt and not finished():
            self._ask(session, prompt, finished)

    def _pick(self) -> Optional[_Session]:
        with self._lock:
            if self._current is not None and (not self._current.ended.is_set() or self._current.text):
                return self._current
            if self._current is not None:
                self._finish_locked(self._current)
            open_ = [s for s in self._sessions.values() if not s.ended.is_set() or s.text]
            if not open_:
                return None
            self._current = min(
                open_, key=lambda s: (s.kind != "post-mortem", s.time if s.kind == "post-mortem" else s.order)
            )
            return self._current

    def _finish(self, session: _Session) -> None:
        with self._lock:
            self._finish_locked(session)

    def _finish_locked(self, session: _Session) -> None:
        self._sessions.pop((session.rank, session.session), None)
        if self._current is session:
            self._current = None
        if session.kind == "post-mortem" and not self._post_mortem_done:
            self._post_mortem_done = True
            others = [s for s in self._sessions.values() if s.kind == "post-mortem"]
            for other in others:
                self._sessions.pop((other.rank, other.session), None)
                self._send(other.rank, events.DebugInput(rank=other.rank, session=other.session, end=True))

    def _end(self, session: _Session) -> None:
        self._send(session.rank, events.DebugInput(rank=session.rank, session=session.session, end=True))

    def _ask(self, session: _Session, prompt: str, finished: Callable[[], bool]) -> None:
        """``input(prompt)``, given up (by an interrupt of this thread) when the session ends or
        the run finishes meanwhile; an interrupt by the user ends the session."""
        done = threading.Event()
        watcher = threading.Thread(
            target=self._watch_prompt, args=(session, finished, done), name="torchdist-debug-prompt", daemon=True
        )
        self._abandoned = False
        self._reading = True
        watcher.start()
        line: Optional[str] = None
        try:
            try:
                line = self._read(prompt)
            finally:
                with self._lock:
                    self._reading = False
                done.set()
                watcher.join()
        except (KeyboardInterrupt, EOFError):
            if self._abandoned:
                self._write("\n")
                return
            line = None
        self._last_activity = time.monotonic()
        if line is None:
            self._end(session)
        else:
            self._send(session.rank, events.DebugInput(rank=session.rank, session=session.session, line=line))

    def _watch_prompt(self, session: _Session, finished: Callable[[], bool], done: threading.Event) -> None:
        while not done.wait(0.1):
            if session.ended.is_set() or finished():
                with self._lock:
                    if self._reading and not done.is_set():
                        self._abandoned = True
                        _interrupt_main_thread()
                return


def _interrupt_main_thread() -> None:
    """Make a pending ``input()`` in the main thread raise ``KeyboardInterrupt``: a real SIGINT
    to it, so that a read blocked in the terminal returns too."""
    if hasattr(signal, "pthread_kill"):
        with contextlib.suppress(OSError):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return
    import _thread

    _thread.interrupt_main()
