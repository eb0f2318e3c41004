"""The training forward of scripts/train_default.py against transformers' Qwen3_5ForCausalLM and
against sapwood's numpy spec (python/sapwood/reference/model.py).

    python3 -m pytest scripts/test_train_forward.py -q

Same random weights (non-identity norms, random dt_bias / A_log / conv) go into both models; the
training module's state_dict must load into HF with strict names and shapes.

Tolerances:
- float32 vs transformers (float32): relative error ||ours - hf|| / ||hf|| over all logits < 1e-5.
  Both compute the same math in float32 with different op orders (we batch all chunks' triangular
  solves, HF loops over them; attention via SDPA vs eager), so they differ by rounding only.
  Measured against the float64 numpy spec each is ~2-5e-6 off (aggressive random O(1) weights,
  8 layers, 64x64 triangular solves per chunk amplify ulps), so 1e-5 is the rounding floor with
  ~2x headroom; a real mistake (a wrong gate, head order, norm offset or decay) moves logits by
  1e-3..1 relative.
- float64 vs the numpy spec (float64): max |diff| / max |logit| < 1e-10. transformers cannot be
  the float64 oracle: its GDN path casts to float32 internally (g via A_log.float(), the chunk rule
  via .to(float32)) and computes rope in float32.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "python"))  # sapwood.reference, uninstalled
import train_default as td  # noqa: E402

from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

TINY = td.hybrid_config(hidden=64, layers=8, intermediate=96, heads=4, kv_heads=2, hk=2, hv=4,
                        head_dim=32, dk=32, dv=16)
TINY["vocab_size"] = 512


def randomize(model: td.HybridLM, seed: int):
    """Weights with O(1) activations and nothing at its identity value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # zero-centred norms
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def hf_model(cfg: dict, sd: dict, dtype):
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = Qwen3_5TextConfig(**kw)
    config._attn_implementation = "eager"
    m = Qwen3_5ForCausalLM(config).to(dtype).eval()
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    m.tie_weights()
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    return m


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


CONFIGS = {"tiny": TINY, "draft": td.DRAFT_CONFIG, "target": td.TARGET_CONFIG}


def random_model(cfg_name, dtype, seed=1):
    torch.manual_seed(0)
    m = td.HybridLM(CONFIGS[cfg_name])
    randomize(m, seed)
    return m.to(dtype).eval()


@pytest.mark.parametrize("cfg_name,B,T", [("tiny", 2, 150), ("tiny", 1, 64), ("draft", 2, 130),
                                          ("target", 1, 200)])
def test_logits_match_transformers_fp32(cfg_name, B, T):
    cfg = CONFIGS[cfg_name]
    ours = random_model(cfg_name, torch.float32)
    hf = hf_model(cfg, ours.hf_state_dict(), torch.float32)
    ids = torch.randint(0, cfg["vocab_size"], (B, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(ids, use_cache=False).logits
        got = ours(ids)
    assert want.abs().max() > 1.0  # not a degenerate comparison
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-5, f"relative logit error {err:.2e} >= 1e-5"


@pytest.mark.parametrize("cfg_name,T", [("tiny", 150), ("draft", 70)])
def test_logits_match_numpy_reference_fp64(cfg_name, T):
    ref_mod = pytest.importorskip("sapwood.reference.model")
    cfg = CONFIGS[cfg_name]
    ours = random_model(cfg_name, torch.float64)
    ref = ref_mod.ReferenceModel(cfg, {k: v.numpy() for k, v in ours.hf_state_dict().items()})
    ids = torch.randint(0, cfg["vocab_size"], (1, T), generator=torch.Generator().manual_seed(2))
    want = torch.from_numpy(ref.prefill(ids[0].numpy()))
    with torch.no_grad():
        got = ours(ids)[0]
    err = rel_err(got, want)
    assert err < 1e-10, f"relative logit error {err:.2e} >= 1e-10"


def test_state_dict_names_match_hf():
    ours = td.HybridLM(td.TARGET_CONFIG)
    kw = {k: v for k, v in td.TARGET_CONFIG.items() if k not in ("architectures", "model_type")}
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kw))
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    got = {k: tuple(v.shape) for k, v in ours.hf_state_dict().items()}
    assert got == want


def test_chunk_matches_recurrent_with_grads():
    """Chunked WY form == token recurrence, values and gradients (float64), with a start state."""
    g = torch.Generator().manual_seed(3)
    B, H, T, dk, dv = 2, 3, 150, 16, 8
    q = torch.nn.functional.normalize(torch.randn(B, H, T, dk, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, H, T, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g, dtype=torch.float64)
    gl = -torch.rand(B, H, T, generator=g, dtype=torch.float64) * 2
    beta = torch.rand(B, H, T, generator=g, dtype=torch.float64)
    s0 = torch.randn(B, H, dk, dv, generator=g, dtype=torch.float64)
    ins = [x.requires_grad_() for x in (q, k, v, gl, beta, s0)]
    o1, s1 = td.chunk_gated_delta_rule(*ins[:5], state=ins[5])
    g1 = torch.autograd.grad((o1.sin().sum() + s1.cos().sum()), ins)
    o2, s2 = td.recurrent_gated_delta_rule(*ins[:5], state=ins[5])
    g2 = torch.autograd.grad((o2.sin().sum() + s2.cos().sum()), ins)
    assert torch.allclose(o1, o2, atol=1e-10) and torch.allclose(s1, s2, atol=1e-10)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-9)


def test_cached_decode_matches_full_forward():
    """The generation path (prefill + per-token steps with KV cache / GDN state) == one forward."""
    torch.manual_seed(0)
    m = td.HybridLM(TINY).double().eval()
    randomize(m, 4)
    m = m.double()
    ids = torch.randint(0, TINY["vocab_size"], (2, 100), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = m(ids)
        cache = {}
        parts = [m(ids[:, :70], cache, 0)]
        parts.append(m(ids[:, 70:80], cache, 70))        # a chunk with history (masked attention)
        for t in range(80, 100):
            parts.append(m(ids[:, t:t + 1], cache, t))  # single-token steps (recurrent GDN)
    assert rel_err(torch.cat(parts, 1), full) < 1e-10


def test_training_step_runs():
    m = td.HybridLM(TINY)
    ids = torch.randint(0, TINY["vocab_size"], (2, 65))
    loss = torch.nn.functional.cross_entropy(m(ids[:, :-1]).reshape(-1, TINY["vocab_size"]), ids[:, 1:].reshape(-1))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_generate_topk_matches_full_forward():
    m = random_model("tiny", torch.float64, seed=6)
    pre = torch.randint(0, TINY["vocab_size"], (3, 70), generator=torch.Generator().manual_seed(7))
    seq, v, i = td.generate(m, pre, 10, 0.0, None, topk=5)
    with torch.no_grad():
        lp = torch.log_softmax(m(seq[:, :-1]), -1)
    assert seq.shape == (3, 80) and v.shape == (3, 79, 5)
    assert torch.allclose(lp.gather(-1, i), v, atol=1e-10)
    assert torch.equal(seq[:, 70:], lp[:, 69:].argmax(-1))  # greedy
