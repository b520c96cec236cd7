"""A run's large notebook values on their way out to the ranks: one file they map, or fetch once
per machine from the run's channel."""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict

from ..backends import Backend
from ..core import values as value_blobs
from ..core.job import Job
from ..core.names import VALUES_FETCH_ENV
from ..core.values import value_directory


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

    def pickle(self, job: Job) -> bytes:
        """The job as its ranks read it.  Its large values (a cell's notebook tensors and
        arrays, a function's arguments) go into one file in shared memory (written once per run,
        from the values' own memory) that the job names: where every rank shares this machine,
        each rank maps it; on a cluster each machine fetches it once from the run's channel and
        its ranks map that copy (``hostcopy``).  Elsewhere (a warm pool on a cluster) they travel
        inside the job."""
        sent = job.sent_buffers()
        if sent is None or sent.nbytes < value_blobs.APART_BYTES:
            return value_blobs.pickle_for_ranks(job)
        shared = self.backend.ranks_share_machine()
        fetch = self.backend.fetches_values and (not shared or os.environ.get(VALUES_FETCH_ENV) == "1")
        if not shared and not fetch:
            return value_blobs.pickle_for_ranks(job)
        self.directory = value_directory(f"torchdist-{self.run_id}-values-", sent.nbytes)
        try:
            in_file = sent.in_file(self.directory)
            if fetch:  # the name of each machine's copy: this process's, as the file's own
                name = f"torchdist-{self.run_id}-values-{os.getpid()}-copy"
                self.served = {name: in_file.path}
                self.fetch = {"values_fetch": name, "values_fetch_size": os.path.getsize(in_file.path)}
                in_file = in_file.fetched(name)
            return value_blobs.pickle_for_ranks(job.with_sent_buffers(in_file))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Remove the file (the run has ended, or never started).  Idempotent."""
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = ""
