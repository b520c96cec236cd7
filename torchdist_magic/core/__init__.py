"""The agreements every process of a run shares (the notebook's driver, the launcher beside each
rank, the rank's worker): records and who may send them (``events``), options, errors, jobs,
values as blobs, the rank's environment, the names of shared files, signals and variables
(``names``), timings and process groups.  Nothing here imports any other part of the package."""
