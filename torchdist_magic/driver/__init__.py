"""What runs in the notebook's driver: a cell or function into a job (``capture``), runs and their
supervision (``distributor``), the run's state (``state``), stragglers, MLflow (``tracking``), the
debugging console (``console``).  Knows nothing of widgets."""
