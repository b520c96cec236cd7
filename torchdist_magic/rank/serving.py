"""A warm pool's rank: the process group set up once, then each job the driver sends run in one
namespace that lives as long as the rank (``serve``), its value sent back in ``JobValue`` pieces
and its end as ``JobDone``; each job's environment set for it and undone after it."""

from __future__ import annotations

import base64
import contextlib
import os
import sys
import time
from typing import Dict, List, Optional

from torchdist_magic.core import events
from .jobrun import _failure, _pickled_value, _stoppable, execute
from .runners import cell_namespace, start_process_group


#: bytes of a warm rank's value per ``JobValue`` record (base64 makes it a third larger, well
#: under the channel's frame limit)
VALUE_PIECE = 1024 * 1024


class JobInbox:
    """The jobs the driver sends a warm rank (``RunJob`` pieces, put together in order)."""

    def __init__(self):
        import queue

        self._parts: Dict[str, List[str]] = {}
        self.jobs: "queue.Queue" = queue.Queue()

    def on_message(self, record: events.Event) -> None:
        if not isinstance(record, events.RunJob):
            return
        self._parts.setdefault(record.job_id, []).append(record.data)
        if record.last:
            data = base64.b64decode("".join(self._parts.pop(record.job_id)))
            self.jobs.put((record, data))


def _keep_process_group(dist) -> None:
    """In a warm pool the process group outlives each job: code that destroys the default
    group (a function written for TorchDistributor, Lightning) leaves it up, and the next
    ``init_process_group`` gets it again (``runners._init_once``)."""
    original = dist.destroy_process_group

    def destroy_process_group(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return None
        return original(group)

    destroy_process_group.__doc__ = original.__doc__
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group


def _end_output(job_id: str) -> None:
    """Mark the end of the job's output on both streams (``events.OUTPUT_END_MARK``): written to
    the file descriptors themselves, after everything the job printed."""
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        with contextlib.suppress(Exception):
            stream.flush()
        with contextlib.suppress(OSError):
            os.write(fd, f"{events.OUTPUT_END_MARK}{job_id}\n".encode())


def _set_environment(values: Dict[str, Optional[str]]) -> Dict[str, Optional[str]]:
    """Set each variable of ``values`` in this process's environment (``None``: unset it);
    what they were before, to set back the same way."""
    before = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return before


def serve(client, inbox: JobInbox, startup_env: Optional[Dict[str, Optional[str]]] = None) -> int:
    """A warm pool's rank: set up the process group once, then run each job the driver sends
    (cells in one namespace that lives as long as the rank) and report it with ``JobValue``
    pieces and ``JobDone``; return when the channel to the driver is gone, or on SIGTERM.
    ``startup_env``: what the env of the run that started the pool changed, with the values the
    variables have without it (``rankenv.ENV_BEFORE``)."""
    import queue

    import cloudpickle

    from torchdist_magic.rank import runtime

    start_process_group()
    import torch.distributed as dist

    _keep_process_group(dist)
    # The ranks started with the env of the run that started the pool (what is read only at
    # start-up, OMP_NUM_THREADS or NCCL's, keeps it); between jobs they have no run's env: each
    # job's own is set for the job and undone after it (its names get their earlier values back,
    # or are unset again), so a later run without it does not see it.  Variables a job's code
    # sets itself (os.environ, a library's) stay, like the names it defines: the rank's state is
    # the user's.
    _set_environment(startup_env or {})
    namespace = cell_namespace()
    with _stoppable(), contextlib.suppress(runtime.RankStopped):  # SIGTERM between jobs: the pool stops
        while True:
            try:
                record, data = inbox.jobs.get(timeout=0.2)
            except queue.Empty:
                if client.lost:
                    return 0
                continue
            runtime._new_job()
            undo = _set_environment(record.env)
            try:
                job = cloudpickle.loads(data)
            except Exception as exc:  # noqa: BLE001
                code, value, failure = 1, None, _failure(exc, type(exc).__qualname__, str(exc))
            else:
                code, value, failure = execute(job, namespace)
            _set_environment(undo)
            has_value = False
            if failure is None and (record.all_ranks or runtime.rank() == 0):
                pickled, failure = _pickled_value(value)
                if pickled is not None:
                    text = base64.b64encode(pickled).decode("ascii")
                    piece = 4 * VALUE_PIECE // 3
                    for i in range(0, len(text), piece):
                        client.send(
                            events.JobValue(rank=runtime.rank(), job_id=record.job_id, data=text[i : i + piece])
                        )
                    has_value = True
                else:
                    code = 1
            runtime.flush_reports()  # the job's report() points go before its end
            _end_output(record.job_id)
            client.send(
                events.JobDone(
                    rank=runtime.rank(),
                    job_id=record.job_id,
                    code=code,
                    time=time.time(),
                    has_value=has_value,
                    failure=failure,
                )
            )
            if failure is not None and failure.exc_type == "RankStopped":
                return 1
    return 1
