"""A hostile user's run over sapwood (issue 38): bad inputs, call orders and concurrent uses,
counted by class as handled well / unclear error / silent wrong result / crash.

    python scripts/hostile_run.py [--out counts.json]

Each class runs in a child process that reports every input before and after it; a child that
dies mid-input counts that input as a crash and the class goes on in a fresh child. "Handled
well": a ValueError / RuntimeError / MemoryError with a message and the object still computing
what a fresh one does, or a correct result. "Unclear": any other exception type. "Wrong": a
result or a later state that differs from what it must be.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CLEAR = (ValueError, RuntimeError, MemoryError)


def _ctx(tmp):
    import numpy as np

    import sapwood
    from sapwood.loading import engine_dims, read_checkpoint
    from sapwood.testing import make_tiny_checkpoint

    paths = {}
    for name, kw in {"a": dict(seed=3), "b": dict(seed=4), "wide": dict(seed=3, dk=32, dv=32),
                     "deep": dict(seed=3, layers=8)}.items():
        paths[name] = Path(tmp) / name
        make_tiny_checkpoint(paths[name], **kw)
    ck = read_checkpoint(paths["a"])
    return dict(np=np, sapwood=sapwood, paths=paths, dims=engine_dims(ck.config), w=ck.weights)


def _engine(c, name="a", **kw):
    args = dict(weights="f32", kv="int8", max_context=256) | kw
    return c["sapwood"].load(c["paths"][name], **args).engine


PROBE = ([3, 4, 8, 1], [-1, 0, 1, 0])


def _same(e, f):
    return e.position == f.position and bool((e.verify(*PROBE) == f.verify(*PROBE)).all())


def _state(e):
    e.prefill(list(range(1, 30)))
    e.verify([5, 6, 7], [-1, 0, 1])
    e.commit([0, 1, 2])
    e.draft_chain(9, 3, prefix=[4])
    e.keep_draft([9])


def _expect_error(call, after=lambda: True):
    try:
        call()
    except CLEAR as err:
        if not str(err):
            return "unclear"
        return "ok" if after() else "wrong"
    except Exception:
        return "unclear"
    return "wrong"


def cls_snapshot(c):
    for other, kw in [("b", {}), ("wide", {}), ("deep", {}), ("a", dict(kv="f32")),
                      ("a", dict(weights="q8")), ("a", dict(max_context=512))]:
        def run(other=other, kw=kw):
            e, twin = _engine(c), _engine(c)
            for x in (e, twin):
                x.prefill(list(range(1, 40)))
            src = _engine(c, other, **kw)
            src.prefill([i % 200 for i in range(1, 300 if kw.get("max_context") else 20)])
            res = _expect_error(lambda: e.restore(src.snapshot()), lambda: _same(e, twin))
            e.reset()
            return res if _same(e, _engine(c)) else "wrong"
        yield f"restore from {other} {kw}", run
    for n in (0, 1, 63, 64, 65, 200):
        def ok(n=n):
            e, f = _engine(c), _engine(c)
            if n:
                e.prefill(list(range(n)))
            f.restore(e.snapshot())
            return "ok" if _same(e, f) else "wrong"
        yield f"restore a snapshot of {n} positions", ok


def cls_reset(c):
    steps = {"prefill": lambda e: e.prefill([1, 2, 3]), "verify": lambda e: e.verify([1, 2], [-1, 0]),
             "commit": lambda e: (e.verify([1, 2], [-1, 0]), e.commit([0, 1])),
             "draft": lambda e: e.draft_chain(3, 2, prefix=[1]), "keep": lambda e: e.keep_draft([3]),
             "cands": lambda e: e.draft_candidates(3, 2, 2), "state": _state}
    after = {"draft+keep": lambda e: (e.draft_chain(4, 2, prefix=[7, 8]), e.keep_draft([4])),
             "commit": lambda e: (e.verify([1, 2, 3], [-1, 0, 0]), e.commit([0, 2])),
             "prefill": lambda e: e.prefill([9, 9])}
    for s in steps:
        for a in after:
            def run(s=s, a=a):
                e, f = _engine(c), _engine(c)
                _state(e)
                steps[s](e)
                e.reset()
                after[a](e), after[a](f)
                return "ok" if _same(e, f) else "wrong"
            yield f"reset after {s}, then {a}", run


def cls_engine_args(c):
    core = c["sapwood"]._core
    bad = [dict(num_kv_heads=0), dict(num_heads=0), dict(num_heads=3), dict(head_dim=0),
           dict(head_dim=48), dict(head_dim=2048), dict(rotary_dim=-2), dict(rotary_dim=3),
           dict(rotary_dim=64), dict(rope_theta=float("inf")), dict(rope_theta=0.0),
           dict(rms_norm_eps=float("nan")), dict(rms_norm_eps=0.0), dict(vocab_size=0),
           dict(vocab_size=-1), dict(hidden_size=0), dict(intermediate_size=0), dict(hk=0),
           dict(hv=0), dict(hv=3), dict(dk=0), dict(conv_kernel=0), dict(conv_kernel=1000),
           dict(layer_is_attention=[]), dict(vocab_size=1 << 30), dict(head_order="x"),
           dict(vocab_size="256"), dict(tie_word_embeddings="false")]
    for change in bad:
        def run(change=change):
            dims = dict(c["dims"]) | change
            return _expect_error(lambda: core.Engine(dims, c["w"], "f32", "int8", 64, 1))
        yield f"dims {change}", run
    for kw in [dict(max_context=2**31 - 1), dict(max_context=0), dict(max_context=-5),
               dict(max_context=2**24 + 1), dict(threads=-1), dict(threads=10**6),
               dict(weights_format="q3"), dict(kv="fp8")]:
        def run(kw=kw):
            args = dict(weights_format="f32", kv="int8", max_context=64, threads=1) | kw
            return _expect_error(lambda: core.Engine(c["dims"], c["w"], **args))
        yield f"engine args {kw}", run


def cls_engine_calls(c):
    np = c["np"]
    calls = [("verify bad parents", lambda e: e.verify([1, 2], [-1, 1])),
             ("verify two roots", lambda e: e.verify([1, 2], [-1, -1])),
             ("verify 257 nodes", lambda e: e.verify(np.zeros(257, int), np.arange(-1, 256))),
             ("verify token 256", lambda e: e.verify([256], [-1])),
             ("verify token -1", lambda e: e.verify([-1], [-1])),
             ("verify float tokens", lambda e: e.verify([1.0], [-1])),
             ("verify past context", lambda e: e.verify(list(range(250)), list(range(-1, 249)))),
             ("verify length mismatch", lambda e: e.verify([1, 2], [-1])),
             ("verify empty", lambda e: e.verify([], [])),
             ("commit without verify", lambda e: e.commit([0])),
             ("commit bad path", lambda e: (e.verify([1, 2, 3], [-1, 0, 0]), e.commit([0, 2, 1]))),
             ("commit empty", lambda e: (e.verify([1], [-1]), e.commit([]))),
             ("prefill empty", lambda e: e.prefill([])),
             ("prefill past context", lambda e: e.prefill(list(range(250)))),
             ("prefill 2-D", lambda e: e.prefill([[1, 2]])),
             ("prefill huge id", lambda e: e.prefill([2**40])),
             ("draft rows 0", lambda e: e.draft_chain(1, 0)),
             ("draft rows past context", lambda e: e.draft_chain(1, 300)),
             ("draft bad root", lambda e: e.draft_chain(999, 2)),
             ("draft long prefix", lambda e: e.draft_chain(1, 2, prefix=list(range(10)))),
             ("draft nan temperature", lambda e: e.draft_chain(1, 2, temperature=float("nan"))),
             ("candidates k 0", lambda e: e.draft_candidates(1, 2, 0)),
             ("keep_draft bad token", lambda e: e.keep_draft([999])),
             ("restore None", lambda e: e.restore(None)),
             ("fill_synthetic past context", lambda e: e.fill_synthetic(1000))]
    for name, call in calls:
        def run(call=call):
            e, twin = _engine(c), _engine(c)
            for x in (e, twin):
                x.prefill(list(range(1, 20)))
            try:
                call(e)
            except CLEAR as err:
                return "ok" if str(err) and _same(e, twin) else "wrong"
            except TypeError as err:  # pybind11's argument check: a clear message too
                return "ok" if "incompatible function arguments" in str(err) and _same(e, twin) else "unclear"
            except Exception:
                return "unclear"
            return "wrong"
        yield name, run


def cls_threads(c):
    import threading

    core = c["sapwood"]._core
    for run_i in range(20):
        def raw(run_i=run_i):
            e = core.Engine(c["dims"], c["w"], "f32", "int8", 256, 2)
            bad = []

            def hammer(k):
                for j in range(30):
                    try:
                        [lambda: e.reset(), lambda: e.prefill([1, 2, 3, 4] * 5), lambda: e.verify([1, 2], [-1, 0]),
                         lambda: e.commit([0, 1]), lambda: e.restore(e.snapshot()),
                         lambda: e.draft_chain(3, 2)][(j * 7 + k + run_i) % 6]()
                    except core.EngineBusyError:
                        pass
                    except (ValueError, MemoryError):
                        pass
                    except Exception as err:
                        bad.append(err)
            ts = [threading.Thread(target=hammer, args=(k,)) for k in range(3)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            e.reset()
            f = core.Engine(c["dims"], c["w"], "f32", "int8", 256, 1)
            return "unclear" if bad else ("ok" if _same(e, f) else "wrong")
        yield f"raw engine, 3 threads, run {run_i}", raw
    m = c["sapwood"].load(c["paths"]["a"], weights="f32", max_context=256)
    want = m.generate([5, 6, 7, 8], max_tokens=10).tokens
    for run_i in range(20):
        def two(run_i=run_i):
            res = []

            def go():
                try:
                    res.append(m.generate([5, 6, 7, 8], max_tokens=10).tokens == want)
                except RuntimeError:
                    res.append(True)
            ts = [threading.Thread(target=go) for _ in range(2)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            return "ok" if all(res) and len(res) == 2 else "wrong"
        yield f"Model.generate on 2 threads, run {run_i}", two

    def streams():
        s = m.generate([5, 6, 7, 8], max_tokens=10, stream=True)
        got = [next(s)]
        r = _expect_error(lambda: m.generate([1, 2], max_tokens=3, stream=True))
        got += list(s)
        return r if got == want else "wrong"
    yield "interleaved streams", streams

    def nested():
        def cb(*a):
            m.generate([1, 2], max_tokens=2)
        r = _expect_error(lambda: m.generate([5, 6, 7, 8], max_tokens=10, on_round=cb))
        return r if m.generate([5, 6, 7, 8], max_tokens=10).tokens == want else "wrong"
    yield "generate from on_round", nested
    yield "drafter=m", lambda: _expect_error(lambda: m.generate([5, 6], max_tokens=4, drafter=m))


def _load_with(c, tmp, cfg_change=None, tensor=None):
    import shutil

    d = Path(tempfile.mkdtemp(dir=tmp))
    shutil.rmtree(d)
    shutil.copytree(c["paths"]["a"], d)
    if cfg_change:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(cfg_change)
        (d / "config.json").write_text(json.dumps(cfg))
    if tensor:
        from safetensors.numpy import load_file, save_file
        w = load_file(str(d / "model.safetensors"))
        name, value = tensor
        w[name] = w[name].copy()
        w[name].reshape(-1)[0] = value
        save_file(w, str(d / "model.safetensors"))
    return c["sapwood"].load(d, weights="f32", max_context=64)


def cls_config(c, tmp):
    inf, nan = float("inf"), float("nan")
    changes = [("tie_word_embeddings", "false"), ("tie_word_embeddings", 0), ("vocab_size", "256"),
               ("vocab_size", 256.7), ("vocab_size", 256.0), ("vocab_size", True), ("vocab_size", -1),
               ("vocab_size", None), ("hidden_size", [64]), ("hidden_size", "64"), ("rms_norm_eps", inf),
               ("rms_norm_eps", nan), ("rms_norm_eps", -1e-6), ("rms_norm_eps", "1e-6"),
               ("rope_parameters", {"rope_type": "default", "rope_theta": inf}),
               ("rope_parameters", {"rope_type": "default", "rope_theta": nan}),
               ("rope_parameters", {"rope_type": "default", "partial_rotary_factor": nan}),
               ("rope_parameters", {"rope_type": "default", "partial_rotary_factor": 2.0}),
               ("rope_parameters", {"rope_type": "yarn"}), ("rope_parameters", [1, 2]),
               ("num_key_value_heads", 0), ("num_attention_heads", 3), ("head_dim", 48),
               ("head_dim", "32"), ("num_hidden_layers", 3), ("layer_types", "linear_attention"),
               ("layer_types", ["x"] * 4), ("linear_num_value_heads", 3), ("linear_conv_kernel_dim", 0),
               ("eos_token_id", "2"), ("eos_token_id", [1.5]), ("model_type", ["qwen3_5_text"]),
               ("model_type", "llama"), ("text_config", [1]), ("attention_bias", "no"),
               ("hidden_act", "gelu"), ("num_experts", 8), ("intermediate_size", 2**40)]
    for key, value in changes:
        yield f"config {key}={value!r}", lambda key=key, value=value: _expect_error(
            lambda: _load_with(c, tmp, {key: value}))


def cls_weights(c, tmp):
    names = ["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight",
             "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
             "model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias",
             "model.layers.0.linear_attn.norm.weight", "model.layers.0.linear_attn.conv1d.weight",
             "model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.3.self_attn.q_norm.weight", "model.layers.3.self_attn.k_norm.weight",
             "model.layers.3.self_attn.o_proj.weight"]
    for name in names:
        for v in (float("nan"), float("inf"), float("-inf")):
            yield f"{name}[0]={v}", lambda name=name, v=v: _expect_error(
                lambda: _load_with(c, tmp, tensor=(name, v)))
    yield "lm_head 3e38", lambda: _expect_error(lambda: _load_with(c, tmp, tensor=("lm_head.weight", 3e38)))
    yield "A_log 1e3", lambda: _expect_error(
        lambda: _load_with(c, tmp, tensor=("model.layers.0.linear_attn.A_log", 1e3)))


def cls_prompt_and_logits(c):
    np = c["np"]
    from sapwood.generate import DecodeConfig, Decoder
    from sapwood.sampling import SamplingParams

    m = c["sapwood"].load(c["paths"]["a"], weights="f32", max_context=128)
    for p in [b"hi", bytearray(b"x"), [1.0, 2.0], [1, 2.5], np.array([1.0]), [True], ["1"], 5,
              [], "", [256], [-1], np.zeros((2, 2), int), {"a": 1}]:
        yield f"prompt {p!r}", lambda p=p: _expect_error(lambda: m.generate(p, max_tokens=2),
                                                       lambda: bool(m.generate([1, 2], max_tokens=2).tokens))
    for row in (np.full(8, -np.inf, np.float32), np.array([0, np.inf], np.float32),
                np.array([0, np.nan], np.float32)):
        for t in (0.0, 0.8):
            d = Decoder(None, None, DecodeConfig(params=SamplingParams(temperature=t)))
            yield f"pick T={t} row {row}", lambda d=d, row=row: _expect_error(lambda: d._pick(row, 0, []))


def cls_stream_stop(c):
    m = c["sapwood"].load(c["paths"]["a"], weights="f32", max_context=128)
    full = m.generate([5, 9, 2], max_tokens=40).tokens
    text = m.decode(full)
    for start in range(1, min(len(text) - 4, 61), 2):
        stop = text[start:start + 3]
        if text.find(stop) != start:
            continue

        def run(stop=stop, start=start):
            r = m.generate([5, 9, 2], max_tokens=40, stop=stop)
            s = list(m.generate([5, 9, 2], max_tokens=40, stop=stop, stream=True))
            return "ok" if s == r.tokens and r.text == text[:start] else "wrong"
        yield f"stop {stop!r}", run


def cls_cli(c, tmp):
    d = c["paths"]["a"]
    cases = [(["generate", "x", "--model", str(d), "--max-tokens", "0"], None, 1),
             (["generate", "x", "--model", str(Path(tmp) / "nope")], None, 1),
             (["generate", "-", "--model", str(d), "--max-tokens", "2"], b"\xff\xfe", 1),
             (["generate", "x", "--model", str(d), "--max-context", "0"], None, 1),
             (["generate", "x", "--model", str(d), "--temperature", "nan"], None, 1),
             (["generate"], None, 2), (["generate", "x", "--threads", "many"], None, 2)]
    for args, stdin, code in cases:
        def run(args=args, stdin=stdin, code=code):
            r = subprocess.run([sys.executable, "-m", "sapwood", *args], input=stdin, capture_output=True)
            lines = [x for x in r.stderr.decode().splitlines() if x.strip()]
            one = b"Traceback" not in r.stderr and (code == 2 or len(lines) == 1)
            return "ok" if r.returncode == code and one else "unclear"
        yield f"cli {' '.join(args[:2])} {args[2:]}", run

    def closed():
        p = subprocess.Popen([sys.executable, "-m", "sapwood", "generate", "hi", "--model", str(d),
                              "--max-tokens", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.close()
        err = p.stderr.read()
        return "ok" if p.wait() == 1 and b"Traceback" not in err else "unclear"
    yield "cli closed stdout", closed


def cls_fuzz(c, tmp):
    import random

    from sapwood.safetensors_io import read_safetensors
    raw = (c["paths"]["a"] / "model.safetensors").read_bytes()
    rng = random.Random(0)
    for i in range(300):
        def st(i=i):
            data = bytearray(raw)
            for _ in range(rng.randint(1, 4)):
                j = rng.randrange(0, min(len(data), 2000))
                data[j] = rng.randrange(256)
            if rng.random() < 0.3:
                data = data[:rng.randrange(len(data))]
            p = Path(tmp) / "f.safetensors"
            p.write_bytes(bytes(data))
            try:
                read_safetensors(p)
                return "ok"
            except ValueError:
                return "ok"
            except Exception:
                return "unclear"
        yield f"safetensors mutation {i}", st
    tok = (c["paths"]["a"] / "tokenizer.json").read_text()
    for i in range(100):
        def tk(i=i):
            import shutil
            d = Path(tempfile.mkdtemp(dir=tmp))
            shutil.rmtree(d)
            shutil.copytree(c["paths"]["a"], d)
            t = list(tok)
            for _ in range(rng.randint(1, 3)):
                t[rng.randrange(len(t))] = rng.choice('{}[]",:0a\\')
            (d / "tokenizer.json").write_text("".join(t))
            try:
                c["sapwood"].load(d, weights="f32", max_context=32).encode("hello")
                return "ok"
            except ValueError:
                return "ok"
            except Exception:
                return "unclear"
        yield f"tokenizer mutation {i}", tk


CLASSES = {"snapshot": cls_snapshot, "reset": cls_reset, "engine_args": cls_engine_args,
           "engine_calls": cls_engine_calls, "threads": cls_threads, "config": cls_config,
           "weights": cls_weights, "prompt_logits": cls_prompt_and_logits,
           "stream_stop": cls_stream_stop, "cli": cls_cli, "fuzz": cls_fuzz}


def child(name, skip):
    with tempfile.TemporaryDirectory() as tmp:
        c = _ctx(tmp)
        fn = CLASSES[name]
        gen = fn(c, tmp) if fn.__code__.co_argcount == 2 else fn(c)
        for i, (label, run) in enumerate(gen):
            if i < skip:
                continue
            print(json.dumps({"i": i, "start": label}), flush=True)
            try:
                outcome = run()
            except Exception as err:
                outcome = "unclear"
                label += f" ({type(err).__name__}: {err})"
            print(json.dumps({"i": i, "label": label, "outcome": outcome}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--classes", nargs="*", default=list(CLASSES))
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.skip)
    counts, notes = {}, []
    for name in a.classes:
        k = counts.setdefault(name, {"tried": 0, "ok": 0, "unclear": 0, "wrong": 0, "crash": 0})
        skip = 0
        while True:
            p = subprocess.run([sys.executable, __file__, "--child", name, "--skip", str(skip)],
                               capture_output=True, text=True)
            started, last = None, skip - 1
            for line in p.stdout.splitlines():
                r = json.loads(line)
                if "start" in r:
                    started = r
                else:
                    started, last = None, r["i"]
                    k["tried"] += 1
                    k[r["outcome"]] += 1
                    if r["outcome"] != "ok":
                        notes.append(f"{name}: {r['label']}: {r['outcome']}")
            if p.returncode == 0:
                break
            if started is None:  # died outside an input: report and stop this class
                notes.append(f"{name}: child exited {p.returncode}: {p.stderr[-500:]}")
                break
            k["tried"] += 1
            k["crash"] += 1
            notes.append(f"{name}: {started['start']}: crash (exit {p.returncode})")
            skip = started["i"] + 1
        print(name, k, flush=True)
    total = {key: sum(v[key] for v in counts.values()) for key in ("tried", "ok", "unclear", "wrong", "crash")}
    print("total", total)
    for n in notes:
        print(" ", n)
    if a.out:
        Path(a.out).write_text(json.dumps({"classes": counts, "total": total, "notes": notes}, indent=1))


if __name__ == "__main__":
    main()
