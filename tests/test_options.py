"""LaunchOptions, the flags built from it, errors that name what the user typed; runtime
helpers outside a run; RankFailure."""

import dataclasses
import pickle

import pytest

from torchdist_magic import LaunchOptions, is_main, local_rank, progress, rank, report, world_size
from torchdist_magic.core.errors import RankFailure
from torchdist_magic.core.failure import Failure
from torchdist_magic.core.flags import FlagError, flag_parser, options_from_flags, parse_flags
from torchdist_magic.core.options import OptionError, option_fields


def test_defaults_and_no_environment_probe(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    opts = LaunchOptions()
    assert (opts.num_processes, opts.use_gpu, opts.backend, opts.timeout, opts.env) == (1, False, "auto", None, {})
    assert "torch" not in sys.modules


def test_every_field_documented_with_a_flag():
    names = {f.name for f in dataclasses.fields(LaunchOptions)}
    flagged = {f.name: f.metadata for f in option_fields()}
    assert set(flagged) == names
    assert all(m["help"] and m["flag"].startswith("--") for m in flagged.values())


def test_backend_option_forms_normalise():
    assert LaunchOptions(backend_options=["partition=gpu", "time=1:00:00"]).backend_options == {
        "partition": "gpu",
        "time": "1:00:00",
    }
    assert LaunchOptions(backend_options={"nodes": 2}).backend_options == {"nodes": "2"}
    assert LaunchOptions(backend_options="spec_dir=/x=y").backend_options == {"spec_dir": "/x=y"}


def test_env_forms_normalise():
    assert LaunchOptions(env=["A=1", "B=x=y"]).env == {"A": "1", "B": "x=y"}
    assert LaunchOptions(env={"N": 3}).env == {"N": "3"}
    assert LaunchOptions(env="C=").env == {"C": ""}


#: (keyword, bad value, exception, message with the Python name, the same with the flag)
BAD = [
    ("num_processes", 0, ValueError, "num_processes must be at least 1, got 0", "--np must be at least 1, got 0"),
    ("num_processes", 1.5, TypeError, "num_processes must be a whole number, got 1.5", "--np must be a whole number"),
    ("use_gpu", "yes", TypeError, "use_gpu must be True or False, got 'yes'", "--gpu must be True or False"),
    (
        "backend",
        "yarn",
        ValueError,
        "backend must be one of auto, local, spark, slurm, ray, got 'yarn' (a package adds one with an entry point in the group 'torchdist_magic.backends', or register_backend())",
        "--backend must be one of",
    ),
    (
        "timeout",
        -1.0,
        ValueError,
        "timeout must be a positive number of seconds, got -1",
        "--timeout must be a positive",
    ),
    ("timeout", "soon", TypeError, "timeout must be a number of seconds, got 'soon'", "--timeout must be a number"),
    ("env", ["NOEQUALS"], ValueError, "env entry 'NOEQUALS' is not of the form KEY=VALUE", "--env entry 'NOEQUALS'"),
    ("env", {"1BAD": "x"}, ValueError, "env: '1BAD' is not a valid environment variable name", "--env: '1BAD'"),
    ("env", {"A": None}, TypeError, "env: the value of A must be a string or number, got NoneType", "--env: the value"),
    ("env", {"A": "a\x00b"}, ValueError, "env: the value of A contains a NUL byte", "--env: the value of A contains"),
    ("env", 3, TypeError, "env must be a dict or a list of 'KEY=VALUE' strings, got int", "--env must be a dict"),
    (
        "backend_options",
        ["partition"],
        ValueError,
        "backend_options entry 'partition' is not of the form KEY=VALUE",
        "--backend-option entry 'partition'",
    ),
    (
        "backend_options",
        {"Part": "x"},
        ValueError,
        "backend_options: 'Part' is not a backend option's name (lower-case letters, digits, '_' and '-')",
        "--backend-option: 'Part' is not",
    ),
    (
        "backend_options",
        {"time": None},
        TypeError,
        "backend_options: the value of time must be a string or number, got NoneType",
        "--backend-option: the value of time",
    ),
    (
        "backend_options",
        {"time": "a\x00"},
        ValueError,
        "backend_options: the value of time contains a NUL byte",
        "--backend-option: the value of time contains",
    ),
    (
        "backend_options",
        3,
        TypeError,
        "backend_options must be a dict or a list of 'KEY=VALUE' strings, got int",
        "--backend-option must be a dict",
    ),
    ("all_ranks", 1, TypeError, "all_ranks must be True or False, got 1", "--all-ranks must be True or False"),
    (
        "hang_timeout",
        0,
        ValueError,
        "hang_timeout must be a positive number of seconds, got 0",
        "--hang-timeout must be a positive number of seconds, got 0",
    ),
    ("hang_timeout", "5", TypeError, "hang_timeout must be a number of seconds, got '5'", "--hang-timeout must be"),
    ("max_restarts", -1, ValueError, "max_restarts must be at least 0, got -1", "--max-restarts must be at least 0"),
    ("max_restarts", 1.0, TypeError, "max_restarts must be a whole number, got 1.0", "--max-restarts must be a whole"),
    ("keep_checkpoints", 0, ValueError, "keep_checkpoints must be at least 1, got 0", "--keep-checkpoints must be at"),
    ("checkpoint_dir", 3, TypeError, "checkpoint_dir must be a path, got 3", "--checkpoint-dir must be a path"),
    (
        "checkpoint_dir",
        " ",
        ValueError,
        "checkpoint_dir must be a directory path, got ' '",
        "--checkpoint-dir must be a directory path",
    ),
    (
        "tls",
        "yes",
        TypeError,
        "tls must be True, False or None (the backend's default), got 'yes'",
        "--tls must be True, False or None",
    ),
    ("mlflow", "yes", TypeError, "mlflow must be True or False, got 'yes'", "--mlflow must be True or False"),
]


@pytest.mark.parametrize("name, value, error, python_text, flag_text", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_refused_values_name_the_keyword_or_the_flag(name, value, error, python_text, flag_text):
    with pytest.raises(error) as info:
        LaunchOptions(**{name: value})
    assert isinstance(info.value, OptionError)
    assert str(info.value) == python_text
    assert info.value.for_flags().startswith(flag_text)


def test_restart_and_watchdog_flags():
    import pathlib

    opts = options_from_flags(
        parse_flags("--max-restarts 2 --checkpoint-dir '/dbfs/my runs' --keep-checkpoints 5 --hang-timeout 120"),
        LaunchOptions(),
    )
    assert (opts.max_restarts, opts.checkpoint_dir, opts.keep_checkpoints, opts.hang_timeout) == (
        2,
        "/dbfs/my runs",
        5,
        120.0,
    )
    assert LaunchOptions(checkpoint_dir=pathlib.Path("/tmp/c")).checkpoint_dir == "/tmp/c"
    defaults = LaunchOptions()
    assert (defaults.max_restarts, defaults.checkpoint_dir, defaults.keep_checkpoints, defaults.hang_timeout) == (
        0,
        None,
        3,
        None,
    )
    with pytest.raises(FlagError, match=r"^--max-restarts must be at least 0, got -1$"):
        options_from_flags(parse_flags("--max-restarts -1"), LaunchOptions())


def test_replace_validates_again():
    with pytest.raises(ValueError, match="num_processes must be at least 1"):
        LaunchOptions().replace(num_processes=0)


def test_flags_parse_into_options_with_defaults_for_what_is_not_given():
    defaults = LaunchOptions(num_processes=3, timeout=9.0)
    args = parse_flags("--gpu --env 'A=x y' --env B=2 --all-ranks --local")
    opts = options_from_flags(args, defaults)
    assert (opts.num_processes, opts.use_gpu, opts.backend, opts.timeout) == (3, True, "local", 9.0)
    assert opts.env == {"A": "x y", "B": "2"} and opts.all_ranks
    assert options_from_flags(parse_flags("--np 2 --timeout 1.5 --spark"), defaults).backend == "spark"


@pytest.mark.parametrize(
    "line, text",
    [
        ("--local --spark", "--local and --spark contradict each other: give one"),
        ("--spark --backend local", "--spark and --backend local contradict each other: give one"),
        ("--np", "argument --np: expected one argument"),
        ("--np two", "argument --np: needs N or MIN:MAX \\(whole numbers\\), got 'two'"),
        ("--frobnicate", "unrecognized arguments: --frobnicate"),
        ("--env 'A=1", "cannot parse the flags: No closing quotation"),
    ],
)
def test_bad_flags_are_flag_errors(line, text):
    with pytest.raises(FlagError, match=text):
        parse_flags(line)


def test_refused_flag_values_name_the_flag():
    with pytest.raises(FlagError, match=r"^--np must be at least 1, got 0$"):
        options_from_flags(parse_flags("--np 0"), LaunchOptions())
    with pytest.raises(FlagError, match=r"^--timeout must be a positive number of seconds, got 0$"):
        options_from_flags(parse_flags("--timeout 0"), LaunchOptions())


def test_flag_parser_has_one_flag_per_field():
    parser = flag_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {f.metadata["flag"] for f in option_fields()} <= flags


def test_gpu_help_says_what_it_does_on_each_backend():
    help_text = next(f.metadata["help"] for f in option_fields() if f.name == "use_gpu")
    for words in (
        "nccl",
        "LOCAL_RANK",
        "Local processes",
        "Spark",
        "spark.task.resource.gpu.amount",
        "CUDA_VISIBLE_DEVICES",
    ):
        assert words in help_text


def test_helpers_outside_a_run(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert (rank(), world_size(), local_rank(), is_main()) == (0, 1, 0, True)
    assert list(progress(range(3), desc="x")) == [0, 1, 2]
    assert len(progress([1, 2])) == 2
    report(loss=0.5)  # no run: nothing to send, nothing raised
    with pytest.raises(TypeError, match=r"report\(loss=...\) needs a number, got str"):
        report(loss="high")
    with pytest.raises(TypeError, match="progress over an iterable of unknown length"):
        len(progress(iter([1])))


def test_device_outside_a_run_is_cpu():
    from torchdist_magic import device

    assert str(device()) == "cpu"


def test_cell_names_are_the_provided_names():
    from torchdist_magic.core.names import CELL_PROVIDED
    from torchdist_magic.rank.runtime import cell_names

    assert set(cell_names()) == set(CELL_PROVIDED)


def test_rank_failure_text_and_pickle():
    err = RankFailure(Failure(rank=1, exit_code=-9, time=1.0), [Failure(rank=0, exc_type="E", message="m")])
    assert err.exit_code == -9 and "killed by SIGKILL" in str(err)
    assert "Other ranks stopped after the root cause" in err.details()
    assert err._render_traceback_()[0].startswith("RankFailure: rank 1")
    again = pickle.loads(pickle.dumps(RankFailure(Failure(rank=1, exc_type="ValueError", message="m", traceback="tb"))))
    assert (again.rank, again.exc_type, again.traceback) == (1, "ValueError", "tb")


def test_tls_is_a_switch_of_two_flags_and_neither_means_the_default():
    assert LaunchOptions().tls is None
    assert options_from_flags(parse_flags("--tls"), LaunchOptions()).tls is True
    assert options_from_flags(parse_flags("--no-tls"), LaunchOptions()).tls is False
    assert options_from_flags(parse_flags("--np 2"), LaunchOptions(tls=False)).tls is False
    assert options_from_flags(parse_flags("--tls --tls"), LaunchOptions()).tls is True
    for line in ("--tls --no-tls", "--no-tls --tls"):
        with pytest.raises(FlagError, match=r"^--tls and --no-tls contradict each other: give one$"):
            parse_flags(line)


def test_mlflow_is_off_by_default_and_a_switch_over_the_configured_default():
    assert LaunchOptions().mlflow is False
    assert options_from_flags(parse_flags("--mlflow"), LaunchOptions()).mlflow is True
    assert options_from_flags(parse_flags("--np 2"), LaunchOptions(mlflow=True)).mlflow is True
    assert options_from_flags(parse_flags("--no-mlflow"), LaunchOptions(mlflow=True)).mlflow is False
    with pytest.raises(FlagError, match=r"^--mlflow and --no-mlflow contradict each other: give one$"):
        parse_flags("--mlflow --no-mlflow")


def test_pdb_and_debug_idle_timeout():
    args = flag_parser().parse_args(["--pdb", "--debug-idle-timeout", "30"])
    options = options_from_flags(args, LaunchOptions())
    assert (options.pdb, options.debug_idle_timeout) == (True, 30.0)
    assert (LaunchOptions().pdb, LaunchOptions().debug_idle_timeout) == (False, 600.0)
    with pytest.raises(OptionError, match="debug_idle_timeout must be a positive number of seconds, got 0"):
        LaunchOptions(debug_idle_timeout=0)
    with pytest.raises(OptionError, match="debug_idle_timeout must be a number of seconds, got None"):
        LaunchOptions(debug_idle_timeout=None)
    with pytest.raises(
        OptionError,
        match="pdb holds a failing rank for a debugger, which a warm pool's ranks "
        "cannot do yet: run it without --warm/warm=True",
    ):
        LaunchOptions(pdb=True, warm=True)
