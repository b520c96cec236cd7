"""Ray fixtures: ``ray_cluster`` (one real three-node Ray cluster for the test session,
``tests/ray_cluster.py``) and ``ray_connected`` (a test that uses it: this process connected to
it, and after the test no actor ALIVE in its GCS and no placement group left that is not
removed).  Skipped, saying why, only where ray is not installed; a pytest plugin, loaded by
``conftest.py``'s ``pytest_plugins``."""

from __future__ import annotations

import time

import pytest

#: how long the actors and placement groups of a test's runs may take to be gone after it
RAY_END_WAIT = 30.0


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    from ray_cluster import RayCluster, why_not

    why = why_not()
    if why:
        pytest.skip(why)
    import tempfile

    # a short directory: Ray's sockets live in it, and a socket's path has at most 107 bytes
    cluster = RayCluster(tempfile.mkdtemp(prefix="tdray-", dir="/tmp"))
    started = False
    try:
        cluster.start()
        started = True
        yield cluster
    finally:
        import ray
        import shutil

        ray.shutdown()
        ended = cluster.stop()
        shutil.rmtree(cluster.directory, ignore_errors=True)
        # a start that failed (interrupted, or a node that never registered) leaves processes the
        # utility does not know: ended by pid, and the start's own error is the one to see
        assert not (started and ended["survived"]), (
            f"Ray processes survived the cluster's shutdown (killed now): {ended}"
        )


def leftovers(cluster) -> dict:
    """What is left on the cluster of the tests' runs: actors ALIVE, placement groups not removed."""
    import ray

    groups = [(g["name"], g["state"]) for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    return {"actors": cluster.alive_actors(), "placement groups": groups}


@pytest.fixture
def ray_connected(ray_cluster):
    """The session's cluster, this process connected to it; nothing of the test's runs may be
    left on it afterwards."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_cluster.address, log_to_driver=False)
    yield ray_cluster
    deadline = time.monotonic() + RAY_END_WAIT
    while any(leftovers(ray_cluster).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = leftovers(ray_cluster)
    assert not any(left.values()), f"left on the Ray cluster after the test: {left}"
