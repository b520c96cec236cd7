"""A warm run as the distributor sees it: its backend (``WarmBackend``: the pool it runs on) and
its backend run (``WarmJobRun``: one job sent to the pool's ranks, their ``JobDone`` turned into
the run's ``Exit`` records once their output for the job is all read).  The pools themselves,
their lifecycle and registry, are ``pool``'s."""

from __future__ import annotations

import base64
import threading
import time
from typing import Dict, List, Optional, Set, Tuple

from ..core import events
from ..core.options import LaunchOptions
from ..core.rankenv import job_environment
from ..core.timing import OUTPUT_END_WAIT, WARM_SETTLE
from .base import Backend, BackendRun, LaunchContext, LaunchPlan


class WarmJobRun(BackendRun):
    """One warm run on ``pool`` (a ``pool.Pool``): what the run's supervisor drives like a cold
    backend run."""

    def __init__(self, pool, ctx: LaunchContext, run_id: str):
        self.pool = pool
        self.emit = ctx.emit
        self.refused = ctx.refused
        self.job_id = f"{run_id}-{ctx.spec.attempt}"
        self.job_bytes = ctx.job_bytes
        spec = ctx.spec
        #: the ranks that run the job (``--ranks``; every rank of the pool by default): the
        #: others stay idle in their serving loop, and the run's state shows them so
        self.ranks = list(spec.ranks) or list(range(pool.options.num_processes))
        self.returns_value = spec.returns_value
        self.env = dict(
            job_environment(spec),
            TORCHDIST_CHECKPOINT_DIR=spec.checkpoint_dir,
            TORCHDIST_KEEP_CHECKPOINTS=str(spec.keep_checkpoints),
            TORCHDIST_RETURN_VALUE="1",
            TORCHDIST_PREFLIGHT="1" if spec.preflight else "0",
        )
        self.sent = False
        self.ended = False
        self._lock = threading.Lock()
        self._values: Dict[int, List[str]] = {}
        self._done: Dict[int, events.JobDone] = {}
        self._output_ended: Dict[int, Set[str]] = {}
        self._exited: Set[int] = set()

    def on_record(self, record: events.Event) -> None:
        with self._lock:
            if isinstance(record, events.JobValue):
                self._values.setdefault(record.rank, []).append(record.data)
                return
            if isinstance(record, events.OutputEnd):
                self._output_ended.setdefault(record.rank, set()).add(record.stream)
            elif isinstance(record, events.JobDone):
                self._done[record.rank] = record
                timer = threading.Timer(OUTPUT_END_WAIT, self._exit, (record.rank, True))
                timer.daemon = True
                timer.start()
        self._exit(record.rank, False)

    def _exit(self, rank: int, late: bool) -> None:
        """The rank's ``Exit`` for this run, once its job is done and its output all read
        (or ``OUTPUT_END_WAIT`` after it was done: a job that closed its stdout, say)."""
        with self._lock:
            done = self._done.get(rank)
            if done is None or rank in self._exited:
                return
            if not late and self._output_ended.get(rank, set()) != {"stdout", "stderr"}:
                return
            self._exited.add(rank)
        host = self.pool.host_of(rank)
        failure = done.failure.for_rank(rank, exit_code=done.code) if done.failure is not None else None
        self.emit(events.Exit(rank=rank, code=done.code, time=done.time, host=host, failure=failure))

    def rank_exited(self, record: events.Exit) -> None:
        with self._lock:
            if record.rank in self._exited:
                return
            self._exited.add(record.rank)
        self.emit(record)

    def stop(self, grace: float) -> None:
        """Leave the pool up when every rank finished the job (one raised); else end it."""
        with self._lock:
            some_done = bool(self._done)
        end = time.monotonic() + (WARM_SETTLE if some_done else 0.0)
        while time.monotonic() < end and len(self._done) < len(self.ranks) and not self.pool.dead:
            time.sleep(0.02)
        if len(self._done) == len(self.ranks) and not self.pool.dead:
            return
        still = [r for r in self.ranks if r not in self._done]
        why = (
            f"rank{'s' if len(still) > 1 else ''} {', '.join(map(str, still))} "
            f"{'were' if len(still) > 1 else 'was'} still in the job"
        )
        if self.pool.dead:
            why = "a rank's process ended"
        message = f"[torchdist] warm {self.pool.id} stopped ({why}); the next warm run starts a fresh pool"
        self.emit(events.Log(rank=0, stream="stderr", line=message))
        self.pool.stop(why, grace)

    def dump_stacks(self) -> None:
        self.pool.dump_stacks()

    def dump_collectives(self) -> None:
        self.pool.dump_collectives()

    def result(self, rank: int) -> Optional[bytes]:
        with self._lock:
            done = self._done.get(rank)
            if done is None or not done.has_value:
                return None
            return base64.b64decode("".join(self._values.get(rank, [])))

    def ranks_alive(self) -> bool:
        return self.pool.ranks_alive()

    def close(self) -> None:
        self.ended = True
        self.pool.job_closed(self)


class WarmBackend(Backend):
    """The backend of a warm run: its ``pool`` (a ``pool.Pool``), started by this run (``fresh``) or
    reused."""

    name = "warm"
    needs_channel = False

    def __init__(self, pool, fresh: bool, note: str = "", ranks: Tuple[int, ...] = ()):
        self.pool = pool
        self.fresh = fresh
        self.note = note
        self.ranks = ranks  # a run on some of its ranks (``--ranks``)

    def describe(self) -> str:
        how = "started for this run" if self.fresh else f"reused, run {self.pool.runs + 1}"
        if self.ranks:
            how += f"; on rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))} only"
        if self.note:
            how += f"; {self.note}"
        return f"warm {self.pool.id} ({how}) of {self.pool.backend.describe()}"

    def channel_host(self) -> str:
        return self.pool.backend.channel_host()

    def ranks_share_machine(self) -> bool:
        return self.pool.backend.ranks_share_machine()

    def slots(self) -> Optional[int]:
        return self.pool.backend.slots()

    def slot_owner(self):
        return self.pool.backend.slot_owner()

    def check(self, options: LaunchOptions) -> LaunchPlan:
        """The pool's plan: its placement was checked when it started.  A run that needs an
        encrypted channel (``channel_tls``) is refused on a pool whose channel is not."""
        if not self.pool.plan.tls and options.tls is not False and self.pool.backend.channel_tls(options):
            raise ValueError(
                f"warm {self.pool.id}'s event channel is not encrypted (it started without "
                "TLS), and this run's must be; stop it first (%torchdist_pool stop, or "
                "torchdist_magic.shutdown_pools()), or run without --warm/warm=True"
            )
        return self.pool.plan

    def start(self, ctx: LaunchContext) -> WarmJobRun:
        try:
            return self.pool.run_job(ctx, ctx.spec.run_id)
        except BaseException:
            self.pool.stop("it could not start")
            raise

    def release(self) -> None:
        self.pool.release()
