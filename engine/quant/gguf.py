"""A GGUF reader that hands out tensors in their stored (quantized) form.

Only the header is parsed (metadata values and tensor infos); tensor bytes stay in the file and
are reached through one read-only memory map, so a client that needs 4 of 32 layers never
touches the other 28, and a tensor used as it is (the LM head, the embedding) costs no copy.
``gguf.GGUFReader`` parses every metadata array element by element (a tokenizer's 100k strings
took 11 s here); this parser skips arrays it does not need in one pass over their lengths.

Tensor shapes follow numpy/torch order: a GGUF ``ne = [K, N]`` matrix is ``(N, K)`` here, stored
as N rows of ``K / block_size`` blocks.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelLoadError

# ggml type id -> (name, values per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("f32", 1, 4),
    1: ("f16", 1, 2),
    2: ("q4_0", 32, 18),
    3: ("q4_1", 32, 20),
    6: ("q5_0", 32, 22),
    7: ("q5_1", 32, 24),
    8: ("q8_0", 32, 34),
    9: ("q8_1", 32, 36),
    10: ("q2_k", 256, 84),
    11: ("q3_k", 256, 110),
    12: ("q4_k", 256, 144),
    13: ("q5_k", 256, 176),
    14: ("q6_k", 256, 210),
    15: ("q8_k", 256, 292),
    24: ("i8", 1, 1),
    25: ("i16", 1, 2),
    26: ("i32", 1, 4),
    27: ("i64", 1, 8),
    28: ("f64", 1, 8),
    30: ("bf16", 1, 2),
}
GGML_IDS = {v[0]: k for k, v in GGML_TYPES.items()}

# metadata value types: id -> struct format (None: string / array, handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SMALL_ARRAY = 64  # arrays up to this many items are kept; longer ones (vocabularies) skipped


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) for a matrix
    kind: str  # "f32", "q4_k", ...
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        _, per_block, block_bytes = GGML_TYPES[GGML_IDS[self.kind]]
        return self.shape[-1] // per_block * block_bytes


def _size(shape: tuple[int, ...], tid: int) -> int:
    """Bytes of a tensor of ggml type ``tid`` (0 for an unknown type: refused elsewhere)."""
    if tid not in GGML_TYPES:
        return 0
    _, per_block, block_bytes = GGML_TYPES[tid]
    return int(np.prod(shape)) // per_block * block_bytes if shape else block_bytes


class _Cursor:
    def __init__(self, buf: Any, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.items = 0  # elements of the arrays skipped (vocabularies, merges)

    def damaged(self) -> ModelLoadError:
        return ModelLoadError(
            f"cannot read GGUF file {self.path}: its header is damaged or cut short",
            hint="copy or download the file again",
        )

    def unpack(self, fmt: str) -> Any:
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise self.damaged() from None
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise self.damaged()
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.unpack("<I")
            count = self.unpack("<Q")
            if count > len(self.buf) - self.pos:  # every element takes at least a byte
                raise self.damaged()
            if count <= _SMALL_ARRAY:
                return [self.value(etype) for _ in range(count)]
            self.items += count
            if etype in _SCALARS:
                self.pos += struct.calcsize(_SCALARS[etype]) * count
            elif etype == _STRING:
                for _ in range(count):
                    n = self.unpack("<Q")  # length, then the bytes (past the end: the next
                    self.pos += n  # read says so)
            else:  # arrays of arrays: walk them
                for _ in range(count):
                    self.value(etype)
            return None
        raise ModelLoadError(f"cannot read GGUF file {self.path}: unknown value type {vtype}")


class GGUFFile:
    """Header, tensor directory and memory map of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with self.path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {exc}") from exc
        cur = _Cursor(self._map, self.path)
        if bytes(self._map[:4]) != b"GGUF":
            raise ModelLoadError(f"cannot read GGUF file {self.path}: it is not a GGUF file")
        cur.pos = 4
        version = cur.unpack("<I")
        if version < 2 or version > 3:
            raise ModelLoadError(
                f"cannot read GGUF file {self.path}: unsupported version {version}"
            )
        n_tensors = cur.unpack("<Q")
        n_kv = cur.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I"))
        # elements of the long metadata arrays: what a reader that parses them one by one
        # (transformers' conversion) spends its time on
        self.array_items = cur.items
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
            raw.append((name, dims[::-1], cur.unpack("<I"), cur.unpack("<Q")))
        align = int(self.metadata.get("general.alignment", 32) or 32)
        data_start = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, tid, off in raw:
            if tid not in GGML_TYPES:
                raise ModelLoadError(
                    f"cannot read GGUF file {self.path}: tensor {name} has unknown type {tid}"
                )
            kind, per_block, block_bytes = GGML_TYPES[tid]
            n = int(np.prod(shape)) if shape else 1
            if shape and shape[-1] % per_block:
                raise ModelLoadError(f"cannot read GGUF file {self.path}: bad shape for {name}")
            nbytes = n // per_block * block_bytes
            start = data_start + off
            if start + nbytes > len(self._map):
                need = max(start + nbytes, *(data_start + o + _size(s, t) for _, s, t, o in raw))
                raise ModelLoadError(
                    f"cannot read GGUF file {self.path}: it is damaged or incomplete — tensor "
                    f"{name} ({kind}, {nbytes:,} bytes) ends at byte {start + nbytes:,} but the "
                    f"file has {len(self._map):,} bytes (expected at least {need:,})",
                    hint="copy or download the file again",
                )
            self.tensors[name] = TensorInfo(name, shape, kind, start, nbytes)
        self._array = np.frombuffer(self._map, dtype=np.uint8)  # whole file, read-only

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value, also looked up under the architecture's prefix."""
        if key in self.metadata:
            return self.metadata[key]
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes, memory-mapped (no copy): uint8 [rows, row_bytes] for a
        matrix, [nbytes] otherwise."""
        t = self.tensors[name]
        flat = self._array[t.offset : t.offset + t.nbytes]
        if len(t.shape) == 2:
            return flat.reshape(t.shape[0], t.row_bytes)
        return flat

    def copy(self, name: str) -> np.ndarray:
        """The tensor's stored bytes read into process memory (for tensors that are permuted or
        fused at load): read with ``readinto`` so the map's pages are not touched."""
        t = self.tensors[name]
        out = np.empty(t.nbytes, dtype=np.uint8)
        with self.path.open("rb") as f:
            f.seek(t.offset)
            if f.readinto(out.data) != t.nbytes:
                raise ModelLoadError(f"cannot read GGUF file {self.path}: {name} is truncated")
        if len(t.shape) == 2:
            return out.reshape(t.shape[0], t.row_bytes)
        return out

    def close(self) -> None:
        self._array = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):  # views alive (weights in use): the map stays
            self._map.close()
