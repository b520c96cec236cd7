"""The backend named ``spark``: a barrier stage on the active SparkSession, classic or Connect."""

from __future__ import annotations

import sys
from importlib.util import find_spec

from .spark_classic import SparkBarrierBackend
from .spark_connect import SparkConnectBackend
from .spark_stage import SparkStageBackend, is_spark_connect

NO_SESSION = (
    "backend 'spark' (--spark, local_mode=False) runs on the active SparkSession (classic or "
    "Spark Connect), and this "
    "process has none. Start one first, e.g.:\n"
    "    from pyspark.sql import SparkSession\n"
    "    spark = SparkSession.builder.master(\"local[2]\").getOrCreate()\n"
    "or run on local processes (--local, local_mode=True)"
)

#: pyspark is an extra (``torchdist_magic[spark]``): a Databricks runtime or Databricks Connect
#: brings its own, which a required PyPI pyspark would shadow
NO_PYSPARK = (
    "backend 'spark' (--spark, local_mode=False) runs on a SparkSession, and pyspark is not "
    "installed in this environment. Install torchdist_magic with its Spark extra:\n"
    '    pip install "torchdist_magic[spark]"\n'
    "(on Databricks the runtime has Spark already), or run on local processes (--local, local_mode=True)"
)


def active_session_backend() -> SparkStageBackend:
    """The backend of the active session's flavour.  Without an active SparkSession it is
    refused (``ValueError``) rather than starting one: a session started here would silently
    take ``local[*]`` and many seconds; without pyspark the refusal says how to install it."""
    session = active_spark_session()
    if session is None:
        raise ValueError(NO_SESSION if find_spec("pyspark") is not None else NO_PYSPARK)
    if is_spark_connect(session):
        return SparkConnectBackend(session)
    return SparkBarrierBackend(session)


def active_spark_session():
    """The active classic SparkSession, else the active Spark Connect session, else None."""
    if "pyspark" not in sys.modules:  # no session can be active if pyspark was never imported
        return None
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is None and "pyspark.sql.connect.session" in sys.modules:
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        session = ConnectSession.getActiveSession()
    return session
