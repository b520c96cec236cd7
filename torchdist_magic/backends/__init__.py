"""Backends start a job's ranks somewhere and report back through the same events.

Every backend implements ``base.Backend`` and returns a ``base.BackendRun``; the distributor
drives both the same way (check, start, watch events, stop, fetch results, close), so every
backend passes the same contract tests.  A backend is chosen by name (``core.registry``: the
built-in ``local`` and ``spark``, and those packages declare under the entry point group
``torchdist_magic.backends``).  The modules, bottom first (each imports only those above it):

- ``base``: the interface (``Backend``, ``BackendRun``, ``LaunchPlan``, ``LaunchContext``)
- ``frames``: the DataFrame a run trains on, checked before anything starts
- ``rendezvous``: the driver's side of the ranks' meeting, for launchers that join the channel
- ``launchers``: a run whose launchers are processes started by a command line (what a
  backend that starts ranks on other machines, by ssh or srun, builds on)
- ``local``: N worker processes on this machine
- ``spark_task``: what runs inside a Spark executor (the barrier task, the Arrow task)
- ``spark_stage``: the driver's side of a barrier stage, shared by classic Spark and Connect
- ``spark_python``: which interpreter the executors run the ranks on
- ``spark_classic``, ``spark_connect``: the two Spark flavours, thin on top of ``spark_stage``
- ``spark``: the backend named ``spark`` (the active session's flavour)
- ``registry``: ``make_backend``, a backend from its name
- ``pool``: warm pools, on any backend
"""

from .base import Backend, BackendRun, LaunchContext, LaunchPlan
from .registry import make_backend

__all__ = ["Backend", "BackendRun", "LaunchContext", "LaunchPlan", "make_backend"]
