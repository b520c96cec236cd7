"""A rank's write of its value into shared memory: ``values.dump`` (one thread) against threads
writing pieces of the same file.

    python benchmarks/value_writers.py [--mib 2048] [--writers 1 2 4] [--rounds 6] [--json OUT]

Each try is a fresh process, as a rank is: it fills a float32 tensor of ``--mib`` MiB, then
writes it into a file in ``/dev/shm`` and removes the file.  Writers 1 is ``values.dump``, as a
rank writes; a larger count sizes the file first (``ftruncate``) and lets that many threads
write 64 MiB pieces at their offsets (``os.pwrite``), the alternative this script weighs.  The
counts take turns, round after round, so that a busy machine weighs on each alike; the table
gives the write's median, fastest and slowest seconds by count, and the fill's (fresh memory
too).  On a virtual machine the first touch of a page may cost the host a fault of its own: both
figures then vary from one try to the next, and the system's lock on the file makes threads
writing to it take turns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

from report import machine, write_json  # noqa: E402  (this script's folder is on sys.path)

ONE_TRY = """
import json, os, sys, threading, time
import torch
from torchdist_magic.core import values
mib, writers, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
PIECE = 64 << 20

def in_pieces(tensor):
    view = memoryview(tensor.numpy()).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, view.nbytes)
    pieces = iter(range(0, view.nbytes, PIECE))
    lock = threading.Lock()

    def write():
        while True:
            with lock:
                start = next(pieces, None)
            if start is None:
                return
            part, offset = view[start:start + PIECE], start
            while part.nbytes:
                done = os.pwrite(fd, part, offset)
                part, offset = part[done:], offset + done

    threads = [threading.Thread(target=write) for _ in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.close(fd)

start = time.perf_counter()
tensor = torch.full((mib * 2**18,), 1.0)
filled = time.perf_counter()
if writers == 1:
    values.dump(tensor, path)
else:
    in_pieces(tensor)
written = time.perf_counter()
os.unlink(path)
print(json.dumps({"fill": filled - start, "write": written - filled}))
"""


def one_try(mib: int, writers: int) -> dict:
    path = os.path.join("/dev/shm", f"torchdist-bench-writers-{os.getpid()}")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", ONE_TRY, str(mib), str(writers), path],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=2048)
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "value_writers.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    tries = {w: [] for w in args.writers}
    for r in range(args.rounds):
        for writers in args.writers:
            tries[writers].append(one_try(args.mib, writers))
            print(
                f"round {r + 1}: {writers} writer(s): fill {tries[writers][-1]['fill']:.2f} s, "
                f"write {tries[writers][-1]['write']:.2f} s",
                flush=True,
            )
    rows = []
    print("\n| writers | write, median (s) | fastest | slowest | MiB/s (median) | fill, median (s) |")
    print("|---|---|---|---|---|---|")
    for writers, mine in tries.items():
        writes = [t["write"] for t in mine]
        row = {
            "writers": writers,
            "mib": args.mib,
            "write_seconds": writes,
            "fill_seconds": [t["fill"] for t in mine],
            "write_median": statistics.median(writes),
            "fill_median": statistics.median(t["fill"] for t in mine),
        }
        rows.append(row)
        print(
            f"| {writers} | {row['write_median']:.2f} | {min(writes):.2f} | {max(writes):.2f} | "
            f"{args.mib / row['write_median']:,.0f} | {row['fill_median']:.2f} |"
        )
    write_json(
        args.json,
        {
            "machine": machine(),
            "rounds": args.rounds,
            "time": time.time(),
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
