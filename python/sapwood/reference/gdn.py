"""Pathwise Gated DeltaNet (numpy reference, float64).

Per layer: C = 2*Hk*dk + Hv*dv mixed channels x (the in_proj_qkv output, before the conv).
    y = silu(causal_depthwise_conv1d(x)) with conv weight w [C, K] and a window of the K-1
        previous inputs; y splits into q [Hk, dk] | k [Hk, dk] | v [Hv, dv] (head-major).
    q, k are L2-normalised (x * rsqrt(sum(x^2) + 1e-6)), then q /= sqrt(dk).
    Per value head h (reading key head kh(h)), state S [dk, dv]:
        S *= exp(g); u = S^T k; d = beta * (v - u); S += k d^T; o = S^T q
Head order: 'grouped' -> kh = h // (Hv // Hk); 'tiled' -> kh = h % Hk.

`GDNReference` holds the committed state: S, the conv window, and "pending" tokens whose tape
(k, v, g, beta) was committed but not yet folded into S. verify() folds them first into a copy;
this must not change any output, which the tests check against the fast kernels.
"""
from __future__ import annotations

import numpy as np

from .tree import check_parents, check_path, path_to

L2_EPS = 1e-6


def key_head_map(hk: int, hv: int, order: str = "grouped") -> np.ndarray:
    if hv % hk:
        raise ValueError(f"Hv={hv} must be a multiple of Hk={hk}")
    h = np.arange(hv)
    if order == "grouped":
        return h // (hv // hk)
    if order == "tiled":
        return h % hk
    raise ValueError(f"head order must be 'grouped' or 'tiled', got {order!r}")


def l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + L2_EPS)


def silu(x):
    return x / (1.0 + np.exp(-x))


def conv_silu(window: np.ndarray, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """window [K-1, C] (oldest first) then x [C] -> silu(sum_t w[:, t] * inputs[t])."""
    inputs = np.concatenate([window, x[None]], axis=0)  # [K, C]
    return silu((inputs * w.T).sum(0))


def split_qkv(y, hk, hv, dk, dv):
    q = y[: hk * dk].reshape(hk, dk)
    k = y[hk * dk: 2 * hk * dk].reshape(hk, dk)
    v = y[2 * hk * dk:].reshape(hv, dv)
    return l2norm(q) / np.sqrt(dk), l2norm(k), v


def gdn_step(S, q, k, v, g, beta):
    """One token for every value head. S [Hv, dk, dv]; q, k [Hv, dk]; v [Hv, dv]; g, beta [Hv]."""
    S = S * np.exp(g)[:, None, None]
    u = np.einsum("hkv,hk->hv", S, k)
    d = beta[:, None] * (v - u)
    S = S + k[:, :, None] * d[:, None, :]
    return S, np.einsum("hkv,hk->hv", S, q)


class GDNReference:
    def __init__(self, hk, hv, dk, dv, conv_w, head_order="grouped"):
        self.hk, self.hv, self.dk, self.dv = hk, hv, dk, dv
        self.w = np.asarray(conv_w, np.float64)  # [C, K]
        self.kmap = key_head_map(hk, hv, head_order)
        c, kk = self.w.shape
        if c != 2 * hk * dk + hv * dv:
            raise ValueError(f"conv weight has {c} channels, expected {2 * hk * dk + hv * dv}")
        self.S = np.zeros((hv, dk, dv))
        self.window = np.zeros((kk - 1, c))
        self.pending: list[tuple] = []  # (k [Hv,dk], v, g, beta) committed but not folded
        self._tape = None

    def _token(self, window, x, g, beta):
        q, k, v = split_qkv(conv_silu(window, x, self.w), self.hk, self.hv, self.dk, self.dv)
        return q[self.kmap], k[self.kmap], v, np.asarray(g, np.float64), np.asarray(beta, np.float64)

    def verify(self, x, g, beta, parents) -> np.ndarray:
        """x [N, C], g [N, Hv], beta [N, Hv] -> o [N, Hv, dv]. The committed state is unchanged."""
        parents = check_parents(parents)
        S_root = self.S.copy()
        for (k, v, gg, bb) in self.pending:
            S_root, _ = gdn_step(S_root, np.zeros_like(k), k, v, gg, bb)
        n = len(parents)
        out = np.zeros((n, self.hv, self.dv))
        states, toks = [None] * n, [None] * n
        for i in range(n):
            path = path_to(parents, i)
            inputs = np.concatenate([self.window, np.asarray(x, np.float64)[path[:-1]]], axis=0)
            window = inputs[inputs.shape[0] - self.window.shape[0]:]
            q, k, v, gg, bb = self._token(window, np.asarray(x[i], np.float64), g[i], beta[i])
            S_par = S_root if parents[i] < 0 else states[parents[i]]
            states[i], out[i] = gdn_step(S_par, q, k, v, gg, bb)
            toks[i] = (k, v, gg, bb)
        self._tape = (parents, S_root, toks, np.asarray(x, np.float64))
        return out

    def commit(self, path, max_pending: int = 8) -> None:
        parents, S_root, toks, x = self._tape
        path = check_path(parents, path)
        self.S = S_root
        self.pending = [toks[i] for i in path]
        inputs = np.concatenate([self.window, x[path]], axis=0)
        self.window = inputs[inputs.shape[0] - self.window.shape[0]:]
        while len(self.pending) > max_pending:
            k, v, gg, bb = self.pending.pop(0)
            self.S, _ = gdn_step(self.S, np.zeros_like(k), k, v, gg, bb)
        self._tape = None

    def folded_state(self) -> np.ndarray:
        S = self.S.copy()
        for (k, v, gg, bb) in self.pending:
            S, _ = gdn_step(S, np.zeros_like(k), k, v, gg, bb)
        return S
