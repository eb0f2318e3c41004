"""Sampling keyed by (seed, position, id): see docs/design.md and the spec in reference/sampling.py.

`sample` runs the engine's sampler (csrc/sampler.cpp: selection instead of a sort of the
vocabulary, noise only where it can win), which draws the reference's tokens bit for bit.
Ties go to the lower id everywhere. T = 0 is plain argmax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from . import _core
from .reference import sampling as reference
from .reference.sampling import as_u64

# Ranges of the numbers a request may set. Logits reach the sampler as finite float32 of magnitude
# at most 1e30 (loading refuses an LM head whose weights could give more: loading.MAX_LOGIT_BOUND),
# and apply_penalties works in float32 (max 3.4e38). A repetition penalty r divides a positive
# logit or multiplies a negative one, so within [0.01, 100] a penalised logit stays below 1e32;
# presence and frequency penalties within OpenAI's [-2, 2] move a logit by at most
# 2 + 2 * count <= 2 + 2 * 2**24 (the context's limit). Every penalised row is therefore finite:
# an unbounded penalty (r = 1e-300 passed the old "> 0") turned seen tokens' logits into +inf and
# made every pick raise. Temperature needs no upper bound: the sampler shifts each row by its max
# before dividing, so any finite T >= 0 gives finite or -inf (probability 0) scores, never +inf
# or NaN. top_k at most 2**31 - 1: token ids are int32 in the engine, so no vocabulary is larger
# (a k at or past the vocabulary's size keeps every id).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_RANGE = (-2.0, 2.0)   # presence_penalty, frequency_penalty
TOP_K_MAX = 2 ** 31 - 1
SEED_LIMIT = 2 ** 64


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def validate(self) -> "SamplingParams":
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise ValueError(f"{f.name}={v!r}: must be a number")
            if isinstance(v, (float, np.floating)) and not math.isfinite(v):
                raise ValueError(f"{f.name}={v!r}: must be finite")
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        if t < 0:
            raise ValueError(f"temperature={t!r}: must be >= 0 (0 is greedy)")
        if not isinstance(k, (int, np.integer)) or not 0 <= k <= TOP_K_MAX:
            raise ValueError(f"top_k={k!r}: must be an int in [0, {TOP_K_MAX}] (0 disables)")
        if not 0 < p <= 1:
            raise ValueError(f"top_p={p!r}: must be in (0, 1]")
        if not 0 <= m <= 1:
            raise ValueError(f"min_p={m!r}: must be in [0, 1]")
        if not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed={self.seed!r}: must be an int in [0, 2**64)")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r}: must be in "
                             f"[{lo}, {hi}] (1 is off; outside it penalised logits could "
                             "overflow)")
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise ValueError(f"{name}={v!r}: must be in [{lo}, {hi}] (0 is off)")
        return self

    def engine_kwargs(self) -> dict:
        """The engine's sampling keyword arguments (_core.sample, Engine.verify_walk)."""
        return {f.name: (int if f.name in ("top_k", "seed") else float)(getattr(self, f.name))
                for f in fields(self)}

    @property
    def tree_eligible(self) -> bool:
        # Penalties change the logits at position t according to the tokens generated before t.
        # Inside a speculative tree those tokens are the (uncommitted) path to each node, which
        # the verifier's single batched logits pass does not apply per path; the chain applies
        # them token by token after each commit, so penalised requests always use the chain.
        return (self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0)


def check_logits(logits) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"logits shape {x.shape}: must be [V] or [N, V] with V > 0")
    x = x.astype(np.float64)
    if np.isnan(x).any():
        raise ValueError(f"logits contain NaN (first at flat index {int(np.isnan(x).argmax())})")
    if np.isposinf(x).any():
        raise ValueError("logits contain +inf")
    if x.size and not np.isfinite(x).any(axis=-1).all():
        raise ValueError("a logits row is all -inf: nothing can be sampled")
    return x


def filtered_probs(logits, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The exact distribution `sample` draws from: same shape as logits ([V] or [N, V]),
    0 outside the kept set, renormalised inside it. T = 0 is one-hot at the argmax."""
    SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).validate()
    x = check_logits(logits)
    p = reference.filtered_probs(np.atleast_2d(x), temperature, top_k, top_p, min_p)
    return p.reshape(x.shape)


def sample(logits, positions, *, seed=0, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
           history=(), repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
           mask=None):
    """logits [V] with an int position -> int; logits [N, V] with positions [N] -> int64 [N].
    `position` is the index the sampled token will have in the sequence (prompt included).
    Penalties apply to every row, counting the token ids in `history` (the caller chooses
    which count: generate passes the whole context), as reference.apply_penalties does.
    mask: allowed-token bitmasks (int32/uint32 [N, ceil(V/32)], or [ceil(V/32)] for logits
    [V]: the layout llguidance and xgrammar fill), applied before everything else: a
    disallowed id is never drawn; a row allowing nothing raises ValueError."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=seed, repetition_penalty=repetition_penalty,
                            presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty).validate()
    x = np.asarray(logits)
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"logits shape {x.shape}: must be [V] or [N, V] with V > 0")
    pos = np.asarray(positions)
    if x.ndim == 1 and pos.ndim != 0:
        raise ValueError(f"positions shape {pos.shape}: logits [V] take one int position")
    if x.ndim == 2 and pos.shape != (x.shape[0],):
        raise ValueError(f"positions shape {pos.shape}: must be ({x.shape[0]},) for logits "
                         f"shape {x.shape}")
    pos = as_u64(pos, "positions").reshape(-1)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)  # exact for every float16 and int32; what check_logits takes
    if mask is not None:
        mask = np.asarray(mask)
        if x.ndim == 1 and mask.ndim == 1:
            mask = mask[None]
    tok = _core.sample(np.ascontiguousarray(np.atleast_2d(x)), pos, **params.engine_kwargs(),
                       history=history, mask=mask)
    return int(tok[0]) if x.ndim == 1 else tok
