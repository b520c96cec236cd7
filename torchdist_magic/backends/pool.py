"""Warm pools: ranks that stay up from run to run (``--warm``, ``warm=True``).

A pool is started by the first warm run of its placement (number of ranks, backend and its
session, GPUs) the way a cold run starts its ranks (the same backend: local processes or one
Spark barrier stage), except that each rank runs ``job.serve_job()``: it sets up the process
group once and then runs the jobs the driver sends it over the pool's event channel
(``events.RunJob``), keeping one namespace for cells.  Each warm run is a ``distributor.Run``
whose backend is the pool (``WarmBackend``): the run's supervision (timeout, hang watchdog,
cancel, the view) is a cold run's, and the pool turns a rank's ``JobDone`` into that run's
``Exit`` for the rank once the rank's output for the job has all been read (``OutputEnd``).

Some ranks (``--ranks``, ``ranks=``).  A warm run may go to some of the pool's ranks only: the
job is sent to those, the others stay in their serving loop (the run's state shows them
``idle``), and the run ends when the chosen ranks are done.  It needs a live pool of its
placement (it never starts one), and must not call collectives (the idle ranks never join).

Failures.  A job that raises on ranks that all finish it (``JobDone``) leaves the pool up: its
ranks and process group are as consistent as after any cell that raised.  Anything else ends
the pool (no process is left): a rank whose process ended, a run cancelled, timed out or hung,
or a rank still in the job ``WARM_SETTLE`` seconds after another rank's job failed (it waits in
a collective its peer never reaches).  The next warm run starts a fresh pool.

One live pool at a time: a warm run with another placement is refused with the live pool's
description and how to stop it (two pools would hold two sets of ranks, and on Spark two
sets of task slots, without the user asking for it).  A pool stops after
``pool_idle_timeout`` seconds without a run, on ``shutdown_pools()`` (``%torchdist_pool stop``,
``%unload_ext``) and when the Python process exits.
"""

from __future__ import annotations

import atexit
import base64
import itertools
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from ..core import events
from . import Backend, BackendRun, LaunchContext, LaunchPlan, make_backend
from .warm import WarmBackend, WarmJobRun
from ..wire.server import ChannelServer
from .channels import open_channel
from ..core.fdlimit import make_room
from ..core.options import LaunchOptions
from ..core.procs import rss_bytes
from ..core.rankenv import RunSpec
from ..core.timing import STOP_GRACE, STOP_WAIT, WARM_SEND_WAIT

#: characters of a job per ``RunJob`` piece (base64): well under the channel's frame limit
JOB_PIECE = 1024 * 1024

_lock = threading.RLock()
_pools: List["Pool"] = []
_ids = itertools.count(1)
#: why the last pool that broke between runs stopped, by placement: the next run's view says it
_broken: Dict[Tuple, str] = {}


@dataclass
class PoolInfo:
    """What ``pools()`` says about one live pool."""

    id: str
    num_processes: int
    use_gpu: bool
    backend: str
    state: str  # new (its first run starting), busy, idle, or stopping (ranks, files going)
    pids: List[int]
    hosts: List[str]
    runs: int  # warm runs it has served
    idle_seconds: float
    idle_timeout: float
    memory_bytes: Optional[int]  # resident memory of its ranks (local pools), else None
    where: str = ""  # where its ranks are when their pids do not say (a Spark job tag)
    run_id: str = ""  # what its ranks carry as TORCHDIST_RUN_ID

    def describe(self) -> str:
        where = self.where or f"pids {', '.join(map(str, self.pids)) or '-'}"
        memory = f", {self.memory_bytes / 2**20:.0f} MiB" if self.memory_bytes else ""
        return (
            f"{self.id}: np={self.num_processes}{' gpu' if self.use_gpu else ''} on {self.backend}, "
            f"{self.state}, {self.runs} run{'s' if self.runs != 1 else ''}, idle {self.idle_seconds:.0f} s "
            f"(stops after {self.idle_timeout:g} s idle), {where}{memory}"
        )


def _placement(options: LaunchOptions, backend: Backend) -> Tuple:
    # what the slots belong to (a SparkSession) by weak reference, not ``id()``: a new session at
    # a dead one's address is another placement (a dead reference equals only itself)
    owner = backend.slot_owner()
    owner = weakref.ref(owner) if owner is not None else None
    return (type(backend).__name__, owner, options.num_processes, options.use_gpu)


class Pool:
    """The driver's side of one warm pool: its ranks (a backend run of ``serve_job``), its
    event channel, and the warm run it is serving (at most one at a time)."""

    def __init__(self, options: LaunchOptions, backend: Backend, plan: LaunchPlan):
        self.id = f"pool-{next(_ids)}"
        self.placement = _placement(options, backend)
        self.backend = backend
        self.plan = plan
        self.options = options
        self.state = "new"  # new, busy (serving a run), idle, stopping, stopped
        self.stop_reason = ""
        self.runs = 0
        self._last_used = time.monotonic()
        self._lock = threading.RLock()
        self._reserved = False
        self._job: Optional["WarmJobRun"] = None
        self._last_emit: Optional[Callable[[events.Event], None]] = None
        self._started: Dict[int, events.Started] = {}
        self._dead = False
        self._channel: Optional[ChannelServer] = None
        self._backend_run: Optional[BackendRun] = None
        self._routes: Dict[type, Callable] = {}
        self._timer: Optional[threading.Timer] = None
        self._stopped = threading.Event()  # set once a stop has released everything
        self.where = ""
        #: what the pool's ranks carry as ``TORCHDIST_RUN_ID``
        self.run_id = f"{self.id}-{uuid.uuid4().hex[:8]}"

    # -- life ----------------------------------------------------------------------------
    def _start(self) -> None:
        from ..core.job import serve_job
        from ..core.values import pickle_for_ranks

        run_id = self.run_id
        make_room(self.options.num_processes, local=self.backend.ranks_share_machine())
        # secrets and a TLS key for the pool's life, which never leave this process
        opened = open_channel(
            self._deliver, run_id, self.backend, self.plan, self.options.num_processes, self._on_refusal
        )
        self._channel = opened.server
        spec = RunSpec.resolve(
            self.options, run_id, opened.address, opened.secret, opened.launcher_secret, channel_cert=opened.certificate
        )
        ctx = LaunchContext(
            self.plan,
            spec,
            pickle_for_ranks(serve_job()),
            self._on_record,
            lambda record: self._channel.broadcast(record, role="launcher"),
            routes=self._routes,
        )
        self._backend_run = self.backend.start(ctx)
        self.where = self._backend_run.where()

    def ranks_alive(self) -> bool:
        run = self._backend_run
        return not self._dead and run is not None and run.ranks_alive()

    # -- what a warm run (``warm.WarmJobRun``) asks of its pool ----------------------------
    @property
    def dead(self) -> bool:
        """A rank's process ended: the pool takes no more runs."""
        return self._dead

    def host_of(self, rank: int) -> str:
        """The host rank ``rank`` started on ("" before it said so)."""
        started = self._started.get(rank)
        return started.host if started is not None else ""

    def dump_stacks(self) -> None:
        """Ask every rank of the pool for its stacks (a warm run's hang report)."""
        run = self._backend_run
        if run is not None:
            run.dump_stacks()

    def dump_collectives(self) -> None:
        """Ask every rank of the pool for its collective records."""
        channel = self._channel
        if channel is not None:
            channel.broadcast(events.DumpCollectives(rank=-1), role="worker")

    @property
    def ending(self) -> bool:
        """Stopping or stopped: it takes no more runs."""
        return self.state in ("stopping", "stopped")

    def stop(self, reason: str, grace: float = STOP_GRACE, wait: bool = True) -> None:
        """Stop the ranks (signal, ``grace``, kill) and release everything (the run directory
        too); idempotent, and a second caller returns once the first one's stop is done (with
        ``wait``; never wait holding ``_lock``: the stop takes it last).  The pool stays in
        ``pools()``, as stopping, until then."""
        if not self._mark_stopping(reason):
            if wait:
                self._stopped.wait(grace + STOP_WAIT)
            return
        self._release_all(grace)

    def _mark_stopping(self, reason: str) -> bool:
        """Take no more runs; True for the first caller, who then releases everything."""
        with self._lock:
            if self.ending:
                return False
            self.state = "stopping"
            self.stop_reason = reason
            if self._timer is not None:
                self._timer.cancel()
            return True

    def _release_all(self, grace: float) -> None:
        """Stop the ranks, close the channel, forget the pool.  Never called holding ``_lock``:
        the ranks' last records (a Spark pool's come on the channel's thread, which ``close``
        joins) may need it."""
        try:
            if self._backend_run is not None:
                self._backend_run.stop(grace)
                self._backend_run.close()
        finally:
            try:
                if self._channel is not None:
                    self._channel.close()
            finally:
                try:
                    self.backend.release()  # what the pool's whole life held (a Slurm allocation)
                finally:
                    self._forget()
                    self._stopped.set()

    def _forget(self) -> None:
        """Stopped, and out of the registry.  Takes ``_lock`` with the pool's own lock not held:
        the lock order is ``_lock`` then ``self._lock`` (``pools()``, ``warm_backend``)."""
        with _lock:
            self.state = "stopped"
            if self in _pools:
                _pools.remove(self)

    def info(self) -> PoolInfo:
        with self._lock:
            ranks = [self._started[r] for r in sorted(self._started)]
            local = self.backend.name == "local"
            idle = 0.0 if self.state == "busy" else time.monotonic() - self._last_used
            return PoolInfo(
                id=self.id,
                num_processes=self.options.num_processes,
                use_gpu=self.options.use_gpu,
                backend=self.backend.describe(),
                state=self.state,
                pids=[s.pid for s in ranks],
                hosts=sorted({s.host for s in ranks}),
                runs=self.runs,
                idle_seconds=idle,
                idle_timeout=self.options.pool_idle_timeout,
                memory_bytes=sum(rss_bytes(s.pid) for s in ranks) if local and ranks else None,
                where=self.where,
                run_id=self.run_id,
            )

    def _idle_check(self) -> None:
        with self._lock:
            if self.state != "idle":
                return
            idle = time.monotonic() - self._last_used
            if idle < self.options.pool_idle_timeout:
                self._arm_timer(self.options.pool_idle_timeout - idle)
                return
        self.stop(f"it had run nothing for {self.options.pool_idle_timeout:g} s (pool_idle_timeout)")

    def _arm_timer(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(max(delay, 0.0), self._idle_check)
        self._timer.daemon = True
        self._timer.start()

    # -- runs ----------------------------------------------------------------------------
    def run_job(self, ctx: LaunchContext, run_id: str) -> "WarmJobRun":
        """Start serving the warm run ``run_id`` (its records go to ``ctx.emit``)."""
        job = WarmJobRun(self, ctx, run_id)
        with self._lock:
            if self.ending:
                raise RuntimeError(f"warm {self.id} was stopped: {self.stop_reason}")
            self._job = job
            fresh = self.state == "new"
            self.state = "busy"
        if fresh:
            self._start()
        else:
            for record in list(self._started.values()):  # the run's view shows the ranks as started
                job.emit(events.Started(rank=record.rank, host=record.host, pid=record.pid, time=time.time()))
        self._send_when_ready()
        return job

    def _send_when_ready(self) -> None:
        with self._lock:
            job = self._job
            if job is None or job.sent or len(self._started) < self.options.num_processes:
                return
            job.sent = True
        threading.Thread(target=self._send, args=(job,), name=f"torchdist-{self.id}-send", daemon=True).start()

    def _send(self, job: "WarmJobRun") -> None:
        """The job to every rank, in ``RunJob`` pieces; waits for room on the channel."""
        text = base64.b64encode(job.job_bytes).decode("ascii")
        pieces = [text[i : i + JOB_PIECE] for i in range(0, len(text), JOB_PIECE)] or [""]
        deadline = time.monotonic() + WARM_SEND_WAIT
        for rank in job.ranks:
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                record = events.RunJob(
                    rank=rank,
                    job_id=job.job_id,
                    data=piece,
                    last=last,
                    env=job.env if last else {},
                    all_ranks=job.returns_value(rank),
                )
                while not self._channel.send(rank, record, role="worker"):
                    if time.monotonic() > deadline or self.ending or self._dead or job.ended:
                        return  # the supervisor sees the rank's exit, or the run's deadline
                    time.sleep(0.005)

    def job_closed(self, job: "WarmJobRun") -> None:
        """``job`` ended: the pool is idle again (its idle timer armed)."""
        with self._lock:
            if self._job is not job:
                return
            self._job = None
            self._last_emit = job.emit
            self.runs += 1
            self._last_used = time.monotonic()
            self._reserved = False
            if self.state == "busy":
                self.state = "idle"
                self._arm_timer(self.options.pool_idle_timeout)

    def release(self) -> None:
        """A reserved run ended without using the pool (cancelled before it started)."""
        with self._lock:
            if self._job is not None or not self._reserved:
                return
            self._reserved = False
            if self.state != "new":
                return
            self.state = "stopping"  # nothing to stop: no run can take it before it is forgotten
        self._forget()
        self._stopped.set()

    # -- records from the ranks ----------------------------------------------------------
    def _deliver(self, record: events.Event) -> None:
        route = self._routes.get(type(record))
        if route is not None:
            route(record)
        else:
            self._on_record(record)

    def _on_refusal(self, kind: str, rank: int, detail: str) -> None:
        job = self._job
        if job is not None:  # between runs the channel's log says it
            job.refused(kind, rank, detail)

    def _on_record(self, record: events.Event) -> None:
        job = self._job
        if isinstance(record, events.Started):
            with self._lock:
                self._started[record.rank] = record
            if job is not None:
                job.emit(record)
            self._send_when_ready()
        elif isinstance(record, (events.JobValue, events.JobDone, events.OutputEnd)):
            if job is not None and record.job_id == job.job_id:
                job.on_record(record)
        elif isinstance(record, events.Exit):  # a rank's process ended: the pool is broken
            self._dead = True
            if job is not None:
                job.rank_exited(record)
            elif self.state == "idle":
                reason = f"rank {record.rank}'s process ended since its last run"
                with _lock:
                    _broken[self.placement] = f"{self.id} stopped: {reason}"
                threading.Thread(target=self.stop, args=(reason,), daemon=True).start()
        else:
            emit = job.emit if job is not None else self._last_emit
            if emit is not None:
                emit(record)


def warm_backend(options: LaunchOptions) -> WarmBackend:
    """The backend of a warm run: the live pool of its placement, a new pool when there is
    none, or when the live pool's ranks died since its last run.  A live pool of another
    placement, or one busy with another run, is a ``ValueError``."""
    backend = make_backend(options)
    placement = _placement(options, backend)
    reason = "its ranks had died since its last run"
    with _lock:
        dead = [
            pool
            for pool in _pools
            if pool.state == "idle"
            and pool.placement == placement
            and not pool.ranks_alive()
            and pool._mark_stopping(reason)
        ]
        for pool in dead:
            _broken[placement] = f"{pool.id} stopped: {reason}"
    for pool in dead:  # outside the registry lock: see Pool._release_all
        pool._release_all(STOP_GRACE)
    with _lock:
        live = [p for p in _pools if not p.ending]
        same = next((p for p in live if p.placement == placement), None)
        if same is None and options.ranks:
            raise ValueError(_no_pool_for_ranks(options, live[0] if live else None, _broken.get(placement, "")))
        if same is None and live:
            other = live[0]
            raise ValueError(
                f"a warm pool with another placement is live: {other.info().describe()}. "
                f"Stop it first (%torchdist_pool stop, or torchdist_magic.shutdown_pools()), or run "
                "without --warm/warm=True"
            )
        if same is not None:
            if same._reserved or same.state == "busy":
                raise ValueError(f"warm {same.id} is running another run; wait for it, or run without --warm/warm=True")
            same._reserved = True
            return WarmBackend(same, fresh=False, ranks=options.ranks or ())
        plan = backend.check(options)
        note = _broken.pop(placement, "")
        pool = Pool(options, backend, plan)
        pool._reserved = True
        _pools.append(pool)
        return WarmBackend(pool, fresh=True, note=note)


def _no_pool_for_ranks(options: LaunchOptions, other: Optional[Pool], broken: str) -> str:
    """Why a run on some ranks (``--ranks``) has no pool to run on."""
    wanted = f"np={options.num_processes}{' gpu' if options.use_gpu else ''}"
    if other is not None:
        found = (
            f"the live one is {other.info().describe()}; give its --np (and --gpu, backend) to run on some of its ranks"
        )
    else:
        found = (
            "none is live" + (f" ({broken})" if broken else "") + "; start one with a --warm cell "
            "on every rank first (or Distributor(..., warm=True).run(...))"
        )
    return (
        f"--ranks needs a warm pool: it runs on some ranks of a live pool with this placement ({wanted}), and {found}"
    )


def check_cold_run(options: LaunchOptions, backend: Backend) -> None:
    """A cold Spark run while a warm pool on the same session holds task slots: a
    ``ValueError`` when too few slots are left (its barrier stage would wait for them forever)."""
    owner = backend.slot_owner()
    if owner is None:
        return
    with _lock:
        holding = [p for p in _pools if not p.ending and p.backend.slot_owner() is owner]
    if not holding:
        return
    held = sum(p.options.num_processes for p in holding)
    total = backend.slots()
    if total - held < options.num_processes:
        raise ValueError(
            f"{options.num_processes} ranks need {options.num_processes} free Spark task slots, but warm "
            f"{holding[0].id} holds {held} of this cluster's {total}; stop it first (%torchdist_pool stop, "
            "or torchdist_magic.shutdown_pools()), or run on it with --warm/warm=True"
        )


def pools() -> List[PoolInfo]:
    """The live warm pools, and those still stopping.

    Example:

    ```python
    from torchdist_magic import pools

    for pool in pools():    # after `%%torchdist --np 4 --warm` cells
        print(pool.describe())
    ```
    """
    with _lock:
        return [p.info() for p in _pools if p.state != "stopped"]


def shutdown_pools() -> List[str]:
    """Stop every warm pool (its ranks, its Spark stage); the ids of those stopped.

    Example:

    ```python
    from torchdist_magic import shutdown_pools

    shutdown_pools()   # e.g. ['pool-1']: its ranks and Spark stage are gone
    ```
    """
    with _lock:
        live = list(_pools)
    for pool in live:
        pool.stop("shutdown_pools()")
    return [p.id for p in live]


atexit.register(shutdown_pools)
