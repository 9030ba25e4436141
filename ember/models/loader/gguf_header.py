"""The GGUF file header: metadata and the tensor table, parsed and validated over an mmap (no
tensor data is read).

Ours rather than ``gguf.GGUFReader``: that reader builds a numpy view per token string (~5-10 s
for a 49k-token vocabulary here, against ~0.2 s for this one) and fails on damaged files with
obscure numpy errors; every damage this parser detects is a ``ValueError`` naming the file.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 used 32-bit counts and is long gone
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# GGUF metadata value types -> (struct format, numpy dtype)
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}  # fmt: skip


class _Corrupt(Exception):
    """Internal: raised while parsing, turned into a ValueError naming the file."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: ggml lists dimensions fastest-moving first
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]  # in file order

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Corrupt(
                f"{what} at byte {self.pos} runs past the end of the file ({self.size} bytes)"
            )

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Corrupt(f"{what} is not valid UTF-8") from e

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row: string()'s checks in one loop (a vocabulary holds ~10^5
        of them; calling string() per entry was most of the header's parse time)."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        length = _U64.unpack_from
        try:
            for _ in range(count):
                if pos + 8 > size:
                    raise _Corrupt(f"{what} at byte {pos} runs past the end of the file ({size} "
                                   "bytes)")
                (n,) = length(buf, pos)
                pos += 8
                if pos + n > size:
                    raise _Corrupt(f"{what} at byte {pos} runs past the end of the file ({size} "
                                   "bytes)")
                out.append(buf[pos : pos + n].decode("utf-8"))
                pos += n
        except UnicodeDecodeError as e:
            raise _Corrupt(f"{what} is not valid UTF-8") from e
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0], what)
        if vtype != _ARRAY:
            raise _Corrupt(f"{what} has unknown value type {vtype}")
        itype, count = self.scalar("<I", what), self.scalar("<Q", what)
        if itype == _STRING:
            self.need(count * 8, what)  # each string takes at least its 8-byte length
            return self.strings(count, what)
        if itype not in _SCALARS:
            raise _Corrupt(f"{what} is an array of unknown type {itype}")
        dtype = np.dtype(_SCALARS[itype][1])
        self.need(count * dtype.itemsize, what)
        # Copy out of the mmap (slicing gives bytes) so nothing keeps the mapping alive.
        arr = np.frombuffer(self.buf[self.pos : self.pos + count * dtype.itemsize], dtype=dtype)
        self.pos += count * dtype.itemsize
        return arr


def _parse(buf: mmap.mmap, size: int, path: str) -> GGUFHeader:
    cur = _Cursor(buf, size)
    cur.need(24, "the file header")
    if buf[:4] != _MAGIC:
        raise _Corrupt(f"bad magic bytes {bytes(buf[:4])!r}, not a GGUF file")
    cur.pos = 4
    version = cur.scalar("<I", "version")
    if version not in _VERSIONS:
        endian = (
            " (a big-endian file?)"
            if int.from_bytes(version.to_bytes(4, "little"), "big") in _VERSIONS
            else ""
        )
        raise _Corrupt(f"unsupported GGUF version {version}{endian}; this reader handles v2 and v3")
    n_tensors, n_kv = cur.scalar("<Q", "tensor count"), cur.scalar("<Q", "metadata count")
    # Each entry takes well over 8 bytes: absurd counts mean garbage, not a huge model.
    if n_tensors * 8 > size or n_kv * 8 > size:
        raise _Corrupt(f"impossible counts ({n_tensors} tensors, {n_kv} metadata keys)")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("a metadata key")
        metadata[key] = cur.value(cur.scalar("<I", f"the type of {key!r}"), f"metadata {key!r}")

    infos = []
    for _ in range(n_tensors):
        name = cur.string("a tensor name")
        n_dims = cur.scalar("<I", f"tensor {name!r}")
        if not 0 < n_dims <= _MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
        dims = [cur.scalar("<Q", f"tensor {name!r}") for _ in range(n_dims)]
        raw_type, rel_offset = cur.scalar("<I", f"tensor {name!r}"), cur.scalar("<Q", name)
        infos.append((name, dims, raw_type, rel_offset))

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, raw_type, rel_offset in infos:
        if name in tensors:
            raise _Corrupt(f"tensor {name!r} appears twice")
        try:
            qtype = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as e:
            raise _Corrupt(f"tensor {name!r} has unknown type {raw_type}") from e
        if dims[0] % block_size:
            raise _Corrupt(f"tensor {name!r}: row of {dims[0]} is not whole {qtype.name} blocks")
        nbytes = int(np.prod(dims, dtype=object)) // block_size * type_size
        start = data_start + rel_offset
        if start + nbytes > size:
            raise _Corrupt(
                f"tensor {name!r} needs bytes {start}..{start + nbytes} but the file has {size}"
            )
        tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), qtype, start, nbytes)
    return GGUFHeader(path, version, metadata, tensors)


def corrupt_error(path: str, detail: str) -> ValueError:
    return ValueError(f"GGUF file {path!r} is corrupt or truncated: {detail}")


def read_gguf_header(path: str) -> GGUFHeader:
    """Parse and validate metadata and the tensor table (no tensor data is read).

    Cached per (path, size, mtime): the config, the weights and the tokenizer all start here."""
    path = os.fspath(path)
    st = os.stat(path)  # FileNotFoundError is already clear
    return _read_header_cached(os.path.realpath(path), st.st_size, st.st_mtime_ns, path)


@functools.lru_cache(maxsize=4)
def _read_header_cached(real: str, size: int, _mtime: int, path: str) -> GGUFHeader:
    if size < 24:
        raise corrupt_error(path, f"only {size} bytes, smaller than a GGUF header")
    with open(real, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse(buf, size, path)
        except _Corrupt as e:
            raise corrupt_error(path, str(e)) from None
        except (struct.error, OverflowError, MemoryError) as e:  # belt and braces
            raise corrupt_error(path, f"{type(e).__name__}: {e}") from None
