"""A run's own directory on the driver (spilled logs, default checkpoints): made when first needed,
removed with its owner or when the process exits."""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from typing import Optional


class RunDirectory:
    """A run's directory (spilled logs, default checkpoints): made on first use, removed when its
    owner is garbage-collected or the process exits."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._path: Optional[str] = None
        self._lock = threading.Lock()

    def path(self) -> str:
        with self._lock:
            if self._path is None:
                self._path = tempfile.mkdtemp(prefix=self.prefix)
                weakref.finalize(self, shutil.rmtree, self._path, True)
            return self._path
