"""Sequences of one model: Engine.new_sequence / Model.new_sequence share one copy of the
weights, and _core.verify_many verifies several sequences' trees in one forward.

Exactness (docs/design.md): a sibling's outputs are the bits a separately loaded engine gives, and a
sequence's logits from verify_many are the bits its own verify() gives (the forward's matmuls are
row-independent; each sequence's attention and GDN layers read its own state only). Asserted
with == on the CPU and on metal-emulated.
"""
from __future__ import annotations

import numpy as np
import pytest

import sapwood
from sapwood import _core
from sapwood.loading import engine_dims, read_checkpoint
from sapwood.testing import make_tiny_checkpoint

from util import chain, path_to, random_tree, star

BACKENDS = ["cpu"] + [b for b in ("metal-emulated", "sycl-emulated") if b in _core.available_backends()]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("seq") / "tiny"
    make_tiny_checkpoint(d, seed=3, layers=4)
    return read_checkpoint(d)


def engine(ck, backend, max_context=512):
    return _core.Engine(engine_dims(ck.config), ck.weights, "q8", "int8", max_context, 2, backend)


def tree(rng, parents):
    return [int(t) for t in rng.integers(0, 256, len(parents))], [int(p) for p in parents]


def deepest_path(parents):
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return path_to(parents, int(np.argmax(depth)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_siblings_share_the_weights_and_give_a_separate_engines_bits(ckpt, backend):
    base = engine(ckpt, backend)
    sib = base.new_sequence()
    grand = sib.new_sequence(max_context=256)
    alone = engine(ckpt, backend)
    assert sib.shares_weights(base) and grand.shares_weights(base)
    assert not alone.shares_weights(base)
    assert grand.max_context == 256 and sib.max_context == base.max_context
    assert sib.model_id == base.model_id and sib.backend == backend
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, 256, 30)]
    base.prefill(list(rng.integers(0, 256, 9)))  # base's own state is not the sibling's
    for e in (sib, grand):
        assert e.position == 0
        np.testing.assert_array_equal(e.prefill(prompt), alone.prefill(prompt) if e is sib else
                                      _solo_prefill(ckpt, backend, prompt))
    toks, par = tree(rng, random_tree(7, 5))
    np.testing.assert_array_equal(sib.verify(toks, par), alone.verify(toks, par))
    np.testing.assert_array_equal(sib.draft_chain(toks[0], 4), alone.draft_chain(toks[0], 4))
    # a snapshot moves between siblings (the same model and backend)
    grand.restore(sib.snapshot())
    np.testing.assert_array_equal(grand.verify(toks, par), alone.verify(toks, par))


def _solo_prefill(ck, backend, prompt):
    return engine(ck, backend).prefill(prompt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_many_equals_each_sequences_own_verify(ckpt, backend):
    """Three sequences at different positions, trees of different shapes and sizes, several
    rounds with commits of different lengths in between."""
    rng = np.random.default_rng(1)
    lead = engine(ckpt, backend)
    seqs = [lead, lead.new_sequence(), lead.new_sequence()]
    solo = [engine(ckpt, backend) for _ in seqs]
    for e, s, n in zip(seqs, solo, (5, 40, 1)):
        h = [int(t) for t in rng.integers(0, 256, n)]
        np.testing.assert_array_equal(e.prefill(h), s.prefill(h))
    shapes = [[random_tree(9, 1), [-1], chain(6)], [star(5), random_tree(13, 2), chain(2)],
              [chain(1), chain(4), random_tree(16, 3)]]
    for rnd, parents in enumerate(shapes):
        order = [(1, 0, 2), (2, 1, 0), (0, 1, 2)][rnd]  # any sequence may lead the forward
        trees = [tree(rng, p) for p in parents]
        out = _core.verify_many([(seqs[i], *trees[i]) for i in order])
        for j, i in enumerate(order):
            ref = solo[i].verify(*trees[i])
            assert out[j].shape == ref.shape
            assert np.array_equal(out[j], ref), f"round {rnd}, sequence {i}"
        for e, s, (t, p) in zip(seqs, solo, trees):
            path = deepest_path(p)
            e.commit(path)
            s.commit(path)
            assert e.position == s.position
    for e, s in zip(seqs, solo):  # the committed states went on alike
        np.testing.assert_array_equal(e.prefill([7]), s.prefill([7]))


def test_verify_many_keeps_hidden_rows_per_sequence(ckpt):
    rng = np.random.default_rng(2)
    a = engine(ckpt, "cpu")
    b = a.new_sequence()
    ref = engine(ckpt, "cpu")
    for e in (a, b, ref):
        e.keep_hidden = True
        e.prefill([1, 2, 3])
        e.take_hidden()
    ta, tb = tree(rng, random_tree(6, 4)), tree(rng, chain(3))
    _core.verify_many([(a, *ta), (b, *tb)])
    ref.verify(*tb)
    b.commit([0, 1, 2])
    ref.commit([0, 1, 2])
    got, want = b.take_hidden(), ref.take_hidden()
    assert got[0] == want[0] and np.array_equal(got[1], want[1])


def test_verify_many_bad_input_names_the_sequence_and_changes_nothing(ckpt):
    a = engine(ckpt, "cpu")
    b = a.new_sequence()
    other = engine(ckpt, "cpu")
    for e in (a, b):
        e.prefill([5, 6])
    before = a.verify([3, 4], [-1, 0])  # a's tree stays committable through the failures below
    with pytest.raises(ValueError, match="sequence 1: token id 999 .*outside the vocabulary"):
        _core.verify_many([(a, [1], [-1]), (b, [1, 999], [-1, 0])])
    with pytest.raises(ValueError, match="does not share"):
        _core.verify_many([(a, [1], [-1]), (other, [1], [-1])])
    with pytest.raises(ValueError, match="same engine"):
        _core.verify_many([(a, [1], [-1]), (a, [2], [-1])])
    with pytest.raises(ValueError, match="at most 256"):
        _core.verify_many([(a, [1] * 200, list(range(-1, 199))), (b, [1] * 100, list(range(-1, 99)))])
    with pytest.raises(ValueError, match="no sequences"):
        _core.verify_many([])
    with pytest.raises(ValueError, match="engine, tokens, parents"):
        _core.verify_many([(a, [1])])
    with pytest.raises(ValueError, match="not an Engine"):
        _core.verify_many([("a", [1], [-1])])
    a.commit([0, 1])  # the verify before the failures
    ref = engine(ckpt, "cpu")
    ref.prefill([5, 6])
    np.testing.assert_array_equal(ref.verify([3, 4], [-1, 0]), before)
    ref.commit([0, 1])
    np.testing.assert_array_equal(a.prefill([9]), ref.prefill([9]))


def test_model_new_sequence_generates_a_separate_models_tokens(tmp_path):
    make_tiny_checkpoint(tmp_path / "t", seed=4, layers=4, mtp=True)
    make_tiny_checkpoint(tmp_path / "d", seed=5, layers=2)
    model = sapwood.load(tmp_path / "t", threads=1)
    model.draft = sapwood.load(tmp_path / "d", threads=1)
    sib = model.new_sequence()
    assert sib.engine.shares_weights(model.engine)
    assert sib.draft.engine.shares_weights(model.draft.engine)
    assert sib.mtp is not None and sib.mtp is not model.mtp
    alone = sapwood.load(tmp_path / "t", threads=1)
    alone.draft = sapwood.load(tmp_path / "d", threads=1)
    prompt = list(range(3, 40))
    for drafter in (None, "mtp", "lookup"):
        for kw in ({}, {"temperature": 0.8, "seed": 3}):
            want = alone.generate(prompt, max_tokens=24, drafter=drafter, **kw).tokens
            assert sib.generate(prompt, max_tokens=24, drafter=drafter, **kw).tokens == want
            assert model.generate(prompt, max_tokens=24, drafter=drafter, **kw).tokens == want


def _hand_in(batcher, jobs):
    """Each (engine, tokens, parents) verified through `batcher` on its own thread, all of them
    decoding; the results (or exceptions) in order."""
    import threading

    out = [None] * len(jobs)

    def run(i, e, t, p):
        try:
            out[i] = batcher.verify(e, t, p)
        except Exception as x:  # noqa: BLE001 - checked by the caller
            out[i] = x
        finally:
            batcher.leave()

    for _ in jobs:
        batcher.enter()
    threads = [threading.Thread(target=run, args=(i, *j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_batcher_runs_the_decoding_slots_verifies_in_one_forward(ckpt):
    from sapwood.server.batching import VerifyBatcher

    rng = np.random.default_rng(6)
    lead = engine(ckpt, "cpu")
    seqs = [lead, lead.new_sequence(), lead.new_sequence()]
    solo = [engine(ckpt, "cpu") for _ in seqs]
    for e, s, n in zip(seqs, solo, (3, 11, 6)):
        h = [int(t) for t in rng.integers(0, 256, n)]
        e.prefill(h), s.prefill(h)
    trees = [tree(rng, p) for p in (random_tree(8, 7), chain(3), [-1])]
    # a long wait: the batch runs when the third tree is in, one forward for all three
    batcher = VerifyBatcher(wait_s=30)
    got = _hand_in(batcher, [(e, *t) for e, t in zip(seqs, trees)])
    assert (batcher.forwards, batcher.sequences) == (1, 3)
    for g, s, t in zip(got, solo, trees):
        assert np.array_equal(g, s.verify(*t))
    # a bad tree fails its own sequence only; engines of two models are verified one by one
    other = engine(ckpt, "cpu")
    other.prefill([1, 2])
    got = _hand_in(VerifyBatcher(wait_s=30), [(seqs[0], *trees[0]), (seqs[1], [999], [-1]),
                                              (other, [4, 5], [-1, 0])])
    assert np.array_equal(got[0], solo[0].verify(*trees[0]))
    assert isinstance(got[1], ValueError) and "999" in str(got[1])
    ref = engine(ckpt, "cpu")
    ref.prefill([1, 2])
    assert np.array_equal(got[2], ref.verify([4, 5], [-1, 0]))


def test_batcher_does_not_wait_past_its_wait_for_a_slot_that_hands_nothing(ckpt):
    from sapwood.server.batching import VerifyBatcher

    e = engine(ckpt, "cpu")
    e.prefill([3, 4])
    batcher = VerifyBatcher(wait_s=0.05)
    batcher.enter()  # a second decoding slot that never verifies
    got = _hand_in(batcher, [(e, [5], [-1])])
    ref = engine(ckpt, "cpu")
    ref.prefill([3, 4])
    assert np.array_equal(got[0], ref.verify([5], [-1]))
    assert (batcher.forwards, batcher.sequences) == (1, 1)
    with pytest.raises(ValueError, match="wait_s"):
        VerifyBatcher(wait_s=-1)
    # adaptive: half the recent forwards' time, within bounds
    b = VerifyBatcher()
    lo, hi = VerifyBatcher.MIN_WAIT_S, VerifyBatcher.MAX_WAIT_S
    assert lo <= b.wait() <= hi
    b._forward_s = 0.03
    assert b.wait() == pytest.approx(0.015)
    b._forward_s = 10.0
    assert b.wait() == hi
