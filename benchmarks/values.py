"""Values both ways: rank 0's value back to the notebook, and a notebook tensor out to the
ranks, for 1, 64, 512 and 2048 MiB, on local processes, Spark ``local[2]`` (classic) and Spark
Connect (a server on ``local[2]`` started for it), against pyspark's TorchDistributor (local
mode, and on the same Spark sessions) in the same process.

    python benchmarks/values.py [--sizes 1 64 512 2048] [--repeat 3] [--json OUT] [--no-spark]
                                [--no-connect] [--no-torchdistributor] [--max-spark-mib N]
                                [--fetch-sizes 1 64 512 2048] [--only-fetch]
                                [--max-torchdistributor-mib N] [--torchdistributor-repeat N]
                                [--connect-driver-memory 4g] [--directions back out]
                                [--kept-sizes 1 1024] [--only-kept]

Every figure is the whole run's wall time (start 2 ranks, train nothing, move the value,
return), the median of ``--repeat`` (each run's is printed, and kept in the JSON as
``each_seconds``: on a busy machine a trivial run alone varies by a second or more); "MiB/s" is the largest size over its time beyond the
smallest size's, i.e. what the value itself costs; "MiB per CPU s" is the same by CPU time (this
process's and that of the children it waited for: the local ranks, torchrun's; not Spark's
executors), which a busy machine changes less.  "out" is a cell that uses a notebook tensor
(``capture_cell``, as ``%%torchdist`` does) for torchdist_magic, and the function's argument for
TorchDistributor, which has no other way.  The driver's peak resident memory above what it held
before (``/proc/self/status`` VmHWM, reset before each size) is in units of the value.  Spark
sizes above ``--max-spark-mib`` are skipped, and TorchDistributor's above
``--max-torchdistributor-mib`` (its closure and result paths hold several copies of the value in
the JVM: 2 GiB exhausts a small machine); TorchDistributor's runs, several times slower, are
repeated ``--torchdistributor-repeat`` times.  A size that fails is recorded with its error
(``"error"`` in the JSON, "failed" in the table) and the runner's larger sizes in that direction
are not tried.  The Connect rows run last (a Connect session makes this process a Connect client
for good), on a server with ``--connect-driver-memory`` of heap: at Spark's default of 1 GiB
TorchDistributor's 512 MiB value back exhausts it (``OutOfMemoryError`` serializing the task's
result; the server stops), where torchdist_magic's value never enters the JVM.

"out file alone", for torchdist's local out rows: what the file of the largest notebook tensor
costs the driver by itself, timed apart from any run (the median of ``--repeat``): writing it into
shared memory, as a run does while its ranks start, and giving its memory back (removing it), as
a run does after its result is known.

The out rows above send each run's tensor as a first run does (``TORCHDIST_KEEP_VALUES=0``).
The "same tensor again" rows (``--kept-sizes``, on local processes) run the out cell once on a
tensor, then ``--repeat`` times more on the same tensor, unchanged, as a notebook's second run of
a cell does: the first run's file is kept and mapped again (``driver.sent.KeptValues``).  Their
"beyond the smallest" column is the seconds the largest tensor costs a second run beyond the
smallest one's (the ranks still read the mapped pages: the cell sums every 4096th element);
``first`` is the first run's time; "send" is what the driver spends sending the values out
(the job pickled, then the file written, or the kept one found: ``SendTimer``).

The "fetch" rows move the values the way a multi-host cluster does (``TORCHDIST_VALUES_FETCH=1``
on ``local[2]``), with the channel's TLS (the default on Spark) and without: out, one task fetches
the notebook tensor's file from the driver's channel into this machine's shared memory, the other
maps it (``hostcopy``); back, rank 0's task sends the file its rank wrote to the driver over the
channel (``valueupload``).  "channel MiB/s" is what the fetching or sending rank's log line says
of the largest size (the median of the rounds): the transfer alone.  Their sizes are
``--fetch-sizes`` (up to 2048 MiB by default: the job itself stays small on that path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Tuple

HERE = os.path.dirname(os.path.abspath(__file__))

from report import machine, spark_session, write_json  # noqa: E402  (this script's folder is on sys.path)

sys.path.insert(0, os.path.dirname(HERE))


def back(mib):
    """Rank 0's value: a float32 tensor of ``mib`` MiB."""
    import os

    import torch

    if os.environ.get("RANK", "0") != "0":
        return None
    return torch.full((mib * 2**18,), 1.0)


def out(tensor):
    """A notebook tensor, out to every rank: its sum comes back."""
    return float(tensor[::4096].sum())


OUT_CELL = "float(tensor[::4096].sum())"


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _status_bytes(field: str) -> int:
    """A memory figure of this process from ``/proc/self/status`` (``VmHWM``: its peak)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_bytes() -> int:
    return _status_bytes("VmHWM")


def _rss_bytes() -> int:
    return _status_bytes("VmRSS")


def time_runs(call, repeat: int, times: list) -> Tuple[float, float]:
    """The median wall time of ``repeat`` calls (each appended to ``times``), and of their CPU
    time: this process's and that of the children it waited for (local ranks, torchrun's; not
    Spark's executors)."""
    cpu = []
    for _ in range(repeat):
        before = os.times()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        after = os.times()
        cpu.append(sum(after[i] - before[i] for i in range(4)))  # user, system, children's both
    return statistics.median(times), statistics.median(cpu)


def out_file_alone(tensor, repeat: int) -> Tuple[float, float]:
    """The medians of what the file of ``tensor`` out to the ranks costs the driver by itself:
    writing it where a run writes it (``Buffers.in_file`` into a ``value_directory``), and giving
    its memory back (removing it).  A run overlaps the first with its ranks' start."""
    import shutil

    from torchdist_magic.core import values

    writes, frees = [], []
    for _ in range(repeat):
        _, buffers = values.pickled_apart({"tensor": tensor})
        directory = values.value_directory("torchdist-bench-values-", buffers.nbytes)
        try:
            start = time.perf_counter()
            buffers.in_file(directory)
            writes.append(time.perf_counter() - start)
        finally:
            start = time.perf_counter()
            shutil.rmtree(directory)
            frees.append(time.perf_counter() - start)
    return statistics.median(writes), statistics.median(frees)


def torchdist_runner(local_mode: bool, **options):
    """``(back, out)`` for torchdist_magic: ``run(back, mib)``, and the out cell on a tensor."""
    from torchdist_magic import Distributor
    from torchdist_magic.capture import capture_cell
    from torchdist_magic.core.job import cell_job

    def run_back(mib):
        return Distributor(2, local_mode=local_mode, show=None, **options).run(back, mib)

    def run_out(tensor):
        cell = capture_cell(OUT_CELL, {"tensor": tensor}, [], warn_bytes=1 << 62)
        return Distributor(2, local_mode=local_mode, show=None, **options).run(cell_job(cell, "out"))

    return run_back, run_out


def torchdistributor_runner(local_mode: bool):
    from pyspark.ml.torch.distributor import TorchDistributor

    def run(fn, arg):
        return TorchDistributor(2, local_mode=local_mode, use_gpu=False).run(fn, arg)

    return (lambda mib: run(back, mib)), (lambda tensor: run(out, tensor))


#: what a rank's log line says of the values over the channel, by direction
CHANNEL_LINES = {"out": "fetched from the driver", "back": "sent to the driver"}


def channel_rate(direction: str) -> float:
    """MiB/s of the last run's values over the channel in ``direction``, as the fetching rank's
    log says (out) or the sending one's (back)."""
    import re

    from torchdist_magic.driver.distributor import last_run

    run = last_run()
    for rank in range(run.options.num_processes):
        found = re.search(CHANNEL_LINES[direction] + r" in [\d.]+ s \((\d+) MiB/s\)", run.logs(rank))
        if found:
            return float(found.group(1))
    raise RuntimeError(f"no rank of run {run.run_id} says it moved values {direction} over the channel")


def measure(name: str, runner, sizes, repeat: int, rows: list, directions) -> None:
    import torch

    run_back, run_out = runner
    run_back(1)  # warm-up: the file cache, Spark's Python daemon
    for direction in directions:
        for mib in sizes:
            tensor = torch.ones(mib * 2**18) if direction == "out" else None
            _reset_peak()
            before = _rss_bytes()
            row = {"runner": name, "direction": direction, "mib": mib, "each_seconds": []}
            fetches: list = []
            # the closures bind this round's values: each is called within the round
            call = (lambda mib=mib: run_back(mib)) if direction == "back" else (lambda tensor=tensor: run_out(tensor))
            try:
                if "fetch" in name:  # each run's transfer as its rank's log says
                    timed = time_runs(
                        lambda call=call, fetches=fetches, direction=direction: (
                            call(),
                            fetches.append(channel_rate(direction)),
                        ),
                        repeat,
                        row["each_seconds"],
                    )
                else:
                    timed = time_runs(call, repeat, row["each_seconds"])
                row["seconds"], row["cpu_seconds"] = timed
            except Exception as exc:  # a runner's limit: recorded, its larger sizes not tried  # noqa: BLE001
                row.update(seconds=None, error=f"{type(exc).__name__}: {str(exc)[:500]}")
            row["driver_peak_per_value"] = (_peak_bytes() - before) / (mib * 2**20)
            if fetches:
                row["fetch_mib_per_s"] = statistics.median(fetches)
            if direction == "out" and name == "torchdist local" and row["seconds"] is not None:
                row["file_write_seconds"], row["file_free_seconds"] = out_file_alone(tensor, repeat)
            tensor = None  # its memory goes before the next size
            rows.append(row)
            if row["seconds"] is None:
                print(f"{name:28s} {direction:4s} {mib:5d} MiB  failed: {row['error'][:200]}", flush=True)
                break
            print(
                f"{name:28s} {direction:4s} {mib:5d} MiB  {row['seconds']:7.2f} s "
                f"({' '.join(f'{t:.2f}' for t in row['each_seconds'])})  CPU {row['cpu_seconds']:6.2f} s  "
                f"driver peak +{row['driver_peak_per_value']:.2f}x"
                + (f"  channel {row['fetch_mib_per_s']:.0f} MiB/s" if "fetch_mib_per_s" in row else "")
                + (
                    f"  file alone: written in {row['file_write_seconds']:.2f} s, freed in "
                    f"{row['file_free_seconds']:.2f} s"
                    if "file_write_seconds" in row
                    else ""
                ),
                flush=True,
            )


KEPT_RUNNER = "torchdist local, same tensor again"


class SendTimer:
    """The seconds a run's driver spends sending its values out (``SentValues.pickle``, then
    ``wait`` for the file the ranks map: written, or the kept one found), each run's appended to
    ``seconds``; timed around the package's own methods, which it leaves as they were."""

    def __init__(self):
        from torchdist_magic.driver.sent import SentValues

        self.seconds: list = []
        self._class = SentValues
        self._pickle, self._wait = SentValues.pickle, SentValues.wait
        timer = self

        def pickle(sent, job):
            start = time.perf_counter()
            try:
                return timer._pickle(sent, job)
            finally:
                sent._send_started = start

        def wait(sent):
            try:
                return timer._wait(sent)
            finally:
                if getattr(sent, "_send_started", None) is not None:
                    timer.seconds.append(time.perf_counter() - sent._send_started)
                    sent._send_started = None

        SentValues.pickle, SentValues.wait = pickle, wait

    def close(self) -> None:
        self._class.pickle, self._class.wait = self._pickle, self._wait


def measure_kept(sizes, repeat: int, rows: list) -> None:
    """The out cell on a tensor once, then ``repeat`` times more on the same tensor, unchanged;
    each run's whole time and its driver's sending time (``SendTimer``)."""
    import torch

    from torchdist_magic.driver.sent import KEEP_ENV, KeptValues

    os.environ[KEEP_ENV] = "1"
    _, run_out = torchdist_runner(True)
    timer = SendTimer()
    try:
        for mib in sizes:
            tensor = torch.ones(mib * 2**18)
            start = time.perf_counter()
            del timer.seconds[:]
            run_out(tensor)
            row = {"runner": KEPT_RUNNER, "direction": "out", "mib": mib, "each_seconds": []}
            row["first_seconds"] = time.perf_counter() - start
            row["first_send_seconds"] = timer.seconds[0]
            del timer.seconds[:]
            row["seconds"], row["cpu_seconds"] = time_runs(
                lambda tensor=tensor: run_out(tensor), repeat, row["each_seconds"]
            )
            row["each_send_seconds"] = list(timer.seconds)
            row["send_seconds"] = statistics.median(timer.seconds)
            row["driver_peak_per_value"] = 0.0
            rows.append(row)
            print(
                f"{KEPT_RUNNER:28s} out  {mib:5d} MiB  first {row['first_seconds']:.2f} s (sent in "
                f"{row['first_send_seconds']:.3f} s), again {row['seconds']:7.2f} s "
                f"({' '.join(f'{t:.2f}' for t in row['each_seconds'])}; sent in "
                f"{' '.join(f'{t:.3f}' for t in row['each_send_seconds'])} s)",
                flush=True,
            )
            KeptValues.forget_current()
            tensor = None
    finally:
        timer.close()
        os.environ[KEEP_ENV] = "0"


def print_kept_table(rows: list) -> None:
    mine = [r for r in rows if r["runner"] == KEPT_RUNNER]
    if not mine:
        return
    print()
    print(
        "| same tensor again (local) | MiB | first run s | its send s | each run after s (median) "
        "| beyond the smallest s | its send s (median) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in mine:
        beyond = r["seconds"] - mine[0]["seconds"]
        r["seconds_beyond_smallest"] = beyond
        print(
            f"| out | {r['mib']} | {r['first_seconds']:.2f} | {r['first_send_seconds']:.3f} | {r['seconds']:.2f} "
            f"({' '.join(f'{t:.2f}' for t in r['each_seconds'])}) | {beyond:+.2f} | {r['send_seconds']:.3f} |"
        )


def rate(mine: list, key: str = "seconds"):
    """MiB/s of the largest size measured beyond the smallest, by wall time (or by ``key``:
    ``"cpu_seconds"``); ``None`` when not measurably slower."""
    mine = [r for r in mine if r["seconds"] is not None]
    if len(mine) < 2:
        return None
    extra = mine[-1][key] - mine[0][key]
    return (mine[-1]["mib"] - mine[0]["mib"]) / extra if extra > 0 else None


def print_table(rows: list, sizes) -> None:
    print()
    print(
        "| runner | direction | "
        + " | ".join(f"{m} MiB" for m in sizes)
        + " | MiB/s beyond a trivial run | MiB per CPU s beyond it | driver peak (x value) | channel MiB/s "
        "| out file alone: write s, free s |"
    )
    print("|" + "---|" * (7 + len(sizes)))
    seen = []
    for r in rows:
        if (r["runner"], r["direction"]) not in seen:
            seen.append((r["runner"], r["direction"]))
    for name, direction in seen:
        mine = [r for r in rows if r["runner"] == name and r["direction"] == direction]
        by_size = {r["mib"]: r for r in mine}
        cells = [
            ("failed" if by_size[m]["seconds"] is None else f"{by_size[m]['seconds']:.2f}") if m in by_size else "-"
            for m in sizes
        ]
        speed, cpu = rate(mine), rate(mine, "cpu_seconds")
        largest = [r for r in mine if r["seconds"] is not None][-1:] or mine
        fetch = largest[0].get("fetch_mib_per_s")
        alone = largest[0].get("file_write_seconds")
        print(
            f"| {name} | {direction} | " + " | ".join(cells) + f" | {f'{speed:,.0f}' if speed else '-'} | "
            f"{f'{cpu:,.0f}' if cpu else '-'} | "
            f"{largest[0]['driver_peak_per_value']:.2f} | {f'{fetch:,.0f}' if fetch else '-'} | "
            + (f"{alone:.2f}, {largest[0]['file_free_seconds']:.2f}" if alone is not None else "-")
            + " |"
        )


def on_connect(measure_all, driver_memory: str) -> None:
    """``measure_all()`` with a Spark Connect session on a server started for it (and stopped),
    with ``driver_memory`` of heap."""
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from pyspark.sql import SparkSession
    from spark_fixtures import ConnectServer

    with tempfile.TemporaryDirectory(prefix="torchdist-bench-") as tmp:
        server = ConnectServer(os.path.join(tmp, "connect"), extra_conf={"spark.driver.memory": driver_memory})
        try:
            spark = SparkSession.builder.remote(server.url).getOrCreate()
            measure_all()
            spark.stop()
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 512, 2048])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "values.json"))
    parser.add_argument("--no-spark", action="store_true")
    parser.add_argument("--no-connect", action="store_true")
    parser.add_argument("--no-torchdistributor", action="store_true")
    parser.add_argument("--max-spark-mib", type=int, default=512)
    parser.add_argument("--fetch-sizes", type=int, nargs="+", default=[1, 64, 512, 2048])
    parser.add_argument("--only-fetch", action="store_true", help="only the fetch rows (on Spark local[2])")
    parser.add_argument("--max-torchdistributor-mib", type=int, default=512)
    parser.add_argument("--torchdistributor-repeat", type=int, default=1)
    parser.add_argument("--connect-driver-memory", default="4g")
    parser.add_argument("--directions", nargs="+", choices=["back", "out"], default=["back", "out"])
    parser.add_argument("--kept-sizes", type=int, nargs="+", default=[1, 1024])
    parser.add_argument("--only-kept", action="store_true", help="only the same-tensor-again rows")
    args = parser.parse_args()
    from torchdist_magic.driver.sent import KEEP_ENV

    os.environ[KEEP_ENV] = "0"  # every out row but the kept ones sends its tensor as a first run does
    import pyspark
    import torch

    rows: list = []
    load_before = os.getloadavg()
    spark_sizes = [m for m in args.sizes if m <= args.max_spark_mib]
    td_local_sizes = [m for m in args.sizes if m <= args.max_torchdistributor_mib]
    td_sizes = [m for m in spark_sizes if m <= args.max_torchdistributor_mib]
    td_repeat = args.torchdistributor_repeat
    # TorchDistributor's tasks run Spark's interpreter: the notebook's, as torchdist_magic picks
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if args.kept_sizes and "out" in args.directions and not args.only_fetch:
        measure_kept(args.kept_sizes, args.repeat, rows)
    if not args.only_fetch and not args.only_kept:
        measure("torchdist local", torchdist_runner(True), args.sizes, args.repeat, rows, args.directions)
    if not args.no_spark and not args.only_kept:
        spark = spark_session("torchdist_magic values benchmark")
        if not args.no_torchdistributor and not args.only_fetch:  # it wants an active session even in local mode
            measure(
                "TorchDistributor local",
                torchdistributor_runner(True),
                td_local_sizes,
                td_repeat,
                rows,
                args.directions,
            )
        if not args.only_fetch:
            measure(
                "torchdist spark local[2]", torchdist_runner(False), spark_sizes, args.repeat, rows, args.directions
            )
        from torchdist_magic.core.names import VALUES_FETCH_ENV

        os.environ[VALUES_FETCH_ENV] = "1"
        for tls in (True, False):
            measure(
                f"torchdist spark fetch{'' if tls else ' no TLS'}",
                torchdist_runner(False, tls=tls),
                args.fetch_sizes,
                args.repeat,
                rows,
                args.directions,
            )
        del os.environ[VALUES_FETCH_ENV]
        if not args.no_torchdistributor and not args.only_fetch:
            measure(
                "TorchDistributor spark local[2]",
                torchdistributor_runner(False),
                td_sizes,
                td_repeat,
                rows,
                args.directions,
            )
        spark.stop()
        if not args.no_connect and not args.only_fetch:

            def measure_connect():
                measure("torchdist connect", torchdist_runner(False), spark_sizes, args.repeat, rows, args.directions)
                if not args.no_torchdistributor:
                    measure(
                        "TorchDistributor connect",
                        torchdistributor_runner(False),
                        td_sizes,
                        td_repeat,
                        rows,
                        args.directions,
                    )

            on_connect(measure_connect, args.connect_driver_memory)
    print_table([r for r in rows if r["runner"] != KEPT_RUNNER], args.sizes)
    print_kept_table(rows)
    for r in rows:
        r["mib_per_s_beyond_smallest"] = r["mib_per_cpu_s_beyond_smallest"] = None
    for name, direction in {(r["runner"], r["direction"]) for r in rows}:
        mine = [r for r in rows if r["runner"] == name and r["direction"] == direction and r["seconds"] is not None]
        if mine:
            mine[-1]["mib_per_s_beyond_smallest"] = rate(mine)
            mine[-1]["mib_per_cpu_s_beyond_smallest"] = rate(mine, "cpu_seconds")
    write_json(
        args.json,
        {
            "machine": machine(torch=torch.__version__, pyspark=pyspark.__version__),
            "repeat": args.repeat,
            "torchdistributor_repeat": td_repeat,
            "connect_driver_memory": args.connect_driver_memory,
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "note": "2 ranks; a shared 2-core machine: see load_average",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
