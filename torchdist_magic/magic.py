"""The IPython layer: ``%%torchdist`` / ``%torchdist script.py`` and ``%torchdist_panel``.

Thin by design: parse the flags (``flags.parse_flags``, generated from ``LaunchOptions``),
capture the cell, ``distributor.submit`` the job, render the run with a view.  Everything it
does is reachable from Python without IPython.  The handle of the latest cell's run is kept in
the notebook variable ``_torchdist_run`` (its ``logs(rank)``, ``state``, ...).
"""

from __future__ import annotations

from typing import Any, Optional

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from traitlets import Bool, CaselessStrEnum, Dict, Float, Int, TraitError, Unicode, validate

from .core.registry import backend_names, unknown_backend
from .core.options import LaunchOptions, OptionError
from .core.flags import FlagError, flag_specs, options_from_flags, parse_flags

RUN_VARIABLE = "_torchdist_run"
#: ``%torchdist WORD ...``: the history of runs and detached runs, not a script to run
RUN_COMMANDS = ("runs", "attach", "stop")
PANEL_VARIABLE = "_torchdist_panel"


def _flag_arguments(func):
    """Stack one ``@magic_arguments.argument`` per flag, so ``%%torchdist?`` shows them."""
    for args, kwargs in reversed(flag_specs()):
        func = magic_arguments.argument(*args, **kwargs)(func)
    return magic_arguments.magic_arguments()(func)


@magics_class
class TorchdistMagics(Magics):
    """Magics of torchdist_magic.  Lasting defaults are settable with ``%config``, e.g.
    ``%config TorchdistMagics.default_np = 4``."""

    default_np = Int(1, help="number of ranks when --np is not given").tag(config=True)
    default_backend = Unicode(
        "auto",
        help="backend when neither --local, --spark nor --backend is given: auto, local, spark, or a registered one",
    ).tag(config=True)

    @validate("default_backend")
    def _known_backend(self, proposal):
        name = str(proposal["value"]).lower()  # as the traitlet's enum took it, in any case
        if name not in backend_names():
            raise TraitError(unknown_backend(name))
        return name

    default_backend_options = Dict(
        help="backend options every run gets (--backend-option KEY=VALUE adds to them), e.g. "
        "{'partition': 'gpu', 'time': '02:00:00'} for --backend slurm",
    ).tag(config=True)
    default_timeout = Float(
        None, allow_none=True, help="timeout in seconds when --timeout is not given (None: no limit)"
    ).tag(config=True)
    mlflow = Bool(False, help="log every run to MLflow when neither --mlflow nor --no-mlflow is given").tag(config=True)
    payload_warning_mb = Float(100.0, help="warn when the notebook values a cell sends are larger (MB)").tag(
        config=True
    )
    view = CaselessStrEnum(
        ["auto", "widget", "text"],
        default_value="auto",
        help="live view: 'widget' (ipywidgets), 'text', or 'auto' (widget in a kernel with ipywidgets, text otherwise)",
    ).tag(config=True)
    cell_filename = Unicode(
        "<torchdist cell In[{n}]>", help="filename tracebacks show for a cell; {n} is the execution count"
    ).tag(config=True)

    pdb = Bool(
        False, help="hold a failing rank for a (Pdb rank r) post-mortem session in the cell, as %pdb on does (--pdb)"
    ).tag(config=True)
    preflight = Bool(
        False,
        help="check every rank's versions, GPUs and bandwidth before each run when "
        "neither --preflight nor --no-preflight is given",
    ).tag(config=True)

    def configured_defaults(self) -> LaunchOptions:
        """What ``%%torchdist`` with no flags uses: the ``%config`` defaults."""
        try:
            return LaunchOptions(
                num_processes=self.default_np,
                backend=self.default_backend,
                backend_options=self.default_backend_options,
                timeout=self.default_timeout,
                pdb=self.pdb,
                mlflow=self.mlflow,
                preflight=self.preflight,
            )
        except OptionError as exc:
            raise UsageError(f"%config TorchdistMagics: {exc}") from None

    # -- magics --------------------------------------------------------------------------
    @_flag_arguments
    @line_cell_magic
    def torchdist(self, line: str, cell: Optional[str] = None) -> Any:
        """Run a cell (``%%torchdist``) or a script (``%torchdist script.py args``) as
        distributed PyTorch on N ranks; rank 0's value is the result.

        In the cell, notebook imports are replayed and notebook values it uses are sent by value;
        ``rank``, ``local_rank``, ``world_size``, ``device``, ``progress``, ``report``,
        ``is_main``, ``restart_count``, ``save_checkpoint`` and ``load_checkpoint`` are
        provided.  A process group (gloo, nccl with --gpu) is set up around the cell unless the
        cell calls ``init_process_group`` itself.  ``!cmd``, ``x = !cmd``,
        ``%time``, ``%%time`` (as the cell's first line), ``%timeit``, ``%env``, ``%cd`` and
        ``%pip`` (once per host) run on every rank; other magics are refused before launch.

        ``%torchdist runs`` lists the recorded runs, ``%torchdist attach RUN_ID`` follows a
        detached run (``--detach``) and returns its value, ``%torchdist stop RUN_ID`` stops one.
        ``%torchdist --version`` prints the release of torchdist_magic this kernel runs.
        """
        words = line.split()
        if cell is None and words == ["--version"]:
            from .core.version import __version__

            print(f"torchdist_magic {__version__}")
            return None
        if cell is None and words and words[0] in RUN_COMMANDS:
            return self._run_command(words[0], words[1:])
        try:
            args = parse_flags(line)
            options = options_from_flags(args, self.configured_defaults())
        except FlagError as exc:
            raise UsageError(str(exc)) from None
        if args.out is not None and not args.out.isidentifier():
            raise UsageError(f"--out needs a variable name, got {args.out!r}")
        data, columns = self._data(args)
        if cell is None:
            if args.script is None:
                raise UsageError(
                    "%torchdist needs a script (%torchdist [flags] script.py [args...]) "
                    "or use %%torchdist as a cell magic"
                )
            target: Any = args.script
            target_args = tuple(args.script_args or ())
        else:
            if args.script is not None:
                raise UsageError(
                    f"unexpected argument {args.script!r}: %%torchdist takes only flags; the cell is what runs"
                )
            if not cell.strip():
                raise UsageError("the %%torchdist cell is empty")
            target, target_args = self._capture(cell), ()
        value = self._run(target, target_args, options, quiet=args.quiet, data=data, columns=columns)
        if args.out is not None:
            self.shell.user_ns[args.out] = value
            return None
        return value

    def _run_command(self, command: str, words: list) -> Any:
        """``%torchdist runs``, ``%torchdist attach RUN_ID``, ``%torchdist stop RUN_ID``."""
        from .driver import history
        from .handles import attach

        if command == "runs":
            if words:
                raise UsageError(f"%torchdist runs takes nothing, got {' '.join(words)!r}")
            print(history.runs_table())
            return None
        if len(words) != 1:
            raise UsageError(
                f"%torchdist {command} needs one run id (%torchdist runs lists them), got {' '.join(words)!r}"
                if words
                else f"%torchdist {command} needs a run id (%torchdist runs lists them)"
            )
        try:
            if command == "stop":
                stopped = attach.stop(words[0], by="%torchdist stop")
                print(f"torchdist: run {words[0]} {'is stopping' if stopped else 'had ended already'}")
                return None
            run = attach.attach(words[0])
        except (KeyError, ValueError) as exc:
            raise UsageError(exc.args[0]) from None
        self.shell.user_ns[RUN_VARIABLE] = run
        from .view import make_view

        return attach.follow_attached(run, make_view(run, self.view, log_hint=f"{RUN_VARIABLE}.logs(rank)"))

    def _data(self, args) -> tuple:
        """The DataFrame of ``--data NAME`` and the ``--columns`` list (``None`` when not given)."""
        columns = None
        if args.columns is not None:
            if args.data is None:
                raise UsageError("--columns chooses columns of the --data DataFrame; give --data NAME too")
            columns = [c.strip() for c in args.columns.split(",") if c.strip()]
        if args.data is None:
            return None, columns
        if args.data not in self.shell.user_ns:
            raise UsageError(f"--data {args.data}: the notebook has no variable {args.data!r}")
        return self.shell.user_ns[args.data], columns

    def _capture(self, cell: str):
        from .capture import CaptureError, capture_cell
        from .core.job import cell_job

        inputs = self.shell.user_ns.get("In")
        # ``In`` holds this cell already; its index is the cell's number on IPython 8 and 9 alike
        # (IPython 9 counts execution_count up before the cell runs, IPython 8 after)
        n = len(inputs) - 1 if inputs else self.shell.execution_count
        history = inputs[:-1] if inputs else []
        try:
            cap = capture_cell(
                cell,
                self.shell.user_ns,
                history,
                filename=self.cell_filename.format(n=n),
                warn_bytes=int(self.payload_warning_mb * 2**20),
            )
        except CaptureError as exc:
            raise UsageError(str(exc)) from None
        return cell_job(cap, f"cell In[{n}]")

    def _run(
        self,
        target: Any,
        target_args: tuple,
        options: LaunchOptions,
        *,
        quiet: bool,
        data: Any = None,
        columns: Optional[list] = None,
    ) -> Any:
        """Start, show (unless ``quiet``), return rank 0's value; bad input is a ``UsageError``."""
        from .driver.console import stdin_available
        from .driver.distributor import submit
        from .handles.follow import follow
        from .driver.tracking import MlflowUnavailable, TrackingError

        if options.detach:
            from .handles.attach import submit_detached

            try:
                run = submit_detached(target, target_args, {}, options, data=data)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            self.shell.user_ns[RUN_VARIABLE] = run
            print(
                f"torchdist: detached run {run.run_id} started (np={options.num_processes}); it goes on without "
                f"this kernel. %torchdist attach {run.run_id} follows it and returns its value, "
                f"%torchdist stop {run.run_id} stops it"
            )
            if not quiet:
                from .handles.attach import follow_in_thread
                from .view import kernel_with_widgets, make_view

                if kernel_with_widgets() and self.view != "text":  # a text view would print into later cells
                    follow_in_thread(run, make_view(run, "widget", log_hint=f"{RUN_VARIABLE}.logs(rank)"))
            return run
        from .handles.attach import supervised

        if supervised(options, data):  # --channel process: the run's channel off this kernel
            from .handles.attach import follow_attached, submit_detached
            from .view import make_view

            try:
                run = submit_detached(target, target_args, {}, options, data=data)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            self.shell.user_ns[RUN_VARIABLE] = run
            view = self.view
            return follow_attached(
                run,
                own=True,
                make_observer=None if quiet else lambda: make_view(run, view, log_hint=f"{RUN_VARIABLE}.logs(rank)"),
            )
        try:
            run = submit(target, target_args, {}, options, data=data, columns=columns, debug_input=stdin_available())
        except (TypeError, ValueError, MlflowUnavailable, TrackingError) as exc:
            raise UsageError(str(exc)) from None
        self.shell.user_ns[RUN_VARIABLE] = run
        observer = None
        if not quiet:
            from .view import make_view

            observer = make_view(run, self.view, log_hint=f"{RUN_VARIABLE}.logs(rank)")
        return follow(run, observer)

    @line_magic
    def torchdist_pool(self, line: str = ""):
        """Show the live warm pools (``--warm``): placement, state, runs served, idle time, the
        ranks' pids (or Spark job tag) and memory.  ``%torchdist_pool stop`` stops them."""
        from .backends.pool import pools, shutdown_pools

        words = line.split()
        if words == ["stop"]:
            stopped = shutdown_pools()
            print(f"stopped {', '.join(stopped)}" if stopped else "no warm pool was running")
            return None
        if words:
            raise UsageError(f"%torchdist_pool takes nothing, or 'stop'; got {line.strip()!r}")
        live = pools()
        print(
            "\n".join(p.describe() for p in live)
            if live
            else "no warm pool is running (a %%torchdist --warm cell starts one)"
        )
        return None

    @line_magic
    def torchdist_panel(self, line: str = ""):
        """Show the launch panel: set the options, write or pick what to run, press Launch.
        The panel is kept in the notebook variable ``_torchdist_panel`` (its ``run``,
        ``value``, ``stop()``)."""
        from .panel import LaunchPanel

        panel = LaunchPanel(self.shell, self.configured_defaults(), name=PANEL_VARIABLE)
        self.shell.user_ns[PANEL_VARIABLE] = panel
        return panel.show()


def load(ipython) -> None:
    ipython.register_magics(TorchdistMagics)


def unload(ipython) -> None:
    import sys

    if "torchdist_magic.backends.pool" in sys.modules:  # the pools go with the extension
        sys.modules["torchdist_magic.backends.pool"].shutdown_pools()
    manager = ipython.magics_manager
    for kind, names in (("line", ("torchdist", "torchdist_panel", "torchdist_pool")), ("cell", ("torchdist",))):
        for name in names:
            manager.magics[kind].pop(name, None)
    manager.registry.pop("TorchdistMagics", None)
