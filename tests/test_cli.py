"""The ``torchdist`` command (cli.py) driven as a user drives it: the real console script in a
subprocess (``python -m torchdist_magic`` where the environment has no ``torchdist`` installed
next to its Python), real ranks, real detached runs; every ``--json`` output checked against
the schemas of driver/status.py.  The status dict and the explanation are also checked on run
states built here, and the text view's live block on a StringIO."""

from __future__ import annotations

import configparser
import importlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

from torchdist_magic import Distributor
from torchdist_magic.core import events
from torchdist_magic.core.failure import Failure
from torchdist_magic.driver import history
from torchdist_magic.driver.state import RunState
from torchdist_magic.driver.status import EXPLAIN_SCHEMA, RECORD_SCHEMA, STATUS_SCHEMA, explain, run_status
from torchdist_magic.view.text import TextView

from helpers import assert_nothing_survives, pids_of_run, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "torchdist")
WAIT = 120  # seconds a command may take at most on a busy machine
#: seconds of quiet after which a run is declared hung: a rank's start (before its script says
#: anything) must fit in it on a busy machine
HANG_TIMEOUT = "10"

STEPS = """
import time
from torchdist_magic import progress, report, rank
for i in progress(range(100000), desc="step", total=100000):
    print(f"step {i}", flush=True)
    report(loss=1.0 / (i + 1 + rank()))
    time.sleep(0.05)
"""
SUCCEEDS = """
import sys
from torchdist_magic import progress, report, rank
for i in progress(range(3), desc="step"):
    report(loss=1.0 / (i + 1 + rank()))
print("args", sys.argv[1:], flush=True)
"""
FAILS = """
from torchdist_magic import rank
print("before the failure", flush=True)
if rank() == 1:
    raise KeyError("no such shard")
"""
#: rank 1 sits in its "data loader" while the others wait in a fourth all_reduce; until the
#: three before it are done, every rank says it is alive each second (the hang is declared
#: --hang-timeout seconds after the last sign of life, however slowly a busy machine starts them)
HANGS = """
import threading, time
started = threading.Event()
def alive():
    while not started.wait(1.0):
        print("starting", flush=True)
threading.Thread(target=alive, daemon=True).start()
import torch, torch.distributed as dist
from torchdist_magic import rank
dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
started.set()
print("three done", flush=True)
if rank() == 1:
    time.sleep(600)
dist.all_reduce(t)
"""


def command() -> list:
    """The ``torchdist`` command as installed, else ``python -m torchdist_magic``."""
    return [CONSOLE_SCRIPT] if os.path.exists(CONSOLE_SCRIPT) else [sys.executable, "-m", "torchdist_magic"]


def environment() -> dict:
    """This test's environment (its ``TORCHDIST_HOME``, its temporary directory), with this
    checkout's package first on the path."""
    env = dict(os.environ, TMPDIR=tempfile.gettempdir(), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def torchdist(*words, cwd=None, timeout=WAIT) -> subprocess.CompletedProcess:
    return subprocess.run(
        command() + [str(w) for w in words],
        cwd=cwd,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def started(*words, cwd=None) -> subprocess.Popen:
    return subprocess.Popen(
        command() + [str(w) for w in words],
        cwd=cwd,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def script(tmp_path, name, source) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def check(value, schema, where="$"):
    """``value`` against JSON Schema ``schema``: jsonschema where installed, else the subset
    the schemas of driver/status.py use (type, const, enum, required, properties,
    additionalProperties, items)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None and where == "$":
        jsonschema.validate(value, schema)
        return
    kinds = {
        "object": dict,
        "array": list,
        "string": str,
        "integer": int,
        "number": (int, float),
        "boolean": bool,
        "null": type(None),
    }
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any(
            isinstance(value, kinds[t]) and not (t in ("integer", "number") and isinstance(value, bool)) for t in types
        )
        assert ok, f"{where}: {value!r} is not of type {types}"
    if "const" in schema:
        assert value == schema["const"], f"{where}: {value!r} != {schema['const']!r}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            assert key in value, f"{where}: no key {key!r}"
        properties = schema.get("properties", {})
        for key, item in value.items():
            if key in properties:
                check(item, properties[key], f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                raise AssertionError(f"{where}: unexpected key {key!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                check(item, schema["additionalProperties"], f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for n, item in enumerate(value):
            check(item, schema["items"], f"{where}[{n}]")


def status_json(run_id) -> dict:
    done = torchdist("status", run_id, "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    check(status, STATUS_SCHEMA)
    return status


# -- the entry point --------------------------------------------------------------------------
def test_the_console_script_is_declared_and_its_entry_point_exists():
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    scripts = [line.strip() for line in config["options.entry_points"]["console_scripts"].splitlines() if line.strip()]
    assert scripts == ["torchdist = torchdist_magic.cli:console"]
    module, function = scripts[0].split(" = ")[1].split(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_help_lists_every_command_and_run_takes_the_magics_flags():
    done = torchdist("--help")
    assert done.returncode == 0
    for word in ("run", "runs", "status", "logs", "attach", "stop", "explain"):
        assert f"    {word} " in done.stdout
    run_help = torchdist("run", "--help").stdout
    for flag in ("--np", "--hang-timeout", "--max-restarts", "--detach", "--env", "--no-tls", "--quiet"):
        assert flag in run_help
    for notebook_only in ("--out NAME", "--data NAME", "--columns A,B"):
        assert notebook_only not in run_help


@pytest.mark.parametrize(
    "words, message",
    [
        ((), "torchdist: give a command: run, runs, status, logs, attach, stop or explain (--help)"),
        (("fly",), "torchdist: argument COMMAND: invalid choice: 'fly'"),
        (("run",), "torchdist run: give a script to run (torchdist run [flags] script.py [args...])"),
        (("run", "--np", "0", "x.py"), "torchdist run: --np"),
        (("run", "--local", "--spark", "x.py"), "torchdist run: --local and --spark contradict each other: give one"),
        (("run", "--spark", "--backend", "local", "x.py"), "torchdist run: --spark and --backend local contradict"),
        (("run", "--np", "2", "missing.py"), "torchdist run: script 'missing.py' does not exist"),
        (("run", "--tls", "--no-tls", "x.py"), "--tls and --no-tls contradict each other: give one"),
        (("status",), "torchdist status: the following arguments are required: RUN"),
        (("run", "--detach", "missing.py"), "torchdist run: script 'missing.py' does not exist"),
        (
            ("run", "--detach", "--spark", "x.py"),
            "torchdist run: backend 'spark' (--spark, local_mode=False) runs on the active SparkSession",
        ),
    ],
)
def test_usage_errors_exit_2_with_the_reason_and_start_nothing(home, tmp_path, words, message):
    script(tmp_path, "x.py", SUCCEEDS)
    done = torchdist(*words, cwd=tmp_path)
    assert done.returncode == 2, done
    assert message in done.stderr, done.stderr
    assert history.runs() == []


# -- run ----------------------------------------------------------------------------------------
def test_run_shows_each_rank_as_plain_lines_when_piped_and_exits_0(home, tmp_path):
    done = torchdist("run", "--np", "2", script(tmp_path, "ok.py", SUCCEEDS), "a", "--b", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[rank 0] args ['a', '--b']" in done.stdout and "[rank 1] args ['a', '--b']" in done.stdout
    assert "torchdist: succeeded after" in done.stdout
    assert "\x1b[" not in done.stdout  # no cursor movement into a pipe
    [record] = history.runs()
    assert record.state == "succeeded" and not record.detached
    assert not pids_of_run(record.run_id)


def test_a_failed_run_exits_1_with_the_root_cause_rank_traceback_on_stderr(home, tmp_path):
    done = torchdist("run", "--np", "2", script(tmp_path, "bad.py", FAILS), cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("RankFailure: rank 1 on ")
    assert "--- traceback of rank 1 ---\nTraceback (most recent call last):" in done.stderr
    assert "KeyError: 'no such shard'" in done.stderr and "bad.py" in done.stderr
    assert "Traceback" not in done.stdout  # the summary on stdout, the traceback on stderr
    [record] = history.runs()
    assert record.root_cause.rank == 1
    assert not pids_of_run(record.run_id)


def test_a_run_past_its_timeout_exits_1_saying_so(home, tmp_path):
    done = torchdist("run", "--np", "2", "--timeout", "3", script(tmp_path, "steps.py", STEPS), cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("JobTimeout: distributed run timed out after 3 s; every rank was stopped")
    [record] = history.runs()
    assert record.outcome == "timed out" and not pids_of_run(record.run_id)


def test_ctrl_c_stops_every_rank_and_exits_130(home, tmp_path):
    process = started("run", "--np", "2", script(tmp_path, "steps.py", STEPS), cwd=tmp_path)
    try:
        run_id = wait_until(lambda: history.runs(), 60, "the run's record")[0].run_id
        wait_until(lambda: len(pids_of_run(run_id)) >= 2, 60, "both ranks")
        wait_until(lambda: "[rank 1] step 1" in _read_some(process), 60, "rank 1's lines")
        status = status_json(run_id)  # from its record: the process that runs it alone knows more
        assert status["state"] == "running" and not status["finished"] and status["num_processes"] == 2
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=WAIT)
    err = process.stderr.read()
    assert process.returncode == 130
    assert "torchdist: interrupted; every rank was stopped" in err
    wait_until(lambda: not pids_of_run(run_id), 30, "the ranks to end")
    assert history.read_record(run_id).state == "cancelled"


# -- the history: runs, prefixes ------------------------------------------------------------
def test_runs_json_and_run_ids_by_unique_prefix(home, tmp_path):
    assert "torchdist: no run 'abc': no run was recorded yet" in torchdist("status", "abc").stderr
    for name, source in (("ok.py", SUCCEEDS), ("bad.py", FAILS)):
        torchdist("run", "--np", "2", script(tmp_path, name, source), cwd=tmp_path)
    done = torchdist("runs", "--json")
    assert done.returncode == 0
    listed = json.loads(done.stdout)
    for item in listed:
        check(item, RECORD_SCHEMA)
    assert [r["job"] for r in listed] == ["bad.py", "ok.py"]  # newest first
    assert listed[0]["state"] == "failed" and listed[0]["root_cause"]["rank"] == 1
    ids = [r["run_id"] for r in listed]
    text = torchdist("runs").stdout
    assert all(i in text for i in ids)
    # the shortest prefix of each that no other id starts with
    for run_id in ids:
        prefix = next(run_id[:n] for n in range(1, len(run_id) + 1) if sum(i.startswith(run_id[:n]) for i in ids) == 1)
        assert status_json(prefix)["run_id"] == run_id
    common = os.path.commonprefix(ids)
    assert common  # each process's first run: "1-..."
    ambiguous = torchdist("status", common)
    assert ambiguous.returncode == 2
    assert f"torchdist: run id {common!r} is ambiguous: 2 runs start with it ({ids[0]}, {ids[1]})" in (ambiguous.stderr)
    wrong = torchdist("logs", "zzz")
    assert wrong.returncode == 2
    assert f"torchdist: no run 'zzz'; the runs are (newest first): {ids[0]}, {ids[1]}" in wrong.stderr


def test_a_finished_runs_status_logs_and_explain_from_its_record(home, tmp_path):
    torchdist("run", "--np", "2", script(tmp_path, "bad.py", FAILS), cwd=tmp_path)
    [record] = history.runs()
    status = status_json(record.run_id)
    assert status["state"] == "failed" and status["finished"] and status["root_cause"]["exc_type"] == "KeyError"
    assert [r["state"] for r in status["ranks"]][1] == "failed"
    text = torchdist("status", record.run_id).stdout
    assert f"run {record.run_id}  failed" in text and "root cause: rank 1 on" in text
    assert torchdist("logs", record.run_id, "--rank", "1").stdout == "before the failure\n"
    done = torchdist("explain", record.run_id, "--json")
    found = json.loads(done.stdout)
    check(found, EXPLAIN_SCHEMA)
    assert found["root_cause"]["rank"] == 1 and "raise KeyError" in found["root_cause"]["traceback"]
    assert found["ranks"] == [{"rank": 1, "why": "root cause", "last_lines": ["before the failure"]}]
    text = torchdist("explain", record.run_id).stdout
    assert text.startswith(f"run {record.run_id} failed: rank 1 on ")
    assert "--- traceback of rank 1 ---" in text and "--- last lines of rank 1 (root cause) ---" in text


@pytest.mark.parametrize(
    "words, message",
    [
        (("logs", "RUN", "--rank", "2"), "torchdist logs: run RUN has ranks 0 to 1; got --rank 2"),
        (("logs", "RUN", "--tail", "-1"), "torchdist logs: --tail takes a number of lines, 0 or more; got -1"),
        (("logs", "RUN", "--attempt", "0"), "torchdist logs: --attempt counts from 1 (the first attempt); got 0"),
        (
            ("logs", "RUN", "--attempt", "1"),
            "torchdist logs: run RUN was not detached: its record keeps each rank's last lines, not its "
            "attempts; leave out --attempt",
        ),
        (
            ("attach", "RUN"),
            "torchdist attach: run RUN was not detached: it ran in the process (pid PID) that started it; "
            "torchdist status RUN and torchdist logs RUN show what its record kept",
        ),
        (("status", "RUN", "--watch", "--interval", "0"), "--interval must be a positive number of seconds, got 0"),
    ],
)
def test_what_a_run_that_was_not_detached_refuses(home, tmp_path, words, message):
    torchdist("run", "--np", "2", script(tmp_path, "ok.py", SUCCEEDS), cwd=tmp_path)
    [record] = history.runs()
    done = torchdist(*[record.run_id if w == "RUN" else w for w in words])
    assert done.returncode == 2
    assert message.replace("RUN", record.run_id).replace("PID", str(record.pid)) in done.stderr


def test_stop_refuses_a_run_that_was_not_detached(home, tmp_path):
    torchdist("run", "--np", "1", script(tmp_path, "ok.py", SUCCEEDS), cwd=tmp_path)
    [record] = history.runs()
    done = torchdist("stop", record.run_id)
    assert done.returncode == 1
    assert f"torchdist stop: run {record.run_id} was not detached: it ran in the kernel" in done.stderr


def test_the_tail_of_a_log(home, tmp_path):
    torchdist("run", "--np", "1", script(tmp_path, "ok.py", SUCCEEDS + "print('one')\nprint('two')\n"), cwd=tmp_path)
    [record] = history.runs()
    assert torchdist("logs", record.run_id, "--tail", "2").stdout == "one\ntwo\n"
    assert torchdist("logs", record.run_id, "--tail", "0").stdout == ""


# -- a detached run: status while it runs, --watch, logs --follow, attach, stop ------------------
def test_a_detached_run_is_watched_followed_attached_and_stopped(home, tmp_path):
    done = torchdist("run", "--np", "2", "--detach", script(tmp_path, "steps.py", STEPS), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip()
    assert f"torchdist: detached run {run_id} started (np=2)" in done.stderr
    record = history.read_record(run_id)
    try:
        wait_until(lambda: "step 5" in torchdist("logs", run_id, "--rank", "1").stdout, 60, "rank 1's steps")
        status = status_json(run_id)
        assert status["state"] == "running" and not status["finished"] and status["ended"] is None
        assert [r["state"] for r in status["ranks"]] == ["running", "running"]
        assert status["progress"]["desc"] == "step" and status["progress"]["total"] == 100000
        assert status["progress"]["rate"] > 0 and status["progress"]["eta_s"] > 0
        assert set(status["metrics"]) == {"loss"} and status["metrics"]["loss"]["ranks"] == 2
        text = torchdist("status", run_id).stdout
        assert f"run {run_id}  running" in text and "progress: step " in text and "ETA" in text
        watch = started("status", run_id, "--watch", "--interval", "0.5")
        watch_json = started("status", run_id, "--watch", "--json", "--interval", "0.5")
        follow = started("logs", run_id, "--rank", "1", "--follow")
        attach = started("attach", run_id)
        wait_until(lambda: "[rank 1] step" in _read_some(attach), 60, "attach to show rank 1's lines")
        attach.send_signal(signal.SIGINT)  # Ctrl-C leaves the run running
        attach.wait(timeout=WAIT)
        attach_err = attach.stderr.read()
        assert attach.returncode == 130
        assert f"torchdist: stopped following run {run_id}, which goes on" in attach_err
        assert status_json(run_id)["state"] == "running"
        wait_until(lambda: _read_some(watch).count(f"run {run_id}  running") >= 2, 60, "two looks of --watch")
        stop = torchdist("stop", run_id)
        assert stop.returncode == 0 and stop.stdout == f"torchdist: run {run_id} is stopping\n"
        out = _all_output(watch)
        assert watch.returncode == 1  # the run did not succeed
        blocks = [b for b in out.split("\n\n") if b.strip()]
        assert len(blocks) >= 2 and f"run {run_id}  running" in blocks[0]
        assert f"run {run_id}  cancelled" in blocks[-1] and "stopped by torchdist stop" in blocks[-1]
        out, _ = watch_json.communicate(timeout=WAIT)
        looks = [json.loads(line) for line in out.splitlines()]
        for look in looks:
            check(look, STATUS_SCHEMA)
        assert looks[0]["state"] == "running" and looks[-1]["state"] == "cancelled" and looks[-1]["finished"]
        out, _ = follow.communicate(timeout=WAIT)
        assert follow.returncode == 0
        steps = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]
        assert steps == list(range(len(steps))) and len(steps) > 5  # every line once, in order
        assert torchdist("stop", run_id).stdout == f"torchdist: run {run_id} had ended already\n"
        ended = status_json(run_id)
        assert ended["state"] == "cancelled" and ended["progress"]["eta_s"] is None
        late = torchdist("attach", run_id)  # a finished run: its end, then the run's exit status
        assert late.returncode == 1 and "torchdist: cancelled after" in late.stdout
        assert "RunCancelled: stopped by torchdist stop" in late.stderr
    finally:
        torchdist("stop", run_id)
        assert_nothing_survives(run_id, record.pid)


def _read_some(process) -> str:
    """What ``process`` printed so far on stdout, read by a thread of its own (the process
    prints faster than a test looks), without waiting for its end."""
    reader = getattr(process, "_reader", None)
    if reader is None:
        lines: list = []

        def read() -> None:
            for line in process.stdout:
                lines.append(line)

        reader = process._reader = (threading.Thread(target=read, daemon=True), lines)
        reader[0].start()
    return "".join(reader[1])


def _all_output(process) -> str:
    """Everything ``process`` printed on stdout, once it has ended."""
    _read_some(process)
    process.wait(timeout=WAIT)
    process._reader[0].join(WAIT)
    return "".join(process._reader[1])


def test_a_detached_run_succeeds_and_attach_exits_0_leaving_the_value(home, tmp_path):
    done = torchdist("run", "--np", "2", "--detach", script(tmp_path, "ok.py", SUCCEEDS), cwd=tmp_path)
    run_id = done.stdout.strip()
    attached = torchdist("attach", run_id)
    assert attached.returncode == 0, attached.stderr
    assert "torchdist: succeeded after" in attached.stdout
    assert history.read_record(run_id).has_value  # attach in a terminal leaves it for a kernel
    assert_nothing_survives(run_id, history.read_record(run_id).pid)


# -- explain of a hang --------------------------------------------------------------------------
def test_explain_of_a_hung_detached_run_names_the_rank_behind(home, tmp_path):
    done = torchdist(
        "run", "--np", "3", "--hang-timeout", HANG_TIMEOUT, "--detach", script(tmp_path, "hang.py", HANGS), cwd=tmp_path
    )
    run_id = done.stdout.strip()
    record = history.read_record(run_id)
    try:
        wait_until(lambda: status_json(run_id)["finished"], WAIT, "the hang to be declared", interval=1.0)
        status = status_json(run_id)
        assert status["state"] == "hung" and status["culprit"]["suspects"] == [1]
        found = json.loads(torchdist("explain", run_id, "--json").stdout)
        check(found, EXPLAIN_SCHEMA)
        assert found["state"] == "hung" and found["root_cause"] is None
        assert found["culprit"]["kind"] == "behind" and found["culprit"]["suspects"] == [1]
        assert found["headline"].startswith("Rank 1 is behind: its last collective was #3 all_reduce")
        assert any("rank 1: last collective #3 all_reduce" in line for line in found["culprit"]["records"])
        [rank] = found["ranks"]
        assert rank["rank"] == 1 and rank["why"] == "culprit (behind)" and rank["last_lines"][-1] == "three done"
        assert found["remedies"][0]["problem"] == "the run hung"
        text = torchdist("explain", run_id).stdout
        assert text.startswith(f"run {run_id} hung: Rank 1 is behind")
        assert "culprit: rank 1 is behind" in text and "--- last lines of rank 1 (culprit (behind)) ---" in text
    finally:
        torchdist("stop", run_id)
        assert_nothing_survives(run_id, record.pid)


def test_a_hung_run_exits_1_saying_which_rank_is_behind(home, tmp_path):
    done = torchdist(
        "run", "--np", "3", "--hang-timeout", HANG_TIMEOUT, script(tmp_path, "hang.py", HANGS), cwd=tmp_path
    )
    assert done.returncode == 1
    assert done.stderr.startswith("HangTimeout: Rank 1 is behind: its last collective was #3 all_reduce")
    [record] = history.runs()
    assert not pids_of_run(record.run_id)
    found = json.loads(torchdist("explain", record.run_id, "--json").stdout)
    check(found, EXPLAIN_SCHEMA)
    assert found["state"] == "hung" and found["headline"].startswith("Rank 1 is behind")


# -- the status dict and the explanation, from states built here ----------------------------------
def _failed_state(message: str, exc_type: str = "RuntimeError", log: str = "") -> RunState:
    state = RunState("r-1", 2, "local processes", job_name="job")
    for rank in range(2):
        state.apply(events.Started(rank=rank, host="h", pid=100 + rank))
    if log:
        state.apply(events.Log(rank=1, line=log))
    failure = Failure(rank=1, host="h", exit_code=1, exc_type=exc_type, message=message, traceback="tb")
    state.apply(events.Exit(rank=1, code=1, failure=failure))
    state.finish("failed", failure)
    return state


@pytest.mark.parametrize(
    "exc_type, message, log, problem",
    [
        (
            "RuntimeError",
            "[Gloo] Timed out waiting 1800000ms for recv operation",
            "",
            "a collective timed out (NCCL or gloo)",
        ),
        ("torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB", "", "a rank ran out of memory"),
        ("", "", "", "a rank ran out of memory"),  # killed by SIGKILL, no traceback
        ("RuntimeError", "connection refused while joining the rendezvous", "", "a rank never joined"),
        ("_pickle.PicklingError", "Can't pickle <function <lambda>>", "", "a value could not be pickled"),
    ],
)
def test_explain_names_the_known_remedy_of_the_error_seen(exc_type, message, log, problem):
    if exc_type:
        state = _failed_state(message, exc_type, log)
    else:  # a rank the kernel's OOM killer took: no traceback, SIGKILL
        state = RunState("r-1", 2, "local processes")
        killed = Failure(rank=0, exit_code=-9)
        state.apply(events.Exit(rank=0, code=-9, failure=killed))
        state.finish("failed", killed)
    found = explain(state)
    check(found, EXPLAIN_SCHEMA)
    assert [r["problem"] for r in found["remedies"]] == [problem]


def test_the_status_has_json_values_only_and_the_same_keys_as_run_status(home):
    state = _failed_state("boom")
    state.apply(
        events.Metrics(rank=0, names=["loss", "odd"], steps=[1], times=[0.0], values=[[float("nan")], [2.5]]),
        attempt=1,
    )
    status = run_status(state)
    check(status, STATUS_SCHEMA)
    json.dumps(status, allow_nan=False)  # no NaN, no inf, nothing JSON has not
    assert status["root_cause"]["summary"] == "rank 1 on h raised RuntimeError: boom"
    run = Distributor(num_processes=1, show=None).submit(_returns_one)
    run.result(60)
    own = run.status()
    check(own, STATUS_SCHEMA)
    assert set(own) == set(status) and own["state"] == "succeeded" and own["schema"] == 2


def _returns_one():
    return 1


# -- the text view on a terminal ------------------------------------------------------------
def test_on_a_terminal_the_text_view_redraws_a_line_per_rank_in_place():
    state = RunState("r-2", 2, "local processes")
    out = io.StringIO()
    view = TextView(state, out=out, err=out, live=True)
    for rank in range(2):
        state.apply(events.Started(rank=rank, host="h", pid=1))
        state.apply(events.Progress(rank=rank, bar="b", desc="step", n=1, total=4, elapsed=1.0, state="running"))
    view.update()
    drawn = out.getvalue()
    assert drawn.endswith(
        "rank 0  running  host=h  step 1/4 (25%) [00:01<00:03, 1.00 it/s]  1 s/step\n"
        + "rank 1  running  host=h  step 1/4 (25%) [00:01<00:03, 1.00 it/s]  1 s/step\n"
    )
    state.apply(events.Log(rank=1, line="hello"))
    view.update()
    after = out.getvalue()[len(drawn) :]
    assert after.startswith("\x1b[2F\x1b[J[rank 1] hello\n")  # the block taken away, the line, the block again
    assert after.endswith("rank 1  running  host=h  step 1/4 (25%) [00:01<00:03, 1.00 it/s]  1 s/step\n")
    view.update()  # nothing new: not drawn again
    assert out.getvalue()[len(drawn) + len(after) :] == ""
    state.finish("succeeded")
    view.close()
    assert "\x1b[2F\x1b[Jtorchdist: succeeded after" in out.getvalue()


def test_piped_the_text_view_prints_plain_lines():
    out = io.StringIO()
    view = TextView(RunState("r-3", 1, "local processes"), out=out, err=out)
    assert view.live is False
    view.close()
    assert "\x1b" not in out.getvalue()


def test_the_docs_page_names_every_key_of_each_schema():
    with open(os.path.join(ROOT, "docs", "guide", "terminal.md"), encoding="utf-8") as fh:
        page = fh.read()
    for schema in (STATUS_SCHEMA, RECORD_SCHEMA, EXPLAIN_SCHEMA):
        for key in schema["properties"]:
            assert f"`{key}`" in page, f"docs/guide/terminal.md does not name {schema['title']}'s key {key!r}"
    assert "schema 2" in page and STATUS_SCHEMA["properties"]["schema"]["const"] == 2


def test_a_rank_that_fails_while_a_hung_run_is_stopped_is_no_root_cause():
    state = RunState("r-4", 2, "local processes")
    collateral = Failure(rank=0, exit_code=1, exc_type="RuntimeError", message="Connection closed by peer")
    state.apply(events.Exit(rank=0, code=1, failure=collateral))
    state.finish("hung", message="no rank sent progress, metrics or output for 10 s (hang_timeout)")
    status, found = run_status(state), explain(state)
    assert status["root_cause"] is None and found["root_cause"] is None and found["ranks"] == []
    assert found["headline"] == "no rank sent progress, metrics or output for 10 s (hang_timeout)"
