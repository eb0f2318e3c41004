"""Tree verify of 16 nodes against one row (a decode step) on a real-size checkpoint, 2 threads:
eng.verify of a 16-node tree (bench/engine_table.py's tree16) over eng.verify of one token at
the same context (64 prompt tokens), alternated, medians and ranges over blocks.

    python bench/results/zen4_vnni/stop49/verify16_4bit.py PATH:WEIGHTS ... [--blocks 8]
"""
import argparse, json, os, statistics, sys, time, warnings
warnings.filterwarnings("ignore")
import numpy as np
import sapwood

ap = argparse.ArgumentParser()
ap.add_argument("specs", nargs="+", metavar="PATH:WEIGHTS")
ap.add_argument("--blocks", type=int, default=8)
a = ap.parse_args()
out = {}
for spec in a.specs:
    path, weights = spec.rsplit(":", 1)
    m = sapwood.load(path, weights=weights, threads=2, max_context=256, quiet=True)
    eng = m.engine
    rng = np.random.default_rng(0)
    eng.prefill([int(t) for t in rng.integers(0, 1000, 64)])
    toks = [int(t) for t in rng.integers(0, 1000, 16)]
    # bench/engine_table.py's 16-node tree: each node's parent among the 3 before it
    tree16 = [-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, 16)]
    arms = {"verify1": lambda: eng.verify(toks[:1], [-1]), "verify16": lambda: eng.verify(toks, tree16)}
    for f in arms.values():
        f()
    t = {k: [] for k in arms}
    for b in range(a.blocks):
        for k in (list(arms) if b % 2 == 0 else list(arms)[::-1]):
            s = time.perf_counter()
            arms[k]()
            t[k].append(time.perf_counter() - s)
    r = [x / y for x, y in zip(t["verify16"], t["verify1"])]
    out[spec] = {k: v for k, v in t.items()} | {"ratio": r}
    print(f"{spec:40s} verify1 {1e3 * statistics.median(t['verify1']):7.1f} ms, verify16 "
          f"{1e3 * statistics.median(t['verify16']):7.1f} ms: x{statistics.median(r):.2f} "
          f"[{min(r):.2f}-{max(r):.2f}]")
    del m, eng
print(json.dumps({"runs": out, "load_avg": os.getloadavg()}))
