"""The DataFrame a run trains on, checked before anything starts and made into what the backend
gives its ranks (the rank's side is ``rank.shard``, the Spark task's ``launch.partitions``).

A backend that trains on a DataFrame says so in ``Backend.prepare_data``, called on the driver
before anything starts: the local backend takes a pandas DataFrame (``prepare_pandas``), the
Spark backends a Spark DataFrame of their session (``prepare_spark``).  The DataFrame is checked (a
pandas DataFrame on local processes, a Spark DataFrame of the run's own SparkSession on Spark;
columns that exist and can become tensors; at least one row per rank) and turned into what the
backend needs.  A pandas DataFrame's rows are dealt out to the ranks by a seeded permutation
(``rank_rows``: a DataFrame sorted by its label still gives every rank a mix of labels), one
Arrow IPC file per rank under the run's directory (``write_rank_files``).  A Spark DataFrame
never passes through the driver: its barrier stage is ``df.repartition(n).mapInArrow(task,
barrier=True)`` and each task streams the Arrow batches of its partition into a file of its own
workdir as they arrive (``write_batches``) before it starts its rank.  Either way the rank
finds the path of its file in ``TORCHDIST_DATA_FILE`` (set by ``rankenv.rank_environment``).

The rank's side, how each rank reads its file and why every rank yields as many batches, is
``rank.shard``'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

#: rows per record batch of a rank file written from a pandas DataFrame
FILE_CHUNK_ROWS = 65536
#: the seed of the permutation that deals a pandas DataFrame's rows out to the ranks
SPLIT_SEED = 0


@dataclass
class PreparedData:
    """A run's DataFrame, checked: ``table`` (pandas input, as Arrow) for local processes, or
    ``frame`` (a Spark DataFrame, its columns selected) and its Arrow ``schema`` for Spark."""

    rows: int
    columns: List[str]
    table: Any = None  # pyarrow.Table (pandas input)
    frame: Any = None  # pyspark DataFrame (Spark input)
    schema: bytes = b""  # the frame's Arrow schema, serialized (for empty partitions)
    files: List[str] = field(default_factory=list)
    _directory: str = ""

    def write_rank_files(self, prefix: str, num_processes: int) -> List[str]:
        """One Arrow IPC file per rank in a new temporary directory named ``prefix...``, rank r's
        rows those of ``rank_rows`` (written once: restarts reuse them; ``remove_files`` removes
        them).  None for a Spark DataFrame, whose rows never pass through the driver."""
        if self.table is None:
            return []
        if not self.files:
            import tempfile

            import pyarrow as pa

            directory = self._directory = tempfile.mkdtemp(prefix=prefix)
            for r, indices in enumerate(rank_rows(self.rows, num_processes)):
                path = os.path.join(directory, f"rank-{r}.arrow")
                _write_table(path, self.table.take(pa.array(indices)))
                self.files.append(path)
        return self.files

    def remove_files(self) -> None:
        if self.files:
            import shutil

            shutil.rmtree(self._directory, ignore_errors=True)
        self.files = []


def rank_rows(rows: int, num_processes: int, seed: int = SPLIT_SEED) -> List[Any]:
    """The row positions each rank gets (numpy arrays, by rank): a permutation of the rows from
    ``seed``, cut into ``num_processes`` parts whose sizes differ by at most 1, each part in the
    DataFrame's order.  Not contiguous ranges: a DataFrame sorted by its label would hand each
    rank one label for every epoch (``shuffle`` only reorders a rank's own rows).  The same rows
    and seed give the same split."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(rows)
    bounds = [rows * r // num_processes for r in range(num_processes + 1)]
    return [np.sort(order[bounds[r] : bounds[r + 1]]) for r in range(num_processes)]


def _write_table(path: str, table) -> None:
    import pyarrow as pa

    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=FILE_CHUNK_ROWS)


def is_pandas_frame(data: Any) -> bool:
    module = type(data).__module__
    return (module == "pandas" or module.startswith("pandas.")) and type(data).__name__ == "DataFrame"


def is_spark_frame(data: Any) -> bool:
    """A classic or a Spark Connect DataFrame (without importing pyspark)."""
    return type(data).__module__.startswith("pyspark.sql") and any(
        cls.__name__ == "DataFrame" for cls in type(data).__mro__
    )


#: what a Spark DataFrame given to a backend that takes a pandas one is told, and the reverse
WANTS_SPARK = (
    "a Spark DataFrame trains on the Spark backend (--spark, local_mode=False), where "
    "each rank reads its share inside the executors; on local processes pass a pandas "
    "DataFrame (df.toPandas() brings a small one to this machine)"
)
WANTS_PANDAS = (
    "a pandas DataFrame trains on local processes (--local, local_mode=True); for a "
    "Spark run make it a Spark DataFrame first: spark.createDataFrame(pandas_df)"
)

#: pyarrow is not required (a cluster brings its own): a pandas DataFrame on local ranks needs it
NO_PYARROW = (
    "a pandas DataFrame travels to the local ranks as Arrow files, and pyarrow is not installed in "
    'this environment: pip install pyarrow (the "torchdist_magic[spark]" extra brings it too)'
)


def prepare_pandas(data: Any, num_processes: int, columns: Optional[Sequence[str]] = None) -> PreparedData:
    """Check ``data``, a pandas DataFrame, for a run of ``num_processes`` local ranks;
    ``columns`` (all when ``None``) are the ones that travel.  ``TypeError``/``ValueError`` name
    what is wrong."""
    _one_of_ours(data, "pandas")
    return _prepare_pandas(data, num_processes, columns)


def prepare_spark(data: Any, num_processes: int, session: Any, columns: Optional[Sequence[str]] = None) -> PreparedData:
    """Check ``data``, a Spark DataFrame of ``session``, for a barrier stage of
    ``num_processes`` tasks; as ``prepare_pandas`` otherwise."""
    _one_of_ours(data, "spark")
    return _prepare_spark(data, num_processes, session, columns)


def _one_of_ours(data: Any, wanted: str) -> None:
    """``data`` is a DataFrame of the kind ``wanted`` (``"pandas"`` or ``"spark"``)."""
    if is_spark_frame(data):
        kind = "spark"
    elif is_pandas_frame(data):
        kind = "pandas"
    else:
        raise TypeError(
            f"the data to train on must be a Spark DataFrame (or a pandas DataFrame on local "
            f"processes), got {type(data).__module__}.{type(data).__qualname__}"
        )
    if kind != wanted:
        raise ValueError(WANTS_SPARK if kind == "spark" else WANTS_PANDAS)


def _chosen_columns(available: List[str], columns: Optional[Sequence[str]]) -> List[str]:
    if columns is None:
        return list(available)
    if isinstance(columns, str):
        columns = [columns]
    missing = [c for c in columns if c not in available]
    if missing:
        raise ValueError(
            f"the DataFrame has no column {', '.join(map(repr, missing))}; its columns: {', '.join(available)}"
        )
    if not columns:
        raise ValueError("no columns chosen: name at least one")
    return list(columns)


def _check_rows(rows: int, num_processes: int) -> None:
    if rows == 0:
        raise ValueError("the DataFrame is empty: there is nothing to train on")
    if rows < num_processes:
        raise ValueError(
            f"the DataFrame has {rows} row{'s' if rows != 1 else ''}, fewer than the "
            f"{num_processes} ranks: every rank needs at least one row"
        )


def _not_tensors(named_types: List[tuple]) -> None:
    if named_types:
        listed = ", ".join(f"{name!r} ({kind})" for name, kind in named_types)
        raise ValueError(
            f"column{'s' if len(named_types) > 1 else ''} {listed} cannot become a tensor: shard() "
            "delivers numbers, booleans and (nested) arrays of them; select the columns the job "
            "needs (df.select(...), or --columns), or encode the others as numbers first"
        )


def _spark_tensor_type(data_type) -> bool:
    from pyspark.sql import types as T

    if isinstance(data_type, T.ArrayType):
        return _spark_tensor_type(data_type.elementType)
    return isinstance(
        data_type, (T.BooleanType, T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType)
    )


def _same_session(one, other) -> bool:
    """Whether two SparkSession objects stand for the same session (PySpark may wrap one
    session in several Python objects): the same JVM session, or the same Connect session id."""
    if one is other:
        return True
    mine, theirs = getattr(one, "_jsparkSession", None), getattr(other, "_jsparkSession", None)
    if mine is not None and theirs is not None:
        return bool(mine.equals(theirs))
    ids = [getattr(getattr(s, "client", None), "_session_id", None) for s in (one, other)]
    return ids[0] is not None and ids[0] == ids[1]


def _prepare_spark(frame, num_processes: int, session, columns) -> PreparedData:
    if session is not None and not _same_session(frame.sparkSession, session):
        raise ValueError(
            "the DataFrame belongs to another SparkSession than the run's active one "
            "(a stopped session, or one from newSession()): create it from the active "
            "session"
        )
    chosen = _chosen_columns(list(frame.columns), columns)
    if chosen != list(frame.columns):
        frame = frame.select(*chosen)
    _not_tensors(
        [(f.name, f.dataType.simpleString()) for f in frame.schema.fields if not _spark_tensor_type(f.dataType)]
    )
    from pyspark.sql.pandas.types import to_arrow_schema

    rows = frame.count()
    _check_rows(rows, num_processes)
    return PreparedData(
        rows=rows, columns=chosen, frame=frame, schema=to_arrow_schema(frame.schema).serialize().to_pybytes()
    )


def _arrow_tensor_type(data_type) -> bool:
    import pyarrow as pa

    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type) or pa.types.is_fixed_size_list(data_type):
        return _arrow_tensor_type(data_type.value_type)
    return pa.types.is_integer(data_type) or pa.types.is_floating(data_type) or pa.types.is_boolean(data_type)


def _prepare_pandas(frame, num_processes: int, columns) -> PreparedData:
    try:
        import pyarrow as pa
    except ImportError:
        raise ValueError(NO_PYARROW) from None

    chosen = _chosen_columns([str(c) for c in frame.columns], columns)
    frame = frame[chosen] if chosen != [str(c) for c in frame.columns] else frame
    _check_rows(len(frame), num_processes)
    try:
        table = pa.Table.from_pandas(frame, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise ValueError(f"the DataFrame cannot be turned into Arrow columns: {exc}") from None
    _not_tensors([(f.name, str(f.type)) for f in table.schema if not _arrow_tensor_type(f.type)])
    return PreparedData(rows=len(frame), columns=chosen, table=table)
