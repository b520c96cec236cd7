"""A real two-node Slurm on this machine, started by the tests and stopped by them.

Debian's ``slurm-wlm`` is built with multiple-slurmd support (``slurmd -N NAME``: one daemon per
node of the configuration, each with its own port), so two nodes, ``node1`` and ``node2``, run
as two ``slurmd`` on 127.0.0.1 beside one ``slurmctld``, and ``srun -N2 -n4`` reports
``SLURM_NODEID`` 0 and 1.  Everything is private to the cluster's directory: its own munge
daemon and key (``AuthInfo=socket=...``), its own ``slurm.conf`` (``SLURM_CONF``), free ports,
spool and state directories; a Slurm already running on the machine is never reached.

Configured for a container run as root: ``ProctrackType=proctrack/linuxproc`` (no cgroups),
``TaskPlugin=task/none``, ``SlurmdParameters=config_overrides`` (the nodes say more CPUs than the
machine has, so that four small tasks fit on two cores), no accounting, ``KillWait`` short so
that a cancelled step ends within seconds.

``SlurmCluster.start()`` returns once ``sinfo`` shows both nodes idle; ``stop()`` ends exactly
the pids it started (SIGTERM, then SIGKILL) and says which survived.  ``why_not()`` names what
this machine lacks to run one (the binaries), ``""`` where it can.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Dict, List

#: the programs a cluster needs (``.ci/slurm-install`` installs them: Debian's slurm-wlm, munge)
PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "salloc", "sinfo", "squeue", "scancel")
#: the nodes, each a ``slurmd -N`` of its own
NODES = ("node1", "node2")
#: CPUs each node says it has (``config_overrides``: more than the machine's are fine)
CPUS_PER_NODE = 4
START_WAIT = 60.0
STOP_WAIT = 15.0


def why_not() -> str:
    """What keeps a cluster from starting here, ``""`` for nothing."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} not on PATH; .ci/slurm-install installs it)"
    if os.geteuid() != 0:
        return "the test Slurm runs its daemons as root (SlurmdUser=root), and the tests do not run as root"
    return ""


def _free_port() -> int:
    from helpers import free_port

    return free_port()


class SlurmCluster:
    """One controller and two nodes under ``directory``; ``env`` is what a client of it needs."""

    def __init__(self, directory: str):
        self.directory = directory
        self.conf = os.path.join(directory, "slurm.conf")
        self.munge_socket = os.path.join(directory, "munge", "munge.socket")
        self.procs: Dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for name in list(self.env):  # an allocation the tests run in is not this cluster's
            if name.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_")) and name != "SLURM_CONF":
                del self.env[name]

    # -- configuration ------------------------------------------------------------------------

    def _write_conf(self) -> None:
        d = self.directory
        host = socket.gethostname().split(".")[0]
        ctld_port = _free_port()
        lines = [
            "ClusterName=torchdisttest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SlurmdParameters=config_overrides",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "KillWait=2",
            "InactiveLimit=0",
            "MinJobAge=2",
            "SlurmdTimeout=60",
            "MessageTimeout=10",
            f"PlugStackConfig={d}/plugstack.conf",
        ]
        for name in NODES:
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} "
                f"CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN"
            )
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        with open(self.conf, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        open(os.path.join(d, "plugstack.conf"), "w").close()

    # -- start and stop -----------------------------------------------------------------------

    def _spawn(self, name: str, argv: List[str]) -> None:
        log = open(os.path.join(self.directory, f"{name}.out"), "wb")
        try:
            self.procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        finally:
            log.close()

    def start(self) -> "SlurmCluster":
        d = self.directory
        for sub in ("munge", "state", *(f"spool/{n}" for n in NODES)):
            os.makedirs(os.path.join(d, sub), mode=0o700, exist_ok=True)
        os.chmod(d, 0o755)
        key = os.path.join(d, "munge", "munge.key")
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        self._write_conf()
        try:
            self._spawn(
                "munged",
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--socket={self.munge_socket}",
                    f"--key-file={key}",
                    f"--pid-file={d}/munge/munged.pid",
                    f"--log-file={d}/munge/munged.log",
                    f"--seed-file={d}/munge/munged.seed",
                ],
            )
            self._wait(lambda: os.path.exists(self.munge_socket), "munged's socket")
            self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", self.conf])
            for name in NODES:
                self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", self.conf])
            self._wait(self._nodes_idle, "both Slurm nodes idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _nodes_idle(self) -> bool:
        done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def _wait(self, condition, what: str) -> None:
        deadline = time.monotonic() + START_WAIT
        while not condition():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the test Slurm did not start: waiting for {what}"
                    + (f"; ended: {', '.join(dead)}" if dead else f" for {START_WAIT:g} s")
                    + "\n"
                    + self.logs()
                )
            time.sleep(0.1)

    def logs(self) -> str:
        """The daemons' last lines, for a failure's message."""
        out = []
        for name in sorted(os.listdir(self.directory)):
            if name.endswith((".log", ".out")):
                with open(os.path.join(self.directory, name), errors="replace") as fh:
                    tail = fh.read().splitlines()[-8:]
                out.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(out)

    def run(self, argv: List[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def jobs(self) -> List[str]:
        """The ids of the jobs ``squeue`` shows (every state it keeps)."""
        return self.run(["squeue", "-h", "-o", "%i"]).stdout.split()

    def stop(self) -> List[str]:
        """End the daemons this cluster started, by pid (SIGTERM, then SIGKILL after
        ``STOP_WAIT``); the names of those that had to be killed."""
        order = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        killed: List[str] = []
        for name in order:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                killed.append(name)
                proc.kill()
                proc.wait(STOP_WAIT)
        return killed

    def alive(self) -> List[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]
