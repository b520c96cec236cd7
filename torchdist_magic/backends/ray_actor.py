"""What runs inside a Ray actor: one rank's launcher (``launch.remote.run_launcher``).

Each rank of a ``--backend ray`` run is one actor of the run's placement group
(``backends.ray``), and its one call, ``RankLauncher.run``, is the launcher every backend's ranks
run under, with a ``RaySite``: its node is the Ray node it was placed on (several Ray nodes may
share a machine), its address that node's (rank 0's is ``MASTER_ADDR``), its GPUs those Ray
assigned it.  The spec (the job and the run's secrets) comes through Ray's object store as the
call's argument, never through a file system; the rank's records, and its value, go to the
driver over the run's channel, and its outcome comes back as the call's return value, which
carries the rank's exit (and its value and last lines where the channel was lost).

Nothing here is driver code, and ``ray`` is imported only inside the actor.
"""

from __future__ import annotations

import socket
from typing import List, Optional

from ..core import events
from ..core.rankenv import Placement, place_ranks
from ..launch.remote import RemoteSpec, Site, TaskOutcome, run_launcher


class RaySite(Site):
    """Where a rank's actor runs, as Ray tells it."""

    def host(self) -> str:
        """The machine's name and the Ray node's id: Ray nodes that share a machine (a test
        cluster, several raylets per host) are nodes of their own."""
        import ray

        return f"{socket.gethostname()}/ray-{ray.get_runtime_context().get_node_id()[:12]}"

    def address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def gpus(self) -> Optional[str]:
        """The GPUs Ray assigned this actor (its accelerator ids), ``None`` where it has none."""
        import ray

        ids = ray.get_runtime_context().get_accelerator_ids().get("GPU") or []
        return ",".join(str(i) for i in ids) or None

    def placement(self, peers: List[events.Joined], use_gpu: bool) -> Placement:
        """As torchrun places them: the ranks of one Ray node numbered locally in rank order
        (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), nodes in the order of their first rank
        (``GROUP_RANK``), rank 0's node address as ``MASTER_ADDR``; without ``--gpu`` no GPU."""
        gpus = [p.gpus for p in peers] if use_gpu else [""] * len(peers)
        return place_ranks([p.host for p in peers], peers[0].address, peers[0].port, gpus)[self.rank]


class RankLauncher:
    """The actor of one rank (made a Ray actor class by ``backends.ray``, with the rank's CPUs,
    GPUs and bundle of the run's placement group)."""

    def pid(self) -> int:
        """The actor's process (for the driver's log and the tests' check that it ended)."""
        import os

        return os.getpid()

    def run(self, spec: RemoteSpec, rank: int) -> TaskOutcome:
        return run_launcher(spec, RaySite(rank))
