"""The IPython layer: ``%%torchdist`` / ``%torchdist script.py`` and ``%torchdist_panel``.

Thin by design: parse the flags (generated from ``LaunchOptions``), capture the cell, hand the
job to ``Distributor``, render the run.  Everything it does is reachable from Python without
IPython (``capture_cell``, ``Distributor``, ``follow``).
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any, Optional

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from traitlets import CaselessStrEnum, Float, Int, Unicode

from .options import BACKENDS, LaunchOptions, option_fields


def _flag_arguments(func):
    """Stack one ``@magic_arguments.argument`` per ``LaunchOptions`` field (plus shortcuts)."""
    specs = []
    for f in option_fields():
        meta = f.metadata
        kwargs: dict = {"help": meta["help"], "dest": f.name, "default": None}
        if f.type in (bool, "bool"):
            kwargs["action"] = "store_true"
        elif meta.get("repeat"):
            kwargs.update(action="append", metavar=meta.get("metavar"))
        else:
            kwargs.update(metavar=meta.get("metavar"), type=meta.get("type", str))
            if "choices" in meta:
                kwargs.update(choices=meta["choices"], metavar=None)
        specs.append(((meta["flag"],), kwargs))
    specs += [
        (("--local",), {"dest": "backend", "action": "store_const", "const": "local",
                        "help": "run on local processes on this machine (same as --backend local)"}),
        (("--spark",), {"dest": "backend", "action": "store_const", "const": "spark",
                        "help": "run as a Spark barrier stage (same as --backend spark)"}),
        (("--out",), {"metavar": "NAME", "default": None,
                      "help": "store rank 0's value in the notebook variable NAME instead of showing it"}),
        (("--quiet",), {"action": "store_true", "help": "no live view; only the result or the error"}),
        (("script",), {"nargs": "?", "default": None,
                       "help": "line form only: a .py file to run on every rank"}),
        (("script_args",), {"nargs": argparse.REMAINDER,
                            "help": "line form only: the script's command-line arguments"}),
    ]
    for args, kwargs in reversed(specs):
        func = magic_arguments.argument(*args, **kwargs)(func)
    return magic_arguments.magic_arguments()(func)


def parse_flags(line: str) -> argparse.Namespace:
    """Flags with shell quoting (``--env 'A=x y'``); mistakes become ``UsageError``."""
    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"cannot parse the flags: {exc}") from None
    return TorchdistMagics.torchdist.parser.parse_args(argv)


@magics_class
class TorchdistMagics(Magics):
    """Magics of torchdist_magic.  Lasting defaults are settable with ``%config``, e.g.
    ``%config TorchdistMagics.default_np = 4``."""

    default_np = Int(1, help="number of ranks when --np is not given").tag(config=True)
    default_backend = CaselessStrEnum(list(BACKENDS), default_value="auto",
                                      help="backend when neither --local, --spark nor --backend is given"
                                      ).tag(config=True)
    default_timeout = Float(None, allow_none=True,
                            help="timeout in seconds when --timeout is not given (None: no limit)"
                            ).tag(config=True)
    payload_warning_mb = Float(100.0, help="warn when the notebook values a cell sends are larger (MB)"
                               ).tag(config=True)
    view = CaselessStrEnum(["auto", "widget", "text"], default_value="auto",
                           help="live view: 'widget' (ipywidgets), 'text', or 'auto' (widget in a "
                                "kernel with ipywidgets, text otherwise)").tag(config=True)
    cell_filename = Unicode("<torchdist cell In[{n}]>",
                            help="filename tracebacks show for a cell; {n} is the execution count"
                            ).tag(config=True)

    # -- parsing -------------------------------------------------------------------------
    def launch_options(self, args: argparse.Namespace) -> LaunchOptions:
        """``LaunchOptions`` from parsed flags, with ``None`` meaning "the configured default"."""
        values = {
            "num_processes": self.default_np if args.num_processes is None else args.num_processes,
            "use_gpu": bool(args.use_gpu),
            "backend": args.backend or self.default_backend,
            "timeout": self.default_timeout if args.timeout is None else args.timeout,
            "env": args.env or {},
            "all_ranks": bool(args.all_ranks),
        }
        missing = {f.name for f in option_fields()} - set(values)
        assert not missing, f"flags without a mapping: {missing}"
        try:
            return LaunchOptions(**values)
        except (TypeError, ValueError) as exc:
            raise UsageError(str(exc)) from None

    # -- magics --------------------------------------------------------------------------
    @_flag_arguments
    @line_cell_magic
    def torchdist(self, line: str, cell: Optional[str] = None) -> Any:
        """Run a cell (``%%torchdist``) or a script (``%torchdist script.py args``) as
        distributed PyTorch on N ranks; rank 0's value is the result.

        In the cell, notebook imports are replayed and notebook values it uses are sent by value;
        ``rank``, ``local_rank``, ``world_size``, ``device``, ``progress``, ``report`` and
        ``is_main`` are provided.  A process group (gloo, nccl with --gpu) is set up around the
        cell unless the cell calls ``init_process_group`` itself.
        """
        args = parse_flags(line)
        options = self.launch_options(args)
        if args.out is not None and not args.out.isidentifier():
            raise UsageError(f"--out needs a variable name, got {args.out!r}")
        if cell is None:
            if args.script is None:
                raise UsageError("%torchdist needs a script (%torchdist [flags] script.py [args...]) "
                                 "or use %%torchdist as a cell magic")
            job_source: Any = args.script
            job_args = tuple(args.script_args or ())
        else:
            if args.script is not None:
                raise UsageError(f"unexpected argument {args.script!r}: %%torchdist takes only flags; "
                                 "the cell is what runs")
            if not cell.strip():
                raise UsageError("the %%torchdist cell is empty")
            job_source, job_args = self._capture(cell), ()
        value = run_job(job_source, job_args, options, quiet=args.quiet, view=self.view)
        if args.out is not None:
            self.shell.user_ns[args.out] = value
            return None
        return value

    def _capture(self, cell: str):
        from .capture import CaptureError, capture_cell
        from .job import Job

        inputs = self.shell.user_ns.get("In")
        # ``In`` holds this cell already; its index is the cell's number on IPython 8 and 9 alike
        # (IPython 9 counts execution_count up before the cell runs, IPython 8 after)
        n = len(inputs) - 1 if inputs else self.shell.execution_count
        history = inputs[:-1] if inputs else []
        try:
            cap = capture_cell(cell, self.shell.user_ns, history,
                               filename=self.cell_filename.format(n=n),
                               warn_bytes=int(self.payload_warning_mb * 2**20))
        except CaptureError as exc:
            raise UsageError(str(exc)) from None
        return Job(kind="cell", name=f"cell In[{n}]", cell=cap.cell)

    @line_magic
    def torchdist_panel(self, line: str = ""):
        """Show the launch panel: set the options, write or pick what to run, press Launch."""
        from .view.panel import LaunchPanel

        return LaunchPanel(self.shell).show()


def run_job(job_source: Any, job_args: tuple, options: LaunchOptions, *, quiet: bool = False,
            view: str = "auto") -> Any:
    """What the magic does after parsing: validate, start, show, return rank 0's value.

    Bad input (a missing script, an unplaceable run) becomes a ``UsageError``.
    """
    from .distributor import Distributor, follow
    from .view import make_view

    dist = Distributor.from_options(options, show=None)
    try:
        run = dist.submit(job_source, *job_args)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return follow(run, view=None if quiet else make_view(run, view))


def load(ipython) -> None:
    ipython.register_magics(TorchdistMagics)


def unload(ipython) -> None:
    manager = ipython.magics_manager
    for kind, names in (("line", ("torchdist", "torchdist_panel")), ("cell", ("torchdist",))):
        for name in names:
            manager.magics[kind].pop(name, None)
    manager.registry.pop("TorchdistMagics", None)
