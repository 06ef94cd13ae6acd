"""A GGUF file's metadata and tensor table, read in one pass over its header; tensor bytes stay in a read-only
memory map until a caller takes them.

Why not gguf-py's ``GGUFReader`` here: it builds a numpy view for every element of every metadata array, and a
tokenizer's arrays (SmolLM2: 49,152 tokens, 48,900 merges) cost ~2.5 s a process before the first tensor is
read. This reader decodes numeric arrays with one ``frombuffer`` and string arrays only when a caller asks for
them. The reference forward (``taps_kernels.reference.gguf_forward``) keeps reading files through gguf-py, so
the two stay independent; the tests compare them field by field and tensor by tensor.

Layout read (GGUF versions 2 and 3, little-endian): ``"GGUF"``, version u32, tensor count u64, metadata count
u64; each metadata entry a string key, a u32 value type and the value (arrays: element type u32, count u64,
elements); each tensor a string name, dims u32, the dims as u64 (fastest first), GGML type u32, data offset
u64; then the tensor data from the next multiple of ``general.alignment`` (default 32).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np


class GGUFFormatError(ValueError):
    """A GGUF file that cannot be read or run: the message names the file, tensor or key and what was found."""


# metadata value types -> numpy dtype (numbers and bool); 8 = string, 9 = array
_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

#: GGML tensor types a file stores: id -> (name, elements per block, bytes per block) (Q8_1, a dot-product
#: intermediate whose size gguf-py and ggml disagree on, is left out: reading one is an error)
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
              15: ("Q8_K", 256, 292), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
              28: ("F64", 1, 8), 30: ("BF16", 1, 2)}


def ggml_type_name(ggml_type: int) -> str:
    return GGML_TYPES[ggml_type][0] if ggml_type in GGML_TYPES else str(ggml_type)


@dataclass
class GGUFTensor:
    """One tensor of the table: ``shape`` in GGUF order (fastest dimension first: a matrix is ``(K, N)``)."""
    name: str
    ggml_type: int
    shape: Tuple[int, ...]
    offset: int  # of its first byte in the file
    _file: "GGUFFile" = field(repr=False, default=None)

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)

    @property
    def nbytes(self) -> int:
        if self.ggml_type not in GGML_TYPES:
            raise GGUFFormatError(f"{self.name}: GGML type {self.ggml_type} is unknown (its size cannot be read)")
        _, per_block, block_bytes = GGML_TYPES[self.ggml_type]
        n = math.prod(self.shape)  # Python integers: a damaged shape cannot overflow into a small size
        if n % per_block:
            raise GGUFFormatError(f"{self.name}: {n} elements is not a whole number of {self.type_name} blocks "
                                  f"({per_block} elements)")
        return n // per_block * block_bytes

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes, ``uint8 [nbytes]``: a read-only view of the file's memory map."""
        end = self.offset + self.nbytes
        if end > self._file.size:
            raise GGUFFormatError(f"{self.name}: its data ends at byte {end}, past the end of "
                                  f"{self._file.path.name} ({self._file.size} bytes): truncated file")
        return self._file.map[self.offset:end]


class GGUFFile:
    """``GGUFFile(path)``: ``fields`` (metadata: key -> int / float / bool / str / numpy array, or a lazily
    decoded list of strings), ``tensors`` (name -> :class:`GGUFTensor`, file order), ``version``, ``alignment``.

    Raises :class:`GGUFFormatError` naming the file for a wrong magic, an unsupported version, an unknown
    metadata type or a header cut short."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            self.map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:  # ValueError: an empty file
            raise GGUFFormatError(f"{self.path.name}: not a readable GGUF file ({e})") from None
        self.size = int(self.map.size)
        self._buf = memoryview(self.map)
        self._pos = 0
        if bytes(self._take(4)) != b"GGUF":
            raise GGUFFormatError(f"{self.path.name}: not a GGUF file (its first bytes are not 'GGUF')")
        self.version = self._u32()
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{self.path.name}: GGUF version {self.version} is not supported (2 or 3)")
        n_tensors, n_fields = self._u64(), self._u64()
        self.fields: Dict[str, object] = {}
        for _ in range(n_fields):
            key = self._str()
            self.fields[key] = self._value(self._u32(), key)
        alignment = self.fields.get("general.alignment", 32)
        self.alignment = int(alignment) if int(alignment) > 0 else 32
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            dims = tuple(int(self._u64()) for _ in range(self._u32()))
            infos.append((name, dims, self._u32(), self._u64()))
        start = -(-self._pos // self.alignment) * self.alignment
        self.tensors: Dict[str, GGUFTensor] = {
            name: GGUFTensor(name, ggml_type, dims, start + offset, self) for name, dims, ggml_type, offset in infos}

    def field(self, key: str, default=None):
        """A metadata value (string arrays decoded to a list of str), or ``default`` where the key is absent."""
        v = self.fields.get(key, default)
        return v.decode() if isinstance(v, _LazyStrings) else v

    # -- header decoding ------------------------------------------------------------------------------------
    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if end > self.size:
            raise GGUFFormatError(f"{self.path.name}: the header ends at byte {self.size}, inside an entry that "
                                  f"needs {end} bytes: truncated file")
        out = self._buf[self._pos:end]
        self._pos = end
        return out

    def _u32(self) -> int:
        return struct.unpack("<I", self._take(4))[0]

    def _u64(self) -> int:
        return struct.unpack("<Q", self._take(8))[0]

    def _str(self) -> str:
        return bytes(self._take(self._u64())).decode("utf-8", errors="replace")

    def _value(self, vtype: int, key: str):
        if vtype in _SCALARS:
            dt = np.dtype(_SCALARS[vtype]).newbyteorder("<")
            v = np.frombuffer(self._take(dt.itemsize), dtype=dt)[0]
            return bool(v) if vtype == 7 else v.item()
        if vtype == _STRING:
            return self._str()
        if vtype == _ARRAY:
            etype, n = self._u32(), self._u64()
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype]).newbyteorder("<")
                return np.frombuffer(self._take(n * dt.itemsize), dtype=dt)
            if etype == _STRING:
                return _LazyStrings.skip(self, n)
            raise GGUFFormatError(f"{self.path.name}: metadata {key}: arrays of value type {etype} are not supported")
        raise GGUFFormatError(f"{self.path.name}: metadata {key}: unknown value type {vtype}")


class _LazyStrings:
    """A metadata array of strings: the header walk only steps over it; :meth:`decode` reads the strings."""

    def __init__(self, buf: memoryview, start: int, n: int):
        self._buf, self._start, self._n = buf, start, n
        self._items: Optional[list] = None

    @classmethod
    def skip(cls, f: GGUFFile, n: int) -> "_LazyStrings":
        start = pos = f._pos
        cut = f"{f.path.name}: a metadata string array runs past the end: truncated file"
        for _ in range(n):  # each string: its length (u64), then its bytes
            if pos + 8 > f.size:
                raise GGUFFormatError(cut)
            pos += 8 + struct.unpack_from("<Q", f._buf, pos)[0]
        if pos > f.size:
            raise GGUFFormatError(cut)
        f._pos = pos
        return cls(f._buf, start, n)

    def decode(self) -> list:
        if self._items is None:
            pos, items = self._start, []
            for _ in range(self._n):
                (n,) = struct.unpack_from("<Q", self._buf, pos)
                items.append(bytes(self._buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"))
                pos += 8 + n
            self._items = items
        return self._items
