"""``%torchdist_panel``: a launch panel for distributed runs.

Its option controls are generated from ``LaunchOptions`` (one control per field, from the
field's flag, help text and choices), so they cannot drift from ``%%torchdist``'s flags.  What
runs is either code typed into the panel (captured like a ``%%torchdist`` cell) or a function
from the notebook with its arguments.  The run starts without blocking the kernel; its live view
appears in the panel, refreshed from a background thread; the panel shows the equivalent
``%%torchdist`` cell so the run can be reproduced in the notebook.  ``panel.run`` is the handle
of the panel's latest run.
"""

from __future__ import annotations

import ast
import dataclasses
import html
import shlex
import threading
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import ipywidgets as widgets

from .driver.handle import RunHandle
from .core.options import LaunchOptions, OptionError, np_range, option_fields
from .view.style import ERROR, MONO, MUTED, STATE_TEXT
from .view.widget import UPDATE_EVERY, WidgetView, close_tree

CODE = "code"
FUNCTION = "function"
RESULT_CHARS = 3000  # of rank 0's value's repr shown in the panel
_NOTE = "display:block;white-space:normal;font-size:12px;line-height:1.35"
#: a help note: two lines at most, cut at a word with an ellipsis (the whole text in its tooltip
#: and the control's), so that the options stay a screen tall in a narrow pane
_HELP = _NOTE + ";display:-webkit-box;-webkit-line-clamp:2;-webkit-box-orient:vertical;overflow:hidden"
#: a switch's control (``--tls``/``--no-tls``): neither flag, one, or the other.  Labels are its
#: values: a dropdown whose value is ``None`` shows no selection at all, not "default"
SWITCH_CHOICES = ("default", "on", "off")
SWITCH_VALUES = {"default": None, "on": True, "off": False}
#: the options shown at once; the others are under "more options" (opened when one of them is
#: refused), so that the panel stays a screen tall however many options there are
FIRST_OPTIONS = ("num_processes", "use_gpu", "backend", "timeout", "env", "all_ranks", "warm", "mlflow")


def _shown(exc: Exception) -> str:
    """A refused setting's message, naming the flag the panel labels its control with."""
    return exc.for_flags() if isinstance(exc, OptionError) else str(exc)


def _is_bool(field: dataclasses.Field) -> bool:
    return field.type in (bool, "bool")


def _flag_text(field: dataclasses.Field, value: Any) -> str:
    """``value`` as its flag takes it (``metadata["text"]`` when the field has its own form)."""
    if "text" in field.metadata:
        return field.metadata["text"](value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def control_for(field: dataclasses.Field, value: Any) -> widgets.Widget:
    """The control of one ``LaunchOptions`` field, showing ``value``."""
    meta = field.metadata
    layout = widgets.Layout(width="220px", flex="0 1 220px", min_width="0")
    if "choices" in meta or "names" in meta:  # names: the choices known when the panel is made
        choices = meta["names"]() if "names" in meta else meta["choices"]
        control = widgets.Dropdown(options=list(choices), value=value, layout=layout)
    elif _is_bool(field):
        control = widgets.Checkbox(value=bool(value), indent=False, layout=widgets.Layout(width="auto"))
    elif "negative" in meta:
        label = next(k for k, v in SWITCH_VALUES.items() if v is value)
        control = widgets.Dropdown(options=list(SWITCH_CHOICES), value=label, layout=layout)
    elif meta.get("repeat"):
        control = widgets.Textarea(
            value="\n".join(f"{k}={v}" for k, v in dict(value).items()),
            placeholder=f"{meta.get('metavar', '')}, one per line",
            rows=2,
            layout=layout,
        )
    elif meta.get("type") in (int, np_range) and field.default is not None:
        # --np's range is its own control here (--min-np): the panel's --np is a whole number
        control = widgets.IntText(value=value, layout=layout)
    else:
        optional = field.default is None
        control = widgets.Text(
            value="" if value is None else _flag_text(field, value),
            placeholder=f"{meta.get('metavar', '')}" + (" (empty: none)" if optional else ""),
            layout=layout,
        )
    control.add_class("torchdist-option")
    control.add_class(f"torchdist-option-{field.name}")
    control.tooltip = meta["help"]
    return control


def control_value(field: dataclasses.Field, control: widgets.Widget) -> Any:
    """The value a control holds, as ``LaunchOptions`` takes it; ``ValueError`` when the text
    cannot be read as one."""
    meta = field.metadata
    value = control.value
    if meta.get("repeat"):
        return [line.strip() for line in value.splitlines() if line.strip()]
    if "negative" in meta and not _is_bool(field):
        return SWITCH_VALUES[value]
    if not isinstance(control, widgets.Text):
        return value
    text = value.strip()
    if not text:
        return None if field.default is None else field.default
    kind = meta.get("type", str)
    try:
        return kind(text)
    except ValueError:
        noun = {"int": "a whole number", "float": "a number"}.get(kind.__name__, f"a {kind.__name__}")
        raise ValueError(f"{meta['flag']} needs {noun} ({meta.get('metavar', '')}), got {text!r}") from None


def command_line(options: LaunchOptions) -> str:
    """The ``%%torchdist`` line that launches with ``options`` (``--np`` always, other flags
    where they differ from the defaults)."""
    defaults = LaunchOptions()
    parts = ["%%torchdist"]
    for field in option_fields():
        flag, value = field.metadata["flag"], getattr(options, field.name)
        if field.name != "num_processes" and value == getattr(defaults, field.name):
            continue
        if "negative" in field.metadata:  # a switch, or a boolean whose default is on
            parts.append(flag if value else field.metadata["negative"][0])
        elif _is_bool(field):
            parts.append(flag)
        elif field.metadata.get("repeat"):
            for key, item in value.items():
                parts += [flag, shlex.quote(f"{key}={item}")]
        else:
            parts += [flag, shlex.quote(_flag_text(field, value))]
    return " ".join(parts)


def parse_call_arguments(text: str, namespace: dict) -> Tuple[tuple, dict]:
    """``10, lr=0.1, data=train_set`` -> ``((10,), {"lr": 0.1, "data": <train_set>})``.

    Each argument is a Python literal or the name of a notebook variable; nothing is evaluated.
    """
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"arguments: {exc.msg}") from None
    assert isinstance(call, ast.Call)

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Name):
            if node.id not in namespace:
                raise ValueError(f"arguments: {node.id!r} is not defined in the notebook")
            return namespace[node.id]
        if isinstance(node, (ast.Starred, ast.keyword)):
            raise ValueError("arguments: *args and **kwargs are not supported; list the arguments")
        try:
            return ast.literal_eval(node)
        except ValueError:
            raise ValueError(
                f"arguments: {ast.unparse(node)!r} is neither a literal nor a notebook "
                "variable; assign it to a variable in a cell first"
            ) from None

    args = tuple(value(a) for a in call.args)
    kwargs = {}
    for kw in call.keywords:
        if kw.arg is None:
            raise ValueError("arguments: *args and **kwargs are not supported; list the arguments")
        kwargs[kw.arg] = value(kw.value)
    return args, kwargs


def notebook_functions(namespace: dict) -> List[str]:
    """Functions defined in the notebook (not imported, not private), by name."""
    return sorted(
        name
        for name, obj in namespace.items()
        if isinstance(obj, types.FunctionType)
        and not name.startswith("_")
        and getattr(obj, "__module__", None) == "__main__"
    )


def follow_in_background(run: RunHandle, view, on_done: Optional[Callable[[Any], None]] = None) -> threading.Thread:
    """Refresh ``view`` from a thread until ``run`` ends, then close it and call ``on_done(run)``;
    the kernel stays free meanwhile."""

    def loop() -> None:
        try:
            while not run.wait(UPDATE_EVERY):
                view.update()
        finally:
            view.close()
            if on_done is not None:
                on_done(run)

    thread = threading.Thread(target=loop, name=f"torchdist-view-{run.run_id}", daemon=True)
    thread.start()
    return thread


class LaunchPanel:
    """Options, what to run, Launch/Stop, the equivalent cell, and the run's live view.

    ``shell`` is the IPython shell (its ``user_ns`` is the notebook: its functions, variables
    and ``In`` history); ``defaults`` are the options the controls start from (the magic passes
    its ``%config`` defaults; None: ``LaunchOptions()``).  ``name``, the notebook expression that holds this panel, lets
    captions say where the run's full logs and value are (``panel.run.logs(1)``); None leaves
    that out.
    """

    def __init__(self, shell, defaults: Optional[LaunchOptions] = None, *, name: Optional[str] = None):
        defaults = LaunchOptions() if defaults is None else defaults
        self.shell = shell
        self.name = name
        #: the run launched last (a ``RunHandle``: in this kernel, or detached)
        self.run: Optional[RunHandle] = None
        self.value: Any = None
        self._lock = threading.Lock()
        self._view: Optional[WidgetView] = None
        self._updater: Optional[threading.Thread] = None

        self.fields = {f.name: f for f in option_fields()}
        self.controls: Dict[str, widgets.Widget] = {}
        self.notes: Dict[str, widgets.HTML] = {}
        rows: List[widgets.Widget] = []
        more_rows: List[widgets.Widget] = []
        for name, field in self.fields.items():
            # a flag on one line; a row wraps its note under the control in a narrow pane
            label = widgets.HTML(
                f'<code style="font-size:12px;white-space:nowrap">{html.escape(field.metadata["flag"])}</code>',
                layout=widgets.Layout(flex="0 0 150px", margin="0 8px 0 0"),
            )
            control = control_for(field, getattr(defaults, name))
            note = widgets.HTML(layout=widgets.Layout(flex="1 1 160px", min_width="0", margin="0 0 0 8px"))
            note.add_class("torchdist-option-note")
            control.observe(self._changed, "value")
            self.controls[name], self.notes[name] = control, note
            (rows if name in FIRST_OPTIONS else more_rows).append(
                widgets.HBox(
                    [label, control, note],
                    layout=widgets.Layout(flex_flow="row wrap", align_items="center", margin="2px 0", min_width="0"),
                )
            )
        self.more_options = widgets.Accordion(
            children=[widgets.VBox(more_rows, layout=widgets.Layout(min_width="0"))],
            selected_index=None,
            titles=(
                "more options: "
                + " ".join(self.fields[n].metadata["flag"] for n in self.fields if n not in FIRST_OPTIONS),
            ),
        )
        self.more_options.add_class("torchdist-more-options")
        self.options_grid = widgets.VBox(rows + [self.more_options], layout=widgets.Layout(min_width="0"))

        self.source = widgets.ToggleButtons(
            options=[("code", CODE), ("function", FUNCTION)], value=CODE, style={"button_width": "90px"}
        )
        self.source.add_class("torchdist-source")
        self.code = widgets.Textarea(
            placeholder="code to run on every rank, as in a %%torchdist cell",
            rows=8,
            layout=widgets.Layout(width="100%"),
        )
        self.code.add_class("torchdist-code")
        self.code_note = widgets.HTML()
        self.function = widgets.Dropdown(options=[], description="function", layout=widgets.Layout(width="280px"))
        self.function.add_class("torchdist-function")
        self.refresh = widgets.Button(
            icon="refresh", tooltip="list the notebook's functions again", layout=widgets.Layout(width="36px")
        )
        self.refresh.on_click(lambda _b: self._list_functions())
        self.arguments = widgets.Text(
            placeholder="10, lr=0.1, data=train_set", description="arguments", layout=widgets.Layout(width="420px")
        )
        self.arguments.add_class("torchdist-arguments")
        self.function_note = widgets.HTML()
        self.function_box = widgets.VBox(
            [
                widgets.HBox(
                    [self.function, self.refresh, self.arguments], layout=widgets.Layout(flex_flow="row wrap")
                ),
                self.function_note,
            ]
        )
        self.code_box = widgets.VBox([self.code, self.code_note])
        self.what = widgets.VBox([self.code_box])
        self.source.observe(self._source_changed, "value")
        for w in (self.code, self.function, self.arguments):
            w.observe(self._changed, "value")

        self.launch_button = widgets.Button(description="Launch", icon="play", button_style="primary")
        self.launch_button.add_class("torchdist-launch")
        self.launch_button.on_click(lambda _b: self.launch())
        self.stop_button = widgets.Button(
            description="Stop", icon="stop", button_style="danger", disabled=True, tooltip="stop every rank of the run"
        )
        self.stop_button.add_class("torchdist-panel-stop")
        self.stop_button.on_click(lambda _b: self.stop())
        self.command = widgets.HTML()
        self.command.add_class("torchdist-command")
        self.message = widgets.HTML()
        self.message.add_class("torchdist-message")
        self.view_box = widgets.VBox()
        self.result = widgets.HTML()
        self.result.add_class("torchdist-result")
        # the code area is a notebook cell in spirit: the notebook's code font (ipywidgets has no
        # font-family setting for text areas)
        title = widgets.HTML(
            '<style>.torchdist-code textarea{font-family:var(--jp-code-font-family,monospace);'
            'font-size:var(--jp-code-font-size,13px)}</style>'
            '<div style="font-size:14px;font-weight:700;margin-bottom:4px">torchdist · launch</div>'
        )
        self.widget = widgets.VBox(
            [
                title,
                self.options_grid,
                widgets.HTML(f'<div style="margin-top:8px;color:{MUTED};font-size:12px">what to run</div>'),
                self.source,
                self.what,
                widgets.HBox([self.launch_button, self.stop_button], layout=widgets.Layout(margin="6px 0")),
                self.message,
                self.command,
                self.view_box,
                self.result,
            ],
            layout=widgets.Layout(
                border="1px solid var(--jp-border-color2, #e0e0e0)",
                padding="8px 12px",
                max_width="1100px",
                min_width="0",
            ),
        )
        self.widget.add_class("torchdist-panel")
        self._list_functions()
        self.validate()

    # -- reading the controls -------------------------------------------------------------------
    def option_values(self) -> Dict[str, Any]:
        """``{field: value}`` as the controls hold them; ``ValueError`` names a control's bad text."""
        return {name: control_value(self.fields[name], control) for name, control in self.controls.items()}

    def options(self) -> LaunchOptions:
        """The ``LaunchOptions`` the controls describe (raises what ``LaunchOptions`` raises)."""
        return LaunchOptions(**self.option_values())

    def field_errors(self) -> Dict[str, str]:
        """``{field: message}`` for each control whose value ``LaunchOptions`` refuses: alone,
        or, for a field that depends on others (``--ranks`` on ``--np`` and ``--warm``), with
        the other controls' values."""
        errors, values = {}, {}
        for name, control in self.controls.items():
            try:
                values[name] = control_value(self.fields[name], control)
            except ValueError as exc:
                errors[name] = str(exc)
        for name, value in values.items():
            try:
                LaunchOptions(**{name: value})
            except (TypeError, ValueError) as alone:
                errors[name] = _shown(alone)
                others = {n: v for n, v in values.items() if n not in errors}
                try:
                    LaunchOptions(**others, **{name: value})
                except OptionError as exc:
                    if exc.name == name:
                        errors[name] = _shown(exc)
                except (TypeError, ValueError):
                    pass
                else:
                    del errors[name]
        return errors

    def what_errors(self) -> List[str]:
        """Why the code or function cannot be launched (empty when it can)."""
        if self.source.value == CODE:
            if not self.code.value.strip():
                return ["write the code to run"]
            from .capture import CaptureError, translate_cell

            try:
                translate_cell(self.code.value)  # IPython syntax (!cmd, %time...) as in a cell
            except CaptureError as exc:
                return [str(exc).splitlines()[0]]
            return []
        if not self.function.value:
            return ["define a function in the notebook, then pick it here (↻ lists them again)"]
        try:
            parse_call_arguments(self.arguments.value, self.shell.user_ns)
        except ValueError as exc:
            return [str(exc)]
        return []

    def command_text(self) -> Optional[str]:
        """The equivalent ``%%torchdist`` cell, or None while the settings are invalid."""
        try:
            line = command_line(self.options())
        except (TypeError, ValueError):
            return None
        if self.source.value == CODE:
            return f"{line}\n{self.code.value.rstrip()}"
        return f"{line}\n{self.function.value}({self.arguments.value.strip()})"

    # -- reacting --------------------------------------------------------------------------------
    def _changed(self, _change=None) -> None:
        self.validate()

    def _source_changed(self, _change=None) -> None:
        if self.source.value == FUNCTION:
            self._list_functions()
        self.validate()

    def validate(self) -> bool:
        """Show every problem next to its control; Launch is enabled only without any."""
        self.what.children = [self.code_box] if self.source.value == CODE else [self.function_box]
        errors = self.field_errors()
        if any(name not in FIRST_OPTIONS for name in errors):
            self.more_options.selected_index = 0  # a refused option is never out of sight
        for name, note in self.notes.items():
            if name in errors:
                note.value = (
                    f'<span class="torchdist-option-error" style="{_NOTE};color:{ERROR}">'
                    f'{html.escape(errors[name])}</span>'
                )
            else:
                help_text = html.escape(self.fields[name].metadata["help"])
                note.value = f'<span style="{_HELP};color:{MUTED}" title="{help_text}">{help_text}</span>'
        overall: Optional[str] = None
        if not errors:
            try:
                self.options()
            except (TypeError, ValueError) as exc:
                overall = _shown(exc)
        what = self.what_errors()
        note = self.code_note if self.source.value == CODE else self.function_note
        note.value = "".join(
            f'<span class="torchdist-what-error" style="color:{ERROR};font-size:12px">{html.escape(e)}</span>'
            for e in what
        )
        ok = not errors and overall is None and not what
        self.message.value = (
            f'<span class="torchdist-option-error" style="color:{ERROR}">{html.escape(overall)}</span>'
            if overall
            else ""
        )
        command = self.command_text() if ok else None
        self.command.value = (
            (
                f'<div style="color:{MUTED};font-size:12px">the same run in a cell:</div>'
                f'<pre style="margin:2px 0 6px 0;padding:6px 8px;background:var(--jp-layout-color2, #f5f5f5);'
                f'border-radius:4px;font-family:{MONO};font-size:12px;max-height:160px;overflow:auto">'
                f'{html.escape(command)}</pre>'
            )
            if command
            else ""
        )
        self.launch_button.disabled = not ok or self.running
        return ok

    def _list_functions(self) -> None:
        names = notebook_functions(self.shell.user_ns)
        current = self.function.value
        self.function.options = names
        self.function.value = current if current in names else (names[0] if names else None)

    @property
    def running(self) -> bool:
        return self.run is not None and not self.run.done()

    # -- launching -------------------------------------------------------------------------------
    def launch(self):
        """Start the run the panel describes; its ``Run`` handle, or None when it could not start
        (the reason is shown in the panel)."""
        from .driver.distributor import submit
        from .driver.tracking import MlflowUnavailable, TrackingError

        with self._lock:
            if self.running or not self.validate():
                return None
            options = self.options()
            try:
                target, args, kwargs = self._target()
                from .handles.attach import submit_detached, supervised

                if supervised(options):  # --detach, --channel process
                    run = submit_detached(target, args, kwargs, options)
                else:
                    run = submit(target, args, kwargs, options)
            except (TypeError, ValueError, MlflowUnavailable, TrackingError) as exc:  # a CaptureError is a ValueError
                self.message.value = (
                    f'<pre class="torchdist-launch-error" style="color:{ERROR};white-space:pre-wrap;'
                    f'margin:0">{html.escape(_shown(exc))}</pre>'
                )
                return None
            self.message.value = ""
            self.result.value = ""
            self.value = None
            if self._view is not None:
                close_tree(self._view.widget)
            self.run = run
            log_hint = f"{self.name}.run.logs(rank)" if self.name else None
            self._view = WidgetView(run, display=False, stop=False, log_hint=log_hint)
            self.view_box.children = [self._view.widget]
            self.launch_button.disabled = True
            self.stop_button.disabled = False
            self._updater = follow_in_background(run, self._view, on_done=self._finished)
            return run

    def _target(self) -> Tuple[Any, tuple, dict]:
        """What ``distributor.submit`` runs: the panel's code as a cell ``Job`` (captured like a
        ``%%torchdist`` cell), or the chosen function with its arguments."""
        if self.source.value == FUNCTION:
            args, kwargs = parse_call_arguments(self.arguments.value, self.shell.user_ns)
            return self.shell.user_ns[self.function.value], args, kwargs
        from .capture import capture_cell
        from .core.job import cell_job

        history = list(self.shell.user_ns.get("In", []))
        captured = capture_cell(
            self.code.value, self.shell.user_ns, history, filename="<torchdist panel>", line_offset=0
        )
        return cell_job(captured, "panel code"), (), {}

    def stop(self) -> None:
        """Cancel the run (every rank is stopped), as the Stop button does."""
        if self.run is not None:
            self.stop_button.disabled = True
            self.run.cancel(by="the panel's Stop button")

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until the run has ended and the panel shows its outcome."""
        updater = self._updater
        if updater is None:
            return True
        updater.join(timeout)
        return not updater.is_alive()

    def _finished(self, run: RunHandle) -> None:
        """From the updater thread, after the run: show rank 0's value or the error."""
        from .core.errors import RankFailure

        if run is not self.run:
            return
        self.stop_button.disabled = True
        # Launch is enabled again before the outcome shows: whoever sees the outcome (a person, a
        # browser test) may launch at once; the widget's changes reach the page in this order
        self.validate()
        error = run.exception
        if error is None:
            self.value = run.result()
            text = repr(self.value)
            if len(text) > RESULT_CHARS:
                text = text[:RESULT_CHARS] + " …"
            also = f" (also <code>{html.escape(self.name)}.value</code>)" if self.name else ""
            self.result.value = (
                f'<div style="color:{MUTED};font-size:12px;margin-top:6px">rank 0 returned{also}:</div>'
                f'<pre class="torchdist-value" style="margin:2px 0;font-family:{MONO};font-size:12px;'
                f'white-space:pre-wrap">{html.escape(text)}</pre>'
            )
        else:
            text = error.details() if isinstance(error, RankFailure) else f"{type(error).__name__}: {error}"
            colour = STATE_TEXT.get(run.state.state, ERROR)
            self.result.value = (
                f'<pre class="torchdist-error" style="margin:6px 0 0 0;color:{colour};'
                f'font-family:{MONO};font-size:12px;white-space:pre-wrap">'
                f'{html.escape(text)}</pre>'
            )

    def show(self) -> None:
        """Display the panel in the notebook."""
        from IPython.display import display

        display(self.widget)
