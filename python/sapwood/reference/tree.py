"""Tree bookkeeping shared by every reference: parents -> depths, root-to-node paths.

A tree of N nodes is given by `parents[N]`: parents[0] == -1 (the root) and 0 <= parents[i] < i
for i > 0, so nodes come in topological order and node i sits at position P + depth(i).
"""
from __future__ import annotations

import numpy as np


def check_parents(parents) -> np.ndarray:
    """Validate a parents array and return it as int64. Raises ValueError naming the bad entry."""
    p = np.asarray(parents)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"parents must be a non-empty 1-D array, got shape {p.shape}")
    if not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"parents must be integers, got dtype {p.dtype}")
    p = p.astype(np.int64)
    if p[0] != -1:
        raise ValueError(f"parents[0] must be -1 (the root), got {p[0]}")
    for i in range(1, p.size):
        if not 0 <= p[i] < i:
            raise ValueError(f"parents[{i}] = {p[i]} must satisfy 0 <= parents[i] < {i}")
    return p


def depths(parents) -> np.ndarray:
    p = check_parents(parents)
    d = np.zeros(p.size, dtype=np.int64)
    for i in range(1, p.size):
        d[i] = d[p[i]] + 1
    return d


def path_to(parents, i: int) -> list[int]:
    """Node indices from the root to node i, root first."""
    p = check_parents(parents)
    out = [int(i)]
    while p[out[-1]] >= 0:
        out.append(int(p[out[-1]]))
    return out[::-1]


def check_path(parents, path) -> list[int]:
    """A commit path must be [0, ..., leaf], each node the child of the one before."""
    p = check_parents(parents)
    path = [int(x) for x in path]
    if not path or path[0] != 0:
        raise ValueError(f"path must start at the root 0, got {path}")
    for a, b in zip(path, path[1:]):
        if not 0 <= b < p.size or p[b] != a:
            raise ValueError(f"path {path}: node {b} is not a child of node {a}")
    return path
