"""What runs in a rank's worker process: the entry point (``worker``), one job run and its outcome
(``jobrun``), a warm pool's rank serving job after job (``serving``), how each kind of job runs
(``runners``), the helpers a job calls (``rank()``, ``progress()``, ``report()``, checkpoints:
``runtime``), the hooks that make tqdm and rich bars the rank's progress and time torch's waits
(``progress_hooks``), IPython syntax in a cell (``shell``), the rank's debugger and ``shard``.
Never imports the driver, the launcher or ipywidgets."""
