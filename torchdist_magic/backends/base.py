"""What every backend is: the interface the distributor and the warm pools drive.

A run goes ``backend.check(options)`` -> ``LaunchPlan`` (everything the backend resolved before
anything starts: refused placements raise here), then ``backend.start(LaunchContext(...))`` with
that plan -> a ``BackendRun`` (stop, stacks, results, close).  What a backend needs comes in
through the context (the plan, the run's spec and job, the DataFrame of a data run); what it
offers is on the base class (its slots, whether its ranks share this machine, the DataFrames it
trains on), so nobody sets attributes on a backend from outside or asks it with ``getattr``.

What a backend supplies, and what it gets:

- **where ranks start**: ``start`` starts one launcher per rank.  The launcher is the same
  everywhere (``launch.launcher.RankProcess`` under ``launch.remote``'s task): it starts the
  rank's worker, forwards its output, samples its system metrics, reports its ``Exit`` from
  what the operating system says, answers ``DumpStacks`` with ``Stacks`` and obeys ``Stop``.
  The local backend runs launchers as threads of the driver; any other backend starts
  ``python -m torchdist_magic.launch.remote SPEC RANK`` (``launch.remote.launcher_command``)
  however its machines start programs (a Spark task calls the same code in the executor).
- **how a launcher reaches the driver**: over the run's event channel, at
  ``RunSpec.channel_address`` (``channel_host`` is the address the driver listens on, reachable
  from the ranks), as role ``launcher`` with the key ``rankenv.rank_key(launcher_secret,
  "launcher", rank)``; the ranks meet there (``rendezvous.DriverRendezvous``: each launcher
  sends ``Joined``, the driver answers ``Peers``), and a rank's value comes back through the
  channel into the driver's value directory (``LaunchContext.receive_values``) unless the
  launcher writes it there itself (``launch.remote.RemoteSpec.value_file``).
- **what it gets back**: every record of the run through ``LaunchContext.emit``; ``Exit`` once
  per rank (a launcher that ended without one is reported by the backend, from its exit code).

``backends.launchers`` is all of that for a backend that starts launchers by a command line: a
new backend (ssh, Slurm, Kubernetes) subclasses it, says how to run a command on its machines,
and is registered by name (``core.registry``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, Optional, Sequence, Set

from ..core import events
from ..core.options import LaunchOptions
from ..core.rankenv import uses_relay
from ..core.rankenv import RunSpec


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class LaunchPlan:
    """What ``Backend.check`` resolved for ``Backend.start``."""

    num_processes: int
    #: whether the run's event channel is TLS-encrypted (``Backend.channel_tls``)
    tls: bool = False
    #: whether the run's launchers reach the driver through one relay per machine
    #: (``launch.hostrelay``: ``TORCHDIST_HOST_RELAY``); a backend whose ranks' launcher is
    #: the driver itself (local processes) never does
    host_relay: bool = False


@dataclass
class LaunchContext:
    """What a backend needs to start one run."""

    plan: LaunchPlan
    spec: RunSpec
    job_bytes: bytes
    emit: Callable[[events.Event], None]  # feed a record into the run's RunState
    to_ranks: Callable[[events.Event], int]  # send a record to every rank's launcher
    #: the run's DataFrame as this backend's ``prepare_data`` made it, else ``None``
    data: Any = None
    #: where records the backend takes for itself (``events.LAUNCHER_TO_DRIVER``) go, by type;
    #: the backend fills it in ``start``
    routes: Dict[type, Callable[[events.Event], None]] = field(default_factory=dict)
    #: send a record to one rank's launcher: whether it was queued for it (a run without a
    #: channel of its own, a warm pool's: never)
    to_rank: Callable[[int, events.Event], bool] = lambda rank, record: False
    #: where the run's channel writes the values that ranks' launchers send over it
    #: (``{rank: path}``, ``ChannelServer.receive_values``); nowhere for a run without a channel
    #: of its own
    receive_values: Callable[[Dict[int, str]], None] = lambda paths: None
    #: where a channel that serves this run counts what it refused (``RunState.refused``): a
    #: warm pool's channel, which outlives its runs, reports to the run it serves
    refused: Callable[[str, int, str], None] = lambda kind, rank, detail: None


class BackendRun(abc.ABC):
    """A started run.  ``Exit`` records (one per rank) arrive through ``LaunchContext.emit``."""

    @abc.abstractmethod
    def stop(self, grace: float) -> None:
        """Stop every rank still running: signal, wait until ``grace`` seconds, then kill."""

    def stop_ranks(self, ranks: Collection[int], grace: float) -> Set[int]:
        """Stop the ranks ``ranks`` (signal, ``grace``, kill) while the others go on (a rank held
        for a debugger under ``--pdb``); their ``Exit`` records say they were stopped.  The ranks
        reached; a backend that cannot stop one rank alone (a warm pool) reaches none."""
        return set()

    def dump_stacks(self) -> None:  # noqa: B027
        """Ask every running rank for its threads' stacks; each answers with an
        ``events.Stacks`` record through ``LaunchContext.emit`` (a backend that cannot, none)."""

    def dump_collectives(self) -> None:  # noqa: B027
        """Ask every running rank's worker for its collective record over a channel the backend
        holds itself (a warm pool's); each answers with an ``events.Collectives`` record through
        ``LaunchContext.emit``.  A run with a channel of its own is asked on it by the driver."""

    @abc.abstractmethod
    def result(self, rank: int) -> Optional[bytes]:
        """The pickled value of ``rank`` (after it exited with 0), or ``None`` if it has none."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything the run holds (processes, ports, files, Spark jobs).  Idempotent."""

    def ranks_alive(self) -> bool:
        """Whether every rank's process is still there (a warm pool asks before each job)."""
        return True

    def where(self) -> str:
        """Where the ranks are, for a warm pool's description (a Spark stage: its job tag);
        ``""`` where their pids say it."""
        return ""


class Backend(abc.ABC):
    """Where a run's ranks go."""

    name = "backend"
    #: whether a run on this backend needs an event channel of its own (a warm pool has one)
    needs_channel = True
    #: whether a launcher of this backend's ranks (a Spark task) fetches the job's large values
    #: from the driver's channel, once per machine, where the job names them (``hostcopy``)
    fetches_values = False

    #: the backend's own settings it takes (``--backend-option KEY=VALUE``, ``backend_options=``):
    #: key -> one line of help; ``configure`` refuses any other key
    option_help: Dict[str, str] = {}

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the run header, e.g. ``local processes on host``."""

    def configure(self, options: Dict[str, str]) -> None:
        """Take the run's backend options (``LaunchOptions.backend_options``) before anything
        starts; ``ValueError`` for a key this backend does not know (listing those it knows) or
        a value it cannot use.  A subclass checks the values, after calling this."""
        unknown = sorted(set(options) - set(self.option_help))
        if unknown:
            known = "; ".join(f"{key}: {text}" for key, text in sorted(self.option_help.items()))
            raise ValueError(
                f"backend {self.name!r} has no option {', '.join(map(repr, unknown))}: "
                + (f"its options are {known}" if known else "it takes no backend options")
            )

    def detachable(self) -> bool:
        """Whether a run on this backend can be detached (``--detach``): its supervising process
        re-creates the backend by its name and options (``make_backend``), so a backend whose
        state lives only in this process (a SparkSession object) says how in its own way."""
        return False

    def channel_host(self) -> str:
        """Address the driver's event channel listens on, reachable from the ranks."""
        return "127.0.0.1"

    def slots(self) -> Optional[int]:
        """How many ranks can run at once, or ``None`` when nothing limits it up front."""
        return None

    def placeable(self) -> Optional[int]:
        """How many ranks could be placed now, for a restart that may go on with fewer
        (``--np MIN:MAX``): what is there at this moment, not what is still expected; ``None``
        when nothing limits it."""
        return self.slots()

    def exclude(self, exclusion: Any) -> bool:
        """Leave ``exclusion``'s host (a ``faults.Exclusion``) out of this backend's next starts;
        whether it can (a backend without hosts to choose, local processes, cannot)."""
        return False

    def readmit(self, exclusion: Any) -> bool:
        """Take back ``exclude(exclusion)`` (without that host the next attempt would not fit);
        whether it could (a Spark executor already killed cannot come back)."""
        return False

    def slot_owner(self) -> Any:
        """What this backend's slots belong to, shared by every run on it (a Spark backend: its
        SparkSession), so that a warm pool holding some is seen by the next cold run, and ends
        with it; ``None`` where runs share no slots."""
        return None

    def prepare_data(self, data: Any, num_processes: int, columns: Optional[Sequence[str]]) -> Any:
        """``data``, a DataFrame to train on, checked and made into what ``start`` gives the
        ranks (``LaunchContext.data``), before anything starts; ``TypeError``/``ValueError``
        naming what is wrong.  A backend that trains on none refuses every DataFrame."""
        raise ValueError(
            f"backend {self.name!r} does not train on a DataFrame: run it on local "
            "processes (a pandas DataFrame) or on Spark (a Spark DataFrame)"
        )

    def ranks_share_machine(self) -> bool:
        """Whether every rank surely runs on this machine, and so reads a file the driver
        writes into shared memory (a job's large values, ``values.Buffers``); where it cannot be
        sure, each machine fetches them (``fetches_values``), or they travel inside the job."""
        return False

    def check(self, options: LaunchOptions) -> LaunchPlan:
        """The plan for a run of ``options``; ``ValueError`` before anything starts if the run
        cannot be placed."""
        return LaunchPlan(
            options.num_processes, tls=self.channel_tls(options), host_relay=uses_relay(options.num_processes)
        )

    def channel_tls(self, options: LaunchOptions) -> bool:
        """Whether the run's event channel is encrypted: ``options.tls``, where ``None`` (the
        default) is on whenever the channel listens beyond this machine's loopback
        (``channel_host``): the ranks' records then cross a network.  A backend says otherwise,
        and ``ValueError`` where it cannot honour it."""
        if options.tls is not None:
            return options.tls
        return not is_loopback(self.channel_host())

    @abc.abstractmethod
    def start(self, ctx: LaunchContext) -> BackendRun:
        """Start every rank.  A failed start releases whatever it had opened before raising."""

    def release(self) -> None:  # noqa: B027
        """The run that used this backend has ended (whether or not ``start`` was called)."""
