"""A run's large notebook values on their way out to the ranks: one file they map, or fetch once
per machine from the run's channel."""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any, Dict, Optional

from ..backends import Backend
from ..core import values
from ..core.job import Job
from ..core.names import VALUES_FETCH_ENV
from ..core.values import FileWriter, value_directory


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
        self._writer = None
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
