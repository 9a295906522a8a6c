"""The metadata a llama.cpp adapter needs from a GGUF file, read without loading the model.

Format: the GGUF header (ggml's ``docs/gguf.md``, versions 2 and 3): the magic ``GGUF``, a
uint32 version, a uint64 tensor count, a uint64 key/value count, then each key/value pair
as a string key (uint64 length + UTF-8 bytes), a uint32 value type and the value. Arrays
carry a uint32 element type and a uint64 count. Files are little-endian unless written
byte-swapped (``gguf-convert-endian``), which shows as a version whose low 16 bits are 0.

Why not ``gguf.GGUFReader`` (gguf-py): it maps every array element and every tensor
description into numpy views before answering: 3.5 s for SmolLM2-135M's header on a 2-core
x86 machine, more for larger vocabularies, and ``build_command`` runs on the agent's event loop
(docs/engines.md, "llama.cpp: pooling"). This reader walks only the key/value section,
skipping array bodies by arithmetic, in milliseconds; the tests check it against
gguf-py's writer and reader on the same files.

Every malformed file is a ``GGUFMetadataError`` (never another exception): short reads,
wrong magic, unknown value types, counts or lengths beyond the file, nesting deeper than
``MAX_ARRAY_DEPTH``, more than ``MAX_KV_COUNT`` pairs, undecodable keys.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass

__all__ = ["GGUFMetadataError", "GGUFPooling", "MAX_ARRAY_DEPTH", "MAX_KV_COUNT", "read_pooling"]

_MAGIC = b"GGUF"
# Value types (docs/gguf.md, enum gguf_metadata_value_type) -> size of a scalar, in bytes.
_STRING, _ARRAY = 8, 9
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_INTEGER_FORMAT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 10: "Q", 11: "q"}

MAX_KV_COUNT = 1 << 20
"""More key/value pairs than any real model has (a few dozen): beyond it the file is garbage."""
MAX_ARRAY_DEPTH = 4
"""Arrays of arrays nest at most this deep (real files: 1)."""
_MAX_KEY_BYTES = 1 << 16


class GGUFMetadataError(ValueError):
    """The file is not a readable GGUF header; the message says where it broke."""


@dataclass(frozen=True, slots=True)
class GGUFPooling:
    """What the header says about pooling.

    architecture: ``general.architecture`` ("llama", "bert", ...), "" when absent.
    pooling_type: the integer value of ``<architecture>.pooling_type`` (llama.cpp's enum:
    0 none, 1 mean, 2 cls, 3 last, 4 rank), or None when the file declares none.
    """

    architecture: str
    pooling_type: int | None


def read_pooling(path: str | os.PathLike[str]) -> GGUFPooling:
    """Read ``general.architecture`` and ``<architecture>.pooling_type`` from ``path``.

    Reads the key/value section only (the tensors are never touched). Raises
    ``GGUFMetadataError`` for a malformed file and ``OSError`` when it cannot be opened.
    """
    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block open() forever
        raise GGUFMetadataError(f"{os.fspath(path)!r} is not a regular file")
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size < 24:
            raise GGUFMetadataError(f"{size} bytes: shorter than a GGUF header (24 bytes)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return _Header(view, size).pooling()


class _Header:
    """A cursor over the mapped file; every read is bounds-checked against its size."""

    def __init__(self, view: mmap.mmap, size: int) -> None:
        self.view = view
        self.size = size
        self.offset = 0
        self.order = "<"

    def _take(self, n: int) -> int:
        start = self.offset
        if n < 0 or start + n > self.size:
            raise GGUFMetadataError(f"offset {start}: {n} bytes wanted, the file ends at {self.size}")
        self.offset = start + n
        return start

    def _unpack(self, fmt: str) -> int:
        start = self._take(struct.calcsize(fmt))
        return int(struct.unpack_from(self.order + fmt, self.view, start)[0])  # integer codes only

    def _string(self) -> bytes:
        length = self._unpack("Q")
        return self.view[self._take(length):self.offset]

    def _skip_string(self) -> None:
        self._take(self._unpack("Q"))

    def _skip_value(self, value_type: int, depth: int = 0) -> None:
        if value_type == _STRING:
            self._skip_string()
        elif value_type in _SCALAR_SIZE:
            self._take(_SCALAR_SIZE[value_type])
        elif value_type == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFMetadataError(f"offset {self.offset}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
            element_type = self._unpack("I")
            count = self._unpack("Q")
            if element_type in _SCALAR_SIZE:
                # One multiplication, bounds-checked: a 2**60 count cannot make us loop.
                self._take(count * _SCALAR_SIZE[element_type])
                return
            if count > self.size - self.offset:  # every element takes at least one byte
                raise GGUFMetadataError(f"offset {self.offset}: array of {count} elements in a {self.size}-byte file")
            if element_type == _STRING:  # vocabularies: 10**5 strings, so no call per element
                unpack, order, size, offset = struct.unpack_from, self.order + "Q", self.size, self.offset
                for _ in range(count):
                    if offset + 8 > size:
                        break
                    offset += 8 + unpack(order, self.view, offset)[0]
                else:
                    if offset <= size:
                        self.offset = offset
                        return
                raise GGUFMetadataError(f"offset {self.offset}: a string array runs past the end of the file")
            for _ in range(count):
                self._skip_value(element_type, depth + 1)
        else:
            raise GGUFMetadataError(f"offset {self.offset}: unknown value type {value_type}")

    def pooling(self) -> GGUFPooling:
        if self.view[0:4] != _MAGIC:
            raise GGUFMetadataError(f"magic {bytes(self.view[0:4])!r}, not {_MAGIC!r}")
        self._take(4)
        version = self._unpack("I")
        if version & 0xFFFF == 0:  # written byte-swapped
            self.order = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise GGUFMetadataError(f"GGUF version {version}: only versions 2 and 3 are read")
        self._unpack("Q")  # tensor count: not needed
        kv_count = self._unpack("Q")
        if kv_count > MAX_KV_COUNT:
            raise GGUFMetadataError(f"{kv_count} key/value pairs (more than {MAX_KV_COUNT}): not a model header")
        architecture = ""
        integers: dict[str, int] = {}
        for _ in range(kv_count):
            raw_key = self._string()
            if len(raw_key) > _MAX_KEY_BYTES:
                raise GGUFMetadataError(f"offset {self.offset}: a {len(raw_key)}-byte key")
            try:
                key = raw_key.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise GGUFMetadataError(f"offset {self.offset}: key is not UTF-8 ({exc.reason})") from None
            value_type = self._unpack("I")
            if key == "general.architecture" and value_type == _STRING:
                architecture = self._string().decode("utf-8", "replace")
            elif key.endswith(".pooling_type") and value_type in _INTEGER_FORMAT:
                integers[key] = self._unpack(_INTEGER_FORMAT[value_type])
            else:
                self._skip_value(value_type)
        return GGUFPooling(architecture, integers.get(f"{architecture}.pooling_type") if architecture else None)
