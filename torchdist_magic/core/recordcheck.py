"""How a record is checked as it is decoded (``build``): a checker made once per field type, a
builder written once per record type as code of its own, and ``MalformedEvent`` for whatever is
not a well-formed record; and a record's fields as JSON values (``to_json_value``)."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Callable, Dict, Union


class MalformedEvent(ValueError):
    """A message that is not a well-formed record of this protocol."""


def to_json_value(value: Any) -> Any:
    """``value`` as JSON values: a dataclass (a record, a failure) as the object of its fields,
    by its type's encoder (``_encoder``, made once per type); lists and dicts copied, each item
    so; anything else as it is (``json`` refuses what it cannot carry)."""
    encode = _ENCODERS.get(type(value))
    if encode is not None:
        return encode(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        encode = _ENCODERS[type(value)] = _encoder(type(value))
        return encode(value)
    if isinstance(value, dict):
        return {k: to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    return value


#: field types whose values are JSON values as they are (or are refused by ``json`` as they are)
_PLAIN = {int, float, str, bool, typing.Optional[int], typing.Optional[float], typing.Optional[str]}
#: field types whose values are copied with one call (their items are plain)
_COPIED = {
    Dict[str, float]: "dict",
    Dict[str, int]: "dict",
    Dict[str, str]: "dict",
    Dict[str, Union[float, str]]: "dict",
    typing.List[str]: "list",
    typing.List[int]: "list",
    typing.List[float]: "list",
    typing.List[typing.List[typing.Optional[Union[float, str]]]]: "rows",
}
_ENCODERS: Dict[type, Callable[[Any], dict]] = {}


def _encoder(cls: type) -> Callable[[Any], dict]:
    """The function that makes a ``cls`` into the JSON object of its fields, written as code for
    ``cls`` (as ``_builder``): a plain field taken as it is, a dict of plain values copied, any
    other by ``to_json_value``.  Every rank encodes every record it sends with it, and a
    detached run's supervising process every record it journals."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # a dataclass whose annotations do not resolve: field by field
        hints = {}
    names = {"convert": to_json_value}
    items = []
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        if hint in _PLAIN:
            items.append(f"{f.name!r}: value.{f.name}")
        elif _COPIED.get(hint) == "rows":  # type: ignore[arg-type]  # a hint may be any object  # a list of lists of plain values: each row copied
            items.append(
                f"{f.name!r}: [list(row) for row in value.{f.name}] "
                f"if type(value.{f.name}) is list else convert(value.{f.name})"
            )
        elif hint in _COPIED:
            copy = _COPIED[hint]
            items.append(
                f"{f.name!r}: {copy}(value.{f.name}) if type(value.{f.name}) is {copy} else convert(value.{f.name})"
            )
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            items.append(
                f"{f.name!r}: [convert(item) for item in value.{f.name}] "
                f"if type(value.{f.name}) is list else convert(value.{f.name})"
            )
        else:
            items.append(f"{f.name!r}: convert(value.{f.name})")
    exec(f"def encode(value):\n    return {{{', '.join(items)}}}", names)  # noqa: S102  code made from the fields
    return names["encode"]


#: the JSON values each plain annotation takes
_JSON_TYPES: Dict[Any, tuple] = {float: (float, int), int: (int,), str: (str,), bool: (bool,)}


def _fail(where: str, expected: str, value: Any) -> MalformedEvent:
    return MalformedEvent(f"{where}: expected {expected}, got {value!r:.80}")


def checker(annotation: Any) -> Callable[[Any, str], Any]:
    """A function ``(value, where)`` that returns ``value`` if it has the type ``annotation``
    describes (recursively; floats as finite floats), else raises ``MalformedEvent`` naming
    ``where``.  Built once per annotation: decoding then costs no type introspection."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Union:
        options = [a for a in args if a is not type(None)]
        nullable = len(options) < len(args)
        if len(options) == 1:  # Optional[X]: X's own message says what is wrong
            inner = checker(options[0])

            def check_optional(value, where):
                return None if value is None else inner(value, where)

            return check_optional
        checks = [checker(option) for option in options]
        # the option a JSON value's own type points at is tried first (a float for
        # Union[float, str]), so that the common case costs one check
        likely: Dict[type, Callable] = {}
        for option, check in zip(options, checks):
            for kind in _JSON_TYPES.get(option, (typing.get_origin(option),)):
                likely.setdefault(kind, check)

        def check_union(value, where):
            if value is None and nullable:
                return None
            first = likely.get(type(value))
            if first is not None:
                try:
                    return first(value, where)
                except MalformedEvent:
                    pass
            for check in checks:
                try:
                    return check(value, where)
                except MalformedEvent:
                    continue
            raise MalformedEvent(f"{where}: {value!r} is none of {annotation}")

        return check_union
    if annotation is type(None):

        def check_none(value, where):
            if value is None:
                return None
            raise _fail(where, "NoneType", value)

        return check_none
    if annotation is bool:

        def check_bool(value, where):
            if isinstance(value, bool):
                return value
            raise _fail(where, "bool", value)

        return check_bool
    if annotation is int:

        def check_int(value, where):
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise _fail(where, "int", value)

        return check_int
    if annotation is float:

        def check_float(value, where):
            if isinstance(value, float) and value - value == 0.0:
                return value  # the common case: a finite float (inf - inf and nan - nan are nan)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    number = float(value)
                except OverflowError:  # an integer beyond any float
                    number = math.inf
                if math.isfinite(number):
                    return number
            raise _fail(where, "float", value)

        return check_float
    if annotation is str:

        def check_str(value, where):
            if isinstance(value, str):
                return value
            raise _fail(where, "str", value)

        return check_str
    if origin is list:
        item = checker(args[0])
        # a list of plain values (a column of metric values, the steps, the times) passes as it
        # came when every item is already what it must be: the items' types taken in one call, and
        # a column of floats found finite by its sum (nan or an infinity makes the sum so; a sum
        # that overflows looks again, item by item); a loop without calls otherwise
        kinds = set(typing.get_args(args[0]) or (args[0],))
        plain = kinds <= {float, int, str, type(None)}
        floats, ints, texts, nulls = float in kinds, int in kinds, str in kinds, type(None) in kinds
        allowed = frozenset(kinds)
        only_floats = {float}

        def check_list(value, where):
            if not isinstance(value, list):
                raise _fail(where, "list", value)
            if plain:
                found = {*map(type, value)}
                if found <= allowed:
                    if float not in found:
                        return value
                    if found == only_floats:
                        total = sum(value)
                        if total - total == 0.0:
                            return value
                for v in value:
                    kind = type(v)
                    if not (
                        (kind is float and floats and v - v == 0.0)
                        or (kind is int and ints)
                        or (kind is str and texts)
                        or (v is None and nulls)
                    ):
                        break
                else:
                    return value
            try:
                return [item(v, where) for v in value]
            except MalformedEvent:  # again, for the message: where the bad item is
                return [item(v, f"{where}[]") for v in value]

        return check_list
    if origin is dict:
        key_check, value_check = checker(args[0]), checker(args[1])
        # a dict of str to floats and texts (metric values, system samples) passes as it came
        # when every key is a str and every value a finite float or a str: one loop, no calls
        kinds = set(typing.get_args(args[1]) or (args[1],))
        plain, floats, texts = args[0] is str and kinds <= {float, str}, float in kinds, str in kinds

        def check_dict(value, where):
            if not isinstance(value, dict):
                raise _fail(where, "dict", value)
            if plain:
                for k, v in value.items():
                    kind = type(v)
                    if type(k) is not str or not (
                        (kind is float and floats and v - v == 0.0) or (kind is str and texts)
                    ):
                        break
                else:
                    return value
            out = {}
            for k, v in value.items():
                try:
                    out[key_check(k, where)] = value_check(v, where)
                except MalformedEvent:  # again, for the message: which key or which value
                    out[key_check(k, f"{where} key")] = value_check(v, f"{where}[{k!r}]")
            return out

        return check_dict
    if dataclasses.is_dataclass(annotation):

        def check_record(value, where):
            if isinstance(value, dict):
                return build(annotation, value, where)
            raise _fail(where, annotation.__name__, value)

        return check_record
    raise TypeError(f"no check for {annotation!r}")  # a record field of a type added above


def check(value: Any, annotation: Any, where: str) -> Any:
    """``value`` if it has the type ``annotation`` describes (recursively), else raise."""
    return checker(annotation)(value, where)


_BUILDERS: Dict[type, Callable[[dict, str], Any]] = {}


#: the field types whose check the code of ``_builder`` writes inline, as its common case
_INLINE_CHECKS = {
    int: "type({v}) is int",
    str: "type({v}) is str",
    bool: "type({v}) is bool",
    float: "type({v}) is float and {v} - {v} == 0.0",
}


def _builder(cls: type) -> Callable[[dict, str], Any]:
    """The function that builds a ``cls`` from its JSON object, checking every field; made once
    per record type (``typing.get_type_hints`` and the fields' checkers).

    It is written as code for ``cls`` (as ``dataclasses`` writes ``__init__``): one line per
    field, a plain field's common case (an int that is an int, a finite float) checked inline,
    its checker called only otherwise; a field that is absent takes its default.  A record type
    with a ``malformed()`` method (``Metrics``: columns that must line up) is refused when that
    says what is wrong with it.  A rank decodes the driver's records with it, and the driver's
    readers of records other than its channel (a journal, a Spark task's exit); the channel decodes
    with msgspec (``recorddecoder``) and leaves to it only what msgspec does not take."""
    hints = typing.get_type_hints(cls)
    own_where = getattr(cls, "type", "") or None
    names: Dict[str, Any] = {
        "cls": cls,
        "MISSING": dataclasses.MISSING,
        "MalformedEvent": MalformedEvent,
        "own_where": own_where,
    }
    lines = ["def build(data, where):", "    get = data.get"]
    args = []
    for i, f in enumerate(dataclasses.fields(cls)):
        v, check, path = f"v{i}", f"check{i}", f"path{i}"
        names[check] = checker(hints[f.name])
        names[path] = f"{own_where}.{f.name}"
        where = f"({path} if where == own_where else where + {'.' + f.name!r})"
        lines.append(f"    {v} = get({f.name!r}, MISSING)")
        lines.append(f"    if {v} is MISSING:")
        if f.default is not dataclasses.MISSING:
            names[f"default{i}"] = f.default
            lines.append(f"        {v} = default{i}")
        elif f.default_factory is not dataclasses.MISSING:
            names[f"factory{i}"] = f.default_factory
            lines.append(f"        {v} = factory{i}()")
        else:
            lines.append(f"        raise MalformedEvent(f\"{{where}}: missing field {f.name!r}\")")
        inline = _INLINE_CHECKS.get(hints[f.name])
        lines.append("    else:" if inline is None else f"    elif not ({inline.format(v=v)}):")
        lines.append(f"        {v} = {check}({v}, {where})")
        args.append(f"{f.name}={v}")
    if hasattr(cls, "malformed"):  # a record whose fields must agree with each other
        lines.append(f"    record = cls({', '.join(args)})")
        lines.append("    problem = record.malformed()")
        lines.append("    if problem:")
        lines.append('        raise MalformedEvent(f"{where}: {problem}")')
        lines.append("    return record")
    else:
        lines.append(f"    return cls({', '.join(args)})")
    exec("\n".join(lines), names)  # noqa: S102  code made above from the record's own fields
    return names["build"]


def builder(cls: type) -> Callable[[dict, str], Any]:
    """The function ``(data, where)`` that builds a ``cls`` from its JSON object, checking every
    field (``_builder``), made on first use."""
    build = _BUILDERS.get(cls)
    if build is None:
        build = _BUILDERS[cls] = _builder(cls)
    return build


def build(cls: type, data: dict, where: str):
    return builder(cls)(data, where)
