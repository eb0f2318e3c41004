"""What a speculative round costs and what it keeps: the two estimators the width rule
(policy.WidthRule) prices widths with, learned from the rounds a model runs.

CostModel: a round's seconds at a width and context (a fitted verify line, per-width medians
where measured, and the rest of the round). AcceptanceModel: the calibrated chance that the
target accepts a drafted candidate given its parent was, by depth, rank and the drafter's
confidence, and from it the best-first tree (C++, tree_growth.h) and E(w) of its prefixes.
"""
from __future__ import annotations

import bisect

import numpy as np

from . import _core
from .tree import Tree


def _median(xs) -> float:
    """statistics.median's value (the mean of the middle two for an even count) without its
    checks and conversions: the cost fit takes a dozen medians a round, and with
    statistics.median verify_line took ~20 us a chain round (per-function timer over cohort
    generations)."""
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


class CostModel:
    """A round's time (seconds) as rest(ctx) + verify(w, ctx).

    verify: the engine's verify of a w-node tree, a line a + b*w per context band (powers of
    two: within a band the context moves little), fitted by Theil-Sen to the median recent
    timing of each width (the slope is the median of the slopes between pairs of widths, the
    intercept the median of what is left; weighting pairs by their width gap was tried and let
    a spiked wide calibration round dominate). A shared machine makes least squares
    unsafe: one preempted calibration round at width 16, three times its cost, once fitted
    8.6 ms a node where a node costs 0.3 ms, and a rule that then stays narrow never sees the
    rounds that would correct it. A median ignores such rounds while they are fewer than ~29%
    of the pairs. Until a band has timings at two widths, the prior line.
    rest: drafting, tree growth, walk and commit, which hardly depend on the width: the median
    of the band's recent rounds (the draft's own attention makes it grow with the context).
    """

    BANDS = tuple(1024 << i for i in range(8))  # 1K .. 128K

    def __init__(self, prior=(1e-3, 3e-4), per_width=8, rest_window=32, min_samples=3,
                 line_weight=2.0):
        self.prior = (float(prior[0]), float(prior[1]))
        self.per_width, self.rest_window = per_width, rest_window
        self.min_samples, self.line_weight = min_samples, line_weight  # verify_widths
        self._obs: dict[int, dict] = {}     # band -> {width: recent seconds}
        self._meds: dict[int, dict] = {}    # band -> {width: their median, None until asked}
        self._lines: dict[int, tuple] = {}  # band -> fitted (a, b), None when stale
        self._rest: dict[int, list] = {}    # band -> recent rest times

    def _band(self, ctx) -> int:
        return bisect.bisect_right(self.BANDS, ctx)  # per round: plain Python, not numpy

    def widths_seen(self, ctx) -> set:
        return set(self._obs.get(self._band(ctx), ()))

    def calibrated(self, ctx) -> bool:
        """Has the band of ctx seen verifies of two widths or more (enough to separate
        intercept and slope)? If not, the decoder measures a calibration round first."""
        return len(self._obs.get(self._band(ctx), ())) >= 2

    def verify_line(self, ctx) -> tuple[float, float]:
        """(a, b): predicted verify seconds a + b*w at ctx, a >= 0 and b >= 0. Fitted to the
        median timing of each width seen (its last `per_width`), so a width verified in most
        rounds counts once, like one verified once."""
        band = self._band(ctx)
        line = self._lines.get(band)
        if line is None:
            line = self.prior
            meds = self._meds.get(band, {})
            if len(meds) >= 2:
                ws = sorted(meds)
                for w in ws:  # the widths observed since the last fit (plain rounds: width 1)
                    if meds[w] is None:
                        meds[w] = _median(self._obs[band][w])
                med = [meds[w] for w in ws]
                slopes = [(med[j] - med[i]) / (ws[j] - ws[i])
                          for i in range(len(ws)) for j in range(i + 1, len(ws))]
                b = max(_median(slopes), 0.0)
                line = (max(_median([t - b * w for w, t in zip(ws, med)]), 0.0), b)
            self._lines[band] = line
        return line

    def slope(self, ctx) -> float:
        """Seconds per verified node at ctx: the line's slope once the band has timed two
        widths; with one width timed, its median time per node, an upper bound (the intercept
        is not negative) that shortens the next draft, whose new width then calibrates the
        band (with 0 there, the bundled pair's padded target at depth 2K drafted 8, 7 and 8
        rows in a fresh band's first three rounds, 37-41 ms each for 1-2 tokens, and the
        fallback then judged speculation on them); 0 before any timing."""
        obs = self._obs.get(self._band(ctx))
        if not obs:
            return 0.0
        if len(obs) >= 2:
            return self.verify_line(ctx)[1]
        (w, times), = obs.items()
        return _median(times) / w

    def rest(self, ctx) -> float:
        r = self._rest.get(self._band(ctx))
        # not np.median: it imports numpy.ma on first use (~40 ms, paid by the first request
        # that drafts; the width study's first request at depth 1 showed it)
        return float(_median(r)) if r else 0.0

    def predict(self, w, ctx) -> float:
        return float(self.predict_widths(np.array([w]), ctx)[0])

    def predict_widths(self, ws, ctx) -> np.ndarray:
        """predict() for an array of widths at one context: the rest plus verify_widths."""
        return np.maximum(self.rest(ctx) + self.verify_widths(ws, ctx), 1e-7)

    def verify_widths(self, ws, ctx) -> np.ndarray:
        """Predicted verify seconds of each width in `ws` at ctx. A width timed `min_samples`
        times or more is priced mostly by its own median (n timings against `line_weight`
        pseudo-timings on the line): a verify's cost is a staircase, not a line (on the padded
        target at depth 1, 2-core Zen 3, verify of 1..9 nodes took 8.7, 12.2, 13.7, 17.7, 21.4,
        23.4, 26.5, 31.0, 31.7 ms; not the int8 matmul's tiles of three rows: a two-row tile
        for the rest left it as it was), and the line through it priced width 3 2.7 ms above
        width 2 where it costs 1.5 more, so the rule verified 2 nodes where the best fixed
        width was 3."""
        a, b = self.verify_line(ctx)  # also refreshes the band's medians
        ws = ws.tolist() if isinstance(ws, np.ndarray) else [int(w) for w in ws]
        v = [a + b * w for w in ws]  # plain floats, twice a round: 16 widths 13 -> 8 us, one 6 -> 4
        band = self._band(ctx)
        meds = self._meds.get(band)
        if meds:
            obs, k, where = self._obs[band], self.line_weight, None
            for w, m in meds.items():
                n = len(obs[w])
                if n < self.min_samples:
                    continue
                if where is None:
                    where = {x: i for i, x in enumerate(ws)}
                i = where.get(w)
                if i is not None:
                    if m is None:
                        m = meds[w] = _median(obs[w])
                    v[i] = (n * m + k * v[i]) / (n + k)
        return np.array(v)

    def observe(self, w, ctx, seconds) -> None:
        """A verify of a w-node tree at ctx took `seconds`."""
        band = self._band(ctx)
        times = self._obs.setdefault(band, {}).setdefault(int(w), [])
        times.append(float(seconds))
        del times[:-self.per_width]
        # its median moved: verify_line recomputes it, and only it (a chain round's refit over 9
        # widths: 12.6 -> 8.8 us in a timeit loop)
        self._meds.setdefault(band, {})[int(w)] = None
        self._lines[band] = None

    def observe_rest(self, ctx, seconds) -> None:
        """The rest of a round at ctx (its time less its verifies) took `seconds`."""
        r = self._rest.setdefault(self._band(ctx), [])
        r.append(float(seconds))
        del r[:-self.rest_window]


class AcceptanceModel:
    """Calibrated chance a(depth, rank, confidence) that a candidate is accepted given its
    parent was.

    Confidence is the drafter's own probability for the candidate, in buckets: it predicts
    acceptance far better than depth does (a confident draft row is accepted wherever it sits,
    an unsure one is not), which lets the width rule cut a chain where the drafter loses
    confidence and branch where it hesitates. Depth refines it: drafts are right in stretches,
    so a candidate whose parents were all accepted is likelier accepted the deeper it sits (on
    the padded target's cohort, rank-0 candidates of draft probability 0.2-0.35 were accepted
    86% at depth 1 and 93% at depth 4 and more), which per-cell chances multiplied along a path
    underrate. Before any observation a cell's chance is a prior by rank; Beta counts take over
    as rounds come, depth by depth: a depth's cell borrows `depth_strength` pseudo-counts from
    the same cell pooled over depths."""

    EDGES = np.array([0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.97])  # 11 buckets
    DEPTHS = 4  # depth groups: depth 1, 2, 3 and 4 or more

    def __init__(self, max_rank=16, prior_strength=2.0, depth_strength=4.0,
                 parent: "AcceptanceModel | None" = None):
        # The prior is by rank only (top ranks likely), not the bucket's own probability: drafts
        # are often far from calibrated (the bundled one is underconfident: rank-0 candidates it
        # gives 0.2-0.35 are accepted ~90% of the time), and a pessimistic prior for a bucket
        # never verified would never be corrected. With a parent (WidthRule.acceptance_for: a
        # context band's model under the drafter's), a cell's prior is the parent's chance of
        # that cell, depth included, with depth_strength pseudo-counts.
        self.prior = np.tile((0.7 / (1.0 + np.arange(max_rank)))[:, None], (1, len(self.EDGES) + 1))
        self.offered = np.zeros((self.DEPTHS,) + self.prior.shape)  # [depth group, rank, bucket]
        self.accepted = np.zeros_like(self.offered)
        self.strength, self.depth_strength = prior_strength, depth_strength
        self.parent = parent
        self.version = 0  # observe() counts: tables() recomputes when it (or the parent's) moves
        self._tables = (None, None)  # (versions, (chance, log_step))

    # bucket edges as log-probabilities: a cell is looked up from the drafter's log-probability
    # directly, by numpy for a lattice (chance) and by bisect for a round's few nodes (observe)
    LOG_EDGES = np.log(EDGES)
    _LOG_EDGES = LOG_EDGES.tolist()

    def chance(self, rank, logprob, depth):
        """The calibrated chance of candidates of these ranks, draft log-probabilities and
        depths (>= 1)."""
        d = np.minimum(np.asarray(depth), self.DEPTHS) - 1
        r = np.minimum(np.asarray(rank), self.offered.shape[1] - 1)
        c = np.searchsorted(self.LOG_EDGES, np.asarray(logprob, float), side="right")
        return self.tables()[0][d, r, c]

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The chance of every (depth group, rank, bucket) cell and its log (floored at 1e-12)
        that growth adds along paths. A cell's chance is (accepted + depth_strength x prior) /
        (offered + depth_strength), its prior the parent's chance of the cell where there is a
        parent, else the cell pooled over depths, (accepted + strength x rank prior) /
        (offered + strength). Recomputed after observe() (offered and accepted change through
        it only), at most once a round."""
        versions = self._versions()
        if self._tables[0] != versions:
            if self.parent is None:
                off, acc = self.offered.sum(0), self.accepted.sum(0)
                prior = (acc + self.strength * self.prior) / (off + self.strength)
            else:
                prior = self.parent.tables()[0]
            k = self.depth_strength
            chance = (self.accepted + k * prior) / (self.offered + k)
            self._tables = (versions, (chance, np.log(np.maximum(chance, 1e-12))))
        return self._tables[1]

    def _versions(self) -> tuple:
        return (self.version,) + (() if self.parent is None else self.parent._versions())

    def grow(self, root: int, lattice, width: int) -> Tree:
        """tree.grow(root, lattice, width, chance=self.chance), in C++ (the same tree, the same
        doubles: tests/test_policy.py): 83-95 us a wide round in Python, 4.4 here (2-core Zen 3,
        8 rows of 4, 16 nodes, timeit)."""
        tokens, logprobs, counts = lattice.arrays()
        chance, log_step = self.tables()
        return Tree(*_core.grow_tree(root, tokens, logprobs, counts, width, chance, log_step,
                                     self.LOG_EDGES))

    def observe(self, tree: Tree, path, picks=None) -> None:
        """Count every node whose parent the path reached: offered, and accepted if on the path.
        With `picks` (the target's pick at each path node, as the walk made them), `tree` may
        be the whole grown tree of which a prefix was verified: a node past the prefix whose
        parent the path reached is counted too, accepted if it carries the parent's pick (what
        the walk would have done). Without them, a cell the rule stopped verifying after a few
        early rejections kept its chance: on the padded target at depth 2K the draft's second
        pick at depth 1 (bucket 0.1-0.2) was offered once in six requests and stayed at 0.15
        where the target took it 55% of the time.
        Plain Python over the round's few nodes: the numpy version (np.add.at) took 8 us a call
        in a timeit loop and ~37 us a chain round under a per-function timer in generation."""
        on_path = set(path)
        pick_at = None if picks is None else dict(zip(path, picks))
        last_r, last_d = self.offered.shape[1] - 1, self.DEPTHS
        counted = []  # (cell, accepted): computed once, added to this model and its ancestors
        for node, (parent, depth, rank, q, token) in enumerate(zip(
                tree.parents.tolist(), tree.depth.tolist(), tree.rank.tolist(), tree.q.tolist(),
                tree.tokens.tolist())):
            if parent >= 0 and parent in on_path:
                counted.append(((min(depth, last_d) - 1, min(rank, last_r),
                                 bisect.bisect_right(self._LOG_EDGES, q)),
                                node in on_path if pick_at is None else token == pick_at[parent]))
        model = self
        while model is not None:
            model.version += 1
            for cell, accepted in counted:
                model.offered[cell] += 1
                if accepted:
                    model.accepted[cell] += 1
            model = model.parent

    def expected_tokens(self, tree: Tree) -> np.ndarray:
        """E(w) for every prefix w = 1..tree.width (the prefix property makes this a cumsum):
        a node's reach is its parent's times its chance, E(w) the sum of the first w reaches.
        In C++ (tree_growth.h): 14 -> 1.5 us for 16 nodes against tests/test_policy.py's definition."""
        chance, log_step = self.tables()
        return _core.expected_tokens(tree.parents, tree.depth, tree.rank, tree.q, chance,
                                     log_step, self.LOG_EDGES)
