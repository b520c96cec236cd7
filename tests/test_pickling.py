"""What the ranks get of a function sent by value: its code whole, with the file it comes from,
whatever cloudpickle's release (3.1.3 and later write "<dynamic-code>" into every code object
they send; ``values.SourcePickler`` keeps the file name)."""

import pickle
import subprocess
import sys
import textwrap

import pytest

from torchdist_magic.core import values
from torchdist_magic.core.job import function_job


def outer(x):
    def inner(y):
        return [lambda: y + x][0]

    return inner


class Model:
    def forward(self, x):
        return x * 2


def load_in_a_fresh_interpreter(stream: bytes, expression: str) -> str:
    """``expression`` evaluated on ``obj``, the unpickled ``stream``, in a Python where this test
    file cannot be imported (as on a rank)."""
    code = textwrap.dedent(f"""
        import pickle, sys
        obj = pickle.loads(sys.stdin.buffer.read())
        print(repr({expression}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], input=stream, capture_output=True, check=True, cwd="/", timeout=120
    )
    return out.stdout.decode().strip()


@pytest.mark.parametrize(
    "name,expression",
    [
        ("function", "obj.__code__.co_filename"),
        ("nested function", "obj(1).__code__.co_filename"),
        ("lambda inside it", "obj(1)(2).__code__.co_filename"),
        ("method of a class sent by value", "type(obj).forward.__code__.co_filename"),
    ],
)
def test_code_sent_by_value_keeps_its_file_name(name, expression):
    obj = Model() if "method" in name else outer
    stream = values.pickle_for_ranks(obj, [sys.modules[__name__]])
    assert load_in_a_fresh_interpreter(stream, expression) == repr(__file__)


def test_code_keeps_its_line_numbers_and_still_runs():
    stream = values.pickle_for_ranks(outer, [sys.modules[__name__]])
    code = "(obj.__code__.co_firstlineno, obj(1)(2)())"
    assert load_in_a_fresh_interpreter(stream, code) == repr((outer.__code__.co_firstlineno, 3))


def test_values_sent_apart_keep_their_code_file_too():
    stream, buffers = values.pickled_apart({"fn": outer}, [sys.modules[__name__]])
    assert buffers.nbytes == 0
    assert load_in_a_fresh_interpreter(stream, "obj['fn'].__code__.co_filename") == repr(__file__)


def test_a_function_job_carries_the_source_of_its_module(tmp_path, monkeypatch):
    helper = tmp_path / "shard_helper.py"
    helper.write_text("def bad_shard(r):\n    raise KeyError('shard ' + str(r))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import shard_helper

    try:
        job = function_job(shard_helper.bad_shard, (1,), {})
        # the ranks on another machine cannot read the helper's file: its lines travel with the job
        assert job.sources[str(helper)] == ["def bad_shard(r):\n", "    raise KeyError('shard ' + str(r))\n"]
        fn, args, _ = pickle.loads(job.payload)
        assert fn.__code__.co_filename == str(helper)
    finally:
        sys.modules.pop("shard_helper", None)


def test_the_run_names_the_versions_it_pickles_and_launches_with():
    import cloudpickle

    from conftest import PACKAGES_UNDER_TEST, package_versions, versions_line

    versions = package_versions()
    assert set(PACKAGES_UNDER_TEST) <= set(versions)
    assert versions["cloudpickle"] == cloudpickle.__version__
    assert f"cloudpickle {cloudpickle.__version__}, torch " in versions_line()
