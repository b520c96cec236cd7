"""Every stop timing and deadline of a run, in one place (seconds).

Stopping a rank is always: SIGTERM to its process group, wait until one shared deadline, then
SIGKILL to the group.  The values below say how long each step may take.
"""

#: between SIGTERM and SIGKILL when a run stops its ranks (cancel, timeout, a peer's failure)
STOP_GRACE = 2.0
#: beyond a stop's grace, how long a second caller of a warm pool's stop waits for the first
#: one to end its ranks and remove its files (they still need REAP_WAIT at worst)
STOP_WAIT = 10.0
#: between SIGTERM and SIGKILL when a finished run releases ranks that are somehow still there
CLOSE_GRACE = 0.5
#: after SIGKILL, how long to wait for a process's exit to be reported
REAP_WAIT = 5.0
#: after a rank exits, how long its exit report waits for its output pipes to close: what the
#: rank wrote is read by then; a child that inherited the pipes may keep them open, and its
#: later output still arrives, after the exit
PIPE_DRAIN_WAIT = 0.2
#: when every failure seen so far is collateral (a peer noticing that a rank went away), how
#: long the driver waits for the failure that caused it before naming a root cause
ROOT_CAUSE_WAIT = 2.0
#: how long a launcher lets a rank's output gather in its pipe after a short read: a few reads
#: a second per pipe, not one per line a rank prints (each read is one record, ``Log.more``)
OUTPUT_GATHER = 0.05
#: how often the driver checks a run's state while a debugger session holds a rank or a hang
#: is observed
SUPERVISE_POLL = 0.02
#: how often the driver's watcher looks at a run that nothing woke it for: a rank's exit and a
#: cancel wake it at once; a deadline, a hang timeout, a debugger session are seen within this
WATCH_INTERVAL = 0.1
#: how often an orphaned worker checks whether its launcher is gone
PARENT_WATCH_INTERVAL = 0.5
#: at a rank's exit, how long its ``atexit`` handlers may run before the process ends anyway
ATEXIT_WAIT = 10.0

#: a hang or a timeout: how long a launcher waits for its rank's stack dump to be written
STACKS_WAIT = 3.0
#: a stack dump is complete once the rank's stack file stopped growing for this long
STACKS_SETTLE = 0.1
#: how long the driver waits for every rank's ``Stacks`` answer (the launchers' wait, and the way back)
STACKS_COLLECT_WAIT = STACKS_WAIT + 1.0
#: how long the driver waits for every rank's collective record, asked after their stacks came
COLLECTIVES_WAIT = 2.0

#: a channel connection must complete its handshake within this deadline (a rank's client tries
#: again, a few times, when it did not: ``wire.handshake.CONNECT_ATTEMPTS``)
HANDSHAKE_DEADLINE = 10.0
#: when a run ends, how long the driver waits for open channel connections to deliver
CHANNEL_CLOSE_WAIT = 2.0
#: beyond that, how long closing the channel waits for its thread, which may be delivering a
#: record to a slow callback (the thread is a daemon: it is left behind, and logged, after that)
CHANNEL_THREAD_WAIT = 5.0
#: how long a rank waits at exit for its queued events to be sent
CLIENT_CLOSE_WAIT = 5.0
#: a fetch of the notebook values (``hostcopy``) whose connection moves no byte for this long is
#: given up, on both ends
FETCH_STALL = 60.0
#: how long a fetch waits for its turn at the driver, which sends ``wire.transfers.FETCHES_AT_ONCE`` at
#: a time (many machines fetching a large value over one network link wait in line); a run that
#: ends closes the fetches still waiting
FETCH_QUEUE_WAIT = 1800.0

#: Spark: how long a run waits for executors to register before giving up on slots
SPARK_SLOT_WAIT = 30.0
#: Spark: a cancel can race the job's submission; it is repeated at this interval
SPARK_CANCEL_RETRY = 0.25
#: Spark: after the ranks' grace, how long a stop waits for the tasks to return
SPARK_STAGE_END_WAIT = 3.0
#: Spark: how long a stop keeps cancelling a stage that does not end
SPARK_CANCEL_WAIT = 30.0
#: a DataFrame run: how long a rank waits for the other ranks' row counts (a Spark task writes
#: its whole partition before its rank starts, so the ranks of one run can start minutes apart)
ROW_COUNTS_WAIT = 1800.0

#: Spark: after the first task joined the driver's rendezvous, how long the driver waits for
#: the others before telling them all to exchange places through Spark's barrier instead
SPARK_RENDEZVOUS_WAIT = 10.0

#: a warm run where some rank's job failed: how long the others may take to finish the job
#: before the pool is torn down (a rank still in the job is likely waiting in a collective)
WARM_SETTLE = 3.0
#: a warm rank reported its job done: how long the driver waits for the end of its output
#: (``events.OutputEnd``) before it takes the job as ended anyway
OUTPUT_END_WAIT = 2.0
#: how long sending a job to a warm pool's ranks may wait for room on the channel
WARM_SEND_WAIT = 60.0
#: a rank's debugger session (``--pdb``, ``breakpoint()``) that gets no input for this long ends,
#: freeing the rank (``LaunchOptions.debug_idle_timeout``'s default)
DEBUG_IDLE_LIMIT = 600.0

#: how often the driver writes a run's new metric points to MLflow (``tracking``)
MLFLOW_FLUSH_INTERVAL = 1.0
#: when a run ends, how long its result waits for the MLflow points still buffered to be written
#: (the rest is counted and said); its logs and status are written after that
MLFLOW_CLOSE_WAIT = 30.0

#: how often a rank's launcher samples its processes' CPU and memory (``sysmetrics``)
SYSTEM_METRICS_INTERVAL = 2.0
#: ... and how often once their memory is past ``sysmetrics.NEAR_LIMIT_FAST`` of its limit, so
#: that a rank the OOM killer ends was seen close to the limit
SYSTEM_METRICS_FAST_INTERVAL = 0.25

#: Ray: how long a run waits for the cluster to place its placement group (which it can place:
#: ``backends.ray`` refuses at once one it never could) before it gives up, saying what is free
RAY_PLACEMENT_WAIT = 10.0
#: Ray: after ``ray.kill``, how long a stop waits for Ray to report each actor dead
RAY_KILL_WAIT = 10.0
#: Ray: how long the backend tries to reach a cluster's HOST:PORT before saying nothing answers
RAY_CONNECT_WAIT = 5.0
