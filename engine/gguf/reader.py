"""A GGUF file's metadata and tensor table, read in one pass.

gguf-py's `GGUFReader` makes a numpy view per array element of the metadata, so a file's
vocabulary (SmolLM2: 49,152 tokens and 48,900 merges) alone took ~2.9 s to open, on every
load of a GGUF model. This reader decodes the same format with `struct` over the
memory-mapped bytes, strings arrays included, in ~0.1 s, and gives what the loader uses:
each metadata value as Python (`GGUFFile.fields[key].contents()`, as gguf-py returns it)
with its value types, and each tensor's name, type, shape and data (a read-only view of
the mapped file, shaped as gguf-py shapes it: the element type for float and integer
tensors, rows of block bytes for quantized ones).

Format (llama.cpp's gguf.md, versions 2 and 3, little-endian): magic "GGUF", version u32,
tensor count u64, metadata count u64; each metadata entry a string key, a u32 value type
and the value (an array: item type u32, count u64, items); each tensor a string name, u32
dimension count, u64 dimensions (innermost first), u32 type, u64 offset from the data
start, which is the end of the tensor table rounded up to `general.alignment` (32).
A string is a u64 byte count and UTF-8 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

# Scalar value types: their struct format (little-endian).
_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
# Numeric arrays are read whole with numpy.
_NUMPY = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64,
}
# Tensor types stored as plain elements (everything else is rows of quantized blocks).
_ELEMENT_TYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True, slots=True)
class MetadataField:
    """One metadata entry: its value as Python (a str, int, float, bool, or a list of them)
    and its value types (`[ARRAY, item type]` for an array), as gguf-py's field has them."""

    value: Any
    types: tuple[GGUFValueType, ...]

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor of the file. `shape` lists dimensions innermost first (as GGUF does); `data`
    is a read-only view of the mapped file: shape reversed(shape) of the element type for
    float and integer types, and for quantized types rows of bytes (the innermost dimension
    as its blocks' bytes)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """The metadata (`fields`, by key) and tensors (`tensors`, in file order) of a GGUF file.
    Raises ValueError for a file that is not GGUF, is truncated, or is big-endian."""

    def __init__(self, path: str | Path) -> None:
        self._map = np.memmap(path, mode="r")
        self._buf = memoryview(self._map)
        try:
            self._read()
        except (struct.error, IndexError) as e:
            raise ValueError(f"truncated or malformed GGUF file ({e})") from None

    def _read(self) -> None:
        buf = self._buf
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError("GGUF magic invalid")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in _VERSIONS:
            if version & 0xFFFF == 0:
                raise ValueError("big-endian GGUF files are not supported")
            raise ValueError(f"GGUF version {version} is not supported (only {_VERSIONS})")
        self.version = version
        offset = 24
        self.fields: dict[str, MetadataField] = {}
        for _ in range(kv_count):
            key, offset = self._string(offset)
            (kind,), offset = struct.unpack_from("<I", buf, offset), offset + 4
            value, types, offset = self._value(GGUFValueType(kind), offset)
            self.fields[key] = MetadataField(value, types)
        infos = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            (n_dims,), offset = struct.unpack_from("<I", buf, offset), offset + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, offset)
            offset += 8 * n_dims
            kind, data_offset = struct.unpack_from("<IQ", buf, offset)
            offset += 12
            infos.append((name, dims, GGMLQuantizationType(kind), data_offset))
        alignment = self.fields.get("general.alignment")
        align = int(alignment.value) if alignment is not None else _DEFAULT_ALIGNMENT
        self.data_offset = data_start = -(-offset // align) * align
        self.tensors: list[TensorInfo] = []
        seen = set()
        for name, dims, kind, rel in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name!r}")
            seen.add(name)
            self.tensors.append(self._tensor(name, dims, kind, data_start + rel))

    def _string(self, offset: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, offset)
        end = offset + 8 + n
        if end > len(self._buf):
            raise ValueError("a string runs past the end of the file")
        return str(self._buf[offset + 8:end], "utf-8"), end

    def _value(self, kind: GGUFValueType, offset: int) -> tuple[Any, tuple[GGUFValueType, ...], int]:
        buf = self._buf
        if kind == GGUFValueType.STRING:
            value, offset = self._string(offset)
            return value, (kind,), offset
        if kind in _SCALAR:
            fmt = _SCALAR[kind]
            return struct.unpack_from(fmt, buf, offset)[0], (kind,), offset + struct.calcsize(fmt)
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = struct.unpack_from("<IQ", buf, offset)
        item = GGUFValueType(item)
        offset += 12
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
            end = offset + count * dtype.itemsize
            if end > len(buf):
                raise ValueError("an array runs past the end of the file")
            return np.frombuffer(buf, dtype, count, offset).tolist(), (kind, item), end
        if item == GGUFValueType.STRING:  # the vocabulary: one loop, no per-item numpy views
            values = []
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                (n,) = unpack(buf, offset)
                values.append(str(buf[offset + 8:offset + 8 + n], "utf-8"))
                offset += 8 + n
            if offset > len(buf):
                raise ValueError("an array runs past the end of the file")
            return values, (kind, item), offset
        values = []  # arrays of arrays (each item an array value: its type, count, items)
        types = (kind, item)
        for i in range(count):
            value, item_types, offset = self._value(item, offset)
            values.append(value)
            if i == 0:  # as gguf-py: [ARRAY, the first item's types...]
                types = (kind, *item_types)
        return values, types, offset

    def _tensor(self, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, start: int) -> TensorInfo:
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block_size, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * type_size // block_size
        if start + n_bytes > len(self._map):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        rows = tuple(reversed(dims))
        if kind in _ELEMENT_TYPES:
            dtype = np.dtype(_ELEMENT_TYPES[kind]).newbyteorder("<")
            data = np.frombuffer(self._map, dtype, n_elements, start).reshape(rows)
        else:
            if rows[-1] % block_size:
                raise ValueError(f"tensor {name!r}: {rows[-1]} columns are not whole {kind.name} blocks")
            data = np.frombuffer(self._map, np.uint8, n_bytes, start).reshape(
                rows[:-1] + (rows[-1] // block_size * type_size,))
        return TensorInfo(name, kind, np.asarray(dims, dtype=np.uint64), n_elements, n_bytes, start, data)
