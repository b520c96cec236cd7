"""One rank's output lines on the driver, complete and in order across attempts (``LogStore``): the
newest lines in memory and older ones spilled to a file in the run's directory (``SpillFile``,
one for all of a run's ranks), so that the driver's memory stays flat however much a rank
prints.  A line that ends with ``\\r`` (a redrawn progress line) is replaced by the next line of
its stream, as on a terminal, so redraws do not pile up."""

from __future__ import annotations

import array
import bisect
import itertools
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

#: a rank's log keeps at most this many lines (and ``LOG_MEMORY_CHARS`` characters) in memory;
#: past that the older half goes to the rank's file
LOG_MEMORY_LINES = 20_000
LOG_MEMORY_CHARS = 8 * 1024 * 1024
#: ... and a run's, all ranks together, about this many lines (and characters): each rank gets
#: its share (at least ``MIN_LOG_LINES`` and ``MIN_LOG_CHARS``)
RUN_LOG_MEMORY_LINES = 400_000
RUN_LOG_MEMORY_CHARS = 64 * 1024 * 1024
MIN_LOG_LINES = 256
MIN_LOG_CHARS = 64 * 1024
#: a spilled line's file offset is remembered for every this many lines (to read a range)
SPILL_INDEX_EVERY = 1024


def memory_share(ranks: int) -> Tuple[int, int]:
    """The lines and characters of output each of a run's ``ranks`` ranks keeps in memory: its
    share of ``RUN_LOG_MEMORY_LINES`` and ``RUN_LOG_MEMORY_CHARS``, within the bounds above."""
    share = max(ranks, 1)
    return (
        min(LOG_MEMORY_LINES, max(MIN_LOG_LINES, RUN_LOG_MEMORY_LINES // share)),
        min(LOG_MEMORY_CHARS, max(MIN_LOG_CHARS, RUN_LOG_MEMORY_CHARS // share)),
    )


class LogLine(NamedTuple):
    """One line of a rank's output: its stream, its text, and whether it ended with ``\r`` (a
    redrawn progress line).  A tuple of plain values: a view reads thousands of them a refresh,
    and the collector stops looking at such a tuple once it has seen it."""

    stream: str
    text: str
    cr: bool = False


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


class _Heads(dict):
    """The head of a spilled line by ``(stream, cr)``: ``r`` or ``n``, the stream (no tab), a tab."""

    def __missing__(self, key: Tuple[str, bool]) -> str:
        stream, cr = key
        head = self[key] = f"{'r' if cr else 'n'}{stream.replace(chr(9), ' ')}\t"
        return head


#: a spilled line's head, text and end, one after the other (``zip`` stops at the shortest)
_chain = itertools.chain.from_iterable
_NEWLINES = itertools.repeat("\n")

_ESCAPED = re.compile(r"\\(.)")
_UNESCAPE = {"n": "\n", "r": "\r", "\\": "\\"}


def _unescape(text: str) -> str:
    return _ESCAPED.sub(lambda m: _UNESCAPE.get(m.group(1), m.group(1)), text) if "\\" in text else text


class SpillFile:
    """The file that one or more ``LogStore`` spill to (a run's ranks share one: ``RunState``),
    made under ``directory()`` when first written: a thousand ranks make one file, not a
    thousand (making a file cost the driver's channel thread a millisecond each).  Each spill
    is one block of lines; the store that wrote it keeps where it is."""

    def __init__(self, directory: Callable[[], str], name: str):
        self._directory = directory
        self._name = name
        self._file = None
        #: where the file is, once made
        self.path: Optional[str] = None
        self._size = 0

    def write(self, data: bytes) -> int:
        """Append ``data``; the offset it starts at."""
        if self._file is None:
            self.path = os.path.join(self._directory(), self._name)
            self._file = open(self.path, "ab")
            self._size = self._file.tell()
        at = self._size
        self._file.write(data)
        self._size += len(data)
        return at

    def reader(self):
        """A binary file to read what was written so far (``write`` is flushed first)."""
        self._file.flush()
        return open(self.path, "rb")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class LogStore:
    """One rank's output lines in order, as a read-only sequence of ``LogLine`` (``len``,
    indexing, slicing, iteration).  Recent lines are in memory; older ones are in ``spill`` (a
    ``SpillFile`` other stores may share), else in a file of its own, ``<name>.log`` under
    ``directory()`` (called on the first spill); read back when asked for.

    ``append`` replaces the stream's last line instead when that line ended with ``\\r`` (also
    when the other stream wrote in between): only a bar's latest state is kept.  A reader that
    keeps a cursor should read a trailing ``\\r``-line again later (``merged.LogCursor`` does).

    In memory a line is its text in one list and its kind, ``(stream, cr)``, in another: a
    tuple shared by every line of that kind, so that keeping a record's lines makes no object
    per line (``extend`` adds two runs of references) and a spill takes its texts as a slice;
    a line is made a ``LogLine`` when read.  Nothing the garbage collector tracks is made per
    line: the hundreds of thousands of lines a large run keeps do not make its collections
    longer (at 1024 ranks they were once four tenths of the driver's CPU time).
    """

    def __init__(
        self,
        directory: Callable[[], str],
        name: str,
        *,
        max_lines: Optional[int] = None,
        max_chars: Optional[int] = None,
        spill: Optional[SpillFile] = None,
    ):
        self._spill_file = SpillFile(directory, f"{name}.log") if spill is None else spill
        # lines and characters in memory at most; past that the older half spills (a RunState
        # gives each rank its share of the run's)
        self._max_lines = LOG_MEMORY_LINES if max_lines is None else max_lines
        self._max_chars = LOG_MEMORY_CHARS if max_chars is None else max_chars
        # the lines in memory: each one's text, and its kind (a tuple of _kinds')
        self._texts: List[str] = []
        self._kinds: List[Tuple[str, bool]] = []
        self._kind_of: Dict[Tuple[str, bool], Tuple[str, bool]] = {}  # (stream, cr): the one tuple of that kind
        self._first = 0  # index of _texts[0]
        self._chars = 0  # characters of the lines in memory
        # where spilled lines are in the file: the line index and file offset of each block's
        # first line and of every SPILL_INDEX_EVERY-th line (the lines from one to the next are
        # one after the other in the file)
        self._mark_lines = array.array("q")
        self._mark_offsets = array.array("q")
        self._sealed = False
        self._open_cr: Dict[str, int] = {}  # per stream: its last line's index, when it ended with \r
        self._heads = _Heads()

    def __len__(self) -> int:
        return self._first + len(self._texts)

    @property
    def spilled(self) -> int:
        """Lines that are in the file, not in memory."""
        return self._first

    def append(self, line: LogLine) -> None:
        self.add(line.stream, line.text, line.cr)

    def add(self, stream: str, text: str, cr: bool = False) -> None:
        """``append`` of the line ``(stream, text, cr)``."""
        key = (stream, cr)
        kind = self._kind_of.setdefault(key, key)
        at = self._open_cr.pop(stream, None)
        if at is not None and at >= self._first and not self._sealed:
            # the stream's redrawn line takes this line, also when another stream wrote between
            at -= self._first
            self._chars += len(text) - len(self._texts[at])
            self._texts[at] = text
            self._kinds[at] = kind
            if cr:
                self._open_cr[stream] = at + self._first
            return
        if self._sealed:
            self._open_cr.clear()
        self._sealed = False
        if cr:
            self._open_cr[stream] = len(self)
        self._texts.append(text)
        self._kinds.append(kind)
        self._chars += len(text)
        if len(self._texts) > self._max_lines or self._chars > self._max_chars:
            self._spill()

    def extend(self, stream: str, texts: List[str]) -> None:
        """``add`` of each of ``texts`` on ``stream``, in order, none of them redrawn (a ``Log``
        record's ``more``): kept in one step, not a line at a time."""
        if not texts:
            return
        if self._sealed or stream in self._open_cr:  # the first line may replace a redrawn one
            self.add(stream, texts[0])
            texts = texts[1:]
        key = (stream, False)
        self._texts += texts
        self._kinds += itertools.repeat(self._kind_of.setdefault(key, key), len(texts))
        self._chars += sum(map(len, texts))
        while (len(self._texts) > self._max_lines or self._chars > self._max_chars) and len(self._texts) > 1:
            self._spill()

    def seal(self) -> None:
        """The next line starts afresh (a new attempt): it never replaces the last one."""
        self._sealed = True

    def _spill(self) -> None:
        """Move the older half of the lines in memory (by count and size) to the file, in one
        write: the lines are joined and encoded together, not one by one, and escaped only
        when some line of them needs it (a spill is most of what a line costs the driver)."""
        count = len(self._texts) // 2
        if not count:  # one line alone over max_chars: it stays, as the newest line always does
            return
        texts = self._texts[:count]
        chars = sum(map(len, texts))
        if self._chars - chars > self._max_chars // 2:  # long lines: spill on, to half the size
            for text in self._texts[count:-1]:
                if self._chars - chars <= self._max_chars // 2:
                    break
                chars += len(text)
                count += 1
            texts = self._texts[:count]
        kinds = self._kinds[:count]
        joined = "\n".join(texts)
        if "\\" in joined or "\r" in joined or joined.count("\n") != count - 1:
            texts = [_escape(text) for text in texts]  # a line that holds \\, \r or \n
        # encoded in pieces, each from a line whose offset the index keeps to the next
        edges = sorted({0, count, *range(-self._first % SPILL_INDEX_EVERY, count, SPILL_INDEX_EVERY)})
        parts, size = [], 0
        for begin, stop in zip(edges, edges[1:]):
            self._mark_lines.append(self._first + begin)
            self._mark_offsets.append(size)
            text = self._spilled_text(kinds[begin:stop], texts[begin:stop])
            parts.append(text.encode("utf-8", "surrogatepass"))
            size += len(parts[-1])
        at = self._spill_file.write(b"".join(parts))
        for k in range(len(self._mark_offsets) - len(parts), len(self._mark_offsets)):
            self._mark_offsets[k] += at
        del self._texts[:count]
        del self._kinds[:count]
        self._first += count
        self._chars -= chars

    def _spilled_text(self, kinds: Sequence[Tuple[str, bool]], texts: Sequence[str]) -> str:
        """Lines as the file keeps them: each its head (``_Heads``), its escaped text and ``\\n``."""
        if kinds.count(kinds[0]) == len(kinds):  # lines of one kind (one stream, no redraws): one head
            head = self._heads[kinds[0]]
            return head + ("\n" + head).join(texts) + "\n"
        return "".join(_chain(zip(map(self._heads.__getitem__, kinds), texts, _NEWLINES)))

    def _read_spilled(self, start: int, stop: int) -> Iterator[Tuple[str, str, bool]]:
        """``(stream, text, cr)`` of the spilled lines ``start <= i < stop``."""
        stop = min(stop, self._first)
        if start >= stop:
            return
        marks = self._mark_lines
        k = bisect.bisect_right(marks, start) - 1
        with self._spill_file.reader() as fh:
            while k < len(marks) and marks[k] < stop:
                fh.seek(self._mark_offsets[k])
                i = marks[k]
                until = min(marks[k + 1] if k + 1 < len(marks) else self._first, stop)
                while i < until:
                    raw = fh.readline()
                    if i >= start:
                        line = raw.decode("utf-8", "surrogatepass")
                        stream, _, body = line[1:-1].partition("\t")
                        yield stream, _unescape(body), line[0] == "r"
                    i += 1
                k += 1

    def __getitem__(self, key: Union[int, slice]):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("a log is sliced with step 1 only")
            out = [LogLine(*fields) for fields in self._read_spilled(start, stop)]
            return out + self._lines(max(start - self._first, 0), max(stop - self._first, 0))
        index = key + len(self) if key < 0 else key
        if not 0 <= index < len(self):
            raise IndexError("log line index out of range")
        if index >= self._first:
            (stream, cr), text = self._kinds[index - self._first], self._texts[index - self._first]
            return LogLine(stream, text, cr)
        return LogLine(*next(self._read_spilled(index, index + 1)))

    def __iter__(self) -> Iterator[LogLine]:
        return iter(self[:])

    def recent(self, limit: int) -> List[LogLine]:
        """Up to ``limit`` of the newest lines, from memory only (what a view scans)."""
        return self._lines(max(len(self._texts) - limit, 0), len(self._texts)) if limit > 0 else []

    def _lines(self, start: int, stop: int) -> List[LogLine]:
        """The lines in memory ``start:stop`` (indices into memory), as ``LogLine``."""
        return [
            LogLine(stream, text, cr) for (stream, cr), text in zip(self._kinds[start:stop], self._texts[start:stop])
        ]

    def text(self, start: int = 0, stop: Optional[int] = None) -> str:
        """Lines ``start:stop`` as the rank wrote them (``\\n`` or ``\\r`` after each)."""
        start, stop, _ = slice(start, stop).indices(len(self))
        chunks: List[str] = []
        part: List[str] = []
        for _stream, text, cr in self._read_spilled(start, stop):
            part += (text, "\r" if cr else "\n")
            if len(part) >= 2 * SPILL_INDEX_EVERY:  # joined as it goes: a spilled log can be large
                chunks.append("".join(part))
                part = []
        chunks.append("".join(part))
        start, stop = max(start - self._first, 0), max(stop - self._first, 0)
        chunks += [
            text + ("\r" if cr else "\n")
            for (_stream, cr), text in zip(self._kinds[start:stop], self._texts[start:stop])
        ]
        return "".join(chunks)

    def close(self) -> None:
        """Close the file this store spills to (a shared one: for every store)."""
        self._spill_file.close()


@dataclass(frozen=True)
class LogRead:
    """Lines of one rank's log read at one moment: ``lines`` are those from index ``start`` on;
    the log held ``total`` lines then and the rank was in ``state``."""

    rank: int
    start: int
    lines: List[LogLine]
    total: int
    state: str

    @property
    def stop(self) -> int:
        """The index after the last line read."""
        return self.start + len(self.lines)
