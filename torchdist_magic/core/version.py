"""The release, one value: ``torchdist_magic.__version__`` is this name, ``setup.cfg`` reads it
(``attr:``) for the wheel's metadata, ``%torchdist --version`` shows it, and every run's record
and MLflow run carry it."""

__version__ = "0.1.0"
