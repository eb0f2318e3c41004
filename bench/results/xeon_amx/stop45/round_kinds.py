"""Stop 45's diagnostic (kept with the figures it made, not a maintained benchmark): auto and
auto-never-wide, each its own policy state, alternated over the cohort (3 blocks); rounds split
by the plan's kind (plain / chain / wide) and the verified tree's shape (root alone, chain,
tree), with tokens, nodes and ms per round; what the wide rounds' judge compared (the chain
counterfactual's tokens and rows); the policies' learned costs.

    PYTHONPATH=python SAPWOOD_POLICY_CACHE=0 python round_kinds.py /tmp/padded 64
"""
import collections, sys
import sapwood
from sapwood.benchmarks.common import load_cohort
from sapwood.policy import Policy, PolicyParams
prompts = [p["text"] for p in load_cohort()]
model, maxt = sys.argv[1], int(sys.argv[2])
m = sapwood.load(model, policy_cache=False)
arms = [("auto", "auto", {}), ("nw", "auto", {"ema_wide_below": 0})]
states = {}
for name, _, params in arms:
    states[name] = {}
    with m.policy_state(states[name]):
        m.speculation_policy(m.resolve_drafter(None))
    for k in states[name]: states[name][k] = Policy(PolicyParams(**params))
judged = collections.Counter(); xs = []
J = Policy.judge
cf = []
def spy(self, band, *a):
    if len(a) == 5:
        tree, rows, picks, line, chain_rows = a
        r = min(chain_rows, len(line) - 1, len(picks))
        kept = next((d for d in range(r) if picks[d] != line[d + 1]), r)
        cf.append((len(picks), kept + 1, chain_rows, rows, tree.width))
    else:
        tree, rows, tokens, (chain_rows, kept, _) = a
        cf.append((tokens, kept + 1, chain_rows, rows, tree.width))
    judged[band] += 1
    before = self.wide_vs_chain.get(band, [0.0])[0]
    J(self, band, *a)
    xs.append(self.wide_vs_chain.get(band, [0.0])[0] - before)
Policy.judge = spy
agg = collections.defaultdict(lambda: [0, 0, 0, 0.0])
from sapwood import generate as G
M = G.Decoder._mode
last = [None]
def mode_spy(self):
    r = M(self); last[0] = (r, self._rows); return r
G.Decoder._mode = mode_spy
def run(arm, p, n, rec):
    def on_round(tree, path, sec):
        if rec:
            a = agg[arm[0], last[0][0] + ("-1node" if tree.width == 1 else "-chain" if tree.is_chain else "-tree")]
            a[0] += 1; a[1] += len(path); a[2] += tree.width; a[3] += sec
    with m.policy_state(states[arm[0]]):
        return m.generate(p, max_tokens=n, verify=arm[1], on_round=on_round)
for p in prompts[:4]:
    for arm in arms: run(arm, p, 32, False)
tot = collections.Counter(); sec = collections.Counter()
for b in range(3):
    for i, p in enumerate(prompts):
        for arm in (arms if (i + b) % 2 == 0 else arms[::-1]):
            g = run(arm, p, maxt, True)
            tot[arm[0]] += g.stats.tokens - 1; sec[arm[0]] += g.stats.decode_s
for a in arms: print(a[0], f"{tot[a[0]]/sec[a[0]]:.1f} tok/s")
for (arm, kind), (n, toks, nodes, s) in sorted(agg.items()):
    print(f"{arm:5} {kind:12}: {n} rounds, {toks/n:.2f} tok/round, {nodes/n:.2f} nodes, {1e3*s/n:.3f} ms/round, {toks/s/1e3:.3f} tok/ms")
import numpy as np
cfa = np.array(cf, float)
print("wide tokens %.3f chain cf tokens %.3f chain_rows %.2f rows %.2f width %.2f" % tuple(cfa.mean(0)))
print("judged per band", dict(judged), "mean x", sum(xs)/max(len(xs),1))
for k, pol in states["auto"].items():
    print(k, {b: [round(v, 2) for v in s] for b, s in pol.wide_vs_chain.items()})
from sapwood.policy import band_of
for name in ("auto", "nw"):
    for k, pol in states[name].items():
        c = pol.costs
        print(name, "rest chain %.3f tree %.3f plain %.3f ms; verify 1 %.3f 2 %.3f 3 %.3f; draft %.3f; n rest chain %d" % tuple(
            [1e3 * (c.cost(0, "rest", x) or 0) for x in ("chain", "tree", "plain")] +
            [1e3 * c.verify(0, n) for n in (1, 2, 3)] + [1e3 * c.cost(0, "draft", 0), len(c.t.get((0, "rest", "chain"), []))]))
        print("   rest chain timings", [round(1e3 * x, 2) for x in c.t.get((0, "rest", "chain"), [])])
        print("   rest tree timings", [round(1e3 * x, 2) for x in c.t.get((0, "rest", "tree"), [])])
