"""Cell capture: which names travel, which imports replay, line numbers, semicolons."""

import threading

import pytest

from torchdist_magic.capture import CaptureError, capture_cell, free_names, notebook_imports


@pytest.mark.parametrize(
    "source,expected",
    [
        ("y = x + 1", ["x"]),
        ("x = 1\ny = x + 1", []),  # assigned before use: the cell's own
        ("y = x\nx = 2", ["x"]),  # used before assigned: from the notebook
        ("total += step", ["step", "total"]),  # augmented assignment reads first
        ("def f():\n    return model\nmodel = 1\nf()", []),  # read later, inside a function it defines
        ("def f():\n    return model\nf()", ["model"]),
        ("class A(Base):\n    k = K\n", ["Base", "K"]),
        ("[v * c for v in data]", ["c", "data"]),
        ("for i in range(n):\n    acc = i\nacc", ["n", "range"]),
        ("import os\nos.getpid()", []),
        ("try:\n    pass\nexcept Exception as e:\n    print(e)", ["Exception", "print"]),
        ("lambda q: q + w", ["w"]),
        ("def g(a=default):\n    return a", ["default"]),
    ],
)
def test_free_names(source, expected):
    assert free_names(source) == expected


def test_notebook_imports_keep_aliases_order_and_skip_failed():
    history = [
        "",
        "import numpy as np\nfrom torch import nn as tnn",
        "import numpy as np",
        "import does_not_exist",
        "from . import rel\nfrom __future__ import annotations",
        "if True:\n    import json",
        "import os.path",
        "from math import *",
        "x = (",
        "print('import')",
    ]
    ns = {"np": 1, "tnn": 2, "os": 3}
    assert notebook_imports(history, ns) == [
        ("import numpy as np", "In[1]"),
        ("from torch import nn as tnn", "In[1]"),
        ("import os.path", "In[6]"),
        ("from math import *", "In[7]"),
    ]


def test_provided_and_ipython_names_do_not_travel():
    cap = capture_cell(
        "print(rank, device, In, Out, get_ipython, cfg)",
        {"rank": 99, "device": "cuda", "In": [], "Out": {}, "get_ipython": object, "cfg": {"lr": 1}},
        [],
    )
    assert cap.value_names == ["cfg"]


def test_module_under_any_name_is_imported_not_pickled():
    import os.path as osp

    cap = capture_cell("osp.join('a', 'b')", {"osp": osp}, [])
    assert cap.value_names == []
    assert cap.imports == [(f"import {osp.__name__} as osp", "the notebook's 'osp'")]


def test_shared_references_survive():
    import cloudpickle

    shared = [1, 2]
    cap = capture_cell("a is b", {"a": shared, "b": {"inner": shared}["inner"]}, [])
    values = cloudpickle.loads(cap.values)
    assert values["a"] is values["b"]


@pytest.mark.parametrize(
    "value,type_name",
    [
        (threading.Lock(), "_thread.lock"),
        ((i for i in range(3)), "generator"),
    ],
)
def test_unpicklable_value_named_with_type(value, type_name):
    with pytest.raises(CaptureError, match=f"the cell uses 'thing' \\(a {type_name}\\) from the notebook"):
        capture_cell("thing", {"thing": value, "fine": 1}, [])


def test_open_file_named(tmp_path):
    with open(tmp_path / "f.txt", "w") as fh:
        with pytest.raises(CaptureError, match=r"'fh' \(a _io.TextIOWrapper\)"):
            capture_cell("fh.write('x')", {"fh": fh}, [])


def test_syntax_error_reports_notebook_line():
    with pytest.raises(CaptureError) as info:
        capture_cell("a = 1\nb = = 2\n", {}, [])
    lines = str(info.value).splitlines()
    assert lines[0] == "SyntaxError in the cell, line 3: invalid syntax"
    assert lines[1] == "    b = = 2"
    assert lines[2].index("^") == 8


def test_semicolon_and_process_group_detection():
    assert capture_cell("x = 1\nx;  # quiet", {}, []).silent
    assert not capture_cell("x = 1\nx", {}, []).silent
    assert not capture_cell("'a;'", {}, []).silent
    assert capture_cell("x = 1", {}, []).init_process_group
    assert not capture_cell(
        "import torch.distributed as dist\ndist.init_process_group('gloo')", {}, []
    ).init_process_group
