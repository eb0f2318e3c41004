"""Drafters: propose a lattice of candidate tokens for the rows after the root.

A lattice has R rows; row r holds candidates for the token r+1 places after the root: the
drafter's own pick first (its argmax, or its keyed sample when the request samples), then the
others by descending log-probability. Candidates of a row do not depend on which candidate was
taken in the row before (the drafter follows its own chain), which is what lets the tree grow
best-first over (row, rank) cells. Room is left for MTP heads and block-diffusion drafters:
anything with `draft(context, root, rows) -> Lattice` and `advance(committed)` fits.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from . import _core


@dataclass
class Lattice:
    # per row: candidate ids [k] and their log-probabilities [k]; a drafter whose rows all have
    # k candidates may give [rows, k] arrays instead (a sequence of rows too)
    tokens: list[np.ndarray] | np.ndarray = field(default_factory=list)
    logprobs: list[np.ndarray] | np.ndarray = field(default_factory=list)

    @property
    def rows(self) -> int:
        return len(self.tokens)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(tokens [rows, k], logprobs [rows, k], counts [rows] or None where every row has
        k): ragged rows padded after their last candidate, as _core.grow_tree reads them."""
        if isinstance(self.tokens, np.ndarray) and self.tokens.ndim == 2:
            return self.tokens, np.asarray(self.logprobs), None
        counts = np.array([len(t) for t in self.tokens], np.int64)
        k = int(counts.max()) if counts.size else 0
        tokens, logprobs = np.zeros((counts.size, k), np.int64), np.zeros((counts.size, k))
        for r, (t, lp) in enumerate(zip(self.tokens, self.logprobs)):
            tokens[r, :len(t)], logprobs[r, :len(t)] = t, lp
        return tokens, logprobs, counts

    def chain(self, rows: int | None = None) -> list[int]:
        """The drafter's own continuation (rank 0 of every row, or of the first `rows`)."""
        return _rank0(self.tokens[:rows], int)

    def chain_logprobs(self, rows: int | None = None) -> list[float]:
        """The log-probabilities of chain()'s tokens."""
        return _rank0(self.logprobs[:rows], float)


def _rank0(rows, kind) -> list:
    if isinstance(rows, np.ndarray):  # one numpy call, not one per row (this runs every round)
        return rows[:, 0].tolist() if rows.size else []
    return [kind(r[0]) for r in rows]


class Drafter(Protocol):
    vocab_size: int | None

    def draft(self, context: Sequence[int], root: int, rows: int) -> Lattice:
        """Candidates for the `rows` tokens after `root`, which follows `context`."""

    def advance(self, committed: Sequence[int]) -> None:
        """The target committed these tokens (the root first); keep any state in step."""

    def reset(self) -> None: ...


def _exclusive(method):
    """One call at a time on a drafter with state (issue 50), as on the engines it drives: a
    call from a second thread while one runs raises EngineBusyError at once. Its engine (or
    head) would refuse the overlapping call anyway, but only after the drafter's own
    bookkeeping (tokens synced, rows taken) had moved under the first caller. Nested calls on
    the holding thread (draft -> sync -> reset) pass through."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        me = threading.get_ident()
        if self._owner == me:
            return method(self, *args, **kwargs)
        if not self._busy.acquire(blocking=False):
            raise _core.EngineBusyError(
                f"{type(self).__name__} is in use by another thread: a drafter runs one call at "
                "a time (give each thread its own, or serialise the calls)")
        self._owner = me
        try:
            return method(self, *args, **kwargs)
        finally:
            self._owner = None
            self._busy.release()
    return guarded


class _Exclusive:
    """The state _exclusive reads; set before any guarded method runs."""

    def __init__(self):
        self._busy, self._owner = threading.Lock(), None


class LookupDrafter:
    """Prompt lookup: match the last n tokens (n from `ngram_max` down to `ngram_min`) earlier
    in the context and propose what followed. Alternatives per row come from other matches,
    scored by how many matches agree. No weights, no state."""

    vocab_size = None
    policy_key = "lookup"  # Model.speculation_policy: one state for every lookup drafter

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1, max_matches: int = 8):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_max, self.ngram_min, self.max_matches = ngram_max, ngram_min, max_matches

    def reset(self) -> None:
        pass

    def advance(self, committed) -> None:
        pass

    def draft(self, context, root, rows) -> Lattice:
        seq = np.asarray(list(context) + [int(root)], np.int64)
        for n in range(min(self.ngram_max, seq.size - 1), self.ngram_min - 1, -1):
            key = seq[-n:]
            # starts of earlier occurrences of key (not the final one), most recent first
            win = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.nonzero((win == key).all(axis=1))[0][::-1][: self.max_matches]
            if hits.size:
                return self._lattice(seq, hits + n, rows)
        return Lattice()

    @staticmethod
    def _lattice(seq, starts, rows) -> Lattice:
        lat = Lattice()
        for r in range(rows):
            pos = starts + r
            pos = pos[pos < seq.size]
            if pos.size == 0:
                break
            ids, first, counts = np.unique(seq[pos], return_index=True, return_counts=True)
            # most agreeing matches first; ties: the most recent match (smallest index in pos)
            order = np.lexsort((first, -counts))
            p = counts[order] / counts.sum()
            lat.tokens.append(ids[order])
            lat.logprobs.append(np.log(p * 0.9))  # a lookup is never certain
        return lat


class ModelDrafter(_Exclusive):
    """A smaller model of the same family run by the same runtime. Its committed state follows
    the target's committed tokens; drafting never changes it (Engine.draft_candidates runs the
    chain and rolls back), so a rejected draft costs nothing to undo. When sampling, the chain
    follows the sampler's keyed noise (set_sampling): a draft close to the target then proposes
    the very token the target will sample, instead of its own argmax. The chain's per-row
    states are kept until the next call, so advancing over the committed prefix of the chain
    costs no forward (Engine.keep_draft)."""

    def __init__(self, model, top_k: int = 4):
        super().__init__()
        self.model, self.top_k = model, int(top_k)
        self.policy_key = ("model", id(model))  # Model.speculation_policy: one state per draft model
        self.engine = model.engine
        self.vocab_size = model.config.vocab_size
        self._synced = 0  # how many context tokens the draft has been given
        self._pending: list[int] = []  # given but not yet committed to the draft engine
        self._keep: list[int] = []  # committed by the target since the last chain (advance)
        self.temperature, self.seed = 0.0, 0
        # generate(cache_prompt=True): the context's first prompt_cache_len tokens are the
        # request's prompt, which the draft model takes in through its own prompt cache
        # (Model._restore_or_prefill) as the target does
        self.prompt_cache_len = 0
        self._resumed = 0  # resume(): context tokens the next sync counts as restored

    @_exclusive
    def resume(self, snapshot) -> None:
        """Start from a snapshot of this draft's engine taken after the first
        snapshot.position tokens of the context to come (a served chat's earlier turn): the
        next sync prefills only what follows them, and counts them as restored."""
        self.engine.restore(snapshot)
        self._synced, self._pending, self._keep = snapshot.position, [], []
        self._resumed = snapshot.position

    @_exclusive
    def set_sampling(self, temperature: float, seed: int) -> None:
        """The request's sampling temperature and seed (0: greedy chain)."""
        self.temperature, self.seed = float(temperature), int(seed)

    @_exclusive
    def reset(self) -> None:
        self.engine.reset()
        self._synced, self._pending, self._keep, self._resumed = 0, [], [], 0

    @_exclusive
    def sync(self, context: Sequence[int]) -> int:
        """Commit context tokens the draft has not seen (the prompt, or after a reset).
        Returns how many of them came from the prompt cache instead of a prefill."""
        if self._synced > len(context):
            self.reset()
        todo = list(context[self._synced:])
        if todo:
            self._take_kept()
        restored, n = self._resumed, self.prompt_cache_len
        self._resumed = 0
        if self._synced == 0 and not self._pending and 0 < n <= len(todo):
            # an identical earlier prompt's state is restored (a long prompt's draft prefill
            # costs more than a short request's whole decode)
            _, hit = self.model._restore_or_prefill(todo[:n])
            restored = n if hit else 0
            self._synced, todo = n, todo[n:]
        if todo:
            self.engine.prefill(self._pending + todo)
            self._pending = []
            self._synced += len(todo)
        return restored

    @_exclusive
    def advance(self, committed) -> None:
        # The rows of the last draft chain that the target committed are already computed:
        # the next draft_candidates takes them (keep=) before its chain, what the chain did not
        # cover (after a fully kept chain, its last pick) going in with the chain's first
        # forward, so an advance costs no call of its own.
        committed = [int(t) for t in committed]
        self._keep += committed
        self._synced += len(committed)

    def _take_kept(self) -> None:
        """Something other than a chain comes next: take the kept rows now (keep_draft), the
        rest as pending tokens for the next chain's first forward, or prefilled."""
        if not self._keep:
            return
        kept = self.engine.keep_draft(self._keep)
        rest, self._keep, self._pending = self._pending + self._keep[kept:], [], []
        if len(rest) <= self.engine.max_draft_prefix:
            self._pending = rest
        else:
            self.engine.prefill(rest)

    @_exclusive
    def draft(self, context, root, rows) -> Lattice:
        self.sync(context)
        if self._keep and self._pending:  # one of the two goes with the chain
            self._take_kept()
        ahead = len(self._pending) + len(self._keep)
        rows = min(rows, self.engine.max_context - self.engine.position - ahead - 1)
        if rows <= 0:
            self._take_kept()
            if self._pending:
                self.engine.prefill(self._pending)
                self._pending = []
            return Lattice()
        keep, self._keep = self._keep, []
        ids, logp = self.engine.draft_candidates(int(root), rows, self.top_k, self.temperature,
                                                 self.seed, self._pending, keep)
        self._pending = []
        return Lattice(tokens=ids, logprobs=logp)


class MtpDrafter(_Exclusive):
    """The checkpoint's own multi-token-prediction head (Model.mtp, a _core.MtpHead; the math:
    reference/mtp.py). Its row j reads the target's final hidden state at position j and the
    token after it: the target engine keeps those rows from the prefill and verifies it runs
    anyway (Engine.keep_hidden / take_hidden), and the head commits them when it next drafts,
    in the draft's first forward, whose last row (the root's) predicts the first draft token.
    Deeper rows feed the head's own output and pick back in; they are rolled back.

    Where the target's rows have a gap (a snapshot restored, e.g. generate(cache_prompt=True))
    the head starts over at the first row it has: its positions are then offset, which RoPE's
    relative form leaves nearly alone, but the history before the gap is missing, so drafts
    there are worse. The output never depends on it (docs/design.md "Exactness")."""

    def __init__(self, model, top_k: int = 4):
        super().__init__()
        if model.mtp is None:
            raise ValueError(f"{model.path}: the checkpoint has no MTP head")
        self.head, self.engine, self.top_k = model.mtp, model.engine, int(top_k)
        self.policy_key = ("mtp", id(model))  # Model.speculation_policy: one state per head
        self.vocab_size = model.config.vocab_size
        self.temperature, self.seed = 0.0, 0
        self.engine.keep_hidden = True
        self.reset()

    @_exclusive
    def set_sampling(self, temperature: float, seed: int) -> None:
        """The request's sampling temperature and seed (0: greedy chain)."""
        self.temperature, self.seed = float(temperature), int(seed)

    @_exclusive
    def reset(self) -> None:
        self.head.reset()  # and the rows it holds for the next draft
        self._next = 0  # where the next draft's context tail starts (the last draft's end)

    @_exclusive
    def advance(self, committed) -> None:
        pass  # the target's rows arrive through the engine (take_hidden) when the head drafts

    @_exclusive
    def draft(self, context, root, rows) -> Lattice:
        # One call: the head takes the target's new hidden rows itself (MtpHead.draft_target)
        # and reads the tokens after them from the context's tail; after a gap (a snapshot
        # restored, a reset) it asks for the context from further back.
        start = self._next if self._next <= len(context) else 0
        out = self.head.draft_target(self.engine, context[start:], start, int(root), rows,
                                     self.top_k, self.temperature, self.seed)
        if isinstance(out, int):
            out = self.head.draft_target(self.engine, context[out:], out, int(root), rows,
                                         self.top_k, self.temperature, self.seed)
        self._next = len(context) + 1
        if out is None:
            return Lattice()  # nothing to read (keep_hidden was turned off): no draft
        ids, logp = out
        return Lattice(tokens=ids, logprobs=logp)


def resolve_drafter(model, drafter):
    """Model.resolve_drafter: the drafter a request names, for the target `model`."""
    from .loading import default_draft_path, load
    from .model import Model

    if drafter is None:
        drafter = model.draft if model.draft is not None else "mtp" if model.mtp is not None else "lookup"
    if isinstance(drafter, str) and drafter == "mtp":
        if model.mtp is None:
            raise ValueError(f"drafter='mtp': {model.mtp_unsupported or 'this checkpoint has no MTP head'}"
                             f" ({model.path})")
        return MtpDrafter(model)
    if isinstance(drafter, str) and drafter == "lookup":
        return LookupDrafter()
    if isinstance(drafter, str) and drafter == "default":
        drafter = default_draft_path()
    if isinstance(drafter, (str, Path)):
        if not Path(drafter).is_dir():
            raise ValueError(f"unknown drafter {str(drafter)!r}: expected 'mtp', 'lookup', 'default', "
                             "a draft checkpoint directory or a loaded Model")
        key = str(Path(drafter).resolve())
        cache = model.__dict__.setdefault("_draft_models", {})
        if key not in cache:  # load a draft checkpoint once per target model
            cache[key] = load(drafter, weights=model.weights, kv=model.kv,
                              max_context=model.max_context)
        drafter = cache[key]
    if isinstance(drafter, Model):
        if drafter is model or drafter.engine is model.engine:
            # one engine cannot hold both the target's committed state and the draft's
            raise ValueError("a model cannot be its own drafter (drafter is this model, "
                             "whose one engine would hold the target's and the draft's "
                             "state): load a second copy of it, or use drafter='lookup'")
        if drafter.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"draft model vocabulary ({drafter.config.vocab_size}) differs from "
                             f"the target's ({model.config.vocab_size})")
        if drafter.engine.max_context < model.engine.max_context:
            raise ValueError("the draft model's max_context is smaller than the target's")
        return ModelDrafter(drafter)
    if hasattr(drafter, "draft") and hasattr(drafter, "advance"):
        return drafter
    raise ValueError(f"unknown drafter {drafter!r}")
