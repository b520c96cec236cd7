"""What each rank is told, derived in one place.

``RunSpec`` is ``LaunchOptions`` resolved once for one run (with the run's id and channel);
``place_ranks`` (local processes: torchrun's placement) and ``place_spark_tasks`` (Spark: each
task a node of one process, as under TorchDistributor) turn the host of every rank into the
placement variables; and
``rank_environment`` is the one function that builds a rank's environment from both.  Backends
call it; nothing else writes a rank's environment, and the worker reads its settings from that
environment only (``TORCHDIST_USE_GPU``, ``TORCHDIST_RETURN_VALUE``; the runtime's
``restart_count()`` and checkpoints read ``TORCHDIST_RESTART_COUNT``, ``TORCHDIST_CHECKPOINT_DIR``
and ``TORCHDIST_KEEP_CHECKPOINTS``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from .options import LaunchOptions, masked_repr
from .names import ENV_BEFORE
from .names import (
    CHANNEL_CERT_ENV,
    CHANNEL_ENV,
    CHECKPOINT_DIR_ENV,
    DATA_FILE_ENV,
    HOST_RANKS_ENV,
    KEEP_CHECKPOINTS_ENV,
    MAX_RESTARTS_ENV,
    PREFLIGHT_ENV,
    TRACE_COLLECTIVES_ENV,
    PRIVATE_TOKEN_ENV,
    PROFILE_STEPS_ENV,
    RESTART_COUNT_ENV,
    RETURN_VALUE_ENV,
    RUN_ID_ENV,
    SECRET_ENV,
    SYSTEM_METRICS_ENV,
    USE_GPU_ENV,
)

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_key(secret: str, role: str, rank: int) -> str:
    """What ``role`` (``"worker"``, ``"launcher"``) of ``rank`` authenticates with on the run's
    channel, derived from the run's secret of that role: a rank's worker is given only its own
    key, so it cannot speak as another rank (``wire.handshake``)."""
    return hmac.new(secret.encode(), f"torchdist {role} {rank}".encode(), hashlib.sha256).hexdigest()


def private_token(secret: str, run_id: str) -> str:
    """The name the ranks of run ``run_id`` give the private directory they meet in where another
    user made this user's usual one first (``PRIVATE_TOKEN_ENV``): derived from the run's secret,
    the same for each rank, and one no other user can make first."""
    return hmac.new(secret.encode(), f"torchdist private directory {run_id}".encode(), hashlib.sha256).hexdigest()[:24]


#: ``auto`` (the default): a relay per machine for runs of ``RELAY_FROM`` ranks or more;
#: ``1``: for every run of launchers (Spark, Slurm, Ray); ``0``: never
RELAY_ENV = "TORCHDIST_HOST_RELAY"
#: from this many ranks an ``auto`` run's launchers use host relays
RELAY_FROM = 64


def uses_relay(num_processes: int, environ: Optional[dict] = None) -> bool:
    """Whether a run of ``num_processes`` ranks reaches its driver through host relays
    (``RELAY_ENV``); ``ValueError`` for a value it does not know."""
    text = (os.environ if environ is None else environ).get(RELAY_ENV, "auto").strip().lower()
    if text not in ("auto", "1", "0"):
        raise ValueError(
            f"{RELAY_ENV} is auto (a relay per machine from {RELAY_FROM} ranks), 1 (always) or 0 (never), not {text!r}"
        )
    return text == "1" or (text == "auto" and num_processes >= RELAY_FROM)


@dataclass(frozen=True)
class RunSpec:
    """One run's settings as every backend needs them (``LaunchOptions`` resolved once)."""

    run_id: str
    num_processes: int
    use_gpu: bool
    all_ranks: bool
    env: Dict[str, str]
    timeout: Optional[float]
    channel_address: str = ""  # host:port of the driver's event channel
    # the run's secrets, of which a worker's and a launcher's keys are derived (``rank_key``);
    # out of the repr, which a log or a traceback may show
    secret: str = field(default="", repr=False)
    launcher_secret: str = field(default="", repr=False)
    #: the PEM certificate of the channel's TLS, which every rank and launcher pins ("": the
    #: channel is not encrypted); public, unlike the key, which stays on the driver
    channel_cert: str = ""
    attempt: int = 0  # 0 for the first start of the job, n for its n-th restart
    max_restarts: int = 0
    checkpoint_dir: str = ""  # resolved: the user's, or the run's own directory
    keep_checkpoints: int = 3
    #: rank r's Arrow file of the run's DataFrame (local processes; a Spark task writes its own)
    data_files: Tuple[str, ...] = ()
    #: a warm run on some ranks of its pool (``LaunchOptions.ranks``); () for every rank
    ranks: Tuple[int, ...] = ()
    #: each rank's launcher samples its CPU, memory and GPUs (``sysmetrics``)
    system_metrics: bool = True
    #: steps of each rank's innermost progress() loop to profile (``rankprofile``); 0: none
    profile: int = 0
    #: the name of the notebook values' file that each machine fetches once from the driver's
    #: channel before its ranks start (``hostcopy``), and its size in bytes; "" when the job
    #: holds them or names a file on the driver's machine
    values_fetch: str = ""
    values_fetch_size: int = 0
    #: every rank runs the pre-flight check before its job (``preflight``)
    preflight: bool = False
    #: every rank keeps torch's Flight Recorder (``--trace-collectives``: ``collectives``)
    trace_collectives: bool = False
    #: the run's launchers reach the driver through one relay per machine (``launch.hostrelay``)
    host_relay: bool = False

    @classmethod
    def resolve(
        cls,
        options: LaunchOptions,
        run_id: str,
        channel_address: str = "",
        secret: str = "",
        launcher_secret: str = "",
        attempt: int = 0,
        checkpoint_dir: str = "",
        data_files: Tuple[str, ...] = (),
        channel_cert: str = "",
    ) -> "RunSpec":
        """``options`` for attempt ``attempt`` of run ``run_id``; ``checkpoint_dir`` is where
        checkpoints go when ``options`` names no directory."""
        return cls(
            run_id=run_id,
            num_processes=options.num_processes,
            use_gpu=options.use_gpu,
            all_ranks=options.all_ranks,
            env=dict(options.env),
            timeout=options.timeout,
            channel_address=channel_address,
            secret=secret,
            launcher_secret=launcher_secret,
            channel_cert=channel_cert,
            attempt=attempt,
            max_restarts=options.max_restarts,
            checkpoint_dir=options.checkpoint_dir or checkpoint_dir,
            keep_checkpoints=options.keep_checkpoints,
            data_files=tuple(data_files),
            ranks=tuple(options.ranks or ()),
            system_metrics=options.system_metrics,
            preflight=options.preflight,
            profile=options.profile,
            trace_collectives=options.trace_collectives,
        )

    def returns_value(self, rank: int) -> bool:
        """Whether ``rank``'s value comes back to the driver: rank 0's (with ``ranks``, the
        lowest chosen rank's), or every (chosen) rank's with ``all_ranks``."""
        if self.ranks:
            return rank in self.ranks and (self.all_ranks or rank == self.ranks[0])
        return rank == 0 or self.all_ranks

    def __repr__(self) -> str:  # ``env``'s values may be secrets, as its secrets are
        return masked_repr(self)


@dataclass(frozen=True)
class Placement:
    """Where one rank runs, as torchrun describes it."""

    rank: int
    local_rank: int
    local_world_size: int
    group_rank: int  # the index of this rank's host among the run's hosts
    group_world_size: int  # the number of hosts
    master_addr: str
    master_port: int
    cuda_visible_devices: Optional[str] = None
    #: the ranks on this rank's machine, in rank order (``runtime.host_ranks()``): what once-per-host
    #: work and the threads per rank go by, whatever the placement calls a node
    host_ranks: Tuple[int, ...] = ()


def _hosts(hosts: List[str]) -> Tuple[Dict[str, int], Dict[str, List[int]]]:
    """Each host's index, in the order of its first rank, and its ranks in rank order."""
    order: Dict[str, int] = {}
    members: Dict[str, List[int]] = {}
    for rank, host in enumerate(hosts):
        order.setdefault(host, len(order))
        members.setdefault(host, []).append(rank)
    return order, members


def place_ranks(
    hosts: List[str], master_addr: str, master_port: int, gpus: Optional[List[Optional[str]]] = None
) -> List[Placement]:
    """Placements of ranks ``0..len(hosts)-1``, where ``hosts[r]`` identifies rank r's machine.

    Ranks on the same host are numbered locally in rank order; hosts are numbered in the order
    of their first rank, so rank 0's host is group 0.  ``gpus[r]`` is the GPU addresses
    (``"0"``, ``"0,1"``) given to rank r (``None``: leave ``CUDA_VISIBLE_DEVICES`` as it is).
    When every rank of a host has exactly one GPU, each of them sees the host's GPUs in local
    rank order, so that ``cuda:LOCAL_RANK`` is its own (as under torchrun); otherwise a rank
    sees its own GPUs only.
    """
    order, members = _hosts(hosts)
    gpus = gpus or [None] * len(hosts)
    out = []
    for rank, host in enumerate(hosts):
        visible = gpus[rank]
        own = [gpus[r] for r in members[host]]
        if visible is not None and all(g is not None and g and "," not in g for g in own):
            visible = ",".join(g for g in own if g)  # each is one GPU (checked above)
        out.append(
            Placement(
                rank=rank,
                local_rank=members[host].index(rank),
                local_world_size=len(members[host]),
                group_rank=order[host],
                group_world_size=len(order),
                master_addr=master_addr,
                master_port=master_port,
                cuda_visible_devices=visible,
                host_ranks=tuple(members[host]),
            )
        )
    return out


def place_spark_tasks(
    hosts: List[str], master_addr: str, master_port: int, use_gpu: bool, gpus: Optional[List[Optional[str]]] = None
) -> List[Placement]:
    """Placements of the ranks of a Spark barrier stage, ``hosts[r]`` rank r's machine: each task
    is a node of one process (``LOCAL_RANK`` 0, ``LOCAL_WORLD_SIZE`` 1, ``GROUP_RANK`` and
    ``NODE_RANK`` its rank, ``GROUP_WORLD_SIZE`` the number of ranks), as TorchDistributor runs
    them, so that code written for it (Lightning's ``devices=1, num_nodes=num_processes``) runs
    unchanged however Spark spreads the tasks over machines.

    GPUs (``gpus[r]``: the addresses Spark gave rank r's task): unlike TorchDistributor, a rank
    sees the GPUs of every rank on its machine, its own first, so that ``cuda:0`` is its own and
    NCCL can still reach its peers' devices directly (peer-to-peer, NVLink), which it cannot
    between processes that do not see each other's GPUs; no address is listed twice.  A run
    without ``use_gpu`` sees no GPU at all (``CUDA_VISIBLE_DEVICES=""``), as under
    TorchDistributor: a CPU job must not allocate on a GPU that Spark gave another task.
    """
    _, members = _hosts(hosts)
    gpus = gpus or [None] * len(hosts)
    out = []
    for rank, host in enumerate(hosts):
        if not use_gpu:
            visible: Optional[str] = ""
        elif gpus[rank] is None:
            visible = None  # Spark gave the task no GPU resource: leave the executor's setting
        else:
            addresses = [a for r in [rank] + members[host] for a in (gpus[r] or "").split(",") if a]
            visible = ",".join(dict.fromkeys(addresses))
        out.append(
            Placement(
                rank=rank,
                local_rank=0,
                local_world_size=1,
                group_rank=rank,
                group_world_size=len(hosts),
                master_addr=master_addr,
                master_port=master_port,
                cuda_visible_devices=visible,
                host_ranks=tuple(members[host]),
            )
        )
    return out


def cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def rank_environment(base: Dict[str, str], spec: RunSpec, place: Placement, data_file: str = "") -> Dict[str, str]:
    """The environment of one rank: the launcher's own, the user's extras, then the run's.
    ``data_file``: the rank's Arrow file of the run's DataFrame when its launcher wrote it (a
    Spark task), else ``spec.data_files``' own."""
    env = _environment(base, spec, place, data_file)
    if spec.env:
        without = _environment(base, replace(spec, env={}), place, data_file)
        env[ENV_BEFORE] = json.dumps(
            {name: without.get(name) for name in sorted(spec.env) if env.get(name) != without.get(name)}
        )
    return env


def _environment(base: Dict[str, str], spec: RunSpec, place: Placement, data_file: str) -> Dict[str, str]:
    env = dict(base)
    if place.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = place.cuda_visible_devices
    env.update(spec.env)
    if "OMP_NUM_THREADS" not in spec.env and "OMP_NUM_THREADS" not in base:
        sharing = len(place.host_ranks) or place.local_world_size  # the ranks on this machine
        env["OMP_NUM_THREADS"] = str(max(1, cores_available() // max(sharing, 1)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _PACKAGE_PARENT not in paths:
        env["PYTHONPATH"] = os.pathsep.join(paths + [_PACKAGE_PARENT])
    env.update(_run_variables(spec, place))
    data_file = data_file or (spec.data_files[place.rank] if spec.data_files else "")
    if data_file:
        env[DATA_FILE_ENV] = data_file  # what torchdist_magic.shard() reads
    else:
        env.pop(DATA_FILE_ENV, None)
    return env


def job_environment(spec: RunSpec) -> Dict[str, str]:
    """What a warm job's ``env`` may set in a live rank: ``spec.env`` less the run's own
    variables (``RANK``, ``MASTER_ADDR``, ``TORCHDIST_*``...), which no ``env`` overrides, as in
    ``rank_environment``."""
    owned = set(_run_variables(spec, Placement(0, 0, 1, 0, 1, "", 0))) | {DATA_FILE_ENV}
    return {name: value for name, value in spec.env.items() if name not in owned}


def _run_variables(spec: RunSpec, place: Placement) -> Dict[str, str]:
    """The variables of a rank that the run sets and no ``env`` of the user's changes."""
    return {
        "RANK": str(place.rank),
        "WORLD_SIZE": str(spec.num_processes),
        "LOCAL_RANK": str(place.local_rank),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "GROUP_RANK": str(place.group_rank),
        "NODE_RANK": str(place.group_rank),
        "GROUP_WORLD_SIZE": str(place.group_world_size),
        "ROLE_RANK": str(place.rank),
        "ROLE_WORLD_SIZE": str(spec.num_processes),
        "MASTER_ADDR": place.master_addr,
        "MASTER_PORT": str(place.master_port),
        HOST_RANKS_ENV: ",".join(map(str, place.host_ranks or (place.rank,))),
        RUN_ID_ENV: spec.run_id,
        CHANNEL_ENV: spec.channel_address,
        # its own key only (a warm job's variables are named from rank 0's placement: names only)
        SECRET_ENV: rank_key(spec.secret, "worker", place.rank) if spec.secret else "",
        PRIVATE_TOKEN_ENV: private_token(spec.secret, spec.run_id) if spec.secret else "",
        CHANNEL_CERT_ENV: spec.channel_cert,
        USE_GPU_ENV: "1" if spec.use_gpu else "0",
        SYSTEM_METRICS_ENV: "1" if spec.system_metrics else "0",
        PROFILE_STEPS_ENV: str(spec.profile),
        PREFLIGHT_ENV: "1" if spec.preflight else "0",
        TRACE_COLLECTIVES_ENV: "1" if spec.trace_collectives else "0",
        RETURN_VALUE_ENV: "1" if spec.returns_value(place.rank) else "0",
        # torchrun's names too, so that code written for torchelastic sees the attempt
        RESTART_COUNT_ENV: str(spec.attempt),
        "TORCHELASTIC_RESTART_COUNT": str(spec.attempt),
        MAX_RESTARTS_ENV: str(spec.max_restarts),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        CHECKPOINT_DIR_ENV: spec.checkpoint_dir,
        KEEP_CHECKPOINTS_ENV: str(spec.keep_checkpoints),
    }
