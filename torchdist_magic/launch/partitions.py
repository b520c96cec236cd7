"""A Spark task's partition of the run's DataFrame into the file its rank reads (``rank.shard``):
the Arrow batches of a ``mapInArrow`` task streamed into an Arrow IPC file as they arrive."""

from __future__ import annotations

from typing import Callable, Iterable


class DataStopped(Exception):
    """The run was stopped while its task was still writing its rows."""


def write_batches(path: str, batches: Iterable, schema: bytes, stopped: Callable[[], bool]) -> int:
    """Stream ``batches`` (a ``mapInArrow`` task's input) into the Arrow IPC file ``path`` as
    they arrive; ``schema`` is the file's schema when none arrives.  The number of rows."""
    import pyarrow as pa

    sink = pa.OSFile(path, "wb")
    writer = None
    rows = 0
    try:
        for batch in batches:
            if stopped():
                raise DataStopped("the run was stopped while this task was reading its rows")
            if writer is None:
                writer = pa.ipc.new_file(sink, batch.schema)
            writer.write_batch(batch)
            rows += batch.num_rows
        if writer is None:
            writer = pa.ipc.new_file(sink, pa.ipc.read_schema(pa.py_buffer(schema)))
        writer.close()
    finally:
        sink.close()
    return rows
