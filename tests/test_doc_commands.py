"""Every command the repository's Markdown files and notebooks tell a reader to type refers to
files and options that exist: a ``pytest`` line collects tests (its paths, ``-m`` markers and
``-k`` words select something), a ``python SCRIPT`` line names a script of the repository and
flags its ``argparse`` declares, ``python -m MODULE`` a module of the package, ``bash FILE`` a
file, ``%pip``/``pip`` options pip accepts and local paths that are there, ``.venv/bin/TOOL`` a
tool the project's environment has.

Where the commands are found: fenced code blocks of ``*.md`` files (every line of a shell or
plain block, the ``%pip``/``!`` lines of a Python block), inline code spans, and the ``%pip``/
``!`` lines of the notebooks' code cells (their Markdown cells as Markdown).

A command may name the reader's own files: a path is the reader's when it is absolute
(``/Volumes/...``, ``/dbfs/...``), holds a placeholder (``<version>``, ``...``), or is a script
name in ``USER_SCRIPTS`` (each of which must be used somewhere, so the list cannot rot). A path
in ``BUILT`` is what a command before it writes (``python -m build`` writes ``dist/``); a glob
must match a file of the repository. A ``.venv/bin/TOOL`` is there when the environment running
the tests has it, or when ``.ci/setup`` or the package's metadata installs it (a tool added by the
branch that added the line, before the environment was set up again). Nothing else is skipped."""

from __future__ import annotations

import ast
import configparser
import functools
import glob
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterator, List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: script names the docs use for a reader's own script (``python train.py``), not the repository's
USER_SCRIPTS = {"train.py"}
#: folders that a command writes before a later one reads them: none of them is in the repository
BUILT = ("dist/",)
#: the first word of a line that makes it a command to check
COMMAND = re.compile(r"^(?:\$ |!)?(?:%pip|pip3?|pytest|python3?|bash|\.venv[\w-]*/bin/\S+)(?:\s|$)")
#: a placeholder for the reader's own value: <version>, <catalog>, ... or …
PLACEHOLDER = re.compile(r"<[A-Za-z_][\w -]*>|\.\.\.|…")
#: fenced blocks whose every line is a command line
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "text"}


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    text: str


def _repo_files(pattern: str) -> List[str]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if os.path.exists(os.path.join(ROOT, line))]


def _markdown_commands(text: str, where: str) -> Iterator[Command]:
    fence = re.compile(r"^( *)```([\w-]*)[^\n]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
    prose = text
    for block in fence.finditer(text):
        first = text.count("\n", 0, block.start(3)) + 1
        language = block.group(2).lower()
        for offset, line in enumerate(block.group(3).splitlines()):
            line = line.strip()
            if language in SHELL_LANGUAGES or line.startswith(("%pip", "!")):
                if COMMAND.match(line):
                    yield Command(f"{where}:{first + offset}", line)
        prose = prose.replace(block.group(0), "\n" * block.group(0).count("\n"), 1)
    for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        words = " ".join(span.group(1).split())
        if COMMAND.match(words):
            yield Command(f"{where}:{prose.count(chr(10), 0, span.start()) + 1}", words)


def commands() -> List[Command]:
    found: List[Command] = []
    for path in _repo_files("*.md"):
        with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
            found += _markdown_commands(fh.read(), path)
    for path in _repo_files("*.ipynb"):
        with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
            cells = json.load(fh)["cells"]
        for number, cell in enumerate(cells):
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            where = f"{path} cell {number}"
            if cell["cell_type"] == "markdown":
                found += _markdown_commands(source, where)
            elif cell["cell_type"] == "code":
                found += [Command(where, line.strip()) for line in source.splitlines() if COMMAND.match(line.strip())]
    return found


# -- what the repository has ------------------------------------------------------------------------


def _user_path(path: str) -> bool:
    return os.path.isabs(path) or bool(PLACEHOLDER.search(path)) or path in USER_SCRIPTS or path.startswith(BUILT)


def _exists(path: str) -> bool:
    path = os.path.join(ROOT, path.split("::")[0])
    return bool(glob.glob(path)) if glob.has_magic(path) else os.path.exists(path)


@functools.lru_cache(maxsize=None)
def _setup_text() -> str:
    """What sets the project's environments up: ``.ci/setup`` and the package's metadata."""
    text = ""
    for name in (".ci/setup", "setup.cfg", "pyproject.toml"):
        if os.path.exists(os.path.join(ROOT, name)):
            with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
                text += fh.read()
    return text


@functools.lru_cache(maxsize=None)
def _script_options(path: str) -> tuple:
    """The option strings and the choices of each option of a script's ``add_argument`` calls
    (read from its source: nothing of it is run)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    options, choices = {"-h", "--help"}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
            options.update(names)
            for keyword in node.keywords:
                if keyword.arg == "choices" and isinstance(keyword.value, (ast.List, ast.Tuple)):
                    for name in names:
                        choices[name] = {ast.literal_eval(e) for e in keyword.value.elts}
    return frozenset(options), choices


@functools.lru_cache(maxsize=None)
def _pip_options(subcommand: str) -> frozenset:
    text = subprocess.run(
        [sys.executable, "-m", "pip", subcommand, "--help"], capture_output=True, text=True, check=True
    ).stdout
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))


@functools.lru_cache(maxsize=None)
def _markers() -> frozenset:
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    lines = config.get("tool:pytest", "markers", fallback="").strip().splitlines()
    return frozenset(line.split(":")[0].strip() for line in lines if line.strip())


@functools.lru_cache(maxsize=None)
def _collected(args: tuple) -> str:
    """What ``pytest --collect-only`` says of ``args`` (run in the repository's root)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stdout.strip().splitlines()
    # "N tests collected" (-q), or "path: N" per file when the command has its own -q (-qq)
    counts = [
        int(m.group(1)) for m in (re.match(r"^(\d+)(?:/\d+)? tests? (?:collected|selected)", x) for x in lines) if m
    ]
    counts += [int(m.group(1)) for m in (re.match(r"^\S+\.\w+: (\d+)$", x) for x in lines) if m]
    if proc.returncode != 0 or not sum(counts):
        last = lines[-1] if lines else proc.stderr.strip()[-300:]
        return f"collects nothing (exit {proc.returncode}): {last}"
    return ""


# -- the checks, one kind of command each --------------------------------------------------------------


def _words(text: str) -> List[List[str]]:
    """The simple commands of a line (split at ``&&``, ``||``, ``;``, ``|``; comments dropped),
    each as its words, placeholders kept whole."""
    keep = {}

    def hide(match):
        keep[f"PLACEHOLDER{len(keep)}"] = match.group(0)
        return f"PLACEHOLDER{len(keep) - 1}"

    lexer = shlex.shlex(re.sub(r"<[A-Za-z_][\w -]*>", hide, text), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out, current = [], []
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            out.append(current)
            current = []
        else:
            for name, value in keep.items():
                token = token.replace(name, value)
            current.append(token)
    return [words for words in out + [current] if words]


def _check_pytest(args: List[str]) -> List[str]:
    problems = []
    for option, expression in zip(args, args[1:] + [""]):
        if option == "-m":
            unknown = set(re.findall(r"[A-Za-z_]\w*", expression)) - {"and", "or", "not"} - _markers()
            problems += [f"-m names marker {name!r}, which setup.cfg does not register" for name in sorted(unknown)]
    paths = [a for a in args if not a.startswith("-") and ("/" in a or a.endswith((".py", ".ipynb")))]
    problems += [f"{path} is not in the repository" for path in paths if not _exists(path)]
    if not problems:  # the shell expands a glob before pytest sees it
        expanded = [
            match
            for a in args
            for match in (
                sorted(os.path.relpath(m, ROOT) for m in glob.glob(os.path.join(ROOT, a)))
                if a in paths and glob.has_magic(a)
                else [a]
            )
        ]
        problems += [p for p in [_collected(tuple(expanded))] if p]
    return problems


def _check_script(path: str, args: List[str]) -> List[str]:
    if _user_path(path):
        return []
    if not _exists(path):
        return [f"{path} is not in the repository"]
    options, choices = _script_options(path)
    problems, current = [], None
    for arg in args:
        if arg.startswith("-") and not re.match(r"^-\d", arg):
            current = arg.split("=", 1)[0]
            if current not in options:
                problems.append(f"{path} has no option {current} (it has {', '.join(sorted(options))})")
        elif current in choices and arg not in choices[current]:
            problems.append(f"{path} {current} takes {sorted(choices[current])}, not {arg!r}")
    if path == "notebooks/execute.py":  # its positional words name notebooks
        names = [a for a in args if not a.startswith("-")]
        problems += [f"execute.py selects no notebook by {n!r}" for n in names if not _notebooks_matching(n)]
    return problems


def _notebooks_matching(name: str) -> List[str]:
    every = sorted(n for n in os.listdir(os.path.join(ROOT, "notebooks")) if n.endswith(".ipynb"))
    return [n for n in every if n == name or n == f"{name}.ipynb" or n.startswith(name)]


def _check_pip(args: List[str]) -> List[str]:
    if not args:
        return []
    subcommand, rest = args[0], args[1:]
    options = _pip_options(subcommand)
    problems = [
        f"pip {subcommand} has no option {a}" for a in rest if a.startswith("-") and a.split("=")[0] not in options
    ]
    for arg in rest:
        if arg.startswith("-"):
            continue
        target = re.sub(r"\[[\w,-]+\]$", "", arg)  # an extra: ".[notebooks]"
        local = target.startswith((".", "/")) or "/" in target or target.endswith((".whl", ".tar.gz", ".txt"))
        if local and not _user_path(target) and not _exists(target):
            problems.append(f"{target} is not in the repository")
    return problems


def check(words: List[str]) -> List[str]:
    """What is wrong with one simple command (``[]``: nothing)."""
    head, args = words[0], words[1:]
    if head.startswith("$"):
        head, args = (args[0], args[1:]) if args else ("", [])
    head = head.lstrip("!")
    tool = head.rsplit("/", 1)[-1]
    if re.match(r"^\.venv[\w-]*/bin/", head):
        here = os.path.exists(os.path.join(os.path.dirname(sys.executable), tool))
        if not here and not re.search(rf"(?<![\w-]){re.escape(tool)}(?![\w-])", _setup_text()):
            return [f"{head}: the project's environment has no {tool}, and nothing installs it"]
    if head == "%pip" or tool in ("pip", "pip3"):
        return _check_pip(args)
    if tool == "pytest":
        return _check_pytest(args)
    if tool == "bash":
        return [] if not args or _user_path(args[0]) or _exists(args[0]) else [f"{args[0]} is not in the repository"]
    if re.match(r"^python[\d.]*$", tool):
        if not args or args[0] == "-c":
            return []
        if args[0] == "-m":
            module, rest = args[1], args[2:]
            if module == "pytest":
                return _check_pytest(rest)
            if module == "pip":
                return _check_pip(rest)
            if module.split(".")[0] == "torchdist_magic" and importlib.util.find_spec(module) is None:
                return [f"there is no module {module}"]
            return []
        return _check_script(args[0], args[1:])
    return []


@pytest.fixture(scope="module")
def found() -> List[Command]:
    return commands()


def test_commands_are_found_in_markdown_and_notebooks(found):
    """The finder sees the kinds of command the repository has (so a test over nothing cannot
    pass): README's three, the notebooks' README, the benchmarks' page, a notebook's ``%pip``."""
    where = {c.where.split(":")[0].split(" cell ")[0] for c in found}
    assert {"README.md", "notebooks/README.md", "docs/benchmarks/index.md"} <= where
    assert any(c.where.endswith(".ipynb") or ".ipynb cell" in c.where for c in found)
    texts = [c.text for c in found]
    assert any("pytest" in t for t in texts) and any("notebooks/run_quickstart.py" in t for t in texts)
    assert any(t.startswith("bash .ci/setup") for t in texts)


def test_every_written_command_names_what_exists(found):
    problems = [f"{c.where}: `{c.text}`: {p}" for c in found for words in _words(c.text) for p in check(words)]
    assert problems == [], "\n".join(problems)


def test_each_user_script_name_is_used():
    """``USER_SCRIPTS`` allows only what the docs use."""
    texts = " ".join(c.text for c in commands())
    assert [name for name in sorted(USER_SCRIPTS) if name not in texts] == []


@pytest.mark.parametrize(
    "text,problem",
    [
        ("python -m pytest notebooks -q", "collects nothing (exit 5)"),
        ("pytest -m 'spark and not slowest' tests/test_docs.py", "-m names marker 'slowest'"),
        ("pytest tests/test_nothing_here.py", "tests/test_nothing_here.py is not in the repository"),
        ("python notebooks/execute.py --output DIR", "notebooks/execute.py has no option --output"),
        ("python notebooks/execute.py 99", "execute.py selects no notebook by '99'"),
        ("python benchmarks/values.py --directions sideways", "--directions takes ['back', 'out'], not 'sideways'"),
        ("python benchmarks/nothing.py", "benchmarks/nothing.py is not in the repository"),
        ("bash .ci/nothing", ".ci/nothing is not in the repository"),
        ("%pip install --not-an-option torchdist_magic", "pip install has no option --not-an-option"),
        ("%pip install wheels/nothing.whl", "wheels/nothing.whl is not in the repository"),
        ("python -m torchdist_magic.nothing", "there is no module torchdist_magic.nothing"),
        (".venv/bin/no-such-tool --version", "the project's environment has no no-such-tool, and nothing installs"),
        ("pytest tests/test_nothing_*.py", "tests/test_nothing_*.py is not in the repository"),
    ],
)
def test_a_command_that_names_what_is_not_there_is_caught(text, problem):
    found = [p for words in _words(text) for p in check(words)]
    assert any(problem in p for p in found), found


@pytest.mark.parametrize(
    "text",
    [
        "%pip install /Volumes/<catalog>/<schema>/<volume>/torchdist_magic-<version>-py3-none-any.whl",
        "pip install dist/torchdist_magic-<version>-py3-none-any.whl",
        "python train.py --epochs 3",
        'pip install -e ".[notebooks]"',
        "%pip install ...",
        "python -m torchdist_magic.launch.remote SPEC RANK",
        "python notebooks/execute.py 01 11-first-errors.ipynb  # two of them",
        "pip install dist/*.whl && .venv/bin/python -m pytest -q tests/test_doc_l*.py",
    ],
)
def test_the_readers_own_files_and_what_exists_pass(text):
    assert [p for words in _words(text) for p in check(words)] == []
