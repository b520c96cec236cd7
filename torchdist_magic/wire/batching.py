"""What a rank sends, in batches: the records a client gathers (``GATHERED``) for ``FLUSH_EVERY``,
each progress bar's newest update only, a rank's metric points and log lines merged into one
record each, packed into as few frames as fit (``encode_batch``): the driver's cost is per batch
more than per record."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple, cast

from ..core import events
from .frames import LENGTH, MAX_FRAME

#: records a client sends in one batch at most (progress updates are coalesced within a batch,
#: metric points merged into one record)
BATCH = 10_000
#: how long a client gathers records before it sends them, as one batch: a rank's sender thread
#: wakes (and takes the interpreter from the training loop) ten times a second, not once a record,
#: and the driver gets few large frames rather than many small ones
FLUSH_EVERY = 0.1
#: from this many ranks a client gathers for ``FLUSH_EVERY_LARGE`` instead: the driver's work
#: is per batch more than per record, and a thousand ranks' batches ten times a second keep a
#: core busy (``benchmarks/scale.py``); a record waits at most that much longer
LARGE_RUN_RANKS = 256
FLUSH_EVERY_LARGE = 0.25


def flush_every(world_size: int) -> float:
    """How long a client of a run of ``world_size`` ranks gathers records before it sends them."""
    return FLUSH_EVERY_LARGE if world_size >= LARGE_RUN_RANKS else FLUSH_EVERY


#: the records a client gathers for ``FLUSH_EVERY``: those a rank sends many of.  Any other
#: (``Started``, ``Exit``, a warm job's end) goes at once, with whatever was gathered before it
GATHERED = (events.Progress, events.Metrics, events.Log)


def encode_batch(records: List[events.Event], rank: int, dropped: int = 0) -> bytes:
    """The frames that carry ``records`` of ``rank`` (progress coalesced, ``_coalesce``), and a
    ``Dropped`` record for ``dropped`` plus those JSON cannot carry; ``b""`` for nothing."""
    parts = []
    for record in merge_logs(_merge_metrics(_coalesce(records))):
        part = _encoded(record)
        if part is None and type(record) is events.Metrics and len(record.steps) > 1:  # only the bad points are lost
            pieces = [_encoded(events.Metrics.point(record.rank, p.step, p.values, p.time)) for p in record.points()]
            dropped += pieces.count(None)
            parts += [piece for piece in pieces if piece is not None]
        elif part is None and type(record) is events.Log and record.more:  # only the lines too long to send
            pieces = [
                _encoded(events.Log(rank=record.rank, stream=o.stream, line=o.line, cr=o.cr)) for o in record.lines()
            ]
            dropped += pieces.count(None)
            parts += [piece for piece in pieces if piece is not None]
        elif part is None:
            dropped += 1
        else:
            parts.append(part)
    if dropped:
        parts.append(events.dumps(events.Dropped(rank=rank, count=dropped)).encode("utf-8"))
    return _pack(parts) if parts else b""


def _encoded(record: events.Event) -> Optional[bytes]:
    """The JSON of ``record``; ``None`` when JSON cannot carry it (nan, an object) or it would
    not fit a frame."""
    try:
        part = events.dumps(record).encode("utf-8")
    except (TypeError, ValueError):
        return None
    return part if len(part) <= MAX_FRAME - 16 else None


def _pack(parts: List[bytes]) -> bytes:
    """Encoded records as ``{"events": [...]}`` frames of at most ``MAX_FRAME`` bytes."""
    frames: List[bytes] = []
    chunk: List[bytes] = []
    size = 0
    for part in parts:
        if chunk and size + len(part) + 16 > MAX_FRAME:
            frames.append(_events_frame(chunk))
            chunk, size = [], 0
        chunk.append(part)
        size += len(part) + 1
    if chunk:
        frames.append(_events_frame(chunk))
    return b"".join(frames)


def _events_frame(parts: List[bytes]) -> bytes:
    body = b'{"events":[' + b",".join(parts) + b"]}"
    return LENGTH.pack(len(body)) + body


def _coalesce(records: List[events.Event]) -> List[events.Event]:
    """Keep only the newest update of each progress bar; everything else in order."""
    newest = {}
    for i, record in enumerate(records):
        if isinstance(record, events.Progress):
            newest[(record.rank, record.bar)] = i
    return [r for i, r in enumerate(records) if not isinstance(r, events.Progress) or newest[(r.rank, r.bar)] == i]


def _merge_metrics(records: List[events.Event]) -> List[events.Event]:
    """The ``Metrics`` records of each rank as one, at the place of its first (its points in
    the order they were reported, its names in the order they first came, ``None`` where a point
    lacks a name): the driver decodes and applies one record per flush, not one per
    ``report()``.  Metrics only move ahead of other records, never behind."""
    out: List[events.Event] = []
    heads: Dict[int, int] = {}  # rank: index in out of its first Metrics
    # index in out of a merged copy (the sender's records stay as they were): its columns by name
    columns: Dict[int, Dict[str, list]] = {}
    for record in records:
        if type(record) is not events.Metrics:
            out.append(record)
            continue
        record = cast(events.Metrics, record)  # for the type checker, which reads no `type() is`
        at = heads.get(record.rank)
        if at is None:
            heads[record.rank] = len(out)
            out.append(record)
            continue
        merged = cast(events.Metrics, out[at])
        by_name = columns.get(at)
        if by_name is None:
            merged = out[at] = dataclasses.replace(
                merged,
                names=list(merged.names),
                steps=list(merged.steps),
                times=list(merged.times),
                values=[list(column) for column in merged.values],
            )
            by_name = columns[at] = dict(zip(merged.names, merged.values))
        before = len(merged.steps)
        merged.steps += record.steps
        merged.times += record.times
        for name, column in zip(record.names, record.values):
            into = by_name.get(name)
            if into is None:  # a name the earlier points lack
                into = by_name[name] = [None] * before
                merged.names.append(name)
                merged.values.append(into)
            into += column
        after = len(merged.steps)
        for into in merged.values:  # a name these points lack
            if len(into) < after:
                into += [None] * (after - len(into))
    return out


#: the most text ``merge_logs`` puts into one record (far below ``MAX_FRAME``)
MERGED_LOG_CHARS = 64 * 1024


def merge_logs(records: List[events.Event]) -> List[events.Event]:
    """Each run of a rank's ``Log`` records on one stream as one (its lines in order, the later
    ones in ``more``), at the place of the run's first: the driver decodes and applies one record
    per flush, not one per line.  A run ends at a line of the rank's other stream, at a redrawn
    line (``cr``: it starts the next run), at ``MERGED_LOG_CHARS``, and at any record but
    progress and metrics (a warm job's ``OutputEnd``, an ``Exit``), so no line ever crosses
    another line of the rank, nor such a record."""
    out: List[events.Event] = []
    heads: Dict[int, Tuple[int, int]] = {}  # rank: (index in out of its open Log, its text so far)
    copied = set()  # indices in out of merged copies (the sender's records stay as they were)
    for record in records:
        kind = type(record)
        if kind is not events.Log:
            if kind is not events.Progress and kind is not events.Metrics:
                heads.clear()
            out.append(record)
            continue
        record = cast(events.Log, record)  # for the type checker, which reads no `type() is`
        head = heads.get(record.rank)
        size = len(record.line) + sum(map(len, record.more))
        if (
            head is None
            or record.cr
            or cast(events.Log, out[head[0]]).stream != record.stream
            or head[1] + size > MERGED_LOG_CHARS
        ):
            heads[record.rank] = (len(out), size)
            out.append(record)
            continue
        at, text = head
        if at not in copied:
            copied.add(at)
            opened = cast(events.Log, out[at])
            out[at] = dataclasses.replace(opened, more=list(opened.more))
        merged = cast(events.Log, out[at])
        merged.more.append(record.line)
        merged.more += record.more
        heads[record.rank] = (at, text + size)
    return out
