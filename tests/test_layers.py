"""Layers point one way: no module imports one above it in the data flow of DESIGN.md
(capture -> distributor -> backend -> launcher -> worker; events -> channel -> RunState -> view),
and no modules import each other in a circle, not even within a layer.  Function-level (lazy)
imports count too."""

import ast
import pathlib

import torchdist_magic

PACKAGE = pathlib.Path(torchdist_magic.__file__).parent

#: bottom first; a module may import its own layer and those below it
LAYERS = [
    ("contract", {"events", "timing", "options", "procs", "tls", "sysmetrics", "gpu_metrics", "fdlimit",
                  "privdir"}),
    ("rank side", {"errors", "runtime", "rank_shell", "job", "rankenv", "data", "values", "rank_debugger"}),
    ("worker and transport", {"worker", "channel", "framemac", "hostcopy", "valueupload"}),
    ("launch and state", {"launcher", "state", "stragglers"}),
    # backends/, bottom first: the interface, what runs in an executor, the driver's side of a
    # Spark stage, the executors' interpreter, the backends themselves, the factory
    ("backend interface", {"backends.base"}),
    ("spark executor side", {"backends.spark_task"}),
    ("spark driver side", {"backends.spark_stage"}),
    ("spark interpreter", {"backends.spark_python"}),
    ("backends", {"backends.local", "backends.spark_classic", "backends.spark_connect"}),
    ("backend factory", {"backends"}),
    ("warm pools", {"pool"}),
    ("debugger console", {"debugger"}),
    ("runs", {"capture", "distributor", "tracking"}),
    ("views", {"view"}),  # every view.* module but the panel
    ("entry points", {"api", "magic", "view.panel", "__init__"}),
]


def layer_of(module: str) -> int:
    for index, (_, names) in enumerate(LAYERS):
        if module in names:
            return index
    if module.startswith("view."):
        return layer_of("view")
    raise AssertionError(f"torchdist_magic.{module} has no layer in this test: add it to LAYERS")


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
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("torchdist_magic"):
                target = node.module[len("torchdist_magic"):].lstrip(".")
            else:
                continue
            for alias in node.names:  # ``from pkg import module`` or ``from module import name``
                yield _known(".".join(filter(None, [target, alias.name])))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torchdist_magic."):
                    yield _known(alias.name[len("torchdist_magic."):])


def _known(name: str) -> str:
    """The module a dotted name refers to (``events.Failure`` -> ``events``)."""
    modules = {m for m, _ in module_names()}
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or "__init__"


def test_every_import_points_down():
    upward = []
    for module, path in module_names():
        for target in imported(module, path):
            if target != module and layer_of(target) > layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "\n".join(upward)


def import_cycles():
    """Every circle of imports between torchdist_magic's modules, each as a list of modules."""
    graph = {m: {t for t in imported(m, p) if t != m} for m, p in module_names()}
    cycles, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
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
    assert "view" in found["api"]            # a function-level import
    assert "events" in found["state"]        # a relative import
    assert "backends.local" in found["backends"]
    assert "backends.base" in found["backends.local"]     # ``from .base import ...``
    assert "runtime" in found["worker"]         # ``from torchdist_magic import runtime``
