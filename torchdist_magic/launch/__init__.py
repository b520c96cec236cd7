"""What runs beside each rank, in its launcher (a thread of the local backend, or a Spark task):
start one worker and report its exit (``launcher``), sample its machine (``sysmetrics``,
``gpu_metrics``), bring the notebook's values in (``hostcopy``) and the rank's value out
(``valueupload``).  Never imports the rank's code."""
