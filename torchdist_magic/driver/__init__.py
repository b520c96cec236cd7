"""What runs in the notebook's driver: a cell or function into a job (``capture``), runs and their
supervision (``distributor``), the run's state (``state``: the records applied; what its readers
ask, ``reading``, and get, ``snapshot``; each rank's log, ``logstore``, spilled to the run's
directory, ``rundir``; the root cause among failures, ``rootcause``; a large run summarised across its ranks,
``summary``), stragglers, MLflow
(``tracking``), the debugging console (``console``).  Knows nothing of widgets."""
