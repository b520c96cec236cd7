"""The docs: README.md stays short and its links and commands hold; the pages generated from the
code (``docs/generate.py``) cover every flag, ``%config`` setting, public name and record; the
site's configuration lists every notebook.  The strict build itself (``mkdocs build --strict``)
runs in ``.ci/run``; the one test here that needs MkDocs is skipped, and says so, without it."""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
README = os.path.join(ROOT, "README.md")
#: the issue's bound: a README that points into the docs, not one that holds them
MAX_README_BYTES = 12 * 1024


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"torchdist_docs_{name}", os.path.join(DOCS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generate():
    return _module("generate")


def _readme() -> str:
    with open(README, encoding="utf-8") as fh:
        return fh.read()


def test_readme_is_short():
    assert os.path.getsize(README) <= MAX_README_BYTES, "README.md is over 12 KB: move the detail into docs/"


def test_readme_three_commands_are_what_ci_runs():
    """``.ci/run`` finds these lines by their marks; without them CI stops with exit 2."""
    block = re.search(r"^## Three commands\n(.*?)^```bash\n(.*?)^```$", _readme(), re.S | re.M)
    assert block, "README.md has no '## Three commands' section with a bash block"
    marks = [line.rsplit("#", 1)[1].strip() for line in block.group(2).splitlines() if "#" in line]
    assert marks == ["set up", "main job", "tests"]


def test_readme_links_point_at_files_of_the_repository():
    missing = [
        target
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)", _readme())
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not os.path.exists(os.path.join(ROOT, target))
    ]
    assert not missing, f"README.md links to files that are not there: {missing}"


def test_flags_reference_has_every_flag_and_setting(generate):
    """The page replaces the pasted ``%%torchdist?`` the README used to carry: every flag of the
    magic's parser and every ``%config`` trait is on it, with the help the magic shows."""
    from torchdist_magic.core.options import option_fields
    from torchdist_magic.core.flags import flag_specs
    from torchdist_magic.magic import TorchdistMagics

    page = generate.flags_reference()
    flags = [flag for args, _ in flag_specs() for flag in args if flag.startswith("-")]
    assert len(flags) >= len(option_fields())
    assert [f for f in flags if f"`{f}" not in page] == []
    assert [f.name for f in option_fields() if f"| `{f.name}` |" not in page] == []
    traits = TorchdistMagics.class_traits(config=True)
    assert [n for n in traits if f"`TorchdistMagics.{n}`" not in page] == []
    assert TorchdistMagics.torchdist.__doc__.strip().splitlines()[0].strip() in page


def test_api_reference_has_every_public_name_once(generate):
    import torchdist_magic

    listed = [name for _, _, names in generate.API_SECTIONS for name in names]
    assert sorted(set(listed)) == sorted(listed), "a name is listed twice"
    assert sorted(set(torchdist_magic.__all__) - set(listed)) == []
    page = generate.api_reference()
    for name in listed:
        path = generate._where(name)
        assert f"::: {path}\n" in page
        module, _, qualname = path.rpartition(".")
        assert hasattr(sys.modules[module], qualname), path


def test_event_contract_has_every_record_and_sender(generate):
    from torchdist_magic.core import events

    page = generate.events_reference()
    records = {cls.__name__ for classes in events.SENDERS.values() for cls in classes}
    assert [r for r in records if f"| `{r}` |" not in page] == []
    assert f"**{events.PROTOCOL_VERSION}**" in page


def test_site_lists_every_notebook_and_page():
    import yaml

    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as fh:
        config = yaml.safe_load(fh)

    def pages(nav):
        for item in nav:
            if isinstance(item, str):
                yield item
            else:
                for value in item.values():
                    yield from (pages(value) if isinstance(value, list) else [value])

    listed = set(pages(config["nav"]))
    notebooks = {f"notebooks/{n}" for n in os.listdir(os.path.join(ROOT, "notebooks")) if n.endswith(".ipynb")}
    assert sorted(notebooks - listed) == []
    written = {
        os.path.relpath(os.path.join(d, f), DOCS).replace(os.sep, "/")
        for d, _, fs in os.walk(DOCS)
        for f in fs
        if f.endswith(".md")
    }
    generated = set(_module("generate").PAGES) | {"notebooks/index.md"}
    assert sorted(written - listed) == [], "pages in docs/ that the site's navigation leaves out"
    assert sorted(listed - written - notebooks - generated) == [], "navigation entries with no page"


def test_docs_extra_and_ci_build_the_site():
    with open(os.path.join(ROOT, "setup.cfg"), encoding="utf-8") as fh:
        setup = fh.read()
    extra = re.search(r"^docs =\n((?:    .+\n)+)", setup, re.M)
    assert extra and "mkdocs" in extra.group(1) and "mkdocstrings" in extra.group(1)
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as fh:
        assert ".venv/bin/mkdocs build --strict" in fh.read()
    with open(os.path.join(ROOT, ".ci", "setup"), encoding="utf-8") as fh:
        assert re.search(r"^install_wheel \.venv \S*docs", fh.read(), re.M)  # the wheel with the docs extra


def test_a_notebook_link_the_site_lacks_is_said(caplog):
    """The site's hook points a notebook's links at the site's files; a link to a file the site
    does not have stays as it was and is a warning, which fails the strict build."""
    pytest.importorskip("mkdocs", reason="MkDocs is the `docs` extra (in .venv after .ci/setup)")
    from mkdocs.config import load_config
    from mkdocs.structure.files import File, Files
    from mkdocs.structure.pages import Page
    from mkdocs_jupyter.plugin import NotebookFile

    hooks = _module("hooks")
    config = load_config(os.path.join(ROOT, "mkdocs.yml"))
    site = {"src_dir": ROOT, "dest_dir": config["site_dir"], "use_directory_urls": True}
    # as mkdocs-jupyter makes them pages: notebooks/01-quickstart/
    quickstart, spark = (
        NotebookFile(File(f"notebooks/{name}", **site), use_directory_urls=True, site_dir=config["site_dir"])
        for name in ("01-quickstart.ipynb", "02-spark.ipynb")
    )
    picture = File("run-view.png", DOCS, config["site_dir"], True)
    page = Page(None, quickstart, config)
    html = '<a href="02-spark.ipynb">next</a> <img src="../docs/run-view.png"> <a href="gone.ipynb">x</a>'
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.torchdist"):
        out = hooks.on_page_content(html, page, config, Files([quickstart, spark, picture]))
    assert '<a href="../02-spark/">next</a>' in out
    assert '<img src="../../run-view.png">' in out
    assert '<a href="gone.ipynb">x</a>' in out
    assert "notebooks/01-quickstart.ipynb links to gone.ipynb, which the site does not have" in caplog.text


def test_generate_imports_nothing_of_the_package():
    """The hook imports ``docs/generate.py`` before MkDocs reads anything: what it documents is
    imported inside each function."""
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('g', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "print(sorted(n for n in sys.modules if n.startswith('torchdist_magic')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, os.path.join(DOCS, "generate.py")], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_the_module_map_lists_every_module_once_with_what_it_is(generate):
    import glob

    page = generate.module_map()
    package = os.path.join(ROOT, "torchdist_magic")
    modules = sorted(glob.glob(os.path.join(package, "**", "*.py"), recursive=True))
    folders = {os.path.relpath(os.path.dirname(path), package) for path in modules}
    assert {folder if folder != "." else "" for folder in folders} == {f for f, _ in generate.LAYERS}
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == len(modules)
    for row in rows:  # a module whose docstring says nothing would show an empty cell
        assert row.split("|")[3].strip(), row


def _public_callables():
    """Every name of ``torchdist_magic.__all__`` and the public methods and properties of its
    classes: what the API page renders a signature for."""
    import torchdist_magic

    for name in torchdist_magic.__all__:
        obj = getattr(torchdist_magic, name)
        yield name, obj
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if not member.startswith("_") and (inspect.isfunction(value) or isinstance(value, classmethod)):
                    yield f"{name}.{member}", getattr(obj, member)


#: a name that starts with an underscore, not part of a longer name or a dotted path's tail
_PRIVATE = re.compile(r"(?<![\w.])_[A-Za-z]\w*")


def test_every_public_name_has_an_example_that_is_python():
    """Each name the package exports shows how it is used: a ```python block in its docstring
    (rendered by mkdocstrings on the API page), whose code parses, ``%%torchdist`` cells and
    ``%`` lines as IPython reads them."""
    import textwrap

    import torchdist_magic
    from IPython.core.inputtransformer2 import TransformerManager

    lacking, broken = [], []
    for name in torchdist_magic.__all__:
        doc = inspect.getdoc(getattr(torchdist_magic, name)) or ""
        blocks = re.findall(r"^```python\n(.*?)^```$", doc, re.S | re.M)
        if not blocks:
            lacking.append(name)
        for block in blocks:
            code = textwrap.dedent(block)
            if code.startswith("%%"):  # a cell magic's body is Python of its own
                code = code.split("\n", 1)[1]
            try:
                compile(TransformerManager().transform_cell(code), f"<example of {name}>", "exec")
            except SyntaxError as exc:
                broken.append(f"{name}: {exc}")
    assert lacking == [], "public names whose docstring has no ```python example"
    assert broken == []


def test_no_rendered_signature_shows_a_private_name():
    """A signature on the API page names only what a user can read about: no private sentinel
    (``_UNSET``) or helper as a default, no ``<object object at 0x...>``.  Checked on what
    ``help()`` shows (``inspect.signature``) and on the source text the docs site renders
    (defaults and annotations as written)."""
    import ast
    import textwrap

    shown = []
    for name, obj in _public_callables():
        func = obj.__init__ if inspect.isclass(obj) else obj
        func = getattr(func, "__func__", func)
        try:
            text = str(inspect.signature(obj))
        except (TypeError, ValueError):  # an exception class with object's own __init__
            continue
        if _PRIVATE.search(text) or " at 0x" in text:
            shown.append(f"{name}{text}")
        try:
            source = textwrap.dedent(inspect.getsource(func))
        except (OSError, TypeError):  # not written in Python here (a dataclass's __init__)
            continue
        node = ast.parse(source).body[0]
        written = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
        written += [a.annotation for a in (*node.args.args, *node.args.kwonlyargs) if a.annotation is not None]
        written += [node.returns] if node.returns is not None else []
        shown += [f"{name}: {ast.unparse(e)}" for e in written if _PRIVATE.search(ast.unparse(e))]
    assert shown == []


def test_local_mode_default_is_true_unless_a_backend_is_named():
    """The public sentinel keeps TorchDistributor's call: ``local_mode`` left out is local
    processes, ``backend=`` alone decides, and an explicit ``True`` still contradicts ``spark``."""
    from torchdist_magic import Distributor
    from torchdist_magic.api import LOCAL_MODE_DEFAULT

    assert inspect.signature(Distributor).parameters["local_mode"].default is LOCAL_MODE_DEFAULT
    assert repr(LOCAL_MODE_DEFAULT) == "LOCAL_MODE_DEFAULT"
    assert Distributor(2).options.backend == "local"
    assert Distributor(2, backend="spark").options.backend == "spark"
    with pytest.raises(ValueError, match="^local_mode=True and backend='spark' contradict each other"):
        Distributor(2, local_mode=True, backend="spark")
