"""What runs in a rank's worker process: the entry point (``worker``), how each kind of job runs
(``runners``), the helpers a job calls (``rank()``, ``progress()``, ``report()``, checkpoints:
``runtime``), the hooks that make tqdm and rich bars the rank's progress and time torch's waits
(``progress_hooks``), IPython syntax in a cell (``shell``), the rank's debugger and ``shard``.
Never imports the driver, the launcher or ipywidgets."""
