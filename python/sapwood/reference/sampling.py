"""The keyed sampler's oracle (docs/design.md "Sampling keyed by (seed, position, id)"); the
engine's sampler (csrc/sampler.cpp) draws the same tokens bit for bit, and
tests/test_sampling.py holds the two together on every mode.

    mix(z): z += 0x9E3779B97F4A7C15; z = (z ^ z>>30) * 0xBF58476D1CE4E5B9;
            z = (z ^ z>>27) * 0x94D049BB133111EB; return z ^ z>>31      (all mod 2^64)
    u = ((mix(mix(mix(seed) ^ position) ^ id) >> 11) + 0.5) * 2^-53      # in (0, 1)
    token = argmax over kept ids of  s[id] - log(-log(u))                # ties: lower id

with s = (logits - max) / T in float64 (the shift is a per-row constant: the argmax is the one
of logits / T, but a tiny T cannot overflow to inf - inf). This is the Gumbel-max trick: the
argmax is an exact draw from the filtered distribution, and since the noise depends only on
(seed, position, id) -- not on how many draws came before -- a tree node draws the same token
that chain or plain decoding would draw at that position.

Kept ids, in this order: finite s; top-k keeps the k first in the order (s descending, ties to
the lower id); top-p keeps the ranks r of that order, over the top-k set, whose integer weights
w = floor(e^s * 2^40) before r sum below ceil(ceil(p * 2^32) * total / 2^32): the smallest
prefix whose mass reaches p, with the mass in exact integers so that no summation order can
change it (and p quantised up to a multiple of 2^-32); min-p keeps e^s >= min_p (e^s is the
probability relative to the largest). T = 0 is plain argmax (the first maximum).

exp and log are the C library's (math.exp, math.log), which the engine's sampler calls too:
numpy's vectorised exp/log differ from them in the last bit on a few percent of inputs, and a
last bit is enough to move a top-p cut or a near-tie. Slow, and meant to be: it is the spec.
"""
from __future__ import annotations

import math

import numpy as np

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = (np.uint64(s) for s in (30, 27, 31, 11))
WEIGHT_SCALE = 2 ** 40
TOP_P_SCALE = 2 ** 32

_libm_exp = np.frompyfunc(math.exp, 1, 1)
_libm_log = np.frompyfunc(math.log, 1, 1)


def libm_exp(x) -> np.ndarray:
    return np.asarray(_libm_exp(np.asarray(x, dtype=np.float64)), dtype=np.float64)


def libm_log(x) -> np.ndarray:
    return np.asarray(_libm_log(np.asarray(x, dtype=np.float64)), dtype=np.float64)


def mix64(z) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays, all arithmetic mod 2^64."""
    z = np.asarray(z, dtype=np.uint64)
    # Wraparound is the point of the hash; numpy warns on overflow for 0-d/scalar uint64 ops.
    with np.errstate(over="ignore"):
        z = z + _GAMMA
        z = (z ^ (z >> _S30)) * _M1
        z = (z ^ (z >> _S27)) * _M2
        return np.asarray(z ^ (z >> _S31), dtype=np.uint64)


def as_u64(x, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {a.dtype}")
    if a.dtype.kind == "i" and a.size and a.min() < 0:
        raise ValueError(f"{what} must be >= 0, got {int(a.min())}")
    return a.astype(np.uint64)


def keyed_uniform(seed, position, ids) -> np.ndarray:
    """u in (0, 1) per (seed, position, id); seed, position and ids broadcast together."""
    s, p, i = (as_u64(x, w) for x, w in ((seed, "seed"), (position, "position"), (ids, "ids")))
    h = mix64(mix64(mix64(s) ^ p) ^ i)
    # The top 53 bits are exact in float64; +0.5 keeps u strictly inside (0, 1) so log(-log(u))
    # is finite.
    return ((h >> _S11).astype(np.float64) + 0.5) * 2.0 ** -53


def scaled(x: np.ndarray, temperature: float) -> np.ndarray:
    """[N, V] float64 -> (x - rowmax) / T."""
    with np.errstate(over="ignore"):
        return (x - x.max(axis=1, keepdims=True)) / temperature


def kept(s: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """[N, V] scaled logits (row max 0) -> bool [N, V] kept set; never empty (the max survives
    every filter: top-k k >= 1, top-p's first rank, min-p's ratio 1 >= min_p)."""
    n, v = s.shape
    keep = np.isfinite(s)                           # -inf logits have probability 0
    if not 0 < top_k < v and top_p >= 1.0 and min_p <= 0.0:
        return keep
    order = np.argsort(-s, axis=1, kind="stable")  # descending, ties: lower id first
    ss = np.take_along_axis(s, order, axis=1)
    keep = np.isfinite(ss)
    if 0 < top_k < v:
        keep[:, top_k:] = False
    if top_p < 1.0:
        w = np.where(keep, np.floor(libm_exp(ss) * WEIGHT_SCALE), 0.0).astype(np.uint64)
        ww = w.astype(object)                       # exact sums past 2^64
        before = np.cumsum(ww, axis=1) - ww
        threshold = -(-(math.ceil(top_p * TOP_P_SCALE) * ww.sum(axis=1)) // TOP_P_SCALE)
        keep &= (before < threshold[:, None]).astype(bool)
    if min_p > 0.0:
        keep &= libm_exp(ss) >= min_p
    out = np.empty_like(keep)
    np.put_along_axis(out, order, keep, axis=1)
    return out


def filtered_probs(x: np.ndarray, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Checked float64 logits [N, V] -> the exact distribution sample draws from [N, V]: 0
    outside the kept set, renormalised inside it. T = 0 is one-hot at the argmax."""
    if temperature == 0:
        p = np.zeros_like(x)
        p[np.arange(len(x)), x.argmax(axis=1)] = 1.0
        return p
    s = scaled(x, temperature)
    p = np.where(kept(s, top_k, top_p, min_p), np.exp(s), 0.0)
    return p / p.sum(axis=1, keepdims=True)


def allowed(mask, v: int) -> np.ndarray:
    """Allowed-token bitmasks [N, ceil(v/32)] (int32 or uint32: bit i % 32 of word i // 32
    allows id i, llguidance's and xgrammar's layout) -> bool [N, v]."""
    m = np.ascontiguousarray(np.asarray(mask).astype(np.uint32, copy=False)).astype("<u4")
    bits = np.unpackbits(m.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :v].astype(bool)


def apply_mask(x: np.ndarray, mask) -> np.ndarray:
    """Logits [N, V] with the ids the mask disallows at -inf: the mask comes before every other
    step (penalties leave -inf at -inf, so before or after them is the same). A row that
    allows nothing, or only -inf logits, raises."""
    ok = allowed(mask, x.shape[1])
    out = np.where(ok, x, -np.inf)
    for r in range(len(x)):
        if not ok[r].any():
            raise ValueError(f"token mask row {r} allows no token: nothing can be sampled")
        if not np.isfinite(out[r]).any():
            raise ValueError(f"token mask row {r} allows only tokens whose logits are -inf: "
                             "nothing can be sampled")
    return out


def sample(x: np.ndarray, positions: np.ndarray, *, seed=0, temperature=0.0, top_k=0, top_p=1.0,
           min_p=0.0, mask=None) -> np.ndarray:
    """Checked float64 logits [N, V], positions uint64 [N] -> int64 tokens [N]. mask: allowed-
    token bitmasks [N, ceil(V/32)] (apply_mask), or None."""
    if mask is not None:
        x = apply_mask(x, mask)
    if temperature == 0:
        return x.argmax(axis=1).astype(np.int64)
    s = scaled(x, temperature)
    keep = kept(s, top_k, top_p, min_p)
    rows, ids = np.nonzero(keep)
    u = keyed_uniform(seed, positions[rows], ids)
    score = np.full(s.shape, -np.inf)
    score[rows, ids] = s[rows, ids] - libm_log(-libm_log(u))
    return score.argmax(axis=1).astype(np.int64)  # first maximum: ties to the lower id


def apply_penalties(logits, history_ids, params) -> np.ndarray:
    """logits [V], history_ids [H] (the caller chooses which tokens count: HF's repetition
    penalty usually includes the prompt, OpenAI's presence/frequency only generated tokens);
    params: a checked sampling.SamplingParams.

    Repetition (HF): for ids in history, logit > 0 is divided by the penalty, otherwise
    multiplied. Then presence/frequency (OpenAI): logit -= presence * [count > 0] +
    frequency * count. Returns a new float array; the input is not modified."""
    x = np.array(logits, dtype=np.result_type(np.asarray(logits).dtype, np.float32))
    if x.ndim != 1:
        raise ValueError(f"logits shape {x.shape}: apply_penalties takes one row [V]")
    h = np.asarray(history_ids).reshape(-1)
    if h.size == 0:
        return x
    if h.dtype.kind not in "iu" or h.min() < 0 or h.max() >= x.shape[0]:
        raise ValueError(f"history_ids must be ints in [0, {x.shape[0]}), got "
                         f"{h.min()}..{h.max()} ({h.dtype})")
    counts = np.bincount(h, minlength=x.shape[0])
    seen = counts > 0
    r = params.repetition_penalty
    if r != 1.0:
        x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    x -= (params.presence_penalty * seen + params.frequency_penalty * counts).astype(x.dtype)
    return x
