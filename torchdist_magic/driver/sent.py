"""A run's large notebook values on their way out to the ranks: one file they map, or fetch once
per machine from the run's channel.

Where the ranks share this machine, the file of a run whose values are all tensors is kept after
the run (``KeptValues``, one per process: the last run's) and mapped again by the next run whose
values are the same tensors, unchanged: the same objects on the same memory at the same version
counters (``values.Mark``), and the same ``values.fingerprint`` of a sixteenth of their bytes
(a change made behind torch's back, through ``.numpy()`` or a NumPy array the tensor shares, is
seen where it touches most of the bytes, not where it touches a few).  A second run of a cell
with an unchanged 1 GiB tensor then writes nothing.  The kept file goes when a run with other
values ends, when one of its tensors is freed, and when the process exits (a process killed
before that leaves it, which the next process to keep one removes: ``_sweep``).
``TORCHDIST_KEEP_VALUES=0`` keeps none.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import stat
import threading
import weakref
from typing import Any, Dict, List, Optional

from ..backends import Backend
from ..core import values
from ..core.job import Job
from ..core.names import VALUES_FETCH_ENV
from ..core.values import Buffers, FileWriter, Mark, value_directory

#: set to ``0``, no run's values are kept for the next run (``KeptValues``)
KEEP_ENV = "TORCHDIST_KEEP_VALUES"
#: the name of a kept file's directory starts with this, then the keeping process's id
KEPT_PREFIX = "torchdist-kept-values-"


def keeping() -> bool:
    """Whether runs' values are kept for the next run (``KEEP_ENV``: ``1`` by default, or ``0``);
    ``ValueError`` for anything else."""
    text = os.environ.get(KEEP_ENV, "1").strip()
    if text not in ("0", "1"):
        raise ValueError(f"{KEEP_ENV} must be 1 (keep a run's notebook tensors for the next run) or 0, got {text!r}")
    return text == "1"


class SentValues:
    """Where run ``run_id``'s large values out to the ranks are, on ``backend``."""

    def __init__(self, run_id: str, backend: Backend):
        self.run_id = run_id
        self.backend = backend
        #: the directory of the file the job names ("" while there is none)
        self.directory = ""
        #: ``{name: path}`` of that file where each machine fetches it from the channel, and
        #: what the ranks' ``RunSpec`` says of it then
        self.served: Dict[str, str] = {}
        self.fetch: Dict[str, Any] = {}
        #: the file's writer while the ranks start (see ``pickle``)
        self._writer: Optional[FileWriter] = None
        #: the last run's file, mapped again by this run (``KeptValues``)
        self.kept: Optional[KeptValues] = None
        #: what this run's file would be kept with: its buffers' marks and fingerprint
        self._marks: Optional[List[Optional[Mark]]] = None
        self._fingerprint = 0

    def pickle(self, job: Job) -> bytes:
        """The job as its ranks read it.  Its large values (a cell's notebook tensors and
        arrays, a function's arguments) go into one file in shared memory (written once per run,
        from the values' own memory) that the job names: where every rank shares this machine,
        each rank maps it; on a cluster each machine fetches it once from the run's channel and
        its ranks map that copy (``hostcopy``).  Elsewhere (a warm pool on a cluster) they travel
        inside the job.  The file the ranks map is written while they start (``FileWriter``):
        ``wait`` for it before the values may change."""
        sent = job.sent_buffers()
        if sent is None or sent.nbytes < values.APART_BYTES:
            return values.pickle_for_ranks(job)
        shared = self.backend.ranks_share_machine()
        fetch = self.backend.fetches_values and (not shared or os.environ.get(VALUES_FETCH_ENV) == "1")
        if not shared and not fetch:
            return values.pickle_for_ranks(job)
        if not fetch and sent.marks is not None and keeping():
            self.kept = KeptValues.reuse(sent)
            if self.kept is not None:  # the last run's file, unchanged: nothing to write
                return values.pickle_for_ranks(job.with_sent_buffers(self.kept.buffers))
            self._marks, self._fingerprint = sent.marks, sent.fingerprint()
        self.directory = value_directory(f"torchdist-{self.run_id}-values-", sent.nbytes)
        try:
            if not fetch:  # the ranks wait for the file where they map it
                self._writer = FileWriter(sent, self.directory)
                return values.pickle_for_ranks(job.with_sent_buffers(self._writer.buffers))
            in_file = sent.in_file(self.directory)  # whole before the channel serves it
            # the name of each machine's copy: this process's, as the file's own
            name = f"torchdist-{self.run_id}-values-{os.getpid()}-copy"
            self.served = {name: in_file.path}
            self.fetch = {"values_fetch": name, "values_fetch_size": os.path.getsize(in_file.path)}
            return values.pickle_for_ranks(job.with_sent_buffers(in_file.fetched(name)))
        except BaseException:
            self.remove()
            raise

    def wait(self) -> None:
        """Return once the file the ranks map is written (at once where there is none): the
        values may change after, the ranks read them as they were."""
        if self._writer is not None:
            self._writer.wait()

    def remove(self) -> None:
        """Remove the file (the run has ended, or never started), once written.  Idempotent.
        Its name goes now; its memory (0.13 s a GiB to give back, here) is given back by a
        thread of its own, which holds the file open meanwhile."""
        self.wait()
        writer, self._writer = self._writer, None
        if self.kept is not None:
            self.kept.release()
            self.kept = None
        if self.directory and writer is not None and writer.error is None and self._marks is not None:
            try:
                KeptValues.keep(self.directory, writer.buffers, self._marks, self._fingerprint)
                self.directory = ""
            except OSError:  # not kept (renamed meanwhile, a full table of names): removed below
                pass
            self._marks = None
        if self.directory:
            held = []
            try:
                names = os.listdir(self.directory)
            except OSError:  # removed already
                names = []
            for name in names:
                try:
                    held.append(os.open(os.path.join(self.directory, name), os.O_RDONLY | os.O_NOFOLLOW))
                except OSError:  # a link: nothing of it to give back
                    pass
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = ""
            if held:
                threading.Thread(target=_close_all, args=(held,), name="torchdist-values-free", daemon=True).start()


def _close_all(fds: list) -> None:
    for fd in fds:
        os.close(fd)


#: guards ``KeptValues``: reentrant, since a tensor's finalizer (``KeptValues.forget``) may run
#: in a thread that holds it
_KEPT_LOCK = threading.RLock()


class KeptValues:
    """The file of the last run's values (all tensors), kept for the next run with the same
    values, unchanged: at most one per process (``current``).  ``users``: the runs mapping it
    now; once another run's file replaces it (``dropped``), it goes when the last of them ends."""

    current: Optional["KeptValues"] = None
    _exit_registered = False

    def __init__(self, directory: str, buffers: Buffers, marks: List[Optional[Mark]], fingerprint: int):
        self.directory = directory
        self.buffers = buffers
        self.marks = marks
        self.fingerprint = fingerprint
        self.users = 0
        self.dropped = False
        self._watches: List[Any] = []

    @classmethod
    def reuse(cls, sent: Buffers) -> Optional["KeptValues"]:
        """The kept file where ``sent`` (the buffers of a new run's values) are its values,
        unchanged, taken for the run (``release`` it); else ``None``, and the kept file is
        dropped: the new run's file is written without the old one beside it."""
        with _KEPT_LOCK:
            kept = cls.current
            if kept is None:
                return None
            if (
                not sent.unchanged_since(kept.marks)
                or sent.fingerprint() != kept.fingerprint
                or not os.path.isfile(kept.buffers.path)
            ):
                kept._drop()
                return None
            kept.users += 1
            return kept

    @classmethod
    def keep(cls, directory: str, buffers: Buffers, marks: List[Optional[Mark]], fingerprint: int) -> None:
        """Keep the file ``buffers`` name, in the run's value ``directory``, for the next run:
        the directory renamed ``KEPT_PREFIX<pid>-...`` beside it, the last kept file dropped.
        ``OSError`` where it cannot be renamed (the caller removes it)."""
        parent, name = os.path.split(directory)
        kept_directory = os.path.join(parent, f"{KEPT_PREFIX}{os.getpid()}-{name}")
        os.rename(directory, kept_directory)
        kept = cls(
            kept_directory,
            buffers._named(os.path.join(kept_directory, os.path.basename(buffers.path))),
            marks,
            fingerprint,
        )
        with _KEPT_LOCK:
            if cls.current is not None:
                cls.current._drop()
            cls.current = kept
            freed = False
            for mark in marks:  # the file goes with the first of its tensors to be freed
                for ref, _ in mark.tensors if mark is not None else ():
                    tensor = ref()
                    if tensor is None:
                        freed = True
                    else:
                        kept._watches.append(weakref.finalize(tensor, kept.forget))
            if freed:  # one went while the run ran: no next run can map it
                kept._drop()
            if not cls._exit_registered:
                atexit.register(cls.forget_current)
                cls._exit_registered = True
        _sweep(parent)

    def release(self) -> None:
        """A run that mapped this file has ended."""
        with _KEPT_LOCK:
            self.users -= 1
            if self.dropped and self.users == 0:
                self._free()

    def forget(self) -> None:
        """Drop this file (one of its tensors was freed): it goes now, or when its last run ends."""
        with _KEPT_LOCK:
            self._drop()

    @classmethod
    def forget_current(cls) -> None:
        """Drop the kept file, if any (the process exits)."""
        with _KEPT_LOCK:
            if cls.current is not None:
                cls.current._drop()

    def _drop(self) -> None:  # under the lock
        if KeptValues.current is self:
            KeptValues.current = None
        if not self.dropped:
            self.dropped = True
            for watch in self._watches:
                watch.detach()
            self._watches = []
            if self.users == 0:
                self._free()

    def _free(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _sweep(parent: str) -> None:
    """Remove the kept files that processes of this user which have exited left in ``parent``
    (killed before they could: a kernel killed, a Python restarted without ``atexit``).  Only
    directories of this user's, not links, named ``KEPT_PREFIX<pid>-``."""
    from ..core.procs import process_exited

    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        match = re.match(re.escape(KEPT_PREFIX) + r"(\d+)-", name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        path = os.path.join(parent, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and process_exited(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
