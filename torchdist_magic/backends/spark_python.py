"""Which Python the Spark executors run the ranks on, checked before any training.

Spark starts its Python workers with ``spark.pyspark.python`` / ``PYSPARK_PYTHON``, or
``python3`` from the executor's PATH.  That interpreter may lack torch or torchdist_magic, or
have another cloudpickle, and the user would see ``ModuleNotFoundError`` or ``Can't get
attribute '_function_setstate'`` from deep inside Spark.  So before a run's barrier stage, a
small probe stage (standard library only, pickled by value) asks the executors what they have:

- the interpreter the user chose (``PYSPARK_PYTHON`` or ``spark.pyspark.python``, also when set
  after the session started), else Spark's own (``SparkContext.pythonExec``), is probed and used
  when it matches this notebook's (Python, torch, cloudpickle, torchdist_magic);
- else, unless the user chose that interpreter, this notebook's own (``sys.executable``) is
  used where it exists on every executor (``local[...]``, ``local-cluster[...]``, a standalone
  cluster on this machine, clusters that share the driver's environment) and matches;
- else the run is refused with both sides' versions and how to fix it.

The answer is kept per SparkContext and interpreter (per Connect session), so only a
session's first run probes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import weakref
from typing import Dict, List, Optional, Tuple

from .spark_stage import spark_failure

#: the packages whose versions must agree between the notebook and the ranks
PACKAGES = ("torch", "cloudpickle", "torchdist_magic")

#: runs on the executors with nothing but the standard library; compiled outside any module of
#: this package so that PySpark pickles it by value (an executor without torchdist_magic can run it)
_PROBE_SOURCE = '''
def probe(driver_python, packages, _partition):
    import importlib.metadata, json, os, socket, sys
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    yield json.dumps({
        "executable": sys.executable, "python": "%d.%d.%d" % sys.version_info[:3],
        "host": socket.gethostname(), "packages": {p: version(p) for p in packages},
        "driver_python_here": os.access(driver_python, os.X_OK)})
'''

#: the same probe as a ``mapInArrow`` function, for Spark Connect sessions
_ARROW_PROBE_SOURCE = (
    _PROBE_SOURCE
    + '''
def probe_arrow(driver_python, packages, batches):
    import pyarrow as pa
    for _ in batches:
        pass
    for text in probe(driver_python, packages, None):
        yield pa.RecordBatch.from_pydict({"facts": [text]})
'''
)

_chosen: Dict[tuple, str] = {}
#: Connect sessions whose executors were checked; weak, so that a new session is never taken
#: for an old one that happened to live at the same address
_checked_connect: "weakref.WeakSet" = weakref.WeakSet()
_chosen_lock = threading.Lock()
#: serialises the swap of ``SparkContext.pythonExec`` around building a stage's function
PYTHON_EXEC_LOCK = threading.Lock()


class InterpreterMismatch(ValueError):
    """The executors' Python cannot run this notebook's ranks."""


def _probe_function(name: str = "probe"):
    namespace: dict = {"__name__": "torchdist_probe"}
    exec(compile(_ARROW_PROBE_SOURCE, "<torchdist interpreter probe>", "exec"), namespace)
    return namespace[name]


def local_facts() -> dict:
    """This notebook's interpreter, described by the same probe the executors run."""
    facts = json.loads(next(_probe_function()(sys.executable, PACKAGES, None)))
    del facts["driver_python_here"]
    return facts


def _public(version: Optional[str]) -> Optional[str]:
    """``2.13.0+cpu`` -> ``2.13.0``: a CPU driver and CUDA executors may differ only there."""
    return version.split("+", 1)[0] if version else version


def differences(mine: dict, theirs: dict) -> List[str]:
    """What differs between two interpreters, as ``torch 2.13.0 here, 2.4.1 there``."""
    out = []
    if mine["python"].rsplit(".", 1)[0] != theirs["python"].rsplit(".", 1)[0]:
        out.append(f"Python {mine['python']} here, {theirs['python']} there")
    for name in PACKAGES:
        here, there = mine["packages"].get(name), theirs["packages"].get(name)
        if _public(here) != _public(there):
            out.append(f"{name} {here or 'not installed'} here, {there or 'not installed'} there")
    return out


def describe(facts: dict) -> str:
    packages = ", ".join(f"{p} {v or 'not installed'}" for p, v in facts["packages"].items())
    return f"{facts['executable']} on {facts['host']}: Python {facts['python']}, {packages}"


@contextlib.contextmanager
def python_exec(sc, python: str):
    """While in the block, Python functions of stages built on ``sc`` run with ``python``.

    PySpark builds a stage's function with ``SparkContext.pythonExec``; it is set only while
    the block builds it, so other jobs of the session are unaffected.
    """
    with PYTHON_EXEC_LOCK:
        previous, sc.pythonExec = sc.pythonExec, python
        try:
            yield
        finally:
            sc.pythonExec = previous


def build_with_python(sc, rdd, python: str):
    """Build ``rdd``'s Java-side Python function now, for ``python``."""
    with python_exec(sc, python):
        rdd._jrdd  # noqa: B018  (the property builds and caches the function)
    return rdd


def _probe(sc, python: str, tasks: int) -> Tuple[List[dict], Optional[BaseException]]:
    import functools

    rdd = sc.parallelize(range(tasks), tasks).mapPartitions(
        functools.partial(_probe_function(), sys.executable, PACKAGES)
    )
    try:
        rows = build_with_python(sc, rdd, python).collect()
    except Exception as exc:  # the interpreter did not even start, or pyspark failed in it  # noqa: BLE001
        return [], exc
    return [json.loads(r) for r in rows], None


def user_choice(sc) -> str:
    """The interpreter the user chose for the executors, or ``""``."""
    return os.environ.get("PYSPARK_PYTHON") or sc.getConf().get("spark.pyspark.python", "")


def choose_python(sc, tasks: int) -> str:
    """The interpreter the ranks' tasks run on (see the module docstring); raises
    ``InterpreterMismatch`` when no interpreter there matches this notebook's."""
    chosen = user_choice(sc)
    first = chosen or sc.pythonExec  # what is probed is what the refusal names
    key = (sc.applicationId, first, bool(chosen), sys.executable)
    with _chosen_lock:
        if key in _chosen:
            return _chosen[key]
    mine = local_facts()
    tasks = max(1, tasks)
    facts, error = _probe(sc, first, tasks)
    python = first
    problems = [f for f in facts if differences(mine, f)]
    if (
        (error or problems)
        and not chosen
        and first != sys.executable
        and (error or all(f["driver_python_here"] for f in facts))
    ):
        own, own_error = _probe(sc, sys.executable, tasks)
        if own_error is None and not any(differences(mine, f) for f in own):
            facts, error, problems, python = own, None, [], sys.executable
    if error is not None or problems:
        raise InterpreterMismatch(_mismatch_message(sc, mine, problems, error, chosen))
    with _chosen_lock:
        _chosen[key] = python
    return python


def _mismatch_message(sc, mine: dict, problems: List[dict], error: Optional[BaseException], chosen: str) -> str:
    which = f"the interpreter you chose ({chosen})" if chosen else f"Spark's interpreter ({sc.pythonExec})"
    lines = [
        f"the Spark executors cannot run the ranks with {which}, and this notebook's "
        f"interpreter is not there to use instead:"
    ]
    if error is not None:
        _, failure = spark_failure(error)
        lines.append(f"  executors: Python did not start: {failure.exc_type}: {failure.message}")
    shown = []
    for facts in problems:
        text = describe(facts)
        if text not in shown and len(shown) < 3:
            shown.append(text)
            lines.append(f"  executors:     {text}")
            lines.append(f"    differs in: {'; '.join(differences(mine, facts))}")
    lines.append(f"  this notebook: {describe(mine)}")
    lines.append(
        "Install the notebook's versions on every executor, or point the executors at a "
        "matching interpreter with spark.pyspark.python (or PYSPARK_PYTHON), for example "
        "an environment shipped with spark.archives=env.tar.gz#env and "
        "spark.pyspark.python=./env/bin/python"
    )
    return "\n".join(lines)


def check_connect_python(spark, tasks: int) -> None:
    """Refuse a run whose Spark Connect server's executors run a Python unlike this notebook's.

    Over Spark Connect the server decides the executors' interpreter; a client can only check it.
    """
    import functools

    with _chosen_lock:
        if spark in _checked_connect:
            return
    probe = functools.partial(_probe_function("probe_arrow"), sys.executable, PACKAGES)
    tasks = max(1, tasks)
    rows = spark.range(0, tasks, 1, numPartitions=tasks).mapInArrow(probe, "facts string").collect()
    mine = local_facts()
    problems = [f for f in (json.loads(r["facts"]) for r in rows) if differences(mine, f)]
    if problems:
        lines = [
            "the Spark Connect server's executors cannot run the ranks: their Python differs from this notebook's:"
        ]
        for text in dict.fromkeys(describe(f) for f in problems):
            lines.append(f"  executors:     {text}")
        lines.append(f"    differs in: {'; '.join(differences(mine, problems[0]))}")
        lines.append(f"  this notebook: {describe(mine)}")
        lines.append(
            "Install the same versions on both sides: on the cluster (%pip install in a "
            "Databricks notebook, or the cluster's libraries), or in this notebook's environment"
        )
        raise InterpreterMismatch("\n".join(lines))
    with _chosen_lock:
        _checked_connect.add(spark)
