"""``shard``: this rank's rows of the run's DataFrame, in batches (the driver's side is
``backends.frames``).

The rank's file (``TORCHDIST_DATA_FILE``) is memory-mapped, never read whole into memory; batches
are sliced (or, shuffled, gathered) from it.  Every rank yields the same number of batches per
epoch, as DDP needs (a rank that took fewer steps would leave its peers waiting in an
all-reduce forever): the ranks tell each other their row counts once, through a key-value
store on ``MASTER_ADDR:MASTER_PORT`` (the one ``init_process_group`` shares, so it works before
and after the job sets up its process group, and in jobs without one), then, as
``DistributedSampler`` does, each rank pads its rows by repeating its own rows up to the largest
rank's count, or with ``drop_last=True`` cuts them to the smallest rank's count.
"""

from __future__ import annotations

import datetime
import os
from typing import Iterator, List, Optional, Sequence

from ..core.names import DATA_FILE_ENV, ROWS_BAR, RUN_ID_ENV
from ..core.timing import ROW_COUNTS_WAIT
from . import runtime

FORMATS = ("torch", "pandas", "arrow")

NO_DATA = (
    "shard() reads the DataFrame of a run started with one, and this {where} has none: "
    "start the run with %%torchdist --data NAME, or Distributor(...).train_on_dataframe(fn, df)"
)


_counts_cache: dict = {}


def _row_counts(own: int) -> List[int]:
    """Every rank's row count (exchanged once per process, see the module's docstring)."""
    n, me = runtime.world_size(), runtime.rank()
    if n == 1:
        return [own]
    key = (os.environ.get(RUN_ID_ENV, ""), os.environ.get("MASTER_PORT", ""))
    if key not in _counts_cache:
        from torch.distributed import TCPStore

        # multi_tenant: the process group's own store on this port (rank 0 serves it) is shared
        # with this one, whichever of the two is made first
        store = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            None,
            me == 0,
            timeout=datetime.timedelta(seconds=ROW_COUNTS_WAIT),
            wait_for_workers=False,
            multi_tenant=True,
        )
        store.set(f"torchdist/data/rows/{me}", str(own))
        store.wait([f"torchdist/data/rows/{r}" for r in range(n)])
        counts = [int(store.get(f"torchdist/data/rows/{r}")) for r in range(n)]
        # rank 0 serves the store: it must not go away before every rank has read the counts
        if store.add("torchdist/data/read", 1) == n:
            store.set("torchdist/data/all-read", "1")
        if me == 0:
            store.wait(["torchdist/data/all-read"])
        _counts_cache[key] = (counts, store)
    return list(_counts_cache[key][0])


class shard:
    """This rank's rows of the run's DataFrame, in batches; iterate again for the next epoch.

    ``batch_size`` rows per batch; ``columns`` (default: all of them) in this order; ``format``:
    ``"torch"`` (a dict of column name -> tensor; array columns become 2-D or deeper tensors and
    must hold arrays of one length), ``"pandas"`` (a ``pandas.DataFrame``) or ``"arrow"`` (a
    ``pyarrow.RecordBatch``).  ``shuffle=True`` shuffles this rank's rows anew each epoch, from
    ``seed`` (the same on every rank: each rank still gets an order of its own); it never moves
    rows between ranks: which rows a rank holds is fixed for the run (see ``rank_rows``).

    Every rank yields the same number of batches (``len(shard)``): with ``drop_last=False`` a
    rank with fewer rows than the largest rank repeats its own rows until it has as many (as
    ``DistributedSampler`` pads), and the last batch may be short; with ``drop_last=True`` each
    rank takes as many rows as the smallest rank has, in whole batches only.

    Each rank reports its rows read and rows/s to the run view (a bar named ``rows``).

    Example:

    ```python
    from torchdist_magic import Distributor, shard

    def train(epochs):
        for epoch in range(epochs):
            for batch in shard(batch_size=256, columns=["features", "label"], shuffle=True, seed=epoch):
                x, y = batch["features"], batch["label"]   # tensors of this rank's rows
                ...

    Distributor(num_processes=4, local_mode=False).train_on_dataframe(train, spark.table("main.default.train"), 3)
    ```
    """

    def __init__(
        self,
        batch_size: int,
        columns: Optional[Sequence[str]] = None,
        format: str = "torch",
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"shard(batch_size=...) must be a whole number of at least 1, got {batch_size!r}")
        if format not in FORMATS:
            raise ValueError(f"shard(format=...) must be one of {', '.join(map(repr, FORMATS))}, got {format!r}")
        path = os.environ.get(DATA_FILE_ENV, "")
        if not path:
            where = "run" if os.environ.get(RUN_ID_ENV) else "process (not a rank of a run)"
            raise RuntimeError(NO_DATA.format(where=where))
        import pyarrow as pa

        self.batch_size, self.format = batch_size, format
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self._table = pa.ipc.open_file(pa.memory_map(path, "r")).read_all()  # mapped, not read
        available = self._table.column_names
        if isinstance(columns, str):
            columns = [columns]
        self.columns = list(available if columns is None else columns)
        missing = [c for c in self.columns if c not in available]
        if missing:
            raise ValueError(
                f"shard(columns=...): the run's DataFrame has no column "
                f"{', '.join(map(repr, missing))}; its columns: {', '.join(available)}"
            )
        self._table = self._table.select(self.columns)
        self.epoch = 0
        self._counts: Optional[List[int]] = None

    @property
    def num_rows(self) -> int:
        """This rank's own rows (before padding or dropping)."""
        return self._table.num_rows

    def row_counts(self) -> List[int]:
        """Every rank's own row count, by rank (the first call waits for every rank's)."""
        if self._counts is None:
            self._counts = _row_counts(self.num_rows)
            empty = [r for r, c in enumerate(self._counts) if c == 0]
            if empty:
                raise ValueError(
                    f"rank{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} got none of the "
                    f"DataFrame's rows (rows per rank: {self._counts}): Spark's repartition spreads "
                    "tiny DataFrames unevenly; give the run more rows or fewer ranks"
                )
        return self._counts

    def rows_per_epoch(self) -> int:
        """The rows each rank yields per epoch (the same on every rank)."""
        counts = self.row_counts()
        if self.drop_last:
            return min(counts) // self.batch_size * self.batch_size
        return max(counts)

    def __len__(self) -> int:
        rows = self.rows_per_epoch()
        return -(-rows // self.batch_size)

    def _order(self, epoch: int):
        """The row indices of ``epoch`` (``None``: the rows in order, padded by wrapping)."""
        if not self.shuffle:
            return None
        import numpy as np

        rng = np.random.default_rng([self.seed, epoch, runtime.rank()])
        return rng.permutation(self.num_rows)

    def _rows(self, order, start: int, stop: int):
        """Rows ``start:stop`` of this epoch's padded sequence, as one Arrow table."""
        import numpy as np
        import pyarrow as pa

        own = self.num_rows
        if order is None:
            pieces = []
            while start < stop:
                begin = start % own
                take = min(stop - start, own - begin)
                pieces.append(self._table.slice(begin, take))
                start += take
            return pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)
        return self._table.take(pa.array(order[np.arange(start, stop) % own]))

    def _convert(self, table):
        if self.format == "arrow":
            table = table.combine_chunks()
            batches = table.to_batches()
            return batches[0] if batches else table.schema.empty_table().to_batches()
        if self.format == "pandas":
            return table.to_pandas()
        return {name: _tensor(name, table.column(name)) for name in self.columns}

    def __iter__(self) -> Iterator:
        rows = self.rows_per_epoch()
        order = self._order(self.epoch)
        self.epoch += 1
        bar = runtime.progress(total=rows, desc=ROWS_BAR)  # this epoch's rows, shown at once
        try:
            for start in range(0, rows, self.batch_size):
                stop = min(start + self.batch_size, rows)
                batch = self._convert(self._rows(order, start, stop))
                bar.update(stop - start)
                yield batch
        finally:
            bar.close()


def _tensor(name: str, column):
    """One column (a ``pyarrow.ChunkedArray``) as a tensor of its own memory (never a view of
    the memory-mapped file)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import torch

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if array.null_count:
        raise ValueError(
            f"column {name!r} has {array.null_count} null value(s) in rank "
            f"{runtime.rank()}'s rows, and a tensor cannot hold them: fill or drop them first"
        )
    shape = [len(array)]
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or pa.types.is_fixed_size_list(array.type):
        lengths = pc.list_value_length(array)
        low, high = (pc.min_max(lengths)[k].as_py() for k in ("min", "max"))
        if len(array) and low != high:
            raise ValueError(
                f"column {name!r} holds arrays of different lengths ({low} to {high}) in "
                f"rank {runtime.rank()}'s rows: a tensor needs one length"
            )
        shape.append(low or 0)
        array = array.flatten()
        if array.null_count:
            raise ValueError(f"column {name!r} has null elements in rank {runtime.rank()}'s rows")
    values = array.to_numpy(zero_copy_only=False)
    return torch.from_numpy(np.array(values, copy=True).reshape(shape))
