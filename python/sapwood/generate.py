"""The decoding loop: root -> draft -> grow -> verify -> walk -> commit.

Each cycle verifies a tree whose node 0 is the root (the target's last pick, not yet
committed), walks from the root following the child whose token equals the target's own pick
at each node (greedy or keyed sample at that node's position), commits the walked path, and
makes the pick at the leaf the next root. Every emitted token is a target pick computed from
logits that depend only on the committed state and the path (DESIGN.md "Exactness"), with
noise keyed by (seed, position, id): the output is the plain decoding output, whatever the
verify mode, width or drafter.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np

from . import _core
from . import tree as trees
from .policy import Policy, band_of
from .sampling import SamplingParams, sample

VERIFY_MODES = ("off", "chain", "tree", "auto")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    tokens: int = 0
    cycles: int = 0
    wide_cycles: int = 0
    nodes_verified: int = 0
    draft_rows_accepted: int = 0
    prefill_s: float = 0.0        # the target's prompt and the first pick: time to first token
    draft_prefill_s: float = 0.0  # a draft model taking in the prompt (in its first round)
    decode_s: float = 0.0         # after the first token, less draft_prefill_s
    widths: list = field(default_factory=list)

    @property
    def tokens_per_cycle(self) -> float:
        return (self.tokens - 1) / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Whole request: prefills included."""
        t = self.prefill_s + self.draft_prefill_s + self.decode_s
        return self.tokens / t if t > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first (which comes with prefill) over decode time."""
        return (self.tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "widths"}
        d.update(tokens_per_cycle=self.tokens_per_cycle, tokens_per_s=self.tokens_per_s,
                 decode_tokens_per_s=self.decode_tokens_per_s)
        return d


@dataclass
class GenerationResult:
    tokens: list
    text: str
    stats: GenerationStats
    finish_reason: str  # "length" | "stop" | "context"


@dataclass
class DecodeConfig:
    max_tokens: int = 256
    params: SamplingParams = field(default_factory=SamplingParams)
    verify: str = "auto"
    width: int | None = None     # tree: fixed width; auto: largest width considered
    rows: int = 8                # lattice rows drafted per cycle (the most, with adapt_rows)
    adapt_rows: bool = True      # chain, auto: fewer rows while the draft keeps few (the policy)
    stop_ids: tuple = ()
    # grammar.Constraint: every pick, tree nodes included, drawn under the grammar's mask
    # along its own path (grammar.py); None: unconstrained
    constraint: object = None

    def validate(self):
        if not isinstance(self.max_tokens, (int, np.integer)) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if self.width is not None and not 1 <= int(self.width) <= 64:
            raise ValueError(f"width must be in [1, 64], got {self.width!r}")
        if not isinstance(self.adapt_rows, bool):
            raise ValueError(f"adapt_rows must be a bool, got {self.adapt_rows!r}")
        if not 1 <= self.rows <= 32:
            raise ValueError(f"rows must be in [1, 32], got {self.rows!r}")
        self.params.validate()
        return self


def walk_and_commit(engine, logits, tokens, parents, fold_in_background=False, **sampling):
    """Engine.verify_walk's walk and commit over logits already computed (a calibration's, a
    batched verify's): (path, picks)."""
    path, picks = _core.walk(logits, tokens, parents, engine.position, **sampling)
    engine.commit(path, fold_in_background=fold_in_background)
    return path, picks


def _root_tree(root: int) -> trees.Tree:
    """A plain round's tree: the root alone."""
    return trees.Tree(np.array([root]), np.array([-1]), np.array([0]), np.array([-1]), np.zeros(1))


class Decoder:
    """One request's decoding loop over a target engine and a drafter (None for `off`)."""

    def __init__(self, engine, drafter, cfg: DecodeConfig, policy: Policy | None = None,
                 on_round=None, clock=time.perf_counter):
        cfg = cfg.validate()
        self.matcher = None  # a constrained request's grammar state (grammar.Matcher)
        self._masks = None   # this round's tree's mask rows (_constrain), for _verify_walk
        if cfg.constraint is not None:
            self.matcher = cfg.constraint.matcher()
            # the grammar's end of text ends the request, as an eos does
            extra = tuple(t for t in cfg.constraint.stop_ids if t not in cfg.stop_ids)
            cfg = replace(cfg, stop_ids=tuple(cfg.stop_ids) + extra)
        self.engine, self.drafter, self.cfg = engine, drafter, cfg
        if hasattr(drafter, "set_sampling"):  # a model drafter follows the sampler's noise
            drafter.set_sampling(cfg.params.temperature, cfg.params.seed)
        self.policy = policy or Policy()
        self.req = None  # the policy's state of this request (run())
        self.clock = clock  # seconds, monotonic: the policy learns costs from it
        self._rows = cfg.rows  # this round's draft rows (_mode)
        self._drafted = (0, 0.0)  # this round's draft: rows, seconds
        self._chain = None            # a wide round's drafted chain (_learn judges the round)
        self._unsent: list[int] = []  # committed tokens the drafter has not been given yet
        self._behind = 0              # how many tokens that is
        self._caught_up = (0, 0.0)    # this round's catch-up: tokens, seconds
        self._prompt_pending = False  # is the drafter yet to take in the prompt?
        self.verify_s = 0.0           # this round's verify time(s)
        self.stats = GenerationStats()
        self.context: list[int] = []
        self.on_round = on_round  # on_round(tree, path, seconds): benchmarks log every round
        # a draft model's rows run on one thread (Engine.forward_threads), leaving a worker idle
        self._drafts_on_own_thread = hasattr(drafter, "sync")
        # asked at every pick: the request's parameters do not change while it runs
        self._tree_eligible = cfg.params.tree_eligible
        self._walk_kw: dict = {}  # run(): the engine's sampling arguments (_sampling)

    def _sampling(self) -> dict:
        """The engine's sampling arguments for this request's picks and walks (made once per
        request: self.context, which penalties count, grows in place)."""
        kw = self.cfg.params.engine_kwargs()
        if not self._tree_eligible:  # penalties count the context (a walk adds the path)
            kw["history"] = self.context
        return kw

    def _mode(self) -> str:
        """This round's kind: off, plain, chain, wide (auto's tree) or tree; sets self._rows."""
        mode, cfg = self.cfg.verify, self.cfg
        self._rows = cfg.rows
        if self.drafter is None:
            return "off"
        if mode in ("tree", "auto") and not self._tree_eligible:
            mode = "chain"  # penalties: always the chain (constraints are per-node masks)
        if mode == "auto" and cfg.adapt_rows:
            mode, self._rows = self.req.plan(self._behind, cfg.rows)
        elif mode == "auto":
            mode = "wide" if self.req.wide() else "chain"
        elif mode == "chain" and cfg.adapt_rows:
            self._rows = self.req.chain_plan(cfg.rows)[0]
        return mode

    def _build(self, root: int, mode: str, room: int, emit: int):
        """This round's tree, whether it is wide, its logits when they were already computed
        (a calibration round) else None, and the tree the acceptance model learns from: the
        grown tree in a wide round, else the round's tree."""
        rows = self._rows
        if mode == "tree" and self.cfg.width:
            # a tree of w nodes reaches depth w - 1 at most: rows past it would never be
            # verified (and a row's candidates do not depend on the rows after it)
            rows = min(rows, self.cfg.width - 1)
        # a round emits its accepted rows and one pick more, at most `emit` tokens (the
        # context's room and what the request still needs): rows past that are never kept
        rows = min(rows, emit - 1)
        if rows <= 0:
            tree = _root_tree(root)
            return tree, False, None, tree
        self._catch_up()
        t0 = self.clock()
        lattice = self.drafter.draft(self.context, root, rows)
        self._drafted = (rows, self.clock() - t0)
        chain = trees.chain(root, lattice, rows)
        ctx, pol = self.engine.position, self.policy
        calibrated = pol.costs.calibrated(band_of(ctx))
        if mode == "chain":  # its rows are the plan's (chain_plan): the chain is verified whole
            if calibrated or self.cfg.verify == "tree":
                return chain, False, None, chain
            return chain, False, self._calibrate(chain, ctx), chain
        grown = pol.acceptance_for(ctx).grow(root, lattice, min(self.cfg.width or 16, room))
        if mode == "tree":
            return grown, True, None, grown
        # wide: the drafter's chain competes with the best-first tree (a confident deep chain
        # can win), each by its best prefix
        cands = [chain, grown]
        self._chain = chain
        full = max(cands, key=lambda t: t.width)
        logits = None if calibrated else self._calibrate(full, ctx)
        tree = pol.choose(cands, ctx, rows, 2 if self.req.probing else 1)
        if not full.has_prefix(tree):  # the chain won over the tree: verified on its own
            return tree, False, None, grown
        return tree, not tree.is_chain, None if logits is None else logits[:tree.width], grown

    def _calibrate(self, full, ctx):
        """A band with fewer than two node counts timed: verify the root alone, then `full`,
        timing both. A node's logits do not depend on the other nodes (DESIGN.md), so full's
        logits serve whichever prefix the policy then picks; the root's verify runs first so
        that the engine's tape (what commit uses) is full's."""
        eng, t = self.engine, self.clock()
        eng.verify(full.tokens[:1], full.parents[:1])
        t1, t = self.clock() - t, self.clock()
        logits = eng.verify(full.tokens, full.parents)
        tw = self.clock() - t
        self.policy.costs.observe(band_of(ctx), "verify", 1, t1)
        self.policy.costs.observe(band_of(ctx), "verify", full.width, tw)
        self.verify_s = t1 + tw
        return logits

    def run(self, prompt, prefill=None) -> Iterator[int]:
        """Yield emitted tokens (target picks) in order; stops at max_tokens, a stop id or a
        full context, and sets self.finish_reason. `prefill(ids) -> last logits` replaces
        engine.prefill (e.g. a prompt cache)."""
        eng, cfg, st = self.engine, self.cfg, self.stats
        self.context = [int(t) for t in prompt]
        st.prompt_tokens = len(self.context)
        self.finish_reason = "length"
        t0 = self.clock()
        logits = (prefill or eng.prefill)(self.context)
        self.req = self.policy.request(len(self.context), cfg.rows)
        if hasattr(self.drafter, "sync"):
            # A draft model takes in the prompt when it first drafts, as a catch-up: the first
            # token does not wait for it (waiting, chain and auto requests' time to first token
            # was well above plain decoding's), and a request that never drafts never pays it.
            self._behind = len(self.context)
            self._prompt_pending = True  # the first catch-up is the draft's prefill
        self._walk_kw = self._sampling()
        first_mask = None if self.matcher is None else self.matcher.mask()[0]
        root = int(sample(logits, len(self.context), **self._walk_kw, mask=first_mask))
        st.prefill_s = self.clock() - t0
        t_start = self.clock()
        try:
            pending = [root]  # picks to emit, in order; the last one is the next root
            first_round = True
            while True:
                for tok in pending:
                    if tok in cfg.stop_ids:
                        self.finish_reason = "stop"
                        return
                    st.tokens += 1
                    yield tok
                    if st.tokens >= cfg.max_tokens:
                        return
                root = pending[-1]
                room = eng.max_context - eng.position
                if room < 1:
                    self.finish_reason = "context"
                    return
                t_round = self.clock()
                mode = self._mode()
                emit = min(room, cfg.max_tokens - st.tokens)  # tokens this round may emit
                if mode != "off" and emit <= 1:
                    # the root's pick alone (the request's last token, or the context's): a
                    # plain round, timed and judged as one, not a speculative round that kept
                    # nothing
                    mode = "plain"
                if mode in ("off", "plain"):  # the root alone: no tree
                    tree, wide, calibration, learn_from = None, False, False, None
                    path, picks = self._verify_walk(self._constrain(_root_tree(root), None),
                                                    None, False)
                    committed = [root]
                else:
                    tree, wide, logits, learn_from = self._build(root, mode, room, emit)
                    # forced text drafted at most as deep as the rows the policy counts
                    tree = self._constrain(tree, logits, min(emit - 1, cfg.rows))
                    calibration = logits is not None
                    # a draft model drafts next, on this thread: the target's worker folds
                    # the committed GDN steps meanwhile, which the next verify would fold
                    path, picks = self._verify_walk(tree, logits, self._drafts_on_own_thread)
                    # the path's tokens: the root, then each pick that found its child
                    committed = [root] + picks[:-1]
                self.context.extend(committed)
                if self.matcher is not None:
                    self.matcher.advance(committed)
                if mode != "off" and not self._drafted[0]:
                    # nothing drafted (a plain round, a tree of width 1): the drafter catches
                    # up when it next drafts. Advanced at every round, a draft model ran a
                    # forward a token for nothing: verify="tree", width=1 decoded well below
                    # plain decoding's speed
                    self._unsent.extend(committed)
                    self._behind += len(committed)
                elif self.drafter is not None:
                    self.drafter.advance(committed)
                width = 1 if tree is None else tree.width
                st.cycles += 1
                st.wide_cycles += int(wide)
                st.nodes_verified += width
                st.draft_rows_accepted += len(path) - 1
                st.widths.append(width)
                ctx = eng.position - len(path)  # the round's context
                round_s = self.clock() - t_round
                catch_up_s = self._caught_up[1]
                self._caught_up = (0, 0.0)
                if mode != "off":
                    self._learn(mode, tree, path, picks, learn_from, calibration, ctx,
                                round_s - catch_up_s, first_round)
                first_round = False
                if self.on_round is not None:
                    self.on_round(tree or _root_tree(root), path, self.clock() - t_round)
                pending = picks  # path tokens 1..k (committed), then the next root
        finally:
            st.decode_s = self.clock() - t_start - st.draft_prefill_s
            if self.drafter is not None:
                self.req.finish()

    def _learn(self, mode, tree, path, picks, learn_from, calibration, ctx, round_s, first):
        """Feed the policy what this round cost and kept (round_s: catch-ups left out)."""
        costs, b = self.policy.costs, band_of(ctx)
        if mode == "plain":
            if not first:  # the first round after prefill is not a steady one
                costs.observe(b, "verify", 1, self.verify_s)
                costs.observe(b, "rest", "plain", max(round_s - self.verify_s, 0.0))
            return
        t_learn = self.clock()
        rows, draft_s = self._drafted
        self._drafted = (0, 0.0)
        # the grown tree teaches the acceptance (its unverified nodes under the path too, known
        # by the picks), the committed path followed in it by its tokens: a cell the round did
        # not verify would otherwise keep its chance however often the target took it
        node, mapped = 0, [0]
        for tok in tree.tokens[path[1:]].tolist():
            node = learn_from.child(node, tok)
            if node < 0:
                break
            mapped.append(node)
        self.policy.acceptance_for(ctx).observe(learn_from, mapped, picks[:len(mapped)])
        line, self._chain = self._chain, None  # this round's only: never a later round's
        if mode == "wide" and self.cfg.adapt_rows and line is not None:
            self.policy.judge(b, tree, rows, picks, line.tokens.tolist(), self.req.chain_rows)
        if rows:
            costs.observe(b, "draft", 0, draft_s / rows)
        if not calibration:  # a calibration round has fed its own verify timings
            costs.observe(b, "verify", tree.width, self.verify_s)
        # the rest of a round includes this learning: a grown tree's costs more than a chain's
        round_s += self.clock() - t_learn
        kind = "tree" if mode in ("wide", "tree") else "chain"
        costs.observe(b, "rest", kind, max(round_s - self.verify_s - draft_s, 0.0))
        self.req.observe(int(tree.depth.max()), len(path) - 1,
                         bool((tree.parents == path[-1]).any()))

    def _catch_up(self) -> None:
        """Give the drafter what it has not seen (the prompt, the tokens of plain rounds), in
        order: a draft model prefills every context token it has not seen (Drafter.sync),
        another drafter gets the skipped tokens through advance(). Timed: the fallback prices
        probes with it, and leaves it out of the round's own time."""
        if not self._behind:
            return
        t, restored = self.clock(), 0
        if hasattr(self.drafter, "sync"):
            restored = self.drafter.sync(self.context) or 0
        else:
            self.drafter.advance(self._unsent)
        self._caught_up = (self._behind, self.clock() - t)
        # tokens restored from a prompt cache cost next to nothing: they would make the
        # catch-ups that probes pay (prefills of skipped tokens) look cheap
        if self._behind > restored:
            self.policy.costs.observe(band_of(self.engine.position), "catch_up", 0,
                                      self._caught_up[1] / (self._behind - restored))
        if self._prompt_pending:
            self.stats.draft_prefill_s, self._prompt_pending = self._caught_up[1], False
        self._unsent, self._behind = [], 0

    def _constrain(self, tree, logits, depth=0):
        """A constrained request's round: the tree less the drafts its grammar forbids (kept
        when `logits`, a calibration's, already scored it: never reached either way), plus the
        text the grammar forces below its leaves, down to `depth` (the round's emit - 1), its
        mask rows kept for _verify_walk (grammar.PathMatcher.tree_masks)."""
        if self.matcher is None:
            return tree
        prune = logits is None
        tree, self._masks = self.matcher.tree_masks(tree, prune, depth if prune else 0)
        return tree

    def _verify_walk(self, tree, logits, fold_in_background):
        """Verify the round's tree (unless `logits`, a calibration's, already scored it), walk
        it and commit the path: (path, picks), in one engine call (Engine.verify_walk: the
        picks made in the engine, no logits copied out). self.verify_s: the call's time."""
        eng, kw = self.engine, self._walk_kw
        if self._masks is not None:  # one row per node: its pick's grammar state
            kw, self._masks = dict(kw, mask=self._masks), None
        if logits is not None:
            return walk_and_commit(eng, logits, tree.tokens, tree.parents, fold_in_background,
                                   **kw)
        t = self.clock()
        path, picks = eng.verify_walk(tree.tokens, tree.parents,
                                      fold_in_background=fold_in_background, **kw)
        self.verify_s = self.clock() - t
        return path, picks
