"""The agreements every process of a run shares (the notebook's driver, the launcher beside each
rank, the rank's worker): records and who may send them (``events``, with a rank's ``failure``,
its ``stacks`` and how a record is checked on decode, ``recordcheck``), options, errors, jobs,
values as blobs, the rank's environment, the names of shared files, signals and variables
(``names``), timings and process groups.  Nothing here imports any other part of the package."""
