"""Speculation policy: the plain fallback (draft at all?), the draft length (how deep?), the
admission EMA (chain or wide?) and the width rule (how wide?).

Plain fallback (PlainFallback, an addition to DESIGN.md): each request drafts until an
optimistic bound of its speculative rounds' tokens per second falls below plain rounds', then
probes again at a bounded cost.

Admission EMA (DESIGN.md): `avg` starts at R; after each cycle avg += alpha * (retained - avg)
with `retained` the draft rows the committed path kept; the next cycle goes wide only while
avg < threshold. High chain acceptance means the chain already captures the draft's value.

Trees at all (WidthRule.trees_pay, an addition): a round the EMA lets go wide grows a tree
only while such rounds that grew one commit more tokens per second than those that drafted
the chain alone (one in tree_explore_every explores).

Width rule: choose w in [1, the request's largest width] maximising expected committed tokens per second,
    E(w) / t(w, ctx),   E(w) = 1 + sum_{i=1}^{w-1} prod_{n on path(i)} a(depth_n, rank_n, q_n)
where a(depth, rank, confidence) is the calibrated chance that the target picks a candidate of
that depth, rank and draft probability given its parent was reached (Beta counts over every
verified node whose parent was on the committed path; AcceptanceModel in round_models.py), and
t is a cost model of a whole round (CostModel, round_models.py): the
rest of the round (drafting, growth, walk, commit) plus the engine's verify, a line in w per
context band fitted robustly (Theil-Sen) to recent verify timings, seeded from a prior and kept
across requests. The first wide round in a band
the model has not seen is a calibration round: the decoder times the full tree and the root
alone (the full tree's logits serve every prefix, so only the root's verify is extra) and feeds
both to the fit before choosing, so even a fresh process's first request starts from measured
costs rather than the prior.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .round_models import AcceptanceModel, CostModel  # noqa: F401 (the policy's API)
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


class DraftLength:
    """How many lattice rows a request drafts (an addition to DESIGN.md's fixed R, which
    stays the maximum). Each draft row costs a draft forward and a verified node, and a row
    after the first wrong one is wasted; a prompt where the draft keeps 2 rows of 8 paid for
    6 more every round. Per request: the chance that row r is kept is a survival estimate over
    the request's recent rounds (Kaplan-Meier: row j's hazard is the rounds rejected at j over
    those that drafted j with rows 1..j-1 kept), with `prior` pseudo-rounds keeping each row at
    `prior_keep`; then E(R) = 1 + sum_{r<=R} S(r) and a round costs fixed + R * per_row
    (per_row: the measured draft time per row plus the cost model's verify slope; fixed: the
    rest of the round). R maximises E(R) / cost(R). Rows never drafted lately take the pooled
    keep rate, and a round that kept all its rows lengthens the next by two. The WidthRule
    keeps one per context band (draft_length): the costs carry across requests, the rows'
    history does not (begin_request). Speed only: any R gives the same output."""

    def __init__(self, max_rows: int = 8, window: int = 16, prior: float = 2.0,
                 prior_keep: float = 0.8, first_rows: int = 3):
        self.max_rows, self.window = int(max_rows), window
        self.first_rows = min(int(first_rows), self.max_rows)
        self.prior, self.prior_keep = prior, prior_keep
        self._rounds: list[tuple[int, int]] = []  # (rows drafted, rows kept), recent
        self.draft_row_s = None   # seconds per draft row (decayed)
        self.fixed_s = None       # a round's time less its draft and its verified draft rows

    def observe(self, drafted: int, kept: int, draft_s: float, round_s: float,
                verify_slope: float) -> None:
        """A speculative round drafted `drafted` rows, committed `kept` of them, spent
        `draft_s` drafting and `round_s` in all (catch-ups excluded)."""
        if drafted <= 0:
            return
        self._rounds.append((int(drafted), int(kept)))
        del self._rounds[:-self.window]
        def ema(old, new):
            return new if old is None else old + 0.2 * (new - old)
        self.draft_row_s = ema(self.draft_row_s, draft_s / drafted)
        self.fixed_s = ema(self.fixed_s, max(round_s - draft_s - verify_slope * drafted, 0.0))

    def keep_rate(self) -> float:
        """The pooled chance that a drafted row is kept given the one before it was: kept rows
        over kept rows plus rejections, with `prior` pseudo-rows at prior_keep."""
        kept = rejected = 0
        for d, k in self._rounds:  # one pass: this runs every round
            kept += k
            rejected += k < d
        return (kept + self.prior * self.prior_keep) / (kept + rejected + self.prior)

    def survival(self) -> list[float]:
        """S(r) for r = 1..max_rows: the estimated chance that rows 1..r are all kept. Each
        row's factor shrinks toward the pooled keep rate, which alone prices rows not drafted
        lately: with a fixed prior there, a prompt whose draft kept 97% of its rows, once
        shortened by a rejection, stayed short (its rows past R were priced at the prior)."""
        m = self.max_rows
        reached, rejected = [0] * (m + 2), [0] * (m + 2)
        for d, k in self._rounds:  # one pass (this runs every round): rows 1..min(d, k+1) drafted
            reached[min(d, k + 1, m) + 1] -= 1  # with the rows before them kept (a difference
            reached[1] += 1                      # array), and row k+1 rejected when k < d
            if k < d and k < m:
                rejected[k + 1] += 1
        out, s, pooled, n = [], 1.0, self.keep_rate(), 0
        for j in range(1, m + 1):
            n += reached[j]
            s *= (n - rejected[j] + self.prior * pooled) / (n + self.prior)
            out.append(s)
        return out

    def begin_request(self) -> None:
        """A new request (WidthRule.draft_length keeps one per context band): the costs stay
        (they are the machine's), the rows' history goes (it is the last prompt's) but its
        pooled keep rate becomes the prior. With neither kept, every request's first round
        drafted all 8 rows (31 ms on the padded target at depth 1, for one token where width
        5 took 20 ms for 3.5: ~5% of a 64-token request, replayed)."""
        if self._rounds:
            self.prior_keep = min(max(self.keep_rate(), 0.3), 0.95)
        self._rounds = []

    def rows(self, verify_slope: float) -> int:
        """The rows to draft this round (first_rows until both costs are measured)."""
        if self.draft_row_s is None or self.fixed_s is None:
            # A fresh band knows no costs. All 8 rows cost a fresh rule's first round 31 ms
            # for 1 token on the padded target at depth 1 (width 5: 20 ms); 3 rows, the best
            # fixed widths' depth there (3-5 nodes at depths 1-8K), lengthened by two while
            # kept, took the first request replayed from x0.943 / 0.981 / 0.953 of the best
            # fixed width to x1.030 / 1.045 / 1.041 at depths 1 / 2K / 8K (4 rows: x1.023 /
            # 0.951 / 1.034; bench/replay_width.py --python-ms 0.4)
            return self.first_rows
        per_row = self.draft_row_s + verify_slope
        best, best_rate, e = self.max_rows, -1.0, 1.0
        for r, s in enumerate(self.survival(), start=1):
            e += s
            rate = e / (self.fixed_s + per_row * r)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = r, rate
        # A round that kept every row it drafted says nothing of the rows past it, whose
        # estimate may be one old rejection: lengthen by two (as Hugging Face's assisted
        # generation does), so a prompt the draft follows gets its depth back in a few rounds.
        # Without it, one early rejection at row 3 kept code-docstring at 2 rows for 16 rounds.
        if self._rounds:
            drafted, kept = self._rounds[-1]
            if kept == drafted:
                best = max(best, min(self.max_rows, drafted + 2))
        return best


class PlainFallback:
    """Auto mode's check that speculation pays at all. Drafting and verifying a tree cost more
    than a plain step; when the draft is often wrong, or verifying extra nodes is expensive
    (a small model on a CPU is compute-bound), plain decoding emits more tokens per second.

    Each request judges its own prompt (how well a draft follows it is the prompt's, not the
    band's): it keeps speculating while an optimistic bound of its speculative rate, the mean
    tokens of its speculative rounds plus `z` standard errors over their mean time, reaches
    the plain rate (and gives up at once where even rounds committing `cap` tokens would
    lose). So it goes plain only on clear evidence, and a prompt where speculation wins by a
    margin is never judged on a few unlucky rounds: drafts are harder at the start of a reply,
    and with a running average and the verdict carried across requests, prompts where the
    chain gains 20% ran plain. A request's first rounds say little about their own spread:
    until it has `pooled_rounds` of them the standard error takes the band's pooled spread
    (the within-request deviations of recent requests, kept like the plain rate), and before
    the band has one, `z_early` standard errors of the request's own spread over its first
    `min_rounds`, with one pseudo-round `prior_spread` tokens off the mean: a fresh process's
    first request on a held-out prompt (padded target, bench/replay_suite.py) committed one
    token in each of its first four rounds, and with their spread of 0 went plain for 16
    rounds where width 3 then kept 3 tokens a round (its first request x0.734 -> x0.851 of the
    best fixed width, its later requests x0.950 -> x0.917; the fallback's own recordings
    unchanged or up to +0.6%). The parameters come from
    replaying recorded chain rounds
    (bench/replay_fallback.py; bench/results/fallback_replay*.txt). The pooled spread against
    z_early's own spread up to min_rounds = 8 (`--pooled-rounds 0`), auto vs plain: a 2-core
    Zen 5 recording with the pool's old 100 us spin, where a chain round cost 5-9 plain tokens
    (fallback_rounds_zen5_spin100us.json), x0.919 -> x0.965; the same machine with the 2 ms
    spin (fallback_rounds.json) x0.973 -> x0.978; a Xeon's (fallback_rounds_xeon.json), where the chain mostly wins, x1.195 ->
    x1.193. Without the early bound the width study's depth-2048 text ran at 0.82 of plain
    decoding, with it 0.88. The plain rate, from the lower quartile of recent plain rounds
    (at least `plain_samples` of them), is kept across requests per context band in the
    WidthRule: it does not depend on the prompt. Live on the Zen 5 (13 prompts x 128 tokens,
    3 blocks) the pooled spread and this plain rate took auto from x0.71 to x0.94 of plain
    decoding. While plain wins, the drafter is left behind (it catches up on the skipped
    tokens before it next drafts), and a speculative round probes again when due: probes cost
    a speculative round's excess over plain rounds plus the catch-up (tokens behind x the
    drafter's measured time per token), and are spaced to cost at most `budget` of the time,
    at least `first_probe` plain rounds apart. A probe that beats plain starts the judgement
    afresh. The verdict itself crosses requests only one way: after `prior_requests` or more
    requests of the band that all lost with speculation, the next starts plain and probes
    (begin_request). Output is unaffected: a plain round is a width-1 tree."""

    def __init__(self, budget: float = 0.05, first_probe: int = 8, min_rounds: int = 8,
                 z: float = 2.0, z_early: float = 4.0, window: int = 16, pooled_rounds: int = 16,
                 pooled_decay: float = 0.98, pooled_min: float = 8.0, plain_samples: int = 8,
                 recent_requests: int = 8, prior_requests: int = 3, prior_spread: float = 1.0):
        self.budget, self.first_probe, self.min_rounds = budget, first_probe, min_rounds
        self.prior_spread = prior_spread
        self.z, self.z_early, self.window = z, z_early, window
        self.pooled_rounds, self.pooled_decay = pooled_rounds, pooled_decay
        self.pooled_min = pooled_min
        # the band's pooled spread: decayed sums of Welford increments (squared deviations from
        # the request's running mean) and of their count, over recent requests' rounds
        self._dev2, self._devs = 0.0, 0.0
        self.plain_samples = plain_samples  # plain rounds timed before plain_s is trusted
        self.plain_s = None
        self._plain_times: list[float] = []  # plain_s: their lower quartile (see observe)
        # until plain_s is measured, a guess of it (the cost model's verify of the root alone,
        # set by the decoder each round): see skip_draft
        self.plain_guess_s = None
        self.catch_up_per_token = None        # the drafter's seconds per caught-up token
        self._tokens: list[int] = []          # this request's speculative rounds (the last
        self._secs: list[float] = []          # `window`): tokens committed, seconds
        self.since_probe, self._probing = 0, False
        self._after_plain = False  # was the last observed round plain?
        self.cap = 9
        self._spec = None  # _summarize()
        # across requests: the speculative tokens/s of each recent request (its judged rounds
        # and probes, `recent_requests` of them); a request starts plain when every one of
        # them lost to plain rounds, once `prior_requests` are in (0: never); see begin_request
        self.recent_requests, self.prior_requests = recent_requests, prior_requests
        self.recent_rates: list[float] = []
        self._req = [0, 0.0, 0]  # this request's speculative tokens, seconds, rounds
        self.prior_plain = False

    def begin_request(self, cap: int = 9) -> None:
        """A new request, whose rounds commit at most `cap` tokens (draft rows + 1)."""
        tokens, secs, rounds = self._req
        if rounds >= 2:  # the last request's speculative rate (one round says little)
            self.recent_rates.append(tokens / secs)
            del self.recent_rates[:-self.recent_requests]
        self._req = [0, 0.0, 0]
        self._tokens, self._secs, self.cap, self._spec = [], [], int(cap), None
        self.since_probe, self._probing, self._after_plain = 0, False, False
        # Start plain (and probe after first_probe rounds) when the band's recent requests all
        # lost with speculation: a request's own judgement costs 3-5 speculative rounds, which
        # on a machine where verifying is dear is most of what auto loses on a short request.
        # Every request, not their mean: with the mean, prompts where the draft wins started
        # plain too and waited for a probe. Replayed (bench/replay_fallback.py, cohort band,
        # third pass), auto vs plain: 2-core Zen 3 AVX2 x0.885 -> x0.899 (vs the chain x1.109
        # -> x1.127); the Zen 5 (both spins) and Xeon recordings unchanged. With the mean: Zen 3
        # x0.921, but Zen 5 x0.978 -> x0.931 (its worst prompt against the chain x0.743).
        rates = self.recent_rates
        self.prior_plain = (self.prior_requests > 0 and self.plain_s is not None
                            and len(rates) >= self.prior_requests
                            and max(rates) * self.plain_s < 1.0)

    def _summarize(self) -> None:
        """What the per-round checks need from this request's speculative rounds: (their mean
        tokens, mean seconds, tokens/s of full rounds, the optimistic bound of their tokens/s
        or None while too few). Computed when a speculative round is observed, not
        in every plain round's skip_draft (~20 us of Python, 4-5% of a plain round)."""
        n = len(self._tokens)
        if n < 2:
            self._spec = None
            return
        # plain arithmetic: statistics.stdev took 12 us a round
        mean, secs = sum(self._tokens) / n, sum(self._secs) / n
        if n < self.pooled_rounds and self._devs >= self.pooled_min:
            z, sd = self.z, (self._dev2 / self._devs) ** 0.5  # the band's spread
        else:
            # one pseudo-round deviating by prior_spread tokens: a few rounds that committed
            # the same count say nothing of the spread (sd 0 made the bound the mean itself)
            s0 = self.prior_spread
            sd = ((sum((t - mean) ** 2 for t in self._tokens) + s0 * s0) / n) ** 0.5
            z = self.z if n >= self.min_rounds else (self.z_early if n >= 3 else None)
        bound = None if z is None else (mean + z * sd / n ** 0.5) / secs
        self._spec = (mean, secs, self.cap / secs, bound)

    def _plain_round_s(self):
        """plain_s, or while unmeasured its guess (None without either)."""
        return self.plain_s if self.plain_s is not None else self.plain_guess_s

    def prefers_plain(self) -> bool:
        """Would the next round be plain (nothing probed)? Yes when even rounds committing
        `cap` tokens would lose to plain ones (a deep context makes a wide verify cost several
        plain steps), or when the optimistic bound of the speculative rate does."""
        plain_s = self._plain_round_s()
        if plain_s is None:
            return False
        if self._spec is None:
            return self.prior_plain
        rate = 1.0 / plain_s
        _, _, full_rate, bound = self._spec
        if full_rate < rate:
            return True
        return self.prior_plain if bound is None else bound < rate

    def probe_cost(self, behind: int) -> float:
        """Seconds a probe costs beyond plain rounds emitting the same tokens."""
        mean, secs, _, _ = self._spec
        plain_s = self._plain_round_s()
        return max(secs - mean * plain_s, 0.0) + behind * (self.catch_up_per_token or 0.0)

    @property
    def probing(self) -> bool:
        """Is this round (skip_draft said speculate) a probe?"""
        return self._probing

    def skip_draft(self, behind: int = 0) -> bool:
        """Should the next round be plain? `behind`: tokens the drafter would catch up on."""
        self._probing = False
        if len(self._tokens) < 2 and not self.prior_plain:
            return False  # time speculation first
        if self.plain_s is None and self.plain_guess_s is None:
            return True  # then plain rounds, which time plain decoding
        if not self.prefers_plain():
            # speculation beats plain rounds, or before they are timed even the guess of one
            # (the root's predicted verify, less than a plain round costs, so the guess errs
            # toward timing plain rounds): without it, a fresh band's first request spent 9
            # plain rounds timing them, on the bundled pair's padded target at depth 1 where
            # the best fixed width ran at 1.6x plain decoding
            return False
        if self.plain_s is None:
            return True  # plain rounds, timed
        self.since_probe += 1
        cost = 0.0 if self._spec is None else self.probe_cost(behind)
        if self.since_probe >= max(self.first_probe, cost / (self.budget * self._plain_round_s())):
            self.since_probe, self._probing = 0, True
            return False
        return True

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """The drafter took `seconds` to take in `tokens` context tokens (a prompt prefill or a
        catch-up)."""
        if tokens:
            per = seconds / tokens
            old = self.catch_up_per_token
            self.catch_up_per_token = per if old is None else old + 0.3 * (per - old)

    def observe(self, plain: bool, tokens: int, seconds: float, catch_up_s: float = 0.0) -> None:
        """A round that committed `tokens` took `seconds`, of which `catch_up_s` caught the
        drafter up (observe_catch_up has its rate)."""
        after_plain, self._after_plain = self._after_plain, plain
        if plain:
            # A plain round right after a speculative one also runs the GDN steps of the path
            # that round committed (the engine applies them at the next verify): 0.60-0.69 ms
            # against 0.45-0.50 for the next ones on the bundled pair at depth 1, and that one
            # sample, taken as the plain cost, kept a fresh request speculating at a loss for
            # 8 rounds. Only plain rounds after plain rounds time plain decoding, and not one
            # of them alone: the next few are slow too on a VM (2-core Zen 5, the pool spinning
            # 3 ms: 215, 191, 182, 175 us, then ~170), and one such sample (437 us where plain
            # decoding ran at 357) kept every request of the band speculating at x0.71 of plain
            # decoding.
            if after_plain:
                self._plain_times.append(seconds)
                del self._plain_times[:-16]
                if len(self._plain_times) >= self.plain_samples:
                    t = sorted(self._plain_times)
                    self.plain_s = t[len(t) // 4]
            return
        seconds = max(seconds - catch_up_s, 1e-7)
        self._req[0] += int(tokens)
        self._req[1] += seconds
        self._req[2] += 1
        if self._probing and tokens / seconds >= 1.0 / self._plain_round_s():
            self._tokens, self._secs = [], []  # the prompt may have changed: judge afresh
            self.prior_plain = False  # this prompt's own rounds decide from here
        if self._tokens:  # the pooled spread: this round's deviation from the request's mean
            n, d = len(self._tokens), self.pooled_decay
            dev = tokens - sum(self._tokens) / n
            self._dev2, self._devs = d * self._dev2 + dev * dev * n / (n + 1), d * self._devs + 1
        self._tokens.append(int(tokens))
        self._secs.append(seconds)
        del self._tokens[:-self.window], self._secs[:-self.window]
        self._summarize()


@dataclass
class WidthRule:
    """The policy state a model keeps across requests, one per drafter (Model.width_rule):
    the cost model, the acceptance calibration and the plain fallbacks, and the choice of a
    round's width from them.

    explore: one round in `explore_every` picks at random among the widths predicted
    within 10% of the best, so the cost fit keeps timings around the optimum (where its slope
    matters) and cannot settle on one width while wrong; it costs at most 10% on those rounds.
    The choice only changes speed, never the output, and the draws come from a seeded
    generator, so a run is reproducible."""
    cost: CostModel = field(default_factory=CostModel)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    explore_every: int = 8
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    fallbacks: dict = field(default_factory=dict)  # context band -> PlainFallback
    draft_lengths: dict = field(default_factory=dict)  # (context band, max rows) -> DraftLength
    band_acceptance: dict = field(default_factory=dict)  # context band -> AcceptanceModel
    tree_explore_every: int = 16  # trees_pay()
    grow_free_s: float = 5e-3  # trees_pay(): rounds this long always grow a tree
    round_decay: float = 0.9  # realized(), trees_pay(): about the last 10 rounds of a shape
    # decayed sums over the rounds choose_tree chose, by [is_chain, (predicted E, committed
    # tokens), width]: realized(). Every such round decays every cell, so a shape or width not
    # chosen lately drifts back to a ratio of 1 (its prior) and is tried again: kept, two early
    # wide trees that committed 2 of 3.4 predicted tokens kept trees from the padded target at
    # depth 2K (x0.81 on every tree) where fixed 3-node trees ran at 1.2x the rule's chains
    _sums: np.ndarray = field(default_factory=lambda: np.zeros((2, 2, 65)))
    shape_prior_tokens: float = 10.0  # realized(): pseudo-tokens at a ratio of 1
    # grown -> decayed (committed tokens, seconds) of the rounds the EMA let go wide
    _rates: dict = field(default_factory=lambda: {True: (0.0, 0.0), False: (0.0, 0.0)})
    width_prior_tokens: float = 10.0  # realized(): a width's own sums against the shape's ratio
    _predicted: tuple | None = None  # (E, width) of the tree choose_tree returned last
    _since_wide: int = 0
    _tree_gap: int = 0  # eligible rounds from one tree exploration to the next (0: not yet)
    _round_s: float | None = None  # decayed mean seconds of a speculative round

    def plain_fallback(self, ctx: int, cap: int = 9) -> PlainFallback:
        """The PlainFallback of ctx's band, ready for a new request (rounds of at most `cap`
        tokens)."""
        pf = self.fallbacks.setdefault(self.cost._band(ctx), PlainFallback())
        pf.begin_request(cap)
        return pf

    def acceptance_for(self, ctx: int) -> AcceptanceModel:
        """The acceptance calibration of ctx's context band: the band's own counts, with the
        drafter's over every band (`acceptance`, which each band's observations also feed) as
        their prior. What a draft's confidence is worth moves with the context: replayed as one
        band of requests at depths 1, 2K and 8K in turn (bench/replay_width.py --shared, padded
        target), one calibration for all ran auto at 154 / 105 / 120 tok/s where each depth
        alone ran at 183 / 110 / 117; per band, 181 / 115 / 119 (the bundled target unpadded:
        auto / chain x0.995 -> x1.037; each depth alone and the cohort, one band, unchanged)."""
        band = self.cost._band(ctx)
        acc = self.band_acceptance.get(band)
        if acc is None:
            acc = self.band_acceptance[band] = AcceptanceModel(parent=self.acceptance)
        return acc

    def draft_length(self, ctx: int, max_rows: int = 8) -> DraftLength:
        """The DraftLength of ctx's band (and max_rows), ready for a new request."""
        dl = self.draft_lengths.setdefault((self.cost._band(ctx), int(max_rows)),
                                           DraftLength(max_rows=max_rows))
        dl.begin_request()
        return dl

    def rate(self, tree: Tree, ctx: int, costs=None) -> np.ndarray:
        """Expected committed tokens per second of every prefix w = 1..tree.width (costs:
        predicted round times of widths 1.. when already computed)."""
        if costs is None:
            costs = self.cost.predict_widths(np.arange(1, tree.width + 1), ctx)
        return self.acceptance_for(ctx).expected_tokens(tree) / costs[:tree.width]

    @staticmethod
    def _at_least(rate: np.ndarray, min_width: int) -> np.ndarray:
        """rate (a fresh array, changed in place) with widths below min_width ruled out, where
        it has that many."""
        if 1 < min_width <= len(rate):
            rate[:min_width - 1] = -np.inf
        return rate

    def _pick(self, rate: np.ndarray) -> int:
        if self.explore_every and self.rng.random() * self.explore_every < 1:
            near = np.flatnonzero(rate >= 0.9 * rate.max())
            return int(self.rng.choice(near)) + 1
        return int(np.argmax(rate)) + 1

    def choose(self, tree: Tree, ctx: int, min_width: int = 1) -> int:
        """Best width for this round's candidate tree (built at max width) at context ctx, at
        least min_width where the tree has that many nodes (choose_tree has why)."""
        return self._pick(self._at_least(self.rate(tree, ctx), min_width))

    def realized(self, chain: bool, widths: int | None = None):
        """Tokens a round of this shape (a chain, or a tree) committed per token its E
        predicted, over recent rounds, starting from 1. With `widths`, that ratio for each
        prefix width 1..widths: a width's own rounds against width_prior_tokens predicted at
        the shape's ratio. The rule picks the width whose E is highest against its cost, so
        rounds at a width were chosen where E overestimated (the optimizer's curse): on the
        padded target at depth 1, chains chosen at width 5 predicted 3.86 tokens and committed
        3.56, those at width 3 predicted 2.45 and committed 2.66."""
        sums = self._sums[int(chain)]
        c = self.shape_prior_tokens
        ratio = (sums[1].sum() + c) / (sums[0].sum() + c)
        if widths is None:
            return float(ratio)
        c = self.width_prior_tokens
        p, r = sums[:, 1:widths + 1]
        return (r + c * ratio) / (p + c)

    def choose_tree(self, candidates, ctx: int, min_width: int = 1) -> Tree:
        """The best prefix of any candidate tree (e.g. the best-first tree and the drafter's
        chain), by the same expected tokens per second, each scaled by what rounds of its
        shape realized against their prediction. E multiplies per-node chances as if
        independent, but drafts are right in stretches: on the bundled pair a chain predicted
        4-7 tokens committed all 9 in most rounds while wide trees committed about what they
        predicted, so unscaled E chose trees costing 0.1-0.6 ms more a round for nothing.
        Scaled, auto against the chain on the cohort went from x0.944 to x0.972 decode tokens/s
        (geometric mean, one 3-block A/B each). min_width: a fallback's probe verifies two
        nodes at least (the root alone tells nothing of the draft, and cannot beat a plain
        round: probes on the padded target at depth 2K that chose the root failed, and the
        request stayed plain where width 3 ran at 1.2x)."""
        costs = self.cost.predict_widths(np.arange(1, max(t.width for t in candidates) + 1), ctx)
        acc = self.acceptance_for(ctx)
        es = [acc.expected_tokens(t) for t in candidates]
        rates = [self._at_least(e / costs[:t.width] * self.realized(t.is_chain, t.width), min_width)
                 for e, t in zip(es, candidates)]
        k = int(np.argmax([r.max() for r in rates]))
        w = self._pick(rates[k])
        self._predicted = (float(es[k][w - 1]), w)
        return candidates[k].prefix(w)

    def trees_pay(self) -> bool:
        """May an auto round that the admission EMA lets go wide grow a tree? Not while such
        rounds that grew one commit fewer tokens per second than those that drafted the chain
        alone: then the chain is drafted and verified as in chain mode, without growing and
        pricing a tree (~0.15-0.25 ms of Python a round, 7-10% of a round on the bundled
        pair), except one round in `tree_explore_every` that keeps the grown rounds' rate
        current. Grown rounds count whatever shape the rule then chose: keyed by the chosen
        shape, rounds that grew a tree and chose the chain were charged to chains, trees
        stayed on, and auto ran 4-5% behind the chain on prompts where both verified the same
        chains (non-english, code-class; 12 alternated requests each). Until grown rounds are
        measured, chains (as the admission EMA starts): exploring trees at once cost a fresh
        process's first 64-token request at depth 1 two tree rounds, ~4% of its time."""
        # The gate saves growing's Python, which matters only while rounds are short: on the
        # bundled target padded to 244M (2-core Zen 3) it kept auto on chains where width 5
        # won (width study, depth 1: rule x0.833 of the best fixed width, growing x0.917-0.992)
        if self._round_s is not None and self._round_s >= self.grow_free_s:
            return True
        (gt, gs), (ct, cs) = self._rates[True], self._rates[False]
        if gs > 0.0 and cs > 0.0 and gt / gs >= ct / cs:
            self._tree_gap = self.tree_explore_every
            return True
        self._since_wide += 1
        gap = self._tree_gap or self.tree_explore_every
        if self.tree_explore_every and self._since_wide >= gap:
            # each exploration that finds trees still losing doubles the gap to the next (up
            # to 8x): explorations cost 1-2 rounds of each 128-token request (~1.5%) on
            # prompts where the chain is best
            self._since_wide = 0
            self._tree_gap = min(2 * gap, 8 * self.tree_explore_every)
            return True
        return False

    def observe_round(self, chain: bool, tokens: int, seconds: float | None,
                      grown: bool | None = None) -> None:
        """A speculative round verifying a chain (or a tree) committed `tokens` (its path,
        root included) in `seconds` (drafting, growth, verify, walk and commit; catch-ups
        excluded; None where the time is not the round's own, as the first after prefill).
        grown: for an auto round the admission EMA let go wide, whether it grew a tree (None
        for other rounds)."""
        d = self.round_decay
        if self._predicted is not None:  # the round choose_tree chose: its E against the tokens
            e, w = self._predicted
            self._sums *= d
            self._sums[int(chain), :, w] += (e, tokens)
            self._predicted = None
        if seconds is not None and grown is not None:
            t, s = self._rates[grown]
            self._rates[grown] = (d * t + tokens, d * s + seconds)
        if seconds is not None:
            r = self._round_s
            self._round_s = seconds if r is None else d * r + (1 - d) * seconds
