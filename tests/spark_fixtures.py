"""Spark fixtures: ``spark_local2`` (master ``local[2]``), ``spark_local2_small_results`` (the
same with 1 MiB of ``spark.driver.maxResultSize``), ``spark_cluster``
(``local-cluster[2,1,1024]``: two executor JVMs with one core each), ``spark_cluster3`` (the same
with three), ``spark_fake_gpus``
(TorchDistributor's own GPU fixture: ``local-cluster[2,2,1024]`` whose workers each find GPUs
0, 1, 2 with a discovery script, one per executor and task), ``spark_standalone`` (a
real standalone cluster started from the pyspark wheel: a master and two one-core workers bound
to 127.0.0.2 and 127.0.0.3, which stand for two hosts) and ``spark_connect`` (a Spark Connect
session on a Connect server started from the wheel, master ``local[2]``).

A process can hold one SparkContext at a time, so the fixtures share one session-scoped
``spark_sessions`` that stops the running session before it starts one on another master or
with other settings (one session per master and settings); ``pytest_collection_modifyitems``
orders the Spark tests by fixture so that each session starts once.  A pytest plugin, loaded by ``conftest.py``'s ``pytest_plugins``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Dict, Optional

import pytest

from helpers import free_port, wait_until

#: fixture -> master URL (the standalone cluster's is known once it runs), in test order; the
#: Connect session comes last (it needs no classic SparkContext in this process)
MASTERS = {
    "spark_local2": "local[2]",
    "spark_local2_small_results": "local[2]",
    "spark_cluster": "local-cluster[2,1,1024]",
    "spark_cluster3": "local-cluster[3,1,1024]",
    "spark_fake_gpus": "local-cluster[2,2,1024]",
    "spark_standalone": None,
    "spark_connect": None,
}
CONNECT_WAIT = 180.0
CONNECT_READY = b"Spark Connect server started"
EXECUTOR_WAIT = 120.0
STANDALONE_HOSTS = ("127.0.0.2", "127.0.0.3")
#: a driver that takes at most 1 MiB of task results: a value of a few MiB that comes back
#: proves it did not pass through Spark
SMALL_RESULTS = {"spark.driver.maxResultSize": "1m"}


class SparkSessions:
    """At most one live SparkSession, on the master and with the settings the current test asks for."""

    def __init__(self, base_dir: str):
        self.base_dir = base_dir
        self.master = None
        self.conf = {}
        self.session = None

    def get(self, master: str, **conf: str):
        if self.session is not None and self.master == master and self.conf == conf and self.session.sparkContext._jsc:
            # the active one again, as a notebook's session is: an earlier test may have made
            # another session of this context active in this thread, or cleared it
            self.session.sparkContext._jvm.SparkSession.setActiveSession(self.session._jsparkSession)
            return self.session  # (a test that stopped the session leaves _jsc None)
        self.stop()
        from pyspark.sql import SparkSession

        other = SparkSession.getActiveSession()
        if other is not None:
            other.stop()  # left by another test: getOrCreate would hand it back, ignoring ``conf``
        work = os.path.join(self.base_dir, master.replace("[", "-").replace("]", "").replace(",", "-"))
        os.makedirs(work, exist_ok=True)
        builder = (
            SparkSession.builder.master(master)
            .appName("torchdist_magic tests")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.local.dir", os.path.join(work, "local"))
            .config("spark.sql.warehouse.dir", os.path.join(work, "warehouse"))
        )
        for key, value in conf.items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
        assert session.sparkContext.master == master, session.sparkContext.master
        took = {key: session.sparkContext.getConf().get(key) for key in conf}
        assert took == conf, f"the session has {took}, not the settings asked for"
        session.sparkContext.setLogLevel("ERROR")
        self.session, self.master, self.conf = session, master, dict(conf)
        if not master.startswith("local["):  # so that the first test does not wait for executors
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
        self.conf = {}
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
    wait_until(
        lambda: sc._jsc.sc().getExecutorMemoryStatus().size() - 1 >= count,
        EXECUTOR_WAIT,
        f"{count} executors to register",
    )


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


class StandaloneCluster:
    """A Spark standalone master and one worker per address of ``STANDALONE_HOSTS``, each a
    JVM started with the wheel's ``spark-class`` in a session of its own, stopped by pid."""

    def __init__(self, base_dir: str):
        import pyspark

        self.home = os.path.dirname(pyspark.__file__)
        self.base_dir = base_dir
        self.port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.procs = []
        self._start(
            "master",
            "127.0.0.1",
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--webui-port",
            "0",
        )
        for i, host in enumerate(STANDALONE_HOSTS):
            self._start(
                f"worker{i}",
                host,
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                host,
                "--cores",
                "1",
                "--memory",
                "1g",
                "--webui-port",
                "0",
                self.url,
            )

    def _start(self, name: str, host: str, cls: str, *args: str) -> None:
        work = os.path.join(self.base_dir, name)
        os.makedirs(work)
        env = dict(
            os.environ,
            SPARK_HOME=self.home,
            SPARK_LOCAL_IP=host,
            SPARK_WORKER_DIR=work,
            SPARK_LOCAL_DIRS=work,
            SPARK_LOG_DIR=work,
            SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
        )
        log = open(os.path.join(work, "out.log"), "wb")
        self.procs.append(
            subprocess.Popen(
                [os.path.join(self.home, "bin", "spark-class"), cls, *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        log.close()

    def stop(self) -> None:
        """Workers first (they stop their executors), then the master: SIGTERM to each group,
        a grace, SIGKILL to the group; then no live process may be left in any of the groups."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what the JVM left in its group (executors)
            except ProcessLookupError:
                pass
            proc.wait()
        groups = {proc.pid for proc in self.procs}
        wait_until(lambda: not _live_members(groups), 20, "the standalone cluster's processes to end")


def _live_members(groups) -> list:
    """Pids of live (not zombie) processes whose process group is one of ``groups``."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z" and int(fields[2]) in groups:
            found.append(int(pid))
    return found


@pytest.fixture(scope="session")
def standalone_cluster(tmp_path_factory, spark_sessions):
    """The running standalone cluster (started the first time a test asks for it)."""
    cluster = StandaloneCluster(str(tmp_path_factory.mktemp("standalone")))
    yield cluster
    spark_sessions.stop()  # the application first: its executors run under the workers
    cluster.stop()


@pytest.fixture
def spark_standalone(spark_sessions, standalone_cluster):
    """The active SparkSession on the standalone cluster (one one-core executor per worker)."""
    return spark_sessions.get(
        standalone_cluster.url, **{"spark.executor.cores": "1", "spark.executor.memory": "512m", "spark.cores.max": "2"}
    )


class ConnectServer:
    """A Spark Connect server (``SparkConnectServer`` through the wheel's ``spark-submit``) on a
    free loopback port, its files under ``base_dir``, in a process group of its own."""

    def __init__(self, base_dir: str, master: str = "local[2]", extra_conf: Optional[Dict[str, str]] = None):
        """``extra_conf``: more of the server's Spark settings (``spark.driver.memory``: its heap)."""
        import pyspark

        home = os.path.dirname(pyspark.__file__)
        jars = os.listdir(os.path.join(home, "jars"))
        if not any(j.startswith("spark-connect_") for j in jars):
            pytest.skip(f"this pyspark ({pyspark.__version__}) ships no Spark Connect server jar")
        self.port = free_port()
        self.base_dir = base_dir
        tmp = os.path.join(base_dir, "tmp")
        os.makedirs(tmp)
        conf = {
            "spark.connect.grpc.binding.port": str(self.port),
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.ui.enabled": "false",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.local.dir": os.path.join(base_dir, "local"),
            "spark.sql.warehouse.dir": os.path.join(base_dir, "warehouse"),
            "spark.jars.ivy": os.path.join(base_dir, "ivy"),
            "spark.driver.extraJavaOptions": f"-Djava.io.tmpdir={tmp}",
            **(extra_conf or {}),
        }
        command = [
            os.path.join(home, "bin", "spark-submit"),
            "--master",
            master,
            "--class",
            "org.apache.spark.sql.connect.service.SparkConnectServer",
        ]
        for key, value in conf.items():
            command += ["--conf", f"{key}={value}"]
        command.append("spark-internal")
        # the server's Python workers run the interpreter of these tests, as a cluster's would
        # run the one its administrator chose
        env = dict(
            os.environ,
            SPARK_HOME=home,
            PYSPARK_PYTHON=sys.executable,
            TMPDIR=tmp,
            SPARK_LOCAL_DIRS=os.path.join(base_dir, "local"),
        )
        self.log = os.path.join(base_dir, "server.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=base_dir,
                start_new_session=True,
            )
        wait_until(self._ready, CONNECT_WAIT, "the Spark Connect server to start")
        self.url = f"sc://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            with open(self.log, "rb") as fh:
                raise AssertionError(f"the Spark Connect server exited: {fh.read()[-2000:]!r}")
        with open(self.log, "rb") as fh:
            return CONNECT_READY in fh.read()

    def stop(self) -> None:
        """SIGTERM to the server's group, a grace, SIGKILL; no live process may be left in it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # Python workers the JVM left in its group
        except ProcessLookupError:
            pass
        self.proc.wait()
        wait_until(lambda: not _live_members({self.proc.pid}), 20, "the Spark Connect server's processes to end")


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory, spark_sessions):
    """The running Spark Connect server (started the first time a test asks for it)."""
    server = ConnectServer(str(tmp_path_factory.mktemp("connect")))
    yield server
    server.stop()


@pytest.fixture
def spark_connect(spark_sessions, connect_server):
    """The active Spark Connect session (no classic session is active meanwhile)."""
    spark_sessions.stop()
    from pyspark.sql import SparkSession

    session = SparkSession.builder.remote(connect_server.url).getOrCreate()
    yield session
    session.stop()


@pytest.fixture
def spark_local2(spark_sessions):
    """The active SparkSession on ``local[2]``."""
    return spark_sessions.get(MASTERS["spark_local2"])


@pytest.fixture
def spark_local2_small_results(spark_sessions):
    """The active SparkSession on ``local[2]`` whose driver takes at most 1 MiB of task results."""
    return spark_sessions.get(MASTERS["spark_local2_small_results"], **SMALL_RESULTS)


@pytest.fixture
def spark_cluster(spark_sessions):
    """The active SparkSession on ``local-cluster[2,1,1024]`` (ranks run in executor JVMs)."""
    return spark_sessions.get(MASTERS["spark_cluster"])


@pytest.fixture
def spark_cluster3(spark_sessions):
    """The active SparkSession on ``local-cluster[3,1,1024]``: three executor JVMs, one of which a
    test may kill (a lost worker), with all three registered."""
    session = spark_sessions.get(MASTERS["spark_cluster3"])
    _wait_for_executors(session.sparkContext, 3)
    return session


@pytest.fixture(scope="session")
def gpu_discovery_script(tmp_path_factory):
    """A GPU discovery script that finds GPUs 0, 1 and 2 (there are none: Spark only hands out
    their addresses)."""
    path = tmp_path_factory.mktemp("gpus") / "discover.sh"
    path.write_text('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0", "1", "2"]}\'\n')
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def spark_fake_gpus(spark_sessions, gpu_discovery_script):
    """The active SparkSession on TorchDistributor's GPU fixture: two workers on this machine,
    each with GPUs 0-2 by its discovery script; one GPU and two cores per executor and task."""
    return spark_sessions.get(
        MASTERS["spark_fake_gpus"],
        **{
            "spark.worker.resource.gpu.discoveryScript": gpu_discovery_script,
            "spark.worker.resource.gpu.amount": "3",
            "spark.task.cpus": "2",
            "spark.task.resource.gpu.amount": "1",
            "spark.executor.resource.gpu.amount": "1",
        },
    )


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
