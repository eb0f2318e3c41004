"""A hash of the engine's outputs on the bundled target: prefill logits, tree verifies and
commits, draft chains, and generated tokens (greedy and sampled, every verify mode). A change
that must keep the bits (a refactor of the forward, the backend seam, the engine) prints the same
hash before and after; run it under both builds and compare.

    python scripts/bits_hash.py [--backend cpu] [--weights q8]
"""
from __future__ import annotations

import argparse
import hashlib

import numpy as np

import sapwood


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--weights", default="q8")
    args = ap.parse_args()
    model = sapwood.load("default", backend=args.backend, weights=args.weights, threads=2)
    eng, h = model.engine, hashlib.sha256()
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    prompt = [int(t) for t in rng.integers(0, V, 300)]  # two prefill chunks
    h.update(eng.prefill(prompt, all_logits=True).tobytes())
    for n, seed in ((1, 0), (9, 1), (33, 2)):
        parents = [-1] + [int(np.random.default_rng(seed).integers(0, i)) for i in range(1, n)]
        tokens = [int(t) for t in rng.integers(0, V, n)]
        h.update(eng.verify(tokens, parents).tobytes())
        path = [n - 1]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        eng.commit(path[::-1])
    h.update(eng.draft_chain(int(prompt[-1]), 6).tobytes())
    h.update(eng.draft_chain(int(prompt[-2]), 4, temperature=0.7, seed=5).tobytes())
    for verify in ("off", "chain", "tree", "auto"):
        for kw in ({}, {"temperature": 0.8, "seed": 11}):
            out = model.generate(prompt[:40], max_tokens=24, verify=verify, **kw)
            h.update(str(out.tokens).encode())
    print(f"bits hash ({args.backend}, {args.weights}): {h.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
