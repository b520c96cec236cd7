"""The docs site's pages that are generated from the code when the site is built, so that they
cannot drift from it: the flags, keywords and ``%config`` reference (from ``LaunchOptions`` and
the magic's traits), the API reference (one mkdocstrings block per public name of
``torchdist_magic``, wherever the name is defined today) and the event contract (from the records
of ``core.events`` and who may send them).

Each function returns a page's Markdown; ``docs/hooks.py`` adds them to the site, and
``tests/test_docs.py`` reads them without MkDocs.  Importing this module imports nothing of the
package: each function imports what it documents.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap

#: the public names of ``torchdist_magic`` on the API page, by section; every name of its
#: ``__all__`` is in exactly one (``tests/test_docs.py`` checks it), plus ``RunState``, the type
#: of ``Run.state``, which has no top-level name
API_SECTIONS = (
    (
        "Launching",
        "Run a function, a script or a cell's job, and follow it.",
        ("Distributor", "Run", "RunHandle", "last_run", "LaunchOptions"),
    ),
    (
        "The run's state",
        "What a run knows about itself and its ranks (`run.state`), which every view reads.",
        ("RunState",),
    ),
    (
        "Runtime helpers",
        "What a job calls on its rank. In a `%%torchdist` cell `rank`, `local_rank`, "
        "`world_size`, `device` and `is_main` are values; functions and scripts call them.",
        (
            "rank",
            "world_size",
            "local_rank",
            "local_world_size",
            "host_ranks",
            "is_main",
            "device",
            "progress",
            "report",
            "restart_count",
            "save_checkpoint",
            "load_checkpoint",
            "shard",
            "RankStopped",
        ),
    ),
    ("Warm pools", "The live pools of `--warm` runs.", ("pools", "shutdown_pools")),
    (
        "Runs that outlive the kernel",
        "Every run's record, and a detached run from any kernel "
        "(see [Runs that outlive the kernel](../guide/detached.md)).",
        ("runs", "attach", "stop"),
    ),
    (
        "Backends",
        "Where ranks start, by name: a package adds one (see [Writing a backend](../design/backends.md)).",
        ("register_backend", "unregister_backend"),
    ),
    (
        "Errors",
        "What a run raises in the notebook.",
        (
            "RankFailure",
            "JobTimeout",
            "HangTimeout",
            "ResultTimeout",
            "NotAvailable",
            "RunCancelled",
            "MlflowUnavailable",
            "TrackingError",
        ),
    ),
    (
        "The IPython extension",
        "`%load_ext torchdist_magic` and `%unload_ext torchdist_magic`.",
        ("load_ipython_extension", "unload_ipython_extension"),
    ),
)


#: the driver's own methods of a run's state, which feed it and which a user never calls: left off
#: its entry (mkdocstrings filters; a name that is gone filters nothing)
DRIVER_ONLY = {
    "RunState": (
        "refused",
        "listen",
        "apply",
        "restart",
        "begin_stacks",
        "wait_stacks",
        "begin_collectives",
        "wait_collectives",
        "set_verdict",
        "finish",
    )
}


def _cell(text: str) -> str:
    """Text for one cell of a Markdown table."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{f.default_factory()!r}`"  # type: ignore[misc]
    return "required"


def _flag_text(kwargs: dict, flag: str) -> str:
    metavar = kwargs.get("metavar")
    if kwargs.get("choices"):
        metavar = "{" + ",".join(kwargs["choices"]) + "}"
    if kwargs.get("action") in ("store_true",) or kwargs.get("nargs") == 0 or "const" in kwargs:
        return f"`{flag}`"
    return f"`{flag} {metavar}`" if metavar else f"`{flag}`"


def flags_reference() -> str:
    """The reference page of every way to set a launch option: the magic's flags (with
    ``%%torchdist?``'s text), ``Distributor``'s keywords and ``%config TorchdistMagics``."""
    from torchdist_magic.core.options import option_fields
    from torchdist_magic.core.flags import flag_specs
    from torchdist_magic.magic import TorchdistMagics

    specs = {args[0]: kwargs for args, kwargs in flag_specs()}
    fields = option_fields()
    field_flags = set()
    out = [
        "# Flags, keywords and `%config`",
        "",
        "Generated from `torchdist_magic.LaunchOptions` and the magic's traits when this site was "
        "built: every launch option is one field of `LaunchOptions`, which gives the "
        "`%%torchdist` flag, the `Distributor` keyword (`Distributor(num_processes, local_mode, "
        "use_gpu, **options)`, and `Distributor.from_options(LaunchOptions(...))`) and the "
        "launch panel's control alike.",
        "",
        "## Launch options",
        "",
        "| flag | keyword | default | what it does |",
        "|---|---|---|---|",
    ]
    for f in fields:
        flag = f.metadata["flag"]
        flags = [_flag_text(specs[flag], flag)]
        field_flags.add(flag)
        helps = [f.metadata["help"]]
        if "negative" in f.metadata:
            off, off_help = f.metadata["negative"]
            flags.append(f"`{off}`")
            field_flags.add(off)
            helps.append(f"`{off}`: {off_help}")
        out.append(f"| {'<br>'.join(flags)} | `{f.name}` | {_default(f)} | {_cell(' '.join(helps))} |")
    out += [
        "",
        "A flag that is not given takes its value from `%config` (below) or the field's default; "
        "`None` means \"not set\" (no deadline, or the backend's choice).",
        "",
        "## Flags of the magic only",
        "",
        "These have no `LaunchOptions` field: they say what the notebook does with the run.",
        "",
        "| flag | what it does |",
        "|---|---|",
    ]
    for flag, kwargs in specs.items():
        if flag in field_flags:
            continue
        name = f"`{flag}`" if not flag.startswith("-") else _flag_text(kwargs, flag)
        out.append(f"| {name} | {_cell(kwargs.get('help', ''))} |")
    out += [
        "",
        "## `%config TorchdistMagics`",
        "",
        "Lasting defaults for every cell of the session, e.g. `%config TorchdistMagics.default_np = 4` "
        "(or in an IPython profile's `ipython_config.py`).",
        "",
        "| setting | type | default | what it does |",
        "|---|---|---|---|",
    ]
    traits = TorchdistMagics.class_traits(config=True)
    for name in sorted(traits):
        trait = traits[name]
        out.append(
            f"| `TorchdistMagics.{name}` | {type(trait).__name__} | `{trait.default_value!r}` | {_cell(trait.help)} |"
        )
    out += [
        "",
        "## `%%torchdist?`",
        "",
        "What the magic's own help prints, as IPython builds it from the same fields:",
        "",
        "```text",
        inspect.cleandoc(TorchdistMagics.torchdist.__doc__ or ""),
        "```",
        "",
    ]
    return "\n".join(out)


def _where(name: str) -> str:
    """The dotted path of the object that ``torchdist_magic.<name>`` is today (the modules
    behind the top-level names move; the names do not)."""
    import importlib

    import torchdist_magic

    if name == "RunState":
        run = torchdist_magic.Run
        obj = importlib.import_module(run.__module__).RunState
    else:
        obj = getattr(torchdist_magic, name)
    return f"{obj.__module__}.{obj.__qualname__}"


def api_reference() -> str:
    """The API page: for each public name, a mkdocstrings block of the object behind it."""
    out = [
        "# Python API",
        "",
        "Every name here is imported from the package itself (`from torchdist_magic import "
        "Distributor`), except `RunState`, which a run hands you as `run.state`. Generated from "
        "the docstrings when this site was built.",
        "",
    ]
    for title, text, names in API_SECTIONS:
        out += [f"## {title}", "", text, ""]
        for name in names:
            out += [
                f"::: {_where(name)}",
                "    options:",
                f"      heading: \"{'torchdist_magic.' + name if name != 'RunState' else 'RunState'}\"",
                f"      toc_label: \"{name}\"",
            ]
            if name in DRIVER_ONLY:
                out.append("      filters: [\"!^_\", \"!^(" + "|".join(DRIVER_ONLY[name]) + ")$\"]")
            out.append("")
    return "\n".join(out)


def _records(base: type) -> list:
    found, todo = [], list(base.__subclasses__())
    while todo:
        cls = todo.pop(0)
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def events_reference() -> str:
    """The event contract: every record type, its fields, and which connections may send it."""
    from torchdist_magic.core import events

    senders: dict = {}
    for role, classes in events.SENDERS.items():
        for cls in classes:
            senders.setdefault(cls, []).append(role)
    out = [
        "# The event contract",
        "",
        "Generated from `torchdist_magic.core.events` when this site was built.",
        "",
        textwrap.dedent(events.__doc__ or "").strip(),
        "",
        f"Protocol version: **{events.PROTOCOL_VERSION}** (both ends compare it at the handshake).",
        "",
        "| record | sent by | fields | what it is |",
        "|---|---|---|---|",
    ]
    for cls in sorted(_records(events.Event), key=lambda c: c.__name__):
        roles = ", ".join(sorted(senders.get(cls, []))) or "the driver"
        names = ", ".join(f"`{f.name}`" for f in dataclasses.fields(cls))
        doc = (inspect.getdoc(cls) or "").split("\n\n")[0]
        out.append(f"| `{cls.__name__}` | {roles} | {names} | {_cell(doc)} |")
    out.append("")
    return "\n".join(out)


#: the package's folders in the order of its layers, top first, and where each one runs
LAYERS = (
    ("", "the driver (the notebook's kernel): the surface a user touches"),
    ("view", "the driver: the run's view"),
    ("handles", "the notebook's kernel: its handles on a run another process holds"),
    ("supervise", "a detached run's supervising process"),
    ("driver", "the run's owner (the kernel, or a detached run's supervising process): runs, their state and record"),
    ("backends", "the driver: where ranks start"),
    ("launch", "the launcher beside each rank"),
    ("rank", "the rank's worker"),
    ("wire", "all three: the run's channel"),
    ("core", "all three: the agreements"),
)


def module_map() -> str:
    """Every module of the package, one line each: its folder, its size and what its docstring's
    first sentence says it is (read from the source, nothing imported)."""
    import ast
    import os

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchdist_magic")
    out = [
        "# Module map",
        "",
        "Generated from the package's source when this site was built: every module, with what the "
        "first sentence of its docstring says it is. The folders go from the top layer down "
        "([Processes and packages](processes.md) says why); imports only point down.",
        "",
    ]
    for folder, where in LAYERS:
        directory = os.path.join(root, folder)
        out += [
            f"## `torchdist_magic/{folder + '/' if folder else ''}`",
            "",
            f"Runs in {where}.",
            "",
            "| module | lines | what it is |",
            "|---|---|---|",
        ]
        for name in sorted(os.listdir(directory)):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(directory, name), encoding="utf-8") as fh:
                source = fh.read()
            doc = ast.get_docstring(ast.parse(source)) or ""
            first = doc.strip().split("\n\n")[0]
            module = name[:-3] if name != "__init__.py" else "(package)"
            out.append(f"| `{module}` | {len(source.splitlines())} | {_cell(first)} |")
        out.append("")
    return "\n".join(out)


#: generated page -> the function that writes it
PAGES = {
    "reference/flags.md": flags_reference,
    "reference/api.md": api_reference,
    "design/events.md": events_reference,
    "design/modules.md": module_map,
}
