"""A detached run's supervising process (``--detach``): it owns the run (its channel, state,
restarts, watchdog, timeout, MLflow) outside the notebook's kernel, so the run goes on when the
kernel dies, restarts or shuts down.

The kernel (``start_detached``) writes into the run's private record directory (``driver.history``; its files are named in ``driver.layout``)
what the supervising process needs (the job as the ranks read it, the options, a token), starts
``python -m torchdist_magic.supervise.supervisor DIRECTORY`` in a session of its own, and returns
once the run has started (or raises what refused it).  What may be a secret never reaches a
file: the values of ``--env`` (the options file has their names) and where the Spark session
is (a Spark Connect remote may carry a ``;token=``, a classic session's settings a secret) go
to the supervising process on its standard input (``HANDOVER``), which it reads first.  It
reads its files back only once it has checked them on the open descriptor (``privdir.open_own``:
this user's own, a regular file, not a link), before it unpickles anything.  The supervising
process then writes:

- ``journal.jsonl``: every record the run's state took, one ``events`` JSON record a line, from
  which any kernel rebuilds the run's state (``handles.attach``); at most ``JOURNAL_MAX_BYTES``, past
  which records are not journaled and ``journal-full`` says so.  A run whose kernel follows it
  (``--channel process``) keeps none (``no-journal``): at 1024 ranks writing it would cost the
  process a third of its time, and its kernel reads the state through the feed while it runs
  and the run's record afterwards;
- ``full-logs/``: for a run that keeps no journal, each rank's complete output once the run
  ended (``write_full_logs``), which the record alone would cut to its newest lines; the
  kernel that started the run reads it once this process has gone, and removes it when it
  exits;
- ``value.blob``: rank 0's value (``core.values``' format) as the rank made it, never decoded in
  this process (``values.kept``), when the run succeeded;
- ``done``: once the journal, the value and the record are complete.

Its control socket (``feed.FeedServer``: a Unix socket in this user's private directory of the
temporary directory, or the private fallback that takes its place where another user made that
directory first, ``privdir.usable_user_directory``; named in the record, and the fallback removed
with the socket) takes, from a process of this user (its peer's uid is
checked) that knows the run's token, one ``events.StopRun`` a connection, or the reads of a
kernel that shows the run (``handles.feed.HostedState``: the kernel gets what its view shows, never
every record); anything else is refused.  Once the run has ended it waits for those kernels'
last reads (``FEED_LINGER`` at most).  SIGTERM,
SIGINT or SIGHUP to the supervising process stop the run too.  When it ends, however it ends,
its ranks end with it (a local rank watches its launcher, which is this process).
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Optional

from ..core import events
from ..core import values
from ..core.options import LaunchOptions
from ..core.privdir import UnsafePath, open_own, open_private, remove_fallback, usable_user_directory
from ..driver.history import RunRecord, options_json, read_record, record_directory, write_private
from ..driver.layout import (
    DONE_FILE,
    FULL_LOGS_DIR,
    FULL_LOGS_INDEX,
    JOB_FILE,
    JOURNAL_FILE,
    JOURNAL_FULL_FILE,
    LOG_FILE,
    NO_JOURNAL_FILE,
    OPTIONS_FILE,
    READY_FILE,
    REFUSED_FILE,
    TOKEN_FILE,
    VALUE_FILE,
)
from .feed import FeedServer

#: what the kernel hands its supervising process on its standard input, never in a file: one
#: JSON object, ``{"env": the values of --env, "spark": spark_target() or None}``
HANDOVER = ("env", "spark")
#: how long the journal's thread gathers records before it writes them: one write a batch,
#: not one a record (at 1024 ranks, a hundred thousand records a second)
JOURNAL_EVERY = 0.05
#: a journal holds at most this much; the rest of the run is in its record (state, logs' tails)
JOURNAL_MAX_BYTES = 1 << 30
#: how long ``start_detached`` waits for the supervising process to start the run
START_WAIT = 120.0
#: how long a run's supervising process, its run ended, waits for the kernels that show it to
#: read the state a last time (``feed.FeedServer.linger``)
FEED_LINGER = 30.0

NOTEBOOK_OWNS_SPARK = (
    "--detach cannot run here on classic Spark: this cluster's one SparkContext belongs to the notebook "
    "(Databricks' classic clusters), and a supervising process outside the kernel cannot start a session "
    "of its own on it. Connect to the cluster with Spark Connect (SparkSession.builder.remote(...), "
    "Databricks Connect), where --detach works, or run without --detach/detach=True"
)
#: a classic session's settings that belong to its own driver, not to the cluster: the supervising
#: process's session takes every other one
OWN_DRIVER_SETTINGS = (
    "spark.app.id",
    "spark.app.name",
    "spark.app.startTime",
    "spark.app.submitTime",
    "spark.driver.host",
    "spark.driver.port",
    "spark.driver.appUIAddress",
    "spark.executor.id",
    "spark.ui.proxyBase",
    "spark.sql.connect.",
    "spark.repl.",
)
NO_DATA = (
    "--detach cannot train on a DataFrame (--data): its ranks would read the data from this "
    "kernel; run it without --detach/detach=True"
)
NO_DATA_IN_PROCESS = (
    "--channel process cannot train on a DataFrame (--data): the run's supervising process "
    "cannot read the data from this kernel; run it with --channel kernel"
)
NOTEBOOK_OWNS_SPARK_IN_PROCESS = (
    "--channel process cannot run here on classic Spark: this cluster's one SparkContext belongs "
    "to the notebook, and the run's supervising process cannot start a session of its own on it; "
    "run it with --channel kernel, or connect with Spark Connect"
)


#: the longest path a Unix socket may have (108 bytes on Linux, with its terminating NUL)
SOCKET_PATH_MAX = 107


def control_path(run_id: str) -> str:
    """Where run ``run_id``'s control socket listens: in this user's private directory of the
    temporary directory, or of ``/tmp`` where that path would be too long for a Unix socket; where
    another user made that directory first, in a private fallback (a warning says which), which
    the supervising process removes with the socket."""
    for parent in (tempfile.gettempdir(), "/tmp"):
        directory = usable_user_directory(parent)
        path = os.path.join(directory, f"ctl-{run_id}.sock")
        if len(os.fsencode(path)) <= SOCKET_PATH_MAX:
            return path
        remove_fallback(directory)
    raise ValueError(
        f"no place for run {run_id}'s control socket: {path} is longer than a Unix socket's path "
        f"may be ({SOCKET_PATH_MAX} bytes)"
    )


def spark_target(session: Any) -> dict:
    """Where a detached run's supervising process opens a Spark session of its own for the run of
    this kernel's ``session``: the same Spark Connect remote with the same credentials (its own
    session id), or the same classic master with the same settings (``OWN_DRIVER_SETTINGS``
    aside).  ``ValueError`` (``NOTEBOOK_OWNS_SPARK``) where the cluster's one SparkContext belongs
    to the notebook."""
    from ..backends.spark_stage import is_spark_connect

    if is_spark_connect(session):
        url = session.client._builder.url  # sc://host:port/;token=...;session_id=... as parsed
        params = [p for p in url.params.split(";") if p and not p.startswith("session_id=")]
        return {"kind": "connect", "remote": f"sc://{url.netloc}/" + "".join(f";{p}" for p in params)}
    settings = dict(session.sparkContext.getConf().getAll())
    if os.environ.get("DATABRICKS_RUNTIME_VERSION") or any(k.startswith("spark.databricks.") for k in settings):
        raise ValueError(NOTEBOOK_OWNS_SPARK)
    return {
        "kind": "classic",
        "master": session.sparkContext.master,
        "conf": {k: v for k, v in settings.items() if not k.startswith(OWN_DRIVER_SETTINGS)},
    }


def open_spark(target: dict) -> Any:
    """The supervising process's own session on ``spark_target``'s cluster."""
    from pyspark.sql import SparkSession

    if target["kind"] == "connect":
        return SparkSession.builder.remote(target["remote"]).getOrCreate()
    builder = SparkSession.builder.master(target["master"]).appName("torchdist-detached")
    for key, value in target["conf"].items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def check_detachable(options: LaunchOptions, session: Any, data: Any = None) -> Optional[dict]:
    """Where a run with ``options`` is detached to (``spark_target``; None: local processes), or
    ``ValueError`` saying why it cannot be, before anything starts.  ``session``: the active
    Spark session, or None."""
    if data is not None:
        raise ValueError(NO_DATA if options.detach else NO_DATA_IN_PROCESS)
    kind = options.backend
    if kind == "auto":
        kind = "spark" if session is not None else "local"
    if kind == "local":
        return None
    if kind != "spark":  # a backend the supervising process re-creates from its name and options
        check_named_detachable(options)
        return None
    if session is None:
        from ..backends.spark import NO_SESSION

        raise ValueError(NO_SESSION)
    try:
        return spark_target(session)
    except ValueError:
        if options.detach:
            raise
        raise ValueError(NOTEBOOK_OWNS_SPARK_IN_PROCESS) from None


def check_named_detachable(options: LaunchOptions) -> None:
    """``ValueError`` unless the backend ``options.backend`` (neither local nor Spark) can run
    under a supervising process: it says so (``Backend.detachable``), and that process can make
    it again from its name (built in, or an installed entry point: one registered in this
    process alone, ``register_backend``, does not exist there)."""
    from ..backends import make_backend
    from ..core.registry import BUILT_IN, registered_here

    name = options.backend
    if name not in BUILT_IN and registered_here(name):
        raise ValueError(
            f"backend {name!r} was registered in this process (register_backend), and a detached run's "
            "supervising process is another: declare it as an entry point (group torchdist_magic.backends) "
            "to detach its runs"
        )
    backend = make_backend(options)
    try:
        if not backend.detachable():
            raise ValueError(f"backend {name!r} cannot run detached (--detach): it says so (Backend.detachable)")
    finally:
        backend.release()


def start_detached(job: Any, options: LaunchOptions, spark: Optional[dict] = None, journal: bool = True) -> str:
    """Start ``job`` as a detached run and return its id once its supervising process has
    started it (on ``spark``, a ``spark_target``, when given; else on local processes);
    ``ValueError`` with what refused it otherwise.  ``journal``: whether it keeps a journal
    (a detached run does; one whose kernel follows it, ``--channel process``, does not)."""
    run_id = f"{time.strftime('%m%d%H%M')}-{uuid.uuid4().hex[:8]}"
    directory = record_directory(run_id)
    fd = open_private(os.path.join(directory, JOB_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "wb") as fh:
        fh.write(values.pickle_for_ranks(job))
    # a named backend (not auto, local or Spark) is made again there, from its name and options
    backend = "spark" if spark is not None else "local" if options.backend in ("auto", "local") else options.backend
    write_private(  # env's names only: its values go with the handover
        os.path.join(directory, OPTIONS_FILE),
        json.dumps(options_json(options.replace(detach=False, backend=backend, channel="kernel"))),
    )
    handover = json.dumps({"env": options.env, "spark": spark}).encode()
    write_private(os.path.join(directory, TOKEN_FILE), secrets.token_hex(32))
    if not journal:
        write_private(os.path.join(directory, NO_JOURNAL_FILE), "")
    record = RunRecord(
        run_id=run_id,
        state="running",
        started=time.time(),
        job_name=job.name,
        options=options_json(options),
        backend=f"Spark ({spark['kind']})"
        if spark is not None
        else "local processes"
        if backend == "local"
        else backend,
        num_processes=options.num_processes,
        detached=True,
        host=os.uname().nodename,
        control=control_path(run_id),
        directory=directory,
    )
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH", "")]))
    log = open_private(os.path.join(directory, LOG_FILE), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        # a session of its own: a kernel's end (its process group signalled) does not reach it
        process = subprocess.Popen(
            [sys.executable, "-m", "torchdist_magic.supervise.supervisor", directory],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(log)
    # reaped here while this process lives (no zombie left); when it dies, init adopts it
    threading.Thread(target=process.wait, name=f"torchdist-supervisor-{run_id}", daemon=True).start()
    handed = False
    try:
        record.pid = process.pid
        record.save()
        # after the record: the supervising process reads the handover to its end before anything else
        try:  # more than a pipe's buffer waits here for the supervising process to read it, at its start
            with process.stdin:
                process.stdin.write(handover)
        except BrokenPipeError:  # it ended before it read it: said below, with its exit code
            pass
        handed = True
        _wait_ready(process, directory, run_id)
    except KeyboardInterrupt:
        if not handed:  # it started nothing: it reads the whole handover before anything else
            process.kill()
            raise
        raise StartInterrupted(run_id) from None  # its ranks may have started: the caller stops them
    return run_id


class StartInterrupted(KeyboardInterrupt):
    """Ctrl-C (the kernel's interrupt) while ``start_detached`` waited for run ``run_id`` to
    start: its supervising process may have started its ranks already."""

    def __init__(self, run_id: str):
        super().__init__()
        self.run_id = run_id


def _wait_ready(process: subprocess.Popen, directory: str, run_id: str) -> None:
    deadline = time.monotonic() + START_WAIT
    while not os.path.exists(os.path.join(directory, READY_FILE)):
        refused = os.path.join(directory, REFUSED_FILE)
        if os.path.exists(refused):
            with open(refused, encoding="utf-8") as fh:
                raise ValueError(fh.read())
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                process.kill()
            raise RuntimeError(
                f"the supervising process of detached run {run_id} did not start it "
                f"(exit code {process.poll()}); its output is in "
                f"{os.path.join(directory, LOG_FILE)}:\n{_tail(directory)}"
            )
        time.sleep(0.01)


def _tail(directory: str, chars: int = 2000) -> str:
    try:
        with open(os.path.join(directory, LOG_FILE), encoding="utf-8", errors="replace") as fh:
            return fh.read()[-chars:]
    except OSError:
        return ""


class Journal:
    """Records of the run's state into ``journal.jsonl``, written by a thread of its own: ``put``
    (the state's listener) returns at once.  Before the first record of a later attempt (the run
    restarted) it writes an ``AttemptBegan``; ``state`` is the run's state, whose attempt the
    records are of (the listener runs with its lock held)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._queue: "queue.SimpleQueue[Optional[events.Event]]" = queue.SimpleQueue()
        fd = open_private(os.path.join(directory, JOURNAL_FILE), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        self._size = 0
        self._full = False
        self.state: Any = None
        self._attempt = 1
        self._thread = threading.Thread(target=self._write, name="torchdist-journal", daemon=True)
        self._thread.start()

    def put(self, record: events.Event) -> None:
        attempt = self.state.attempt if self.state is not None else 1
        if attempt != self._attempt:
            self._attempt = attempt
            self._queue.put(events.AttemptBegan(rank=-1, attempt=attempt))
        self._queue.put(record)

    def _write(self) -> None:
        while True:
            record = self._queue.get()
            time.sleep(JOURNAL_EVERY)  # what comes meanwhile goes in the same write
            lines = []
            while record is not None:
                lines.append(events.dumps(record) + "\n")
                try:
                    record = self._queue.get_nowait()
                except queue.Empty:
                    break
            kept = []
            for line in lines:
                if self._full:
                    break
                if self._size + len(line) > JOURNAL_MAX_BYTES:
                    self._full = True
                    write_private(
                        os.path.join(self.directory, JOURNAL_FULL_FILE),
                        f"the journal reached {JOURNAL_MAX_BYTES} bytes; later records are in the "
                        "run's record only (its state, the tails of its logs)",
                    )
                    break
                kept.append(line)
                self._size += len(line)
            if kept:
                self._file.write("".join(kept))
                self._file.flush()
            if record is None:
                self._file.close()
                return

    def close(self) -> None:
        """Write what is queued and close the file."""
        self._queue.put(None)
        self._thread.join()


def write_full_logs(state: Any, directory: str) -> None:
    """Each rank's complete output (every attempt, one after the other) into ``FULL_LOGS_DIR``
    of the run's ``directory``: ``rank-R.log``, and ``FULL_LOGS_INDEX`` with the byte offsets
    of each rank's attempts (written last: without it, the logs are not complete)."""
    logs = os.path.join(directory, FULL_LOGS_DIR)
    os.makedirs(logs, mode=0o700, exist_ok=True)
    offsets = {}
    for rank in range(state.num_processes):
        fd = open_private(os.path.join(logs, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        at = [0]
        with os.fdopen(fd, "wb") as fh:
            for attempt in range(1, state.attempt + 1):  # one attempt's text at a time in memory
                at.append(at[-1] + fh.write(state.logs(rank, attempt).encode("utf-8", "surrogatepass")))
        offsets[str(rank)] = at
    write_private(os.path.join(logs, FULL_LOGS_INDEX), json.dumps({"attempts": state.attempt, "offsets": offsets}))


def read_full_logs(directory: str, rank: int, attempt: Optional[int] = None) -> Optional[str]:
    """``rank``'s complete output as ``write_full_logs`` kept it (``attempt``: that attempt's
    only, 1 for the first); None when the run's directory has none (a run with a journal, one
    still going, or one whose kernel removed them); ``IndexError`` for a rank or an attempt the
    run did not have."""
    logs = os.path.join(directory, FULL_LOGS_DIR)
    try:
        with open(os.path.join(logs, FULL_LOGS_INDEX), encoding="utf-8") as fh:
            index = json.load(fh)
        with open(os.path.join(logs, f"rank-{rank}.log"), "rb") as fh:
            at = index["offsets"].get(str(rank))
            if at is None:
                raise IndexError(f"rank {rank} is not in this run (ranks 0..{len(index['offsets']) - 1})")
            if attempt is None:
                return fh.read().decode("utf-8", "surrogatepass")
            if not 1 <= attempt <= index["attempts"]:
                raise IndexError(f"attempt {attempt} is not in this run (attempts 1..{index['attempts']})")
            fh.seek(at[attempt - 1])
            return fh.read(at[attempt] - at[attempt - 1]).decode("utf-8", "surrogatepass")
    except FileNotFoundError:
        return None


def read_handover() -> dict:
    """What the kernel handed this process on its standard input (``HANDOVER``), read to its
    end; the standard input is /dev/null afterwards, as the ranks' and Spark's inherit it."""
    with os.fdopen(os.dup(0), "rb") as fh:
        text = fh.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        handed = json.loads(text)
        if not isinstance(handed, dict) or not isinstance(handed.get("env"), dict):
            raise ValueError(f"not an object with {', '.join(HANDOVER)}")
    except ValueError as exc:
        raise SystemExit(
            f"torchdist: the supervising process of a detached run takes what its kernel hands it on its "
            f"standard input ({exc}); it is started by --detach, not by hand"
        ) from None
    return {name: handed.get(name) for name in HANDOVER}


def supervise(directory: str) -> int:
    """The supervising process's work: start the run, serve its control socket, keep its
    journal, value and record until it ends.  The exit code: 0 once the run ended, whatever its
    outcome; 2 when it was refused before it started (``refused`` says why)."""
    import cloudpickle

    from ..driver.distributor import submit

    handover = read_handover()
    run_id = os.path.basename(directory.rstrip(os.sep))
    record = read_record(run_id)
    directory = record.directory  # in the home as checked (``history.home``), not as named on the command line
    with os.fdopen(open_own(os.path.join(directory, OPTIONS_FILE)), encoding="utf-8") as fh:
        options = LaunchOptions(**{**json.load(fh), "env": handover["env"]})
    with os.fdopen(open_own(os.path.join(directory, TOKEN_FILE)), encoding="utf-8") as fh:
        token = fh.read().strip()
    with os.fdopen(open_own(os.path.join(directory, JOB_FILE)), "rb") as fh:
        job = cloudpickle.load(fh)
    session = None if handover["spark"] is None else open_spark(handover["spark"])
    # a run whose kernel follows it (--channel process) keeps no journal: its kernel reads the
    # state through the feed, and the run's record after it ended
    journal = None if os.path.exists(os.path.join(directory, NO_JOURNAL_FILE)) else Journal(directory)
    cancel = threading.Event()  # a stop asked for before the run's handle exists
    run = None
    stopped_by = ["%torchdist stop"]

    def stop(by: str) -> None:
        stopped_by[0] = by
        cancel.set()
        if run is not None:
            run.cancel(by=by)

    control = FeedServer(record.control, token, None, stop)
    try:
        run = submit(
            job, (), {}, options, run_id=run_id, listener=None if journal is None else journal.put, value_as_bytes=True
        )
        control.state = run.state
        if journal is not None:
            journal.state = run.state  # the first attempt's records need no mark
    except (TypeError, ValueError) as exc:
        control.close()
        remove_fallback(os.path.dirname(record.control))
        if session is not None:
            session.stop()
        if journal is not None:
            journal.close()
        record.state, record.failure, record.ended = "failed", str(exc), time.time()
        record.save()
        write_private(os.path.join(directory, REFUSED_FILE), str(exc))
        return 2
    if cancel.is_set():  # a stop asked for while the ranks started
        run.cancel(by=stopped_by[0])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stop(f"{signal.Signals(signum).name} to its supervising process"))
    write_private(os.path.join(directory, READY_FILE), str(os.getpid()))
    try:
        while not run.wait(0.5):
            pass
        has_value = False
        if run.exception is None:
            # the ranks' bytes as they came: never decoded here, so this process needs none of
            # the value's classes and holds no second copy of it
            values.write(run.result(), os.path.join(directory, VALUE_FILE))
            has_value = True
        if journal is not None:
            journal.close()
        run.record.end(has_value=has_value)
    finally:
        write_private(os.path.join(directory, DONE_FILE), run.state.state)
        if journal is None:  # while the feed still serves the kernel: it reads these once it has gone
            try:
                write_full_logs(run.state, directory)
            except OSError as exc:
                print(f"torchdist: the ranks' complete logs could not be kept ({exc})", file=sys.stderr)
        control.linger(FEED_LINGER)  # the kernels' views take their last look at the state
        control.close()
        remove_fallback(os.path.dirname(record.control))  # where another user made the usual one
        if session is not None:
            session.stop()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(supervise(sys.argv[1]))
    except UnsafePath as exc:  # a file of the run's that is not this user's: said, nothing loaded
        sys.exit(f"torchdist: {exc}")
