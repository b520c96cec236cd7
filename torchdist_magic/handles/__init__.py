"""The kernel's handles on a run another process holds: ``attach`` (a detached run's handle,
``AttachedRun``; ``attach``/``stop`` by run id; starting one, ``submit_detached``), ``feed``
(the run's state read through the feed of the process that holds it, ``HostedState``, and the
kernel's side of its merged log), ``follow`` (a run followed in the calling thread).  They read
the owner's code (``driver``) and start or ask the supervising process (``supervise``); the
owner never imports them."""
