"""Fuzzing what a checkpoint directory holds (issue 38): a safetensors header, config.json and
tokenizer.json, mutated by hypothesis. Loading either works or raises ValueError: any other
exception fails the test, and a crash would end the run. Bounded example counts keep the
default run to seconds; the slow variants run more."""
import json
import math
import shutil
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sapwood
from sapwood.safetensors_io import read_safetensors
from sapwood.testing import make_tiny_checkpoint

FAST = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
LONG = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=8)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    p = tmp_path_factory.mktemp("base")
    make_tiny_checkpoint(p, seed=2, layers=2)
    return p


def copy_of(base, tmp_path_factory):
    d = tmp_path_factory.mktemp("f")
    for f in base.iterdir():
        shutil.copy(f, d / f.name)
    return d


def loads_or_value_error(d):
    try:
        sapwood.load(d, weights="f32", max_context=64)
    except ValueError:
        return False
    return True


# ---- safetensors -------------------------------------------------------------------------

def header_of(base):
    raw = (base / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return raw, n, json.loads(raw[8:8 + n])


def check_safetensors(path):
    try:
        read_safetensors(path)
    except ValueError:
        pass


@st.composite
def header_edits(draw):
    """(tensor index or None for the top level, key, new value)."""
    return (draw(st.none() | st.integers(0, 40)),
            draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra", "__metadata__"])),
            draw(json_values | st.sampled_from(["F32", "BF16", "F8_E4M3", [0, 1 << 62], [-1], [3, 2]])))


def _fuzz_header(base, tmp_path_factory, edits, cut, flip):
    raw, n, header = header_of(base)
    names = sorted(k for k in header if k != "__metadata__")
    for idx, key, value in edits:
        if idx is None:
            header[key] = value
        else:
            entry = header[names[idx % len(names)]]
            if isinstance(entry, dict):
                entry[key] = value
    body = json.dumps(header, allow_nan=True).encode()
    data = struct.pack("<Q", len(body)) + body + raw[8 + n:]
    if flip is not None:  # one byte anywhere, the length field included
        i, b = flip
        data = data[:i % len(data)] + bytes([b]) + data[i % len(data) + 1:]
    if cut is not None:
        data = data[:cut % (len(data) + 1)]
    p = tmp_path_factory.mktemp("st") / "model.safetensors"
    p.write_bytes(data)
    check_safetensors(p)


edits_st = st.lists(header_edits(), max_size=3)
cut_st = st.none() | st.integers(0, 1 << 20)
flip_st = st.none() | st.tuples(st.integers(0, 1 << 20), st.integers(0, 255))


@FAST
@given(edits=edits_st, cut=cut_st, flip=flip_st)
def test_fuzz_safetensors_header(base, tmp_path_factory, edits, cut, flip):
    _fuzz_header(base, tmp_path_factory, edits, cut, flip)


@pytest.mark.slow
@LONG
@given(edits=edits_st, cut=cut_st, flip=flip_st)
def test_fuzz_safetensors_header_long(base, tmp_path_factory, edits, cut, flip):
    _fuzz_header(base, tmp_path_factory, edits, cut, flip)


# ---- config.json -------------------------------------------------------------------------

CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "layer_types",
               "full_attention_interval", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "rope_parameters", "rope_theta", "partial_rotary_factor",
               "tie_word_embeddings", "linear_num_key_heads", "linear_num_value_heads",
               "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
               "eos_token_id", "model_type", "text_config", "hidden_act", "attention_bias",
               "sapwood_gdn_head_order", "num_experts"]
config_edits = st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), json_values | st.integers(-3, 300)),
                        min_size=1, max_size=3)


def _fuzz_config(base, tmp_path_factory, edits, drop):
    d = copy_of(base, tmp_path_factory)
    cfg = json.loads((d / "config.json").read_text())
    for key, value in edits:
        cfg[key] = value
    if drop:
        cfg.pop(drop, None)
    (d / "config.json").write_text(json.dumps(cfg, allow_nan=True))
    if loads_or_value_error(d):
        # whatever loaded must be a model that runs: finite logits, in-range tokens
        m = sapwood.load(d, weights="f32", max_context=64)
        logits = m.engine.prefill([1, 2, 3])
        assert all(math.isfinite(x) for x in logits[:8])


drop_st = st.none() | st.sampled_from(CONFIG_KEYS)


@FAST
@given(edits=config_edits, drop=drop_st)
def test_fuzz_config(base, tmp_path_factory, edits, drop):
    _fuzz_config(base, tmp_path_factory, edits, drop)


@pytest.mark.slow
@LONG
@given(edits=config_edits, drop=drop_st)
def test_fuzz_config_long(base, tmp_path_factory, edits, drop):
    _fuzz_config(base, tmp_path_factory, edits, drop)


# ---- tokenizer.json ----------------------------------------------------------------------

TOKENIZER_PATHS = [("model", "type"), ("model", "vocab"), ("model", "merges"), ("added_tokens",),
                   ("decoder",), ("pre_tokenizer",), ("normalizer",), ("post_processor",),
                   ("model", "unk_token"), ("version",)]


def _fuzz_tokenizer(base, tmp_path_factory, edits, cut):
    d = copy_of(base, tmp_path_factory)
    text = (d / "tokenizer.json").read_text()
    tok = json.loads(text)
    for path, value in edits:
        node = tok
        for k in path[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[path[-1]] = value
    text = json.dumps(tok)
    if cut is not None:
        text = text[:cut % (len(text) + 1)]
    (d / "tokenizer.json").write_text(text)
    if loads_or_value_error(d):
        m = sapwood.load(d, weights="f32", max_context=64)
        ids = m.encode("hello world")
        assert all(0 <= i < m.config.vocab_size for i in ids)


tok_edits = st.lists(st.tuples(st.sampled_from(TOKENIZER_PATHS), json_values), max_size=2)


@FAST
@given(edits=tok_edits, cut=st.none() | st.integers(0, 1 << 16))
def test_fuzz_tokenizer(base, tmp_path_factory, edits, cut):
    _fuzz_tokenizer(base, tmp_path_factory, edits, cut)


@pytest.mark.slow
@LONG
@given(edits=tok_edits, cut=st.none() | st.integers(0, 1 << 16))
def test_fuzz_tokenizer_long(base, tmp_path_factory, edits, cut):
    _fuzz_tokenizer(base, tmp_path_factory, edits, cut)
