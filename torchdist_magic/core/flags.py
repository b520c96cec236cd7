"""The ``%%torchdist`` flags: the argument parser generated from ``options.LaunchOptions``'
field metadata, and the options a parsed line gives (``parse_flags``, ``options_from_flags``)."""

from __future__ import annotations

import argparse
import shlex
from typing import List, Optional, Tuple

from .options import LaunchOptions, OptionError, option_fields


class FlagError(ValueError):
    """The magic's (or the panel's) flags could not be parsed."""


class _Switch(argparse.Action):
    """One of a field's two flags (``--tls``/``--no-tls``): sets it to ``const``; both at once
    contradict each other."""

    def __init__(self, option_strings, dest, const, pair, **kwargs):
        super().__init__(option_strings, dest, nargs=0, const=const, **kwargs)
        self.pair = pair

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) not in (None, self.const):
            parser.error(f"{self.pair[0]} and {self.pair[1]} contradict each other: give one")
        setattr(namespace, self.dest, self.const)


# -- flags ------------------------------------------------------------------------------------


def flag_specs() -> List[Tuple[tuple, dict]]:
    """``(args, kwargs)`` of every ``%%torchdist`` argument for ``argparse.add_argument``: one
    per ``LaunchOptions`` field, then the magic's own (shortcuts, ``--out``, ``--quiet``, the
    script).  ``None`` as a parsed value means "not given: use the configured default"."""
    specs: List[Tuple[tuple, dict]] = []
    for f in option_fields():
        meta = f.metadata
        kwargs: dict = {
            "help": meta["help"].replace("%", "%%"),
            "dest": f.name,
            "default": None,
        }  # argparse formats help
        if f.type in (bool, "bool") and "negative" not in meta:
            kwargs["action"] = "store_true"
        elif "negative" in meta:  # a switch: on, off, or (neither given) the default
            off, off_help = meta["negative"]
            pair = (meta["flag"], off)
            kwargs.update(action=_Switch, const=True, pair=pair)
            specs.append(((meta["flag"],), kwargs))
            kwargs = dict(kwargs, help=off_help.replace("%", "%%"), const=False)
            specs.append(((off,), kwargs))
            continue
        elif meta.get("repeat"):
            kwargs.update(action="append", metavar=meta.get("metavar"))
        else:
            kwargs.update(metavar=meta.get("metavar"), type=meta.get("type", str))
            if "choices" in meta:
                kwargs.update(choices=meta["choices"], metavar=None)
        specs.append(((meta["flag"],), kwargs))
    specs += [
        (
            ("--local",),
            {
                "dest": "local",
                "action": "store_true",
                "help": "run on local processes on this machine (same as --backend local)",
            },
        ),
        (
            ("--spark",),
            {"dest": "spark", "action": "store_true", "help": "run as a Spark barrier stage (same as --backend spark)"},
        ),
        (
            ("--out",),
            {
                "metavar": "NAME",
                "default": None,
                "help": "store rank 0's value in the notebook variable NAME instead of showing it",
            },
        ),
        (("--quiet",), {"action": "store_true", "help": "no live view and no summary: only the result or the error"}),
        (
            ("--data",),
            {
                "metavar": "NAME",
                "default": None,
                "help": "train on the DataFrame in the notebook variable NAME: a Spark DataFrame "
                "(--spark: each rank reads its share inside the executors) or a pandas "
                "DataFrame (--local: split by rows); the job reads its rows with "
                "torchdist_magic.shard(batch_size=...)",
            },
        ),
        (
            ("--columns",),
            {
                "metavar": "A,B",
                "default": None,
                "help": "with --data: only these columns of the DataFrame travel to the ranks",
            },
        ),
        (("script",), {"nargs": "?", "default": None, "help": "line form only: a .py file to run on every rank"}),
        (
            ("script_args",),
            {"nargs": argparse.REMAINDER, "help": "line form only: the script's command-line arguments"},
        ),
    ]
    return specs


class _FlagParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise FlagError(message)


def flag_parser(prog: str = "%torchdist") -> argparse.ArgumentParser:
    """An argparse parser of the flags that raises ``FlagError`` instead of exiting."""
    parser = _FlagParser(prog=prog, add_help=False)
    for args, kwargs in flag_specs():
        parser.add_argument(*args, **kwargs)
    return parser


def parse_flags(line: str, parser: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    """Flags with shell quoting (``--env 'A=x y'``); ``FlagError`` for anything wrong, including
    contradictory choices (``--local`` with ``--spark``)."""
    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise FlagError(f"cannot parse the flags: {exc}") from None
    args = (parser or flag_parser()).parse_args(argv)
    chosen = [f for f, on in (("--local", args.local), ("--spark", args.spark)) if on]
    if len(chosen) == 2:
        raise FlagError("--local and --spark contradict each other: give one")
    if chosen and args.backend is not None and args.backend != chosen[0][2:]:
        raise FlagError(f"{chosen[0]} and --backend {args.backend} contradict each other: give one")
    if chosen:
        args.backend = chosen[0][2:]
    return args


def options_from_flags(args: argparse.Namespace, defaults: LaunchOptions) -> LaunchOptions:
    """``LaunchOptions`` from parsed flags; a flag not given takes its value from ``defaults``
    (a repeatable one's entries add to the defaults', a key given again replacing its default).
        A refused value raises ``FlagError`` naming the flag."""
    values = {}
    for f in option_fields():
        given = getattr(args, f.name)
        if f.type in (bool, "bool") and "negative" not in f.metadata:
            given = True if given else None
        if f.metadata.get("repeat") and given is not None:  # the flags add to the %config defaults
            given = [f"{key}={value}" for key, value in getattr(defaults, f.name).items()] + list(given)
        values[f.name] = getattr(defaults, f.name) if given is None else given
    try:
        return LaunchOptions(**values)
    except OptionError as exc:
        raise FlagError(exc.for_flags()) from None
