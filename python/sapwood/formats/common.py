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


