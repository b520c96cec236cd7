"""Python API and local backend: inputs, environment, scripts, logs, pickling by value."""

import importlib
import os
import signal
import sys
import textwrap
import threading
import time

import pytest

from helpers import alive, assert_no_survivors, pids_of_run, wait_until
from torchdist_magic import Distributor, LaunchOptions, RankFailure, last_run


def env_of_rank(names):
    return {n: os.environ.get(n) for n in names}


RANK_VARS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "MY_SETTING",
    "TORCHDIST_SECRET",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "NODE_RANK",
]


def test_rank_environment(local_distributor):
    run = local_distributor(2, all_ranks=True, env={"MY_SETTING": "42"}).submit(env_of_rank, RANK_VARS)
    envs = run.result(timeout=60)
    cores = len(os.sched_getaffinity(0))
    for r, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert 1024 < int(env["MASTER_PORT"]) < 65536
        assert env["OMP_NUM_THREADS"] == str(max(1, cores // 2))
        assert env["MY_SETTING"] == "42"
        assert env["TORCHDIST_SECRET"] is None  # the channel secret is not left for user code
        assert env["GROUP_RANK"] == env["NODE_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert_no_survivors(run)


def test_user_omp_threads_kept(local_distributor):
    value = local_distributor(1, env=["OMP_NUM_THREADS=7"]).run(env_of_rank, ["OMP_NUM_THREADS"])
    assert value == {"OMP_NUM_THREADS": "7"}


def all_reduce_sum():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def test_process_group_on_reserved_port(local_distributor):
    run = local_distributor(2).submit(all_reduce_sum)
    assert run.result(timeout=120) == 3.0
    assert_no_survivors(run)


def print_lines(n):
    from torchdist_magic import rank

    for i in range(n):
        print(f"r{rank()} line {i}")
    return n


def test_ten_thousand_lines_per_rank_all_arrive_in_order(local_distributor):
    run = local_distributor(2).submit(print_lines, 10_000)
    assert run.result(timeout=120) == 10_000
    for r in range(2):
        lines = run.logs(r).splitlines()
        assert lines == [f"r{r} line {i}" for i in range(10_000)]
    assert_no_survivors(run)


def carriage_returns():
    sys.stdout.write("step 1\rstep 2\rstep 3\r\ndone\n")
    sys.stderr.write("warned\n")


def test_cr_lines_are_replaced_by_the_next_line_of_their_stream(local_distributor):
    run = local_distributor(1).submit(carriage_returns)
    run.result(timeout=60)
    logs = run.state.ranks[0].logs
    # what a terminal leaves: a redrawn line's latest state, not every redraw
    assert [(l.text, l.cr) for l in logs if l.stream == "stdout"] == [("step 3", False), ("done", False)]
    assert [l.text for l in logs if l.stream == "stderr"] == ["warned"]
    assert "\r" not in run.logs(0)
    with pytest.raises(IndexError, match=r"^rank 5 is not in this run \(ranks 0\.\.0\)$"):
        run.logs(5)


def bar_then_other_stream(marks):
    """Each write once the test saw the one before it arrive (``marks``/``<n>``): the two pipes'
    order is the test's, not the scheduler's."""
    import os
    import time

    def written(n):
        while not os.path.exists(os.path.join(marks, str(n))):
            time.sleep(0.02)

    sys.stderr.write("\r 50%|#####     |")  # tqdm writes "\r" + the bar, and the newline apart
    sys.stderr.flush()
    sys.stderr.write("\r100%|##########|")  # its "\r" shows the 50% bar
    sys.stderr.flush()
    written(1)
    print("between", flush=True)  # the other stream, before the bar's newline
    written(2)
    sys.stderr.write("\n")


def test_a_carriage_return_at_a_line_start_leaves_no_line(local_distributor, tmp_path):
    run = local_distributor(1).submit(bar_then_other_stream, str(tmp_path))
    for n, text in enumerate(("50%", "between"), start=1):
        wait_until(lambda: any(text in line.text for line in run.state.ranks[0].logs), 60, repr(text))  # noqa: B023
        (tmp_path / str(n)).touch()
    run.result(timeout=60)
    lines = [(l.stream, l.text, l.cr) for l in run.state.ranks[0].logs]
    # the bar's final state, in its own place; no empty or stale redraw left between
    assert lines == [("stderr", "100%|##########|", False), ("stdout", "between", False)]
    assert "\r" not in run.logs(0)


def test_text_view_prefixes_and_summary(capsys):
    def shout():
        print("hello")
        return 1

    assert Distributor(2, show="text").run(shout) == 1
    out = capsys.readouterr().out
    assert "[rank 0] hello" in out and "[rank 1] hello" in out
    assert "torchdist: run shout on local processes" in out
    assert "torchdist: succeeded" in out and "rank 1  done" in out


# -- scripts ---------------------------------------------------------------------------------
SCRIPT = """
import os, sys
from helper_mod import double
print("args", sys.argv[1:], "rank", os.environ["RANK"], "double", double(21))
if "--fail" in sys.argv and os.environ["RANK"] == "1":
    sys.exit(7)
"""


def test_script_runs_with_args(local_distributor, tmp_path):
    (tmp_path / "helper_mod.py").write_text("def double(x):\n    return 2 * x\n")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = local_distributor(2).submit(str(script), "--lr", 0.1)
    assert run.result(timeout=60) is None
    assert "args ['--lr', '0.1'] rank 1 double 42" in run.logs(1)
    assert_no_survivors(run)


def test_script_exit_code_fails_the_run(local_distributor, tmp_path):
    (tmp_path / "helper_mod.py").write_text("def double(x):\n    return 2 * x\n")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with pytest.raises(RankFailure) as info:
        local_distributor(2).run(str(script), "--fail")
    assert info.value.rank == 1 and info.value.exit_code == 7
    assert "rank 1 on" in str(info.value) and "SystemExit: exit code 7" in str(info.value)


# -- bad input: clear errors before anything starts ------------------------------------------
@pytest.mark.parametrize(
    "n,error,text",
    [
        (0, ValueError, "num_processes must be at least 1, got 0"),
        (-2, ValueError, "num_processes must be at least 1, got -2"),
        ("2", TypeError, "num_processes must be a whole number, got '2'"),
        (2.0, TypeError, "num_processes must be a whole number, got 2.0"),
        (True, TypeError, "num_processes must be a whole number, got True"),
    ],
)
def test_bad_num_processes(n, error, text):
    with pytest.raises(error, match="^" + text + "$"):
        Distributor(n)


@pytest.mark.parametrize(
    "kwargs,text",
    [
        ({"timeout": 0}, "timeout must be a positive number of seconds, got 0"),
        ({"timeout": "10"}, "timeout must be a number of seconds, got '10'"),
        ({"env": ["NOEQUALS"]}, "env entry 'NOEQUALS' is not of the form KEY=VALUE"),
        (
            {"backend": "yarn"},
            "backend must be one of auto, local, spark, slurm, ray, got 'yarn' (a package adds one with an "
            "entry point in the group 'torchdist_magic.backends', or register_backend())",
        ),
        ({"use_gpu": "yes"}, "use_gpu must be True or False, got 'yes'"),
        ({"all_ranks": 1}, "all_ranks must be True or False, got 1"),
        (
            {"nprocs": 2},
            "unknown option(s): nprocs; known: min_processes, backend, timeout, hang_timeout, max_restarts, "
            "checkpoint_dir, keep_checkpoints, restart_on, on_hang, env, backend_options, all_ranks, warm, ranks, pool_idle_timeout, pdb, "
            "debug_idle_timeout, tls, system_metrics, profile, trace_collectives, mlflow, preflight, detach, channel",
        ),
        ({"show": "html"}, "show must be one of 'text', 'auto', 'widget', None, got 'html'"),
        ({"local_mode": "yes"}, "local_mode must be True, False or None, got 'yes'"),
        (
            {"backend": "local", "local_mode": False},
            "local_mode=False and backend='local' contradict each other: give one of them",
        ),
        (
            {"backend": "spark", "local_mode": True},
            "local_mode=True and backend='spark' contradict each other: give one of them",
        ),
        (
            {"backend": "auto", "local_mode": True},
            "local_mode=True and backend='auto' contradict each other: give one of them",
        ),
    ],
)
def test_bad_options(kwargs, text):
    with pytest.raises((ValueError, TypeError), match="^" + text.replace("(", r"\(").replace(")", r"\)") + "$"):
        Distributor(1, **kwargs)


@pytest.mark.parametrize(
    "kwargs,backend",
    [
        ({}, "local"),
        ({"local_mode": True}, "local"),
        ({"local_mode": False}, "spark"),
        ({"local_mode": None}, "auto"),
        ({"backend": "spark"}, "spark"),
        ({"backend": "auto"}, "auto"),
        ({"local_mode": False, "backend": "spark"}, "spark"),
    ],
)
def test_local_mode_and_backend_agree(kwargs, backend):
    assert Distributor(1, **kwargs).options.backend == backend


def test_from_options_validates_like_the_constructor():
    opts = LaunchOptions(num_processes=2)
    opts.num_processes = 0  # a dataclass can be changed after it was validated
    with pytest.raises(ValueError, match="^num_processes must be at least 1, got 0$"):
        Distributor.from_options(opts)
    with pytest.raises(TypeError, match="options must be a LaunchOptions, got dict"):
        Distributor.from_options({"num_processes": 2})
    with pytest.raises(ValueError, match="show must be one of"):
        Distributor.from_options(LaunchOptions(), show="html")


def test_spark_without_an_active_session_is_refused_with_how_to_start_one():
    from pyspark.sql import SparkSession

    assert SparkSession.getActiveSession() is None
    with pytest.raises(ValueError) as info:
        Distributor(2, local_mode=False, show=None).run(print)
    text = str(info.value)
    assert "runs on the active SparkSession (classic or Spark Connect), and this process has none" in text
    assert 'SparkSession.builder.master("local[2]").getOrCreate()' in text and "--local" in text


def test_missing_script(local_distributor, tmp_path):
    with pytest.raises(ValueError, match="script '.*nope.py' does not exist"):
        local_distributor(1).run(str(tmp_path / "nope.py"))
    with pytest.raises(ValueError, match=r"\(it is a directory\)"):
        local_distributor(1).run(str(tmp_path))


def test_script_with_keyword_arguments(local_distributor, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(TypeError, match="keyword arguments cannot be passed to a script"):
        local_distributor(1).run(str(script), lr=0.1)
    with pytest.raises(TypeError, match="script arguments must be strings or numbers, got \\[1\\]"):
        local_distributor(1).run(str(script), [1])


def test_not_callable(local_distributor):
    with pytest.raises(TypeError, match="train_object must be a function or a path to a .py file, got int"):
        local_distributor(1).run(42)


def test_unpicklable_argument_is_named(local_distributor):
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"argument 1 of run\(\) \(a _thread.lock\) cannot be pickled"):
        local_distributor(1).run(print, "ok", lock)
    with pytest.raises(TypeError, match=r"keyword argument 'guard' of run\(\) \(a _thread.lock\)"):
        local_distributor(1).run(print, guard=lock)


def test_unpicklable_closure_is_named(local_distributor):
    lock = threading.Lock()

    def train():
        with lock:
            return 1

    with pytest.raises(TypeError, match=r"variable 'lock' captured by .*train \(a _thread.lock\) cannot be pickled"):
        local_distributor(1).run(train)


def unpicklable_result():
    return threading.Lock()


def test_unpicklable_result_is_a_rank_failure(local_distributor):
    with pytest.raises(RankFailure, match=r"the value of rank 0 \(a lock\) cannot be pickled"):
        local_distributor(1).run(unpicklable_result)


# -- a function from a module the workers cannot import by name ------------------------------
def test_function_from_unimportable_module_travels_by_value(local_distributor, tmp_path, monkeypatch):
    (tmp_path / "my_training_helpers.py").write_text(
        textwrap.dedent("""
        FACTOR = 3
        def scale(x):
            return x * FACTOR
        def train(x):
            from torchdist_magic import rank
            return scale(x) + rank()
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("my_training_helpers")
    os.remove(tmp_path / "my_training_helpers.py")  # workers cannot import it by name now
    try:
        run = local_distributor(2, all_ranks=True).submit(module.train, 5)
        assert run.result(timeout=60) == [15, 16]
    finally:
        sys.modules.pop("my_training_helpers", None)


# -- grandchildren, Ctrl-C, last_run ---------------------------------------------------------
def spawn_grandchild_and_fail(spawned):
    import subprocess

    from torchdist_magic import rank

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"grandchild {child.pid}", flush=True)
    if rank() == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(spawned):  # rank 0's grandchild is there to be stopped too
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 never spawned its grandchild")
            time.sleep(0.05)
        raise RuntimeError("after spawning")
    with open(spawned, "w"):
        pass
    time.sleep(600)


def test_no_grandchild_survives(local_distributor, tmp_path):
    run = local_distributor(2).submit(spawn_grandchild_and_fail, str(tmp_path / "rank0-spawned"))
    with pytest.raises(RankFailure, match="after spawning"):
        run.result(timeout=60)
    pids = [
        int(line.split()[1]) for r in range(2) for line in run.logs(r).splitlines() if line.startswith("grandchild")
    ]
    assert len(pids) == 2
    assert_no_survivors(run, extra_pids=pids)


def child_then_raise():
    import subprocess

    import torch
    import torch.distributed as dist

    from torchdist_magic import rank

    dist.init_process_group("gloo")
    if rank() == 1:
        child = subprocess.Popen(["sleep", "600"])  # inherits the rank's output pipes
        print("child", child.pid, flush=True)
        raise ValueError("the real cause")
    dist.all_reduce(torch.zeros(1))  # rank 0 waits here and sees its peer go away


@pytest.mark.parametrize("attempt", range(3))
def test_rank_with_a_child_that_raises_is_the_root_cause(local_distributor, attempt):
    run = local_distributor(2).submit(child_then_raise)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=60)
    assert (info.value.rank, info.value.exc_type, info.value.message) == (1, "ValueError", "the real cause")
    child = int(run.logs(1).split()[1])
    assert_no_survivors(run, extra_pids=[child])


def test_keyboard_interrupt_stops_every_rank():
    def sleepy():
        print("started", flush=True)
        time.sleep(600)

    before = last_run()
    started, returned = [], threading.Event()

    def interrupt_once_both_ranks_started():
        def both_started():
            run = last_run()
            return run is not before and all("started" in run.logs(r) for r in range(2))

        try:
            wait_until(lambda: returned.is_set() or both_started(), 60, "both ranks to print 'started'")
        except AssertionError:
            pass
        if not returned.is_set():  # Ctrl-C in the main thread, which is waiting for the run
            started.append(both_started())
            signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    interrupter = threading.Thread(target=interrupt_once_both_ranks_started, daemon=True)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            Distributor(2, show=None).run(sleepy)
    finally:
        returned.set()
        interrupter.join()
        signal.signal(signal.SIGALRM, previous)
    assert started == [True], "the ranks were interrupted before both printed 'started'"
    run = last_run()
    assert run.done() and run.state.state == "cancelled"
    assert run.state.message == "stopped by an interrupt (Ctrl-C, or the kernel's interrupt); every rank was stopped"
    assert all(not alive(rs.pid) for rs in run.state.ranks if rs.pid)
    assert_no_survivors(run)


def test_result_wait_timeout_leaves_run_going(local_distributor):
    def slow():
        time.sleep(600)

    run = local_distributor(1).submit(slow)
    try:
        with pytest.raises(TimeoutError, match="the run is still going after waiting 0.2 s"):
            run.result(timeout=0.2)
        assert not run.done()
    finally:
        run.cancel()
        assert run.wait(30), "the cancelled run did not end"
    assert_no_survivors(run)
    assert "cancelled" in repr(run)


DRIVER = """
import subprocess, sys, time
from torchdist_magic import Distributor
def sleepy():
    child = subprocess.Popen(["sleep", "1000"])
    print("up", child.pid, flush=True)
    time.sleep(600)
run = Distributor(2, show=None).submit(sleepy)
while "up" not in run.logs(0) or "up" not in run.logs(1):
    time.sleep(0.05)
children = [run.logs(r).split()[1] for r in (0, 1)]
print(run.run_id, run.state.ranks[0].pid, run.state.ranks[1].pid, *children, flush=True)
time.sleep(600)
"""


def test_ranks_exit_when_the_driver_is_killed(tmp_path):
    import subprocess

    scratch = tmp_path / "driver-tmp"
    scratch.mkdir()
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=dict(os.environ, TMPDIR=str(scratch))
    )
    lines = []
    reader = threading.Thread(target=lambda: lines.append(driver.stdout.readline()), daemon=True)
    reader.start()
    try:
        wait_until(lambda: lines or driver.poll() is not None, 60, "the driver to print its run's pids")
        reader.join(10)
        assert lines and lines[0].strip(), f"the driver exited ({driver.returncode}) before printing its run's pids"
        run_id, *pids = lines[0].split()
        assert pids_of_run(run_id)
    finally:
        driver.kill()
        driver.wait()

    def leftovers():
        return pids_of_run(run_id) + [p for p in pids if alive(int(p))], sorted(scratch.rglob("*"))

    try:
        wait_until(lambda: not any(leftovers()), 10, "the orphaned ranks to exit and clean up")
    except AssertionError:
        procs, files = leftovers()
        assert not procs, f"ranks or their children outlived their killed driver: {procs}"
        assert not files, f"the orphaned ranks did not remove the run directory: {files}"
    assert len(pids) == 4  # two ranks and a child of each, all gone


ENDS_WITH_ITS_DRIVER = """
import os, sys, time
from torchdist_magic import Distributor
def ends_with_its_driver(driver):
    print("up", flush=True)
    while os.path.exists(f"/proc/{driver}"):
        time.sleep(0.01)
    print("the driver is gone", flush=True)  # the pipe to the driver is broken: the job fails now
run = Distributor(2, show=None).submit(ends_with_its_driver, os.getpid())
while sys.argv[1] == "running" and ("up" not in run.logs(0) or "up" not in run.logs(1)):
    time.sleep(0.05)
print(run.run_id, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("when", ["starting", "running"])
def test_ranks_whose_job_ends_as_their_driver_is_killed_remove_the_run_files(tmp_path, when):
    # a kernel killed while its run's ranks start (or run): each rank's next print breaks on the
    # dead driver's pipe and the rank exits before its watch of the launcher looks again (or
    # before it began to watch); the rank removes the run's directories (its temporary one, its
    # values in /dev/shm) as it exits
    import subprocess

    from torchdist_magic.core.values import SHARED_MEMORY

    scratch = tmp_path / "driver-tmp"
    scratch.mkdir()
    driver = subprocess.Popen(
        [sys.executable, "-c", ENDS_WITH_ITS_DRIVER, when],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TMPDIR=str(scratch)),
    )
    try:
        line = driver.stdout.readline()
        assert line.strip(), f"the driver exited ({driver.poll()}) before printing its run id"
        run_id = line.split()[0]
        wait_until(lambda: len(pids_of_run(run_id)) == 2, 60, "both ranks to start")
    finally:
        driver.kill()
        driver.wait()

    def values():
        return [n for n in os.listdir(SHARED_MEMORY) if n.startswith(f"torchdist-{run_id}-")]

    wait_until(lambda: not pids_of_run(run_id), 30, "the orphaned ranks to exit")
    assert sorted(scratch.rglob("*")) == []
    assert values() == []


def test_text_view_shows_outer_and_inner_bars():
    from torchdist_magic.driver.state import RunState
    from torchdist_magic.view.text import rank_progress_text

    from torchdist_magic.core.events import Progress

    state = RunState("r", 1)
    state.apply(Progress(rank=0, bar="epoch#0", desc="epoch", n=1, total=3, elapsed=2.0, state="running"))
    state.apply(Progress(rank=0, bar="batch#1", desc="batch", n=8, total=10, elapsed=1.0, state="running"))
    assert rank_progress_text(state.ranks[0]) == (
        "epoch 1/3 (33%) [00:02<00:04, 0.50 it/s] · batch 8/10 (80%) [00:01<00:00, 8.00 it/s]"
    )


def test_a_run_cancelled_before_it_starts_starts_nothing():
    from torchdist_magic.backends.local import LocalProcessBackend
    from torchdist_magic.core.job import build_job
    from torchdist_magic.driver.distributor import Run
    from torchdist_magic.core.errors import RunCancelled

    opts = LaunchOptions(num_processes=2)
    backend = LocalProcessBackend()
    run = Run(build_job(print, (), {}), opts, backend, backend.check(opts))
    run.cancel()
    run._start()
    with pytest.raises(RunCancelled, match="the run was cancelled before it started"):
        run.result(timeout=30)
    assert [rs.pid for rs in run.state.ranks] == [None, None]


def test_a_job_is_taken_as_it_is_and_logs_name_the_ranks_and_attempts_there_are(local_distributor):
    run = local_distributor(2).submit(print_lines, 1)
    assert run.result(timeout=60) == 1
    # a run's job (arguments included) can be started again, but takes no new arguments
    with pytest.raises(TypeError, match=r"^a Job takes no arguments; they belong in the job$"):
        local_distributor(2).submit(run.job, 5)
    with pytest.raises(TypeError, match=r"^a Job takes no arguments; they belong in the job$"):
        local_distributor(2).submit(run.job, n=5)
    assert last_run() is run  # nothing started
    for rank in (2, -1):
        with pytest.raises(IndexError, match=rf"^rank {rank} is not in this run \(ranks 0\.\.1\)$"):
            run.logs(rank)
    with pytest.raises(IndexError, match=r"^attempt 2 is not in this run \(attempts 1\.\.1\)$"):
        run.logs(0, attempt=2)
    assert run.logs(1, attempt=1) == "r1 line 0\n"
    assert_no_survivors(run)


SCRIPT_LAST_WORDS = {
    "usage_error.py": (
        "import argparse\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--lr', type=float, required=True)\n"
        "parser.parse_args()\n",
        ["usage: usage_error.py [-h] --lr LR", "usage_error.py: error: the following arguments are required: --lr"],
    ),
    "exit_127.py": (
        "import sys\n"
        "print('looking for the compiler', flush=True)\n"
        "print('fake-nvcc: command not found', file=sys.stderr, flush=True)\n"
        "sys.exit(127)\n",
        ["looking for the compiler", "fake-nvcc: command not found"],
    ),
}


@pytest.mark.parametrize("name", sorted(SCRIPT_LAST_WORDS))
def test_a_failing_scripts_last_words_are_in_its_rank_failure(local_distributor, tmp_path, name):
    source, said = SCRIPT_LAST_WORDS[name]
    script = tmp_path / name
    script.write_text(source)
    with pytest.raises(RankFailure) as info:
        local_distributor(1).run(str(script))
    text = str(info.value)
    assert "SystemExit" in text and "--- traceback of rank 0 ---" in text
    # stdout and stderr are two pipes: their lines may interleave either way
    assert sorted(text.split("--- last output of rank 0 ---\n", 1)[1].splitlines()[: len(said)]) == sorted(said)
