"""Constrained decoding: a grammar's allowed tokens as the sampler's masks, inside speculation.

A constraint (JSON object, JSON schema, regex, Lark or GBNF grammar) is compiled by llguidance
into a matcher that follows the tokens of one request. The sampler takes a bitmask per tree
node (sampler.h: applied before penalties and every filter), so each node's pick is drawn
from the masked distribution of the grammar state along that node's own path: the state after
the committed tokens and the path's tokens through the node. That is the state plain decoding
would be in at that position, so a constrained request gives the same tokens in every verify
mode, width and drafter (DESIGN.md "Serving").

Why llguidance (bench/grammar_mask.py, Qwen3.5's 248,320-id vocabulary, AMD EPYC, one core):
a node's consume + mask costs a median 10 us (p90 20 us) against xgrammar's 4 us (p90 29 us),
both far below a verify round's milliseconds, but a JSON schema compiles in 1 ms against
xgrammar's 200 ms (per request: time to first token), llguidance reads Lark grammars, regexes
and JSON schemas natively, and fills numpy masks without torch.

Masks of a tree are computed depth-first from the request's matcher: consume a node's token,
fill its row, visit its children, roll back one token. A drafted node whose token its parent's
state forbids is pruned before verify with its subtree (tree.Tree keeps parents before
children, so the kept nodes in order are a tree again); the walk could never reach it anyway,
since the parent's pick is drawn among allowed tokens. Stop ids end a request: a node carrying
one is not consumed (llguidance cannot roll a finished matcher back), its pick is never
emitted, so its row allows everything and its subtree is pruned.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

KINDS = ("json_object", "json_schema", "regex", "grammar")
# JSON as OpenAI's structured outputs write it ({"a": 1, "b": [2, 3]}): no free whitespace,
# which a model could otherwise spend its whole budget on (random test models do)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TOKENIZERS: dict = {}  # (id(tokenizer), vocab, stop ids) -> (tokenizer, LLTokenizer)


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # an install without the extras: say which
        raise RuntimeError("constrained decoding needs llguidance: pip install "
                           "'sapwood[server]' (or llguidance)") from e
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """A compiled constraint bound to a model's tokenizer: `matcher()` starts one request."""
    kind: str
    grammar: str          # llguidance's grammar (JSON text)
    tokenizer: object     # llguidance.LLTokenizer of the model, n_vocab = the model's V
    vocab: int
    stop_ids: tuple       # tokens that end the request (the grammar's end of text)

    def matcher(self) -> "Matcher":
        return Matcher(self)


def _ll_tokenizer(model):
    """The model's llguidance tokenizer, built once per tokenizer object and (vocabulary, stop
    ids): ~1-2 s at 248k ids. Models of one checkpoint (new_sequence) share the tokenizer."""
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"{model.path}: constrained decoding needs the checkpoint's "
                         "tokenizer.json, which this model has none of")
    key = (id(tok), _model_vocab(model), stop_ids_of(model))
    hit = _TOKENIZERS.get(key)
    if hit is None or hit[0] is not tok:
        ll = _llguidance().LLTokenizer(tok.to_str(), n_vocab=key[1], eos_token=list(key[2]))
        hit = _TOKENIZERS[key] = (tok, ll)  # the tokenizer held: its id stays its own
    return hit[1]


def _model_vocab(model) -> int:
    return int(model.config.vocab_size)


def stop_ids_of(model) -> tuple:
    """The tokens that end a constrained request: the model's eos ids (generation_config),
    else config.json's."""
    stops = tuple(model.eos_ids()) or tuple(model.config.eos_token_ids)
    if not stops:
        raise ValueError(f"{model.path}: constrained decoding needs an end-of-text token "
                         "(eos_token_id in generation_config.json or config.json)")
    return stops


def grammar_source(*, json_schema=None, json_object=False, regex=None, grammar=None) -> str:
    """llguidance's grammar text for one constraint; ValueError naming what is wrong."""
    ll = _llguidance()
    given = [k for k, v in (("json_schema", json_schema), ("json_object", json_object or None),
                            ("regex", regex), ("grammar", grammar)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"give one constraint of json_schema, json_object, regex, grammar; "
                         f"got {given or 'none'}")
    if json_schema is not None:
        if isinstance(json_schema, str):
            try:
                json_schema = json.loads(json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(json_schema, dict):
            raise ValueError(f"json_schema must be a JSON object (a schema), got "
                             f"{type(json_schema).__name__}")
        return ll.LLMatcher.grammar_from_json_schema(json_schema, defaults=JSON_LAYOUT)
    if json_object:
        return ll.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise ValueError(f"regex must be a non-empty string, got {regex!r}")
        return ll.LLMatcher.grammar_from_regex(regex)
    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError(f"grammar must be a non-empty string (Lark or GBNF), got {grammar!r}")
    if "::=" in grammar:  # GBNF (llama.cpp's `grammar`): llguidance converts it to Lark
        from llguidance.gbnf_to_lark import gbnf_to_lark
        try:
            grammar = gbnf_to_lark(grammar)
        except Exception as e:  # the converter's own errors: name the input
            raise ValueError(f"grammar (GBNF) does not parse: {e}") from None
    return ll.LLMatcher.grammar_from_lark(grammar)


def compile_constraint(model, **constraint) -> Constraint:
    """Compile json_schema= / json_object=True / regex= / grammar= for `model`; ValueError
    naming the problem (an unsupported schema keyword, a regex or grammar that does not
    parse) before any request state exists."""
    source = grammar_source(**constraint)
    kind = next(k for k in KINDS if constraint.get(k) not in (None, False))
    tok = _ll_tokenizer(model)
    err = _llguidance().LLMatcher.validate_grammar(source, tok)
    if err:
        raise ValueError(f"{kind}: {err.strip().splitlines()[0][:500]}")
    return Constraint(kind, source, tok, _model_vocab(model), stop_ids_of(model))


class PathMatcher:
    """One request's constraint state over the committed tokens (advance): masks for the next
    pick (mask) and for every node of a tree (tree_masks). Subclasses give the steps: consume
    a token (False: forbidden), roll one back, fill a mask row for the current state."""

    words: int
    _stops: frozenset

    def _consume(self, tok: int) -> bool:
        raise NotImplementedError

    def _rollback(self) -> None:
        raise NotImplementedError

    def _fill(self, row: np.ndarray) -> None:
        raise NotImplementedError

    def _why(self) -> str:
        return ""

    def _forced(self) -> list:
        """Tokens the constraint forces next (its fixed text: a schema's keys and
        punctuation), as far as it forces them; [] when it does not."""
        return []

    def mask(self) -> np.ndarray:
        """int32 [1, words]: the tokens allowed next."""
        out = np.zeros((1, self.words), np.int32)
        self._fill(out[0])
        return out

    def advance(self, tokens) -> None:
        """Consume committed tokens, up to a stop id (the request ends there)."""
        for t in tokens:
            if self.finished:
                return
            if int(t) in self._stops:
                self.finished = True
                return
            if not self._consume(int(t)):
                raise RuntimeError(f"constraint refused committed token {int(t)}: "
                                   f"{self._why()}")

    def tree_masks(self, tree, prune: bool, depth: int = 0):
        """(tree, masks int32 [w, words]) for a round's tree whose root is the next pick (not
        consumed yet): row i is the state after the path to node i. With prune, nodes the
        constraint forbids (and their subtrees) are left out of the returned tree; without
        (the tree's logits already computed), they stay with rows allowing everything (never
        reached: their parent cannot pick them).

        depth > 0 (with prune): below each leaf whose path ends where the constraint forces
        text (a schema's keys and punctuation), the forced tokens are drafted as a chain, down
        to that depth (at most MAX_GRAFT nodes a round). A drafter that knows no grammar rarely
        proposes them; verified like any draft, they change what a round keeps, never what
        it emits."""
        w = tree.width
        toks, par = tree.tokens.tolist(), tree.parents.tolist()
        masks = np.full((w, self.words), -1, np.int32)
        bits = masks.view(np.uint32)
        ok = np.zeros(w, bool)
        kids: list = [[] for _ in range(w)]
        for i in range(1, w):
            kids[par[i]].append(i)
        stops = self._stops
        dep = tree.depth.tolist()
        grafts: list = []  # (parent: an old node or -(k + 1) for grafts[k], token, mask row)

        def allowed(row, t):
            return (row.view(np.uint32)[t >> 5] >> np.uint32(t & 31)) & 1

        def graft(node):
            room = min(depth - dep[node], MAX_GRAFT - len(grafts))
            parent, row, n = node, masks[node], 0
            for t in self._forced()[:max(room, 0)]:
                if t in stops or not allowed(row, t) or not self._consume(t):
                    break
                n += 1
                new = np.empty(self.words, np.int32)
                self._fill(new)
                grafts.append((parent, t, new))
                parent, row = -len(grafts), new
            for _ in range(n):
                self._rollback()

        def visit(node):
            ok[node] = True
            tok = toks[node]
            if tok in stops:  # its pick is never emitted; what follows it neither
                return
            if not self._consume(tok):
                raise RuntimeError(f"constraint refused token {tok} at tree node {node}: "
                                   f"{self._why()}")
            self._fill(masks[node])
            leaf = True
            for k in kids[node]:
                t = toks[k]
                if allowed(masks[node], t):
                    visit(k)
                    leaf = False
            if leaf and prune and depth > dep[node]:
                graft(node)
            self._rollback()

        visit(0)
        if grafts:
            return _grafted(tree, ok, masks, grafts)
        if not prune or ok.all():
            return tree, masks
        keep = np.flatnonzero(ok)
        new_index = np.full(w, -1, np.int64)
        new_index[keep] = np.arange(keep.size)
        parents = np.where(tree.parents[keep] >= 0, new_index[tree.parents[keep]], -1)
        from .tree import Tree
        pruned = Tree(tree.tokens[keep], parents, tree.depth[keep], tree.rank[keep],
                      tree.logp[keep], tree.q[keep])
        return pruned, masks[keep]


MAX_GRAFT = 24  # forced-text drafts added to one round's tree (tree_masks)


def _grafted(tree, ok, masks, grafts):
    """The tree's kept nodes, then the grafted chains (each graft's parent an earlier node),
    and their mask rows."""
    from .tree import Tree
    keep = np.flatnonzero(ok)
    new_index = np.full(tree.width, -1, np.int64)
    new_index[keep] = np.arange(keep.size)
    toks = tree.tokens[keep].tolist()
    pars = np.where(tree.parents[keep] >= 0, new_index[tree.parents[keep]], -1).tolist()
    dep, rank = tree.depth[keep].tolist(), tree.rank[keep].tolist()
    logp, q = tree.logp[keep].tolist(), tree.q[keep].tolist()
    rows = [masks[keep]]
    for parent, t, row in grafts:
        p = int(new_index[parent]) if parent >= 0 else keep.size + (-parent - 1)
        toks.append(int(t))
        pars.append(p)
        dep.append(dep[p] + 1)
        rank.append(0)
        logp.append(logp[p])  # certain under the grammar: no less likely than its parent
        q.append(0.0)
        rows.append(row[None])
    out = Tree(np.array(toks, np.int64), np.array(pars, np.int64), np.array(dep, np.int64),
               np.array(rank, np.int64), np.array(logp), np.array(q))
    return out, np.concatenate(rows)


class Matcher(PathMatcher):
    """A grammar's state (llguidance's matcher): consume and roll back one token at a time."""

    def __init__(self, c: Constraint):
        self.c = c
        self.words = (c.vocab + 31) // 32
        self._m = _llguidance().LLMatcher(c.tokenizer, c.grammar)
        self._stops = frozenset(c.stop_ids)
        self.finished = False  # a stop id was committed: nothing more is decoded
        self._check()

    def _check(self):
        if self._m.is_error():
            raise RuntimeError(f"grammar matcher failed: {self._why()}")

    def _why(self) -> str:
        return self._m.get_error()[:500]

    def _consume(self, tok: int) -> bool:
        return self._m.consume_token(tok)

    def _rollback(self) -> None:
        self._m.rollback(1)

    def _fill(self, row: np.ndarray) -> None:
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self._check()

    def _forced(self) -> list:
        return self._m.compute_ff_tokens()


def _all_of(row: np.ndarray, vocab: int) -> None:
    """Allow every id below vocab (the bits past it stay clear)."""
    row[:] = -1
    if vocab % 32:
        row.view(np.uint32)[-1] = np.uint32((1 << (vocab % 32)) - 1)


@dataclass(frozen=True)
class ThinkingConstraint:
    """A chat whose prompt opened a thinking block: free reasoning until `end_id` (Qwen3.5's
    `</think>`), at most `budget` reasoning tokens (then the end is the only token allowed:
    the budget is a mask, so exact in every mode), then `inner` (the response's constraint,
    which applies to the answer only, as vLLM's reasoning-aware structured output does), or
    anything."""
    end_id: int
    budget: int | None
    inner: Constraint | None
    vocab: int
    stop_ids: tuple

    def matcher(self) -> "ThinkingMatcher":
        return ThinkingMatcher(self)


class ThinkingMatcher(PathMatcher):
    def __init__(self, c: ThinkingConstraint):
        self.c = c
        self.words = (c.vocab + 31) // 32
        self.inner = c.inner.matcher() if c.inner is not None else None
        self._stops = frozenset(c.stop_ids)
        self.finished = False
        self._states = [(True, 0)]  # (thinking, reasoning tokens so far) after each token
        self._inner_steps = []      # per consumed token: did the inner matcher take it?

    def _consume(self, tok: int) -> bool:
        thinking, n = self._states[-1]
        if thinking:
            if tok == self.c.end_id:
                self._states.append((False, n))
            elif self.c.budget is not None and n >= self.c.budget:
                return False
            else:
                self._states.append((True, n + 1))
            self._inner_steps.append(False)
            return True
        if self.inner is not None and not self.inner._consume(tok):
            return False
        self._states.append((False, n))
        self._inner_steps.append(self.inner is not None)
        return True

    def _rollback(self) -> None:
        self._states.pop()
        if self._inner_steps.pop():
            self.inner._rollback()

    def _fill(self, row: np.ndarray) -> None:
        thinking, n = self._states[-1]
        if thinking and self.c.budget is not None and n >= self.c.budget:
            row[:] = 0
            row.view(np.uint32)[self.c.end_id >> 5] = np.uint32(1 << (self.c.end_id & 31))
        elif thinking or self.inner is None:
            _all_of(row, self.c.vocab)
        else:
            self.inner._fill(row)

    def _forced(self) -> list:
        thinking, n = self._states[-1]
        if thinking:
            return [self.c.end_id] if self.c.budget is not None and n >= self.c.budget else []
        return self.inner._forced() if self.inner is not None else []

    def _why(self) -> str:
        thinking, n = self._states[-1]
        if thinking:
            return f"the thinking budget ({self.c.budget} tokens) is spent"
        return self.inner._why() if self.inner is not None else ""
