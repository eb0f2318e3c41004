"""The MTP drafter (issue 36): the head's forward against the numpy reference, the target's
hidden rows following commits, generation token-identical to plain decoding, clear load
errors for bad heads."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import sapwood
from sapwood.drafters import MtpDrafter
from sapwood.reference.model import ReferenceModel
from sapwood.reference.mtp import MtpReference
from sapwood.safetensors_io import load_checkpoint_weights
from sapwood.testing import make_tiny_checkpoint
from util import assert_close

# f32 weights and an f32 KV cache against the float64 reference: the runtime's float32 sums of
# at most 2H = 128 products per dot, through the target's 4 layers and then the head's one,
# with logits of magnitude ~3: observed errors stay below 2e-5; 2e-4 leaves room for other ISAs'
# summation orders while a wrong norm, concatenation order or position would be off by O(0.1).
ATOL = 2e-4
PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, 240, 24)]


def _ckpt(tmp_path_factory, name, **kw):
    d = tmp_path_factory.mktemp(name)
    cfg = make_tiny_checkpoint(d, mtp=True, **kw)
    return d, cfg


@pytest.fixture(scope="module", params=["plain-untied", "multimodal-tied"])
def head(request, tmp_path_factory):
    layout, tie = request.param.split("-")
    d, cfg = _ckpt(tmp_path_factory, request.param, layout=layout, tied=tie == "tied")
    model = sapwood.load(d, weights="f32", kv="f32", max_context=256)
    w = load_checkpoint_weights(Path(d))
    return model, ReferenceModel(cfg, w), MtpReference(cfg, w)


def test_hidden_rows_and_head_forward_match_reference(head):
    model, ref, mref = head
    eng, mtp = model.engine, model.mtp
    eng.reset()
    mtp.reset()
    eng.keep_hidden = True
    eng.prefill(PROMPT)
    start, h = eng.take_hidden()
    assert start == 0 and h.shape == (len(PROMPT), 64)
    h_ref, _ = ref.forward(PROMPT, np.arange(len(PROMPT)) - 1)
    assert_close(h, h_ref, ATOL, "target final hidden rows")
    # every committed row at once: logits and output hidden states of each
    nxt = PROMPT[1:] + [7]
    z, out_h = mtp.prefill(h, nxt, True)
    out_ref, z_ref = mref.prefill(h, nxt)
    assert_close(z, z_ref, ATOL, "MTP logits")
    assert_close(out_h, out_ref, ATOL, "MTP output hidden")
    assert mtp.position == len(PROMPT)
    # then a chain of 6 rows from two more committed rows, rolled back after
    more = np.random.default_rng(2).normal(size=(2, 64)).astype(np.float32)
    ids, logp, zc = mtp.draft(more, [11, 12], 6, 3, 0.0, 0, 0, True)
    zc_ref, picks = mref.draft(more, [11, 12], 6)
    assert_close(zc, zc_ref, ATOL, "MTP chain logits")
    assert ids[:, 0].tolist() == picks
    assert mtp.position == len(PROMPT) + 2  # the drafted rows rolled back, the given ones kept
    # ranked as draft_candidates: log-probabilities of the row's softmax, best others next
    lse = np.log(np.exp(zc_ref - zc_ref.max(1, keepdims=True)).sum(1)) + zc_ref.max(1)
    assert_close(logp, np.take_along_axis(zc_ref, ids, 1) - lse[:, None], ATOL, "log-probabilities")
    assert (np.diff(logp[:, 1:], axis=1) <= 0).all()


def test_drafter_follows_tree_commits(head):
    """The head reads the committed path's rows of a tree verify (not its other nodes), and
    the draft after a commit is the reference's from the reference target's hidden rows."""
    model, ref, mref = head
    eng = model.engine
    drafter = MtpDrafter(model, top_k=2)
    eng.reset()
    ref.reset()
    mref.reset()
    eng.prefill(PROMPT)
    h_ref = ref.forward(PROMPT, np.arange(len(PROMPT)) - 1)[0]  # rows of the committed prompt
    ref.commit(list(range(len(PROMPT))))
    context, root = list(PROMPT), 9
    lat = drafter.draft(context, root, 4)
    z_ref, picks = mref.draft(h_ref, PROMPT[1:] + [root], 4)
    assert lat.chain() == picks
    # a tree whose committed path [0, 2] skips node 1: the head must read nodes 0 and 2's rows
    tokens, parents = [root, 20, 21, 22], [-1, 0, 0, 2]
    eng.verify(tokens, parents)
    eng.commit([0, 2])
    h_tree, _ = ref.forward(tokens, parents)
    ref.commit([0, 2])
    context += [root, 21]
    root = 30
    lat = drafter.draft(context, root, 3)
    z_ref, picks = mref.draft(h_tree[[0, 2]], [21, root], 3)
    assert lat.chain() == picks
    assert_close(lat.logprobs[:, 0], [z[p] - np.log(np.exp(z - z.max()).sum()) - z.max()
                                      for z, p in zip(z_ref, picks)], ATOL, "chain log-probabilities")


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    d, _ = _ckpt(tmp_path_factory, "q8")
    return sapwood.load(d, max_context=512)


@pytest.mark.parametrize("verify", ["chain", "tree", "auto"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generate_token_identical(q8_model, verify, temperature):
    prompt = "The quick brown fox jumps over the lazy dog. The quick"
    plain = q8_model.generate(prompt, max_tokens=32, verify="off", temperature=temperature, seed=5)
    out = q8_model.generate(prompt, max_tokens=32, verify=verify, drafter="mtp",
                            temperature=temperature, seed=5, width=6 if verify == "tree" else None)
    assert out.tokens == plain.tokens
    assert out.stats.cycles < out.stats.tokens or out.stats.draft_rows_accepted == 0
    if verify != "auto":  # auto may measure plain decoding faster and draft nothing: timing
        assert out.stats.nodes_verified > out.stats.cycles  # drafts were verified


def test_none_prefers_mtp_and_cache_prompt_identical(q8_model):
    assert isinstance(q8_model.resolve_drafter(None), MtpDrafter)
    prompt = "def main():\n    print('hello"
    plain = q8_model.generate(prompt, max_tokens=32, verify="off").tokens
    for _ in range(2):  # the second request restores the prompt: the head starts past the gap
        assert q8_model.generate(prompt, max_tokens=32, verify="chain", cache_prompt=True).tokens == plain


def test_head_changes_no_target_output(tmp_path):
    """Adding the head leaves the target's weights (same seed) and logits as they were, and
    keeping the hidden rows does not change a bit of the logits."""
    make_tiny_checkpoint(tmp_path / "a", seed=3)
    make_tiny_checkpoint(tmp_path / "b", seed=3, mtp=True)
    a, b = sapwood.load(tmp_path / "a"), sapwood.load(tmp_path / "b")
    assert a.mtp is None and b.mtp is not None
    b.engine.keep_hidden = True
    za, zb = a.engine.prefill(PROMPT, True), b.engine.prefill(PROMPT, True)
    assert np.array_equal(za, zb)
    ta, tb = a.engine.verify([5, 6, 7], [-1, 0, 0]), b.engine.verify([5, 6, 7], [-1, 0, 0])
    assert np.array_equal(ta, tb)


GPU = [b for b in sapwood.available_backends() if b != "cpu"]


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory, "gpu")[0]


@pytest.mark.skipif(not GPU, reason="this build has no GPU backend")
@pytest.mark.parametrize("backend", GPU)
def test_head_on_gpu_backend_close_to_cpu(plain_ckpt, backend):
    """The head runs on the target's backend kind. Its logits and output rows against the CPU
    head's for the same rows and tokens: f32 weights and int8 KV on both sides, so they differ
    by the kernels' summation orders only (test_backends.py's f32 bound, 2e-3 of the scale),
    where a missing norm or a wrong fc half would be off by O(1)."""
    out = {}
    h = np.random.default_rng(3).normal(size=(len(PROMPT), 64)).astype(np.float32)
    nxt = PROMPT[1:] + [7]
    for b in ("cpu", backend):
        mtp = sapwood.load(plain_ckpt, weights="f32", backend=b, max_context=256).mtp
        z, out_h = mtp.prefill(h, nxt, True)
        ids, _, zc = mtp.draft(h[:2], [11, 12], 5, 2, 0.0, 0, 0, True)
        assert mtp.position == len(PROMPT) + 2
        out[b] = (z, out_h, zc)
    for what, got, want in zip(("prefill logits", "output rows", "chain logits"), out[backend], out["cpu"]):
        err = float(np.abs(got - want).max() / np.abs(want).max())
        print(f"{backend} vs cpu, {what}: {err:.2e} of the scale")
        assert err <= 2e-3, what


@pytest.mark.skipif(not GPU, reason="this build has no GPU backend")
@pytest.mark.parametrize("backend", GPU)
@pytest.mark.parametrize("verify, temperature", [("chain", 0.0), ("tree", 0.8)])
def test_generate_on_gpu_backend_token_identical(plain_ckpt, backend, verify, temperature):
    m = sapwood.load(plain_ckpt, backend=backend, max_context=256)
    prompt = "The quick brown fox jumps over the lazy dog. The quick"
    plain = m.generate(prompt, max_tokens=16, verify="off", temperature=temperature, seed=5)
    out = m.generate(prompt, max_tokens=16, verify=verify, drafter="mtp", temperature=temperature,
                     seed=5, width=6 if verify == "tree" else None)
    assert out.tokens == plain.tokens
    if verify != "auto":  # auto may measure plain decoding faster and draft nothing: timing
        assert out.stats.nodes_verified > out.stats.cycles  # drafts were verified


def _rewrite(d: Path, mutate_weights=None, mutate_config=None):
    from safetensors.numpy import save_file

    f = d / "model.safetensors"
    w = dict(load_checkpoint_weights(d))
    if mutate_weights:
        mutate_weights(w)
    save_file({n: np.ascontiguousarray(x) for n, x in w.items()}, str(f), metadata={"format": "pt"})
    if mutate_config:
        c = json.loads((d / "config.json").read_text())
        mutate_config(c)
        (d / "config.json").write_text(json.dumps(c))


def _set(name, shape):
    return lambda w: w.__setitem__(name, np.zeros(shape, np.float32))


@pytest.mark.parametrize("mutate_weights, mutate_config, match", [
    (_set("mtp.fc.weight", (64, 64)), None, r"MTP tensor 'mtp.fc.weight' has shape \(64, 64\), expected \(64, 128\)"),
    (_set("mtp.layers.0.self_attn.k_proj.weight", (32, 64)), None,
     r"'mtp.layers.0.self_attn.k_proj.weight' has shape \(32, 64\), expected \(64, 64\)"),
    (_set("mtp.pre_fc_norm_hidden.weight", (65,)), None, "mtp.pre_fc_norm_hidden.weight"),
    (lambda w: w.pop("mtp.layers.0.self_attn.q_proj.weight"), None,
     r"missing MTP tensor 'mtp.layers.0.self_attn.q_proj.weight' \(config says mtp_num_hidden_layers=1\)"),
    (lambda w: [w.pop(n) for n in list(w) if n.startswith("mtp.layers.0.")], None,
     "missing MTP tensor 'mtp.layers.0."),
    (None, lambda c: c.update(mtp_num_hidden_layers=2), r"missing MTP tensor 'mtp.layers.1\."),
    (_set("mtp.layers.1.input_layernorm.weight", (64,)), None,
     "unexpected MTP tensor 'mtp.layers.1.input_layernorm.weight'"),
])
def test_bad_head_fails_at_load(tmp_path, mutate_weights, mutate_config, match):
    make_tiny_checkpoint(tmp_path, mtp=True)
    _rewrite(tmp_path, mutate_weights, mutate_config)
    with pytest.raises(ValueError, match=match):
        sapwood.load(tmp_path)


def test_no_head(tmp_path):
    make_tiny_checkpoint(tmp_path)
    m = sapwood.load(tmp_path)
    with pytest.raises(ValueError, match="drafter='mtp': this checkpoint has no MTP head"):
        m.generate([1, 2, 3], max_tokens=4, drafter="mtp")
    # a head the config does not announce is ignored (as transformers does), not an error
    make_tiny_checkpoint(tmp_path / "quiet", mtp=True)
    _rewrite(tmp_path / "quiet", mutate_config=lambda c: c.pop("mtp_num_hidden_layers"))
    assert sapwood.load(tmp_path / "quiet").mtp is None


def test_bad_head_calls(head):
    model = head[0]
    with pytest.raises(ValueError, match=r"hidden has shape \(2, 63\)"):
        model.mtp.prefill(np.zeros((2, 63), np.float32), [1, 2])
    with pytest.raises(ValueError, match="token id 9999 at index 1"):
        model.mtp.prefill(np.zeros((2, 64), np.float32), [1, 9999])
    with pytest.raises(ValueError, match="hidden has 128 floats, expected 3 rows of 64"):
        model.mtp.prefill(np.zeros((2, 64), np.float32), [1, 2, 3])
    with pytest.raises(ValueError, match="k must be >= 1"):
        model.mtp.draft(np.zeros((1, 64), np.float32), [1], 2, 0)


def test_bundled_target_ships_a_trained_head():
    """The bundled target carries its MTP head (scripts/train_mtp.py) in the real layout: it
    loads, generates plain decoding's tokens, and the target keeps some of its drafts (a chain
    that kept none would make 1.0 tokens per cycle)."""
    from sapwood.loading import default_target_path

    m = sapwood.load(default_target_path(), max_context=1024)
    assert m.mtp is not None and m.config.mtp_layers == 1
    prompt = "def merge(a, b):\n"
    plain = m.generate(prompt, max_tokens=32, verify="off").tokens
    r = m.generate(prompt, max_tokens=32, verify="chain", drafter="mtp")
    assert r.tokens == plain
    assert r.stats.tokens_per_cycle > 1.1
