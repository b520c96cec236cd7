"""IPython syntax in a ``%%torchdist`` cell as both sides read it: which magics the ranks run,
``%timeit``'s options, the expressions ``!cmd`` and magic lines expand, and what a refusal says.
The driver checks and translates a cell with these (``capture``); the rank runs it with
them (``rank.shell``)."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

#: the magics a rank runs, without their ``%``
LINE_MAGICS = ("time", "timeit", "env", "cd", "pip")
CELL_MAGICS = ("time", "timeit")
#: what a cell may use, in words, for error messages
SUPPORTED = "!cmd, x = !cmd, %time, %%time, %timeit, %%timeit, %env, %cd and %pip"
TIMEIT_DEFAULT_REPEAT = 7
TIME_TAKES_NO_ARGUMENTS = "nothing can follow %%time on its line; the code it times goes on the lines below it"


class _Expander(string.Formatter):
    """IPython's expansion of ``!cmd`` and magic lines: ``{expression}`` is evaluated, and so is
    ``$name`` (or ``$name.attr``) outside single quotes; ``$$`` is a literal ``$``."""

    _dollar = re.compile(r"(.*?)\$(\$?[\w.]+)(?=([^']*'[^']*')*[^']*$)")

    def parse(self, text: str) -> Iterator[Tuple[str, Optional[str], Optional[str], Optional[str]]]:
        for literal, field, spec, conversion in super().parse(text):
            kept, end = "", 0
            for match in self._dollar.finditer(literal):
                before, name = match.group(1, 2)
                if name.startswith("$"):
                    kept += before + name
                else:
                    yield kept + before, name, "", None
                    kept = ""
                end = match.end()
            yield kept + literal[end:], field, spec, conversion

    def vformat(self, text: str, args: Any, kwargs: Any) -> str:
        out = []
        for literal, field, spec, conversion in self.parse(text):
            out.append(literal)
            if field is not None:
                # as in IPython, a ':' is part of the expression ({items[1:3]}), never a format spec
                value = eval(f"{field}:{spec}" if spec else field, dict(kwargs))
                out.append(self.format_field(self.convert_field(value, conversion), ""))
        return "".join(out)


EXPANDER = _Expander()


def expansions(text: str) -> List[str]:
    """The Python expressions that expanding ``text`` evaluates (``capture`` sends what they read)."""
    try:
        return [f"{field}:{spec}" if spec else field for _, field, spec, _ in EXPANDER.parse(text) if field is not None]
    except ValueError:  # unbalanced braces: the line is used as it is
        return []


@dataclass
class TimeitOptions:
    """``%timeit``'s options: ``number`` loops per measurement (0: chosen), ``repeat``
    measurements, ``precision`` digits, ``quiet`` (print nothing), ``result`` (return a
    ``TimeitResult``)."""

    number: int = 0
    repeat: int = TIMEIT_DEFAULT_REPEAT
    precision: int = 3
    quiet: bool = False
    result: bool = False


_TIMEIT_VALUES = {"n": "number", "r": "repeat", "p": "precision"}
_TIMEIT_FLAGS = {"q": "quiet", "o": "result"}


def parse_timeit(line: str) -> Tuple[TimeitOptions, int]:
    """``%timeit``'s options and where its statement starts in ``line`` (options come first, as
    in ``-n 10 -r 3 f(x)``; ``--`` ends them).  ``ValueError`` says what is wrong."""
    options = TimeitOptions()
    tokens = [(m.group(), m.start()) for m in re.finditer(r"\S+", line)]
    i = 0
    while i < len(tokens) and re.match(r"-[A-Za-z-]", tokens[i][0]):
        token = tokens[i][0]
        i += 1
        if token == "--":
            break
        letters = token[1:]
        while letters:
            letter, letters = letters[0], letters[1:]
            if letter in _TIMEIT_FLAGS:
                setattr(options, _TIMEIT_FLAGS[letter], True)
                continue
            if letter not in _TIMEIT_VALUES:
                raise ValueError(f"unknown %timeit option -{letter} (the ranks know -n N, -r R, -p P, -q and -o)")
            if not letters:
                if i == len(tokens):
                    raise ValueError(f"%timeit -{letter} needs a number")
                letters = tokens[i][0]
                i += 1
            if not letters.isdigit() or int(letters) < 1:
                raise ValueError(f"%timeit -{letter} needs a whole number of at least 1, got {letters!r}")
            setattr(options, _TIMEIT_VALUES[letter], int(letters))
            letters = ""
    start = tokens[i][1] if i < len(tokens) else len(line)
    return options, start


def unsupported(magic: str) -> str:
    """Why ``magic`` (with its ``%`` or ``%%``) cannot run on a rank."""
    return (
        f"{magic} cannot run on the ranks (they run without IPython); a %%torchdist cell can use "
        f"{SUPPORTED}. Run {magic} in a cell of its own."
    )
