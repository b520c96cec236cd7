"""Fixtures every test file shares.  Spark's fixtures are a plugin of their own
(``spark_fixtures``), and so are the gate that fails a run on an unexpected skip (``skip_gate``)
and the guard that the tests run against the installed wheel, not a stale one
(``install_guard``); process helpers are plain functions in ``helpers``."""

import os
import shutil
import sys
import tempfile
import time

import pytest

pytest_plugins = ["install_guard", "spark_fixtures", "slurm_fixtures", "ray_fixtures", "skip_gate"]

#: every run the tests start leaves its record in the history of runs (``driver.history``): in a
#: directory of this test session's own, never the user's, and gone with the session; the
#: processes and kernels the tests start inherit it
_HISTORY_HOME = tempfile.mkdtemp(prefix="torchdist-test-home-")
os.environ["TORCHDIST_HOME"] = _HISTORY_HOME
#: the processes the tests start (drivers, kernels, supervisors, servers) inherit the session's
#: mark: what they leave in shared memory is this session's, not another's (``SharedMemoryWatch``)
os.environ["TORCHDIST_TESTS_SESSION"] = str(os.getpid())

#: the packages whose releases change how a job is pickled, launched or shown: their versions head
#: every test run, so that a failure after a fresh set-up names the release that changed
PACKAGES_UNDER_TEST = ("cloudpickle", "torch", "pyspark", "ipykernel", "ipywidgets", "IPython", "mlflow")


def package_versions():
    """``{name: version}`` of ``PACKAGES_UNDER_TEST``, "not installed" where one is missing."""
    from importlib import metadata

    versions = {}
    for name in PACKAGES_UNDER_TEST:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def versions_line() -> str:
    return "torchdist_magic runs with " + ", ".join(f"{k} {v}" for k, v in package_versions().items())


def pytest_report_header(config):
    return versions_line()


def pytest_unconfigure(config):
    shutil.rmtree(_HISTORY_HOME, ignore_errors=True)


def pytest_sessionstart(session):
    """With ``-q`` (README's test command) pytest prints no header: the versions are said anyway."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.get_verbosity() < 0:
        reporter.write_line(versions_line())


@pytest.fixture(scope="module")
def ip():
    """An IPython shell with ``%load_ext torchdist_magic`` and the text view; run cells with
    ``helpers.cell``."""
    from IPython.testing.globalipapp import get_ipython, start_ipython

    shell = start_ipython() or get_ipython()  # None when another test module started it first
    shell.run_line_magic("load_ext", "torchdist_magic")
    shell.run_line_magic("config", "TorchdistMagics.view = 'text'")
    yield shell
    shell.run_line_magic("unload_ext", "torchdist_magic")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A history of runs of this test's own (``TORCHDIST_HOME`` under its ``tmp_path``): the
    directory's path; the processes the test starts inherit it."""
    from torchdist_magic.driver import history

    monkeypatch.setenv(history.HOME_ENV, str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def local_distributor():
    """``make(num_processes, **options)`` -> a silent local-process Distributor."""
    from torchdist_magic import Distributor

    def make(num_processes=2, **options):
        return Distributor(num_processes, local_mode=True, show=None, **options)

    return make


@pytest.fixture(autouse=True)
def _no_temp_leftovers(tmp_path, monkeypatch):
    """Every test gets its own temp dir for run directories, which must be empty afterwards, and
    leaves nothing of its runs in shared memory (where ranks write their values)."""
    import tempfile

    from torchdist_magic.core.values import SHARED_MEMORY
    from torchdist_magic.core.privdir import user_path

    def in_shared_memory():  # this process's runs' only: another test session may share it
        mine = f"-values-{os.getpid()}-"
        found = set()
        for folder in (SHARED_MEMORY, user_path(SHARED_MEMORY)):  # a machine's copies are in the latter
            if os.path.isdir(folder):
                found |= {
                    os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("torchdist-") and mine in n
                }
        return found

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    before = in_shared_memory()
    yield
    # this user's private directory may stay (privdir), empty
    private = scratch / os.path.basename(user_path(str(scratch)))
    left = sorted(
        [p.name for p in scratch.iterdir() if p != private]
        + ([f"{private.name}/{p.name}" for p in private.iterdir()] if private.is_dir() else [])
    )
    assert not left, f"temp files left behind: {left}"
    kept = sys.modules.get("torchdist_magic.driver.sent")
    if kept is not None:  # kept by design while its tensors live (one may still be in a frame or
        kept.KeptValues.forget_current()  # a cycle): a next test starts without it
    left = sorted(in_shared_memory() - before)
    assert not left, f"left behind in {SHARED_MEMORY}: {left}"


#: how long the session's last runs (a supervisor, a kernel shutting down) may take to remove
#: their directories after the last test
SESSION_END_WAIT = 30.0


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_in_shared_memory():
    """What the processes of this session (this pytest process and the ones it started: a
    killed driver, a kernel, a supervisor) made in shared memory under torchdist_magic's names
    must be gone at the session's end; another session's entries are never named."""
    from helpers import SESSION_VARIABLE, SharedMemoryWatch

    watch = SharedMemoryWatch(int(os.environ[SESSION_VARIABLE]))
    yield watch
    kept = sys.modules.get("torchdist_magic.driver.sent")
    if kept is not None:  # the last run's values kept for a next run: this process's exit drops them
        kept.KeptValues.forget_current()
    deadline = time.monotonic() + SESSION_END_WAIT
    while watch.left() and time.monotonic() < deadline:
        time.sleep(0.1)
    watch.stop()
    left = watch.left()
    assert not left, f"this test session's processes left behind in shared memory: {left}"


@pytest.fixture
def run_clock(monkeypatch):
    """The ``helpers.SteppedClock`` that runs started in this test measure their ``timeout`` and
    their ranks' quiet (``hang_timeout``) with."""
    import torchdist_magic.driver.console as console
    import torchdist_magic.driver.distributor as distributor
    from helpers import SteppedClock
    from torchdist_magic.driver.state import RunState

    clock = SteppedClock()
    monkeypatch.setattr(distributor, "time", clock)
    monkeypatch.setattr(console, "time", clock)  # the debugger's sessions' quiet, the watchdog's other half
    idle = RunState.idle
    monkeypatch.setattr(RunState, "idle", lambda state: idle(state) + clock.offset)
    return clock


#: how long a run cancelled after its test may take to end (a Spark stage's cancel included)
CANCELLED_RUN_WAIT = 120.0


@pytest.fixture(autouse=True)
def _no_unfinished_runs(_no_temp_leftovers):
    """A run that its test left going (the test failed before it ended it) is cancelled and waited
    for after the test; then no process of it may be left.  Runs are noted as they start, weakly
    (a test that checks what a run's garbage collection removes still can)."""
    import weakref

    import torchdist_magic.driver.distributor as distributor
    from helpers import assert_no_survivors

    started = weakref.WeakSet()
    start = distributor.Run._start

    def noting_start(run):
        started.add(run)
        return start(run)

    distributor.Run._start = noting_start
    try:
        yield
    finally:
        distributor.Run._start = start
    unfinished = [run for run in list(started) if not run.done()]
    for run in unfinished:
        run.cancel()
    stuck = [run.run_id for run in unfinished if not run.wait(CANCELLED_RUN_WAIT)]
    assert not stuck, f"runs the test left going did not end when cancelled: {stuck}"
    for run in unfinished:
        if not run.options.warm:  # a warm run's ranks are its pool's, which outlive it by design
            assert_no_survivors(run)


@pytest.fixture
def shell_backend():
    """The backend ``shell`` (``tests/shell_backend.py``), registered while the test runs."""
    from shell_backend import ShellBackend
    from torchdist_magic import register_backend, unregister_backend

    ShellBackend.commands.clear()
    register_backend("shell", ShellBackend)
    yield ShellBackend
    unregister_backend("shell")


#: backends the contract suite runs against
CONTRACT_BACKENDS = [
    pytest.param("local", id="local"),
    pytest.param("shell", id="command-line"),  # tests/shell_backend.py: a backend outside the package
    pytest.param("local2", id="spark-local2", marks=pytest.mark.spark),
    pytest.param("cluster", id="spark-cluster", marks=pytest.mark.spark),
    pytest.param("connect", id="spark-connect", marks=pytest.mark.spark),
    pytest.param("slurm", id="slurm"),  # the real two-node Slurm of tests/slurm_cluster.py
    pytest.param("ray", id="ray", marks=pytest.mark.ray),  # the real three-node Ray of tests/ray_cluster.py
]


@pytest.fixture(params=CONTRACT_BACKENDS)
def dist(request):
    """``dist(num_processes, **options)`` -> a silent Distributor on the parametrized backend."""
    from torchdist_magic import Distributor

    kind = request.param
    if kind == "local":
        return lambda n=2, **o: Distributor(n, local_mode=True, show=None, **o)
    if kind == "shell":
        request.getfixturevalue("shell_backend")
        return lambda n=2, **o: Distributor(n, backend="shell", show=None, **o)
    if kind == "ray":
        request.getfixturevalue("ray_connected")
        return lambda n=2, **o: Distributor(n, backend="ray", show=None, **o)
    if kind == "slurm":
        request.getfixturevalue("slurm")
        return lambda n=2, **o: Distributor(n, backend="slurm", show=None, **o)
    session = request.getfixturevalue(f"spark_{kind}")
    assert session is not None
    return lambda n=2, **o: Distributor(n, local_mode=False, show=None, **o)


#: the test session's clusters: each starts once per pytest process that needs it (a session
#: fixture), and two of one kind side by side would only share the machine's two cores
CLUSTER_GROUPS = ("spark", "slurm", "ray")
#: notebooks that start a cluster of their own kind (``tests/slurm_cluster.py``, ``ray_cluster.py``)
NOTEBOOK_CLUSTERS = {"13-slurm.ipynb": "slurm", "14-ray.ipynb": "ray"}


def cluster_group(item) -> str:
    """The cluster ``item`` runs on ("" for none): what ``pytest -n`` keeps on one worker."""
    from spark_fixtures import _spark_master_of

    names = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    params = [v for v in callspec.params.values() if isinstance(v, str)] if callspec is not None else []
    if _spark_master_of(item) or "connect_server" in names or "standalone_cluster" in names:
        return "spark"
    if {"slurm", "slurm_cluster"} & names or "slurm" in params:
        return "slurm"
    if {"ray_connected", "ray_cluster"} & names or "ray" in params:
        return "ray"
    for value in params:
        if value in NOTEBOOK_CLUSTERS:
            return NOTEBOOK_CLUSTERS[value]
    return ""


def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N --dist loadgroup`` (README's test command) the tests of one cluster run
    in one worker, in the order ``spark_fixtures`` gives them (each SparkSession starts once);
    every other test goes to whichever worker is free."""
    for item in items:
        group = cluster_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
