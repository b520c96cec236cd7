"""IPython syntax in a %%torchdist cell: translated on the driver by IPython, line for line
(``capture.translate_cell``), run on every rank by ``rank_shell.RankShell`` -- in process, then
through the magic on local processes and on Spark ``local[2]``."""

import ast
import base64
import contextlib
import glob
import hashlib
import io
import linecache
import os
import shutil
import socket
import sys
import zipfile

import pytest

from helpers import assert_no_survivors, cell
from torchdist_magic import RankFailure
from torchdist_magic.capture import CaptureError, capture_cell, translate_cell
from torchdist_magic.rank.shell import MagicError, PipFailed, RankShell, SList, TimeitResult

SUPPORTED = "!cmd, x = !cmd, %time, %%time, %timeit, %%timeit, %env, %cd and %pip"


# -- translation on the driver ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "source, python",
    [
        ("!ls -l\nx = 1", "get_ipython().system('ls -l')\nx = 1"),
        ("files = !ls\nfiles", "files = get_ipython().getoutput('ls')\nfiles"),
        ("%time y = f(1)\nz = y", "get_ipython().run_line_magic('time', 'y = f(1)')\nz = y"),
        (
            "for i in range(2):\n    !echo {i}\n    %time g(i)\ndone = 1",
            "for i in range(2):\n    get_ipython().system('echo {i}')\n    get_ipython().run_line_magic('time', 'g(i)')\n"
            "done = 1",
        ),
        (
            "!ls \\\n  -l\nafter = 1",  # IPython joins a continued ! line into one call
            "get_ipython().system('ls    -l')\n\nafter = 1",
        ),
        (
            "\n\n%env A=1\nafter = 1",  # IPython drops leading blank lines
            "\n\nget_ipython().run_line_magic('env', 'A=1')\nafter = 1",
        ),
        (
            "%%time\nx = 1\n!ls\nx",
            "get_ipython().run_cell_magic('time', '', \"x = 1\\nget_ipython().system('ls')\\nx\\n\")\n\n\n",
        ),
        (
            "%%timeit -n 2 setup = 1\nsetup + 1\n",
            "get_ipython().run_cell_magic('timeit', '-n 2 setup = 1', 'setup + 1\\n')\n\n",
        ),
        ("text = '''\n!not a command\n'''", "text = '''\n!not a command\n'''"),
        ("x = 1\n!ls \\", "x = 1\nget_ipython().system('ls \\\\')"),  # a backslash on the last line continues nothing
    ],
)
def test_translation_keeps_every_line_where_it_was_typed(source, python):
    assert translate_cell(source).python == python
    assert len(python.split("\n")) == len(source.split("\n"))


def test_plain_python_runs_as_typed():
    assert capture_cell("x = 1\nx", {}, []).python == ""
    assert capture_cell("!ls\nx = 1", {}, []).python == "get_ipython().system('ls')\nx = 1"


def test_code_inside_magics_is_translated_too():
    call = ast.parse(translate_cell("%%time\n!echo {a}\n%time !echo b").python).body[0].value
    assert call.args[2].value == (
        "get_ipython().system('echo {a}')\nget_ipython().run_line_magic('time', \"get_ipython().system('echo b')\")\n"
    )


def test_names_a_magic_uses_travel_and_get_ipython_does_not():
    ns = {
        "cfg": {"n": 1},
        "path": "/data",
        "build": len,
        "x": [1],
        "model": "notebook's",
        "get_ipython": object,
        "setup_value": 2,
        "n": 3,
    }
    cap = capture_cell("!echo {cfg['n']} $path\n%time model = build(x)\nmodel\n%timeit -n 2 setup_value + n", ns, [])
    assert cap.value_names == ["build", "cfg", "n", "path", "setup_value", "x"]  # not model: the cell makes it


@pytest.mark.parametrize(
    "source,message",
    [
        (
            "x = 1\n%matplotlib inline",
            "line 3, `%matplotlib inline`: %matplotlib cannot run on the ranks (they run "
            f"without IPython); a %%torchdist cell can use {SUPPORTED}. Run %matplotlib in a "
            "cell of its own.",
        ),
        ("model?", "line 2, `model?`: %pinfo cannot run on the ranks"),
        ("?", "line 2, `?`: get_ipython().show_usage cannot run on the ranks"),
        ("%%bash\nls", "line 2, `%%bash`: %%bash cannot run on the ranks"),
        (
            "x = 1\n%%time\nx",
            "line 3, `%%time`: a cell magic (%%time) must be the first line of the code, and applies to all of it",
        ),
        (
            "%%time x = 1\nx",
            "line 2, `%%time x = 1`: nothing can follow %%time on its line; the code it times goes on "
            "the lines below it",
        ),
        (
            "%timeit -x f()",
            "line 2, `%timeit -x f()`: unknown %timeit option -x (the ranks know -n N, -r R, -p P, -q and -o)",
        ),
        ("%timeit -n", "line 2, `%timeit -n`: %timeit -n needs a number"),
        ("%timeit -r0 f()", "line 2, `%timeit -r0 f()`: %timeit -r needs a whole number of at least 1, got '0'"),
        ("%%time\nok = 1\n%time y = (1,", "SyntaxError in the cell, line 4: '(' was never closed\n    %time y = (1,"),
    ],
)
def test_what_the_ranks_cannot_run_is_refused_naming_the_line(source, message):
    with pytest.raises(CaptureError) as info:
        capture_cell(source, {}, [])
    assert str(info.value).startswith(message)


# -- the rank's get_ipython(), in this process -----------------------------------------------------
@pytest.fixture
def shell():
    return RankShell()


def test_shell_output_is_the_processes_own_output(shell, capfd):
    word = "fd"  # noqa: F841  (the shell line reads it: $word)
    shell.system("echo {word} out; echo $word err >&2; exit 3")
    assert capfd.readouterr() == ("fd out\n", "fd err\n")
    assert sys._getframe().f_globals["_exit_code"] == 3


def test_shell_output_follows_a_redirected_stdout(shell):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        shell.system("echo redirected")
    assert out.getvalue() == "redirected\n"


def test_getoutput_returns_the_lines(shell):
    lines = shell.getoutput("echo one; echo two >&2")
    assert isinstance(lines, SList) and lines == ["one", "two"]
    assert (lines.n, lines.s, lines.l) == ("one\ntwo", "one two", lines)
    assert shell.getoutput("echo one", split=False) == "one\n"


@pytest.mark.parametrize(
    "command,expected",
    [
        ("echo {n * 2} $name {items[1:3]}", "4 box [2, 3]"),
        ("echo $$HOME-literal", os.path.expandvars("$HOME") + "-literal"),  # $$ is the shell's $
        ("echo '$name'", "$name"),  # not inside single quotes
        ("echo {missing} $name", "{missing}"),  # IPython: left as typed when it fails
    ],
)
def test_expansion_is_ipythons(shell, command, expected):
    n, name, items = 2, "box", [1, 2, 3, 4]  # noqa: F841 (read by the expansion)
    assert shell.getoutput(command).n.rstrip() == expected


def test_env(shell, monkeypatch, capsys):
    monkeypatch.setenv("TORCHDIST_TEST_TOKEN", "s3cret")
    monkeypatch.delenv("TORCHDIST_TEST_MODE", raising=False)
    assert shell.run_line_magic("env", "TORCHDIST_TEST_MODE=fast") is None
    assert capsys.readouterr().out == "env: TORCHDIST_TEST_MODE=fast\n"
    shell.run_line_magic("env", "TORCHDIST_TEST_MODE slow")
    assert shell.run_line_magic("env", "TORCHDIST_TEST_MODE") == "slow" == os.environ["TORCHDIST_TEST_MODE"]
    everything = shell.run_line_magic("env", "")
    assert everything["TORCHDIST_TEST_MODE"] == "slow" and everything["TORCHDIST_TEST_TOKEN"] == "<hidden>"
    with pytest.raises(MagicError, match="^%env NOPE_NOT_SET: rank 0 has no environment variable NOPE_NOT_SET$"):
        shell.run_line_magic("env", "NOPE_NOT_SET")
    with pytest.raises(
        MagicError,
        match=r"^%env A B=c: an environment variable name has no spaces \('A B'\); "
        "write %env NAME=value$",
    ):
        shell.run_line_magic("env", "A B=c")


def test_cd(shell, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a dir").mkdir()
    shell.run_line_magic("cd", "'a dir'")
    assert os.getcwd() == str(tmp_path / "a dir") and capsys.readouterr().out == f"{tmp_path / 'a dir'}\n"
    shell.run_line_magic("cd", "-q -")
    assert os.getcwd() == str(tmp_path) and capsys.readouterr().out == ""
    with pytest.raises(MagicError, match="^%cd a b: give one directory"):
        shell.run_line_magic("cd", "a b")


def test_time_prints_and_returns_like_ipython(shell, capsys):
    assert shell.run_line_magic("time", "2 + 3") == 5
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("CPU times: user ") and out[1].startswith("Wall time: ")
    cell_namespace = {"get_ipython": shell.get_ipython}
    exec("value = get_ipython().run_cell_magic('time', '', 'a = 4\\na * 2\\n')", cell_namespace)
    assert cell_namespace["value"] == 8 and cell_namespace["a"] == 4
    with pytest.raises(ZeroDivisionError):
        shell.run_line_magic("time", "1 / 0")
    assert "Wall time: " in capsys.readouterr().out  # timed even when it raises
    with pytest.raises(MagicError, match="^%%time x: nothing can follow %%time on its line"):
        shell.run_cell_magic("time", "x", "1")


def test_timeit_options(shell, capsys):
    result = shell.run_line_magic("timeit", "-n 3 -r 2 -o -q sum(range(10))")
    assert isinstance(result, TimeitResult) and (result.loops, result.repeat, len(result.all_runs)) == (3, 2, 2)
    assert capsys.readouterr().out == ""
    assert shell.run_cell_magic("timeit", "-n2 -r1 calls = []", "calls.append(1)\nassert len(calls) <= 2") is None
    assert capsys.readouterr().out.strip().endswith("(mean ± std. dev. of 1 run, 2 loops each)")
    with pytest.raises(MagicError, match="^unknown %timeit option -z"):
        shell.run_line_magic("timeit", "-z 1")


def test_a_magic_the_ranks_lack_is_named_when_called(shell):
    with pytest.raises(MagicError, match=f"^%matplotlib cannot run on the ranks .* can use {SUPPORTED}."):
        shell.run_line_magic("matplotlib", "inline")
    with pytest.raises(MagicError, match="^%%bash cannot run on the ranks"):
        shell.run_cell_magic("bash", "", "ls")


@pytest.mark.parametrize(
    "source,lines,shown",
    [
        (
            "\nx = 1\n%time y = x / (x - 1)\n",
            [3, 3],
            "    %time y = x / (x - 1)\n              ~~^~~~~~~~~\n",
        ),  # marks the code, not "%time"
        ("\n%%time\nx = 1\ny = x / (x - 1)\n", [2, 4], "    y = x / (x - 1)\n        ~~^~~~~~~~~\n"),
    ],
)
def test_traceback_through_time_shows_the_cells_lines(source, lines, shown):
    from torchdist_magic.rank.jobrun import _format_exception

    filename = "<torchdist cell In[7]>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        exec(compile(translate_cell(source).python, filename, "exec"), {"get_ipython": RankShell().get_ipython})
    except ZeroDivisionError as exc:
        text = _format_exception(exc)
    finally:
        del linecache.cache[filename]
    assert "rank_shell" not in text
    frames = [line for line in text.splitlines() if line.startswith("  File")]
    assert frames[1:] == [f'  File "{filename}", line {n}, in <module>' for n in lines]  # after this test's own
    assert shown in text


def test_pip_runs_once_and_its_failure_reaches_every_rank_of_the_host(tmp_path, monkeypatch, capfd):
    missing = tmp_path / "missing-0.1-py3-none-any.whl"
    line = f"install --no-index --disable-pip-version-check {missing}"
    monkeypatch.setenv("TORCHDIST_HOST_RANKS", "0,1")  # as on Spark: LOCAL_WORLD_SIZE is 1 there
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    failures = []
    for rank in ("0", "1"):  # two ranks of one host, one after the other, at the same %pip
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(PipFailed) as info:
            RankShell().run_line_magic("pip", line)
        failures.append(str(info.value))
    host = socket.gethostname()
    assert failures == [
        f"%pip {line} failed on {host}: pip exited with code 1 (its output is above)",
        f"%pip {line} failed on {host}: pip exited with code 1 (its output is in rank 0's log)",
    ]
    out = "".join(capfd.readouterr())
    assert out.count(f"Processing {missing}") == 1  # pip ran once
    assert f"%pip {line}: pip ran once for this host, on rank 0" in out
    # and the lock file is gone: conftest checks that this test's temp directory is empty


# -- through the magic, on real ranks --------------------------------------------------------------


def tiny_wheel(directory, name):
    """A wheel of package ``name`` (``VALUE = 41``), written by hand."""
    dist_info = f"{name}-0.1.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 41\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist_info}/RECORD"] = "\n".join(record + [f"{dist_info}/RECORD,,"]) + "\n"
    wheel = directory / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


EVERY_FORM = """
    %%torchdist --np 2 {where} --timeout 120 --env TMPDIR={rank_tmp}
    %%time
    import os, sys
    import torch, torch.distributed as dist
    !echo {{greeting}} from rank {{rank}}
    files = !echo one; echo two >&2
    %time total = sum(range(10))
    %timeit -n 3 -r 2 total * 2
    %timeit -r 1 dist.all_reduce(torch.ones(1))
    %env TORCHDIST_TEST_MODE=fast
    mode = %env TORCHDIST_TEST_MODE
    %cd {{workdir}}
    %pip install --no-index --no-deps --disable-pip-version-check --target {{target}} {{wheel}}
    sys.path.insert(0, target)
    import {package} as tiny
    (rank, files, total, mode, os.getcwd(), tiny.VALUE, [m for m in ("IPython", "ipywidgets") if m in sys.modules])
"""


@pytest.mark.parametrize("where", ["local", pytest.param("spark_local2", marks=pytest.mark.spark)])
def test_every_form_runs_on_every_rank(ip, request, tmp_path, where):
    if where != "local":
        request.getfixturevalue(where)
    package = f"torchdist_tiny_{where}"
    rank_tmp = tmp_path / "rank-tmp"
    rank_tmp.mkdir()
    ip.user_ns.update(
        greeting="hello", workdir=str(tmp_path), target=str(tmp_path / "site"), wheel=str(tiny_wheel(tmp_path, package))
    )
    result = cell(
        ip, EVERY_FORM.format(where="--local" if where == "local" else "--spark", rank_tmp=rank_tmp, package=package)
    )
    run = ip.user_ns["_torchdist_run"]
    assert result.error_in_exec is None, run.logs(0) + run.logs(1)
    assert result.result == (0, ["one", "two"], 45, "fast", str(tmp_path), 41, [])  # a rank has no IPython
    logs = [run.logs(r) for r in range(2)]
    for r, log in enumerate(logs):
        assert f"hello from rank {r}\n" in log
        assert log.count("Wall time: ") == 2  # %time, then %%time around the whole cell
        assert "(mean ± std. dev. of 2 runs, 3 loops each)" in log and "of 1 run, " in log
        assert f"env: TORCHDIST_TEST_MODE=fast\n{tmp_path}\n" in log
    installed = [r for r, log in enumerate(logs) if f"Successfully installed {package.replace('_', '-')}-0.1" in log]
    assert len(installed) == 1, logs  # once for the host, by one rank
    assert f"pip ran once for this host, on rank {installed[0]}" in logs[1 - installed[0]]
    assert not glob.glob(str(rank_tmp / "torchdist-*" / "torchdist-pip-*"))  # in the user's private directory
    assert_no_survivors(run)


def test_a_failure_after_a_time_line_reports_the_cells_line(ip):
    result = cell(
        ip,
        """
        %%torchdist --np 2
        %time x = rank * 2
        if rank == 1:
            raise ValueError("after %time")
    """,
    )
    err = result.error_in_exec
    assert isinstance(err, RankFailure) and err.rank == 1
    assert f'File "<torchdist cell In[{result.execution_count}]>", line 4, in <module>' in err.traceback
    assert 'raise ValueError("after %time")' in err.traceback
    assert_no_survivors(ip.user_ns["_torchdist_run"])


def test_an_unknown_magic_is_a_usage_error_before_launch(ip, capsys):
    ip.user_ns["_torchdist_run"] = before = object()
    cell(
        ip,
        """
        %%torchdist --np 2
        x = 1
        %load_ext autoreload
    """,
    )
    text = "".join(capsys.readouterr())
    assert (
        "UsageError: line 3, `%load_ext autoreload`: %load_ext cannot run on the ranks (they run without IPython)"
    ) in text
    assert "Traceback" not in text and ip.user_ns["_torchdist_run"] is before  # nothing started


@pytest.mark.gpu
def test_shell_commands_see_the_gpus_in_a_gpu_cell(ip):
    if shutil.which("nvidia-smi") is None:  # before importing torch, which takes seconds
        pytest.skip("needs a CUDA device")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    n = torch.cuda.device_count()
    result = cell(
        ip,
        f"""
        %%torchdist --np {n} --gpu --timeout 120
        import torch, torch.distributed as dist
        !nvidia-smi -L
        %timeit -r 1 dist.all_reduce(torch.ones(1, device=device))
        rank
    """,
    )
    run = ip.user_ns["_torchdist_run"]
    assert result.error_in_exec is None and result.result == 0, run.logs(0)
    for r in range(n):
        assert "GPU 0: " in run.logs(r) and "of 1 run, " in run.logs(r)  # nccl: agreed on one loop count
    assert_no_survivors(run)
