"""The streaming loader: weights go from the files into the engine a chunk at a time.

Checked here: the streamed engine is the engine of the same tensors handed over whole (same
model_id, logits ==), whatever the file's float dtype and the chunking; a load's peak memory
stays within 1.3x of what the engine holds (measured in a subprocess at the real vocabulary);
the memory estimate matches the engine's own accounting; a model that cannot fit is refused
before anything is read."""
import json
import sys

import numpy as np
import pytest

import sapwood
from sapwood import _core
from sapwood.benchmarks.load import measure_load
from sapwood.loading import engine_dims, read_checkpoint
from sapwood.memory import estimate_config
from sapwood.config import ModelConfig
from sapwood.safetensors_io import load_checkpoint_weights
from sapwood.testing import make_tiny_checkpoint

PROMPT = [1, 5, 9, 200, 17, 3, 44]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(d, seed=7, dtype="bfloat16", mtp=True)
    return d


def _engine(weights, cfg, fmt="q8"):
    return _core.Engine(engine_dims(cfg), weights, fmt, "int8", 64, 2, "cpu")


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8", "q4"])
def test_streamed_engine_is_the_whole_tensor_engine(tiny, fmt):
    ck = read_checkpoint(tiny)
    whole = {n: ck.weights[n] for n in ck.weights}  # a dict: handed over as float32 arrays
    a, b = _engine(whole, ck.config, fmt), _engine(ck.weights, ck.config, fmt)
    assert a.model_id == b.model_id
    assert np.array_equal(a.prefill(PROMPT), b.prefill(PROMPT))


@pytest.mark.parametrize("chunk_bytes", [1, 48 * 256])
def test_chunking_changes_nothing(tiny, chunk_bytes):
    ck = read_checkpoint(tiny)
    ref = _engine(ck.weights, ck.config)  # the default chunk: every tensor here in one read
    # reads of 16 rows (the loader's smallest block) and of 48 rows of 64 floats
    ck.weights.chunk_bytes = chunk_bytes
    got = _engine(ck.weights, ck.config)
    assert got.model_id == ref.model_id and np.array_equal(got.prefill(PROMPT), ref.prefill(PROMPT))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_file_dtype_of_equal_values_changes_nothing(tiny, tmp_path, dtype):
    """bf16 values written as f16 (where exact) or f32 stream to the same engine."""
    from safetensors.numpy import save_file

    w = load_checkpoint_weights(tiny)
    if dtype == "float16":  # keep values f16 represents exactly: a few mantissa bits, small range
        w = {n: np.round(x * 64) / 64 for n, x in w.items()}
        src = tmp_path / "ref"
        save_file({n: x.astype(np.float32) for n, x in w.items()}, str(_copy(tiny, src) / "model.safetensors"))
        tiny = src
    d = _copy(tiny, tmp_path / dtype)
    save_file({n: x.astype(dtype) for n, x in w.items()}, str(d / "model.safetensors"))
    a, b = read_checkpoint(tiny), read_checkpoint(d)
    ea, eb = _engine(a.weights, a.config), _engine(b.weights, b.config)
    assert ea.model_id == eb.model_id and np.array_equal(ea.prefill(PROMPT), eb.prefill(PROMPT))


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def test_mtp_head_built_on_first_use_from_the_files(tiny):
    m = sapwood.load(tiny, max_context=64, threads=1)
    assert m._mtp is None  # nothing of the head read at load
    head = m.mtp
    assert head is not None and m.mtp is head
    whole = {n: x for n, x in load_checkpoint_weights(tiny).items() if n.startswith("mtp.")}
    ref = _core.MtpHead(m.engine, whole, "q8", "int8", 64, 1, "cpu")
    hidden = np.random.default_rng(0).standard_normal((3, m.config.hidden_size)).astype(np.float32)
    assert np.array_equal(head.prefill(hidden, [1, 2, 3])[0], ref.prefill(hidden, [1, 2, 3])[0])


def test_non_finite_value_named_with_its_index(tiny, tmp_path):
    from safetensors.numpy import save_file

    w = load_checkpoint_weights(tiny)
    name = "model.layers.2.mlp.down_proj.weight"
    w[name].reshape(-1)[77] = np.inf
    d = _copy(tiny, tmp_path / "bad")
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name} has a non-finite value inf at flat index 77"):
        sapwood.load(d)


@pytest.mark.parametrize("weights", ["f32", "bf16", "q8", "q4"])
@pytest.mark.parametrize("kv", ["int8", "f32"])
def test_estimate_matches_the_engine(tiny, weights, kv):
    m = sapwood.load(tiny, weights=weights, kv=kv, max_context=200, threads=1)
    est = estimate_config(m.config, weights=weights, kv=kv, max_context=200)
    mem = m.engine.memory()
    assert est.parts["weights"] == mem["weights_bytes"]
    assert est.parts["kv_cache"] == mem["kv_pool_bytes"]
    assert est.parts["gdn_states"] == mem["gdn_state_bytes"]
    assert est.parts["mtp_drafter"] > 0 and est.total > sum(mem.values())


@pytest.fixture(scope="module")
def nine_b(tmp_path_factory):
    """Qwen3.5-9B as published, its files holes: real headers, no disk, every value zero."""
    from sapwood.checkpoints import write_checkpoint

    d = tmp_path_factory.mktemp("nine")
    write_checkpoint("9B", d, sparse=True, tokenizer=None)
    return d


def test_too_big_refused_before_reading(nine_b, monkeypatch):
    monkeypatch.setenv("SAPWOOD_MEMORY_GB", "20")
    with pytest.raises(MemoryError, match=r"weights='f32' needs 3\d\.\d GB, 20\.0 GB available; "
                                          r"weights='bf16' needs 1\d\.\d GB") as e:
        sapwood.load(nine_b, weights="f32")
    assert "kv_cache" in str(e.value) and "check_memory=False" in str(e.value)
    monkeypatch.setenv("SAPWOOD_MEMORY_GB", "1")
    with pytest.raises(MemoryError, match="no weights mode fits"):
        sapwood.load(nine_b, weights="q4")
    est = sapwood.estimate(nine_b, weights="q4")
    assert 4.5e9 < est.parts["weights"] < 6e9 and "mtp_drafter" in est.parts


def test_config_contradicted_by_the_tensors_named_before_the_memory_check(tmp_path, monkeypatch):
    from sapwood.checkpoints import write_checkpoint

    monkeypatch.setenv("SAPWOOD_MEMORY_GB", "1")
    d = tmp_path / "more_layers"  # written anew: a copy of a sparse file is not sparse
    write_checkpoint("9B", d, sparse=True, tokenizer=None)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = 4000
    cfg["text_config"].pop("layer_types")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.32."):
        sapwood.load(d)


def test_absent_mixers_widths_cost_nothing(tmp_path):
    """Found by test_fuzz_config_long: a config whose layers are all GDN may set the attention
    widths to anything (no tensor says otherwise); the estimate charged them as round buffers
    and a KV pool, and refused a 0.5 MB model as needing 23 GB."""
    make_tiny_checkpoint(tmp_path, seed=3, layers=2, layer_types=["linear_attention"] * 2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(num_attention_heads=1 << 16, num_key_value_heads=1 << 16, head_dim=1024)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    est = sapwood.estimate(tmp_path, weights="f32", max_context=64)
    assert est.parts["kv_cache"] == 0 and est.total < 0.5e9
    assert sapwood.load(tmp_path, weights="f32", max_context=64).generate(
        [1, 2, 3], max_tokens=2, verify="off").tokens


def test_flat_multimodal_config_is_not_defaults(nine_b):
    text = json.loads((nine_b / "config.json").read_text())["text_config"]
    cfg = ModelConfig.from_dict({**text, "model_type": "qwen3_5", "hidden_size": 1024})
    assert cfg.hidden_size == 1024 and cfg.num_layers == len(text["layer_types"])


# Real vocabulary, narrow layers: the embedding and the head dominate, as in the real models.
@pytest.fixture(scope="module")
def real_vocab(tmp_path_factory):
    d = tmp_path_factory.mktemp("vocab")
    make_tiny_checkpoint(d, seed=1, vocab=248320, hidden=256, intermediate=512, layers=4, hk=2, hv=4,
                         dk=64, dv=64, head_dim=64, dtype="bfloat16")
    return d


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("weights", ["f32", "q8", "q4"])
def test_peak_memory_within_1_3x_of_the_engine(real_vocab, weights):
    r = measure_load(real_vocab, weights)
    grew, held = r["peak"] - r["base"], r["final"] - r["base"]
    assert held >= 0.9 * r["engine"], r  # the engine's weights are resident: the measure is real
    assert grew <= 1.3 * held, r


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_real_0_8b_shape_loads_in_bounded_memory_and_generates(tmp_path):
    """Qwen3.5-0.8B's published layout (vision tower and MTP head in the files, bf16 with f32
    A_log / norms as published): loads in every quantized mode within 1.3x, and generates."""
    from sapwood.checkpoints import write_checkpoint

    write_checkpoint("0.8B", tmp_path, tokenizer=None)
    for weights in ("q8", "q4"):
        r = measure_load(tmp_path, weights)
        assert r["peak"] - r["base"] <= 1.3 * (r["final"] - r["base"]), (weights, r)
    m = sapwood.load(tmp_path, weights="q4", max_context=128, quiet=True)
    plain = m.generate([1, 2, 3, 4], max_tokens=6, verify="off")
    assert plain.tokens == m.generate([1, 2, 3, 4], max_tokens=6, drafter="mtp", verify="chain").tokens


class _Terminal(__import__("io").StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("tty, quiet, shown", [(True, False, True), (True, True, False),
                                               (False, False, False)])
def test_progress_bar_on_a_terminal_unless_quiet(tiny, monkeypatch, tty, quiet, shown):
    from sapwood.loading import _progress

    err = _Terminal() if tty else __import__("io").StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    ck = read_checkpoint(tiny)
    with _progress(ck, quiet) as bar:
        assert bar.disable is not shown and bar.total == ck.weights.nbytes
        bar.delay = 0  # as if the load had taken over a second: the bar draws
        bar.update(ck.weights.nbytes)
        bar.refresh()
    assert ("loading" in err.getvalue()) is shown
