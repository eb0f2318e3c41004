"""The small ops of the forward and the drafter (numpy oracles) that model.py and ranking.py do
not already define as functions: the q|gate split, the GDN gates, the KV tape's row gather, the
RoPE (cos, sin) table the host computes, and the row selections (argmax, top-k) over logits.
The rest of the op list lives beside the model: rms_norm, sigmoid and rope in model.py, silu in
gdn.py, logsumexp in ranking.py, the weight formats and quantized matmuls in quant.py.
"""
from __future__ import annotations

import numpy as np


def split_q_gate(qg, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """q_proj output [n, Hq * 2D] (per head [q | gate]) -> q, gate [n, Hq, D]."""
    qg = np.asarray(qg).reshape(len(qg), -1, 2 * head_dim)
    return qg[..., :head_dim], qg[..., head_dim:]


def gdn_gates(ba, dt_bias, a_log) -> tuple[np.ndarray, np.ndarray]:
    """ba [n, 2 Hv] = in_proj_b | in_proj_a -> (beta, g) [n, Hv] in float64:
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)."""
    ba = np.asarray(ba, np.float64)
    hv = ba.shape[1] // 2
    beta = 1.0 / (1.0 + np.exp(-ba[:, :hv]))
    g = -np.exp(np.asarray(a_log, np.float64)) * np.logaddexp(0.0, ba[:, hv:] + np.asarray(dt_bias, np.float64))
    return beta, g


def gather_rows(src, idx) -> np.ndarray:
    return np.asarray(src)[np.asarray(idx)]


def rope_table(pos, rotary_dim: int, theta: float) -> np.ndarray:
    """(cos, sin) [n, rotary_dim / 2, 2] float32 per position and frequency, as the engine
    computes them (float64 angles, rounded once)."""
    f = np.arange(rotary_dim // 2, dtype=np.float64)
    inv = 1.0 / np.power(float(theta), 2.0 * f / rotary_dim)
    ang = np.asarray(pos, np.float64)[:, None] * inv[None]
    return np.stack([np.cos(ang), np.sin(ang)], -1).astype(np.float32)


def argmax_rows(x) -> np.ndarray:
    """Per row the first index of the largest non-NaN value; 0 when there is none."""
    out = []
    for row in np.asarray(x, np.float64):
        valid = ~np.isnan(row)
        out.append(int(np.flatnonzero(row == row[valid].max())[0]) if valid.any() else 0)
    return np.array(out, np.int64)


def top_k_rows(x, k: int, skip=None) -> np.ndarray:
    """Per row the k best ids other than skip[row] (-1: none), best first, an equal value's lower
    id first, NaNs never; -1 where fewer qualify."""
    x = np.asarray(x, np.float64)
    out = np.full((len(x), k), -1, np.int64)
    for r, row in enumerate(x):
        order = [int(i) for i in np.argsort(-row, kind="stable")
                 if not np.isnan(row[i]) and (skip is None or i != skip[r])]
        out[r, :min(k, len(order))] = order[:k]
    return out
