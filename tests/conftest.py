"""Fixtures every test file shares.  Spark's fixtures are a plugin of their own
(``spark_fixtures``); process helpers are plain functions in ``helpers``."""

import pytest

pytest_plugins = ["spark_fixtures"]


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
def local_distributor():
    """``make(num_processes, **options)`` -> a silent local-process Distributor."""
    from torchdist_magic import Distributor

    def make(num_processes=2, **options):
        return Distributor(num_processes, local_mode=True, show=None, **options)

    return make


@pytest.fixture(autouse=True)
def _no_temp_leftovers(tmp_path, monkeypatch):
    """Every test gets its own temp dir for run directories, which must be empty afterwards."""
    import tempfile

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    yield
    left = sorted(p.name for p in scratch.iterdir())
    assert not left, f"temp files left behind: {left}"


#: backends the contract suite runs against
CONTRACT_BACKENDS = [
    pytest.param("local", id="local"),
    pytest.param("local2", id="spark-local2", marks=pytest.mark.spark),
    pytest.param("cluster", id="spark-cluster", marks=pytest.mark.spark),
    pytest.param("connect", id="spark-connect", marks=pytest.mark.spark),
]


@pytest.fixture(params=CONTRACT_BACKENDS)
def dist(request):
    """``dist(num_processes, **options)`` -> a silent Distributor on the parametrized backend."""
    from torchdist_magic import Distributor

    kind = request.param
    if kind == "local":
        return lambda n=2, **o: Distributor(n, local_mode=True, show=None, **o)
    session = request.getfixturevalue(f"spark_{kind}")
    assert session is not None
    return lambda n=2, **o: Distributor(n, local_mode=False, show=None, **o)
