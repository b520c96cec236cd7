"""What the view tests share: a fake run and short ways to feed its ``RunState`` events."""

from __future__ import annotations

import time

from torchdist_magic.core import events
from torchdist_magic.core.errors import NotAvailable
from torchdist_magic.driver.handle import StateAnswers
from torchdist_magic.driver.state import RunState


class FakeRun(StateAnswers):
    """A ``RunHandle`` over a state the test feeds by hand: ``cancel()`` is counted, and it ends
    when the state does."""

    can_profile = False

    def __init__(self, num_processes=2):
        self.run_id = "7-cafe"
        self.state = RunState(self.run_id, num_processes, backend="local processes on testhost", job_name="cell In[3]")
        self.cancelled = 0
        self.cancelled_by = ""

    def cancel(self, by="cancel()"):
        self.cancelled += 1
        self.cancelled_by = by

    def result(self, timeout=None):
        return None

    @property
    def exception(self):
        return None

    def done(self):
        return self.state.finished

    def wait(self, timeout=None):
        return self.state.finished

    def logs(self, rank=0, attempt=None):
        return self.state.logs(rank, attempt)

    def culprit(self):
        return self.last_verdict()

    def start_profile(self, steps):
        raise NotAvailable("a test's run has no ranks to profile")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def no_cpu():
    """A ``cpu_clock`` for a view under a fake ``Clock``: drawing costs no CPU, so the view's
    refresh intervals stay ``UPDATE_EVERY`` and ``PLOT_EVERY`` however slow this machine is (the
    stretching itself: test_widget's test of a view that costs more to draw)."""
    return 0.0


def feed(state, *records):
    for record in records:
        state.apply(record)


def running(state, rank, host="node-a"):
    feed(state, events.Started(rank=rank, host=host, pid=100 + rank))


def bar(state, rank, n, total, desc="epoch", bar_id=None, state_="running", elapsed=2.0):
    feed(
        state,
        events.Progress(
            rank=rank, bar=bar_id or f"{desc}#0", desc=desc, n=n, total=total, elapsed=elapsed, state=state_
        ),
    )


def metrics(state, rank, step, **values):
    feed(state, events.Metrics.point(rank=rank, step=step, values=values))


def log(state, rank, text, cr=False, stream="stdout"):
    feed(state, events.Log(rank=rank, stream=stream, line=text, cr=cr))


def exit_(state, rank, code, exc_type="", message="", stopped=False):
    failure = events.Failure(exc_type=exc_type, message=message) if exc_type else None
    feed(state, events.Exit(rank=rank, code=code, time=time.time(), stopped=stopped, failure=failure))


def simulated_run(ranks, steps=100, lines=20, per_host=8):
    """A run of ``ranks`` simulated ranks (``per_host`` to a host) as a view sees it mid-run,
    fed through ``RunState.apply`` on a fake clock: an epoch and a batch bar, ``steps`` points of
    three metrics and ``lines`` lines of output each (every tenth on stderr or a warning); rank
    ``ranks // 3`` straggles at a fifth of the others' pace, the last rank failed with a
    traceback and, from 8 ranks, rank ``ranks // 2`` fell silent."""
    from torchdist_magic.driver import stragglers

    clock = Clock()
    run = FakeRun(ranks)
    run.state = RunState(run.run_id, ranks, backend=f"simulated, {ranks} ranks", job_name="cell In[7]", clock=clock)
    state = run.state
    slow, failed, silent = ranks // 3, ranks - 1, (ranks // 2 if ranks >= 8 else None)
    for r in range(ranks):
        feed(state, events.Started(rank=r, host=f"gpu-node-{r // per_host:03d}", pid=1000 + r))
    seconds = stragglers.SLOW_FOR + stragglers.RATE_WINDOW + 4
    ticks = int(seconds / 0.5)
    for tick in range(1, ticks + 1):
        clock.now += 0.5
        for r in range(ranks):
            if r == silent and tick > ticks // 3:
                continue
            pace = 2.0 if r == slow else 10.0 + (r % 7) * 0.3
            n = int(pace * 0.5 * tick)
            before = int(pace * 0.5 * (tick - 1)) // 50
            if n // 50 != before:  # the last epoch's batch bar ends, as progress() says when its loop ends
                feed(
                    state,
                    events.Progress(
                        rank=r,
                        bar=f"batch#{1 + before}",
                        desc="batch",
                        n=50,
                        total=50,
                        elapsed=0.5 * tick,
                        state="done",
                    ),
                )
            feed(
                state,
                events.Progress(rank=r, bar="epoch#0", desc="epoch", n=n // 50, total=4, elapsed=0.5 * tick),
                events.Progress(
                    rank=r, bar=f"batch#{1 + n // 50}", desc="batch", n=n % 50, total=50, elapsed=(n % 50) / pace
                ),
            )
    for r in range(ranks):
        for step in range(steps):
            noise = ((r * 7919 + step * 104729) % 1000) / 1000
            feed(
                state,
                events.Metrics.point(
                    rank=r,
                    step=step,
                    values={
                        "loss": 2.0 / (1 + step / 10) + 0.3 * noise + (0.5 if r == slow else 0.0),
                        "accuracy": min(0.99, step / steps + 0.05 * noise),
                        "lr": 0.1 * 0.99**step,
                    },
                ),
            )
        for i in range(lines):
            stream = "stderr" if i % 10 == 9 else "stdout"
            text = (
                f"UserWarning: rank {r} step {i}: grad norm clipped"
                if i % 10 == 4
                else f"rank {r} epoch {i // 10} batch {i}: loss {1 / (i + 1):.4f}"
            )
            feed(state, events.Log(rank=r, stream=stream, line=text))
    traceback = (
        "Traceback (most recent call last):\n  File \"<cell In[7]>\", line 12, in <module>\n"
        "    loss = model(batch)\nRuntimeError: CUDA error: an illegal memory access was encountered\n"
    )
    feed(
        state,
        events.Exit(
            rank=failed,
            code=1,
            time=time.time(),
            failure=events.Failure(
                exc_type="RuntimeError",
                message="CUDA error: an illegal memory access was encountered",
                traceback=traceback,
            ),
        ),
    )
    return run, clock
