"""Reading a failed stage's Py4J error: the rank, host, Python exception and traceback a user
needs, from the text Spark produced (samples in tests/data were captured from pyspark 4.3)."""

import pathlib

import pytest

from torchdist_magic.backends.spark_stage import spark_failure

pytestmark = pytest.mark.spark  # also run under pyspark 3.5 (README's test command)

DATA = pathlib.Path(__file__).parent / "data"


class FakePy4JError(Exception):
    """Stands for a Py4JJavaError whose JVM is gone: ``str()`` is all there is."""


def failure_of(text):
    return spark_failure(FakePy4JError(text))


def test_python_exception_in_a_barrier_task():
    rank, failure = failure_of((DATA / "py4j_python_exception.txt").read_text())
    assert rank == 0
    assert failure.exc_type == "ImportError"
    assert failure.message == "No module named 'torchdist_magic' (simulated)"
    assert failure.traceback.startswith("Traceback (most recent call last):")
    assert 'File "/home/user/notebook_helpers.py", line 9, in raise_in_task' in failure.traceback
    assert "SQLSTATE" not in failure.traceback and "\tat org.apache" not in failure.traceback


def test_killed_barrier_task_gives_sparks_reason():
    rank, failure = failure_of((DATA / "py4j_killed_task.txt").read_text())
    assert rank == 1
    assert failure.exc_type == "SparkException"
    assert failure.message.startswith("Python worker exited unexpectedly (crashed).")
    assert failure.traceback == ""


def test_lost_task_names_rank_host_and_reason():
    text = (
        "Job aborted due to stage failure: Task 1 in stage 3.0 failed 1 times, most recent failure: "
        "Lost task 1.0 in stage 3.0 (TID 7) (10.0.0.5 executor 2): ExecutorLostFailure (executor 2 "
        "exited caused by one of the running tasks) Reason: Container killed\n\tat org.apache.Foo"
    )
    rank, failure = failure_of(text)
    assert (rank, failure.host) == (1, "10.0.0.5")
    assert failure.message.startswith("ExecutorLostFailure (executor 2 exited")


@pytest.mark.parametrize("text", ["", "something else entirely"])
def test_unrecognised_text_keeps_what_there_is(text):
    rank, failure = failure_of(text)
    assert rank is None
    assert failure.exc_type == "FakePy4JError"
    assert failure.message == (text or "FakePy4JError")
