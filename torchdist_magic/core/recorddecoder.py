"""The driver's compiled decoder of the records ranks send (``RecordDecoder``): msgspec's C
decoder reads a frame's JSON and builds each record's own dataclass (``events``), its fields
typed and checked as it goes, with no dict in between and no Python per field.

It reads the same JSON the ranks have always sent (``{"events": [record, ...]}``, each record an
object whose ``"type"`` names it), so a rank needs nothing new: only the driver's side imports
this module (and msgspec), a rank and a launcher encode with the standard library and decode the
driver's few records with ``recordcheck``.  Its guarantees are those of ``events.decode``: a
field of the wrong type, a missing field, an unknown type, columns that do not line up
(``Metrics.malformed``) are refused; a float is finite (msgspec's JSON has no ``NaN`` and refuses
a number out of a float's range); nothing is unpickled.

msgspec is the fast path, not a second judge: a record it does not take goes to
``events.decode`` (the contract's own check, ``recordcheck``), which refuses it with a message
that names the field, or takes the rare record that JSON allows and msgspec does not (a text
with a lone surrogate escape, ``"\\udc80"``).  So the channel accepts exactly what the contract
accepts, at msgspec's speed for the records that are well formed.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional

import msgspec

from . import events
from .recordcheck import MalformedEvent


class _Frame(msgspec.Struct):
    """A frame: its records, each as its JSON text (decoded one by one: a bad record costs
    itself, not its frame)."""

    events: List[msgspec.Raw]


class _Head(msgspec.Struct):
    """What a record is: its ``"type"`` (its other fields are skipped, not built)."""

    type: str


class RecordDecoder:
    """Decodes a channel frame's records (``frame``, then ``record`` for each); one per server
    (a decoder is used on one thread at a time)."""

    def __init__(self) -> None:
        self._frames = msgspec.json.Decoder(_Frame)
        self._heads = msgspec.json.Decoder(_Head)
        #: each record type's decoder by its name; a type whose fields must agree with each other
        #: (``malformed``) is checked after it
        self._decoders: Dict[str, Callable[[msgspec.Raw], events.Event]] = {
            name: msgspec.json.Decoder(cls).decode for name, cls in events.RECORDS.items()
        }
        self._agreeing = frozenset(name for name, cls in events.RECORDS.items() if hasattr(cls, "malformed"))

    def frame(self, body: bytes) -> Optional[list]:
        """The records of a frame's ``body``, for ``record``; ``None`` for a body that is not a
        JSON object with a list of records.  Each record is its JSON text, or, in a frame that
        msgspec's strict JSON does not take but Python's does (``NaN`` in a field no record has),
        its decoded value."""
        try:
            return self._frames.decode(body).events
        except Exception:  # noqa: BLE001  a ValidationError, a DecodeError, a RecursionError
            pass
        try:
            data = json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return None
        items = data.get("events") if isinstance(data, dict) else None
        return items if isinstance(items, list) else None

    def record(self, item: Any) -> events.Event:
        """The record ``item`` (one of ``frame``'s) holds; ``MalformedEvent`` for anything that is
        not a well-formed record (whatever it provokes: a peer must not stop the reader)."""
        try:
            kind = self._heads.decode(item).type
            record = self._decoders[kind](item)
        except Exception:  # noqa: BLE001  not taken: the contract's own check says why, or takes it
            return self._checked(item)
        if kind in self._agreeing:
            problem = record.malformed()  # type: ignore[attr-defined]  # the kinds in _agreeing have it
            if problem:
                raise MalformedEvent(f"{kind}: {problem}")
        return record

    @staticmethod
    def _checked(item: Any) -> events.Event:
        """``item`` decoded by ``events.decode``: the record, or its ``MalformedEvent``."""
        try:
            return events.decode(_value(item))
        except MalformedEvent:
            raise
        except Exception as exc:  # noqa: BLE001  json's own errors, and what a hostile record provokes
            raise MalformedEvent(f"not a record: {type(exc).__name__}") from None

    @staticmethod
    def kind_of(item: Any) -> object:
        """What ``item`` says it is (its ``"type"``), for a refusal's message; ``None`` if it
        says nothing readable."""
        try:
            data = _value(item)
        except Exception:  # noqa: BLE001  a refusal's message must not fail
            return None
        return data.get("type") if isinstance(data, dict) else None


def _value(item: Any) -> Any:
    """A frame's record as Python values (``json``'s): decoded from its text, or as it came."""
    return json.loads(bytes(item).decode("utf-8")) if isinstance(item, msgspec.Raw) else item
