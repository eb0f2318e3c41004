"""A random checkpoint of realistic small shape, built in memory, and the engine timings of
issues 3 and 4: decode step and prefill at several contexts as a fraction of the memory floor,
verify(N) over verify(1), chain and tree rounds over a plain step.

    python bench/realistic.py [--weights q8 q4] [--contexts 64 4096 16384] [--json out.json]

Shape (issue 3): hidden 1024, 24 layers in the 3:1 pattern, 8 query heads and 2 KV heads of dim
256, Hk = Hv = 16 with dk = dv = 128, intermediate 3584, vocab 151936, tied embeddings. Long
contexts are filled with synthetic K/V (Engine.fill_synthetic): the timing of a step does not
depend on what the cache holds, and prefilling 16K tokens would take minutes here.
Timings alternate arms in ABBA order; medians and ranges are reported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from sapwood import _core

SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3584,
             layer_is_attention=[(i + 1) % 4 == 0 for i in range(24)], num_heads=8, num_kv_heads=2,
             head_dim=256, rotary_dim=64, rope_theta=1e7, rms_norm_eps=1e-6,
             tie_word_embeddings=True, hk=16, dk=128, hv=16, dv=128, conv_kernel=4,
             head_order="grouped")


def random_weights(d=SHAPE, seed=0):
    rng = np.random.default_rng(seed)
    H, I, D = d["hidden_size"], d["intermediate_size"], d["head_dim"]
    C = 2 * d["hk"] * d["dk"] + d["hv"] * d["dv"]
    V = d["hv"] * d["dv"]

    def m(*shape, s=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * s)

    w = {"model.embed_tokens.weight": m(d["vocab_size"], H), "model.norm.weight": m(H, s=0.1)}
    for i, attn in enumerate(d["layer_is_attention"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = m(H, s=0.1)
        w[p + "post_attention_layernorm.weight"] = m(H, s=0.1)
        w[p + "mlp.gate_proj.weight"] = m(I, H)
        w[p + "mlp.up_proj.weight"] = m(I, H)
        w[p + "mlp.down_proj.weight"] = m(H, I)
        if attn:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = m(2 * d["num_heads"] * D, H)
            w[a + "k_proj.weight"] = m(d["num_kv_heads"] * D, H)
            w[a + "v_proj.weight"] = m(d["num_kv_heads"] * D, H)
            w[a + "o_proj.weight"] = m(H, d["num_heads"] * D)
            w[a + "q_norm.weight"] = m(D, s=0.1)
            w[a + "k_norm.weight"] = m(D, s=0.1)
        else:
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = m(C, H)
            w[a + "in_proj_z.weight"] = m(V, H)
            w[a + "in_proj_b.weight"] = m(d["hv"], H)
            w[a + "in_proj_a.weight"] = m(d["hv"], H)
            w[a + "conv1d.weight"] = m(C, 1, d["conv_kernel"], s=0.3)
            w[a + "dt_bias"] = m(d["hv"], s=0.5)
            w[a + "A_log"] = m(d["hv"], s=0.5)
            w[a + "norm.weight"] = 1 + m(d["dv"], s=0.1)
            w[a + "out_proj.weight"] = m(H, V)
    return w


def step_bytes(engine, ctx, d=SHAPE):
    """Bytes a decode step must read: all weights, the KV history, the GDN states."""
    n_attn = sum(d["layer_is_attention"])
    kv = ctx * n_attn * d["num_kv_heads"] * 2 * d["head_dim"] * (1 + 4 / 32)
    return engine.memory()["weights_bytes"] + kv + engine.memory()["gdn_state_bytes"]


def timeit(fn, reps):
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def summary(xs):
    return {"median_ms": 1e3 * statistics.median(xs), "min_ms": 1e3 * min(xs), "max_ms": 1e3 * max(xs)}


def bench_format(fmt, contexts, reps, weights):
    eng = _core.Engine(SHAPE, weights, fmt, "int8", max(contexts) + 64, 0)
    rng = np.random.default_rng(1)
    res = {"weights": fmt, "weights_bytes": eng.memory()["weights_bytes"], "contexts": {}}
    prompt = rng.integers(0, 151936, 64)
    t0 = time.perf_counter()
    eng.prefill(prompt)
    res["prefill_64_tok_per_s"] = 64 / (time.perf_counter() - t0)
    for ctx in contexts:
        eng.reset()
        eng.prefill(prompt[:min(64, ctx)])
        eng.fill_synthetic(ctx - eng.position, 7)
        snap = eng.snapshot()
        tree16 = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, 16)])
        toks = rng.integers(0, 151936, 16)
        arms = {
            "plain": lambda: (eng.verify(toks[:1], [-1]), eng.commit([0]), eng.restore(snap)),
            "verify1": lambda: eng.verify(toks[:1], [-1]),
            "chain9": lambda: eng.verify(toks[:9], np.arange(9) - 1),
            "verify16": lambda: eng.verify(toks, tree16),
        }
        times = {k: [] for k in arms}
        for f in arms.values():  # warm-up, excluded
            f()
        names = list(arms) + ["bandwidth"]
        bws = []
        for block in range(reps):
            order = names if block % 2 == 0 else names[::-1]  # ABBA over blocks
            for k in order:
                if k == "bandwidth":  # measured in every block: the host's bandwidth drifts
                    bws.append(_core.read_bandwidth(1 << 29, 0, 1))
                else:
                    times[k] += timeit(arms[k], 1)
        floors = [step_bytes(eng, ctx) / bw for bw in bws]
        r = {k: summary(v) for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in times.items()}
        r["read_GBps"] = {"median": statistics.median(bws) / 1e9, "min": min(bws) / 1e9,
                          "max": max(bws) / 1e9}
        r["floor_ms"] = 1e3 * statistics.median(floors)
        r["verify1_over_floor"] = med["verify1"] / statistics.median(floors)
        # paired per block: the floor at that block's bandwidth over that block's step
        frac = [f / t for f, t in zip(floors, times["verify1"])]
        r["floor_fraction"] = statistics.median(frac)
        r["floor_fraction_range"] = [min(frac), max(frac)]
        r["verify16_over_verify1"] = med["verify16"] / med["verify1"]
        r["chain9_over_verify1"] = med["chain9"] / med["verify1"]
        res["contexts"][ctx] = r
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", nargs="+", default=["q8", "q4"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[64, 4096, 16384])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    weights = random_weights()
    out = {"threads": _core.get_num_threads(), "isa": _core.isa(), "results": []}
    print(f"{out['threads']} threads, isa {out['isa']}; floor = bytes a step reads / streaming read "
          "bandwidth measured in the same ABBA block (paired; median [range] over blocks)")
    for fmt in a.weights:
        r = bench_format(fmt, a.contexts, a.reps, weights)
        out["results"].append(r)
        print(f"\n{fmt}: weights {r['weights_bytes'] / 1e6:.0f} MB, prefill {r['prefill_64_tok_per_s']:.1f} tok/s (64-token prompt)")
        print(f"{'ctx':>6} {'GB/s':>5} {'step ms':>8} {'floor ms':>9} {'floor% [range]':>15} "
              f"{'v16/v1':>7} {'chain9/v1':>9} {'plain ms':>9}")
        for ctx, c in r["contexts"].items():
            lo, hi = c["floor_fraction_range"]
            print(f"{ctx:>6} {c['read_GBps']['median']:>5.1f} {c['verify1']['median_ms']:>8.1f} "
                  f"{c['floor_ms']:>9.1f} {100 * c['floor_fraction']:>5.0f}% [{100 * lo:.0f}, {100 * hi:.0f}] "
                  f"{c['verify16_over_verify1']:>7.2f} {c['chain9_over_verify1']:>9.2f} "
                  f"{c['plain']['median_ms']:>9.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
