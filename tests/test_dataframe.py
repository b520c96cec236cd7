"""Training on a DataFrame (``train_on_dataframe``, ``%%torchdist --data``, ``shard``): every row
reaches exactly one rank, every rank takes the same number of batches, bad input is refused
before anything starts, and nothing survives the run.  Local processes with pandas first, then
real Spark on ``local[2]`` and ``local-cluster[2,1,1024]``."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from helpers import assert_no_survivors, cell
from torchdist_magic import Distributor, RankFailure, last_run, shard
from torchdist_magic.rank.shard import NO_DATA


def read_everything(batch_size):
    """What one rank saw: its batch counts and row ids for each way of reading."""
    from torchdist_magic import shard

    plain = shard(batch_size=batch_size)
    ids = [[int(i) for i in b["id"]] for b in plain]
    again = [[int(i) for i in b["id"]] for b in plain]  # the next epoch
    dropped = shard(batch_size=batch_size, drop_last=True)
    dropped_ids = [[int(i) for i in b["id"]] for b in dropped]
    mixed = shard(batch_size=batch_size, shuffle=True, seed=7)
    epoch0, epoch1 = ([int(i) for b in mixed for i in b["id"]] for _ in range(2))
    replay = shard(batch_size=batch_size, shuffle=True, seed=7)
    frames = list(shard(batch_size=batch_size, columns=["id"], format="pandas"))
    arrow = next(iter(shard(batch_size=batch_size, format="arrow")))
    return {
        "counts": plain.row_counts(),
        "len": len(plain),
        "ids": ids,
        "again": again,
        "dropped": dropped_ids,
        "len_dropped": len(dropped),
        "epoch0": epoch0,
        "epoch1": epoch1,
        "replay0": [int(i) for b in replay for i in b["id"]],
        "pandas": [list(f.columns) for f in frames][:1],
        "arrow": arrow.schema.names,
    }


def check_shares(ranks, rows, batch_size):
    """Every row delivered, equal batch counts, padding and drop_last as documented."""
    counts = ranks[0]["counts"]
    assert sum(counts) == rows and all(r["counts"] == counts for r in ranks)
    assert {len(r["ids"]) for r in ranks} == {-(-max(counts) // batch_size)}
    assert {r["len"] for r in ranks} == {len(ranks[0]["ids"])}
    seen = [i for r in ranks for batch in r["ids"] for i in batch]
    assert set(seen) == set(range(rows))  # no row lost
    for r in ranks:
        flat = [i for batch in r["ids"] for i in batch]
        assert len(flat) == max(counts)  # padded with its own rows
        assert r["again"] == r["ids"]
        assert {len(r["dropped"]), r["len_dropped"]} == {min(counts) // batch_size}
        assert all(len(b) == batch_size for b in r["dropped"])
        assert len(r["epoch0"]) == len(flat) and set(r["epoch0"]) == set(flat)
        assert r["epoch0"] != r["epoch1"]
        assert r["replay0"] == r["epoch0"]  # the shared seed replays
        assert r["pandas"] == [["id"]] and r["arrow"] == ["id", "x"]
    assert ranks[0]["epoch0"] != ranks[1]["epoch0"]


# -- local processes, pandas ----------------------------------------------------------------------


def frame(rows):
    return pd.DataFrame({"id": np.arange(rows), "x": np.linspace(0, 1, rows, dtype="float32")})


def test_pandas_frame_on_local_processes():
    values = Distributor(2, local_mode=True, show=None, all_ranks=True).train_on_dataframe(
        read_everything, frame(23), 4
    )
    check_shares(values, 23, 4)
    assert values[0]["counts"] == [11, 12]
    assert_no_survivors(last_run())


def test_tensors_of_array_columns_and_the_rows_bar():
    def batches():
        from torchdist_magic import shard

        b = next(iter(shard(batch_size=3)))
        return {k: (str(v.dtype), tuple(v.shape)) for k, v in b.items()}

    data = pd.DataFrame(
        {
            "v": [np.arange(4, dtype="float32") + i for i in range(6)],
            "flag": [True, False] * 3,
            "n": np.arange(6, dtype="int16"),
        }
    )
    dist = Distributor(2, local_mode=True, show=None)
    assert dist.train_on_dataframe(batches, data) == {
        "v": ("torch.float32", (3, 4)),
        "flag": ("torch.bool", (3,)),
        "n": ("torch.int16", (3,)),
    }
    run = last_run()
    bars = [b for rs in run.state.ranks for b in rs.progress.values()]
    assert {(b["desc"], b["n"], b["total"]) for b in bars} == {("rows", 3, 3)}
    assert_no_survivors(run)


def test_shard_without_data_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TORCHDIST_DATA_FILE", raising=False)
    with pytest.raises(RuntimeError, match="not a rank of a run"):
        shard(batch_size=2)

    def reads():
        from torchdist_magic import shard

        return list(shard(batch_size=2))

    with pytest.raises(RankFailure) as info:
        Distributor(2, local_mode=True, show=None).run(reads)
    assert NO_DATA.format(where="run") in str(info.value)
    assert_no_survivors(last_run())


def test_shard_arguments_are_checked(monkeypatch, tmp_path):
    from torchdist_magic.backends.frames import prepare_pandas

    data = prepare_pandas(frame(4), 1)
    path = data.write_rank_files("torchdist-test-", 1)[0]
    monkeypatch.setenv("TORCHDIST_DATA_FILE", path)
    with pytest.raises(ValueError, match="no column 'nope'; its columns: id, x"):
        shard(batch_size=2, columns=["nope"])
    with pytest.raises(ValueError, match=r"^shard\(batch_size=\.\.\.\) must be a whole number of at least 1, got 0$"):
        shard(batch_size=0)
    with pytest.raises(
        ValueError,
        match=r"^shard\(format=\.\.\.\) must be one of 'torch', 'pandas', 'arrow', "
        r"got 'numpy'$",
    ):
        shard(batch_size=2, format="numpy")
    assert [len(b["id"]) for b in shard(batch_size=3)] == [3, 1]  # one rank: no exchange
    data.remove_files()


BAD_PANDAS = [
    (["not", "a", "frame"], None, TypeError, "must be a Spark DataFrame .* got builtins.list"),
    (frame(4), ["id", "nope"], ValueError, "no column 'nope'; its columns: id, x"),
    (frame(4).assign(name="a"), None, ValueError, r"column 'name' \((large_)?string\) cannot become a tensor"),
    (frame(0), None, ValueError, "the DataFrame is empty"),
    (frame(1), None, ValueError, "has 1 row, fewer than the 2 ranks"),
]


@pytest.mark.parametrize(
    "data, columns, error, message", BAD_PANDAS, ids=["not-a-frame", "no-column", "string", "empty", "too-few-rows"]
)
def test_bad_data_is_refused_before_start(data, columns, error, message):
    from torchdist_magic.driver.distributor import submit

    before = last_run()
    with pytest.raises(error, match=message):
        submit(read_everything, (2,), {}, Distributor(2, local_mode=True).options, data=data, columns=columns)
    assert last_run() is before  # nothing started


def test_magic_data_flag(ip):
    ip.user_ns["pdf"] = frame(10)
    result = cell(
        ip,
        """
        %%torchdist --np 2 --local --data pdf --columns id --all-ranks --quiet
        from torchdist_magic import shard
        [len(b["id"]) for b in shard(batch_size=4)]
    """,
    )
    assert result.error_in_exec is None, result.error_in_exec
    assert result.result == [[4, 1], [4, 1]]
    assert_no_survivors(last_run())
    for line, message in [
        ("--data missing", "the notebook has no variable 'missing'"),
        ("--columns id", "give --data NAME too"),
        ("--data pdf --columns nope", "no column 'nope'"),
    ]:
        result = cell(ip, f"%%torchdist --np 2 --local {line}\n1")
        assert message in str(result.error_in_exec), result.error_in_exec


# -- Spark ------------------------------------------------------------------------------------------


def spark_frame(spark, rows, partitions):
    return spark.range(0, rows, 1, numPartitions=partitions).selectExpr("id", "cast(id as float) / 2 as x")


@pytest.mark.spark
@pytest.mark.parametrize("partitions", [1, 2, 7])
def test_any_partition_count_on_local2(spark_local2, partitions):
    values = Distributor(2, local_mode=False, show=None, all_ranks=True).train_on_dataframe(
        read_everything, spark_frame(spark_local2, 101, partitions), 8
    )
    check_shares(values, 101, 8)
    assert_no_survivors(last_run())


@pytest.mark.spark
def test_a_spark_connect_dataframe_is_read_inside_the_executors(spark_connect):
    values = Distributor(2, local_mode=False, show=None, all_ranks=True).train_on_dataframe(
        read_everything, spark_frame(spark_connect, 57, 3), 8
    )
    check_shares(values, 57, 8)
    assert_no_survivors(last_run())


@pytest.mark.spark
def test_bad_spark_input_is_refused_before_start(spark_local2):
    from torchdist_magic.driver.distributor import submit

    spark = spark_local2
    on_spark = Distributor(2, local_mode=False).options
    cases = [
        (spark.newSession().range(10), on_spark, "belongs to another SparkSession"),
        (
            spark_frame(spark, 10, 2).selectExpr("id", "cast(id as string) as s"),
            on_spark,
            r"column 's' \(string\) cannot become a tensor",
        ),
        (spark_frame(spark, 10, 2).where("id < 0"), on_spark, "the DataFrame is empty"),
        (spark_frame(spark, 1, 1), on_spark, "has 1 row, fewer than the 2 ranks"),
        (frame(10), on_spark, "a pandas DataFrame trains on local processes"),
        (
            spark_frame(spark, 10, 2),
            Distributor(2, local_mode=True).options,
            "a Spark DataFrame trains on the Spark backend",
        ),
    ]
    before = last_run()
    for data, options, message in cases:
        with pytest.raises(ValueError, match=message):
            submit(read_everything, (2,), {}, options, data=data)
    with pytest.raises(ValueError, match="no column 'nope'"):
        submit(read_everything, (2,), {}, on_spark, data=spark_frame(spark, 10, 2), columns=["nope"])
    assert last_run() is before


def fit(batches_of, epochs=4, lr=0.1):
    """Linear regression trained by ``batches_of(epoch)``; with DDP when a group is set up."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    if dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(epochs):
        for x, y in batches_of(epoch):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            loss.backward()
            optimizer.step()
    inner = getattr(model, "module", model)
    return torch.cat([inner.weight.detach().flatten(), inner.bias.detach()]).tolist()


def train_ddp():
    import torch.distributed as dist

    from torchdist_magic import shard

    dist.init_process_group("gloo")  # as TorchDistributor code does
    rows = shard(batch_size=32, shuffle=True, seed=1)
    weights = fit(lambda _epoch: ((b["features"], b["label"]) for b in rows))
    dist.destroy_process_group()
    return weights


@pytest.mark.spark
def test_ddp_on_a_dataframe_converges_like_in_memory_on_a_cluster(spark_cluster, monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # torch.optim's, here

    true_w = [1.5, -2.0, 0.5, 3.0]
    columns = ", ".join(f"cast(randn({i}) as float)" for i in range(4))
    df = (
        spark_cluster.range(0, 2000, 1, numPartitions=7)
        .selectExpr(f"array({columns}) as features")
        .selectExpr(
            "features",
            "cast(aggregate(zip_with(features, array("
            + ", ".join(map(str, true_w))
            + "), (a, b) -> a * b), 0d, (s, v) -> s + v) + 0.25 as float) as label",
        )
    )
    weights = Distributor(2, local_mode=False, show=None).train_on_dataframe(train_ddp, df)
    run = last_run()
    local = df.toPandas()
    x = torch.tensor(np.stack(local["features"].to_numpy()).astype("float32"))
    y = torch.tensor(local["label"].to_numpy().astype("float32"))
    in_memory = fit(lambda e: zip(x.split(64), y.split(64)))  # 2 ranks x 32 rows a step
    expected = true_w + [0.25]
    assert np.allclose(weights, expected, atol=0.05), weights
    assert np.allclose(in_memory, expected, atol=0.05), in_memory
    assert_no_survivors(run)


# -- messages a user sees about the data (each triggered once) -------------------------------------


def test_no_columns_chosen_is_refused_before_start(ip):
    ip.user_ns["pdf"] = frame(4)
    before = last_run()
    result = cell(ip, "%%torchdist --np 2 --local --data pdf --columns ,\n1")
    assert str(result.error_in_exec) == "no columns chosen: name at least one"
    assert last_run() is before  # nothing started


def test_a_frame_arrow_cannot_hold_is_refused_before_start():
    before = last_run()
    mixed = pd.DataFrame({"id": [1, 2], "mixed": [1, "a"]})  # an object column of int and str
    with pytest.raises(ValueError) as info:
        Distributor(2, local_mode=True, show=None).train_on_dataframe(read_everything, mixed, 2)
    text = str(info.value)
    assert text.startswith("the DataFrame cannot be turned into Arrow columns: ")
    assert "Conversion failed for column mixed with type object" in text
    assert last_run() is before


def first_batch():
    from torchdist_magic import shard

    return next(iter(shard(batch_size=4)))


@pytest.mark.parametrize(
    "data, message",
    [
        (
            pd.DataFrame({"x": [1.0, np.nan, 3.0, np.nan]}),
            "column 'x' has 2 null value(s) in rank 0's rows, and a tensor cannot hold them: fill or drop them first",
        ),
        (
            pd.DataFrame({"v": [[1, 2], [3], [4, 5], [6, 7, 8]]}),
            "column 'v' holds arrays of different lengths (1 to 3) in rank 0's rows: a tensor needs one length",
        ),
        (pd.DataFrame({"v": [[1, None], [3, 4], [5, 6], [7, 8]]}), "column 'v' has null elements in rank 0's rows"),
    ],
    ids=["null-values", "ragged-arrays", "null-elements"],
)
def test_rows_a_tensor_cannot_hold_fail_the_rank_that_reads_them(data, message):
    # one rank, so that which rank holds the bad rows does not depend on how rows are split
    with pytest.raises(RankFailure) as info:
        Distributor(1, local_mode=True, show=None).train_on_dataframe(first_batch, data)
    assert (info.value.rank, info.value.exc_type, info.value.message) == (0, "ValueError", message)
    assert_no_survivors(last_run())


def count_rows():
    from torchdist_magic import shard

    return shard(batch_size=1).row_counts()


@pytest.mark.spark
def test_a_rank_without_rows_says_so(spark_local2):
    # two partitions already (no repartition), the second one empty after the filter
    data = spark_local2.range(0, 4, 1, numPartitions=2).where("id < 2")
    assert data.rdd.getNumPartitions() == 2 and data.count() == 2
    with pytest.raises(RankFailure) as info:
        Distributor(2, local_mode=False, show=None).train_on_dataframe(count_rows, data)
    assert info.value.exc_type == "ValueError"
    assert info.value.message == (
        "rank 1 got none of the DataFrame's rows (rows per rank: [2, 0]): Spark's repartition "
        "spreads tiny DataFrames unevenly; give the run more rows or fewer ranks"
    )
    assert_no_survivors(last_run())


def own_rows():
    """This rank's own rows (``id``, ``label``), in the order ``shard`` yields them."""
    from torchdist_magic import shard

    rows = shard(batch_size=64)
    pairs = [(int(i), int(label)) for b in rows for i, label in zip(b["id"], b["label"])]
    return pairs[: rows.num_rows]  # not the padding


def test_a_frame_sorted_by_label_gives_every_rank_both_classes():
    rows = 601
    data = pd.DataFrame({"id": np.arange(rows), "label": (np.arange(rows) >= 300).astype("int64")})
    dist = Distributor(2, local_mode=True, show=None, all_ranks=True)
    ranks = dist.train_on_dataframe(own_rows, data)
    assert_no_survivors(last_run())
    assert sorted(i for pairs in ranks for i, _ in pairs) == list(range(rows))  # each row once
    assert sorted(len(pairs) for pairs in ranks) == [300, 301]
    for pairs in ranks:
        share = sum(label for _, label in pairs) / len(pairs)
        assert 0.4 < share < 0.6, share  # both classes, about half each
        assert [i for i, _ in pairs] == sorted(i for i, _ in pairs)  # in the DataFrame's order
    assert dist.train_on_dataframe(own_rows, data) == ranks  # the same split every time
    assert_no_survivors(last_run())


def test_torchdistributors_private_name_still_works():
    """Code written for TorchDistributor calls its private ``_train_on_dataframe``."""
    frame = pd.DataFrame({"x": [1.0, 2.0, 3.0, 4.0]})
    dist = Distributor(2, local_mode=True, show=None, all_ranks=True)
    assert dist._train_on_dataframe(count_rows, frame) == dist.train_on_dataframe(count_rows, frame) == [[2, 2]] * 2
