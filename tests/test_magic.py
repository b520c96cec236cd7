"""%%torchdist through a real IPython shell, with real worker processes."""

import os
import re
import subprocess
import sys

import pytest

from helpers import assert_no_survivors, cell
from torchdist_magic import RankFailure, last_run


def fresh_ipython(*lines):
    """The first two lines a new IPython process prints after ``%load_ext`` and ``lines``."""
    code = "\n".join(
        (
            "import sys",
            "from IPython.testing.globalipapp import start_ipython",
            "ip = start_ipython()",
            "ip.run_line_magic('load_ext', 'torchdist_magic')",
            "m = ip.magics_manager.magics",
        )
        + lines
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.split("\n")[:2]


def test_load_is_light():
    assert fresh_ipython(
        "print(sorted(x for x in ('torch', 'pyspark', 'ipywidgets', 'cloudpickle', 'cryptography', 'pynvml', 'mlflow', 'msgspec') if x in sys.modules))",
        "print('torchdist' in m['cell'])",
    ) == ["[]", "True"]


def test_percent_torchdist_version_prints_the_release(ip, capsys):
    import torchdist_magic

    assert ip.run_line_magic("torchdist", "--version") is None
    assert capsys.readouterr().out == f"torchdist_magic {torchdist_magic.__version__}\n"
    # the wheel's metadata says the same release (setup.cfg reads it: one value)
    from importlib import metadata

    assert metadata.version("torchdist_magic") == torchdist_magic.__version__


def test_notebook_imports_classes_and_helpers(ip):
    cell(
        ip,
        """
        import numpy as np
        import torch
        from torch import nn as tnn
        import torch.nn.functional as F
        from collections import OrderedDict as OD
        SCALE = 3
        class Net(tnn.Module):
            def __init__(self):
                super().__init__()
                self.fc = tnn.Linear(4, 2)
            def forward(self, x):
                return F.relu(self.fc(x))
        def helper(x):
            return x * SCALE
    """,
    )
    result = cell(
        ip,
        """
        %%torchdist --np 2
        net = Net()
        out = net(torch.ones(1, 4))
        (helper(rank), np.arange(3).sum().item(), list(OD(a=1)), tuple(out.shape), world_size)
    """,
    )
    assert result.error_in_exec is None
    assert result.result == (0, 3, ["a"], (1, 2), 2)
    assert ip.user_ns["Out"][result.execution_count] == result.result
    assert_no_survivors(last_run())


def test_captured_values_are_only_what_the_cell_uses(ip):
    from torchdist_magic.capture import capture_cell

    ns = {"used": 1, "unused": 2, "later": 3, "np": __import__("numpy"), "f": len}
    cap = capture_cell("x = used + 1\nlater = 5\nprint(later, f(x), np.pi)\n", ns, [])
    assert cap.value_names == ["f", "used"]
    assert ("import numpy as np", "the notebook's 'np'") in cap.imports


def test_databricks_seed_code_unchanged(ip):
    result = cell(
        ip,
        """
        %%torchdist --np 2
        import torch
        import torch.distributed as dist
        import torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        dist.init_process_group("gloo")
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        sampler = DistributedSampler(data)
        loader = DataLoader(data, batch_size=8, sampler=sampler)
        model = DDP(nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
        state = {k: v.clone() for k, v in model.module.state_dict().items()}
        dist.destroy_process_group()
        sorted(state)
    """,
    )
    assert result.error_in_exec is None
    assert result.result == ["bias", "weight"]


def test_cell_defines_and_uses_its_own_function_and_class(ip):
    result = cell(
        ip,
        """
        %%torchdist --np 2
        import torch
        import torch.distributed as dist
        class Acc:
            def __init__(self):
                self.total = 0
        def square(v):
            return v * v
        acc = Acc()
        for i in progress(range(4), desc="steps"):
            acc.total += square(i)
            report(total=acc.total)
        t = torch.tensor([float(acc.total)])
        dist.all_reduce(t)
        t.item()
    """,
    )
    assert result.error_in_exec is None
    assert result.result == 28.0
    state = last_run().state
    assert state.ranks[1].current_progress()["n"] == 4
    assert state.ranks[0].metrics["total"] == 14.0


def test_out_variable_and_semicolon(ip):
    result = cell(
        ip,
        """
        %%torchdist --np 2 --out weights
        {"rank": rank}
    """,
    )
    assert result.result is None and ip.user_ns["weights"] == {"rank": 0}
    before = ip.user_ns["_torchdist_run"]
    result = cell(
        ip,
        """
        %%torchdist --np 1
        print("the cell ran")
        41 + 1;
    """,
    )
    assert result.error_in_exec is None and result.result is None
    run = ip.user_ns["_torchdist_run"]
    # the cell ran, and its last expression, ended by ";", is no value (as in IPython)
    assert run is not before and run.logs(0) == "the cell ran\n" and run.result() is None


def test_all_ranks(ip):
    result = cell(
        ip,
        """
        %%torchdist --np 2 --all-ranks
        rank * 10
    """,
    )
    assert result.result == [0, 10]


def test_backend_options_add_to_their_config_default_and_the_backend_checks_them(ip, capsys):
    ip.run_line_magic("config", "TorchdistMagics.default_backend_options = {'partition': 'gpu'}")
    try:
        result = ip.run_cell("%%torchdist --backend local --backend-option time=01:00:00\n1")
    finally:
        ip.run_line_magic("config", "TorchdistMagics.default_backend_options = {}")
    assert result.error_in_exec is not None
    text = capsys.readouterr()
    text = text.out + text.err
    assert "UsageError: backend 'local' has no option 'partition', 'time': it takes no backend options" in text
    assert "Traceback" not in text


def test_env_flag_and_config_default(ip):
    ip.run_line_magic("config", "TorchdistMagics.default_np = 2")
    try:
        result = cell(
            ip,
            """
            %%torchdist --env MODE=fast --env DEPTH=3 --env 'NOTE=two words'
            import os
            (world_size, os.environ["MODE"], os.environ["DEPTH"], os.environ["NOTE"])
        """,
        )
    finally:
        ip.run_line_magic("config", "TorchdistMagics.default_np = 1")
    assert result.result == (2, "fast", "3", "two words")


def test_a_cell_resumes_from_its_checkpoint_after_a_restart(ip, tmp_path, capsys):
    result = cell(
        ip,
        f"""
        %%torchdist --np 2 --max-restarts 1 --checkpoint-dir {tmp_path / "checkpoints"}
        import os, signal, time
        state = load_checkpoint() or {{"epoch": 0}}
        start = state["epoch"]
        for epoch in range(start, 4):
            save_checkpoint({{"epoch": epoch + 1}})
            if epoch == 1 and rank == 1 and restart_count() == 0:
                while load_checkpoint() is None:  # rank 0 saved one (a loaded machine may hold it up)
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
        (start, restart_count())
    """,
    )
    assert result.error_in_exec is None, result.error_in_exec
    start, attempt = result.result
    assert attempt == 1 and start > 0  # resumed, not started over
    out = capsys.readouterr().out
    assert "torchdist: attempt 1 failed (rank 1 on " in out and "restarting: attempt 2 of 2" in out
    assert ip.user_ns["_torchdist_run"].attempt == 2


def test_failing_rank_shows_cell_line(ip, capsys):
    result = cell(
        ip,
        """
        %%torchdist --np 2
        x = 1
        if rank == 1:
            raise ValueError("bad shard")
        x
    """,
    )
    err = result.error_in_exec
    assert isinstance(err, RankFailure) and err.rank == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert f'File "<torchdist cell In[{result.execution_count}]>", line 4, in <module>' in text
    assert 'raise ValueError("bad shard")' in text
    assert "RankFailure: rank 1 on" in text and "raised ValueError: bad shard" in text
    assert_no_survivors(last_run())
    assert cell(ip, "1 + 1").result == 2  # the kernel stays usable


@pytest.mark.parametrize(
    "source,expected",
    [
        ("%%torchdist --np 0\n1", "UsageError: --np must be at least 1, got 0"),
        ("%%torchdist --np x\n1", "UsageError: argument --np: needs N or MIN:MAX (whole numbers), got 'x'"),
        ("%%torchdist --bogus\n1", "UsageError: unrecognized arguments: --bogus"),
        (
            "%%torchdist --backend yarn\n1",
            "UsageError: --backend must be one of auto, local, spark, slurm, ray, got 'yarn'",
        ),
        (
            "%%torchdist --backend-option NOVALUE\n1",
            "UsageError: --backend-option entry 'NOVALUE' is not of the form KEY=VALUE",
        ),
        ("%%torchdist --timeout -1\n1", "UsageError: --timeout must be a positive number of seconds, got -1"),
        ("%%torchdist --env NOVALUE\n1", "UsageError: --env entry 'NOVALUE' is not of the form KEY=VALUE"),
        ("%%torchdist --env 1A=x\n1", "UsageError: --env: '1A' is not a valid environment variable name"),
        ("%%torchdist --local --spark\n1", "UsageError: --local and --spark contradict each other: give one"),
        ("%%torchdist --spark --backend local\n1", "UsageError: --spark and --backend local contradict each other"),
        (
            "%%torchdist --np 2 --spark\n1",
            "UsageError: backend 'spark' (--spark, local_mode=False) runs on the "
            "active SparkSession (classic or Spark Connect), and this process has none",
        ),
        ("%%torchdist --out 1x\n1", "UsageError: --out needs a variable name, got '1x'"),
        ("%%torchdist script.py\n1", "UsageError: unexpected argument 'script.py': %%torchdist takes only flags"),
        ("%%torchdist\n\n", "UsageError: the %%torchdist cell is empty"),
        ("%%torchdist --env 'A=b\n1", "UsageError: cannot parse the flags: No closing quotation"),
        ("%torchdist --np 2", "UsageError: %torchdist needs a script"),
        ("%torchdist missing_script.py", "UsageError: script 'missing_script.py' does not exist"),
        ("%%torchdist --np 2\nx = (1,\ny = 2", "UsageError: SyntaxError in the cell, line 2: '(' was never closed"),
    ],
)
def test_usage_errors_without_traceback(ip, capsys, source, expected):
    result = ip.run_cell(source)
    assert result.error_in_exec is not None or result.error_before_exec is not None
    out = capsys.readouterr()
    text = out.out + out.err
    assert expected in text
    assert "Traceback" not in text


def test_unpicklable_global_named(ip, capsys):
    cell(ip, "import threading\nguard = threading.Lock()")
    cell(
        ip,
        """
        %%torchdist --np 2
        with guard:
            pass
    """,
    )
    text = "".join(capsys.readouterr())
    assert "UsageError: the cell uses 'guard' (a _thread.lock) from the notebook, which cannot be sent" in text
    assert "Traceback" not in text


def test_large_payload_warns_with_names(ip):
    cell(ip, "big = b'x' * (3 * 2**20)\nsmall = 1")
    ip.run_line_magic("config", "TorchdistMagics.payload_warning_mb = 1.0")
    try:
        with pytest.warns(
            UserWarning, match=r"the cell sends 3 MB of notebook values to every rank; largest: big \(3 MB\)"
        ):
            result = cell(ip, "%%torchdist\nlen(big) + small")
    finally:
        ip.run_line_magic("config", "TorchdistMagics.payload_warning_mb = 100.0")
    assert result.result == 3 * 2**20 + 1


def test_import_failing_on_worker_names_the_statement(ip, tmp_path, capsys):
    (tmp_path / "only_on_driver.py").write_text("VALUE = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        cell(ip, "import only_on_driver as odd")
        os.remove(tmp_path / "only_on_driver.py")
        result = cell(ip, "%%torchdist\nodd.VALUE")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("only_on_driver", None)
        ip.user_ns.pop("odd", None)
    assert isinstance(result.error_in_exec, RankFailure)
    assert result.error_in_exec.exc_type == "CellImportError"
    assert "the notebook import `import only_on_driver as odd`" in result.error_in_exec.message
    assert "ModuleNotFoundError" in result.error_in_exec.message


def test_line_form_runs_a_script(ip, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys, os\nprint('script', os.environ['RANK'], sys.argv[1:])\n")
    result = cell(ip, f"%torchdist --np 2 {script} --lr 0.1 --epochs 2")
    assert result.error_in_exec is None
    assert "script 1 ['--lr', '0.1', '--epochs', '2']" in last_run().logs(1)


def test_help_text(ip):
    from torchdist_magic.magic import TorchdistMagics

    doc = ip.magics_manager.magics["cell"]["torchdist"].__doc__
    for flag in (
        "--np <N|MIN:MAX>",
        "--min-np N",
        "--gpu",
        "--local",
        "--spark",
        "--timeout SECONDS",
        "--env <KEY=VALUE>",
        "--out NAME",
        "--all-ranks",
        "--backend",
        "--hang-timeout SECONDS",
        "--max-restarts N",
        "--checkpoint-dir PATH",
        "--keep-checkpoints K",
    ):
        assert flag in doc
    assert "rank 0's value is the result" in doc
    words = " ".join(doc.split())  # argparse wraps to the terminal's width
    for flag_help in (
        "--np <N|MIN:MAX> number of ranks (processes) to start; MIN:MAX (num_processes=(MIN, MAX)) starts as many",
        "--timeout SECONDS stop every rank and raise TimeoutError after SECONDS",
        "--env <KEY=VALUE> extra environment variable for every rank (repeatable)",
        "--all-ranks return every rank's value as a list indexed by rank",
    ):
        assert flag_help in words
    settings = " ".join(TorchdistMagics.class_get_help().split())  # what %config TorchdistMagics lists
    for setting_help in (
        "--TorchdistMagics.default_np=<Int> number of ranks when --np is not given Default: 1",
        "--TorchdistMagics.default_timeout=<Float> timeout in seconds when --timeout is not "
        "given (None: no limit) Default: None",
        "--TorchdistMagics.cell_filename=<Unicode> filename tracebacks show for a cell; {n} is the execution count",
    ):
        assert setting_help in settings


def test_flags_match_launch_options():
    from IPython.core.magic_arguments import construct_parser

    from torchdist_magic.magic import TorchdistMagics
    from torchdist_magic.core.options import option_fields

    parser = construct_parser(TorchdistMagics.torchdist)
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in option_fields()} <= dests
    assert dests - {f.name for f in option_fields()} == {
        "local",
        "spark",
        "out",
        "quiet",
        "data",
        "columns",
        "script",
        "script_args",
    }


def test_unload_removes_magics():
    assert fresh_ipython(
        "ip.run_line_magic('unload_ext', 'torchdist_magic')",
        "print('torchdist' in m['cell'], 'torchdist' in m['line'], 'torchdist_panel' in m['line'])",
        "ip.run_line_magic('load_ext', 'torchdist_magic')",
        "print('torchdist' in m['cell'])",
    ) == ["False False False", "True"]


def test_function_that_sets_up_its_own_group_runs_in_a_cell(ip):
    cell(
        ip,
        """
        import torch.distributed as dist
        def torchdistributor_style(x):
            dist.init_process_group("gloo")
            r = dist.get_rank()
            return r + x
    """,
    )
    result = cell(ip, "%%torchdist --np 2 --all-ranks\ntorchdistributor_style(10)")
    assert result.error_in_exec is None
    assert result.result == [10, 11]


def test_traceback_through_a_notebook_function_shows_its_source(ip):
    cell(
        ip,
        """
        def bad_shard(r):
            if r == 1:
                raise KeyError("shard " + str(r))
            return r
    """,
    )
    result = cell(ip, "%%torchdist --np 2\nbad_shard(rank)")
    err = result.error_in_exec
    assert isinstance(err, RankFailure) and err.exc_type == "KeyError"
    assert 'raise KeyError("shard " + str(r))' in err.traceback
    assert "bad_shard(rank)" in err.traceback


def test_quiet_shows_the_result_and_nothing_else(ip, capsys):
    capsys.readouterr()
    result = cell(
        ip,
        """
        %%torchdist --np 2 --quiet
        print("from a rank")
        rank + 40
    """,
    )
    assert result.result == 40
    out = capsys.readouterr()
    assert re.fullmatch(r"Out\[\d+\]: 40\n", out.out) and out.err == ""  # IPython shows the value
    assert "from a rank" in ip.user_ns["_torchdist_run"].logs(1)


def test_the_cells_run_is_kept_in_the_notebook(ip):
    cell(ip, "%%torchdist --np 2\nprint('hi', rank)")
    run = ip.user_ns["_torchdist_run"]
    assert run.done() and run.state.state == "succeeded" and "hi 1" in run.logs(1)


def test_invalid_config_default_is_a_usage_error(ip, capsys):
    ip.run_line_magic("config", "TorchdistMagics.default_np = 0")
    try:
        ip.run_cell("%%torchdist\n1")
    finally:
        ip.run_line_magic("config", "TorchdistMagics.default_np = 1")
    text = "".join(capsys.readouterr())
    assert "UsageError: %config TorchdistMagics: num_processes must be at least 1, got 0" in text


def test_config_default_backend_is_used_when_no_flag_names_one(ip):
    from pyspark.sql import SparkSession

    assert SparkSession.getActiveSession() is None
    before = last_run()
    ip.run_line_magic("config", "TorchdistMagics.default_backend = 'spark'")
    try:
        refused = cell(ip, "%%torchdist --np 2\n1")
        flagged = cell(ip, "%%torchdist --np 2 --local --quiet\nrank + 7")
    finally:
        ip.run_line_magic("config", "TorchdistMagics.default_backend = 'auto'")
    text = str(refused.error_in_exec)
    assert "runs on the active SparkSession (classic or Spark Connect), and this process has none" in text
    assert flagged.error_in_exec is None and flagged.result == 7  # a flag still wins
    run = last_run()
    assert run is not before and run.options.backend == "local"
    assert_no_survivors(run)


def test_config_default_timeout_stops_a_cell_without_timeout(ip):
    from torchdist_magic import JobTimeout

    ip.run_line_magic("config", "TorchdistMagics.default_timeout = 3.0")
    try:
        result = cell(
            ip,
            """
            %%torchdist --np 2 --quiet
            import time
            time.sleep(120)
        """,
        )
    finally:
        ip.run_line_magic("config", "TorchdistMagics.default_timeout = None")
    err = result.error_in_exec
    assert isinstance(err, JobTimeout), err
    assert err.headline == "distributed run timed out after 3 s; every rank was stopped"
    run = ip.user_ns["_torchdist_run"]
    assert run.options.timeout == 3.0 and run.state.state == "timed out"
    assert_no_survivors(run)


def test_config_cell_filename_names_the_cell_in_tracebacks(ip):
    ip.run_line_magic("config", "TorchdistMagics.cell_filename = 'train.ipynb, cell {n}'")
    try:
        result = cell(
            ip,
            """
            %%torchdist --np 2 --quiet
            x = 1
            raise ValueError("bad shard")
        """,
        )
    finally:
        ip.run_line_magic("config", "TorchdistMagics.cell_filename = '<torchdist cell In[{n}]>'")
    err = result.error_in_exec
    assert isinstance(err, RankFailure) and err.message == "bad shard"
    assert f'File "train.ipynb, cell {result.execution_count}", line 3, in <module>' in err.traceback
    assert "<torchdist cell" not in err.traceback
    assert_no_survivors(last_run())
