"""The package as users install it: the wheel ``.ci/setup`` built into ``dist/``, its metadata,
and the environments it goes into.

- The wheel holds the package and nothing else, every module of the source tree included, and
  its metadata asks for no Spark (``[spark]`` and ``[connect]`` do).
- ``.venv-bare`` (``.ci/setup``: torch and the wheel alone, no extra): ``import
  torchdist_magic``, the magic and a local run work there without pyspark, pandas or pyarrow,
  and ``--spark`` says how to install Spark (a pandas DataFrame without pyarrow, how to install
  that).
- A Databricks-like environment, where ``pyspark`` is importable but no distribution of that
  name is installed (a runtime's own Spark, Databricks Connect): README's wheel line installs
  the wheel there pulling nothing else, then a real Spark job runs through torchdist_magic.
- ``.venv-compat`` runs the lowest pyspark, ipykernel and cloudpickle that ``setup.cfg`` allows.
- The ranks import the copy of the package under test (``install_guard``), not the checkout's.
"""

from __future__ import annotations

import configparser
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import zipfile

import pytest


import torchdist_magic
from install_guard import SOURCE

REPO = SOURCE.parent
DIST = REPO / "dist"
BARE = REPO / ".venv-bare"
COMPAT = REPO / ".venv-compat"
SETUP = "bash .ci/setup"
WHEEL_NAME = f"torchdist_magic-{torchdist_magic.__version__}-py3-none-any.whl"


def wheel() -> pathlib.Path:
    path = DIST / WHEEL_NAME
    assert path.is_file(), f"no {path.relative_to(REPO)}: `{SETUP}` builds it"
    return path


def venv_python(venv: pathlib.Path) -> str:
    python = venv / "bin" / "python"
    assert python.is_file(), f"no {venv.name}: `{SETUP}` makes it"
    return str(python)


def site_packages(python: str) -> pathlib.Path:
    out = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return pathlib.Path(out.stdout.strip())


def requirements(metadata: str):
    """``[(requirement, marker)]`` of a wheel's METADATA."""
    found = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist: "):
            requirement, _, marker = line[len("Requires-Dist: ") :].partition(";")
            found.append((requirement.strip(), marker.strip()))
    return found


def name_of(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


# -- the wheel --------------------------------------------------------------------------------------
def test_the_wheel_holds_the_package_and_nothing_else():
    with zipfile.ZipFile(wheel()) as whl:
        names = whl.namelist()
    info = f"torchdist_magic-{torchdist_magic.__version__}.dist-info/"
    strays = [n for n in names if not n.startswith(("torchdist_magic/", info))]
    assert not strays, f"the wheel carries what is not the package: {strays}"
    modules = sorted(n[len("torchdist_magic/") :] for n in names if n.startswith("torchdist_magic/"))
    source = sorted(str(p.relative_to(SOURCE)) for p in SOURCE.rglob("*.py") if "__pycache__" not in p.parts)
    assert modules == source, f"the wheel and the source tree differ (`{SETUP} wheel` rebuilds it)"


def test_the_wheels_metadata_has_the_version_and_no_spark_but_in_its_extras():
    with zipfile.ZipFile(wheel()) as whl:
        metadata = whl.read(f"torchdist_magic-{torchdist_magic.__version__}.dist-info/METADATA").decode()
    assert f"\nVersion: {torchdist_magic.__version__}\n" in metadata
    required = {name_of(r) for r, marker in requirements(metadata) if not marker}
    assert "torch" in required and not required & {"pyspark", "pandas", "pyarrow"}, required
    for extra in ("spark", "connect"):
        names = {name_of(r) for r, marker in requirements(metadata) if marker == f'extra == "{extra}"'}
        assert {"pyspark", "pandas", "pyarrow"} <= names, (extra, names)
    # pandas < 3 in the Spark extras only, as pyspark advises; no other upper bound anywhere
    bounded = [(r, m) for r, m in requirements(metadata) if "<" in r and not r.startswith("pandas")]
    assert not bounded, bounded


# -- a venv without Spark -----------------------------------------------------------------------------
NO_SPARK_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys
    out = {"missing": [m for m in ("pyspark", "pandas", "pyarrow") if importlib.util.find_spec(m) is None]}
    import torchdist_magic
    out["file"] = torchdist_magic.__file__
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "torchdist_magic")
    ip.run_line_magic("config", "TorchdistMagics.view = 'text'")
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        ip.run_line_magic("torchdist", "--version")
    out["version"] = printed.getvalue()
    ip.run_cell_magic("torchdist", "--np 2 --quiet --out value", "rank * 10 + world_size")
    out["value"] = ip.user_ns["value"]
    for flags in ("--spark --np 2", "--backend spark --np 2"):
        try:
            ip.run_cell_magic("torchdist", flags, "rank")
        except UsageError as exc:
            out[flags] = str(exc)
    try:
        torchdist_magic.Distributor(2, local_mode=False, show=None).run(int)
    except ValueError as exc:
        out["local_mode=False"] = str(exc)
    print(json.dumps(out))
    """
)


def test_without_pyspark_the_magic_and_local_runs_work_and_spark_says_how_to_install_it(tmp_path):
    done = subprocess.run(
        [venv_python(BARE), "-c", NO_SPARK_SCRIPT], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["missing"] == ["pyspark", "pandas", "pyarrow"]
    assert out["file"].startswith(str(BARE)), out["file"]
    assert out["version"] == f"torchdist_magic {torchdist_magic.__version__}\n"
    assert out["value"] == 2  # rank 0's
    for key in ("--spark --np 2", "--backend spark --np 2", "local_mode=False"):
        assert "pyspark is not installed in this environment" in out[key], out
        assert 'pip install "torchdist_magic[spark]"' in out[key], out


PANDAS_WITHOUT_PYARROW = textwrap.dedent(
    """
    import importlib.util, json
    import pandas
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "torchdist_magic")
    ip.user_ns["df"] = pandas.DataFrame({"x": [1.0, 2.0, 3.0, 4.0]})
    out = {"pyarrow": importlib.util.find_spec("pyarrow") is not None}
    try:
        ip.run_cell_magic("torchdist", "--np 2 --quiet --data df", "rank")
    except UsageError as exc:
        out["error"] = str(exc)
    print(json.dumps(out))
    """
)


def test_a_pandas_dataframe_without_pyarrow_says_how_to_install_it(tmp_path):
    """pandas (with what it needs, from .venv) on PYTHONPATH of the bare venv, pyarrow nowhere."""
    own = pathlib.Path(pandas_location()).parent
    shared = tmp_path / "pandas-only"
    shared.mkdir()
    for name in ("pandas", "numpy", "numpy.libs", "pytz", "six.py"):
        (shared / name).symlink_to(own / name)
    done = subprocess.run(
        [venv_python(BARE), "-c", PANDAS_WITHOUT_PYARROW],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(shared)),
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {
        "pyarrow": False,
        "error": "a pandas DataFrame travels to the local ranks as Arrow files, and pyarrow is not installed in "
        'this environment: pip install pyarrow (the "torchdist_magic[spark]" extra brings it too)',
    }


def pandas_location() -> str:
    import pandas

    return os.path.dirname(pandas.__file__)


# -- pyspark importable, not installed (a Databricks runtime, Databricks Connect) ----------------------
SPARK_JOB = textwrap.dedent(
    """
    import json, os, sys
    from importlib import metadata
    from pyspark.sql import SparkSession
    try:
        metadata.version("pyspark")
        installed = True
    except metadata.PackageNotFoundError:
        installed = False
    work = sys.argv[1]
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.local.dir", os.path.join(work, "local"))
        .config("spark.sql.warehouse.dir", os.path.join(work, "warehouse"))
        .getOrCreate()
    )
    try:
        import torchdist_magic

        def job():
            import torchdist_magic
            return [torchdist_magic.rank() * 10 + 7, torchdist_magic.__file__]

        value = torchdist_magic.Distributor(2, local_mode=False, show=None).run(job)
    finally:
        spark.stop()
    print(json.dumps({"installed": installed, "value": value, "file": torchdist_magic.__file__}))
    """
)


def venv_over(tmp_path, base: pathlib.Path) -> pathlib.Path:
    """A new venv whose own site-packages is empty and that sees the packages of ``base`` (a
    site-packages) but torchdist_magic as installed (a ``.pth``), with a ``pip``: its bin
    directory.  Installing into it takes seconds: the rest is there."""
    shared = tmp_path / "installed-packages"
    shared.mkdir()
    for entry in base.iterdir():
        if not entry.name.startswith(("torchdist_magic", "__editable__")):
            (shared / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site_packages(str(venv / "bin" / "python")) / "installed.pth").write_text(f"{shared}\n")
    (venv / "bin" / "pip").write_text(f'#!/bin/sh\nexec "{venv}/bin/python" -m pip "$@"\n')
    (venv / "bin" / "pip").chmod(0o755)
    return venv / "bin"


def pip_env(bin_dir: pathlib.Path, **more: str) -> dict:
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        PIP_NO_INDEX="1",  # nothing may come from an index: all it needs is there
        **more,
    )
    env.pop("PYTHONPATH", None)
    env.update(more)
    return env


def databricks_like(tmp_path) -> tuple:
    """A venv over ``.venv-bare``'s packages (``venv_over``), with this interpreter's ``pyspark``
    and ``py4j`` on ``PYTHONPATH`` only (no distribution of theirs installed): ``(bin
    directory, env)``."""
    import py4j
    import pyspark

    bin_dir = venv_over(tmp_path, site_packages(venv_python(BARE)))
    spark_path = tmp_path / "spark-python"
    spark_path.mkdir()
    for module in (pyspark, py4j):
        folder = pathlib.Path(module.__file__).parent
        (spark_path / folder.name).symlink_to(folder)
    env = pip_env(bin_dir, PYTHONPATH=str(spark_path), PYSPARK_PYTHON=str(bin_dir / "python"))
    env.pop("SPARK_HOME", None)
    return bin_dir, env


def readme_install_lines():
    """README's install lines, ``<version>`` as this release's."""
    text = (REPO / "README.md").read_text()
    return [
        line.split(" #")[0].strip().replace("<version>", torchdist_magic.__version__)
        for line in text.splitlines()
        if re.match(r"\s*%?pip install ", line)
    ]


def test_readmes_wheel_line_installs_where_pyspark_is_importable_but_not_installed_then_spark_runs(tmp_path):
    (line,) = [x for x in readme_install_lines() if x.startswith("pip install dist/")]
    assert line == f"pip install dist/{WHEEL_NAME}"
    bin_dir, env = databricks_like(tmp_path)
    report = tmp_path / "report.json"
    done = subprocess.run(
        ["bash", "-c", f"{line} --quiet --report {report}"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    installed = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installed == ["torchdist_magic"]  # no pyspark, nothing else: the rest was there
    work = tmp_path / "spark"
    done = subprocess.run(
        [str(bin_dir / "python"), "-c", SPARK_JOB, str(work)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["installed"] is False  # pyspark ran without a distribution of that name
    assert out["file"].startswith(str(tmp_path / "venv")), out["file"]
    value, rank_file = out["value"]
    assert value == 7 and rank_file == out["file"]  # rank 0's, with the wheel just installed


def test_readmes_clone_line_installs_the_checkout_with_its_spark_extra(tmp_path):
    """In a copy of the checkout's files that a build reads, over this venv's packages (pyspark
    installed): the build uses this venv's setuptools (no index here), nothing else is pulled."""
    (line,) = [x for x in readme_install_lines() if x.startswith('pip install ".')]
    assert line == 'pip install ".[spark]"'
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        (clone / name).write_bytes((REPO / name).read_bytes())
    import shutil

    shutil.copytree(SOURCE, clone / "torchdist_magic", ignore=shutil.ignore_patterns("__pycache__"))
    bin_dir = venv_over(tmp_path, site_packages(sys.executable))
    report = tmp_path / "report.json"
    done = subprocess.run(
        ["bash", "-c", f"{line} --quiet --no-build-isolation --report {report}"],
        cwd=clone,
        env=pip_env(bin_dir),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]] == ["torchdist_magic"]
    code = "import pyspark, torchdist_magic; print(torchdist_magic.__file__)"
    done = subprocess.run(
        [str(bin_dir / "python"), "-c", code], cwd=tmp_path, env=pip_env(bin_dir), capture_output=True, text=True
    )
    assert done.stdout.startswith(str(tmp_path / "venv")), done.stdout + done.stderr


# -- the lower bounds ---------------------------------------------------------------------------------
def lower_bounds():
    """``{name: lowest version}`` of pyspark, ipykernel, cloudpickle and msgspec in setup.cfg."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = config["options"]["install_requires"].split("\n") + config["options.extras_require"]["spark"].split("\n")
    bounds = {}
    for line in lines:
        found = re.match(r"(pyspark|ipykernel|cloudpickle|msgspec)>=([0-9.]+)", line.strip())
        if found:
            bounds[found.group(1)] = found.group(2)
    assert sorted(bounds) == ["cloudpickle", "ipykernel", "msgspec", "pyspark"], bounds
    return bounds


def test_the_compat_venv_runs_the_lowest_versions_setup_cfg_allows():
    code = (
        "import json; from importlib import metadata; "
        "print(json.dumps({n: metadata.version(n) for n in ('pyspark', 'ipykernel', 'cloudpickle', 'msgspec')}))"
    )
    done = subprocess.run([venv_python(COMPAT), "-c", code], capture_output=True, text=True, check=True)
    from packaging.version import Version

    installed = {name: Version(v) for name, v in json.loads(done.stdout).items()}
    assert installed == {name: Version(v) for name, v in lower_bounds().items()}


# -- the processes the tests start ----------------------------------------------------------------------
def where_torchdist_magic_is():
    import torchdist_magic

    return torchdist_magic.__file__


def test_the_ranks_import_the_copy_under_test(local_distributor):
    run = local_distributor(2, all_ranks=True).submit(where_torchdist_magic_is)
    assert run.result(120) == [torchdist_magic.__file__] * 2


def test_a_detached_runs_supervisor_and_ranks_import_the_copy_under_test(home):
    from helpers import assert_nothing_survives

    handle = torchdist_magic.Distributor(2, show=None, detach=True, all_ranks=True).run(where_torchdist_magic_is)
    assert handle.result(120) == [torchdist_magic.__file__] * 2
    assert_nothing_survives(handle.run_id, handle.record.pid)


@pytest.mark.kernel
def test_a_kernel_started_in_the_checkout_imports_the_copy_under_test():
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="python3")  # this interpreter
    km.start_kernel(cwd=str(REPO))  # where IPython puts the working directory on sys.path, unless told not to
    client = km.client()
    client.start_channels()
    printed = []

    def keep(msg):
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])

    try:
        client.wait_for_ready(timeout=60)
        code = "import torchdist_magic; print(torchdist_magic.__file__)"
        assert client.execute_interactive(code, timeout=60, output_hook=keep)["content"]["status"] == "ok"
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)
    assert "".join(printed).strip() == torchdist_magic.__file__


# -- the install guard (tests/install_guard.py) ----------------------------------------------------------
def copy_of_package(root: pathlib.Path, **files: str) -> pathlib.Path:
    package = root / "torchdist_magic"
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    (package / "core" / "version.py").write_text('__version__ = "0.1.0"\n')
    for name, text in files.items():
        (package / name).write_text(text)
    return package


def test_the_guard_refuses_the_source_tree_in_ci_only(tmp_path):
    from install_guard import install_problem

    source = copy_of_package(tmp_path / "checkout")
    problem = install_problem(source, source, ci=True)
    assert problem.startswith("CI tests the installed wheel, but torchdist_magic was imported from the source tree (")
    assert "(.venv/bin/pytest ...)" in problem
    assert install_problem(source, source, ci=False) is None  # a developer testing the working tree


def test_the_guard_refuses_a_stale_install_and_says_how_to_reinstall(tmp_path):
    from install_guard import install_problem

    source = copy_of_package(tmp_path / "checkout", **{"magic.py": "new = True\n"})
    installed = copy_of_package(tmp_path / "site-packages")
    (installed / "core" / "__pycache__").mkdir()
    (installed / "core" / "__pycache__" / "version.cpython-311.pyc").write_bytes(b"\0")  # not a difference
    for ci in (False, True):
        problem = install_problem(installed, source, ci=ci)
        assert problem.startswith(
            f"the installed torchdist_magic ({installed}) is not this checkout's source: magic.py differ."
        )
        assert "Reinstall it with `bash .ci/setup wheel`" in problem
    (installed / "magic.py").write_text("new = True\n")
    assert install_problem(installed, source, ci=True) is None
    (installed / "core" / "version.py").write_text('__version__ = "0.2.0"\n')
    assert "core/version.py differ" in install_problem(installed, source)
