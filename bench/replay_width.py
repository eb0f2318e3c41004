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
position of it, which depends only on the context (DESIGN.md: a node's logits do not depend
on the batch), so whatever rounds a policy runs, its drafts are these; and the costs there,
medians of alternated timings: verify of 1..16 nodes, a draft of 1..8 rows, the draft's
catch-up per token.
replay: a fake engine whose verify returns logits picking the recorded continuation and
advances the clock by the recorded verify cost; a replay drafter that returns the recorded
lattice and advances it by the draft cost. The clock is the real one plus those costs, so the
policy's own Python still counts, measured live (on the bundled target, whose rounds take
~1 ms, that part stays noisy). Per context: fixed widths (verify="tree"), the chain and auto,
each `--requests` requests in a row on one WidthRule (as a server's band), the first request
(a fresh rule) and the mean of the rest in decode tokens/s; over several contexts, auto
against the chain's geometric mean.
"""
import argparse
import json
import time
import zlib

import numpy as np

from sapwood import generate as G
from sapwood.benchmarks.common import geomean
from sapwood.drafters import Lattice


def _median_times(fn, args, reps):
    out = {a: [] for a in args}
    for r in range(reps):
        for a in (args if r % 2 == 0 else args[::-1]):
            t = time.perf_counter()
            fn(a)
            out[a].append(time.perf_counter() - t)
    return [float(np.median(out[a])) for a in args]


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
    verify = _median_times(lambda n: eng.verify([root] * n, list(range(-1, n - 1))),
                           list(range(1, 17)), a.reps)
    d.reset()
    d.sync(prompt)
    draft = _median_times(lambda r: d.draft(prompt, root, r), list(range(1, 9)), a.reps)
    t = time.perf_counter()
    d.reset()
    d.sync(prompt)
    catch_up = (time.perf_counter() - t) / len(prompt)
    print(f"{name}: verify ms", " ".join(f"{v * 1e3:.1f}" for v in verify),
          "| draft ms", " ".join(f"{v * 1e3:.2f}" for v in draft))
    return {"name": name, "prompt_len": len(prompt), "seq": seq, "lattices": lattices,
            "verify_s": verify, "draft_s": draft, "catch_up_per_token_s": catch_up}


def record(a):
    import sapwood
    from sapwood.benchmarks.common import load_cohort
    from sapwood.benchmarks.width import depth_contexts

    model = sapwood.load(a.model, max_context=max(a.depths + [512]) + a.max_tokens + 64)
    d = model.resolve_drafter(a.drafter)
    contexts = []
    if a.depths:
        contexts += [(f"depth {n}", ids) for n, ids in depth_contexts(model, a.depths).items()]
    contexts += [(p["id"], model._prompt_ids(p["text"])) for p in load_cohort()[:a.cohort]]
    if a.prompts:  # a file of {"prompts": [{"id", "text"}]}, as bench/heldout_prompts.json
        contexts += [(p["id"], model._prompt_ids(p["text"]))
                     for p in json.load(open(a.prompts))["prompts"][:a.prompts_n]]
    out = {"model": a.model, "drafter": a.drafter,
           "contexts": [record_context(model, d, name, prompt, a) for name, prompt in contexts]}
    with open(a.out, "w") as f:
        json.dump(out, f)


class Clock:
    """Real time plus simulated engine and draft costs: the decoder's `time` while replaying.
    With `python_s` set, no real time: each verify also costs python_s for the round's Python,
    so a replay is deterministic (exploration draws come from a seeded generator). With
    `noise` (a sample of time / median ratios, bench/verify_noise.py), each verify costs its
    recorded median times a ratio drawn from it by a generator seeded with `seed`."""

    def __init__(self, python_s=None, noise=None, seed=0):
        self.extra, self.python_s = 0.0, python_s
        self.noise, self.rng = noise, np.random.default_rng(seed)

    def scatter(self, seconds: float) -> float:
        return seconds if self.noise is None else seconds * self.noise[self.rng.integers(len(self.noise))]

    def perf_counter(self):
        return self.extra if self.python_s is not None else time.perf_counter() + self.extra


class FakeEngine:
    """Verify returns one-hot logits picking the recorded continuation at every node whose
    path matches it (other nodes are never walked) and costs the recorded verify time."""

    def __init__(self, rec, clock, vocab):
        self.rec, self.clock, self.vocab = rec, clock, vocab
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
        self.clock.extra += (self.clock.scatter(self.rec["verify_s"][min(n, 16) - 1])
                             + (self.clock.python_s or 0.0))
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        p = self.position - self.plen  # the root is seq[p]
        last = len(self.seq) - 1
        return self._onehot([self.seq[min(p + d + 1, last)] for d in depth])

    def commit(self, path, fold_in_background=False):
        self.position += len(path)


class ReplayDrafter:
    def __init__(self, rec, clock):
        self.rec, self.clock = rec, clock
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
        self.clock.extra += self.rec["draft_s"][rows - 1]
        # [rows, k] int64 / float64 arrays, as Engine.draft_candidates gives them
        return Lattice(tokens=np.array(toks[:rows], np.int64), logprobs=np.array(lps[:rows]))


def replay_request(rec, arm, rule, max_tokens, trace=False, python_s=None, noise=None,
                   seed=0) -> float:
    """One request of `arm` on `rule` (trace: print its rounds, mode width:tokens/ms);
    returns its decode tokens/s. noise, seed: Clock's."""
    clock = Clock(python_s, noise, seed)
    G.time = clock  # the decoder's clock (restored by replay())
    vocab = 1 + max(max(rec["seq"]), max(max(max(r) for r in lat[0]) for lat in rec["lattices"]))
    eng, drafter = FakeEngine(rec, clock, vocab), ReplayDrafter(rec, clock)
    if arm in ("auto", "chain"):
        cfg = G.DecodeConfig(max_tokens=max_tokens, verify=arm, width=16)
    else:
        cfg = G.DecodeConfig(max_tokens=max_tokens, verify="tree", width=int(arm))
    log = []
    dec = G.Decoder(eng, drafter, cfg, rule=rule,
                    on_round=lambda t, path, sec: log.append((t.width, len(path), sec)))
    modes, mode_of = [], dec._mode
    dec._mode = lambda: modes.append(mode_of()) or modes[-1]
    toks = list(dec.run([0] * rec["prompt_len"]))
    if trace:  # c: chain, w: wide, p: plain, t: fixed tree
        print(f"  {rec['name']} {arm}: " + " ".join(f"{m[0]}{w}:{k}/{sec * 1e3:.0f}"
                                      for m, (w, k, sec) in zip(modes, log)))
    assert toks == rec["seq"][:len(toks)], "the replay changed the output"
    return dec.stats.decode_tokens_per_s


def replay(a):
    """Per arm, `requests` passes over the contexts. Each context has its own WidthRule per
    arm (a band asked the same prompt again and again, as the width study does), or with
    --shared one rule per arm serves every context in turn (a server's band of varied prompts,
    as `sapwood bench ab` runs the cohort); --one-rule: the arms share theirs."""
    data = json.load(open(a.rec))
    contexts = data["contexts"]
    noise = None if a.noise is None else np.array(json.load(open(a.noise))["ratios"])
    lo, hi = (int(x) for x in a.widths.split("-")) if a.widths else (1, 0)
    arms = [str(w) for w in range(lo, hi + 1)] + ["chain", "auto"]
    rules = {}
    tps = {(c["name"], arm): [] for c in contexts for arm in arms}
    try:
        for i in range(a.requests):
            for c in contexts:
                n = min(a.max_tokens, len(c["seq"]) - 1)
                for arm in arms:
                    key = (None if a.shared else c["name"], None if a.one_rule else arm)
                    rule = rules.setdefault(key, G.WidthRule())
                    tps[c["name"], arm].append(replay_request(
                        c, arm, rule, n, trace=a.trace and arm in ("auto", "chain", a.trace),
                        python_s=None if a.python_ms is None else a.python_ms / 1e3, noise=noise,
                        # each request its own draws, the same for every arm and run
                        seed=zlib.crc32(f"{c['name']} {i}".encode())))
    finally:
        G.time = time
    ratios = {"first": [], "later": [], "best_first": [], "best_later": [],  # auto / chain, best
              "fixed_first": []}
    for c in contexts:
        rows = {arm: tps[c["name"], arm] for arm in arms}
        later = {k: float(np.mean(v[1:])) for k, v in rows.items()}
        fixed = arms[:-2]
        line = (f"{c['name']}: auto {later['auto']:.1f} tok/s, x{later['auto'] / later['chain']:.3f}"
                f" of the chain (first request x{rows['auto'][0] / rows['chain'][0]:.3f})")
        ratios["later"].append(later["auto"] / later["chain"])
        ratios["first"].append(rows["auto"][0] / rows["chain"][0])
        if fixed:
            best = max(fixed, key=lambda k: later[k])
            ratios["best_later"].append(later["auto"] / later[best])
            # against the fixed width's later requests, as the width study pairs a fresh rule
            # with a fixed width whose acceptance calibration has seen earlier requests (a fresh
            # rule's fixed width grows its trees from the prior too: at depth 2K it verified 36
            # rounds where a calibrated one verified 31, so fresh against fresh read x0.96
            # where live ran x0.83)
            ratios["best_first"].append(rows["auto"][0] / later[best])
            # the best fixed width's own first request (its trees grown from a fresh
            # calibration): what the first request costs any tree, the rule's choices aside
            ratios["fixed_first"].append(rows[best][0] / later[best])
            line += (f"; best fixed w={best} {later[best]:.1f}, auto x{later['auto'] / later[best]:.3f}"
                     f" (first request x{rows['auto'][0] / later[best]:.3f}; its own first "
                     f"x{rows[best][0] / later[best]:.3f})\n  fixed: " +
                     " ".join(f"w{k}:{later[k]:.0f}" for k in fixed))
        print(line)
    if len(contexts) > 1:
        g = {k: geomean(v) for k, v in ratios.items()}
        print(f"auto / chain, geometric mean: later requests x{g['later']:.3f} (worst "
              f"x{min(ratios['later']):.3f}), first requests x{g['first']:.3f}")
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
    r.add_argument("--out", default="replay_width.json")
    p = sub.add_parser("replay")
    p.add_argument("rec")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--widths", default="1-16", help="fixed widths lo-hi ('' for none)")
    p.add_argument("--python-ms", type=float, default=None,
                   help="deterministic: no real time, this much Python per round instead")
    p.add_argument("--noise", default=None,
                   help="verify costs scattered by the time / median ratios in this file "
                        "(bench/verify_noise.py)")
    p.add_argument("--one-rule", action="store_true",
                   help="the arms share their WidthRule too (as `sapwood bench ab` arms do)")
    p.add_argument("--shared", action="store_true",
                   help="one WidthRule per arm for all contexts (a band of varied prompts)")
    p.add_argument("--trace", nargs="?", const="auto", default=None,
                   help="print auto's and the chain's rounds (and a fixed width's given here)")
    a = ap.parse_args()
    record(a) if a.cmd == "record" else replay(a)


if __name__ == "__main__":
    main()
