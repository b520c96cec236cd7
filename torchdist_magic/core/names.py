"""The names the driver, the launchers and the ranks agree on: environment variables, the files
in a rank's result directory, the signal that asks a rank for its stacks, and the names a cell
gets from its rank.  Each is spelled here once; every process reads it from here."""

from __future__ import annotations

import signal

#: the mark every process a rank starts carries: spelled in ``procs``, which a Spark task's guard
#: runs on its own, without this package
from .procs import MARK_VARIABLE as MARK_VARIABLE

# -- environment variables a rank's launcher sets (``rankenv.rank_environment``) ---------------
RUN_ID_ENV = "TORCHDIST_RUN_ID"
#: ``host:port`` of the run's channel, its certificate (TLS) and the workers' secret
CHANNEL_ENV = "TORCHDIST_CHANNEL"
CHANNEL_CERT_ENV = "TORCHDIST_CHANNEL_CERT"
SECRET_ENV = "TORCHDIST_SECRET"
#: the ranks on this rank's host, as ``host_ranks()`` gives them
HOST_RANKS_ENV = "TORCHDIST_HOST_RANKS"
USE_GPU_ENV = "TORCHDIST_USE_GPU"
SYSTEM_METRICS_ENV = "TORCHDIST_SYSTEM_METRICS"
#: how many steps of its innermost progress() loop the rank profiles (``--profile``; 0: none)
PROFILE_STEPS_ENV = "TORCHDIST_PROFILE_STEPS"
#: whether the rank runs the pre-flight check with its peers before its job (``core.preflight``)
PREFLIGHT_ENV = "TORCHDIST_PREFLIGHT"
#: whether the rank turns torch's Flight Recorder on (``--trace-collectives``: ``collectives``)
TRACE_COLLECTIVES_ENV = "TORCHDIST_TRACE_COLLECTIVES"
#: whether this rank's value goes back to the driver (rank 0's, or every rank's with all_ranks)
RETURN_VALUE_ENV = "TORCHDIST_RETURN_VALUE"
RESTART_COUNT_ENV = "TORCHDIST_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHDIST_MAX_RESTARTS"
CHECKPOINT_DIR_ENV = "TORCHDIST_CHECKPOINT_DIR"
KEEP_CHECKPOINTS_ENV = "TORCHDIST_KEEP_CHECKPOINTS"
#: the file of this rank's rows of the run's DataFrame (``shard``)
DATA_FILE_ENV = "TORCHDIST_DATA_FILE"
#: what the run's ``env`` changed in a rank's environment, ``{name: its value without it}`` as
#: JSON (``null``: unset): a warm pool's rank started with the ``env`` of the run that started
#: the pool and sets these back (``serving.serve``), so that a later run without it does not see
#: it.  The worker removes the variable itself before any job runs.
ENV_BEFORE = "TORCHDIST_ENV_BEFORE"
#: the paths a rank's worker removes when its launcher dies (the run's directory, which the dead
#: launcher can no longer remove)
CLEANUP_ENV = "TORCHDIST_CLEANUP"
#: the pid of a rank's launcher, which started its worker: a launcher that died before the worker
#: looked at its parent must still be seen gone
LAUNCHER_PID_ENV = "TORCHDIST_LAUNCHER_PID"
#: where a rank writes its value when its launcher says (else ``RESULT_FILE`` in its result dir)
VALUE_FILE_ENV = "TORCHDIST_VALUE_FILE"
#: the rank's debugger: the session's id, ``--pdb``, and how long a held rank waits for input
DEBUG_ENV = "TORCHDIST_DEBUG"
PDB_ENV = "TORCHDIST_PDB"
IDLE_ENV = "TORCHDIST_DEBUG_IDLE"
#: set to 1 on the driver, a run on Spark whose executors share the driver's machine (``local[...]``,
#: ``local-cluster[...]``) takes the path of a cluster's both ways: each machine fetches the
#: notebook values from the driver's channel (``hostcopy``) rather than mapping the driver's file,
#: and each rank's task sends its value to the driver over the channel (``valueupload``) rather
#: than have its rank write it into the driver's value directory.  For testing those paths on one
#: machine.
VALUES_FETCH_ENV = "TORCHDIST_VALUES_FETCH"
#: the path of the machine's copy of the notebook values that a rank's launcher fetched or found
#: whole before it started the rank (``hostcopy``): the one file the rank maps for them, never a
#: path it guesses (``values.Buffers.load``)
VALUES_COPY_ENV = "TORCHDIST_VALUES_COPY"
#: a name the ranks of a run derive alike and no other user can (from the run's secret): of the
#: private directory the ranks of a host meet in (``%pip``) where another user made this user's
#: usual one first (``privdir.usable_user_directory``'s ``agreed``)
PRIVATE_TOKEN_ENV = "TORCHDIST_PRIVATE_TOKEN"

# -- a rank's result directory -------------------------------------------------------------------
RESULT_FILE = "result.pkl"
ERROR_FILE = "error.json"
STACKS_FILE = "stacks.txt"
#: the signal that asks a worker for its stacks: one that no library uses (SIGUSR1 is Lightning's on SLURM)
STACKS_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
STACKS_HEADER = "torchdist main thread "

# -- what a cell sees ---------------------------------------------------------------------------
#: names a cell gets from the run, in place of any notebook value of the same name
CELL_PROVIDED = (
    "rank",
    "local_rank",
    "world_size",
    "device",
    "progress",
    "report",
    "is_main",
    "restart_count",
    "save_checkpoint",
    "load_checkpoint",
)
#: the ``desc`` of the bar each rank's rows are reported with (the view shows rows/s for it)
ROWS_BAR = "rows"
