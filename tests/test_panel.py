"""The launch panel: controls generated from LaunchOptions (and in step with the magic's flags),
validation next to each control, the equivalent %%torchdist cell, and real runs from the panel."""

import threading
import types

import ipywidgets as widgets
import pytest

from helpers import assert_no_survivors, wait_until
from torchdist_magic.core.options import LaunchOptions, option_fields
from torchdist_magic.core.flags import flag_parser, options_from_flags, parse_flags
from torchdist_magic import panel as P
from torchdist_magic.view.model import rank_rows

#: flags that are no launch setting: shortcuts of --backend, where the value goes, no view
MAGIC_ONLY_FLAGS = {"--local", "--spark", "--out", "--quiet", "--data", "--columns"}


class Notebook:
    """What the panel reads of an IPython shell: the notebook namespace (with its ``In``
    history)."""

    def __init__(self):
        self.user_ns = {"__name__": "__main__", "In": [""]}

    def run_cell(self, source):
        self.user_ns["In"].append(source)
        exec(compile(source, f"<cell {len(self.user_ns['In']) - 1}>", "exec"), self.user_ns)


@pytest.fixture
def notebook():
    """A ``Notebook`` (the shared ``ip`` fixture is a real IPython shell; the panel needs less)."""
    return Notebook()


@pytest.fixture
def panel(notebook):
    return P.LaunchPanel(notebook, LaunchOptions())


def parse_line(line):
    """``LaunchOptions`` that a ``%%torchdist ...`` line gives where nothing is configured."""
    assert line.startswith("%%torchdist")
    return options_from_flags(parse_flags(line[len("%%torchdist") :]), LaunchOptions())


# -- controls and flags agree ----------------------------------------------------------------------
def test_every_option_field_has_a_control_and_every_flag_maps_to_a_field(panel):
    names = [f.name for f in option_fields()]
    assert list(panel.controls) == names == list(panel.notes)
    for name, control in panel.controls.items():
        assert {"torchdist-option", f"torchdist-option-{name}"} <= set(control._dom_classes)
    flags = {flag: a.dest for a in flag_parser()._actions for flag in a.option_strings}
    for field in option_fields():
        assert flags[field.metadata["flag"]] == field.name
    unmapped = {flag for flag, dest in flags.items() if dest not in names}
    assert unmapped == MAGIC_ONLY_FLAGS, f"flags without a LaunchOptions field: {unmapped - MAGIC_ONLY_FLAGS}"


def test_control_kinds_follow_the_field_metadata(panel):
    kinds = {name: type(c) for name, c in panel.controls.items()}
    assert kinds == {
        "num_processes": widgets.IntText,
        "min_processes": widgets.Text,
        "use_gpu": widgets.Checkbox,
        "backend": widgets.Dropdown,
        "timeout": widgets.Text,
        "hang_timeout": widgets.Text,
        "max_restarts": widgets.IntText,
        "checkpoint_dir": widgets.Text,
        "keep_checkpoints": widgets.IntText,
        "restart_on": widgets.Text,
        "on_hang": widgets.Dropdown,
        "env": widgets.Textarea,
        "backend_options": widgets.Textarea,
        "all_ranks": widgets.Checkbox,
        "warm": widgets.Checkbox,
        "ranks": widgets.Text,
        "pool_idle_timeout": widgets.Text,
        "pdb": widgets.Checkbox,
        "debug_idle_timeout": widgets.Text,
        "tls": widgets.Dropdown,
        "system_metrics": widgets.Checkbox,
        "profile": widgets.IntText,
        "trace_collectives": widgets.Checkbox,
        "mlflow": widgets.Checkbox,
        "preflight": widgets.Checkbox,
        "detach": widgets.Checkbox,
        "channel": widgets.Dropdown,
    }
    assert panel.controls["backend"].options[:3] == ("auto", "local", "spark")  # and those registered
    assert panel.options() == LaunchOptions()
    for field in option_fields():  # the help text is next to the control until there is an error
        assert panel.controls[field.name].tooltip == field.metadata["help"]
        assert field.metadata["help"].split("(")[0].strip() in panel.notes[field.name].value.replace("&#x27;", "'")


def test_panel_starts_from_the_defaults_it_is_given(notebook):
    defaults = LaunchOptions(num_processes=3, backend="local", timeout=90.0, env={"A": "1"}, all_ranks=True)
    panel = P.LaunchPanel(notebook, defaults)  # the magic passes its %config defaults
    assert panel.options() == defaults
    assert P.LaunchPanel(types.SimpleNamespace(user_ns={}), LaunchOptions()).options() == LaunchOptions()


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, text, value",
    [
        ("num_processes", 0, 0),
        ("num_processes", -2, -2),
        ("timeout", "-1", -1.0),
        ("timeout", "inf", float("inf")),
        ("env", "1BAD=x", ["1BAD=x"]),
        ("env", "NO_EQUALS_SIGN", ["NO_EQUALS_SIGN"]),
    ],
)
def test_bad_settings_are_shown_next_to_the_control_and_block_launch(panel, name, text, value):
    panel.code.value = "rank"
    assert not panel.launch_button.disabled
    panel.controls[name].value = text
    with pytest.raises((TypeError, ValueError)) as expected:
        LaunchOptions(**{name: value})
    message = expected.value.for_flags()  # named by the flag that labels the control
    assert message.startswith(panel.fields[name].metadata["flag"])
    assert panel.field_errors() == {name: message}
    assert "torchdist-option-error" in panel.notes[name].value
    assert message.split(",")[0].replace("'", "&#x27;") in panel.notes[name].value
    assert panel.launch_button.disabled and panel.command.value == ""
    assert panel.launch() is None
    panel.controls[name].value = {"num_processes": 1, "timeout": "", "env": ""}[name]
    assert panel.field_errors() == {} and not panel.launch_button.disabled


def test_text_that_is_not_a_number_is_refused(panel):
    panel.code.value = "rank"
    panel.controls["timeout"].value = "soon"
    assert panel.field_errors() == {"timeout": "--timeout needs a number (SECONDS), got 'soon'"}
    assert panel.launch_button.disabled
    panel.controls["timeout"].value = " 12.5 "
    assert panel.options().timeout == 12.5 and not panel.launch_button.disabled
    panel.controls["timeout"].value = ""
    assert panel.options().timeout is None


def test_ranks_are_typed_as_the_flag_takes_them(panel):
    panel.code.value = "rank"
    panel.controls["num_processes"].value = 4
    panel.controls["ranks"].value = "3, 1"
    assert panel.field_errors() == {
        "ranks": "--ranks needs a warm pool: it runs a cell on some ranks of the "
        "live pool (--warm/warm=True), and a cold run starts every rank afresh"
    }
    panel.controls["warm"].value = True
    assert panel.field_errors() == {} and panel.options().ranks == (1, 3)
    assert "%%torchdist --np 4 --warm --ranks 1,3\nrank" in panel.command.value
    assert P.LaunchPanel(panel.shell, panel.options()).controls["ranks"].value == "1,3"


def test_what_to_run_is_checked_too(notebook, panel):
    assert panel.what_errors() == ["write the code to run"] and panel.launch_button.disabled
    panel.code.value = "for i in range(3)\n    pass"
    assert panel.what_errors() == ["SyntaxError in the cell, line 1: expected ':'"] and panel.launch_button.disabled
    assert "torchdist-what-error" in panel.code_note.value
    panel.code.value = "rank * 2"
    assert panel.what_errors() == [] and not panel.launch_button.disabled
    panel.code.value = "!nvidia-smi -L\n%time rank * 2"  # IPython syntax, as in a %%torchdist cell
    assert panel.what_errors() == [] and not panel.launch_button.disabled
    panel.code.value = "x = 1\n%matplotlib inline"
    assert panel.what_errors() == [
        "line 2, `%matplotlib inline`: %matplotlib cannot run on the ranks (they run "
        "without IPython); a %%torchdist cell can use !cmd, x = !cmd, %time, %%time, "
        "%timeit, %%timeit, %env, %cd and %pip. Run %matplotlib in a cell of its own."
    ]
    assert panel.launch_button.disabled
    panel.code.value = "rank * 2"
    notebook.run_cell("def panel_fn(x, scale=1):\n    return x * scale\nPANEL_X = 21")
    panel.source.value = P.FUNCTION  # lists the notebook's functions again
    panel.function.value = "panel_fn"
    panel.arguments.value = "PANEL_X, scale=nope"
    assert panel.what_errors() == ["arguments: 'nope' is not defined in the notebook"]
    assert panel.launch_button.disabled and "torchdist-what-error" in panel.function_note.value
    panel.arguments.value = "PANEL_X, scale=2"
    assert not panel.launch_button.disabled


def test_call_arguments_are_literals_or_notebook_names():
    ns = {"data": [1, 2], "lr": 0.1}
    assert P.parse_call_arguments("", ns) == ((), {})
    assert P.parse_call_arguments("10, -2.5, 'x', (1, None), lr=lr, data=data", ns) == (
        (10, -2.5, "x", (1, None)),
        {"lr": 0.1, "data": [1, 2]},
    )
    for text, message in [
        ("missing", "'missing' is not defined"),
        ("1 +", "arguments: "),
        ("len(data)", "neither a literal nor a notebook variable"),
        ("*data", "not supported"),
        ("**ns", "not supported"),
    ]:
        with pytest.raises(ValueError, match=message):
            P.parse_call_arguments(text, ns)


def test_only_the_notebooks_own_functions_are_offered():
    import os.path

    def mine():
        pass

    mine.__module__ = "__main__"

    def _private():
        pass

    _private.__module__ = "__main__"
    ns = {"mine": mine, "_private": _private, "join": os.path.join, "value": 3, "cls": dict}
    assert P.notebook_functions(ns) == ["mine"]


# -- the equivalent cell ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"num_processes": 4},
        {"num_processes": 2, "backend": "local", "timeout": "90"},
        {"use_gpu": True, "all_ranks": True, "backend": "spark", "timeout": "0.5"},
        {"env": "A=1\nPATH_EXTRA=/opt/x:/opt/y\nEMPTY="},
        {"max_restarts": 2, "checkpoint_dir": "/dbfs/my runs/1", "keep_checkpoints": 5, "hang_timeout": "600"},
    ],
)
def test_equivalent_cell_reproduces_the_options(notebook, panel, settings):
    for name, value in settings.items():
        panel.controls[name].value = value
    panel.code.value = "model = train()\nmodel"
    text = panel.command_text()
    line, body = text.split("\n", 1)
    assert body == "model = train()\nmodel"
    assert line.startswith("%%torchdist --np ")
    assert parse_line(line) == panel.options()
    assert panel.command.value and "the same run in a cell" in panel.command.value


def test_equivalent_cell_of_a_function_call(notebook, panel):
    notebook.run_cell("def panel_train(epochs, lr=0.1):\n    return epochs * lr")
    panel.source.value = P.FUNCTION
    panel.function.value = "panel_train"
    panel.arguments.value = " 3, lr=0.5 "
    panel.controls["num_processes"].value = 2
    assert panel.command_text() == "%%torchdist --np 2\npanel_train(3, lr=0.5)"


def test_command_line_leaves_out_defaults_but_always_names_np():
    assert P.command_line(LaunchOptions()) == "%%torchdist --np 1"
    assert (
        P.command_line(LaunchOptions(num_processes=2, use_gpu=True, timeout=30.0, env={"A": "x y"}))
        == "%%torchdist --np 2 --gpu --timeout 30 --env 'A=x y'"
    )


def test_the_tls_switch_shows_default_on_off_and_round_trips_through_the_flags(panel):
    # a value of None would show an empty dropdown: the default is labelled, and selected
    assert panel.controls["tls"].options == ("default", "on", "off") and panel.controls["tls"].value == "default"
    for label, value, flag in (("on", True, " --tls"), ("off", False, " --no-tls"), ("default", None, "")):
        panel.controls["tls"].value = label
        assert panel.options().tls is value
        line = P.command_line(panel.options())
        assert line == "%%torchdist --np 1" + flag
        assert parse_line(line).tls is value


def test_system_metrics_is_a_checkbox_on_by_default_that_round_trips_through_the_flags(panel):
    assert panel.controls["system_metrics"].value is True
    panel.controls["system_metrics"].value = False
    assert panel.options().system_metrics is False
    line = P.command_line(panel.options())
    assert line == "%%torchdist --np 1 --no-system-metrics"
    assert parse_line(line).system_metrics is False


def test_quoted_env_round_trips_through_the_flags():
    opts = LaunchOptions(num_processes=2, env={"A": "x y", "B": "it's"})
    assert parse_line(P.command_line(opts)) == opts


# -- real runs from the panel ----------------------------------------------------------------------
def wait_for(panel, timeout=120):
    assert panel.wait(timeout), "the panel's run did not end"


def test_launch_code_runs_in_the_background_and_shows_the_value(notebook, panel):
    notebook.run_cell("import math as m\nSCALE = 3")  # notebook imports and values, as a cell sees them
    panel.controls["num_processes"].value = 2
    panel.code.value = "print('hello from', rank)\nm.sqrt(16) * SCALE + rank"
    run = panel.launch()
    assert run is not None and panel.run is run
    assert panel._updater is not threading.current_thread() and panel._updater.daemon
    assert panel.launch_button.disabled and not panel.stop_button.disabled
    assert panel.launch() is None  # one run at a time
    assert panel.view_box.children == (panel._view.widget,)
    wait_for(panel)
    assert panel.value == 12.0 and run.result() == 12.0
    assert "12.0" in panel.result.value and "torchdist-value" in panel.result.value
    assert [r.state for r in rank_rows(run.state)] == ["done", "done"]
    assert 'data-state="succeeded"' in panel._view.header.value
    assert "hello from 0" in panel._view.logs.value
    assert not panel.launch_button.disabled and panel.stop_button.disabled
    assert run.job.cell.filename == "<torchdist panel>"
    assert_no_survivors(run)


def test_a_named_panel_says_where_its_runs_logs_and_value_are(notebook):
    panel = P.LaunchPanel(notebook, LaunchOptions(num_processes=2, backend="local"), name="_torchdist_panel")
    panel.code.value = "print('hi from', rank)\nrank + 1"
    run = panel.launch()
    wait_for(panel)
    assert "full log: _torchdist_panel.run.logs(0)" in panel._view.logs.value
    assert "<code>_torchdist_panel.value</code>" in panel.result.value and panel.value == 1
    assert panel.run is run
    assert_no_survivors(run)


def test_launch_a_notebook_function_with_notebook_arguments(notebook, panel):
    notebook.run_cell(
        "from torchdist_magic import rank as _rank\n"
        "def scaled(x, factor=1):\n    return (x * factor, _rank())\nBASE = 21"
    )
    panel.controls["num_processes"].value = 2
    panel.controls["all_ranks"].value = True
    panel.source.value = P.FUNCTION
    panel.function.value = "scaled"
    panel.arguments.value = "BASE, factor=2"
    run = panel.launch()
    wait_for(panel)
    assert panel.value == [(42, 0), (42, 1)]
    assert run.state.job_name == "scaled"
    assert_no_survivors(run)


def test_code_with_ipython_syntax_runs_from_the_panel(panel):
    panel.controls["num_processes"].value = 2
    panel.code.value = "!echo shell on rank {rank}\n%time value = rank + 1\nvalue"
    run = panel.launch()
    wait_for(panel)
    assert panel.value == 1
    assert "shell on rank 1" in run.logs(1) and "Wall time:" in run.logs(1)
    assert_no_survivors(run)


def test_a_failing_rank_shows_its_traceback_in_the_panel(panel):
    panel.controls["num_processes"].value = 2
    panel.code.value = "x = 1\nif rank == 1:\n    raise ValueError(f'bad batch on rank {rank}')\nx"
    run = panel.launch()
    wait_for(panel)
    assert panel.value is None
    assert "RankFailure: rank 1" in panel.result.value and "ValueError: bad batch on rank 1" in panel.result.value
    assert "&lt;torchdist panel&gt;&quot;, line 3" in panel.result.value  # the panel code's own lines
    assert [r.state for r in rank_rows(run.state)][1] == "failed"
    assert not panel.launch_button.disabled
    assert_no_survivors(run)


def test_stop_cancels_the_panels_run(panel):
    panel.controls["num_processes"].value = 2
    panel.code.value = "import time\nfor i in progress(range(2000), desc='step'):\n    time.sleep(0.05)"
    run = panel.launch()
    wait_until(lambda: [r.state for r in rank_rows(run.state)] == ["running", "running"], 60, "both ranks to run")
    panel.stop_button.click()
    wait_for(panel, 60)
    assert run.state.state == "cancelled"
    assert "RunCancelled" in panel.result.value
    assert 'data-state="cancelled"' in panel._view.header.value
    assert "stopped by the panel&#x27;s Stop button; every rank was stopped" in panel._view.failure.value
    assert_no_survivors(run)


def test_a_cell_that_cannot_be_captured_is_refused_before_anything_starts(notebook, panel):
    notebook.run_cell("import threading\nPANEL_LOCK = threading.Lock()")
    panel.code.value = "with PANEL_LOCK:\n    pass"
    assert panel.launch() is None and panel.run is None
    assert "PANEL_LOCK" in panel.message.value and "torchdist-launch-error" in panel.message.value


def test_the_options_past_the_first_few_are_folded_and_open_when_one_is_refused(panel):
    from torchdist_magic.panel import FIRST_OPTIONS

    folded = panel.more_options.children[0].children
    assert len(folded) == len(panel.fields) - len(FIRST_OPTIONS) > 0
    assert panel.more_options.selected_index is None  # folded: the panel stays a screen tall
    assert all(panel.controls[name] not in row.children for row in folded for name in FIRST_OPTIONS)
    panel.code.value = "rank"
    panel.controls["hang_timeout"].value = "soon"
    assert "hang_timeout" in panel.field_errors()
    assert panel.more_options.selected_index == 0  # the refused option is in sight
    assert "--hang-timeout" in panel.more_options.titles[0]


def test_a_run_whose_channel_is_in_a_process_of_its_own_shows_its_value(notebook, panel, home):
    """``--channel process`` from the panel: the view reads the run through its feed and the
    value shows once the run's supervising process has ended it."""
    from helpers import assert_nothing_survives
    from torchdist_magic.handles import attach

    panel.controls["num_processes"].value = 2
    panel.controls["channel"].value = "process"
    panel.code.value = "print('hello from', rank)\nrank + 40"
    run = panel.launch()
    assert isinstance(run, attach.AttachedRun)
    wait_for(panel)
    assert panel.value == 40 and "40" in panel.result.value
    assert 'data-state="succeeded"' in panel._view.header.value
    assert_nothing_survives(run.run_id, run.record.pid)
