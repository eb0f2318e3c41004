"""What a decoding round costs outside the engine, at a checkpoint's real vocabulary.

Two measures, side by side in one run (issue 53):
- plain decoding, greedy against sampled (temperature 0.8, top_p 0.95): decode ms per token,
  alternated repetitions, medians and ranges, and their ratio;
- a sampled tree run (verify="tree", width 16, the checkpoint's MTP head, else prompt lookup,
  or --drafter):
  engine calls per round and the share of the decode time spent outside them.

    python bench/round_cost.py /tmp/qwen35-0.8b --tokens 48 --reps 3 --out results.json
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

import sapwood
from sapwood.benchmarks.common import dump_json
from sapwood.generate import DecodeConfig, Decoder
from sapwood.sampling import SamplingParams

SAMPLED = dict(temperature=0.8, top_p=0.95, seed=1)


class Counted:
    """An engine-like object whose method calls are counted and timed into `log`."""

    def __init__(self, inner, log):
        self._inner, self._log = inner, log

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr) or name.startswith("_"):  # pybind11's conduit: not a call
            return attr

        def call(*a, **k):
            t = time.perf_counter()
            try:
                return attr(*a, **k)
            finally:
                self._log.append((name, time.perf_counter() - t))
        return call


def plain_ms(model, prompt, tokens, reps):
    out = {"greedy": [], "sampled": []}
    for _ in range(reps):
        for kind, kw in (("greedy", {}), ("sampled", SAMPLED)):
            r = model.generate(prompt, max_tokens=tokens, verify="off", **kw)
            out[kind].append(1e3 / r.stats.decode_tokens_per_s)
    return out


def tree_run(model, prompt, tokens, width, drafter=None):
    drafter = model.resolve_drafter(drafter or ("mtp" if model.mtp is not None else "lookup"))
    log = []
    if hasattr(drafter, "head"):
        drafter.head = Counted(drafter.head, log)
    if hasattr(drafter, "engine"):
        drafter.engine = Counted(drafter.engine, log)
    cfg = DecodeConfig(max_tokens=tokens, params=SamplingParams(**SAMPLED), verify="tree",
                       width=width)
    model.engine.reset()
    dec = Decoder(Counted(model.engine, log), drafter, cfg)
    t0 = time.perf_counter()
    ids = list(dec.run(prompt))
    total = time.perf_counter() - t0
    st = dec.stats
    decode_calls = log[1:]  # the prompt's prefill first
    inside = sum(s for _, s in decode_calls)
    names = sorted({n for n, _ in decode_calls})
    return {"drafter": type(drafter).__name__, "tokens": len(ids), "rounds": st.cycles,
            "engine_calls_per_round": len(decode_calls) / max(st.cycles, 1),
            "calls": {n: sum(1 for m, _ in decode_calls if m == n) for n in names},
            "decode_s": st.decode_s, "outside_engine_share": 1 - inside / st.decode_s,
            "total_s": total, "tokens_per_cycle": st.tokens_per_cycle}


def python_per_kind(model, prompt, tokens, drafter=None, reps=2):
    """Per kind of round (off, plain, chain, wide, tree): the seconds of each round spent
    outside engine calls (the decoder's and the policy's Python), from runs of verify off,
    chain, tree (width 16) and auto, `reps` times each. What bench/replay_suite.py charges
    each kind of round (--python-ms)."""
    out = {}
    for _ in range(reps):
        for verify in ("off", "chain", "tree", "auto"):
            d = None if verify == "off" else model.resolve_drafter(drafter or "lookup")
            log = []
            if hasattr(d, "head"):
                d.head = Counted(d.head, log)
            if hasattr(d, "engine"):
                d.engine = Counted(d.engine, log)
                d.reset()
            cfg = DecodeConfig(max_tokens=tokens, verify=verify, width=16)
            model.engine.reset()
            seen = [0]
            rounds = []

            def on_round(tree, path, seconds):
                calls, seen[0] = log[seen[0]:], len(log)
                rounds.append(seconds - sum(s for _, s in calls))
            dec = Decoder(Counted(model.engine, log), d, cfg, on_round=on_round,
                          policy=model.speculation_policy(d) if d is not None else None)
            modes, mode_of = [], dec._mode
            dec._mode = lambda: modes.append(mode_of()) or modes[-1]
            list(dec.run(prompt, lambda ids: (model.engine.prefill(ids), log.clear(),
                                              seen.__setitem__(0, 0))[0]))
            for m, s in zip(modes[1:], rounds[1:]):  # the first round is not a steady one
                out.setdefault(m, []).append(s)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--weights", default="q8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--drafter", default=None, help="default: the MTP head, else lookup")
    ap.add_argument("--out")
    ap.add_argument("--kinds", action="store_true",
                    help="only the Python per kind of round (python_per_kind), of --drafter")
    a = ap.parse_args()
    model = sapwood.load(a.checkpoint, weights=a.weights, threads=a.threads)
    model.generation_config["eos_token_id"] = []  # random weights would stop anywhere
    v = model.config.vocab_size
    prompt = [int(t) for t in np.random.default_rng(0).integers(min(1000, v // 20),
                                                                min(20000, v // 2), 32)]
    if a.kinds:
        kinds = python_per_kind(model, prompt, a.tokens, a.drafter, a.reps)
        for k, v in sorted(kinds.items()):
            q = np.quantile(v, [0.25, 0.5, 0.75]) * 1e3
            print(f"{k:6s} {len(v):4d} rounds: Python {q[1]:.3f} ms a round "
                  f"[p25 {q[0]:.3f}, p75 {q[2]:.3f}]")
        if a.out:
            res = {"checkpoint": a.checkpoint, "drafter": a.drafter, "load_avg": os.getloadavg(),
                   "python_s": kinds}
            print(f"# {a.out} sha256 {dump_json(res, a.out)}")
        return
    plain = plain_ms(model, prompt, a.tokens, a.reps)
    tree = tree_run(model, prompt, a.tokens, a.width, a.drafter)
    res = {"checkpoint": os.path.basename(a.checkpoint.rstrip("/")), "weights": a.weights,
           "threads": a.threads, "vocab": model.config.vocab_size, "cpu": platform.processor(),
           "load_avg": os.getloadavg(), "plain_ms_per_token": plain,
           "sampled_over_greedy": float(np.median(plain["sampled"]) / np.median(plain["greedy"])),
           "tree": tree}
    for k, v in plain.items():
        print(f"plain {k:8s} {np.median(v):7.2f} ms/token  [{min(v):.2f}-{max(v):.2f}]")
    print(f"sampled / greedy: x{res['sampled_over_greedy']:.3f}")
    print(f"tree w{a.width} ({tree['drafter']}): {tree['engine_calls_per_round']:.2f} engine calls "
          f"a round {tree['calls']}, {100 * tree['outside_engine_share']:.1f}% of decode outside them")
    if a.out:
        print(f"# {a.out} sha256 {dump_json(res, a.out)}")


if __name__ == "__main__":
    main()
