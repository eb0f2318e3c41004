"""A small reader of the safetensors format: numpy only, no pickle, no torch.

Why not the `safetensors` library's own reader: numpy has no bfloat16, so its numpy path cannot
hand over the bf16 tensors every Qwen3.5 checkpoint holds, and a load needs bounded chunks of
rows in the file's own dtype (the engine widens and quantizes them on its worker threads). The
library stays the writer (tests, scripts) and the oracle these tests compare against.

Layout: an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the
data; offsets are relative to the first byte after the header. Everything is checked before any
array is made, so a corrupt or truncated file fails with a ValueError naming the file and tensor
rather than yielding garbage weights.

Floating tensors come back as float32 (the engine's input type; BF16 widens exactly by a 16-bit
shift), integer and bool tensors in their own native dtype.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors dtype -> little-endian numpy storage type. F8_E4M3 is read as its bits, which
# only formats.BlockFp8 (with its block scales) turns into values; F8_E5M2 is left out.
_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "F8_E4M3": "u1",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}
_FLOATS = ("F64", "F32", "F16", "BF16")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def numpy_dtype_name(dtype: str) -> str:
    """A safetensors dtype as numpy names it ("BF16" -> "bfloat16", "I32" -> "int32")."""
    if dtype in ("BF16", "F8_E4M3"):
        return {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3"}[dtype]
    return np.dtype(_DTYPES[dtype]).name


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:  # json.loads would silently keep the last one
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def read_header(path) -> tuple[dict, int, int]:
    """Parse and validate the header: ({name: (dtype, shape, begin, end)}, data start, data size).

    `__metadata__` is skipped. Raises ValueError naming the file (and tensor) on any defect.
    """
    path = Path(path)
    size = os.path.getsize(path)
    if size < 8:
        raise ValueError(f"{path}: {size} bytes, too short for a safetensors file (no header length)")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} exceeds the file size {size} "
                             "(truncated file, or not a safetensors file)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    data_size = size - 8 - n
    tensors, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise ValueError(f"{where}: entry must have dtype, shape and data_offsets, got {info!r}")
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise ValueError(f"{where}: unknown or unsupported dtype {dtype!r} "
                             f"(supported: {', '.join(_DTYPES)})")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"{where}: bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise ValueError(f"{where}: bad data_offsets {offs!r} (need [begin, end], 0 <= begin <= end)")
        begin, end = offs
        if end > data_size:
            raise ValueError(f"{where}: data_offsets {offs} run past the end of the data "
                             f"({data_size} bytes; truncated file?)")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize
        if nbytes != end - begin:
            raise ValueError(f"{where}: shape {shape} of {dtype} needs {nbytes} bytes, "
                             f"data_offsets {offs} span {end - begin}")
        tensors[name] = (dtype, tuple(shape), begin, end)
        spans.append((begin, end, name))
    # Overlap means two tensors share bytes: a corrupt (or hostile) header. Empty tensors own none.
    spans.sort()
    prev_end, prev = 0, None
    for begin, end, name in spans:
        if begin < prev_end and end > begin:
            raise ValueError(f"{path}: tensor {name!r} data_offsets [{begin}, {end}] overlap "
                             f"tensor {prev!r} (ending at {prev_end})")
        if end > begin:
            prev_end, prev = end, name
    return tensors, 8 + n, data_size


def _to_array(buf, dtype: str, shape: tuple) -> np.ndarray:
    x = np.frombuffer(buf, dtype=_DTYPES[dtype]).reshape(shape)
    if dtype == "BF16":  # bf16 is the top half of a float32: widening is exact
        return (x.astype(np.uint32) << 16).view(np.float32)
    if dtype in _FLOATS:
        return x.astype(np.float32)  # always a copy: aligned, writable, native byte order
    return x.astype(x.dtype.newbyteorder("="))


def read_safetensors(path, names=None) -> dict[str, np.ndarray]:
    """Read tensors of one .safetensors file (all of them, or `names`) as numpy arrays.

    F32/F16/BF16/F64 -> float32; integer and BOOL dtypes stay as they are (native byte order).
    Only the requested tensors are read from disk.
    """
    path = Path(path)
    infos = file_index(path)
    if names is None:
        names = list(infos)
    else:
        missing = [n for n in names if n not in infos]
        if missing:
            raise ValueError(f"{path}: no tensor {missing[0]!r} in this file"
                             + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else ""))
    reader = TensorReader(0)
    try:
        return {name: reader.read(infos[name]) for name in names}
    finally:
        reader.close()


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie: `offset` is absolute in `path`."""
    path: Path
    dtype: str
    shape: tuple
    offset: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of the tensor seen as [shape[0], the rest]."""
        rows = self.shape[0] if self.shape else 1
        return self.nbytes // rows if rows else 0


def file_index(path) -> dict[str, TensorInfo]:
    """{name: TensorInfo} of one .safetensors file, from its validated header alone."""
    path = Path(path)
    tensors, start, _ = read_header(path)
    return {n: TensorInfo(path, dt, shape, start + b, e - b) for n, (dt, shape, b, e) in tensors.items()}


def checkpoint_index(directory) -> dict[str, TensorInfo]:
    """Every tensor of an HF checkpoint directory (`model.safetensors`, or the shards listed in
    `model.safetensors.index.json`) by name, from the headers alone: no tensor data is read.

    As transformers does, a single file wins over an index when both exist.
    """
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"{d}: not a directory (expected an HF checkpoint directory)")
    if (d / SINGLE_FILE).is_file():
        return file_index(d / SINGLE_FILE)
    index = d / INDEX_FILE
    if not index.is_file():
        others = sorted(p.name for p in d.glob("*.safetensors"))
        hint = f"; found {others[:4]} but no index naming them" if others else ""
        raise ValueError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a valid safetensors index (needs a 'weight_map'): {e}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to shard files")
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ValueError(f"{index}: tensor {name!r} maps to {shard!r}, not a file name in {d}")
        shards.setdefault(shard, []).append(name)
    for shard in shards:  # check every shard before reading any: fail fast on a partial download
        if not (d / shard).is_file():
            raise ValueError(f"{d}: shard {shard!r} listed in {INDEX_FILE} is missing "
                             f"(holds {len(shards[shard])} tensors, e.g. {shards[shard][0]!r})")
    out = {}
    for shard, names in shards.items():
        infos = file_index(d / shard)
        missing = [n for n in names if n not in infos]
        if missing:
            raise ValueError(f"{d / shard}: no tensor {missing[0]!r} in this file (listed in {INDEX_FILE})"
                             + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else ""))
        out.update({n: infos[n] for n in names})
    return out


class TensorReader:
    """Reads tensors, or chunks of their rows, from the files of an index with plain reads into
    a reused buffer: a load's memory is the engine's plus one chunk, and the file's pages stay
    in the OS cache rather than in this process (a mapping would count them as resident).
    Engines may be built from one reader on several threads at once: each thread has its own
    buffer, and reads name their offset (pread) instead of sharing a file position."""

    def __init__(self, chunk_bytes: int = 32 << 20):
        self.chunk_bytes = int(chunk_bytes)
        self._files: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._files.get(path)
            if fd is None:
                fd = self._files[path] = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            return fd

    def _read_into(self, info: TensorInfo, offset: int, out: np.ndarray) -> None:
        fd, view, done = self._fd(info.path), memoryview(out).cast("B"), 0
        while done < len(view):
            if hasattr(os, "preadv"):
                n = os.preadv(fd, [view[done:]], offset + done)
            else:  # no positioned reads (Windows): one reader at a time
                with self._lock:
                    os.lseek(fd, offset + done, os.SEEK_SET)
                    n = os.readv(fd, [view[done:]])
            if not n:
                raise ValueError(f"{info.path}: ended early while reading (file truncated or "
                                 "changed while loading?)")
            done += n

    def rows(self, info: TensorInfo, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) in the file's dtype, flat (BF16 as its uint16 bits; the array is this
        thread's reused buffer, valid until its next call). F64 comes back as float32."""
        n = (r1 - r0) * info.row_bytes
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < n:
            buf = self._local.buf = np.empty(max(n, self.chunk_bytes), np.uint8)
        raw = buf[:n]
        self._read_into(info, info.offset + r0 * info.row_bytes, raw)
        x = raw.view(_DTYPES[info.dtype])
        return x.astype(np.float32) if info.dtype == "F64" else x

    def read(self, info: TensorInfo) -> np.ndarray:
        """The whole tensor, as read_safetensors gives it (floats widened to float32)."""
        raw = np.empty(info.nbytes, np.uint8)
        if info.nbytes:
            self._read_into(info, info.offset, raw)
        return _to_array(raw, info.dtype, info.shape)

    def close(self) -> None:
        with self._lock:
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()
        self._local = threading.local()  # the buffers go with the load


def load_checkpoint_weights(directory) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint directory, read whole (floats as float32): for tests and
    small models; `sapwood.load` streams instead (loading.CheckpointTensors)."""
    index = checkpoint_index(directory)
    reader = TensorReader(0)
    try:
        return {name: reader.read(info) for name, info in index.items()}
    finally:
        reader.close()
