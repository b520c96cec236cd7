"""The package is laid out by process (DESIGN.md, "Three processes, one package folder each"), and
its imports point one way:

    top (api, magic, panel, capture, __init__) -> view -> handles -> supervise -> driver
        -> backends -> launch -> wire -> core
    rank -> wire -> core

Strings that name a module or a file of the package (``python -m ...``, the rank's files that a
stack leaves out) are checked too: each names one that is there.

The driver's side is three homes by where the code runs: ``driver`` is the run's owner (in the
kernel, or in a detached run's supervising process), ``supervise`` the supervising process's own
code (its journal, its feed's server), ``handles`` the kernel's handles on a run another process
holds.  The owner imports neither of the others; the views take the handles, never the
supervising process's code.  ``capture`` (cell -> job) needs only ``core``.

``launch`` (beside each rank) and ``rank`` (the rank's worker) never import each other, and the
driver's side (``backends``, ``driver``, ``view``) never imports the rank's code: what they share
lives in ``core``.  No modules import each other in a circle, not even within a package.
Function-level (lazy) imports count too."""

import ast
import pathlib

import torchdist_magic

PACKAGE = pathlib.Path(torchdist_magic.__file__).parent

#: each package folder and the folders its modules may import (besides their own)
MAY_IMPORT = {
    "core": set(),
    "wire": {"core"},
    "rank": {"wire", "core"},
    "launch": {"wire", "core"},
    "backends": {"launch", "wire", "core"},
    "driver": {"backends", "launch", "wire", "core"},
    "supervise": {"driver", "backends", "launch", "wire", "core"},
    "handles": {"supervise", "driver", "backends", "launch", "wire", "core"},
    "view": {"handles", "driver", "backends", "launch", "wire", "core"},
    # the public names: the Python API, the magics, the panel, capture, and the helpers a job calls
    "top": {"view", "handles", "supervise", "driver", "backends", "launch", "wire", "core", "rank"},
}
TOP = {"__init__", "__main__", "api", "capture", "cli", "magic", "panel"}


def package_of(module: str) -> str:
    if module in TOP:
        return "top"
    folder = module.split(".")[0]
    if folder not in MAY_IMPORT:
        raise AssertionError(
            f"torchdist_magic.{module} is in no package this test knows: put it in one of "
            f"{sorted(MAY_IMPORT)} or add it to TOP"
        )
    return folder


def module_names():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        yield ".".join(parts), path


def imported(module: str, path: pathlib.Path):
    """Names of torchdist_magic modules that ``module`` imports, relative to the package."""
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    if module == "__init__":
        package = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("torchdist_magic"):
                target = node.module[len("torchdist_magic") :].lstrip(".")
            else:
                continue
            for alias in node.names:  # ``from pkg import module`` or ``from module import name``
                yield _known(".".join(filter(None, [target, alias.name])))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torchdist_magic."):
                    yield _known(alias.name[len("torchdist_magic.") :])


def _known(name: str) -> str:
    """The module a dotted name refers to (``events.Failure`` -> ``events``)."""
    modules = {m for m, _ in module_names()}
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or "__init__"


def test_every_module_sits_in_a_package_of_the_layout():
    assert {package_of(m) for m, _ in module_names()} == set(MAY_IMPORT)


def test_every_import_points_down():
    upward = []
    for module, path in module_names():
        for target in imported(module, path):
            source, dest = package_of(module), package_of(target)
            if dest != source and dest not in MAY_IMPORT[source]:
                upward.append(f"{module} ({source}) imports {target} ({dest})")
    assert not upward, "\n".join(upward)


def test_procs_imports_nothing_of_the_package():
    """A Spark task's guard runs ``core.procs``' source on its own, where the package may not be
    importable (``launch.remote.guard_source``)."""
    path = PACKAGE / "core" / "procs.py"
    assert set(imported("core.procs", path)) == set()
    assert "from ." not in path.read_text()


def test_the_rank_and_the_launcher_never_import_each_other_nor_the_driver_the_rank():
    assert "rank" not in MAY_IMPORT["launch"] and "launch" not in MAY_IMPORT["rank"]
    assert not {"rank"} & (MAY_IMPORT["driver"] | MAY_IMPORT["backends"] | MAY_IMPORT["view"])


def test_the_owner_imports_neither_the_supervising_process_nor_the_handles():
    """A run's owner runs in the kernel and in a supervising process alike: it knows neither
    home above it, and the views read a run through the handles, never the supervisor."""
    assert not {"supervise", "handles", "view"} & MAY_IMPORT["driver"]
    assert "supervise" not in MAY_IMPORT["view"] and "handles" in MAY_IMPORT["view"]
    assert "handles" not in MAY_IMPORT["supervise"]
    found = {
        (package_of(module), package_of(target)) for module, path in module_names() for target in imported(module, path)
    }
    assert ("driver", "supervise") not in found and ("driver", "handles") not in found
    assert ("view", "supervise") not in found
    assert ("view", "handles") in found  # the rule is not vacuous: the widget's merged log


def test_capture_needs_only_the_agreements():
    """Cell -> job runs before any run exists: it imports ``core`` alone."""
    path = PACKAGE / "capture.py"
    assert {package_of(target) for target in imported("capture", path)} == {"core"}


def test_the_check_finds_an_import_that_points_up(tmp_path, monkeypatch):
    """The check itself: a module of ``core`` that imports the driver is named."""
    fake = tmp_path / "torchdist_magic"
    (fake / "core").mkdir(parents=True)
    (fake / "driver").mkdir()
    for init in (fake / "__init__.py", fake / "core" / "__init__.py", fake / "driver" / "__init__.py"):
        init.write_text("")
    (fake / "driver" / "state.py").write_text("")
    (fake / "core" / "events.py").write_text("def f():\n    from ..driver.state import RunState\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    found = {m: set(imported(m, p)) for m, p in module_names()}
    assert found["core.events"] == {"driver.state"}
    with __import__("pytest").raises(AssertionError, match=r"core\.events \(core\) imports driver\.state \(driver\)"):
        test_every_import_points_down()


def import_cycles():
    """Every circle of imports between torchdist_magic's modules, each as a list of modules."""
    graph = {m: {t for t in imported(m, p) if t != m} for m, p in module_names()}
    cycles, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_no_modules_import_each_other_in_a_circle():
    assert import_cycles() == []


def test_the_check_sees_lazy_and_relative_imports():
    found = dict((m, set(imported(m, p))) for m, p in module_names())
    assert "view" in found["api"]  # a function-level import
    assert "core.events" in found["driver.state"]  # a relative import, one package up
    assert "backends.registry" in found["backends"]  # ``from .registry import ...``
    assert "backends.base" in found["backends.local"]  # ``from .base import ...``
    assert "rank.runtime" in found["rank.worker"]  # ``from torchdist_magic.rank import runtime``


NAMED = __import__("re").compile(r"torchdist_magic(?:[./][A-Za-z_][A-Za-z0-9_]*)+(?:\.py)?")


def _top_level_names(path: pathlib.Path) -> set:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if path.name == "__init__.py":  # a package's lazy names (``_LAZY``) are its names too
        names |= set(getattr(torchdist_magic, "_LAZY", {})) if path.parent == PACKAGE else set()
    return names


def stale_names():
    """Strings in the package that name one of its modules (``python -m torchdist_magic.x``, a
    file of it, a backend's entry point) where no such module, file or name is: a module moved
    and a string left behind, which no import shows."""
    modules = dict(module_names())
    stale = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            for named in NAMED.findall(node.value):
                if "/" in named:
                    if not (PACKAGE.parent / named).exists():
                        stale.append(f"{module}: {named!r}")
                    continue
                parts = named.split(".")[1:]
                found = next(
                    (n for n in range(len(parts), -1, -1) if ".".join(parts[:n] or ["__init__"]) in modules), 0
                )
                rest = parts[found:]
                if rest and rest[0] not in _top_level_names(modules[".".join(parts[:found] or ["__init__"])]):
                    stale.append(f"{module}: {named!r}")
    return stale


def test_every_module_a_string_names_is_there():
    assert stale_names() == []


def test_the_check_finds_a_string_that_names_a_moved_module(tmp_path, monkeypatch):
    fake = tmp_path / "torchdist_magic"
    (fake / "driver").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "driver" / "__init__.py").write_text("")
    (fake / "driver" / "state.py").write_text("X = 1\n")
    (fake / "driver" / "start.py").write_text(
        'A = ["-m", "torchdist_magic.driver.supervisor"]\nB = "torchdist_magic.driver.state.X"\n'
        'C = "torchdist_magic/rank/worker.py"\n'
    )
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert sorted(stale_names()) == [
        "driver.start: 'torchdist_magic.driver.supervisor'",
        "driver.start: 'torchdist_magic/rank/worker.py'",
    ]


def test_a_rank_and_its_launcher_need_no_msgspec():
    """Only the driver decodes with msgspec (``core.recorddecoder``): a rank on an executor that
    lacks it encodes its records, decodes the driver's and runs its launcher and its host's relay
    with the standard library alone."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['msgspec'] = None\n"  # an import of it fails
        "import torchdist_magic.rank.worker, torchdist_magic.launch.launcher, torchdist_magic.wire.client\n"
        "import torchdist_magic.wire.relay\n"  # a host relay runs where the ranks run
        "from torchdist_magic.core import events\n"
        "from torchdist_magic.wire.batching import encode_batch\n"
        "assert encode_batch([events.Metrics.point(0, 1, {'loss': 0.5}), events.Log(rank=0, line='x')], 0)\n"
        "assert events.loads(events.dumps(events.Stop(rank=0, grace=1.0))) == events.Stop(rank=0, grace=1.0)\n"
        "assert not any(m.startswith('torchdist_magic.core.recorddecoder') for m in sys.modules)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
