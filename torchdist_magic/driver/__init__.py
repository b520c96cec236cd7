"""The run's owner, in the process that holds a run (the notebook's kernel, or a detached run's
supervising process): runs and their supervision (``distributor``), the run's state (``state``:
the records applied, and its reads; what its readers get, ``snapshot``, and may ask through a
feed, ``reading``; each rank's log, ``logstore``, spilled to the
run's directory, ``rundir``; the root cause among failures, ``rootcause``; a large run summarised
across its ranks, ``summary``; the merged log a view follows, ``merged``), stragglers, goodput,
hangs, profiles, MLflow (``tracking``), the debugging console (``console``), the run's record
(``history``, its files named in ``layout``).  Knows nothing of widgets, of the kernel's handles
on a run held elsewhere (``handles``) or of the supervising process (``supervise``)."""
