"""What the formats share: float rows as read, and a tensor read with another shape."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..safetensors_io import TensorInfo, TensorReader


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint32) << 16).view(np.float32)


def _f32(x: np.ndarray) -> np.ndarray:
    """A float tensor's rows as read (bf16 as its uint16 bits) as a new float32 array."""
    return _bf16_bits(x) if x.dtype == np.uint16 else x.astype(np.float32)


def engine_q4_group(group: int) -> int:
    """The engine's affine 4-bit group (QMatrix's q4a) that holds a format's groups of `group`
    inputs as stored: 32 as is, a multiple of 64 as groups of 64 that repeat its scale and bias;
    0 for any other size."""
    return 32 if group == 32 else 64 if group > 0 and group % 64 == 0 else 0


def pack_q4_affine(q: np.ndarray, s: np.ndarray, b: np.ndarray, group: int):
    """Rows of 4-bit values q [n, cols] (0..15) with a scale s and bias b [n, cols / group] per
    `group` inputs (weight = s * q + b), as the engine stores affine groups (csrc/weights.h):
    nibbles (an engine group of G inputs: byte j holds input j low and j + G / 2 high), scales
    and biases per engine group, and the largest |weight| (a group's extremes sit at its
    smallest and largest q: the weight is linear in q)."""
    n = q.shape[0]
    eg = engine_q4_group(group)
    per = group // eg
    s, b = np.repeat(s, per, axis=1), np.repeat(b, per, axis=1)
    g = q.astype(np.uint8).reshape(n, -1, eg)
    nibbles = np.ascontiguousarray(g[:, :, :eg // 2] | (g[:, :, eg // 2:] << 4)).reshape(-1)
    ends = [s * g.min(axis=2).astype(np.float32) + b, s * g.max(axis=2).astype(np.float32) + b]
    amax = float(max(np.abs(e).max() for e in ends)) if g.size else 0.0
    return nibbles, np.ascontiguousarray(s).reshape(-1), np.ascontiguousarray(b).reshape(-1), amax


@dataclass(frozen=True)
class Relaid:
    """A stored tensor read with another shape (same bytes, e.g. conv1d [C, K, 1] as [C, 1, K]),
    minus `minus` when nonzero (MLX's RMSNorm weights, stored plus one)."""
    name: str
    info: TensorInfo
    shape: tuple
    minus: float = 0.0

    @property
    def dtype(self) -> str:
        return "F32" if self.minus else self.info.dtype

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    @property
    def row_bytes(self) -> int:
        return self.info.nbytes // self.shape[0] if self.shape[0] else 0

    def rows(self, reader: TensorReader, r0: int, r1: int) -> np.ndarray:
        if not self.minus:  # rows of the new shape are whole rows of the stored bytes
            return reader.rows(self._flat(), r0, r1)
        return _f32(reader.rows(self._flat(), r0, r1)) - np.float32(self.minus)

    def _flat(self) -> TensorInfo:
        return TensorInfo(self.info.path, self.info.dtype, self.shape, self.info.offset,
                          self.info.nbytes)


