"""A rank's value at memory speed: one file (or one blob), its pickle stream and its large
buffers apart.

A model's weights are a few large arrays.  Pickled the usual way they are copied into the pickle
stream, written, read back into another bytes object and copied again into new tensors: four
passes over every byte, each at pickle's pace.  Here the value is pickled with protocol 5 and
out-of-band buffers (PEP 574): NumPy arrays give theirs by themselves, and every dense tensor is
reduced to its storage's raw bytes, once per storage, and its shape, strides and offset in it
(``_tensor_from_storage``), so that views and tied weights share their storage again.  The blob is

    MAGIC | 8-byte length of the header | header (JSON: sizes) | pickle stream | buffers

each buffer aligned to ``ALIGN`` bytes.  Writing streams each buffer straight from the tensor's
memory to the file, from one thread: the system takes the file's lock for each write, so that
threads writing pieces of one file take turns (two to four of them were no faster here, 2 GiB
into shared memory in 0.75 s either way when the machine was quiet; what made it slower at
times, up to 3.6 s, was a busy host, whichever the count; ``benchmarks/value_writers.py``).
Reading fills one ``bytearray`` with the whole file (a plain read, at the speed of the page
cache) and the loaded tensors and arrays are views into it: the driver holds the value once,
plus the small pickle stream.  (A view of a small part of a large storage brings the whole
storage, as ``torch.save`` does.)

The same machinery carries values the other way, out to the ranks (``Buffers``): the notebook
values a cell uses and ``run()``'s arguments are pickled with their large buffers apart; on the
driver those are views of the values' own memory, written once per run into one file in shared
memory, which every rank on the machine maps (``Buffers.load``).  The driver writes that file
while its ranks start (``FileWriter``: a thread of its own, holding the file's ``flock``, which a
rank that wants the file first waits for; the file is in a directory of the driver's that no
other user may enter): 1 GiB into shared memory takes about 0.35 s here, a
rank's start (Python, torch) about 1 s.  Where the ranks are on other machines, each machine
fetches that file once from the driver into its own shared memory (``hostcopy``), and its ranks
map that copy (``Buffers.fetched``): exactly the file their launcher fetched or found whole
before it started them (``names.VALUES_COPY_ENV``), never a path a rank guesses, checked once
open (``_open_host_copy``: not through a link, this user's, the size and header the job's sizes
give) and never waited for (it is whole before the rank starts: no ``flock``).

Nothing here imports torch unless the value holds a tensor.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import json
import marshal
import mmap
import os
import pickle
import socket
import stat
import struct
import tempfile
import threading
import types
import weakref
from typing import Any, Iterator, List, Optional, Tuple, Union

from .names import VALUES_COPY_ENV
from .privdir import UnsafePath, check_private, inside, open_private, user_path

MAGIC = b"torchdist-value-1\n"
#: what a file of values sent to the ranks holds instead when the driver could not write it,
#: followed by the reason (``FileWriter``)
UNWRITTEN = b"torchdist-value-unwritten\n"
ALIGN = 64
_LEN = struct.Struct("<Q")
#: bytes per read or write call: one call of more than 2 GiB may be cut short by the system
CHUNK = 1 << 30
#: values sent to the ranks whose large buffers come to at least this travel in a file of their
#: own (``Buffers.write``) where the ranks share the driver's machine; below it, in the job
APART_BYTES = 1 << 20
#: the name of that file in the run's value directory
SENT_FILE = "sent.values"
#: where a machine keeps files in memory (tmpfs): a fetched copy of the values goes there
#: where the machine has room for it (``host_copy_path``)
SHARED_MEMORY = "/dev/shm"

Blob = Union[bytes, bytearray, memoryview, mmap.mmap]


def _pad(n: int) -> int:
    return -n % ALIGN


def _code_from_marshal(data: bytes) -> types.CodeType:
    """A code object as ``_SourcePickler`` sent it (its file name and line numbers whole)."""
    return marshal.loads(data)


@functools.lru_cache(maxsize=None)
def _source_pickler_class():
    import cloudpickle

    class SourcePickler(cloudpickle.Pickler):
        """cloudpickle whose code objects keep the file they come from.

        cloudpickle 3.1.3 and later write ``co_filename = "<dynamic-code>"`` into every code
        object they send by value, so that a rank's traceback and stack through a function of
        the notebook, of a helper module or of a test file would name no file and show no source
        line.  Code objects go as ``marshal`` writes them instead: whole, with their file name
        and line table.  (marshal's format is Python's own: the ranks run the notebook's Python
        version, which the Spark check stage compares, as cloudpickle's byte code needs too.)
        This uses only cloudpickle's public ``Pickler`` and pickle's ``reducer_override``."""

        def reducer_override(self, obj):
            if type(obj) is types.CodeType:
                return _code_from_marshal, (marshal.dumps(obj),)
            return super().reducer_override(obj)

    return SourcePickler


@functools.lru_cache(maxsize=None)
def _pickler_class(cpu_only: bool = False):
    class ValuePickler(_source_pickler_class()):  # type: ignore[misc]  # cloudpickle's class, made on first use
        """``SourcePickler`` (functions and classes of the notebook by value, with their files)
        with the bytes of tensors' storages out of band, each storage once; ``cpu_only``:
        tensors on other devices are left to torch's own pickling (a notebook's CUDA tensor
        reaches a rank on CUDA, as before)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._storages: dict = {}

        def reducer_override(self, obj):
            if type(obj).__module__ == "torch" or type(obj).__name__ == "Parameter":
                reduced = _reduce_tensor(obj, self._storages, cpu_only)
                if reduced is not None:
                    return reduced
            return super().reducer_override(obj)

    return ValuePickler


@contextlib.contextmanager
def _sent_by_value(modules: Optional[list]) -> Iterator[None]:
    """cloudpickle sends the functions and classes of ``modules`` by value meanwhile (modules
    the ranks cannot be assumed to import: a test file, a helper next to the notebook)."""
    import cloudpickle

    registered = []
    try:
        for m in modules or ():
            if m is not None and m.__name__ not in cloudpickle.list_registry_pickle_by_value():
                cloudpickle.register_pickle_by_value(m)
                registered.append(m)
        yield
    finally:
        for m in registered:
            cloudpickle.unregister_pickle_by_value(m)


def pickle_for_ranks(value: Any, by_value: Optional[list] = None) -> bytes:
    """``value``'s pickle stream, every buffer in it: what the ranks read a job from, and how
    the driver checks that a value can be sent.  Functions and classes defined in the notebook,
    and those of the ``by_value`` modules, travel by value, each code object with its file name
    (``SourcePickler``).  The one way this package pickles for the ranks, with ``pickled_apart``."""
    stream = io.BytesIO()
    with _sent_by_value(by_value):
        _source_pickler_class()(stream, protocol=5).dump(value)
    return stream.getvalue()


class _Storage:
    """A tensor storage's bytes, pickled out of band; one per storage, so that the tensors
    that share it (views, tied weights) share it again when loaded.  ``tensors``: each tensor
    pickled on it, as ``(weak reference, version counter)``, which tell the driver whether the
    storage may have changed since (``Buffers.marks``)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.tensors: List[Tuple[Any, int]] = []

    def __reduce__(self):
        return (_storage_from_buffer, (pickle.PickleBuffer(self.raw),))


def _reduce_tensor(obj, storages: dict, cpu_only: bool = False):
    """``(_tensor_from_storage, args)`` for a dense tensor (on any device: it comes back on the
    CPU, as ``torch.save`` with ``map_location="cpu"`` gives it); ``None`` for anything else,
    which torch pickles itself."""
    import torch

    if not isinstance(obj, torch.Tensor) or type(obj) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if obj.layout != torch.strided or obj.is_quantized or obj.is_nested or obj.device.type == "meta":
        return None
    if cpu_only and obj.device.type != "cpu":
        return None
    storage = obj.untyped_storage()
    key = (obj.device.type, obj.device.index, storage.data_ptr(), storage.nbytes())
    if key not in storages:
        cpu = storage if obj.device.type == "cpu" else storage.cpu()
        raw = torch.empty(0, dtype=torch.uint8).set_(cpu).numpy()
        storages[key] = _Storage(raw)
    if obj.device.type == "cpu" and not obj.is_inference():  # an inference tensor has no version counter
        storages[key].tensors.append((weakref.ref(obj), obj._version))
    return (
        _tensor_from_storage,
        (
            storages[key],
            str(obj.dtype).split(".", 1)[1],
            tuple(obj.shape),
            tuple(obj.stride()),
            obj.storage_offset(),
            obj.requires_grad,
            isinstance(obj, torch.nn.Parameter),
        ),
    )


def _storage_from_buffer(buffer):
    import torch

    view = memoryview(buffer).cast("B")
    return torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else torch.empty(0, dtype=torch.uint8)


def _tensor_from_storage(storage, dtype: str, shape, stride, offset: int, requires_grad: bool, parameter: bool):
    import torch

    kind = getattr(torch, dtype)
    tensor = torch.empty(0, dtype=kind).set_(storage.untyped_storage(), offset, shape, stride)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _pickled(value: Any, cpu_only: bool = False) -> Tuple[bytes, List[memoryview]]:
    """The pickle stream of ``value`` and its out-of-band buffers (as raw memoryviews)."""
    stream, raws, _ = _pickled_marked(value, cpu_only)
    return stream, raws


def _pickled_marked(value: Any, cpu_only: bool = False) -> Tuple[bytes, List[memoryview], List[Optional["Mark"]]]:
    """``_pickled``, with each buffer's ``Mark`` (``None`` for one that is not a CPU tensor's
    storage with a version counter: a NumPy array's, whose changes nothing counts)."""
    buffers: List[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    pickler = _pickler_class(cpu_only)(stream, protocol=5, buffer_callback=buffers.append)
    pickler.dump(value)
    raws = [b.raw() for b in buffers]
    by_array = {id(s.raw): s for s in pickler._storages.values() if s.tensors}
    marks: List[Optional[Mark]] = []
    for raw in raws:
        storage = by_array.get(id(raw.obj))
        marks.append(Mark(raw, storage.tensors) if storage is not None else None)
    return stream.getvalue(), raws, marks


class Mark:
    """What tells, at the next run, that a tensor storage sent to the ranks has not changed:
    the tensors pickled on it are the same objects (alive), at the same version counter (every
    in-place change of a tensor bumps it, torch's own check for autograd), on the same memory.
    A write torch does not count (through ``.numpy()``, ``.data``, a NumPy array the tensor
    shares) is not seen by these; ``fingerprint`` looks at a sample of the bytes for that."""

    def __init__(self, raw: memoryview, tensors: List[Tuple[Any, int]]):
        self.address = _address(raw)
        self.nbytes = raw.nbytes
        self.tensors = list(tensors)

    def holds(self, raw: memoryview) -> bool:
        """Whether ``raw`` (a buffer of a later pickling) is this storage, unchanged by torch."""
        if self.address == -1 or _address(raw) != self.address or raw.nbytes != self.nbytes:
            return False
        for ref, version in self.tensors:
            tensor = ref()
            if tensor is None or tensor._version != version:
                return False
        return True


def _address(raw: memoryview) -> int:
    """Where ``raw``'s bytes are, by the NumPy array that exported it (a tensor storage's raw
    bytes are one: ``_reduce_tensor``); -1 for any other buffer."""
    interface = getattr(raw.obj, "__array_interface__", None)
    return int(interface["data"][0]) if interface is not None else -1


#: ``fingerprint`` reads this many bytes of every ``FINGERPRINT_STEP``
FINGERPRINT_BLOCK = 4096
FINGERPRINT_STEP = 64 * 1024


def fingerprint(raws: List[memoryview]) -> int:
    """A CRC-32 of a sixteenth of ``raws``' bytes (4 KiB of every 64 KiB, and each buffer's last
    4 KiB): about 10 ms a GiB.  It sees a change of most of the bytes made behind torch's back
    (a NumPy array the tensor shares, filled again), not a change of a few."""
    import zlib

    crc = 0
    for raw in raws:
        view = raw.cast("B") if raw.format != "B" or raw.ndim != 1 else raw
        size = view.nbytes
        for start in range(0, size, FINGERPRINT_STEP):
            crc = zlib.crc32(view[start : start + FINGERPRINT_BLOCK], crc)
        if size > FINGERPRINT_BLOCK:
            crc = zlib.crc32(view[size - FINGERPRINT_BLOCK :], crc)
    return crc


def _header(stream: bytes, raws: List[memoryview]) -> bytes:
    return _header_of(len(stream), [r.nbytes for r in raws])


def _header_of(stream_size: int, sizes: List[int]) -> bytes:
    """The start of a blob (its mark, the header's length, the header) whose pickle stream and
    buffers have these sizes."""
    text = json.dumps({"pickle": stream_size, "buffers": list(sizes)}).encode()
    return MAGIC + _LEN.pack(len(text)) + text


def _blob_size_of(head: bytes, stream_size: int, sizes: List[int]) -> int:
    """The size of the blob that starts with ``head`` (``_header_of`` these sizes)."""
    size = len(head)
    for part in [stream_size] + list(sizes):
        size += _pad(size) + part
    return size


def _write_all(fh, view: memoryview) -> None:
    for start in range(0, view.nbytes, CHUNK):
        part = view[start : start + CHUNK]
        while part.nbytes:
            written = fh.write(part)
            part = part[written:]


def dump(value: Any, path: str) -> int:
    """Write ``value`` to ``path``; the number of bytes written.  Raises what pickling raises."""
    stream, raws = _pickled(value)
    return _write_blob(path, stream, raws)


def write(blob: Blob, path: str) -> int:
    """Write a blob as it is (one a rank made, never decoded here) to ``path``, readable by this
    user only; its size."""
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb", buffering=0) as fh:
        _write_all(fh, memoryview(blob).cast("B"))
    return memoryview(blob).nbytes


class RankBlobs:
    """Several ranks' values (``all_ranks``), each still the blob its rank made: what a detached
    run's supervising process keeps as one blob without decoding any (``kept``), decoded by the
    kernel that takes it (``loads_kept``).  ``by_rank``: a dict by rank, else a list."""

    def __init__(self, blobs: "dict", by_rank: bool):
        self.blobs = blobs
        self.by_rank = by_rank

    def values(self) -> Any:
        values = {r: None if blob is None else loads(blob) for r, blob in self.blobs.items()}
        return values if self.by_rank else list(values.values())


def kept(blobs: "dict", all_ranks: bool, by_rank: bool) -> bytes:
    """The ranks' blobs (``{rank: blob or None}``, in order) as the one blob a record keeps: the
    first rank's as it is, or with ``all_ranks`` every one inside a ``RankBlobs``; none decoded."""
    if not all_ranks:
        [blob] = blobs.values()
        return dumps(None) if blob is None else blob
    return dumps(RankBlobs({r: None if b is None else bytes(b) for r, b in blobs.items()}, by_rank))


def loads_kept(blob: Blob) -> Any:
    """The value of a blob that ``kept`` made (or ``dump``): what ``Run.result()`` would give."""
    value = loads(blob)
    return value.values() if isinstance(value, RankBlobs) else value


def _write_blob(path: str, stream: bytes, raws: List[memoryview]) -> int:
    """Write the blob of ``stream`` and ``raws`` into ``path`` (readable by this user only, never
    through a link: ``privdir.open_private``); its size.  Raises the ``OSError`` of a failed
    write (a full disk)."""
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb", buffering=0) as fh:
        return _write_parts(fh, stream, raws)


def _write_parts(fh, stream: bytes, raws: List[memoryview]) -> int:
    """Write the blob of ``stream`` and ``raws`` into ``fh`` (unbuffered, at its start); its size."""
    head = _header(stream, raws)
    size = 0
    for part in [memoryview(head), memoryview(stream)] + raws:
        pad = _pad(size)  # 0 before the header
        _write_all(fh, memoryview(b"\0" * pad))
        _write_all(fh, part)
        size += pad + part.nbytes
    return size


def dumps(value: Any) -> bytes:
    """``value`` as one blob in memory (a warm rank's value, which travels in records)."""
    out = io.BytesIO()
    stream, raws = _pickled(value)
    out.write(_header(stream, raws))
    for part in [stream] + raws:
        out.write(b"\0" * _pad(out.tell()))
        out.write(part)
    return out.getvalue()


def read(path: str) -> bytearray:
    """The whole file at ``path`` in one ``bytearray`` (read in chunks, no copy after)."""
    size = os.path.getsize(path)
    blob = bytearray(size)
    view = memoryview(blob)
    with open(path, "rb", buffering=0) as fh:
        got = 0
        while got < size:
            n = fh.readinto(view[got : got + CHUNK])
            if not n:
                raise EOFError(f"{path} ended after {got} of {size} bytes")
            got += n
    return blob


def loads(blob: Blob) -> Any:
    """The value in ``blob`` (from ``dump``/``dumps``/``read``); its arrays and tensors are views
    into ``blob``, which they keep alive."""
    stream, buffers = _parts(blob)
    return pickle.loads(stream, buffers=buffers)


def _parts(blob: Blob) -> Tuple[memoryview, List[memoryview]]:
    """The pickle stream of ``blob`` and its buffers, as views into it."""
    view = memoryview(blob).cast("B")
    if view.readonly:  # tensors over read-only memory would be writable anyway: own a copy
        view = memoryview(bytearray(view))
    if view[: len(MAGIC)].tobytes() != MAGIC:
        raise ValueError("not a torchdist value: the blob does not start with its mark")
    start = len(MAGIC)
    (head_size,) = _LEN.unpack_from(view, start)
    start += _LEN.size
    header = json.loads(view[start : start + head_size].tobytes())
    offset = start + head_size
    offset += _pad(offset)
    stream = view[offset : offset + header["pickle"]]
    offset += header["pickle"]
    buffers = []
    for size in header["buffers"]:
        offset += _pad(offset)
        buffers.append(view[offset : offset + size])
        offset += size
    if offset > view.nbytes:  # slices past its end would be silently short
        raise ValueError(f"not a whole torchdist value: it ends after {view.nbytes} of its {offset} bytes")
    return stream, buffers


# -- values out to the ranks ----------------------------------------------------------------


class Buffers:
    """The large buffers of values sent to the ranks, apart from the job that holds their pickle
    stream (``pickled_apart``).

    On the driver they are views of the values' own memory: nothing is copied until ``in_file``
    (or ``FileWriter``, while the ranks start) writes them, once per run, into one file, which the
    job then names instead of holding the bytes; every rank on the machine maps that file
    (``load``), once it is written.  Where the ranks are on other
    machines, the job names the file by a name instead (``fetched``): each of those machines
    fetches it once from the driver into ``host_copy_path`` before its ranks start, and they map
    that copy, at the path their launcher hands them.  A job pickled with buffers not in a file
    holds the bytes.
    """

    def __init__(
        self, raws: List[memoryview], path: str = "", host_copy: str = "", marks: Optional[List[Optional[Mark]]] = None
    ):
        self._raws = raws
        self.sizes = [r.nbytes for r in raws]
        self.path = path
        #: the name of the machine's own copy of the file, fetched from the driver; else ""
        self.host_copy = host_copy
        #: on the driver, each buffer's ``Mark`` where every one has one (all are tensors'
        #: storages): what lets the next run with the same values map this run's file again
        #: (``driver.sent``); else ``None``.  Never pickled.
        self.marks = marks if marks and all(m is not None for m in marks) else None

    def unchanged_since(self, marks: List[Optional[Mark]]) -> bool:
        """Whether these buffers (of a later pickling) are the ones ``marks`` were taken of,
        unchanged by torch: the same storages, in the same order, each tensor on them at the
        same version counter."""
        return len(marks) == len(self._raws) and all(
            m is not None and m.holds(raw) for m, raw in zip(marks, self._raws)
        )

    def fingerprint(self) -> int:
        """``fingerprint`` of these buffers (on the driver, before they are in a file)."""
        return fingerprint(self._raws)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def in_file(self, directory: str) -> "Buffers":
        """These buffers written into ``directory`` (``SENT_FILE``, readable by its owner only),
        as ``Buffers`` that name the file; the caller removes the directory.  Raises the
        ``OSError`` of a failed write (a full disk)."""
        writer = FileWriter(self, directory)
        writer.wait()
        if writer.error is not None:
            raise writer.error
        return writer.buffers

    def _named(self, path: str = "", host_copy: str = "") -> "Buffers":
        named = Buffers([], path, host_copy)
        named.sizes = self.sizes
        return named

    def fetched(self, name: str) -> "Buffers":
        """These buffers (already ``in_file``) as each rank's machine has them once it fetched
        the file: a copy named ``name`` (``host_copy_path(name, ...)``, or the run's own
        directory beside it: ``hostcopy.copy_path``), at the path each rank's launcher hands it."""
        return self._named(host_copy=name)

    def __getstate__(self):
        if self.path or self.host_copy:
            return {"path": self.path, "host_copy": self.host_copy, "sizes": self.sizes}
        return {"path": "", "sizes": self.sizes, "raws": [pickle.PickleBuffer(r) for r in self._raws]}

    def __setstate__(self, state):
        self.path, self.sizes = state["path"], state["sizes"]
        self.host_copy = state.get("host_copy", "")
        self._raws = [memoryview(r).cast("B") for r in state.get("raws", [])]
        self.marks = None

    def load(self) -> List[memoryview]:
        """The buffers, on a rank: views of the file mapped copy-on-write (the machine's pages
        of it are shared by every rank that maps it, until a rank writes to a tensor of its
        own), or of the bytes the job held."""
        if not self.path and not self.host_copy:
            return self._raws
        if self.host_copy:
            path, mapped = _open_host_copy(self.host_copy, self.sizes)
        else:
            path = self.path
            try:
                fh = open(path, "rb")
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"the notebook values sent to the ranks are in {self.path} on the driver's machine, "
                    f"which this rank's machine ({socket.gethostname()}) cannot see"
                ) from None
            with fh:
                fcntl.flock(fh.fileno(), fcntl.LOCK_SH)  # the driver holds it while it writes the file
                if fh.read(len(MAGIC)) != MAGIC:
                    raise _unwritten(fh, path)
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            _, buffers = _parts(mapped)
        except ValueError as exc:  # the driver was stopped while it wrote the file
            raise OSError(f"the notebook values sent to the ranks in {path} are not whole: {exc}") from None
        return buffers


def _open_host_copy(name: str, sizes: List[int]) -> Tuple[str, mmap.mmap]:
    """The machine's copy of the notebook values named ``name``, whose buffers have ``sizes``,
    mapped copy-on-write, and its path: the file this rank's launcher fetched or found whole
    (``VALUES_COPY_ENV``), opened without following a link, in a private directory of this
    user's, and checked once open: a regular file of this user's whose size and header are the
    ones ``sizes`` give (``privdir.UnsafePath`` naming what differs).  Nothing waits on it: the
    launcher starts its rank only once the copy is whole."""
    host = socket.gethostname()
    path = os.environ.get(VALUES_COPY_ENV, "")
    if not path:
        raise FileNotFoundError(
            f"the notebook values sent to the ranks were to be fetched from the driver onto this rank's "
            f"machine ({host}) before it started, and its launcher did not say where they are "
            f"({VALUES_COPY_ENV} is not set)"
        )
    if os.path.basename(path) != name:
        raise UnsafePath(
            f"the notebook values sent to the ranks are {name}, and this rank's launcher named {path}; it is not mapped"
        )
    check_private(os.path.dirname(path))
    try:
        fd = open_private(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO there would not keep it waiting
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the notebook values sent to the ranks were to be fetched from the driver into {path} "
            f"on this rank's machine ({host}) before it started, and are not there"
        ) from None
    with open(fd, "rb") as fh:
        info = os.fstat(fd)
        head = _header_of(0, sizes)
        size = _blob_size_of(head, 0, sizes)
        problems = []
        if not stat.S_ISREG(info.st_mode):
            problems.append("not a regular file")
        if info.st_uid != os.geteuid():
            problems.append(f"owned by uid {info.st_uid}, not {os.geteuid()}")
        if info.st_size != size:
            problems.append(f"{info.st_size} bytes where the job's values take {size}")
        elif fh.read(len(head)) != head:
            problems.append("its header is not the one of the job's values")
        if problems:
            raise UnsafePath(
                f"{path} is not the copy of the notebook values this rank's launcher fetched "
                f"({', '.join(problems)}); it is not mapped"
            )
        return path, mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)


def _unwritten(fh, path: str) -> OSError:
    """What a rank raises for the file of values at ``path`` (open in ``fh``) that does not hold
    a value: the reason the driver could not write it (``FileWriter``), else that it is none."""
    fh.seek(0)
    head = fh.read(4096)
    if head.startswith(UNWRITTEN):
        reason = head[len(UNWRITTEN) :].decode("utf-8", "replace")
        return OSError(f"the driver could not write the notebook values sent to the ranks into {path}: {reason}")
    return OSError(
        f"the notebook values sent to the ranks in {path} are not whole: it does not start with a value's mark"
    )


class FileWriter:
    """``buffers`` being written into ``directory`` (``SENT_FILE``, readable by its owner only) by
    a thread of its own, from the values' own memory; ``self.buffers`` names the file at once.

    The file is made and locked (``flock``, exclusively) before this returns, and the lock is
    let go of once it is written: a rank that loads the buffers first waits for it, so the ranks
    may start meanwhile.  Where the write fails (a full disk), the file holds ``UNWRITTEN`` and
    the reason instead, which a rank that loads it raises (``self.error`` has it on the driver).
    Nothing of it is copied while the values' memory changes: ``wait`` before the values may
    change (the caller gives the notebook back).  The caller removes the directory, after
    ``wait``."""

    def __init__(self, buffers: Buffers, directory: str):
        path = os.path.join(directory, SENT_FILE)
        self.buffers = buffers._named(path)
        #: the ``OSError`` of a failed write, once ``wait`` returned; else ``None``
        self.error: Optional[OSError] = None
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._thread = threading.Thread(
                target=self._write, args=(fd, buffers._raws), name=f"torchdist-values-{path}", daemon=True
            )
            self._thread.start()
        except BaseException:
            os.close(fd)
            raise

    def _write(self, fd: int, raws: List[memoryview]) -> None:
        try:
            with open(fd, "r+b", buffering=0, closefd=False) as fh:
                _write_parts(fh, b"", raws)
        except OSError as exc:
            self.error = exc
            with contextlib.suppress(OSError):  # truncated, it has room for the reason
                os.ftruncate(fd, 0)
                os.pwrite(fd, UNWRITTEN + str(exc).encode("utf-8", "replace"), 0)
        finally:
            os.close(fd)  # lets go of the lock: the ranks waiting for the file go on

    def wait(self) -> None:
        """Return once the file is written (or the write failed: ``self.error``)."""
        self._thread.join()


def host_copy_path(name: str, nbytes: int) -> str:
    """Where a machine keeps its fetched copy (of ``nbytes``) of the values named ``name``: in
    this user's private directory (``privdir.user_path``: no other user may plant a copy there) in
    shared memory (``SHARED_MEMORY``) where the machine has it and the copy takes at most half of
    its size (a container's is often 64 MiB), else in the temporary directory.  The same on
    every task of a machine: it goes by the size of its shared memory, not by what is free."""
    if fits_shared_memory(nbytes):
        return os.path.join(user_path(SHARED_MEMORY), name)
    import tempfile

    return os.path.join(user_path(tempfile.gettempdir()), name)


def fits_shared_memory(nbytes: int) -> bool:
    """Whether this machine has shared memory (``SHARED_MEMORY``) that a file of ``nbytes``
    would take at most half of: by its size, not by what is free, so that every process of the
    machine answers alike."""
    if not (os.path.isdir(SHARED_MEMORY) and os.access(SHARED_MEMORY, os.W_OK)):
        return False
    stats = os.statvfs(SHARED_MEMORY)
    return stats.f_blocks * stats.f_frsize >= 2 * nbytes


def blob_size(path: str) -> int:
    """The size the blob in the file at ``path`` has by its own header (its mark, the header's
    length and the header: the sizes of its parts); ``ValueError`` when it is not a blob."""
    with open(path, "rb") as fh:
        start = fh.read(len(MAGIC) + _LEN.size)
        if start[: len(MAGIC)] != MAGIC or len(start) < len(MAGIC) + _LEN.size:
            raise ValueError("not a torchdist value: the blob does not start with its mark")
        (head_size,) = _LEN.unpack_from(start, len(MAGIC))
        try:
            header = json.loads(fh.read(head_size))
            size = len(start) + head_size
            for part in [header["pickle"]] + header["buffers"]:
                size += _pad(size) + part
        except (ValueError, KeyError, TypeError):
            raise ValueError("not a torchdist value: its header is not one") from None
    return size


def pickled_apart(value: Any, by_value: Optional[list] = None) -> Tuple[bytes, Buffers]:
    """``value``'s pickle stream (cloudpickle, protocol 5; ``by_value``: modules whose functions
    travel by value) and its large buffers (``Buffers``): CPU tensors' storages and NumPy
    arrays, not copied.  ``pickle.loads(stream, buffers=buffers.load())`` rebuilds it."""
    with _sent_by_value(by_value):
        stream, raws, marks = _pickled_marked(value, cpu_only=True)
    return stream, Buffers(raws, marks=marks)


def loads_apart(stream: bytes, buffers: Optional[Buffers]) -> Any:
    """The value of ``pickled_apart``."""
    return pickle.loads(stream, buffers=buffers.load() if buffers is not None else ())


# -- the run's value directories -----------------------------------------------------------


def value_directory(prefix: str, nbytes: int = 0) -> str:
    """A new directory for ranks' values: in shared memory (``SHARED_MEMORY``) where this machine
    has it, so that a value written there is mapped by the driver, never copied; else an
    ordinary temporary directory.  Its name carries this process's id after ``prefix``, so that
    what a driver left in the machine-wide shared memory can be told apart from another's.
    ``nbytes``: what will be written there, known in advance, goes to the temporary directory
    where it would take more than half of the shared memory (``fits_shared_memory``)."""
    prefix = f"{prefix}{os.getpid()}-"
    if fits_shared_memory(nbytes):  # SHARED_MEMORY, there and writable
        try:
            return tempfile.mkdtemp(prefix=prefix, dir=SHARED_MEMORY)
        except OSError:
            pass
    return tempfile.mkdtemp(prefix=prefix)


def map_value(path: str, directory: str) -> Optional[mmap.mmap]:
    """The value blob at ``path``, a file of the run's value ``directory``, mapped into memory,
    copy-on-write, and the file's name removed: in shared memory the value's pages are then the
    ones the rank wrote, never copied; the mapping (and with it the memory) goes when the last
    tensor or array of the value goes.  ``None`` when there is no such file;
    ``privdir.UnsafePath`` for a path elsewhere (a task names it) or a link."""
    if not inside(path, directory):
        raise UnsafePath(
            f"a rank's value was to be read from {path}, outside the run's value directory "
            f"{directory}; it is neither read nor removed"
        )
    try:
        fd = open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with open(fd, "rb") as fh:
        blob = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    os.unlink(path)
    return blob
