"""The speculation policy: each round, the option with the most expected committed tokens per
second, plain decoding included (docs/design.md "Speculation policy").

Options: plain (verify the root alone), a chain of d draft rows (d + 1 nodes), or a best-first
tree of w nodes grown from the drafted rows. Before drafting, the policy compares plain decoding
with the best chain depth, using what the request's rounds kept so far (a survival estimate per
row, pooled per context band across requests), and verifies a chain round's rows whole; after
drafting a wide round, it picks the best prefix of the drafter's chain and of the best-first
tree, using the calibrated acceptance of each node (by depth, rank and the drafter's
confidence). Costs per context band are low quantiles of recent timings, so preempted rounds
move nothing: verify by node count (times the host's level, which follows a shared host's
load), draft by row, and the rest of a round by kind. The admission EMA is the design's
(docs/design.md): trees only while the chain's acceptance is below its threshold, and then only
while the band's wide rounds have not been shown to keep fewer tokens per second than the chain
rounds they replaced would have (their picks tell what the chain would have kept): where a
round's own Python is as large as a small target's verify, trees can lose.

Every choice changes speed only: any tree's walk commits the target's own picks.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from statistics import median

import numpy as np

from . import _core
from .tree import Tree

BANDS = tuple(1024 << i for i in range(8))  # context bands: 1K .. 128K, powers of two


def band_of(ctx: int) -> int:
    return bisect.bisect_right(BANDS, ctx)


def quantile(xs, q: float) -> float:
    """The q-quantile of xs, linear between order statistics (numpy's default)."""
    s = sorted(xs)
    i = q * (len(s) - 1)
    lo = int(i)
    return s[lo] if lo + 1 >= len(s) else s[lo] + (s[lo + 1] - s[lo]) * (i - lo)


def capped_by_larger(prices: dict) -> dict:
    """Each node count's price capped by every larger count's: a verify of more nodes does the
    work of fewer and more, so a count dearer than a larger one was timed while preempted."""
    out, cap = {}, float("inf")
    for n in sorted(prices, reverse=True):
        cap = out[n] = min(prices[n], cap)
    return out


@dataclass
class PolicyParams:
    ema_start: float = 8.0       # docs/design.md: the admission EMA starts at R (all rows kept)
    ema_weight: float = 0.125    # docs/design.md: the EMA's weight of a cycle's kept rows
    ema_wide_below: float = 6.5  # docs/design.md: trees only while the chain keeps fewer rows
    window: int = 16             # timings kept per (band, part, size): enough for a low quantile
                                 # to skip preempted rounds, recent enough to follow the host
    quantile: float = 0.25       # a size's cost is this low quantile of its timings: a loaded host
                                 # preempts many, and a preempted round is not what the size costs
    min_samples: int = 3         # a size timed this often is priced by its own timings, else the line
    prior_strength: float = 4.0  # pseudo-counts a cell (or a request's row) borrows from the level above
    first_rows: int = 3          # rows a band drafts before any cost is timed: a short, cheap first look
    probe_budget: float = 0.05   # the most of a plain stretch's time that speculative probes may cost
    plain_sd: float = 2.0        # plain only while it beats speculation's rate with each row's chance
                                 # this many posterior sds up, chain rounds for wide ones only while
                                 # wide rounds lose by this many: a few unlucky rounds prove nothing
    memory: float = 0.9          # per request, the decay of a band's pooled row counts (~10 requests)

    def validate(self) -> "PolicyParams":
        if not 0 < self.ema_weight <= 1:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight!r}")
        if not (self.window >= 1 and self.min_samples >= 1 and self.first_rows >= 1):
            raise ValueError(f"window, min_samples and first_rows must be >= 1: {self!r}")
        if not (0 < self.probe_budget < 1 and 0 <= self.memory <= 1 and 0 <= self.quantile <= 1
                and self.prior_strength > 0 and self.plain_sd >= 0):
            raise ValueError(f"probe_budget in (0, 1), memory and quantile in [0, 1], "
                             f"prior_strength > 0, plain_sd >= 0: {self!r}")
        return self


class Costs:
    """Recent seconds of the parts of a round per context band: ("verify", nodes), ("draft", 0)
    per drafted row, ("catch_up", 0) per caught-up token, ("rest", kind) the remainder of a round
    of that kind (plain / chain / tree: picks, walk, commit, growth, Python). A size's cost is
    the `q` quantile of its timings: the rounds a shared host preempted sit above it."""

    def __init__(self, window: int, min_samples: int, q: float):
        self.window, self.min_samples, self.q = window, min_samples, q
        self.t: dict[tuple, deque] = {}
        self._tables: dict[int, tuple | None] = {}
        self._quantiles: dict[tuple, float] = {}  # cost() per key, until its next timing
        self._prices: dict[int, np.ndarray] = {}  # verify_prices() per band, likewise
        # per band, the host's level: a shared host's load scales every node count at once, so
        # verify timings are stored divided by the level they were taken at and priced at
        # today's. Each timing of a count timed min_samples times votes timing / its median;
        # the level is the median of the last few counts' votes and itself, so it moves only
        # where two counts agree: one count that turns dear is that count's cost
        self.level: dict[int, float] = {}
        self._votes: dict[int, deque] = {}

    def observe(self, band: int, part: str, size, seconds: float) -> None:
        if part == "verify":
            xs, level = self.t.get((band, part, size)), self.level.get(band, 1.0)
            if xs and len(xs) >= self.min_samples:
                # the last 2 * min_samples - 1 votes: a few rounds, so a change is followed
                votes = self._votes.setdefault(band, deque(maxlen=2 * self.min_samples - 1))
                votes.append((size, seconds / median(xs)))
                by_size = {n: [r for m, r in votes if m == n] for n, _ in votes}
                if len(by_size) >= 2:
                    level = self.level[band] = median([median(v) for v in by_size.values()]
                                                       + [level])
            seconds /= level
            self._tables[band] = self._prices[band] = None
        self.t.setdefault((band, part, size), deque(maxlen=self.window)).append(float(seconds))
        self._quantiles.pop((band, part, size), None)

    def cost(self, band, part, size, default=None):
        # a round asks for the same few costs dozens of times (every option it prices): each
        # quantile is computed once per timing, as the policy's Python is part of every round
        key = (band, part, size)
        q = self._quantiles.get(key)
        if q is None:
            xs = self.t.get(key)
            if not xs:
                return default
            q = self._quantiles[key] = quantile(xs, self.q)
        return q

    def verify_sizes(self, band) -> list:
        return sorted(s for b, p, s in self.t if b == band and p == "verify")

    def _table(self, band):
        """(line, prices): Theil-Sen through the costs of the node counts timed ((intercept,
        slope) >= 0; None below two counts), and each count's price: its own cost once timed
        min_samples times (or with no line), else the line's, capped by every larger count's."""
        table = self._tables.get(band)
        if table is None:
            ns, line = self.verify_sizes(band), None
            own = {n: self.cost(band, "verify", n) for n in ns}
            if len(ns) >= 2:
                b = max(median([(own[j] - own[i]) / (j - i)
                                 for i in ns for j in ns if j > i]), 0.0)
                line = (max(median([own[n] - b * n for n in ns]), 0.0), b)
            table = self._tables[band] = (line, capped_by_larger(
                {n: own[n] if line is None or len(self.t[band, "verify", n]) >= self.min_samples
                 else line[0] + line[1] * n for n in ns}))
        return table

    def verify(self, band, nodes: int):
        line, prices = self._table(band)
        if nodes not in prices and line is None:
            return None
        shape = prices[nodes] if nodes in prices else min(
            [line[0] + line[1] * nodes] + [p for n, p in prices.items() if n > nodes])
        return shape * self.level.get(band, 1.0)

    def verify_prices(self, band, nodes: int) -> np.ndarray:
        """verify(band, n) for n = 1..nodes (a calibrated band), kept until its next verify
        timing: choose() prices every prefix of every candidate each round."""
        prices = self._prices.get(band)
        if prices is None or len(prices) < nodes:
            prices = self._prices[band] = np.array(
                [self.verify(band, n) for n in range(1, max(nodes, 16) + 1)])
        return prices[:nodes]

    def calibrated(self, band) -> bool:
        return self._table(band)[0] is not None

    def round(self, band, kind: str, nodes: int, rows: int):
        """Predicted seconds of a round verifying `nodes` after drafting `rows` (None: unknown)."""
        v = self.verify(band, nodes)
        if v is None:
            return None
        drafted, rest = self.beside_verify(band, kind, rows)
        return v + drafted + rest

    def beside_verify(self, band, kind: str, rows: int) -> tuple:
        """(drafting `rows`, the rest of a round of `kind`): what every option of a round shares.
        A kind not timed yet borrows the chain's rest, but for plain rounds: with the walk in
        the engine their Python is next to none (~30 us against a chain round's ~0.5 ms,
        bench/round_cost.py --kinds), and pricing them at a chain's would keep a policy that
        has never run one from ever trying plain decoding where it wins."""
        rest = self.cost(band, "rest", kind, 0.0 if kind == "plain" else
                         self.cost(band, "rest", "chain", 0.0))
        return rows * self.cost(band, "draft", 0, 0.0), rest


class Acceptance:
    """Calibrated chance that the target takes a drafted candidate given its parent was taken,
    per (depth group, rank, bucket of the drafter's probability): Beta counts over every node
    whose parent the committed path reached, each cell borrowing `strength` pseudo-counts from
    its parent level (a band's from the drafter's) or, at the top, from the cell pooled over
    depths and a prior by rank. The drafter's confidence predicts acceptance far better than
    depth; depth refines it because drafts are right in stretches. Nodes off the drafter's
    line (Tree.off_line) have a group of their own: their row was drafted for another prefix,
    so they are taken far less often than their depth and confidence say."""

    EDGES = np.array([0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.97])
    LOG_EDGES = np.log(EDGES)
    _LOG_EDGES = LOG_EDGES.tolist()
    DEPTHS, RANKS = 4, 16

    def __init__(self, strength: float, parent: "Acceptance | None" = None):
        shape = (self.DEPTHS + 1, self.RANKS, len(self.EDGES) + 1)
        self.offered, self.accepted = np.zeros(shape), np.zeros(shape)
        self.strength, self.parent = strength, parent
        # by rank only, never by the drafter's stated probability: drafts are often far from
        # calibrated, and a pessimistic prior for a cell never verified would never be corrected
        self.prior = np.broadcast_to((0.7 / (1.0 + np.arange(self.RANKS)))[:, None], shape[1:])
        self.version, self._cache = 0, (None, None)

    def _versions(self) -> tuple:
        return (self.version,) + (() if self.parent is None else self.parent._versions())

    def tables(self):
        """(chance, log chance) of every cell; recomputed only after an observe()."""
        return self._tables()[:2]

    def rank0_means(self) -> list:
        """Per depth group on the drafter's line, a rank-0 candidate's chance averaged over
        the buckets (Policy.row_keep's prior, asked for several times a round)."""
        return self._tables()[2]

    def _tables(self):
        v = self._versions()
        if self._cache[0] != v:
            k = self.strength
            if self.parent is None:
                prior = (self.accepted.sum(0) + k * self.prior) / (self.offered.sum(0) + k)
            else:
                prior = self.parent.tables()[0]
            chance = (self.accepted + k * prior) / (self.offered + k)
            self._cache = (v, (chance, np.log(np.maximum(chance, 1e-12)),
                               chance[:self.DEPTHS, 0].mean(axis=1).tolist()))
        return self._cache[1]

    def chance(self, rank, logprob, depth, off=False):
        d = np.where(off, self.DEPTHS, np.minimum(np.asarray(depth), self.DEPTHS) - 1)
        r = np.minimum(np.asarray(rank), self.RANKS - 1)
        return self.tables()[0][d, r, np.searchsorted(self.LOG_EDGES, np.asarray(logprob, float),
                                                      side="right")]

    def grow(self, root: int, lattice, width: int) -> Tree:
        """tree.grow(root, lattice, width, chance=self.chance), in C++ (same tree, same doubles)."""
        tokens, logprobs, counts = lattice.arrays()
        chance, log_step = self.tables()
        return Tree(*_core.grow_tree(root, tokens, logprobs, counts, width, chance, log_step,
                                     self.LOG_EDGES))

    def expected_tokens(self, tree: Tree) -> np.ndarray:
        """E(w) for every prefix w = 1..tree.width: the sum of the first w nodes' reach."""
        chance, log_step = self.tables()
        return _core.expected_tokens(tree.parents, tree.depth, tree.rank, tree.q, chance,
                                     log_step, self.LOG_EDGES)

    def observe(self, tree: Tree, path, picks=None) -> None:
        """Count every node whose parent the path reached: accepted if on the path, or with the
        target's `picks` along the path, if it carries its parent's pick (then `tree` may be a
        whole grown tree of which only a prefix was verified)."""
        on_path = set(path)
        pick_at = None if picks is None else dict(zip(path, picks))
        cells = [((self.DEPTHS if o else min(d, self.DEPTHS) - 1, min(r, self.RANKS - 1),
                   bisect.bisect_right(self._LOG_EDGES, q)),
                  node in on_path if pick_at is None else tok == pick_at[p])
                 for node, (p, d, r, q, tok, o) in enumerate(zip(
                     tree.parents.tolist(), tree.depth.tolist(), tree.rank.tolist(),
                     tree.q.tolist(), tree.tokens.tolist(), tree.off_line().tolist()))
                 if p >= 0 and p in on_path]
        model = self
        while model is not None:
            model.version += 1
            for cell, ok in cells:
                model.offered[cell] += 1
                model.accepted[cell] += ok
            model = model.parent


class Request:
    """One request's policy state: its admission EMA and what its rounds kept, row by row."""

    def __init__(self, policy: "Policy", ctx: int, max_rows: int):
        self.policy, self.band, self.max_rows = policy, band_of(ctx), int(max_rows)
        self.avg = float(policy.params.ema_start)
        self.reached, self.kept = [0.0] * (self.max_rows + 1), [0.0] * (self.max_rows + 1)
        self.plain_run = 0     # plain rounds since the last speculative one
        self.last = (0, 0)     # the last speculative round's (verified depth, rows kept)
        self.probing = False   # is this round a probe after plain rounds?
        self.wide_rows = 0     # rows this round drafts for a tree (0: not a wide round)
        self.chain_rows = 0    # the rows the plan chose for a chain round
        self.deep = True       # did the last wide round's tree reach its deepest drafted row?

    def wide(self) -> bool:
        """docs/design.md's admission: a tree only while the chain keeps fewer rows than the
        threshold."""
        return self.avg < self.policy.params.ema_wide_below

    def survival(self, sd: float = 0.0) -> list:
        """S(j), j = 1..max_rows: the chance that rows 1..j are all kept, each row's conditional
        chance from this request's rounds with the band's pooled counts as their prior (its
        Beta posterior mean, plus `sd` posterior standard deviations)."""
        pooled = self.policy.row_keep(self.band, self.max_rows)
        k, s, out = self.policy.params.prior_strength, 1.0, []
        for j in range(1, self.max_rows + 1):
            n = self.reached[j] + k
            c = (self.kept[j] + k * pooled[j]) / n
            s *= min(c + sd * (c * (1 - c) / (n + 1)) ** 0.5, 1.0)
            out.append(s)
        return out

    def _rows(self, max_rows: int | None) -> int:
        return self.max_rows if max_rows is None else max(1, min(max_rows, self.max_rows))

    def _chain_seconds(self, m: int) -> list:
        """Predicted seconds of a chain round of d rows, d = 1..m (None: unpriced): Costs.round
        of each, its shared parts looked up once (this runs every round)."""
        costs, b = self.policy.costs, self.band
        draft, rest = costs.beside_verify(b, "chain", 1)
        out = []
        for d in range(1, m + 1):
            v = costs.verify(b, d + 1)
            out.append(None if v is None else v + d * draft + rest)
        return out

    def chain_plan(self, max_rows: int | None = None, sd: float = 0.0, near: float = 0.0,
                   seconds: list | None = None):
        """(rows, expected tokens / second) of the best chain depth; rate None when unpriced.
        After a round that kept every row, two rows more where that rates within `near` of the
        best (0: always; verify="chain" asks for speculation whatever plain decoding costs).
        seconds: _chain_seconds(m), when the caller has them (plan() asks twice)."""
        m = self._rows(max_rows)
        seconds = self._chain_seconds(m) if seconds is None else seconds
        survival = self.survival(sd)
        best, e = (min(self.policy.params.first_rows, m), None), 1.0
        for d, s in enumerate(survival[:m], start=1):
            e += s
            t = seconds[d - 1]
            if t is not None and (best[1] is None or e / t > best[1]):
                best = (d, e / t)
        # a round that kept every row it verified says nothing of the rows past it, whose
        # price may rest on one preempted timing: look two rows further
        depth, kept = self.last
        if depth and kept == depth and best[0] < min(depth + 2, m):
            d = min(depth + 2, m)
            t = seconds[d - 1]
            rate = None if t is None else (1.0 + sum(survival[:d])) / t
            if rate is None or best[1] is None or rate >= near * best[1]:
                best = (d, rate)
        return best

    def plan(self, behind: int, max_rows: int):
        """Before drafting: ("plain", 0), ("chain", rows) or ("wide", rows)."""
        p, costs = self.policy.params, self.policy.costs
        seconds, near = self._chain_seconds(self._rows(max_rows)), 0.9
        rows, rate = self.chain_plan(max_rows, near=near, seconds=seconds)
        self.chain_rows = rows
        plain_s = costs.round(self.band, "plain", 1, 0)
        # speculation's rate with every row's chance plain_sd sds up is at least `near` times
        # its rate (chain_plan): asked for only where plain decoding might win (1.001: rounding)
        sure = plain_s is None or (rate is not None and near * rate * plain_s > 1.001)
        hope = None if sure else self.chain_plan(max_rows, p.plain_sd, near=near,
                                                 seconds=seconds)[1]
        self.probing = False
        if hope is not None and plain_s is not None and hope * plain_s < 1.0:
            # plain wins; probe once the probes' excess cost over plain decoding (the draft's
            # catch-up included) stays within probe_budget of the plain stretch's time
            t = (costs.round(self.band, "chain", rows + 1, rows)
                 + behind * costs.cost(self.band, "catch_up", 0, 0.0))
            excess = max(t - rate * t * plain_s, 0.0)
            if excess > p.probe_budget * plain_s * self.plain_run:
                self.plain_run += 1
                return "plain", 0
            self.probing = True
        self.plain_run = 0
        if self.wide() and self.policy.wide_pays(self.band):
            # one row past the chain's best depth lets a tree extend its likeliest path: drafted
            # while the last wide round's tree reached its deepest row, else a row paid for nothing
            self.wide_rows = min(rows + self.deep, max_rows)
            return "wide", self.wide_rows
        self.wide_rows = 0
        return "chain", rows

    def observe(self, drafted: int, kept: int, judged_next: bool) -> None:
        """A speculative round drafted `drafted` rows and its path kept `kept`; judged_next:
        was row kept + 1 verified (else it is censored, not rejected)?"""
        if drafted <= 0:
            return
        self.last = (drafted, kept)
        if self.wide_rows:
            self.deep = drafted >= self.wide_rows
        for j in range(1, min(kept, drafted) + 1):
            self.reached[j] += 1
            self.kept[j] += 1
        if kept < drafted and judged_next:
            self.reached[kept + 1] += 1
        self.avg += self.policy.params.ema_weight * (kept - self.avg)

    def finish(self) -> None:
        self.policy.end_request(self)


class Policy:
    """The speculation state a model keeps per drafter across requests (Model.speculation_policy):
    costs, acceptance and row survival per context band. Persisted by policy_cache (its state()
    and load_state())."""

    def __init__(self, params: PolicyParams | None = None):
        self.params = (params or PolicyParams()).validate()
        self.costs = Costs(self.params.window, self.params.min_samples, self.params.quantile)
        self.acceptance = Acceptance(self.params.prior_strength)
        self.bands: dict[int, Acceptance] = {}
        self.rows: dict[int, list] = {}   # band -> [reached[], kept[]], decayed per request
        # band -> [sum, sum of squares, count] over wide rounds of the tokens each kept beyond
        # what the chain round it replaced would have in its time (judge), decayed per request
        self.wide_vs_chain: dict[int, list] = {}
        self.on_request_end = None        # policy_cache saves here

    def acceptance_for(self, ctx: int) -> Acceptance:
        b = band_of(ctx)
        if b not in self.bands:
            self.bands[b] = Acceptance(self.params.prior_strength, parent=self.acceptance)
        return self.bands[b]

    def request(self, ctx: int, max_rows: int) -> Request:
        return Request(self, ctx, max_rows)

    def row_keep(self, band: int, max_rows: int) -> list:
        """The band's pooled chance that row j is kept given rows before it were, j = 0..max_rows
        (index 0 unused), with the calibrated acceptance of a rank-0 candidate at that depth as
        the prior."""
        priors = self.acceptance_for(BANDS[band - 1] if band else 0).rank0_means()
        reached, kept = self.rows.get(band, ([0.0] * 33, [0.0] * 33))
        k, out = self.params.prior_strength, [1.0]
        for j in range(1, max_rows + 1):
            out.append((kept[j] + k * priors[min(j, Acceptance.DEPTHS) - 1]) / (reached[j] + k))
        return out

    def judge(self, band: int, tree: Tree, rows: int, picks: list, line: list,
              chain_rows: int) -> None:
        """A wide round verified `tree` after drafting `rows`, and the target's picks along its
        path were `picks` (one per path node: it kept len(picks) tokens). The chain round its
        plan chose, `chain_rows` rows of the drafter's `line` (root first), would have kept its
        rows while those picks are its tokens (at least: the tree may stop first). Both priced
        by the band's costs: wide rounds against the chain rounds they replaced, on the same
        contexts (the ones the admission EMA chose)."""
        r = min(chain_rows, len(line) - 1, len(picks))
        kept = next((d for d in range(r) if picks[d] != line[d + 1]), r)
        wide = self.costs.round(band, "tree", tree.width, rows)
        chain = self.costs.round(band, "chain", chain_rows + 1, chain_rows)
        if wide is not None and chain is not None:
            x = len(picks) - (kept + 1) * wide / chain  # beyond the chain's in the same time
            s = self.wide_vs_chain.setdefault(band, [0.0, 0.0, 0.0])
            for i, v in enumerate((x, x * x, 1.0)):
                s[i] += v

    def wide_pays(self, band: int) -> bool:
        """Yes (docs/design.md's admission alone) unless the band's last wide rounds (`window` at
        least) kept fewer tokens than the chain would have in their time, by plain_sd
        standard errors. The evidence decays per request: a band that stopped them takes wide
        rounds again once it weighs less than `window` rounds, to see whether they still lose."""
        s = self.wide_vs_chain.get(band)
        if s is None or s[2] < self.params.window:
            return True
        mean = s[0] / s[2]
        se = (max(s[1] / s[2] - mean * mean, 0.0) / s[2]) ** 0.5
        return mean + self.params.plain_sd * se >= 0

    def end_request(self, req: Request) -> None:
        reached, kept = self.rows.setdefault(req.band, ([0.0] * 33, [0.0] * 33))
        m = self.params.memory
        for j in range(1, 33):
            r = req.reached[j] if j < len(req.reached) else 0.0
            c = req.kept[j] if j < len(req.kept) else 0.0
            reached[j], kept[j] = m * reached[j] + r, m * kept[j] + c
        for v in self.wide_vs_chain.values():
            v[:] = [m * x for x in v]
        if self.on_request_end is not None:
            self.on_request_end(self)

    def choose(self, candidates, ctx: int, rows: int, min_width: int = 1) -> Tree:
        """A wide round's pick: the prefix of a candidate tree (the best-first tree, the drafter's
        chain) with the most expected tokens per second; `rows` were drafted (their cost, and
        the rest of a tree round, are in every option)."""
        b, acc, c = band_of(ctx), self.acceptance_for(ctx), self.costs
        drafted, rest = c.beside_verify(b, "tree", rows)  # Costs.round's sum, shared parts once
        best, pick = -1.0, (candidates[0], 1)
        for tree in candidates:  # the rate of its prefixes of min_width .. width nodes
            t = c.verify_prices(b, tree.width)[min_width - 1:] + drafted + rest
            r = acc.expected_tokens(tree)[min_width - 1:] / np.maximum(t, 1e-9)
            if len(r) and r.max() > best:  # the first of equals, as a strict scan would keep
                i = int(r.argmax())
                best, pick = float(r[i]), (tree, min_width + i)
        return pick[0].prefix(pick[1])
