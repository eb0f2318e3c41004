"""Weight formats and the quantized matmuls (numpy oracles).

The formats are csrc/weights.h's, in the plain row-major layout a GPU backend stores
(W [rows = outputs, cols = inputs], y = x W^T):
    bf16  uint16 bits, round to nearest even from float32.
    q8    int8 [rows, cols_pad] (cols_pad a multiple of 32, zero padded), scale [rows]:
          scale = amax / 127 per row, q = clip(rint(w / scale), -127, 127), scale 0 -> 0.
    q4    groups of 64 inputs, scale = amax / 7 per (row, group), q in [-7, 7] stored as q + 8
          in nibbles; byte j of a group holds input j (low nibble) and input j + 32 (high):
          uint8 [rows, cols_pad / 2] (cols_pad a multiple of 64, padding q = 0), scale
          [rows, cols_pad / 64].
Activations of the int8 matmuls are quantized per row like q8 (scale = amax / 127), and the
dots are exact integers; the oracles below sum in float64.
"""
from __future__ import annotations

import numpy as np

Q4_GROUP = 64


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def quantize_block(x: np.ndarray, qmax: float) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int quantization of each row of x [..., n] (float32 arithmetic, as the CPU's
    quantize_block): scale = amax / qmax, q = clip(rint(x / scale), -qmax, qmax)."""
    x = np.asarray(x, np.float32)
    scale = (np.abs(x).max(axis=-1) / np.float32(qmax)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    q = np.where(scale[..., None] == 0, 0, np.clip(np.rint(x / safe), -qmax, qmax))
    return q.astype(np.int8), scale


def to_bf16(w) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(w, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(b) -> np.ndarray:
    return (np.asarray(b, np.uint32) << 16).view(np.float32)


def q8_weights(w) -> tuple[np.ndarray, np.ndarray]:
    """W [rows, cols] float32 -> (q int8 [rows, cols_pad], scale [rows])."""
    w = np.asarray(w, np.float32)
    q, s = quantize_block(w, 127)
    return np.pad(q, ((0, 0), (0, round_up(w.shape[1], 32) - w.shape[1]))), s


def q8_dequantize(q, scale, cols: int) -> np.ndarray:
    return (q[:, :cols].astype(np.float32) * np.asarray(scale, np.float32)[:, None]).astype(np.float32)


def q4_weights(w) -> tuple[np.ndarray, np.ndarray]:
    """W [rows, cols] float32 -> (packed uint8 [rows, cols_pad / 2], scale [rows, groups])."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    pad = round_up(cols, Q4_GROUP)
    groups = pad // Q4_GROUP
    q = np.zeros((rows, pad), np.int8)
    scale = np.zeros((rows, groups), np.float32)
    for g in range(groups):  # each group over its real inputs only (the last may be short)
        k0, k1 = g * Q4_GROUP, min(cols, (g + 1) * Q4_GROUP)
        q[:, k0:k1], scale[:, g] = quantize_block(w[:, k0:k1], 7)
    n = (q.astype(np.int16) + 8).astype(np.uint8).reshape(rows, groups, 2, Q4_GROUP // 2)
    return (n[:, :, 0] | (n[:, :, 1] << 4)).reshape(rows, pad // 2), scale


def q4_unpack(packed) -> np.ndarray:
    """packed [rows, cols_pad / 2] -> q int8 [rows, cols_pad]."""
    rows, half = packed.shape
    b = packed.reshape(rows, -1, Q4_GROUP // 2)
    q = np.concatenate([b & 15, b >> 4], axis=-1).astype(np.int8) - 8
    return q.reshape(rows, 2 * half)


def q4_dequantize(packed, scale, cols: int) -> np.ndarray:
    q = q4_unpack(packed).astype(np.float32)
    s = np.repeat(np.asarray(scale, np.float32), Q4_GROUP, axis=1)
    return (q * s)[:, :cols].astype(np.float32)


def quantize_acts(x, cols_pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row int8 activations (csrc QActs): (xq [n, cols_pad] zero padded, xs [n])."""
    q, s = quantize_block(x, 127)
    return np.pad(q, ((0, 0), (0, cols_pad - q.shape[1]))), s


def q8_matmul(wq, ws, xq, xs) -> np.ndarray:
    """y [n, rows] in float64: exact int dots scaled by the weight's and the row's scale."""
    dot = xq.astype(np.int64) @ wq.astype(np.int64).T
    return dot * np.asarray(ws, np.float64)[None, :] * np.asarray(xs, np.float64)[:, None]


def q4_matmul(packed, scale, xq, xs) -> np.ndarray:
    """y [n, rows] in float64: per group the exact int dot times its scale, summed, times the
    row's activation scale."""
    q = q4_unpack(packed).astype(np.int64)                       # [rows, pad]
    rows, pad = q.shape
    x = np.asarray(xq, np.int64).reshape(len(xq), pad // Q4_GROUP, Q4_GROUP)
    dots = np.einsum("ngk,ogk->nog", x, q.reshape(rows, -1, Q4_GROUP))  # [n, rows, groups]
    y = (dots * np.asarray(scale, np.float64)[None]).sum(-1)
    return y * np.asarray(xs, np.float64)[:, None]
