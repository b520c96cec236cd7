"""Spark fixtures: ``spark_local2`` (master ``local[2]``) and ``spark_cluster``
(``local-cluster[2,1,1024]``: two executor JVMs with one core each).

A process can hold one SparkContext at a time, so both fixtures share one session-scoped
``spark_sessions`` that stops the running session before it starts one on another master;
``pytest_collection_modifyitems`` orders the Spark tests by master so that each session starts
once.  A pytest plugin, loaded by ``conftest.py``'s ``pytest_plugins``.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from helpers import wait_until

MASTERS = {"spark_local2": "local[2]", "spark_cluster": "local-cluster[2,1,1024]"}
EXECUTOR_WAIT = 120.0


class SparkSessions:
    """At most one live SparkSession, on the master the current test asks for."""

    def __init__(self, base_dir: str):
        self.base_dir = base_dir
        self.master = None
        self.session = None

    def get(self, master: str):
        if self.session is not None and self.master == master and self.session.sparkContext._jsc:
            return self.session  # (a test that stopped the session leaves _jsc None)
        self.stop()
        from pyspark.sql import SparkSession

        other = SparkSession.getActiveSession()
        if other is not None and other.sparkContext.master != master:
            other.stop()  # left by another test: getOrCreate would hand it back, on its master
        work = os.path.join(self.base_dir, master.replace("[", "-").replace("]", "").replace(",", "-"))
        os.makedirs(work, exist_ok=True)
        builder = (SparkSession.builder.master(master).appName("torchdist_magic tests")
                   .config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.local.dir", os.path.join(work, "local"))
                   .config("spark.sql.warehouse.dir", os.path.join(work, "warehouse")))
        session = builder.getOrCreate()
        assert session.sparkContext.master == master, session.sparkContext.master
        session.sparkContext.setLogLevel("ERROR")
        self.session, self.master = session, master
        if master.startswith("local-cluster"):  # so that the first test does not wait for them
            _wait_for_executors(session.sparkContext, 2)
        return session

    def stop(self) -> None:
        if self.session is None:
            return
        sc = self.session.sparkContext
        app_id = sc.applicationId
        local_cluster = self.master.startswith("local-cluster")
        self.session.stop()
        self.session = self.master = None
        if local_cluster:
            # a local cluster's workers keep executor logs under $SPARK_HOME/work/<app id>
            import pyspark

            work = os.path.join(os.path.dirname(pyspark.__file__), "work")
            shutil.rmtree(os.path.join(work, app_id), ignore_errors=True)
            try:
                os.rmdir(work)
            except OSError:
                pass


def _wait_for_executors(sc, count: int) -> None:
    # the driver counts as one
    wait_until(lambda: sc._jsc.sc().getExecutorMemoryStatus().size() - 1 >= count, EXECUTOR_WAIT,
               f"{count} executors to register")


@pytest.fixture(scope="session")
def spark_sessions(tmp_path_factory):
    sessions = SparkSessions(str(tmp_path_factory.mktemp("spark")))
    yield sessions
    sessions.stop()
    shut_down_gateway_jvm()


def shut_down_gateway_jvm() -> None:
    """End the py4j gateway's JVM, which ``SparkSession.stop`` keeps for the next session and
    which would otherwise exit only after pytest does, and check by its pid that it is gone."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if gateway is None or proc is None:
        return
    gateway.shutdown()
    SparkContext._gateway = SparkContext._jvm = None
    proc.stdin.close()  # the JVM ends itself when its parent's pipe closes
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.returncode is not None, f"the Spark gateway JVM (pid {proc.pid}) survived"


@pytest.fixture
def spark_local2(spark_sessions):
    """The active SparkSession on ``local[2]``."""
    return spark_sessions.get(MASTERS["spark_local2"])


@pytest.fixture
def spark_cluster(spark_sessions):
    """The active SparkSession on ``local-cluster[2,1,1024]`` (ranks run in executor JVMs)."""
    return spark_sessions.get(MASTERS["spark_cluster"])


def _spark_master_of(item) -> int:
    """0 for tests without Spark, then one group per master, in ``MASTERS`` order."""
    callspec = getattr(item, "callspec", None)
    names = set(getattr(item, "fixturenames", ()))
    if callspec is not None:  # a parameter naming the fixture, or the ``dist`` fixture's backend
        for value in callspec.params.values():
            if isinstance(value, str):
                names.update((value, f"spark_{value.replace('-', '_')}"))
    for i, name in enumerate(MASTERS, start=1):
        if name in names:
            return i
    return 0


def pytest_collection_modifyitems(session, config, items):
    """Group Spark tests by master (stable otherwise): each SparkSession starts only once."""
    items.sort(key=_spark_master_of)
