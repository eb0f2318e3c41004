"""Best-first tree growth over a draft lattice.

Node 0 is the root (the target's pick, certain). A node at depth d >= 1 is a candidate of
lattice row d-1 hanging under a node at depth d-1; its chance is its parent's chance times the
candidate's draft probability. Nodes are popped in descending chance (ties: earlier push
first), so a tree of w nodes is exactly the first w pops of the largest tree: every prefix
keeps its parents, and a narrower tree's accepted path is the wide path cut at w.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from .drafters import Lattice


@dataclass
class Tree:
    tokens: np.ndarray    # [w] token ids, node 0 = root
    parents: np.ndarray   # [w], parents[0] = -1
    depth: np.ndarray     # [w]
    rank: np.ndarray      # [w] candidate rank within its lattice row (-1 for the root)
    logp: np.ndarray      # [w] log path chance under the drafter
    q: np.ndarray = None  # [w] the drafter's log-probability of each node's token (root: 0)

    def __post_init__(self):
        if self.q is None:
            self.q = np.zeros(self.tokens.size)
        self._children = None  # child(): (parent, token) -> node
        self._is_chain = None

    @property
    def width(self) -> int:
        return int(self.tokens.size)

    @property
    def is_chain(self) -> bool:
        if self._is_chain is None:  # asked several times a round; the arrays are not mutated
            self._is_chain = bool((self.parents == np.arange(self.width) - 1).all())
        return self._is_chain

    def child(self, node: int, token: int) -> int:
        """The child of `node` carrying `token`, or -1 (candidates in a row are distinct)."""
        if self._children is None:  # built on the first lookup, as a walk makes one per
            # token: a numpy search of the whole tree per lookup made the walk's Python slower
            self._children = {(p, t): i for i, (p, t) in
                              enumerate(zip(self.parents.tolist(), self.tokens.tolist()))}
        return self._children.get((int(node), int(token)), -1)

    def off_line(self) -> np.ndarray:
        """Per node: is it off the drafter's own line, below a node (not the root) that is not
        its row's first candidate? Its lattice row was drafted for another prefix."""
        off = np.zeros(self.width, bool)
        par, rank = self.parents.tolist(), self.rank.tolist()
        for i in range(1, self.width):
            off[i] = par[i] > 0 and (off[par[i]] or rank[par[i]] > 0)
        return off

    def has_prefix(self, other: "Tree") -> bool:
        """Are `other`'s nodes this tree's first nodes (same tokens, same parents), so that
        node indices mean the same in both?"""
        w = other.width
        return (w <= self.width and np.array_equal(self.parents[:w], other.parents)
                and np.array_equal(self.tokens[:w], other.tokens))

    def prefix(self, w: int) -> "Tree":
        return Tree(self.tokens[:w], self.parents[:w], self.depth[:w], self.rank[:w], self.logp[:w],
                    self.q[:w])


def grow(root: int, lattice: Lattice, width: int, chance=None) -> Tree:
    """The first `width` nodes of the best-first tree (fewer if the lattice runs out).

    A node's chance is its parent's times its candidate's probability: the drafter's, or, when
    `chance(ranks, logprobs, depths, off)` is given (arrays and a bool in, array out), the
    calibrated probability that the target accepts a candidate of that rank, draft
    log-probability and depth, on the drafter's line or off it (Tree.off_line), made
    non-increasing in rank, so siblings still pop in rank order.
    Calibrated chances keep a confident drafter's chain deep instead of spending the width on
    unlikely siblings near the root.

    Lazy enumeration: popping a node pushes its first child (rank 0 of the next row) and its
    next sibling (rank+1 in the same row, same parent), so the heap stays small.
    """
    toks, pars, dep, rnk, lps, qs = [int(root)], [-1], [0], [-1], [0.0], [0.0]
    heap: list = []
    counter = 0
    # Python lists, and one chance() call for the whole lattice: this runs every round, and
    # per-row numpy calls cost more than the tree's own bookkeeping.
    tokens = [np.asarray(t).tolist() for t in lattice.tokens]
    logprobs = [np.asarray(lp, float).tolist() for lp in lattice.logprobs]
    steps = (logprobs, logprobs)  # a child's step by line: on the drafter's (0), off it (1)
    if chance is not None and tokens:
        ks = [len(t) for t in tokens]
        bounds = np.cumsum([0] + ks)
        ranks = np.concatenate([np.arange(k) for k in ks])
        qs_all = np.array([q for lp in logprobs for q in lp])
        depths = np.repeat(np.arange(1, len(ks) + 1), ks)

        def line_steps(off: bool) -> list:
            c = np.asarray(chance(ranks, qs_all, depths, off), float)
            return [np.log(np.maximum(np.minimum.accumulate(c[bounds[r]:bounds[r + 1]]),
                                      1e-12)).tolist() for r in range(len(ks))]
        steps = (line_steps(False), line_steps(True))
    rows = len(tokens)
    kids_off = [False]  # per node: are its children off the drafter's line (it is, or rank > 0)?

    def push(parent: int, row: int, rank: int):
        nonlocal counter
        if row < rows and rank < len(tokens[row]):
            heapq.heappush(heap, (-(lps[parent] + steps[kids_off[parent]][row][rank]), counter,
                                  parent, row, rank))
            counter += 1

    push(0, 0, 0)
    while heap and len(toks) < width:
        neg, _, parent, row, rank = heapq.heappop(heap)
        node = len(toks)
        toks.append(int(tokens[row][rank]))
        pars.append(parent)
        dep.append(row + 1)
        rnk.append(rank)
        lps.append(-neg)
        qs.append(logprobs[row][rank])
        kids_off.append(kids_off[parent] or rank > 0)
        push(node, row + 1, 0)
        push(parent, row, rank + 1)
    return Tree(np.array(toks, np.int64), np.array(pars, np.int64), np.array(dep, np.int64),
                np.array(rnk, np.int64), np.array(lps), np.array(qs))


def _chain_shape(n: int) -> tuple:
    """(parents, depth, rank, logp) of an n-node chain: the same every round, so built once
    (read-only, as trees share them). Rebuilding them each round: chain() 4.7 us instead of
    2.4 (timeit, 8 rows)."""
    shape = _CHAIN_SHAPES.get(n)
    if shape is None:
        rank = np.zeros(n, np.int64)
        rank[0] = -1
        shape = (np.arange(n) - 1, np.arange(n), rank, np.zeros(n))
        for a in shape:
            a.flags.writeable = False
        _CHAIN_SHAPES[n] = shape
    return shape


_CHAIN_SHAPES: dict = {}


def chain(root: int, lattice: Lattice, rows: int) -> Tree:
    """The root plus the drafter's own chain (rank 0 of every row) of `rows` rows."""
    c = lattice.chain(rows)
    n = len(c) + 1
    q = [0.0] + lattice.chain_logprobs(rows)
    tree = Tree(np.array([root] + c, np.int64), *_chain_shape(n), np.array(q))
    tree._is_chain = True
    return tree
