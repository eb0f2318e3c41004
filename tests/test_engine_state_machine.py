"""A stateful property test of the Engine API (issue 38).

Random sequences of prefill / verify / commit / draft_chain / draft_candidates / keep_draft /
reset / snapshot / restore, invalid calls included, run on one engine. A small model of the
engine's state predicts which calls must succeed; every call that fails must raise ValueError
or MemoryError. The calls that succeeded form the valid history; at check points a fresh
engine replays it and the two must give the same logits, compared with `==` (docs/design.md: logits
depend only on the committed state and the path), so a failed call that changed anything, a
reset that left state behind or a restore that kept some shows up as a difference.

The default run is a few seconds (a tiny model, bounded examples); the slow one runs longer.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sapwood import _core
from sapwood.loading import engine_dims, read_checkpoint
from sapwood.testing import make_tiny_checkpoint

MAX_CONTEXT = 80
V = 256


def _build(tmp, seed):
    p = tmp / f"m{seed}"
    make_tiny_checkpoint(p, seed=seed, vocab=V, hidden=32, intermediate=64, layers=4, head_dim=32)
    ck = read_checkpoint(p)
    return engine_dims(ck.config), ck.weights


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sm")
    return _build(tmp, 1), _build(tmp, 2)


def new_engine(m, threads=1):
    dims, w = m
    return _core.Engine(dims, w, "f32", "int8", MAX_CONTEXT, threads)


tokens = st.lists(st.integers(-1, V), min_size=0, max_size=12)
good_tokens = st.lists(st.integers(0, V - 1), min_size=1, max_size=6)


@st.composite
def trees(draw):
    n = draw(st.integers(1, 8))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    if draw(st.integers(0, 9)) == 0:  # an invalid tree now and then
        parents[draw(st.integers(0, n - 1))] = draw(st.integers(-2, n))
    return draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n)), parents


def depths(parents):
    d = []
    for i, p in enumerate(parents):
        d.append(0 if i == 0 else d[p] + 1)
    return d


def valid_tree(parents):
    return parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i > 0)


class EngineMachine(RuleBasedStateMachine):
    models = None  # set by the test

    def __init__(self):
        super().__init__()
        self.e = new_engine(self.models[0], threads=2)  # the replay runs on one: the same bits
        self.other = None           # an engine of another model, for foreign snapshots
        self.history = []           # successful state-changing calls since the last reset
        self.pos = 0
        self.tape = None            # parents of the last verify, while commit may follow
        self.draft = []             # the last draft chain's processed tokens, while kept
        self.draft_rows = 0
        self.snaps = []             # (snapshot, history, position)

    def call(self, valid, name, *args, **kw):
        """Run a call on the engine; a failure must be a ValueError/MemoryError and must have
        been predicted. Returns (ok, result)."""
        try:
            out = getattr(self.e, name)(*args, **kw)
        except (ValueError, MemoryError):
            assert valid is not True, f"{name}{args} failed but should have succeeded"
            return False, None
        assert valid is not False, f"{name}{args} succeeded but should have failed"
        self.history.append((name, args, kw))
        return True, out

    @rule(toks=tokens)
    def prefill(self, toks):
        valid = bool(toks) and all(0 <= t < V for t in toks) and self.pos + len(toks) <= MAX_CONTEXT
        ok, _ = self.call(valid, "prefill", toks)
        self.tape, self.draft = (None, []) if ok else (self.tape, self.draft)
        if ok:
            self.pos += len(toks)

    @rule(tree=trees())
    def verify(self, tree):
        toks, parents = tree
        valid = valid_tree(parents) and self.pos + max(depths(parents) if valid_tree(parents) else [0]) + 1 <= MAX_CONTEXT
        ok, _ = self.call(valid, "verify", toks, parents)
        if ok:
            self.tape, self.draft = parents, []

    @rule(data=st.data(), background=st.booleans())
    def commit(self, data, background):
        if self.tape is not None and data.draw(st.integers(0, 5)) > 0:
            leaf = data.draw(st.integers(0, len(self.tape) - 1))
            path = [leaf]
            while self.tape[path[-1]] >= 0:
                path.append(self.tape[path[-1]])
            path = path[::-1]
            valid = True
        else:
            path = data.draw(st.lists(st.integers(-1, 8), min_size=0, max_size=4))
            valid = False if self.tape is None else None  # may happen to be a valid path
        ok, _ = self.call(valid, "commit", path, fold_in_background=background)
        if ok:
            self.pos += len(path)
            self.tape, self.draft = None, []

    @rule(root=st.integers(-1, V), rows=st.integers(0, 5), prefix=st.lists(st.integers(0, V - 1), max_size=3),
          temperature=st.sampled_from([0.0, 0.7]), candidates=st.booleans())
    def draft(self, root, rows, prefix, temperature, candidates):
        R = self.pos + len(prefix)
        valid = (0 <= root < V and rows >= 1 and R + rows <= MAX_CONTEXT
                 and len(prefix) <= self.e.max_draft_prefix)
        if candidates:
            ok, _ = self.call(valid, "draft_candidates", root, rows, 3, temperature, 7, prefix)
        else:
            ok, _ = self.call(valid, "draft_chain", root, rows, temperature, 7, prefix)
        if ok:
            self.pos = R
            self.tape = None
            self.draft, self.draft_rows = [root], rows  # its processed tokens start with the root

    @rule(extra=st.lists(st.integers(0, V - 1), max_size=3), lead=st.booleans())
    def keep_draft(self, extra, lead):
        toks = (self.draft[:1] if lead else []) + extra or [0]
        ok, m = self.call(True, "keep_draft", toks)
        # the chain's first processed token is its root: kept iff the tokens start with it
        if self.draft and toks[0] == self.draft[0]:
            assert 1 <= m <= min(len(toks), self.draft_rows)
        else:
            assert m == 0
        self.pos += m
        self.tape, self.draft = None, []

    @rule()
    def reset(self):
        self.e.reset()
        self.history, self.pos, self.tape, self.draft = [], 0, None, []

    @rule()
    def snapshot(self):
        self.snaps.append((self.e.snapshot(), list(self.history), self.pos))  # changes nothing

    @precondition(lambda self: self.snaps)
    @rule(i=st.integers(0, 20))
    def restore(self, i):
        snap, history, pos = self.snaps[i % len(self.snaps)]
        self.e.restore(snap)
        self.history, self.pos, self.tape, self.draft = list(history), pos, None, []

    @rule(long=st.booleans())
    def foreign_restore(self, long):
        if self.other is None:
            self.other = new_engine(self.models[1])
        self.other.reset()
        self.other.prefill([1, 2, 3] * (9 if long else 1))
        try:
            self.e.restore(self.other.snapshot())
        except ValueError as err:
            assert "another model" in str(err)
        else:
            raise AssertionError("a snapshot of another model was restored")

    @invariant()
    def position_matches(self):
        assert self.e.position == self.pos

    @rule()
    def check_replay(self):
        """A fresh engine replaying the valid history has the same state, bitwise."""
        fresh = new_engine(self.models[0])
        for name, args, kw in self.history:
            getattr(fresh, name)(*args, **kw)
        assert fresh.position == self.e.position
        if self.pos + 3 <= MAX_CONTEXT:
            probe = ([5, 9, 2], [-1, 0, 0])
            a, b = self.e.verify(*probe), fresh.verify(*probe)
            assert (a == b).all()
            self.history.append(("verify", probe, {}))
            self.tape, self.draft = probe[1], []

    def teardown(self):
        self.check_replay()


def _run(models, **kw):
    EngineMachine.models = models
    test = EngineMachine.TestCase
    test.settings = settings(deadline=None, suppress_health_check=list(HealthCheck), **kw)
    test("runTest").runTest()


def test_engine_state_machine(models):
    _run(models, max_examples=12, stateful_step_count=25, derandomize=True)


@pytest.mark.slow
def test_engine_state_machine_long(models):
    _run(models, max_examples=400, stateful_step_count=60)
