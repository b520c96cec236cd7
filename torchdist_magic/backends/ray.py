"""The backend named ``ray``: each rank's launcher a Ray actor of one placement group.

The run goes to the Ray cluster this process is connected to (``ray.init`` called already, in
the notebook), else to the one the backend option ``address`` or ``RAY_ADDRESS`` names (this
process then connects to it, and stays connected); it never starts a Ray of its own, which would
silently take this machine instead of the cluster.

Placement.  One placement group per attempt holds one bundle per rank (``num_cpus`` CPUs, and
with ``--gpu`` ``num_gpus`` GPUs), placed by the ``strategy`` option (``PACK`` by default, or
``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``); rank r's actor (``ray_actor.RankLauncher``) runs
in bundle r.  Before anything starts, the bundles are checked against the cluster's alive nodes
(what each node holds in all, by strategy), so a run the cluster can never place is refused at
once naming what is missing; a group that the cluster could place but does not within
``RAY_PLACEMENT_WAIT`` (other runs or actors hold the resources) is removed and the run fails
saying what is free, instead of waiting forever.  Each actor names its Ray node, from which every
rank gets torchrun's ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``; rank 0's node
address is ``MASTER_ADDR``; its GPUs are those Ray assigned the actor.

What travels where.  The spec (the job, the run's secrets) goes through Ray's object store, once,
as the actors' argument; the ranks' records and values come back over the run's event channel
(TLS-encrypted by default: the channel listens on this node's address, not the loopback), which
the actors reach like any remote launcher (``launch.remote``).  An actor's outcome (its rank's
exit, and its value and last lines where the channel was lost) is its call's return value.

Stopping.  The launchers are told to stop over the channel; then every actor of the attempt is
killed (``ray.kill``: its launcher's guard then ends the rank's worker) and the placement group
removed, whether the run succeeded, failed, timed out or was cancelled.  An actor that died
without its rank's exit reaching the driver (its node lost, killed from outside) is reported as
that rank's failure with Ray's reason.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import time
from typing import Any, Dict, List, Optional, Set, Collection

from ..core import events
from ..core.names import VALUES_FETCH_ENV
from ..core.options import LaunchOptions
from ..core.rankenv import uses_relay
from ..core.timing import CLOSE_GRACE, RAY_CONNECT_WAIT, RAY_KILL_WAIT, RAY_PLACEMENT_WAIT, SPARK_STAGE_END_WAIT
from ..core.values import map_value
from ..launch.remote import RemoteSpec, marked_value_directory
from .base import Backend, BackendRun, LaunchContext, LaunchPlan
from .rendezvous import DriverRendezvous

log = logging.getLogger("torchdist_magic")

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

NO_RAY = (
    "backend 'ray' runs the ranks as Ray actors, and ray is not installed in this environment. "
    'Install torchdist_magic with its Ray extra:\n    pip install "torchdist_magic[ray]"\n'
    "(the same Ray version as the cluster's), or run on local processes (--local, local_mode=True)"
)
NO_CLUSTER = (
    "backend 'ray' runs on the Ray cluster this process is connected to, and it is connected to "
    "none. Connect first, e.g.:\n"
    "    import ray\n"
    '    ray.init(address="auto")          # or the cluster\'s HOST:PORT\n'
    "or give the cluster's address as --backend-option address=HOST:PORT (backend_options="
    '{"address": ...}) or in RAY_ADDRESS'
)


def connect(address: Optional[str]):
    """The ``ray`` module, connected to the cluster: the one this process is connected to, else
    ``address`` (the backend option), else ``RAY_ADDRESS``; ``ValueError`` without any."""
    try:
        import ray
    except ImportError:
        raise ValueError(NO_RAY) from None
    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError(NO_CLUSTER)
    unreachable = _unreachable(address)
    if unreachable:  # ray.init would retry for minutes
        raise ValueError(f"backend 'ray' could not connect to the Ray cluster at {address!r}: {unreachable}")
    try:
        # the ranks' output comes over the run's channel: Ray's copy of it would be printed twice
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ValueError(f"backend 'ray' could not connect to the Ray cluster at {address!r}: {exc}") from None
    return ray


def _unreachable(address: str) -> str:
    """Why nothing answers at a ``HOST:PORT`` address (``""``: something listens there, or the
    address is another form, ``auto`` or ``ray://...``, which ``ray.init`` resolves itself)."""
    import socket

    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return ""
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_WAIT).close()
    except OSError as exc:
        return f"nothing answers there ({type(exc).__name__}: {exc.strerror or exc})"
    return ""


def bundle_fits(resources: Dict[str, float], bundle: Dict[str, float]) -> int:
    """How many ``bundle``s a node of ``resources`` holds in all."""
    return min(int(math.floor(resources.get(k, 0.0) / v + 1e-9)) for k, v in bundle.items() if v > 0)


def placeable(nodes: List[Dict[str, float]], bundle: Dict[str, float], strategy: str) -> int:
    """How many ``bundle``s the alive ``nodes`` (each its resources) can place at once by ``strategy``."""
    fits = [bundle_fits(node, bundle) for node in nodes]
    if strategy == "STRICT_SPREAD":  # one bundle per node
        return sum(1 for f in fits if f > 0)
    if strategy == "STRICT_PACK":  # every bundle on one node
        return max(fits, default=0)
    return sum(fits)


def describe_bundle(bundle: Dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in bundle.items() if v > 0)


class RayBackend(Backend):
    """Ranks as Ray actors of one placement group on the connected Ray cluster."""

    name = "ray"
    #: each machine fetches a job's large notebook values once from the driver's channel
    fetches_values = True
    option_help = {
        "address": "the Ray cluster to connect to when this process is not connected yet (ray.init's "
        "address: HOST:PORT, auto, ray://...; default RAY_ADDRESS)",
        "num_cpus": "CPUs each rank's actor takes (default 1)",
        "num_gpus": "GPUs each rank's actor takes with --gpu (default 1)",
        "strategy": "how the ranks' bundles are placed on the nodes: PACK (default), SPREAD, STRICT_PACK or STRICT_SPREAD",
    }

    def __init__(self):
        self.settings: Dict[str, str] = {}
        self.num_cpus = 1.0
        self.num_gpus: Optional[float] = None
        self.strategy = "PACK"
        #: the Ray node ids a restart leaves out (each bundle's label selector refuses them)
        self.left_out: List[str] = []
        #: the last attempt's Ray node id of each rank (its bundle's node)
        self.rank_nodes: Dict[int, str] = {}

    def configure(self, options: Dict[str, str]) -> None:
        super().configure(options)
        for key in ("num_cpus", "num_gpus"):
            if key in options:
                try:
                    amount = float(options[key])
                except ValueError:
                    amount = -1.0
                if not math.isfinite(amount) or amount < 0 or (key == "num_cpus" and amount == 0):
                    raise ValueError(
                        f"backend option {key} must be a number of "
                        f"{'CPUs above 0' if key == 'num_cpus' else 'GPUs, 0 or more'}, got {options[key]!r}"
                    )
                setattr(self, key, amount)
        strategy = options.get("strategy", "PACK").upper()
        if strategy not in STRATEGIES:
            raise ValueError(
                f"backend option strategy must be one of {', '.join(STRATEGIES)}, got {options['strategy']!r}"
            )
        self.strategy = strategy
        self.settings = dict(options)

    def _ray(self):
        return connect(self.settings.get("address"))

    def describe(self) -> str:
        ray = self._ray()
        alive = [n for n in ray.nodes() if n.get("Alive")]
        return f"Ray actors ({self.strategy}) on a Ray cluster of {len(alive)} nodes"

    def channel_host(self) -> str:
        """This process's address as its Ray node knows it: the one the actors' nodes reach."""
        return self._ray().util.get_node_ip_address()

    def bundle(self, use_gpu: bool) -> Dict[str, float]:
        gpus = (1.0 if self.num_gpus is None else self.num_gpus) if use_gpu else (self.num_gpus or 0.0)
        return {"CPU": self.num_cpus, "GPU": gpus} if gpus else {"CPU": self.num_cpus}

    def check(self, options: LaunchOptions) -> LaunchPlan:
        self._ray()  # connected, or ValueError naming why not
        n = options.num_processes
        if options.use_gpu and self.num_gpus == 0:
            raise ValueError("use_gpu/--gpu needs GPUs for the ranks, and the backend option num_gpus is 0")
        bundle = self.bundle(options.use_gpu)
        alive = [node["Resources"] for node in self._alive()]  # a node left out is none of them
        fit = placeable(alive, bundle, self.strategy)
        if fit < n:
            totals = {k: sum(node.get(k, 0.0) for node in alive) for k in bundle}
            held = ", ".join(f"{v:g} {k}" for k, v in totals.items())
            how = {
                "STRICT_SPREAD": "each on a node of its own (strategy STRICT_SPREAD)",
                "STRICT_PACK": "all on one node (strategy STRICT_PACK)",
            }.get(self.strategy, f"(strategy {self.strategy})")
            raise ValueError(
                f"{n} ranks need {n} Ray bundles of {describe_bundle(bundle)} {how}, but this Ray "
                f"cluster can place {fit}: its {len(alive)} alive nodes hold {held} in all; use {fit} "
                "or fewer ranks, smaller bundles (backend options num_cpus, num_gpus), or add nodes"
            )
        return LaunchPlan(n, tls=self.channel_tls(options), host_relay=uses_relay(n))

    def _alive(self) -> List[dict]:
        return [node for node in self._ray().nodes() if node.get("Alive") and node["NodeID"] not in self.left_out]

    def placeable(self) -> int:
        """The bundles the alive nodes not left out can place now."""
        return placeable([node["Resources"] for node in self._alive()], self.bundle(False), self.strategy)

    def exclude(self, exclusion) -> bool:
        """Leave out the Ray node the failing rank's bundle was on: the next placement group's
        bundles refuse its node id (a label selector on ``ray.io/node-id``)."""
        node = self.rank_nodes.get(exclusion.rank)
        if node is None:
            return False
        if node not in self.left_out:
            self.left_out.append(node)
        return True

    def readmit(self, exclusion) -> bool:
        node = self.rank_nodes.get(exclusion.rank)
        if node is None or node not in self.left_out:
            return False
        self.left_out.remove(node)
        return True

    def label_selector(self) -> Optional[Dict[str, str]]:
        """Each bundle's label selector: not on a node left out (``None``: any node)."""
        return {"ray.io/node-id": f"!in({', '.join(self.left_out)})"} if self.left_out else None

    def start(self, ctx: LaunchContext) -> "RayRun":
        run = RayRun(self, ctx)
        try:
            run.launch()
        except BaseException:
            run.close()
            raise
        return run


class RayRun(BackendRun):
    """One attempt: its placement group, one actor per rank, and the thread that waits for
    their outcomes."""

    def __init__(self, backend: RayBackend, ctx: LaunchContext):
        self._backend = backend
        self._ctx = ctx
        self._n = ctx.spec.num_processes
        self._ray = backend._ray()
        self._group = None
        self._actors: List[Any] = []
        self._calls: Dict[int, Any] = {}  # rank -> the ObjectRef of its actor's ``run``
        self._spec_ref = None
        self._spec: Optional[RemoteSpec] = None
        self._value_dir = ""
        self._values: Dict[int, bytes] = {}  # values that came back with an outcome
        self._value_files: Dict[int, str] = {}
        self._reported: Set[int] = set()  # ranks whose Exit reached the driver
        self._lock = threading.Lock()
        self._stopping = False
        self._closed = False
        self._watcher: Optional[threading.Thread] = None
        self._rendezvous = DriverRendezvous(ctx, self._n)
        ctx.routes[events.Exit] = self._on_exit

    @property
    def group_name(self) -> str:
        return f"torchdist-{self._ctx.spec.run_id}-attempt{self._ctx.spec.attempt}"

    def launch(self) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .ray_actor import RankLauncher

        ray, ctx, backend = self._ray, self._ctx, self._backend
        self._value_dir = marked_value_directory(ctx.spec)
        self._spec = RemoteSpec(
            run=ctx.spec,
            job_bytes=ctx.job_bytes,
            value_dir=self._value_dir,
            values_sent=os.environ.get(VALUES_FETCH_ENV) == "1",
        )
        ctx.receive_values(
            {rank: self._spec.value_path(rank) for rank in range(self._n) if ctx.spec.returns_value(rank)}
        )
        bundle = backend.bundle(ctx.spec.use_gpu)
        selector = backend.label_selector()
        self._group = placement_group(
            [dict(bundle)] * self._n,
            strategy=backend.strategy,
            name=self.group_name,
            bundle_label_selector=[dict(selector)] * self._n if selector else None,
        )
        ready, _ = ray.wait([self._group.ready()], timeout=RAY_PLACEMENT_WAIT)
        if not ready:
            free = {k: v for k, v in ray.available_resources().items() if k in bundle}
            raise ValueError(
                f"the Ray cluster did not place the run's {self._n} bundles of {describe_bundle(bundle)} "
                f"(strategy {backend.strategy}) within {RAY_PLACEMENT_WAIT:g} s: it has "
                f"{', '.join(f'{free.get(k, 0):g} {k}' for k in bundle)} free now (other runs or actors "
                "hold the rest); use fewer ranks, or run when they are free"
            )
        placed = ray.util.placement_group_table(self._group).get("bundles_to_node_id", {})
        backend.rank_nodes = {int(bundle): node for bundle, node in placed.items()}  # rank r is in bundle r
        self._spec_ref = ray.put(self._spec)  # once, in the object store; each node fetches it
        actor_class = ray.remote(RankLauncher)
        for rank in range(self._n):
            actor = actor_class.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=rank
                ),
            ).remote()
            self._actors.append(actor)
            self._calls[rank] = actor.run.remote(self._spec_ref, rank)
        self._watcher = threading.Thread(target=self._watch, daemon=True, name=f"torchdist-ray-{ctx.spec.run_id}")
        self._watcher.start()

    def _on_exit(self, record: events.Exit) -> None:
        with self._lock:
            self._reported.add(record.rank)
        self._ctx.emit(record)

    def _watch(self) -> None:
        """Wait for every actor's outcome; report each rank's exit where the channel did not."""
        pending = {ref: rank for rank, ref in self._calls.items()}
        while pending:
            done, _ = self._ray.wait(list(pending), num_returns=1)
            for ref in done:
                self._finished(pending.pop(ref), ref)

    def _finished(self, rank: int, ref) -> None:
        try:
            outcome = self._ray.get(ref)
        except Exception as exc:  # the actor died (killed, its node lost) or could not start  # noqa: BLE001
            with self._lock:
                if rank in self._reported:
                    return
                self._reported.add(rank)
                stopping = self._stopping
            now = time.time()
            if stopping:  # killed by this run's stop
                self._ctx.emit(events.Exit(rank=rank, code=None, time=now, stopped=True))
                return
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            failure = events.Failure.from_exit(rank, None, time=now).for_rank(
                rank,
                exc_type="LauncherLost",
                message=f"the Ray actor of rank {rank} ended without reporting its rank's exit: "
                f"{type(exc).__name__}: {reason}",
            )
            self._ctx.emit(events.Exit(rank=rank, code=1, time=now, failure=failure))
            return
        if outcome.channel_lost:
            for line in outcome.log_tail:
                self._ctx.emit(events.Log(rank=rank, stream="stderr", line=line))
        if outcome.value is not None:
            self._values[rank] = bytes(outcome.value)
        if outcome.value_file:
            self._value_files[rank] = outcome.value_file
        with self._lock:
            if rank in self._reported:
                return
            self._reported.add(rank)
        self._ctx.emit(events.decode(outcome.exit_json))

    def stop(self, grace: float) -> None:
        """Tell every launcher to stop its rank and wait for them until the grace has passed;
        then kill the actors and remove the placement group."""
        with self._lock:
            self._stopping = True
        stop = events.Stop(rank=-1, grace=grace)
        deadline = time.monotonic() + max(grace, 0.0) + SPARK_STAGE_END_WAIT
        while self._watcher is not None and self._watcher.is_alive() and time.monotonic() < deadline:
            self._ctx.to_ranks(stop)  # again while waiting: a launcher that connects late gets it too
            self._watcher.join(0.2)
        self._end()

    def stop_ranks(self, ranks: Collection[int], grace: float) -> Set[int]:
        return {r for r in ranks if self._ctx.to_rank(r, events.Stop(rank=r, grace=grace))}

    def dump_stacks(self) -> None:
        self._ctx.to_ranks(events.DumpStacks(rank=-1))

    def result(self, rank: int) -> Optional[bytes]:
        if self._watcher is not None:
            self._watcher.join()
        if rank in self._values:
            return self._values[rank]
        path = self._value_files.get(rank) or (self._spec.value_path(rank) if self._spec is not None else "")
        return map_value(path, self._value_dir) if path and os.path.exists(path) else None

    def ranks_alive(self) -> bool:
        return self._watcher is not None and self._watcher.is_alive() and not self._stopping

    def where(self) -> str:
        return f"Ray placement group {self.group_name}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None and self._watcher.is_alive():
            self.stop(CLOSE_GRACE)
        self._end()
        self._rendezvous.close()
        if self._value_dir:
            shutil.rmtree(self._value_dir, ignore_errors=True)

    def _end(self) -> None:
        """Kill every actor of the attempt, wait until Ray says each is gone, remove the
        placement group; idempotent."""
        with self._lock:
            self._stopping = True
        ray = self._ray
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # the cluster is gone, and the actor with it  # noqa: BLE001
                log.info("run %s: could not kill a Ray actor (%s: %s)", self._ctx.spec.run_id, type(exc).__name__, exc)
        if self._watcher is not None:
            self._watcher.join(RAY_KILL_WAIT)  # each killed actor's call ends with its death
            if self._watcher.is_alive():
                log.warning("run %s: Ray actors still there %g s after ray.kill", self._ctx.spec.run_id, RAY_KILL_WAIT)
        self._actors = []
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._group)
            except Exception as exc:  # noqa: BLE001
                log.info(
                    "run %s: could not remove placement group %s (%s)", self._ctx.spec.run_id, self.group_name, exc
                )
            self._group = None
        self._spec_ref = None
