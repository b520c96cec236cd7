"""A real three-node Ray cluster on this machine, started by the tests and stopped by them.

Ray's own test utility (``ray.cluster_utils.Cluster``) starts each node as Ray's processes do in
a cluster (one GCS on the head, a raylet and its agents per node), here as children of the test
process: a head that holds no CPU (as a cluster's head usually takes no work), and two worker
nodes of ``CPUS_PER_NODE`` CPUs each, told apart by a resource of their own (``node1``,
``node2``), with a small object store each (``OBJECT_STORE``).  No node runs Ray's dashboard: its dozen
processes made a node miss Ray's own 30 s limit to register on a busy machine, so the actors
``ray list actors`` would show (which its state API reads from the GCS) are read from the GCS
directly (``alive_actors``).  Everything Ray writes (its session directory, sockets, logs,
and the address file ``ray.init("auto")`` reads) goes to a directory of the cluster's own
(``RAY_TMPDIR``), never a Ray of the machine's.

``stop()`` shuts the nodes down through the utility, then makes sure: every process the cluster
started (the nodes' daemons, and their children: agents, actors, idle workers), noted before the
shutdown, must be gone; it ends any still there by pid (SIGKILL) and says which.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Dict, List, Tuple

#: CPUs of each worker node (the head has none)
CPUS_PER_NODE = 2
#: the worker nodes, each with a resource of its name
NODES = ("node1", "node2")
#: bytes of each node's object store
OBJECT_STORE = 80 * 1024 * 1024
STOP_WAIT = 30.0


def why_not() -> str:
    """What keeps a cluster from starting here, ``""`` for nothing."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return 'ray is not installed (pip install "torchdist_magic[ray]"; .ci/setup installs it into .venv)'
    return ""


class RayCluster:
    """The head and ``NODES`` under ``directory``; ``address`` is what ``ray.init`` takes."""

    def __init__(self, directory: str):
        self.directory = directory
        self.cluster = None
        self.address = ""

    def start(self, attempts: int = 3) -> "RayCluster":
        """Start the nodes; on a machine so busy that a raylet misses Ray's own limits (30 s to
        register, ``Node``'s ``raylet_start_wait_time_s``; 15 s for its agents to write their
        ports, after which it crashes: ray-project/ray#62883; neither configurable from here), stop
        what started and try again, up to ``attempts`` times."""
        from ray.cluster_utils import Cluster

        os.environ["RAY_TMPDIR"] = self.directory  # the processes the nodes start inherit it
        for attempt in range(attempts):
            common = dict(object_store_memory=OBJECT_STORE, num_gpus=0, include_dashboard=False)
            self.cluster = Cluster()
            try:
                self.cluster.add_node(**common, num_cpus=0)
                for name in NODES:
                    self.cluster.add_node(**common, num_cpus=CPUS_PER_NODE, resources={name: 1})
                self.cluster.wait_for_nodes()
            except Exception:
                self.stop()  # a node that never registered is unknown to the utility: ended by pid
                if attempt == attempts - 1:
                    raise
                continue
            break
        self.address = self.cluster.address
        return self

    def processes(self) -> List[Tuple[int, float]]:
        """Every live process of the cluster: the children of this process that Ray started for
        it (their command lines name the cluster's directory: a node that failed to start
        included) and all their descendants."""
        import psutil

        found = []
        for child in psutil.Process().children():
            try:
                line = " ".join(child.cmdline())
                if self.directory not in line and "ray_process_reaper" not in line:
                    continue
                for proc in [child, *child.children(recursive=True)]:
                    found.append((proc.pid, proc.create_time()))
            except psutil.NoSuchProcess:
                pass
        return sorted(set(found))

    def nodes_by_raylet(self) -> Dict[int, str]:
        """``{raylet pid: node name}`` of the worker nodes: a process of a Ray node (an actor, and
        what it starts) has its raylet's pid in ``RAY_RAYLET_PID``."""
        import ray

        names = {}
        for node in ray.nodes():
            found = [k for k in node["Resources"] if k in NODES]
            if node["Alive"] and found:
                names[node["NodeID"]] = found[0]
        out = {}
        for node in self.cluster.list_all_nodes():
            if node.node_id in names:
                out[node.all_processes["raylet"][0].process.pid] = names[node.node_id]
        return out

    def alive_actors(self) -> List[Dict]:
        """The actors the cluster's GCS holds as ALIVE (what ``ray list actors --filter
        state=ALIVE`` shows), each with its class, pid and node."""
        table = self.cluster.global_state.actor_table(None)
        return [
            {"id": a["ActorID"], "class": a["ActorClassName"], "pid": a["Pid"], "node": a["Address"]["NodeID"]}
            for a in table.values()
            if a["State"] == "ALIVE"
        ]

    def stop(self) -> Dict[str, List[int]]:
        """Shut the cluster down; ``{"survived": pids, "killed": pids}``: processes it started that
        were still there after the shutdown (then killed by pid)."""
        import psutil

        started = self.processes()
        if self.cluster is not None:
            try:
                self.cluster.shutdown()
            except Exception:  # a node that never registered: its processes are ended below  # noqa: BLE001
                pass
            self.cluster = None

        def left() -> List[Tuple[int, float]]:
            out = []
            for pid, created in started:
                try:
                    proc = psutil.Process(pid)
                    if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                        out.append((pid, created))
                except psutil.NoSuchProcess:
                    pass
            return out

        deadline = time.monotonic() + STOP_WAIT
        while left() and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = left()
        for pid, _ in survivors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return {"survived": [pid for pid, _ in survivors], "killed": [pid for pid, _ in survivors]}
