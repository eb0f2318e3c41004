"""The C++ Engine against the numpy reference model, bitwise invariances, snapshots, bad input.

Oracle tolerance (f32 weights): the engine runs float32 end to end, the reference float64; over
4 layers of a width-64 model the logit error stays ~1e-5 against logits of size ~5. 2e-4 times
max(1, |logit|max) leaves margin and still fails on any wrong formula (those move logits by
1e-2 or more). With int8 KV the queries are int8-rounded too (reference/tree_attention.py
int8_queries): where the engine's float32 query dim and the reference's float64 one straddle a
rounding boundary of that grid (a last-bit difference, about 1e-5 of the dims), the dim moves by
a whole step, amax / 127 of its group, and the logits by up to ~3e-4 of their scale (measured
2.8e-4 on one decode step here, ~1e-6 on the others); INT8_TOL = 1e-3 keeps the margin and
still fails on a wrong formula.
"""
import json

import numpy as np
import pytest

import sapwood
from sapwood.reference.model import ReferenceModel
from sapwood.safetensors_io import load_checkpoint_weights
from sapwood.testing import make_tiny_checkpoint
from util import ISAS, isa, path_to, random_tree


@pytest.fixture(scope="module", params=["untied-grouped", "tied-tiled"])
def ckpt(request, tmp_path_factory):
    tied = request.param.startswith("tied")
    order = request.param.split("-")[1]
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(path, tied=tied, head_order=order, seed=3)
    return path


def reference(path, kv_int8):
    cfg = json.load(open(path / "config.json"))
    return ReferenceModel(cfg, load_checkpoint_weights(path), kv_int8=kv_int8)


def prompt(n, vocab=256, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, n)


def scale(x):
    return max(1.0, float(np.abs(x).max()))


TOL, INT8_TOL = 2e-4, 1e-3  # of scale(logits): f32 KV, int8 KV (the module docstring says why)


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_matches_reference_prefill_and_decode(ckpt, kv):
    model = sapwood.load(ckpt, weights="f32", kv=kv)
    ref = reference(ckpt, kv_int8=(kv == "int8"))
    toks = prompt(40)
    got, want = model.engine.prefill(toks, all_logits=True), ref.prefill(toks)
    tol = TOL if kv == "f32" else INT8_TOL
    assert np.abs(got - want).max() <= tol * scale(want)
    t = int(np.argmax(got[-1]))
    for _ in range(12):
        got = model.engine.verify([t], [-1])[0]
        model.engine.commit([0])
        want = ref.step(t)
        assert np.abs(got - want).max() <= tol * scale(want)
        t = int(np.argmax(want))


def test_tree_verify_matches_reference(ckpt):
    model = sapwood.load(ckpt, weights="f32", kv="int8")
    ref = reference(ckpt, kv_int8=True)
    toks = prompt(30, seed=1)
    model.engine.prefill(toks)
    ref.prefill(toks)
    parents = random_tree(12, 5)
    tree = prompt(12, seed=2)
    got, want = model.engine.verify(tree, parents), ref.verify(tree, parents)
    assert np.abs(got - want).max() <= INT8_TOL * scale(want)
    path = path_to(parents, 11)
    model.engine.commit(path)
    ref.commit(path)
    assert model.engine.position == 30 + len(path)
    got, want = model.engine.verify([7], [-1]), ref.verify([7], [-1])
    assert np.abs(got - want).max() <= INT8_TOL * scale(want)


@pytest.mark.parametrize("weights", ["q8", "f32"])
def test_plain_chain_tree_bitwise(ckpt, weights):
    """For any path, plain decoding, chain verify and a tree containing it give identical logits."""
    eng = sapwood.load(ckpt, weights=weights, kv="int8").engine
    eng.prefill(prompt(37, seed=3))
    snap = eng.snapshot()
    parents = random_tree(16, 9)
    tree = prompt(16, seed=4)
    out_tree = eng.verify(tree, parents)
    for leaf in [5, 12, 15]:
        path = path_to(parents, leaf)
        out_chain = eng.verify(tree[path], np.arange(len(path)) - 1)
        assert (out_chain == out_tree[path]).all(), f"chain vs tree, leaf {leaf}"
        for j, node in enumerate(path):  # plain decoding, committing each token
            out_plain = eng.verify([tree[node]], [-1])
            assert (out_plain[0] == out_tree[node]).all(), f"plain vs tree, node {node}"
            eng.commit([0])
        eng.restore(snap)
        assert eng.position == 37


def test_prefill_equals_chain_verify_bitwise(ckpt):
    eng = sapwood.load(ckpt, weights="q8").engine
    eng.prefill(prompt(20, seed=5))
    snap = eng.snapshot()
    more = prompt(9, seed=6)
    a = eng.prefill(more, all_logits=True)
    eng.restore(snap)
    b = eng.verify(more, np.arange(9) - 1)
    assert (a == b).all()


@pytest.mark.parametrize("pending", [0, 5])
def test_draft_chain_equals_growing_chain_verifies_bitwise(ckpt, pending):
    eng = sapwood.load(ckpt, weights="q8").engine
    eng.prefill(prompt(21, seed=9))
    for t in prompt(pending, seed=10):  # committed one at a time: GDN tokens left unfolded
        eng.verify([t], [-1])
        eng.commit([0])
    rows = eng.draft_chain(7, 9)
    assert rows.shape == (9, 256) and eng.position == 21 + pending
    chain = [7] + [int(np.argmax(r)) for r in rows[:-1]]
    for r in range(9):
        assert (eng.verify(chain[: r + 1], np.arange(r + 1) - 1)[r] == rows[r]).all()
    # committed state untouched: decoding on gives what a fresh engine gives
    eng.verify(chain[:3], [-1, 0, 1])
    eng.commit([0, 1, 2])
    fresh = sapwood.load(ckpt, weights="q8").engine
    fresh.prefill([*prompt(21, seed=9), *prompt(pending, seed=10), *chain[:3]])
    assert (eng.verify([5], [-1]) == fresh.verify([5], [-1])).all()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("n_prefix", [1, 2])
def test_draft_chain_takes_a_prefix_in_its_first_forward(ckpt, n_prefix, temperature):
    """draft_chain(root, prefix=p) == prefill(p) then draft_chain(root), bitwise: its rows, the
    committed state it leaves and the rows keep_draft then adopts."""
    base, pre = prompt(40, seed=12), prompt(n_prefix, seed=13)
    a, b = (sapwood.load(ckpt, weights="q8").engine for _ in range(2))
    a.prefill(base)
    b.prefill(base)
    assert a.max_draft_prefix == 2  # conv kernel 4: a first forward of 3 rows keeps its inputs
    ids_a, _ = a.draft_candidates(7, 6, 1, temperature, 3, prefix=pre)
    b.prefill(pre)
    ids_b, _ = b.draft_candidates(7, 6, 1, temperature, 3)
    assert (ids_a == ids_b).all() and a.position == b.position == 40 + n_prefix
    chain = [7] + [int(t) for t in ids_a[:-1, 0]]
    assert a.keep_draft(chain[:4] + [3]) == b.keep_draft(chain[:4] + [3]) == 4
    tree = [5, 9, 2], [-1, 0, 0]
    assert (a.verify(*tree) == b.verify(*tree)).all()
    with pytest.raises(ValueError, match="prefix of 3 tokens"):
        a.draft_chain(7, 2, prefix=[1, 2, 3])
    with pytest.raises(ValueError):
        a.draft_chain(7, 2, prefix=[999999])
    assert (a.verify(*tree) == b.verify(*tree)).all()  # unchanged by the errors


@pytest.mark.parametrize("kept", [0, 1, 4, 6])
@pytest.mark.parametrize("pending", [0, 3])
def test_keep_draft_adopts_the_committed_rows_of_the_chain(ckpt, kept, pending):
    """After a draft chain, keep_draft(tokens) commits the prefix of tokens that the chain
    processed (here `kept` of them, then a token that leaves the chain) as pending GDN tokens;
    prefilling the rest leaves the state a plain prefill of all tokens gives, bitwise. The GDN
    layers may hold pending tokens before the chain (folding past a layer's limit is
    test_gdn's)."""
    base = prompt(70, seed=4)  # 70: the chain crosses a KV page boundary (64)
    eng = sapwood.load(ckpt, weights="q8").engine
    eng.prefill(base[:60 - pending])
    for t in base[60 - pending:60]:  # committed one at a time: GDN tokens left unfolded
        eng.verify([t], [-1])
        eng.commit([0])
    rows = eng.draft_chain(7, 6)
    chain = [7] + [int(np.argmax(r)) for r in rows[:-1]]
    tokens = chain[:kept] + [(chain[kept] + 1) % 256 if kept < 6 else 11, 3]
    m = eng.keep_draft(tokens)
    assert m == kept and eng.position == 60 + kept
    eng.prefill(tokens[m:])
    rows = eng.draft_chain(4, 6)  # a second chain, adopted whole
    chain2 = [4] + [int(np.argmax(r)) for r in rows[:-1]]
    assert eng.keep_draft(chain2) == 6
    fresh = sapwood.load(ckpt, weights="q8").engine
    fresh.prefill([*base[:60], *tokens, *chain2])
    assert eng.position == fresh.position
    tree = [5, 9, 2], [-1, 0, 0]
    assert (eng.verify(*tree) == fresh.verify(*tree)).all()
    # anything in between drops what the chain kept
    eng.draft_chain(7, 3)
    eng.verify([1], [-1])
    assert eng.keep_draft([7]) == 0 and eng.position == fresh.position


def test_sampled_draft_chain_follows_the_keyed_sampler(ckpt):
    """At temperature > 0 the chain's pick from each row is the keyed Gumbel-max sample among
    the row's best kDraftSampleTop (256) ids (here all of them), and each row still equals the
    chain's verify."""
    from sapwood.reference.sampling import keyed_uniform

    eng = sapwood.load(ckpt, weights="q8").engine
    eng.prefill(prompt(13, seed=3))
    T, seed, rows = 0.8, 77, 6
    z = eng.draft_chain(7, rows, temperature=T, seed=seed)
    ids, logp = eng.draft_candidates(7, rows, 5, temperature=T, seed=seed)
    chain = [7]
    for r in range(rows):
        x = z[r].astype(np.float64)
        score = (x - x.max()) / T - np.log(-np.log(keyed_uniform(seed, 13 + r + 1, np.arange(256))))
        best = int(np.argmax(score))
        assert ids[r, 0] == best
        chain.append(int(best))
        # then the most likely others, and log-probabilities of the row (the engine sums float32
        # exps in float64: each exp is within ~1 ulp of float32 (1.2e-7 relative), hence 1e-6)
        others = [t for t in np.argsort(-x, kind="stable") if t != best][:4]
        assert ids[r, 1:].tolist() == others
        lse = x.max() + np.log(np.exp(x - x.max()).sum())
        np.testing.assert_allclose(logp[r], x[ids[r]] - lse, rtol=0, atol=1e-6)
    for r in range(rows):
        assert (eng.verify(chain[: r + 1], np.arange(r + 1) - 1)[r] == z[r]).all()
    assert eng.position == 13
    greedy = eng.draft_candidates(7, rows, 1)[0][:, 0]
    assert greedy.tolist() == [int(np.argmax(r)) for r in eng.draft_chain(7, rows)]


def test_snapshot_restore_replays_identically(ckpt):
    eng = sapwood.load(ckpt, weights="q8").engine
    eng.prefill(prompt(15, seed=7))
    snap = eng.snapshot()

    def decode(n):
        out, t = [], 3
        for _ in range(n):
            lg = eng.verify([t], [-1])[0]
            eng.commit([0])
            out.append(lg)
            t = int(np.argmax(lg))
        return np.stack(out)

    first = decode(6)
    eng.restore(snap)
    assert eng.position == 15 and snap.position == 15
    assert (decode(6) == first).all()
    eng.reset()
    assert eng.position == 0


def test_commit_folding_in_background_gives_the_same_bits(ckpt):
    """commit(fold_in_background=True) folds the path's GDN steps on a pool worker while the
    caller goes on (here: another engine drafts, as the decoder's draft model does); whatever
    the caller calls next on the engine waits for it. Every call below equals the engine that
    folds in its next verify."""
    plain, bg = (sapwood.load(ckpt, weights="q8", threads=2).engine for _ in range(2))
    other = sapwood.load(ckpt, weights="q8", threads=2).engine
    for e in (plain, bg, other):
        e.prefill(prompt(21, seed=11))
    rng = np.random.default_rng(12)
    for step in range(8):
        parents = random_tree(9, step)
        tree = prompt(9, seed=20 + step)
        a, b = plain.verify(tree, parents), bg.verify(tree, parents)
        assert (a == b).all(), f"verify after step {step}"
        path = path_to(parents, int(rng.integers(0, 9)))
        plain.commit(path)
        bg.commit(path, fold_in_background=True)
        other.draft_candidates(int(tree[0]), 4, 2, 0.0, 0, [])  # the caller works meanwhile
        if step == 3:  # calls other than verify wait for the fold too
            mp, mb = plain.memory(), bg.memory()  # the folded steps' tape is gone
            assert mb.pop("gdn_state_bytes") < mp.pop("gdn_state_bytes") and mp == mb
            sp, sb = plain.snapshot(), bg.snapshot()
            plain.restore(sp), bg.restore(sb)
        if step == 5:
            ip, lp = plain.draft_candidates(3, 3, 2, 0.0, 0, [])
            ib, lb = bg.draft_candidates(3, 3, 2, 0.0, 0, [])
            assert (ip == ib).all() and (lp == lb).all()
    assert plain.position == bg.position
    bg.verify([1], [-1])
    bg.commit([0], fold_in_background=True)
    del bg  # an engine may go while its fold runs


def test_thread_count_bitwise(ckpt):
    outs = []
    for threads in [1, 2]:
        eng = sapwood.load(ckpt, weights="q8", threads=threads).engine
        eng.prefill(prompt(33, seed=8))
        outs.append(eng.verify(prompt(10, seed=9), random_tree(10, 2)))
    assert (outs[0] == outs[1]).all()


@pytest.mark.parametrize("weights", ["bf16", "q8", "q4"])
def test_weight_formats_agree_with_f32(ckpt, weights):
    """End-to-end effect of weight quantization: relative RMS logit error against f32.
    Measured on these random 4-layer models: bf16 ~0.01, q8 ~0.05-0.07, q4 ~0.5-0.6 (random
    nets amplify 4-bit error; the q4 kernel itself is checked exactly in test_matmul.py).
    Bounds are ~1.5-3x the measurement."""
    bound = {"bf16": 0.03, "q8": 0.15, "q4": 0.9}[weights]
    toks = prompt(24, seed=10)
    base = sapwood.load(ckpt, weights="f32").engine.prefill(toks, all_logits=True)
    got = sapwood.load(ckpt, weights=weights).engine.prefill(toks, all_logits=True)
    rel = np.linalg.norm(got - base) / np.linalg.norm(base)
    top1 = (got.argmax(-1) == base.argmax(-1)).mean()
    print(f"{weights}: relative RMS logit error {rel:.4f}, top-1 agreement {top1:.3f}")
    assert rel <= bound


def test_memory_figures(ckpt):
    m = sapwood.load(ckpt, weights="q8", max_context=512)
    mem = m.engine.memory()
    assert mem["weights_bytes"] > 0 and mem["kv_pool_bytes"] > 0 and mem["kv_used_bytes"] == 0
    m.engine.prefill(prompt(70))
    # 3 GDN layers of the tiny model: S [4, 16, 16] + conv window [3, 128] floats each
    assert mem["gdn_state_bytes"] == 3 * 4 * (4 * 16 * 16 + 3 * 128)
    assert m.engine.memory()["kv_used_bytes"] > 0


def test_bad_input_then_usable(ckpt):
    eng = sapwood.load(ckpt, weights="q8", max_context=64).engine
    with pytest.raises(ValueError, match="token id 256"):
        eng.prefill([1, 256])
    with pytest.raises(ValueError, match="token id -1"):
        eng.verify([-1], [-1])
    with pytest.raises(ValueError, match="no tokens"):
        eng.prefill([])
    with pytest.raises(ValueError, match="context full"):
        eng.prefill(prompt(65))
    assert eng.position == 0
    eng.prefill(prompt(60))
    with pytest.raises(ValueError, match="context full"):
        eng.verify(prompt(6), np.arange(6) - 1)
    with pytest.raises(ValueError, match="without a preceding verify"):
        eng.commit([0])
    eng.verify([1, 2, 3], [-1, 0, 0])
    with pytest.raises(ValueError, match="not a child"):
        eng.commit([0, 1, 2])
    with pytest.raises(ValueError, match="parents"):
        eng.verify([1, 2], [-1, 1])
    with pytest.raises(ValueError, match="differ in length"):
        eng.verify([1, 2], [-1])
    with pytest.raises(ValueError, match="draft_chain: 5 rows at position 60"):
        eng.draft_chain(1, 5)
    with pytest.raises(ValueError, match="draft_chain: 0 rows"):
        eng.draft_chain(1, 0)
    with pytest.raises(ValueError, match="token id 300"):
        eng.draft_chain(300, 2)
    with pytest.raises(ValueError, match="temperature must be finite and >= 0, got -0.5"):
        eng.draft_chain(1, 2, temperature=-0.5)
    with pytest.raises(ValueError, match="draft_candidates: k must be >= 1, got 0"):
        eng.draft_candidates(1, 2, 0)
    with pytest.raises(ValueError, match="draft_chain: 0 rows"):
        eng.draft_candidates(1, 0, 4)
    assert eng.draft_chain(1, 4).shape == (4, 256)
    assert eng.position == 60
    eng.verify([1, 2, 3], [-1, 0, 0])
    eng.commit([0, 2])
    assert eng.position == 62
    assert np.isfinite(eng.verify([4], [-1])).all()


@pytest.mark.parametrize("weights", ["q8", "f32"])
def test_every_kernel_variant_gives_the_same_bits(ckpt, weights):
    """The whole forward (matmuls, activation quantization, norms, GDN, attention, draft
    ranking) on every ISA built and supported here: prefill rows, a tree verify after a commit
    and draft candidates agree bit for bit with the first variant."""
    outs = []
    for name in ISAS:
        with isa(name):
            eng = sapwood.load(ckpt, weights=weights).engine
            rows = eng.prefill(prompt(45, seed=8), all_logits=True)
            eng.verify([3], [-1])
            eng.commit([0])
            tree = eng.verify([5, 9, 2, 7], [-1, 0, 0, 1])
            ids, logp = eng.draft_candidates(4, 5, 3)
            outs.append((rows, tree, ids, logp))
    for got in outs[1:]:
        for a, b in zip(outs[0], got):
            assert (a == b).all()
