"""The numpy model reference (sapwood.reference.model) against transformers, and against itself.

transformers knows only the grouped GDN head order (it repeat_interleaves q/k over value heads),
so the tiled order is checked within the reference: a tiled checkpoint is the grouped one with
permuted value heads and must give the same logits.
"""
import numpy as np
import pytest

from sapwood.config import ModelConfig
from sapwood.reference.model import ReferenceModel
from sapwood.testing import make_tiny_checkpoint, to_tiled_order

safetensors_numpy = pytest.importorskip("safetensors.numpy")
pytest.importorskip("tokenizers")

PROMPT_LEN, STEPS = 24, 16


def _prompt(vocab, n=PROMPT_LEN, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tied" if request.param else "tiny")
    config = make_tiny_checkpoint(path, seed=3, tied=request.param)
    return path, config, safetensors_numpy.load_file(str(path / "model.safetensors"))


def _hf_model(path, dtype="float32"):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, info = transformers.Qwen3_5ForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), output_loading_info=True)
    # every tensor we wrote is one transformers expects, and vice versa
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return torch, model.float().eval()


def _close(a, b):
    # transformers runs float32, the reference float64: float32 rounding through 4 layers leaves
    # ~1e-6 relative error; 1e-4 of the logit scale catches any real formula error (those move
    # logits by >1e-2) without flaking on rounding.
    scale = max(1.0, float(np.abs(b).max()))
    err = float(np.abs(np.asarray(a, np.float64) - b).max())
    assert err <= 1e-4 * scale, f"max abs diff {err:.3g} > {1e-4 * scale:.3g}"


def test_matches_transformers(ckpt):
    path, config, weights = ckpt
    torch, model = _hf_model(path)
    prompt = _prompt(config["vocab_size"])

    # reference: prefill, then greedy decoding one committed token at a time
    ref = ReferenceModel(config, weights)
    ref_logits = [ref.prefill(prompt)]
    ref_tokens = []
    for _ in range(STEPS):
        ref_tokens.append(int(np.argmax(ref_logits[-1][-1])))
        ref_logits.append(ref.step(ref_tokens[-1])[None])
    ref_logits = np.concatenate(ref_logits)                      # [24 + 16, V]

    with torch.no_grad():
        # transformers, use_cache path: prompt at once (chunked GDN), then recurrent steps
        out = model(torch.tensor(prompt)[None], use_cache=True)
        hf_logits, hf_tokens, cache = [out.logits[0].double().numpy()], [], out.cache
        for _ in range(STEPS):
            hf_tokens.append(int(np.argmax(hf_logits[-1][-1])))
            out = model(torch.tensor([[hf_tokens[-1]]]), cache=cache, use_cache=True)
            hf_logits.append(out.logits[0].double().numpy())
            cache = out.cache
        hf_logits = np.concatenate(hf_logits)
        # transformers, full-sequence path without a cache over prompt + generated tokens
        full = np.concatenate([prompt, ref_tokens])
        hf_full = model(torch.tensor(full)[None], use_cache=False).logits[0].double().numpy()

    assert hf_tokens == ref_tokens
    _close(ref_logits, hf_logits)
    _close(ref_logits, hf_full)
    ref.reset()
    _close(ref.prefill(full), hf_full)                          # reference whole-sequence path


def test_bfloat16_checkpoint_matches_transformers(tmp_path):
    config = make_tiny_checkpoint(tmp_path, seed=5, dtype="bfloat16")
    torch, model = _hf_model(tmp_path, dtype="bfloat16")
    from safetensors.torch import load_file
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    weights = {n: t.float().numpy() for n, t in stored.items()}    # bf16 -> float32 is exact
    prompt = _prompt(config["vocab_size"])
    with torch.no_grad():
        hf = model(torch.tensor(prompt)[None], use_cache=False).logits[0].double().numpy()
    _close(ReferenceModel(config, weights).prefill(prompt), hf)


def test_prefill_equals_steps(ckpt):
    _, config, weights = ckpt
    tokens = _prompt(config["vocab_size"], 40, seed=2)
    for kv_int8, tol in ((False, 1e-9), (True, 1e-6)):
        # int8: a 1-ulp difference between the batched and single-row matmul can move a float32
        # quantization scale by one ulp, hence the looser bound
        a = ReferenceModel(config, weights, kv_int8=kv_int8)
        whole = a.prefill(tokens, chunk=64)
        b = ReferenceModel(config, weights, kv_int8=kv_int8)
        steps = np.stack([b.step(t) for t in tokens])
        c = ReferenceModel(config, weights, kv_int8=kv_int8)
        chunked = c.prefill(tokens, chunk=7)   # chunk boundaries leave GDN tokens pending
        np.testing.assert_allclose(steps, whole, rtol=0, atol=tol)
        np.testing.assert_allclose(chunked, whole, rtol=0, atol=tol)
        assert a.length == b.length == c.length == tokens.size
    exact = ReferenceModel(config, weights).prefill(tokens)
    assert np.abs(exact - whole).max() > 1e-4                   # the int8 round trip is active


def test_tree_verify_matches_chain(ckpt):
    _, config, weights = ckpt
    prompt = _prompt(config["vocab_size"], 10, seed=4)
    tree_tokens = np.array([5, 17, 9, 200, 33, 64])
    parents = [-1, 0, 0, 1, 1, 3]                               # path to node 5: [0, 1, 3, 5]
    model = ReferenceModel(config, weights)
    model.prefill(prompt)
    tree = model.verify(tree_tokens, parents)
    model.commit([0, 1, 3, 5])
    after = model.step(7)
    chain = ReferenceModel(config, weights)
    chain.prefill(prompt)
    for node in (0, 1, 3, 5):
        np.testing.assert_allclose(chain.step(tree_tokens[node]), tree[node], rtol=0, atol=1e-9)
    np.testing.assert_allclose(chain.step(7), after, rtol=0, atol=1e-9)
    side = ReferenceModel(config, weights)                      # an off-path node: node 2
    side.prefill(prompt)
    np.testing.assert_allclose(side.prefill([5, 9])[1], tree[2], rtol=0, atol=1e-9)


def test_tiled_head_order_is_the_same_model(ckpt, tmp_path):
    path, config, weights = ckpt
    tokens = _prompt(config["vocab_size"], 16, seed=6)
    grouped = ReferenceModel(config, weights).prefill(tokens)
    tiled_w = to_tiled_order(weights, config)
    np.testing.assert_allclose(ReferenceModel(config, tiled_w, head_order="tiled").prefill(tokens),
                               grouped, rtol=0, atol=1e-9)
    # read in the wrong order the permuted weights are a different model
    assert np.abs(ReferenceModel(config, tiled_w).prefill(tokens) - grouped).max() > 1e-3
    # the tiled checkpoint on disk says so in config.json and holds the same weights
    tcfg = make_tiny_checkpoint(tmp_path, seed=3, tied=config["tie_word_embeddings"], head_order="tiled")
    assert ModelConfig.from_dict(tcfg).head_order == "tiled"
    tw = safetensors_numpy.load_file(str(tmp_path / "model.safetensors"))
    assert tw.keys() == tiled_w.keys() and all(np.array_equal(tw[n], tiled_w[n]) for n in tw)


def test_config_parsing():
    flat = {"model_type": "qwen3_5_text", "num_hidden_layers": 8, "head_dim": 64,
            "rope_theta": 5e6, "partial_rotary_factor": 0.5}
    c = ModelConfig.from_dict(flat)
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",) + \
        ("linear_attention",) * 3 + ("full_attention",)
    assert (c.rotary_dim, c.rope_theta, c.tie_word_embeddings) == (32, 5e6, False)
    nested = {"model_type": "qwen3_5", "tie_word_embeddings": True,
              "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 8, "head_dim": 64,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                  "partial_rotary_factor": 0.5,
                                                  "mrope_section": [11, 11, 10]}}}
    n = ModelConfig.from_dict(nested)
    assert n.tie_word_embeddings and n.layer_types == c.layer_types and n.rotary_dim == 32


@pytest.mark.parametrize("config, words", [
    ({"model_type": "qwen3_next"}, ["qwen3_next", "not supported"]),
    ({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text"}},
     ["qwen3_5_moe", "MoE"]),
    ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_moe_text"}},
     ["qwen3_5_moe_text", "MoE"]),
    ({"model_type": "qwen3_5_text", "num_experts": 8}, ["MoE"]),
    ({"model_type": "llama"}, ["unsupported model_type 'llama'"]),
    ({"model_type": "qwen3_5_text", "rope_parameters": {"rope_type": "yarn"}}, ["yarn"]),
])
def test_config_rejects_unsupported(config, words):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dict(config)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_weights_are_checked(ckpt):
    _, config, weights = ckpt
    bad = dict(weights)
    bad["model.layers.0.linear_attn.A_log"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="A_log: shape"):
        ReferenceModel(config, bad)
    with pytest.raises(ValueError, match="unexpected weights"):
        ReferenceModel(config, {**weights, "model.layers.3.self_attn.q_proj.bias": np.zeros(4)})
    # composite (ConditionalGeneration) names map onto the text model
    renamed = {n.replace("model.", "model.language_model.", 1): w for n, w in weights.items()}
    tokens = _prompt(config["vocab_size"], 4)
    np.testing.assert_array_equal(ReferenceModel(config, renamed).prefill(tokens),
                                  ReferenceModel(config, weights).prefill(tokens))
