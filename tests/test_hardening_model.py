"""Issue 38 at the Model level: requests that would interleave on one engine raise instead of
corrupting each other, configs and prompts are not coerced, non-finite logits fail alike greedy
or sampled, and a stream never yields a token that the result withdraws."""
import json
import math
import threading

import numpy as np
import pytest

import sapwood
from sapwood.sampling import sample
from sapwood.testing import make_tiny_checkpoint
from sapwood.textstream import IncrementalText


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    p = tmp_path_factory.mktemp("m")
    make_tiny_checkpoint(p, seed=5)
    return p


@pytest.fixture(scope="module")
def model(ckpt):
    return sapwood.load(ckpt, weights="f32", max_context=512)


PROMPT = [5, 17, 99, 3, 42, 7, 7, 120]


def test_interleaved_streams_raise_and_the_first_is_unharmed(model):
    want = model.generate(PROMPT, max_tokens=12, verify="off").tokens
    s1 = model.generate(PROMPT, max_tokens=12, verify="off", stream=True)
    got = next(s1).tokens + next(s1).tokens
    with pytest.raises(RuntimeError, match="in use by another request on this thread"):
        model.generate([1, 2, 3], max_tokens=5, stream=True)
    got += [t for chunk in s1 for t in chunk.tokens]
    assert got == want
    assert model.generate(PROMPT, max_tokens=12, verify="off").tokens == want  # released


def test_closed_or_dropped_stream_releases_the_model(model):
    want = model.generate(PROMPT, max_tokens=6).tokens
    s = model.generate(PROMPT, max_tokens=6, stream=True)
    s.close()  # never started
    s = model.generate(PROMPT, max_tokens=6, stream=True)
    next(s)
    del s  # dropped mid-way
    assert model.generate(PROMPT, max_tokens=6).tokens == want


def test_generate_from_on_round_raises(model):
    want = model.generate(PROMPT, max_tokens=8).tokens
    seen = []

    def nested(tree, path, seconds):
        try:
            model.generate([1, 2], max_tokens=3)
        except RuntimeError as e:
            seen.append(str(e))
            raise

    with pytest.raises(RuntimeError, match="in use by another request"):
        model.generate(PROMPT, max_tokens=8, on_round=nested)
    assert seen and "on_round" in seen[0]
    assert model.generate(PROMPT, max_tokens=8).tokens == want


def test_model_as_its_own_drafter_is_refused(model):
    with pytest.raises(ValueError, match="cannot be its own drafter"):
        model.generate(PROMPT, max_tokens=4, drafter=model)
    assert model.generate(PROMPT, max_tokens=4).tokens  # still usable


def test_two_threads_one_model_raise_or_finish_exactly(model):
    """Across many runs: each request either finishes with the solo result or raises the busy
    error; never a crash, never other tokens."""
    want = {p: model.generate([p] + PROMPT, max_tokens=10, verify="chain", drafter="lookup").tokens
            for p in (1, 2)}
    outcomes = []

    def one(p):
        try:
            r = model.generate([p] + PROMPT, max_tokens=10, verify="chain", drafter="lookup")
            outcomes.append(("ok", p, r.tokens))
        except RuntimeError as e:
            assert "in use by another request on another thread" in str(e)
            outcomes.append(("busy", p, None))

    for _ in range(25):
        ts = [threading.Thread(target=one, args=(p,)) for p in (1, 2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert len(outcomes) == 50
    assert all(tokens == want[p] for kind, p, tokens in outcomes if kind == "ok")
    assert any(kind == "ok" for kind, _, _ in outcomes)


@pytest.mark.parametrize("row, match", [
    (np.full(8, -np.inf, np.float32), "all -inf"),
    (np.array([0, np.inf, 1, 2], np.float32), r"\+inf"),
    (np.array([0, np.nan, 1, 2], np.float32), "NaN"),
])
def test_greedy_treats_a_non_finite_row_as_sampling_does(row, match):
    """Greedy, sampled and penalised picks, alone and in the engine's walk, refuse the row
    (greedy once took token 0 forever for the all -inf row)."""
    from sapwood import _core
    for kw in (dict(), dict(temperature=0.7), dict(presence_penalty=1.0, history=[1])):
        with pytest.raises(ValueError, match=match):
            sample(row, 0, **kw)
        with pytest.raises(ValueError, match=match):  # the engine's walk (Engine.verify_walk)
            _core.walk(row[None, :], [1], [-1], 0, **kw)


@pytest.mark.parametrize("prompt, match", [
    (b"hello", "prompt is bytes"),
    (bytearray(b"\x01\x02"), "prompt is bytearray"),
    ([1.0, 2.0], r"prompt token id 1.0 at index 0 is not an integer"),
    ([1, 2.7], r"prompt token id 2.7 at index 1 is not an integer"),
    (np.array([1.0, 2.0]), "dtype float64"),
    ([True, 3], "prompt token id True at index 0"),
    ([1, "2"], r"prompt token id '2' at index 1"),
    (5, "got int"),
])
def test_prompts_are_not_coerced(model, prompt, match):
    with pytest.raises(ValueError, match=match):
        model.generate(prompt, max_tokens=2)


def test_numpy_int_prompts_accepted(model):
    want = model.generate(PROMPT, max_tokens=4).tokens
    assert model.generate(np.array(PROMPT, np.int32), max_tokens=4).tokens == want


def _text_tokens(model, n=40):
    return model.generate(PROMPT, max_tokens=n, verify="off").tokens


def test_stream_never_yields_what_the_stop_string_drops(model):
    """For stop strings cut from every position of the output's text: the streamed tokens are
    the result's tokens (before: the stream had already yielded the stop string's first
    tokens), and the result's text ends where the stop string starts."""
    full = _text_tokens(model)
    text = model.decode(full)
    checked = 0
    for start in range(1, len(text) - 3, 3):
        for n in (1, 3, 6):
            stop = text[start:start + n]
            if not stop or text.find(stop) != start:
                continue
            r = model.generate(PROMPT, max_tokens=40, verify="off", stop=stop)
            s = model.generate(PROMPT, max_tokens=40, verify="off", stop=stop, stream=True)
            chunks = list(s)
            streamed = [t for c in chunks for t in c.tokens]
            assert streamed == r.tokens, (stop, streamed, r.tokens)
            assert "".join(c.text for c in chunks) == r.text == s.result.text
            assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
            assert r.text == text[:start] and r.finish_reason == "stop"
            assert text[:start].startswith(model.decode(r.tokens))
            checked += 1
    assert checked >= 10


def test_stop_strings_need_a_tokenizer(ckpt):
    m = sapwood.load(ckpt, weights="f32", max_context=128)
    m.tokenizer = None
    with pytest.raises(ValueError, match="stop strings need"):
        m.generate(PROMPT, max_tokens=3, stop="x")


def test_incremental_text_matches_a_whole_decode(model):
    """The text grown token by token is the whole decode's, for random ids (partial UTF-8
    sequences included), and safe_tokens never exceeds what a later stop keeps."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        ids = rng.integers(0, 256, 30).tolist()
        inc = IncrementalText(model.tokenizer)
        for t in ids:
            inc.push(t)
        whole = model.decode(ids)
        rest = whole[len(inc.text):]  # held: tokens since the text last ended on a whole character
        assert whole.startswith(inc.text) and (rest == "" or rest.endswith("\ufffd"))
        stops = [whole[5:9]] if len(whole) > 9 else []
        inc = IncrementalText(model.tokenizer, stops)
        safe_seen = []
        for t in ids:
            inc.push(t)
            safe_seen.append(inc.safe_tokens())
        if stops and inc.stop_at >= 0:
            assert max(safe_seen) <= inc.tokens_before(inc.stop_at)


def _write_config(src, dst, **change):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(change)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("change, match", [
    (dict(tie_word_embeddings="false"), r"tie_word_embeddings='false': must be true or false"),
    (dict(vocab_size="256"), r"vocab_size='256': must be an integer"),
    (dict(vocab_size=256.7), r"vocab_size=256.7: must be an integer"),
    (dict(hidden_size=[64]), r"hidden_size=\[64\]: must be an integer"),
    (dict(rms_norm_eps=math.inf), r"rms_norm_eps=inf: must be a finite number"),
    (dict(rms_norm_eps="1e-6"), r"rms_norm_eps='1e-6': must be a finite number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": math.nan}), r"rope_theta=nan"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 1.5}),
     r"partial_rotary_factor=1.5: must be a finite number > 0.0 and <= 1.0"),
    (dict(num_key_value_heads=0), r"num_key_value_heads=0: must be an integer in \[1, "),
    # a claim of 10^7 layers is refused before anything is sized from it (issue 50, case 8)
    (dict(num_hidden_layers=10 ** 7, layer_types=None), r"num_hidden_layers=10000000: must be an "
                                                        r"integer in \[1, 4096\]"),
    (dict(hidden_size=1 << 40), r"hidden_size=1099511627776: must be an integer in \[1, 16777216\]"),
    (dict(eos_token_id="2"), r"eos_token_id='2'"),
    (dict(layer_types="linear_attention"), r"layer_types='linear_attention': must be a list"),
    (dict(attention_bias="no"), r"attention_bias='no': must be true or false"),
])
def test_config_values_are_typed(ckpt, tmp_path, change, match):
    d = _write_config(ckpt, tmp_path / "c", **change)
    with pytest.raises(ValueError, match=match):
        sapwood.load(d)


def test_infinite_eps_in_json_refused(ckpt, tmp_path):
    d = _write_config(ckpt, tmp_path / "c")
    (d / "config.json").write_text((d / "config.json").read_text().replace(
        '"rms_norm_eps": 1e-06', '"rms_norm_eps": Infinity'))
    with pytest.raises(ValueError, match="rms_norm_eps=inf"):
        sapwood.load(d)


def _with_tensor(ckpt, tmp_path, name, edit):
    import shutil

    from safetensors.numpy import load_file, save_file

    d = tmp_path / "w"
    shutil.copytree(ckpt, d)
    w = load_file(str(d / "model.safetensors"))
    w[name] = edit(w[name].copy())
    save_file(w, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("name, value, match", [
    ("lm_head.weight", 3e38, r"'lm_head.weight' .* could give logits up to"),
    ("model.layers.0.linear_attn.A_log", 1e3, r"'model.layers.0.linear_attn.A_log' has A_log=1000"),
    ("model.norm.weight", np.nan, r"model.norm.weight has a non-finite value nan"),
    ("model.layers.1.input_layernorm.weight", np.inf, r"model.layers.1.input_layernorm.weight "
                                                       r"has a non-finite value inf"),
    ("model.layers.0.linear_attn.dt_bias", -np.inf, r"linear_attn.dt_bias has a non-finite"),
])
def test_bad_weights_refused_at_load_naming_the_tensor(ckpt, tmp_path, name, value, match):
    def edit(x):
        x.reshape(-1)[1] = value
        return x

    with pytest.raises(ValueError, match=match):
        sapwood.load(_with_tensor(ckpt, tmp_path, name, edit), weights="f32")
