"""What the run view costs at 4 to 1024 ranks: the live widget's update (bytes sent to the
browser in one refresh, and the time to render it) and the summary kept in the notebook (HTML
and text bytes, time to render), for a simulated run (``tests/view_helpers.simulated_run``: two
bars, three metrics, output lines, a straggler, a failed and a silent rank) fed through the real
``RunState``.

    python benchmarks/view.py [--ranks 4 64 256 1024] [--steps 400] [--json OUT]

Render times are wall-clock (max and median over ``--rounds`` refreshes) and the median CPU time
of this process (less sensitive to other load on a shared machine).  No browser here: paint
times are not measured."""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
from report import machine, write_json  # noqa: E402  (this script's folder is on sys.path)

sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from view_helpers import simulated_run  # noqa: E402

from torchdist_magic.core import events  # noqa: E402
from torchdist_magic.view import widget as W  # noqa: E402
from torchdist_magic.view.text import summary_with_logs  # noqa: E402

PARTS = ("header", "rows", "failure", "stacks", "plots", "logs", "log_select", "host_page")


def sent_by(view, act) -> int:
    """Bytes of the widget values (or options) that ``act`` changed: what one update sends."""
    sizes = []
    handlers = []
    for name in PARTS:
        part = getattr(view, name)
        trait = "options" if name in ("log_select", "host_page") else "value"

        def handler(change):
            sizes.append(len(str(change["new"]).encode()))

        part.observe(handler, trait)
        handlers.append((part, handler, trait))
    act()
    for part, handler, trait in handlers:
        part.unobserve(handler, trait)
    return sum(sizes)


def measure(ranks: int, steps: int, rounds: int) -> dict:
    run, clock = simulated_run(ranks, steps=steps)
    view = W.WidgetView(run, display=False, clock=clock)
    frames, renders, cpu = [], [], []
    for i in range(rounds):
        clock.now += W.PLOT_EVERY  # a refresh that redraws everything, plots included
        for r in range(ranks):
            run.state.apply(events.Progress(rank=r, bar="batch#9", desc="batch", n=30 + i, total=50, elapsed=20.0 + i))
            run.state.apply(events.Log(rank=r, stream="stdout", line=f"rank {r} round {i}"))
        started, started_cpu = time.perf_counter(), time.process_time()
        frames.append(sent_by(view, view.update))
        renders.append((time.perf_counter() - started) * 1000)
        cpu.append((time.process_time() - started_cpu) * 1000)
    started = time.perf_counter()
    html = view.snapshot_html()
    summary_ms = (time.perf_counter() - started) * 1000
    text = summary_with_logs(run.state, "_torchdist_run.logs(rank)")
    return {
        "ranks": ranks,
        "steps": steps,
        "frame_bytes_max": max(frames),
        "render_ms_max": round(max(renders), 1),
        "render_ms_median": round(sorted(renders)[len(renders) // 2], 1),
        "render_cpu_ms_median": round(sorted(cpu)[len(cpu) // 2], 1),
        "summary_html_bytes": len(html.encode()),
        "summary_text_bytes": len(text.encode()),
        "summary_ms": round(summary_ms, 1),
        "stragglers": [s.rank for s in run.state.stragglers()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=400, help="metric points per rank")
    parser.add_argument("--rounds", type=int, default=5, help="refreshes measured per size")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "view.json"))
    args = parser.parse_args()
    results = [measure(n, args.steps, args.rounds) for n in args.ranks]
    print(
        f"{'ranks':>6} {'update KB':>10} {'render ms (max / median)':>25} {'CPU ms':>7}"
        f" {'summary KB (html / text)':>25} {'summary ms':>11}"
    )
    for r in results:
        print(
            f"{r['ranks']:>6} {r['frame_bytes_max'] / 1024:>10.1f} {r['render_ms_max']:>14.1f} / "
            f"{r['render_ms_median']:<8.1f} {r['render_cpu_ms_median']:>7.1f} {r['summary_html_bytes'] / 1024:>14.1f} / "
            f"{r['summary_text_bytes'] / 1024:<8.1f} {r['summary_ms']:>11.1f}"
        )
    write_json(args.json, {"machine": machine(), "results": results})


if __name__ == "__main__":
    main()
