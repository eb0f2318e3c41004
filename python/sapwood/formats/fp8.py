"""FP8 block quantization (`quantization_config: {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128]}`, as Qwen's and DeepSeek's FP8 releases and transformers'
finegrained_fp8 write it): `X.weight` holds float8 e4m3 values and `X.weight_scale_inv` one
scale per block of rows x columns; the weight is value * scale (transformers' dequantisation).
Each value widens exactly to float32 and the product is rounded once, to float32: the tensor
the engine gets is within half a float32 ulp of the stored one. Tensors without a scale (the
`modules_to_not_convert`, norms, the GDN parameters) stay as they are stored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..safetensors_io import TensorInfo, TensorReader
from .common import _bf16_bits

SCALE_SUFFIX = "_scale_inv"


def _e4m3_table() -> np.ndarray:
    """float32 value of every e4m3 ("fn": no infinities, S.1111.111 is NaN) bit pattern."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return (sign * v).astype(np.float32)


E4M3 = _e4m3_table()


@dataclass(frozen=True)
class BlockFp8:
    """A float tensor stored as e4m3 values (`weight`) and float32/bf16 scales per
    block[0] x block[1] block (`scale`): what CheckpointTensors reads as float32 rows."""
    name: str
    weight: TensorInfo
    scale: TensorInfo
    block: tuple

    dtype = "F32"  # what it reads as
    quantized = True  # formats.requantized: rounded again in bf16, q8, q4
    q4_group = 0  # no engine kernel runs FP8 blocks as stored

    @property
    def shape(self) -> tuple:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    @property
    def row_bytes(self) -> int:
        return self.weight.row_bytes

    def rows(self, reader: TensorReader, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) as float32 [(r1 - r0) * cols] (a new array)."""
        cols = self.shape[1]
        w = E4M3[reader.rows(self.weight, r0, r1)].reshape(r1 - r0, cols)  # a copy: the reader's
        b0, b1 = self.block                                                # buffer is reused next
        s0, s1 = r0 // b0, (r1 - 1) // b0 + 1
        s = reader.rows(self.scale, s0, s1)
        s = _bf16_bits(s) if s.dtype == np.uint16 else s.astype(np.float32)
        s = s.reshape(s1 - s0, -1)[np.arange(r0, r1) // b0 - s0]       # the scale row of each row
        return (w * np.repeat(s, b1, axis=1)[:, :cols]).reshape(-1)


def fp8_block_size(raw_config: dict) -> tuple | None:
    """(rows, cols) of an FP8 block-quantized checkpoint's scale blocks, None for a checkpoint
    that does not say it is quantized; ValueError for a quantization sapwood does not read."""
    q = raw_config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r}: sapwood reads float "
                         "checkpoints, FP8 block-quantized ones ('fp8'), GPTQ and AWQ int4 "
                         "('gptq', 'awq'), MLX and GGUF files; convert others to bf16 first")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r}: FP8 checkpoints are read in e4m3")
    block = q.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(type(v) is int and 1 <= v <= 1 << 16 for v in block)):
        raise ValueError(f"quantization_config.weight_block_size={block!r}: expected [rows, cols] "
                         "of block scales (per-tensor or per-channel FP8 is not read)")
    return tuple(block)


def fp8_view(index: dict, block: tuple) -> dict:
    """The checkpoint's tensors with every e4m3 weight and its scale as one BlockFp8 (by the
    weight's name); ValueError naming a weight without its scale or a scale of the wrong shape."""
    out = {}
    for name, info in index.items():
        if name.endswith(SCALE_SUFFIX):
            if name[:-len(SCALE_SUFFIX)] not in index:
                raise ValueError(f"scale {name!r} has no tensor {name[:-len(SCALE_SUFFIX)]!r}")
            continue
        scale = index.get(name + SCALE_SUFFIX)
        if info.dtype != "F8_E4M3":
            if scale is not None:
                raise ValueError(f"{name!r} has a scale but holds {info.dtype}, not F8_E4M3")
            out[name] = info
            continue
        if scale is None:
            raise ValueError(f"FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r}")
        if len(info.shape) != 2:
            raise ValueError(f"FP8 tensor {name!r} has shape {info.shape}: block scales need 2-D")
        want = tuple(math.ceil(n / b) for n, b in zip(info.shape, block))
        if tuple(scale.shape) != want or scale.dtype not in ("F32", "BF16"):
            raise ValueError(f"{name + SCALE_SUFFIX!r} is {scale.dtype}{list(scale.shape)}: "
                             f"expected F32 or BF16 {list(want)} for {list(info.shape)} in "
                             f"{block[0]}x{block[1]} blocks")
        out[name] = BlockFp8(name, info, scale, block)
    return out


