"""The backend named ``slurm``: each rank's launcher a step of a Slurm allocation, started by ``srun``.

Inside an allocation (``SLURM_JOB_ID`` set: a notebook in ``salloc``, an ``sbatch`` job, a
JupyterHub spawned by Slurm) the ranks run as steps of that allocation, which must hold at least
``--np`` tasks.  Outside one (a login node) the run asks for its own with ``salloc --no-shell``
(``--np`` tasks over the ``nodes`` option's nodes, with the ``partition``, ``account`` and
``time`` options, one GPU per task with ``--gpu``), and cancels it when the run ends, however it
ends (``release``: value, failure, timeout, cancel).

Placement.  One ``srun`` per rank (``--nodes=1 --ntasks=1 --nodelist=NODE --exact``), each rank
on the node torchrun's block placement gives it among the allocation's nodes and their tasks
(``SLURM_JOB_NODELIST``/``SLURM_TASKS_PER_NODE``, or what this run asked for): node 0 holds ranks
0..k-1, node 1 the next, and so on.  Every launcher names its node as Slurm does
(``SLURMD_NODENAME``, ``launch.remote.SlurmSite``), from which each rank gets torchrun's
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and rank 0's address as ``MASTER_ADDR``.
One step per rank keeps each launcher a process of the driver's own, watched and stopped like
any command-line backend's, at the cost of one ``srun`` each (they start in parallel).

Stopping.  The launchers are told to stop over the channel, then their ``srun`` is signalled
(``srun`` forwards the signal to its step); at the run's end the allocation this run asked for
is cancelled (``scancel``), and inside the user's allocation any step of this run still listed
is cancelled by its id, so ``squeue`` shows nothing of the run afterwards.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from typing import Dict, List, Optional, Tuple

from ..core.options import LaunchOptions
from .base import LaunchContext, LaunchPlan
from .launchers import CommandLineBackend, CommandLineRun, checked_python

#: how long ``salloc`` may wait for the run's allocation before the run is refused
ALLOCATION_WAIT = 300.0
#: how long a Slurm client command (``scontrol``, ``squeue``, ``scancel``) may take
CLIENT_WAIT = 30.0

NO_SLURM = (
    "backend 'slurm' needs Slurm's client commands (srun, salloc, scancel, squeue, scontrol) on "
    "PATH, and {missing} is not there: run the notebook on a Slurm login node or inside an allocation"
)


def expand_nodelist(nodelist: str) -> List[str]:
    """The node names of a Slurm node list (``node[1-3,5],gpu7``), as ``scontrol show hostnames``
    gives them."""
    done = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=CLIENT_WAIT
    )
    if done.returncode != 0:
        raise ValueError(f"scontrol show hostnames {nodelist!r} failed: {done.stderr.strip()}")
    return done.stdout.split()


def tasks_per_node(spec: str) -> List[int]:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) as one count per node."""
    counts: List[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"cannot read SLURM_TASKS_PER_NODE={spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def block_placement(nodes: List[str], counts: List[int], num_processes: int) -> List[str]:
    """Each rank's node: the nodes filled in order, ``counts[i]`` ranks on node ``i``."""
    out: List[str] = []
    for node, count in zip(nodes, counts):
        out += [node] * count
    if len(out) < num_processes:
        raise ValueError(f"the allocation holds {len(out)} tasks, and the run needs {num_processes}")
    return out[:num_processes]


class SlurmBackend(CommandLineBackend):
    """Ranks as ``srun`` steps of the run's Slurm allocation (the one it runs in, or its own)."""

    name = "slurm"
    site = "slurm"
    option_help = {
        "nodes": "how many nodes the run's own allocation spreads the ranks over (default: Slurm's choice)",
        "partition": "the partition of the run's own allocation (salloc --partition)",
        "account": "the account it is charged to (salloc --account)",
        "time": "its time limit (salloc --time, e.g. 02:00:00)",
        "python": "the interpreter on the nodes (default: this one's path)",
        "spec_dir": "a directory every node reads at the same path (a shared file system) for the run's spec file",
        "address": "the address the nodes reach this notebook at (default: its host name's)",
    }

    def __init__(self):
        self.settings: Dict[str, str] = {}
        self._job: Optional[str] = None  # the allocation the ranks run in
        self._own_job = False  # whether this run asked for it (and so cancels it)
        self._placement: List[str] = []
        #: the allocation's nodes and their tasks, and the nodes a restart leaves out
        self._nodes: List[str] = []
        self._counts: List[int] = []
        self._left_out: List[str] = []
        self._run_id = ""
        self._use_gpu = False

    def describe(self) -> str:
        job = os.environ.get("SLURM_JOB_ID")
        return (
            f"Slurm steps of job {job} (this notebook's allocation)"
            if job
            else "Slurm steps of the run's own allocation"
        )

    def configure(self, options: Dict[str, str]) -> None:
        super().configure(options)
        nodes = options.get("nodes")
        if nodes is not None and (not nodes.isdigit() or int(nodes) < 1):
            raise ValueError(f"backend option nodes must be a whole number of at least 1, got {nodes!r}")
        python = options.get("python")
        if python is not None and not os.path.isabs(python):
            raise ValueError(f"backend option python must be an absolute path on the nodes, got {python!r}")
        spec_dir = options.get("spec_dir")
        if spec_dir is not None and not os.path.isdir(spec_dir):
            raise ValueError(f"backend option spec_dir must be an existing directory, got {spec_dir!r}")
        missing = [c for c in ("srun", "salloc", "scancel", "squeue", "scontrol") if shutil.which(c) is None]
        if missing:
            raise ValueError(NO_SLURM.format(missing=missing[0]))
        self.settings = dict(options)

    def detachable(self) -> bool:
        """A detached run's supervising process makes the backend again from its name and options,
        in the notebook's environment (``SLURM_JOB_ID`` included): its ranks are steps of the same
        allocation, or of one it asks for itself."""
        return True

    def python(self) -> str:
        return self.settings.get("python") or super().python()

    def spec_directory(self) -> Optional[str]:
        return self.settings.get("spec_dir")

    def channel_host(self) -> str:
        if "address" in self.settings:
            return self.settings["address"]
        import socket

        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"

    def check(self, options: LaunchOptions) -> LaunchPlan:
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            tasks = sum(tasks_per_node(os.environ.get("SLURM_TASKS_PER_NODE", "1")))
            if options.num_processes > tasks:
                raise ValueError(
                    f"--np {options.num_processes} is more than the {tasks} tasks of the Slurm allocation "
                    f"this notebook runs in (job {job}): ask for more tasks (salloc -n), or give fewer ranks"
                )
            own = [k for k in ("nodes", "partition", "account", "time") if k in self.settings]
            if own:
                raise ValueError(
                    f"backend option {own[0]} is for an allocation of the run's own, and this notebook runs "
                    f"inside job {job} (SLURM_JOB_ID): its ranks are steps of that job"
                )
        nodes = int(self.settings.get("nodes", "0") or 0)
        if nodes > options.num_processes:
            raise ValueError(f"backend option nodes={nodes} is more than the run's {options.num_processes} ranks")
        return super().check(options)

    def start(self, ctx: LaunchContext) -> CommandLineRun:
        self._run_id, self._use_gpu = ctx.spec.run_id, ctx.spec.use_gpu
        if self._job is None:  # a restart runs in the same allocation
            self._allocate(ctx)
        elif self._left_out:  # on its nodes that were not left out
            self._placement = block_placement(*self._kept(), ctx.spec.num_processes)
        return super().start(ctx)

    def _kept(self) -> Tuple[List[str], List[int]]:
        kept = [(node, count) for node, count in zip(self._nodes, self._counts) if node not in self._left_out]
        return [node for node, _ in kept], [count for _, count in kept]

    def exclude(self, exclusion) -> bool:
        """Leave a node of the allocation out of the next attempt's placement (its ranks go on
        the other nodes' tasks); a host that is no node of it cannot be."""
        if exclusion.host not in self._nodes:
            return False
        if exclusion.host not in self._left_out:
            self._left_out.append(exclusion.host)
        return True

    def readmit(self, exclusion) -> bool:
        if exclusion.host not in self._left_out:
            return False
        self._left_out.remove(exclusion.host)
        return True

    def placeable(self) -> Optional[int]:
        """The tasks of the allocation's nodes not left out (before the first start: unknown)."""
        return sum(self._kept()[1]) if self._nodes else None

    def _allocate(self, ctx: LaunchContext) -> None:
        n = ctx.spec.num_processes
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            nodes = expand_nodelist(os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", ""))
            counts = tasks_per_node(os.environ.get("SLURM_TASKS_PER_NODE", "1"))
            self._nodes, self._counts = nodes, counts
            self._placement = block_placement(nodes, counts, n)
            self._job = job
            return
        nodes = int(self.settings.get("nodes", "0") or 0)
        argv = ["salloc", "--no-shell", f"--job-name=torchdist-{ctx.spec.run_id}", f"--ntasks={n}"]
        if nodes:
            argv += [f"--nodes={nodes}", f"--ntasks-per-node={math.ceil(n / nodes)}"]
        for key in ("partition", "account", "time"):
            if key in self.settings:
                argv.append(f"--{key}={self.settings[key]}")
        if ctx.spec.use_gpu:
            argv.append("--gpus-per-task=1")
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=ALLOCATION_WAIT)
        except subprocess.TimeoutExpired:
            self._cancel_named()
            raise ValueError(f"Slurm gave no allocation within {ALLOCATION_WAIT:g} s ({' '.join(argv)})") from None
        match = re.search(r"Granted job allocation (\d+)", done.stderr)
        if done.returncode != 0 or match is None:
            raise ValueError(f"Slurm refused the run's allocation ({' '.join(argv)}): {done.stderr.strip()}")
        self._job, self._own_job = match.group(1), True
        info = subprocess.run(
            ["squeue", "-h", "-j", self._job, "-o", "%N"], capture_output=True, text=True, timeout=CLIENT_WAIT
        )
        names = expand_nodelist(info.stdout.strip())
        per_node = math.ceil(n / len(names))
        self._nodes, self._counts = names, [per_node] * len(names)
        self._placement = block_placement(names, self._counts, n)

    def command(self, rank: int, argv: List[str]) -> List[str]:
        line = [
            "srun",
            f"--jobid={self._job}",
            f"--job-name=torchdist-{self._run_id}",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={self._placement[rank]}",
            "--exact",
            "--quiet",
        ]
        if self._use_gpu:
            line.append("--gpus-per-task=1")  # Slurm binds it: CUDA_VISIBLE_DEVICES as the step sees it
        return line + checked_python(argv)

    def release(self) -> None:
        """Cancel the run's own allocation, or the steps of this run still in the user's."""
        if self._job is None:
            return
        try:
            if self._own_job:
                subprocess.run(["scancel", self._job], capture_output=True, timeout=CLIENT_WAIT)
            else:
                steps = subprocess.run(
                    ["squeue", "-h", "-s", "-j", self._job, "-o", "%i %j"],
                    capture_output=True,
                    text=True,
                    timeout=CLIENT_WAIT,
                ).stdout.split("\n")
                mine = [s.split()[0] for s in steps if s.strip().endswith(f"torchdist-{self._run_id}")]
                if mine:
                    subprocess.run(["scancel", *mine], capture_output=True, timeout=CLIENT_WAIT)
        finally:
            self._job, self._own_job = None, False
            self._nodes, self._counts, self._left_out = [], [], []

    def _cancel_named(self) -> None:
        """Cancel a pending allocation of this run that ``salloc`` gave up waiting for."""
        subprocess.run(["scancel", f"--name=torchdist-{self._run_id}"], capture_output=True, timeout=CLIENT_WAIT)
