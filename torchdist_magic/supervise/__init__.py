"""A detached run's supervising process (``--detach``, ``--channel process``): ``supervisor``
(the process itself: it submits the run with the owner's code, journals what the state took,
keeps the record; and how a kernel starts it), ``feed`` (its control socket: the reads of kernels
that show the run, ``FeedServer``).  The record's files are named in ``driver.layout``.  The
owner (``driver``) never imports this package, nor do the views."""
