"""Speculation policy: the admission EMA (chain or wide?) and the width rule (how wide?).

Admission EMA (DESIGN.md): `avg` starts at R; after each cycle avg += alpha * (retained - avg)
with `retained` the draft rows the committed path kept; the next cycle goes wide only while
avg < threshold. High chain acceptance means the chain already captures the draft's value.

Width rule: choose w in [1, max_width] maximising expected committed tokens per second,
    E(w) / t(w, ctx),   E(w) = 1 + sum_{i=1}^{w-1} prod_{n on path(i)} a(rank_n, q_n)
where a(rank, confidence) is the calibrated chance that the target picks a candidate of that
rank and draft probability given its parent was reached (Beta counts over every verified node
whose parent was on the committed path), and t is a cost model of a whole round, linear in features
[1, w, ctx, w*ctx], fitted by recursive least squares from every round (not one timing per
width), seeded from a prior and kept per context band across requests. The first wide round in a
band the model has not seen is a calibration round: the decoder times the full tree and the root
alone (the full tree's logits serve every prefix, so only the root's verify is extra) and feeds
both to the fit before choosing, so even a fresh process's first request starts from measured
costs rather than the prior.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .tree import Tree


@dataclass
class AdmissionEMA:
    rows: int = 8
    alpha: float = 0.125
    threshold: float = 6.5
    avg: float = field(default=None)

    def __post_init__(self):
        if not 0 < self.alpha <= 1:
            raise ValueError(f"EMA alpha must be in (0, 1], got {self.alpha}")
        if self.avg is None:
            self.avg = float(self.rows)

    def wide(self) -> bool:
        return self.avg < self.threshold

    def update(self, retained: int) -> None:
        self.avg += self.alpha * (retained - self.avg)


class CostModel:
    """Round time (seconds) as a linear function of [1, w, c, w*c] with c = ctx / 4096, by
    recursive least squares (a Kalman filter on the coefficients) with slight forgetting; one
    fit per context band. Coefficients are kept in units of the prior intercept, where the
    prior uncertainty (rel_uncertainty per coefficient) and the per-round timing noise
    (noise, relative) are both meaningful numbers."""

    BANDS = (1024, 4096, 16384)

    def __init__(self, prior=(4e-3, 1e-3, 1e-3, 5e-4), rel_uncertainty=2.0, noise=0.05,
                 forget=0.995):
        prior = np.asarray(prior, np.float64)
        self.unit = float(prior[0])
        self.theta0 = prior / self.unit
        # Prior covariance proportional to each coefficient's size: a round observed at one
        # width corrects intercept and slope in proportion.
        self.P0 = np.diag((rel_uncertainty * self.theta0) ** 2)
        self.noise, self.forget = noise ** 2, forget
        self._fits: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._widths: dict[int, set] = {}  # widths observed per band
        self.samples = 0

    @staticmethod
    def _phi(w, ctx):
        c = ctx / 4096.0
        return np.array([1.0, w, c, w * c])

    def _band(self, ctx) -> int:
        b = int(np.searchsorted(self.BANDS, ctx, side="right"))
        if b not in self._fits:
            self._fits[b] = (self.theta0.copy(), self.P0.copy())
        return b

    def calibrated(self, ctx) -> bool:
        """Has the band of ctx seen rounds of two widths or more (enough to separate intercept
        and slope)? If not, the decoder measures a calibration round first."""
        return len(self._widths.get(self._band(ctx), ())) >= 2

    def predict(self, w, ctx) -> float:
        return float(self.predict_widths(np.array([w]), ctx)[0])

    def predict_widths(self, ws, ctx) -> np.ndarray:
        """predict() for an array of widths at one context, in one product."""
        theta, _ = self._fits[self._band(ctx)]
        # a wider round never costs less: noisy timings (a shared machine) can fit a negative
        # width slope, which would send the rule to the widest tree every time
        theta = np.array([theta[0], max(theta[1], 0.0), theta[2], max(theta[3], 0.0)])
        ws = np.asarray(ws, np.float64)
        c = ctx / 4096.0
        phi = np.stack([np.ones_like(ws), ws, np.full_like(ws, c), ws * c], axis=1)
        return np.maximum(phi @ theta * self.unit, 1e-7)

    def observe(self, w, ctx, seconds) -> None:
        b = self._band(ctx)
        theta, P = self._fits[b]
        x = self._phi(w, ctx)
        Px = P @ x
        k = Px / (self.noise + x @ Px)
        theta = theta + k * (seconds / self.unit - x @ theta)
        P = (P - np.outer(k, Px)) / self.forget
        self._fits[b] = (theta, P)
        self._widths.setdefault(b, set()).add(int(w))
        self.samples += 1


class AcceptanceModel:
    """Calibrated chance a(rank, confidence) that a candidate is accepted given its parent was.

    Confidence is the drafter's own probability for the candidate, in buckets: it predicts
    acceptance far better than depth does (a confident draft row is accepted wherever it sits,
    an unsure one is not), which lets the width rule cut a chain where the drafter loses
    confidence and branch where it hesitates. Before any observation a cell's chance is a prior
    by rank; Beta counts take over as rounds come."""

    EDGES = np.array([0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.97])  # 11 buckets

    def __init__(self, max_rank=16, prior_strength=2.0):
        # The prior is by rank only (top ranks likely), not the bucket's own probability: drafts
        # are often far from calibrated (the bundled one is underconfident: rank-0 candidates it
        # gives 0.2-0.35 are accepted ~90% of the time), and a pessimistic prior for a bucket
        # never verified would never be corrected.
        self.prior = np.tile((0.7 / (1.0 + np.arange(max_rank)))[:, None], (1, len(self.EDGES) + 1))
        self.offered = np.zeros_like(self.prior)
        self.accepted = np.zeros_like(self.prior)
        self.strength = prior_strength

    def _cell(self, rank, logprob):
        r = np.minimum(rank, self.offered.shape[0] - 1)
        c = np.searchsorted(self.EDGES, np.exp(np.minimum(logprob, 0.0)), side="right")
        return r, c

    def chance(self, rank, logprob):
        r, c = self._cell(np.asarray(rank), np.asarray(logprob, float))
        return (self.accepted[r, c] + self.strength * self.prior[r, c]) / (self.offered[r, c] + self.strength)

    def observe(self, tree: Tree, path) -> None:
        on_path = np.zeros(tree.width, bool)
        on_path[list(path)] = True
        nodes = np.flatnonzero(on_path[tree.parents[1:]]) + 1  # nodes whose parent was reached
        if nodes.size:
            r, c = self._cell(tree.rank[nodes], tree.q[nodes])
            np.add.at(self.offered, (r, c), 1)
            np.add.at(self.accepted, (r, c), on_path[nodes])

    def expected_tokens(self, tree: Tree) -> np.ndarray:
        """E(w) for every prefix w = 1..tree.width (the prefix property makes this a cumsum)."""
        ch = self.chance(tree.rank[1:], tree.q[1:]).tolist()  # one lookup
        parents = tree.parents.tolist()
        reach = [1.0]
        for i in range(1, tree.width):
            reach.append(reach[parents[i]] * ch[i - 1])
        return np.cumsum(reach)


@dataclass
class WidthRule:
    max_width: int = 16
    cost: CostModel = field(default_factory=CostModel)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)

    def rate(self, tree: Tree, ctx: int) -> np.ndarray:
        """Expected committed tokens per second of every prefix w = 1..tree.width."""
        e = self.acceptance.expected_tokens(tree)
        return e / self.cost.predict_widths(np.arange(1, tree.width + 1), ctx)

    def choose(self, tree: Tree, ctx: int) -> int:
        """Best width for this round's candidate tree (built at max width) at context ctx."""
        return int(np.argmax(self.rate(tree, ctx))) + 1

    def choose_tree(self, candidates, ctx: int) -> Tree:
        """The best prefix of any candidate tree (e.g. the best-first tree and the drafter's
        chain), by the same expected tokens per second."""
        rates = [self.rate(t, ctx) for t in candidates]
        k = int(np.argmax([r.max() for r in rates]))
        return candidates[k].prefix(int(np.argmax(rates[k])) + 1)
