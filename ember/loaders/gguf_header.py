"""A GGUF file's header read in one pass: its metadata as plain values and its tensors as the gguf
package's `ReaderTensor`s over a memory map of the file.

The gguf package's own reader makes a numpy view of every value, one by one: on a file whose
tokenizer holds 49,152 tokens and as many merges that is 7.5 s (an Intel Xeon), paid at every
start of a worker. Reading the values with `struct` from the mapped bytes takes a few
hundredths of a second. The tensors are the package's type, laid out as its reader lays them
out (quantized ones as rows of bytes), so its dequantizers take them unchanged.
"""

from __future__ import annotations

import logging
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger("ember.loaders")

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_VERSIONS = (2, 3)

# GGUF value types: the scalars by their struct code, then strings (8) and arrays (9).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numbers (the rest are blocks of bytes).
_PLAIN_TENSORS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader can read (cut off, a value of no known type)."""


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor


class _Cursor:
    """Reads little-endian values from a byte buffer, moving on past each."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.at = 0
        self.undecodable = False  # a string since this was last cleared was not UTF-8

    def unpack(self, code: str) -> Any:
        try:
            (value,) = struct.unpack_from("<" + code, self.buffer, self.at)
        except struct.error:
            raise GGUFFormatError(f"the header ends at byte {self.at}, in the middle of a value") from None
        self.at += struct.calcsize(code)
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        end = self.at + length
        if end > len(self.buffer):
            raise GGUFFormatError(f"a string at byte {self.at} runs past the end of the file")
        raw = bytes(self.buffer[self.at:end])
        self.at = end
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:  # the value it belongs to is dropped (read_header)
            self.undecodable = True
            return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("I"), self.unpack("Q")
            if item_kind in _SCALARS:  # numbers at once
                code = _SCALARS[item_kind]
                end = self.at + count * struct.calcsize(code)
                if end > len(self.buffer):
                    raise GGUFFormatError(f"an array at byte {self.at} runs past the end of the file")
                values = np.frombuffer(self.buffer, dtype="<" + code, count=count, offset=self.at).tolist()
                self.at = end
                return values
            return [self.value(item_kind) for _ in range(count)]
        raise GGUFFormatError(f"a value of unknown type {kind} at byte {self.at}")


def read_header(path: pathlib.Path) -> GGUFHeader:
    """The metadata and tensors of the GGUF file at `path` (little-endian, versions 2 and 3).
    Raises GGUFFormatError where the bytes do not hold a readable header, or a tensor lies past
    the end of the file."""
    import gguf
    from gguf.quants import quant_shape_to_byte_shape

    data = np.memmap(path, mode="r")
    cursor = _Cursor(memoryview(data))
    if bytes(data[:4]) != GGUF_MAGIC:
        raise GGUFFormatError("it does not start with the GGUF magic bytes")
    cursor.at = 4
    version = cursor.unpack("I")
    if version not in _VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} (ember reads versions 2 and 3, little-endian)")
    tensor_count, kv_count = cursor.unpack("Q"), cursor.unpack("Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        cursor.undecodable = False
        value = cursor.value(cursor.unpack("I"))
        if cursor.undecodable:  # a value ember cannot read as text is left out, not guessed at
            logger.debug("skipping GGUF field %s: it holds text that is not UTF-8", key)
        else:
            metadata[key] = value
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.unpack("Q") for _ in range(cursor.unpack("I"))]
        infos.append((name, dims, cursor.unpack("I"), cursor.unpack("Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment!r} is not a power of two")
    start = -(-cursor.at // alignment) * alignment
    tensors: dict[str, Any] = {}
    for name, dims, raw_type, offset in infos:
        if name in tensors:
            raise GGUFFormatError(f"tensor {name} is listed twice")
        try:
            kind = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name} has unknown type {raw_type}") from None
        elements = int(np.prod(dims, dtype=np.int64))
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        n_bytes = elements * type_size // block_size
        begin = start + offset
        if begin + n_bytes > len(data):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file")
        shape = tuple(reversed(dims))
        plain = _PLAIN_TENSORS.get(kind.name)
        if plain is not None:
            values = data[begin:begin + n_bytes].view(plain).reshape(shape)
        else:
            values = data[begin:begin + n_bytes].reshape(quant_shape_to_byte_shape(shape, kind))
        tensors[name] = gguf.ReaderTensor(name=name, tensor_type=kind, shape=np.array(dims, dtype=np.uint64),
                                          n_elements=elements, n_bytes=n_bytes, data_offset=begin, data=values,
                                          field=None)
    return GGUFHeader(metadata, tensors)
