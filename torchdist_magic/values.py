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
memory to the file; reading fills one ``bytearray`` with the whole file (a plain read, at the
speed of the page cache) and the loaded tensors and arrays are views into it: the driver holds
the value once, plus the small pickle stream.  (A view of a small part of a large storage
brings the whole storage, as ``torch.save`` does.)

Nothing here imports torch unless the value holds a tensor.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
from typing import Any, List, Union

MAGIC = b"torchdist-value-1\n"
ALIGN = 64
_LEN = struct.Struct("<Q")
#: bytes per read or write call: one call of more than 2 GiB may be cut short by the system
CHUNK = 1 << 30

Blob = Union[bytes, bytearray, memoryview]


def _pad(n: int) -> int:
    return -n % ALIGN


def _pickler_class():
    import cloudpickle

    class ValuePickler(cloudpickle.Pickler):
        """cloudpickle (functions and classes of the notebook by value) with the bytes of
        tensors' storages out of band, each storage once."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._storages: dict = {}

        def reducer_override(self, obj):
            if type(obj).__module__ == "torch" or type(obj).__name__ == "Parameter":
                reduced = _reduce_tensor(obj, self._storages)
                if reduced is not None:
                    return reduced
            return super().reducer_override(obj)

    return ValuePickler


class _Storage:
    """A tensor storage's bytes, pickled out of band; one per storage, so that the tensors
    that share it (views, tied weights) share it again when loaded."""

    def __init__(self, raw):
        self.raw = raw

    def __reduce__(self):
        return (_storage_from_buffer, (pickle.PickleBuffer(self.raw),))


def _reduce_tensor(obj, storages: dict):
    """``(_tensor_from_storage, args)`` for a dense tensor (on any device: it comes back on the
    CPU, as ``torch.save`` with ``map_location="cpu"`` gives it); ``None`` for anything else,
    which torch pickles itself."""
    import torch

    if not isinstance(obj, torch.Tensor) or type(obj) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if obj.layout != torch.strided or obj.is_quantized or obj.is_nested or obj.device.type == "meta":
        return None
    storage = obj.untyped_storage()
    key = (obj.device.type, obj.device.index, storage.data_ptr(), storage.nbytes())
    if key not in storages:
        cpu = storage if obj.device.type == "cpu" else storage.cpu()
        raw = torch.empty(0, dtype=torch.uint8).set_(cpu).numpy()
        storages[key] = _Storage(raw)
    return (_tensor_from_storage, (storages[key], str(obj.dtype).split(".", 1)[1], tuple(obj.shape),
                                   tuple(obj.stride()), obj.storage_offset(), obj.requires_grad,
                                   isinstance(obj, torch.nn.Parameter)))


def _storage_from_buffer(buffer):
    import torch

    view = memoryview(buffer).cast("B")
    return torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else torch.empty(0, dtype=torch.uint8)


def _tensor_from_storage(storage, dtype: str, shape, stride, offset: int, requires_grad: bool,
                         parameter: bool):
    import torch

    kind = getattr(torch, dtype)
    tensor = torch.empty(0, dtype=kind).set_(storage.untyped_storage(), offset, shape, stride)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _pickled(value: Any):
    """The pickle stream of ``value`` and its out-of-band buffers (as raw memoryviews)."""
    buffers: List[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _pickler_class()(stream, protocol=5, buffer_callback=buffers.append).dump(value)
    return stream.getvalue(), [b.raw() for b in buffers]


def _header(stream: bytes, raws: List[memoryview]) -> bytes:
    text = json.dumps({"pickle": len(stream), "buffers": [r.nbytes for r in raws]}).encode()
    return MAGIC + _LEN.pack(len(text)) + text


def _write_all(fh, view: memoryview) -> None:
    for start in range(0, view.nbytes, CHUNK):
        part = view[start:start + CHUNK]
        while part.nbytes:
            written = fh.write(part)
            part = part[written:]


def dump(value: Any, path: str) -> int:
    """Write ``value`` to ``path``; the number of bytes written.  Raises what pickling raises."""
    stream, raws = _pickled(value)
    head = _header(stream, raws)
    size = 0
    with open(path, "wb", buffering=0) as fh:
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
            n = fh.readinto(view[got:got + CHUNK])
            if not n:
                raise EOFError(f"{path} ended after {got} of {size} bytes")
            got += n
    return blob


def loads(blob: Blob) -> Any:
    """The value in ``blob`` (from ``dump``/``dumps``/``read``); its arrays and tensors are views
    into ``blob``, which they keep alive."""
    view = memoryview(blob).cast("B")
    if view.readonly:  # tensors over read-only memory would be writable anyway: own a copy
        view = memoryview(bytearray(view))
    if view[:len(MAGIC)].tobytes() != MAGIC:
        raise ValueError("not a torchdist value: the blob does not start with its mark")
    start = len(MAGIC)
    (head_size,) = _LEN.unpack_from(view, start)
    start += _LEN.size
    header = json.loads(view[start:start + head_size].tobytes())
    offset = start + head_size
    offset += _pad(offset)
    stream = view[offset:offset + header["pickle"]]
    offset += header["pickle"]
    buffers = []
    for size in header["buffers"]:
        offset += _pad(offset)
        buffers.append(view[offset:offset + size])
        offset += size
    return pickle.loads(stream, buffers=buffers)
