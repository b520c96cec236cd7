"""The backend a run uses, made from its name (``core.registry``): ``make_backend``."""

from __future__ import annotations

from ..core.options import LaunchOptions
from ..core.registry import AUTO, backend_factory
from .base import Backend


def make_backend(options: LaunchOptions) -> Backend:
    """The backend for ``options.backend``.  ``auto`` is Spark when a SparkSession is active in
    this process, local processes otherwise; a backend that cannot run here says why
    (``ValueError``) before anything starts, and so does one refusing the run's backend options
    (``Backend.configure``)."""
    name = options.backend
    if name == AUTO:
        from .spark import active_spark_session  # imports no pyspark of its own

        name = "spark" if active_spark_session() is not None else "local"
    backend = backend_factory(name)()
    if not isinstance(backend, Backend):
        raise TypeError(
            f"backend {name!r}: its factory returned a {type(backend).__name__}, not a "
            "torchdist_magic Backend (backends.base.Backend)"
        )
    backend.configure(dict(options.backend_options))
    return backend
