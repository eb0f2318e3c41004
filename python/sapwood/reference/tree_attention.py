"""Tree attention over a committed history plus a tree of new nodes (numpy reference).

Shapes: q [N, Hq, D]; history k, v [P, Hkv, D]; tree k, v [N, Hkv, D]; parents [N].
Query node i sees history positions [0, P) and the tree nodes on its root-to-i path (its
ancestors and itself). GQA: query head h reads KV head h // (Hq // Hkv). Scale D^-0.5.

Query precision: over int8 KV the kernels score with int8 queries, each query vector quantized
per 32 dims exactly as a key is, from its own fp32 values (the CPU: exact integer dot products
per group, scaled and summed over groups in float32; the GPU kernels: the same rounded query
in float arithmetic). In exact arithmetic that is the softmax over `int8_queries(q)`: pass it
as q to either form below. An f32 KV pool keeps fp32 queries.

Two forms side by side, as in flash-linear-attention:
- `tree_attention_naive`: one softmax over all visible keys (float64).
- `tree_attention_split`: split-K over fixed chunks of absolute key positions; each chunk gives
  float64 partials (max, sum, acc) merged by log-sum-exp. This is the structure the kernels use.
"""
from __future__ import annotations

import numpy as np

from .kv import roundtrip
from .tree import check_parents, path_to


def int8_queries(q: np.ndarray) -> np.ndarray:
    """The queries an int8 pool's scores use: each vector int8-roundtripped per 32 dims, like
    a key (reference/kv.py), so a row's value depends only on its own fp32 query."""
    return roundtrip(q)


def _visible(k_hist, v_hist, k_tree, v_tree, parents, i):
    path = path_to(parents, i)
    k = np.concatenate([k_hist, k_tree[path]], axis=0).astype(np.float64)
    v = np.concatenate([v_hist, v_tree[path]], axis=0).astype(np.float64)
    return k, v


def tree_attention_naive(q, k_hist, v_hist, k_tree, v_tree, parents) -> np.ndarray:
    parents = check_parents(parents)
    n, hq, d = q.shape
    hkv = k_tree.shape[1]
    out = np.zeros((n, hq, d), np.float64)
    for i in range(n):
        k, v = _visible(k_hist, v_hist, k_tree, v_tree, parents, i)
        for h in range(hq):
            kh = h // (hq // hkv)
            s = k[:, kh] @ q[i, h].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h] = p @ v[:, kh] / p.sum()
    return out


def tree_attention_split(q, k_hist, v_hist, k_tree, v_tree, parents, split: int = 512) -> np.ndarray:
    """Split-K form: chunk c covers absolute key positions [c*split, (c+1)*split)."""
    parents = check_parents(parents)
    n, hq, d = q.shape
    hkv = k_tree.shape[1]
    out = np.zeros((n, hq, d), np.float64)
    for i in range(n):
        k, v = _visible(k_hist, v_hist, k_tree, v_tree, parents, i)
        for h in range(hq):
            kh = h // (hq // hkv)
            s_all = k[:, kh] @ q[i, h].astype(np.float64) / np.sqrt(d)
            m, l, acc = -np.inf, 0.0, np.zeros(d)
            for c0 in range(0, s_all.size, split):
                s = s_all[c0:c0 + split]
                mc = s.max()
                p = np.exp(s - mc)
                lc, accc = p.sum(), p @ v[c0:c0 + split, kh]
                mn = max(m, mc)  # log-sum-exp merge of (m, l, acc) with (mc, lc, accc)
                a, b = np.exp(m - mn), np.exp(mc - mn)
                m, l, acc = mn, l * a + lc * b, acc * a + accc * b
            out[i, h] = acc / l
    return out
