"""Slurm fixtures: ``slurm_cluster`` (one real two-node Slurm for the test session,
``tests/slurm_cluster.py``) and ``slurm`` (a test that uses it: its client commands reach that
cluster through ``SLURM_CONF``, no allocation of another Slurm is inherited, and after the test
``squeue`` shows no job).  Skipped, saying why, only where the cluster cannot start here; a
pytest plugin, loaded by ``conftest.py``'s ``pytest_plugins``."""

from __future__ import annotations

import os
import time

import pytest

#: how long a job the test cancelled may take to leave squeue (KillWait 2 s, MinJobAge 2 s)
JOB_END_WAIT = 30.0


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    from slurm_cluster import SlurmCluster, why_not

    why = why_not()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm"))).start()
    try:
        yield cluster
    finally:
        killed = cluster.stop()
        assert not cluster.alive(), f"Slurm daemons survived their stop: {cluster.alive()}"
        assert not killed, f"Slurm daemons did not end on SIGTERM and were killed: {killed}"


@pytest.fixture
def slurm(slurm_cluster, monkeypatch):
    """The session's cluster, as this test's Slurm (``SLURM_CONF``); no job may be left in it."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.conf)
    yield slurm_cluster
    deadline = time.monotonic() + JOB_END_WAIT
    while slurm_cluster.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not slurm_cluster.jobs(), f"jobs left in squeue after the test: {slurm_cluster.jobs()}"
