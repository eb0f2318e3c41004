"""scripts/pad_checkpoint.py: a wider MLP and extra zero-output layers change a checkpoint's cost,
not its function. Logits are compared with ==: the padding adds exact zeros (see the script)."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import sapwood
from sapwood.testing import make_tiny_checkpoint

_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "pad_checkpoint.py"
_spec = importlib.util.spec_from_file_location("pad_checkpoint", _SCRIPT)
pad = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pad)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pad")
    # 4 layers (3 GDN, 1 attention), bfloat16 as the bundled checkpoints are
    make_tiny_checkpoint(root / "src", seed=3, layers=4, dtype="bfloat16")
    cfg = pad.pad_checkpoint(root / "src", root / "dst", intermediate=200, layers=9)
    return root / "src", root / "dst", cfg


def test_padded_config_and_weights(pair):
    src, dst, cfg = pair
    assert cfg["intermediate_size"] == 200 and cfg["num_hidden_layers"] == 9
    # the pattern goes on (every 4th layer attention); extra layers copy a layer of their type
    assert cfg["layer_types"] == json.loads((src / "config.json").read_text())["layer_types"] + [
        "linear_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"]
    w = sapwood.safetensors_io.load_checkpoint_weights(dst)
    assert w["model.layers.0.mlp.gate_proj.weight"].shape[0] == 200
    assert not w["model.layers.0.mlp.gate_proj.weight"][128:].any()
    assert not w["model.layers.7.self_attn.o_proj.weight"].any()
    assert not w["model.layers.8.mlp.down_proj.weight"].any()
    assert w["model.layers.7.self_attn.q_proj.weight"].any()  # computes on real values


@pytest.mark.parametrize("weights", ["f32", "q8"])
def test_padded_model_is_the_same_function(pair, weights):
    src, dst, _ = pair
    a = sapwood.load(src, weights=weights, max_context=256)
    b = sapwood.load(dst, weights=weights, max_context=256)
    ids = list(np.random.default_rng(0).integers(1, 250, 40))
    la, lb = a.engine.prefill(ids), b.engine.prefill(ids)
    assert (la == lb).all()
    tree, parents = [5, 6, 7, 8], [-1, 0, 0, 1]  # a verify of a tree too
    assert (a.engine.verify(tree, parents) == b.engine.verify(tree, parents)).all()
    assert (a.generate(ids, max_tokens=24, verify="off").tokens
            == b.generate(ids, max_tokens=24, verify="off").tokens)


def test_padding_never_shrinks(pair, tmp_path):
    src, _, _ = pair
    with pytest.raises(ValueError, match="intermediate"):
        pad.pad_checkpoint(src, tmp_path / "x", intermediate=64, layers=9)
    with pytest.raises(ValueError, match="layers"):
        pad.pad_checkpoint(src, tmp_path / "x", intermediate=200, layers=2)


def test_mtp_head_is_widened_with_the_target(tmp_path):
    """An MTP head's MLP has the target's intermediate size: the padded checkpoint loads, and the
    head drafts as before (the same rows kept by the same chain rounds)."""
    make_tiny_checkpoint(tmp_path / "src", seed=5, layers=4, dtype="bfloat16", mtp=True)
    pad.pad_checkpoint(tmp_path / "src", tmp_path / "dst", intermediate=200, layers=6)
    w = sapwood.safetensors_io.load_checkpoint_weights(tmp_path / "dst")
    assert w["mtp.layers.0.mlp.gate_proj.weight"].shape[0] == 200
    assert not w["mtp.layers.0.mlp.down_proj.weight"][:, 128:].any()
    a = sapwood.load(tmp_path / "src", max_context=256, policy_cache=False)
    b = sapwood.load(tmp_path / "dst", max_context=256, policy_cache=False)
    ids = list(np.random.default_rng(1).integers(1, 250, 30))
    ra, rb = (m.generate(ids, max_tokens=24, verify="chain", drafter="mtp", adapt_rows=False)
              for m in (a, b))
    assert ra.tokens == rb.tokens
    assert ra.stats.draft_rows_accepted == rb.stats.draft_rows_accepted
