"""Replays recorded requests through the real decoding loop (generate.Decoder, the whole auto
policy) on a virtual clock, to compare policy changes without the noise of a shared host: on
a 2-core VM the same fixed width ran at 135-198 tokens/s from one request to the next, so live
width studies (`sapwood bench width`) could not tell a 3% change from none.

    python bench/replay_width.py record --model DIR [--depths 1 2048] [--cohort 13]
                                        [--drafter default] [--max-tokens 64] [--out rec.json]
    python bench/replay_width.py replay rec.json [--requests 8] [--widths 1-16] [--trace [W]]
                                       [--shared] [--one-rule] [--python-ms 0.4]
                                       [--noise verify_noise.json]

record: per context (the width study's context at each depth, the first N cohort prompts),
the greedy continuation; the draft model's lattice (8 rows, its top 4 per row) at every
position of it, which depends only on the context (docs/design.md: a node's logits do not depend
on the batch), so whatever rounds a policy runs, its drafts are these; and the costs there,
every alternated timing (and their medians): verify of 1..16 nodes, a draft of 1..8 rows, the
draft's catch-up per token.
replay: a fake engine whose verify returns logits picking the recorded continuation and
advances the clock by the recorded verify cost (charged(): priced as the policy prices its own
timings); a replay drafter that returns the recorded lattice and advances it by the draft cost. The clock (passed to the decoder) is the real one
plus those costs, so the policy's own Python still counts, measured live; with --python-ms, no
real time at all (deterministic). Per context: fixed widths (verify="tree"), plain decoding,
the chain and auto, each `--requests` requests in a row on one policy state per arm (as a
server's band), the first request (a fresh state: cold) and the mean of the rest (warm) in
decode tokens/s, and auto's first request on a state saved after those requests and loaded
through JSON (a second process with the policy cache). Auto is compared with the best of
plain, the chain and the best fixed width, warm against warm and cold against cold. The
policy before issue 39 (its WidthRule) replays too: run this file with that package first on
PYTHONPATH (bench/replay_suite.py --old).
"""
import argparse
import json
import os
import time
import zlib

import numpy as np

from sapwood import generate as G
from sapwood.benchmarks.common import geomean
from sapwood.drafters import Lattice


def _alternated_times(fn, args, reps):
    """Every timing of fn(a), reps per a, the args alternated forwards and backwards."""
    out = {a: [] for a in args}
    for r in range(reps):
        for a in (args if r % 2 == 0 else args[::-1]):
            t = time.perf_counter()
            fn(a)
            out[a].append(time.perf_counter() - t)
    return [out[a] for a in args]


def record_context(model, d, name, prompt, a):
    """The greedy continuation of `prompt`, the draft's lattice at each of its positions and
    the costs at this context."""
    seq = model.generate(prompt, verify="off", max_tokens=a.max_tokens + 1).tokens
    d.reset()
    lattices = []
    for p in range(len(seq)):
        lat = d.draft(prompt + seq[:p], seq[p], 8)
        lattices.append([[t.tolist() for t in lat.tokens], [lp.tolist() for lp in lat.logprobs]])
        d.advance([seq[p]])
    eng = model.engine
    eng.reset()
    eng.prefill(prompt)
    root = prompt[-1]
    verify_all = _alternated_times(lambda n: eng.verify([root] * n, list(range(-1, n - 1))),
                                   list(range(1, 17)), a.reps)
    d.reset()
    d.sync(prompt)
    draft_all = _alternated_times(lambda r: d.draft(prompt, root, r), list(range(1, 9)), a.reps)
    verify = [float(np.median(v)) for v in verify_all]
    draft = [float(np.median(v)) for v in draft_all]
    t = time.perf_counter()
    d.reset()
    d.sync(prompt)
    catch_up = (time.perf_counter() - t) / len(prompt)
    print(f"{name}: verify ms", " ".join(f"{v * 1e3:.1f}" for v in verify),
          "| draft ms", " ".join(f"{v * 1e3:.2f}" for v in draft))
    return {"name": name, "prompt_len": len(prompt), "seq": seq, "lattices": lattices,
            "verify_s": verify, "draft_s": draft, "catch_up_per_token_s": catch_up,
            "verify_all_s": verify_all, "draft_all_s": draft_all}


def record(a):
    import sapwood
    from sapwood.benchmarks.common import load_cohort
    from sapwood.benchmarks.width import depth_contexts

    model = sapwood.load(a.model, max_context=max(a.depths + [512]) + a.max_tokens + 64,
                         threads=a.threads, policy_cache=False)
    d = model.resolve_drafter(a.drafter)
    contexts = []
    if a.depths:
        contexts += [(f"depth {n}", ids) for n, ids in depth_contexts(model, a.depths).items()]
    contexts += [(p["id"], model._prompt_ids(p["text"])) for p in load_cohort()[:a.cohort]]
    if a.prompts:  # a file of {"prompts": [{"id", "text"}]}, as bench/heldout_prompts.json
        contexts += [(p["id"], model._prompt_ids(p["text"]))
                     for p in json.load(open(a.prompts))["prompts"][:a.prompts_n]]
    out = {"model": a.model, "drafter": a.drafter, "threads": a.threads,
           "contexts": [record_context(model, d, name, prompt, a) for name, prompt in contexts]}
    with open(a.out, "w") as f:
        json.dump(out, f)


class Clock:
    """Real time plus simulated engine and draft costs: the decoder's `time` while replaying.
    With `python_s` set, no real time: each verify also costs python_s for the round's Python,
    so a replay is deterministic. With
    `noise` (a sample of time / median ratios, bench/verify_noise.py), each verify costs its
    recorded median times a ratio drawn from it by a generator seeded with `seed`."""

    def __init__(self, python_s=None, noise=None, seed=0):
        # python_s: seconds a round, or per kind of round (the decoder's modes: off, plain,
        # chain, wide, tree), as bench/round_cost.py --kinds measures them
        self.extra, self.python_s = 0.0, python_s
        self.noise, self.rng = noise, np.random.default_rng(seed)
        self.kind = "off"  # the round being run (replay_request follows the decoder's _mode)

    def python(self) -> float:
        """The Python a verify is charged: python_s when it is one figure (the rounds before
        issue 53, whose Python came with the verify), else 0 (start_round charges it)."""
        return 0.0 if isinstance(self.python_s, dict) else self.python_s or 0.0

    def start_round(self, kind: str) -> None:
        """A round of `kind` begins: with python_s per kind, its Python is charged now, outside
        the verify, where the live decoder's timings put it (the round's rest)."""
        self.kind = kind
        if isinstance(self.python_s, dict):  # an older decoder's modes: priced as a chain's
            self.extra += self.python_s.get(kind, self.python_s["chain"])

    def scatter(self, seconds: float) -> float:
        return seconds if self.noise is None else seconds * self.noise[self.rng.integers(len(self.noise))]

    def perf_counter(self):
        return self.extra if self.python_s is not None else time.perf_counter() + self.extra


def charged(rec, part: str) -> list:
    """The seconds a replay charges a verify of 1..16 nodes (part "verify") or a draft of 1..8
    rows ("draft"), priced as the policy prices its own timings: the policy's quantile of the
    recorded timings (a recording that kept only their medians: the medians), each capped by
    the larger sizes' (policy.capped_by_larger): a size dearer than a larger one was timed
    while the recording host preempted it, which the live policy does not take as its cost."""
    raw = rec.get(f"{part}_all_s")
    own = np.array(rec[f"{part}_s"] if raw is None else [np.quantile(v, quantile()) for v in raw])
    return np.minimum.accumulate(own[::-1])[::-1].tolist()


def quantile() -> float:
    """The policy's cost quantile (PolicyParams.quantile); replay_suite.py --old passes the
    current one, so an older policy is judged on the same charges."""
    q = os.environ.get("SAPWOOD_REPLAY_QUANTILE")
    if q:
        return float(q)
    from sapwood.policy import PolicyParams

    return PolicyParams().quantile


class FakeEngine:
    """Verify returns one-hot logits picking the recorded continuation at every node whose
    path matches it (other nodes are never walked) and costs the recorded verify time."""

    def __init__(self, rec, clock, vocab):
        self.rec, self.clock, self.vocab = rec, clock, vocab
        self.verify_s = charged(rec, "verify")
        self.seq, self.plen = rec["seq"], rec["prompt_len"]
        self.max_context = self.plen + len(self.seq) + 64
        self.position = 0

    def _onehot(self, picks):
        out = np.zeros((len(picks), self.vocab), np.float32)
        out[np.arange(len(picks)), picks] = 1.0
        return out

    def prefill(self, ids):
        self.position = len(ids)
        return self._onehot([self.seq[0]])[0]

    def verify(self, tokens, parents):
        n = len(tokens)
        self.clock.extra += self.clock.scatter(self.verify_s[min(n, 16) - 1]) + self.clock.python()
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        p = self.position - self.plen  # the root is seq[p]
        last = len(self.seq) - 1
        return self._onehot([self.seq[min(p + d + 1, last)] for d in depth])

    def verify_walk(self, tokens, parents, fold_in_background=False, **sampling):
        return G.walk_and_commit(self, self.verify(tokens, parents), tokens, parents, **sampling)

    def commit(self, path, fold_in_background=False):
        self.position += len(path)


class ReplayDrafter:
    def __init__(self, rec, clock):
        self.rec, self.clock = rec, clock
        self.draft_s = charged(rec, "draft")
        self._synced = 0

    def set_sampling(self, temperature, seed):
        pass

    def sync(self, context):
        n = len(context) - self._synced
        self.clock.extra += max(n, 0) * self.rec["catch_up_per_token_s"]
        self._synced = len(context)
        return 0

    def advance(self, committed):
        self._synced += len(committed)

    def draft(self, context, root, rows):
        self.sync(context)
        p = len(context) - self.rec["prompt_len"]
        toks, lps = self.rec["lattices"][p]
        rows = min(rows, len(toks))
        self.clock.extra += self.draft_s[rows - 1]
        # [rows, k] int64 / float64 arrays, as Engine.draft_candidates gives them
        return Lattice(tokens=np.array(toks[:rows], np.int64), logprobs=np.array(lps[:rows]))


OLD = hasattr(G, "WidthRule")  # the package on the path is the policy before issue 39


def new_state(saved=None):
    """A fresh policy state for one arm (or one loaded from `saved`, a JSON text of state())."""
    if OLD:
        return G.WidthRule()
    # SAPWOOD_REPLAY_PARAMS: a JSON object of PolicyParams fields, to replay a parameter change
    from sapwood.policy import PolicyParams

    params = json.loads(os.environ.get("SAPWOOD_REPLAY_PARAMS") or "{}")
    pol = G.Policy(PolicyParams(**params))
    if saved is not None:
        from sapwood import policy_cache
        policy_cache.load_state(pol, json.loads(saved))
    return pol


def saved_state(pol):
    if OLD:
        return None
    from sapwood import policy_cache
    return json.dumps(policy_cache.state(pol))


def replay_request(rec, arm, rule, max_tokens, trace=False, python_s=None, noise=None,
                   seed=0) -> float:
    """One request of `arm` on policy state `rule` (trace: print its rounds, mode
    width:tokens/ms); returns its decode tokens/s. noise, seed: Clock's."""
    clock = Clock(python_s, noise, seed)
    vocab = 1 + max(max(rec["seq"]), max(max(max(r) for r in lat[0]) for lat in rec["lattices"]))
    eng, drafter = FakeEngine(rec, clock, vocab), ReplayDrafter(rec, clock)
    if arm in ("auto", "chain", "off"):
        cfg = G.DecodeConfig(max_tokens=max_tokens, verify=arm, width=16)
    else:
        cfg = G.DecodeConfig(max_tokens=max_tokens, verify="tree", width=int(arm))
    log = []
    def on_round(t, path, sec):
        log.append((t.width, len(path), sec))
    drafter = None if arm == "off" else drafter
    if OLD:  # its decoder reads the module's clock
        G.time = clock
        dec = G.Decoder(eng, drafter, cfg, rule=rule, on_round=on_round)
    else:
        dec = G.Decoder(eng, drafter, cfg, policy=rule, on_round=on_round,
                        clock=clock.perf_counter)
    modes, mode_of = [], dec._mode

    def mode():
        modes.append(mode_of())
        clock.start_round(modes[-1])
        return modes[-1]
    dec._mode = mode
    toks = list(dec.run([0] * rec["prompt_len"]))
    if trace:  # c: chain, w: wide, p: plain, t: fixed tree
        print(f"  {rec['name']} {arm}: " + " ".join(f"{m[0]}{w}:{k}/{sec * 1e3:.0f}"
                                      for m, (w, k, sec) in zip(modes, log)))
    assert toks == rec["seq"][:len(toks)], "the replay changed the output"
    return dec.stats.decode_tokens_per_s


def replay(a):
    """Per arm, `requests` passes over the contexts. Each context has its own policy state per
    arm (a band asked the same prompt again and again, as the width study does), or with
    --shared one state per arm serves every context in turn (a server's band of varied prompts,
    as `sapwood bench ab` runs the cohort); --one-rule: the arms share theirs."""
    data = json.load(open(a.rec))
    contexts = data["contexts"]
    noise = None if a.noise is None else np.array(json.load(open(a.noise))["ratios"])
    lo, hi = (int(x) for x in a.widths.split("-")) if a.widths else (1, 0)
    arms = [str(w) for w in range(lo, hi + 1)] + ["off", "chain", "auto"]
    rules = {}
    tps = {(c["name"], arm): [] for c in contexts for arm in arms}
    python_s = a.python_ms
    if isinstance(python_s, str):  # --python-ms chain=0.45,wide=0.6,...
        python_s = {k: float(v) for k, v in (kv.split("=") for kv in python_s.split(","))}
    if isinstance(python_s, dict):
        python_s = {k: v / 1e3 for k, v in python_s.items()}
        python_s.setdefault("plain", python_s.get("off", 0.0))
    elif python_s is not None:
        python_s = float(python_s) / 1e3
    def run(c, i, arm, rule, trace=False):
        return replay_request(c, arm, rule, min(a.max_tokens, len(c["seq"]) - 1), trace=trace,
                              python_s=python_s, noise=noise,
                              # each request its own draws, the same for every arm and run
                              seed=zlib.crc32(f"{c['name']} {i}".encode()))
    try:
        for i in range(a.requests):
            for c in contexts:
                for arm in arms:
                    key = (None if a.shared else c["name"], None if a.one_rule else arm)
                    rule = rules.setdefault(key, new_state())
                    tps[c["name"], arm].append(run(
                        c, i, arm, rule, trace=a.trace and arm in ("auto", "chain", a.trace)))
        # a second process's first request: auto's state saved after those requests, reloaded
        persisted = {}
        saved = {}
        for c in contexts:
            key = (None if a.shared else c["name"], None if a.one_rule else "auto")
            if key not in saved:
                saved[key] = saved_state(rules[key])
            if saved[key] is not None:
                persisted[c["name"]] = run(c, a.requests, "auto",
                                           new_state(saved[key]))
    finally:
        if OLD:
            G.time = time
    ratios = {k: [] for k in ("later", "first", "persisted", "chain_later", "chain_first")}
    later_of = {}
    for c in contexts:
        rows = {arm: tps[c["name"], arm] for arm in arms}
        later = {k: float(np.mean(v[1:])) for k, v in rows.items()}
        later_of[c["name"]] = later
        base = [k for k in arms if k != "auto"]
        best = max(base, key=lambda k: later[k])
        ratios["later"].append(later["auto"] / later[best])
        ratios["first"].append(rows["auto"][0] / rows[best][0])  # cold against cold
        ratios["chain_later"].append(later["auto"] / later["chain"])
        ratios["chain_first"].append(rows["auto"][0] / rows["chain"][0])
        line = (f"{c['name']}: auto {later['auto']:.1f} tok/s, best of the others {best} "
                f"{later[best]:.1f}: auto x{later['auto'] / later[best]:.3f}, first request "
                f"x{rows['auto'][0] / rows[best][0]:.3f} (cold / cold)")
        if c["name"] in persisted:
            ratios["persisted"].append(persisted[c["name"]] / later["auto"])
            line += f", a reloaded state's first x{persisted[c['name']] / later['auto']:.3f} of warm"
        line += (f"; plain {later['off']:.0f}, chain {later['chain']:.0f}" +
                 "".join(f" w{k}:{later[k]:.0f}" for k in arms[:-3]))
        print(line)
    if len(contexts) > 1:  # the cohort: auto against each arm's geometric mean over contexts
        g = {arm: geomean([later_of[c["name"]][arm] for c in contexts]) for arm in arms}
        gf = {arm: geomean([tps[c["name"], arm][0] for c in contexts]) for arm in arms}
        best = max((k for k in arms if k != "auto"), key=lambda k: g[k])
        ratios["cohort"] = g["auto"] / g[best]
        ratios["cohort_first"] = gf["auto"] / gf[best]
        print(f"geometric means over {len(contexts)} contexts: auto {g['auto']:.1f} tok/s, best "
              f"arm {best} {g[best]:.1f}: auto x{ratios['cohort']:.3f} (first requests x"
              f"{ratios['cohort_first']:.3f}); per context against its own best: x"
              f"{geomean(ratios['later']):.3f} (worst x{min(ratios['later']):.3f})")
    return ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--model", default="default")
    r.add_argument("--drafter", default="default", help="a draft model (its top 4 per row)")
    r.add_argument("--depths", type=int, nargs="*", default=[1, 2048])
    r.add_argument("--cohort", type=int, default=0, help="also the first N cohort prompts")
    r.add_argument("--prompts", default=None,
                   help="also prompts from this file ({'prompts': [{'id', 'text'}]})")
    r.add_argument("--prompts-n", type=int, default=12, help="how many of --prompts")
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--reps", type=int, default=9)
    r.add_argument("--threads", type=int, default=None,
                   help="engine threads (1 keeps a busy shared host from stalling a pool's barrier)")
    r.add_argument("--out", default="replay_width.json")
    p = sub.add_parser("replay")
    p.add_argument("rec")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--widths", default="1-16", help="fixed widths lo-hi ('' for none)")
    p.add_argument("--python-ms", default=None,
                   help="deterministic: no real time, this much Python per round instead "
                        "(ms; or per kind of round: off=0.03,chain=0.45,tree=0.45,wide=0.6)")
    p.add_argument("--noise", default=None,
                   help="verify costs scattered by the time / median ratios in this file "
                        "(bench/verify_noise.py)")
    p.add_argument("--seed", type=int, default=0,
                   help="the --noise draws (a replay is deterministic per seed)")
    p.add_argument("--one-rule", action="store_true",
                   help="the arms share their policy state too")
    p.add_argument("--shared", action="store_true",
                   help="one policy state per arm for all contexts (a band of varied prompts)")
    p.add_argument("--trace", nargs="?", const="auto", default=None,
                   help="print auto's and the chain's rounds (and a fixed width's given here)")
    a = ap.parse_args()
    record(a) if a.cmd == "record" else replay(a)


if __name__ == "__main__":
    main()
