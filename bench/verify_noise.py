"""How a verify's time scatters on this host: the ratio of each timing to its width's median,
from alternated verifies of a few widths at one context, for bench/replay_width.py --noise
(which draws a recorded cost's multiplier from these ratios).

    python bench/verify_noise.py --model /tmp/padded --depth 2048 [--widths 1 3 5 9] [--reps 60]
                                 [--out verify_noise.json]
    python bench/verify_noise.py --recording rec.json [--out verify_noise.json]

--recording: the ratios from a replay recording that kept every timing (replay_width.py
record), each verify timing over its node count's charged cost (replay_width.charged: the
policy's low quantile), so a replay with --noise charges that cost scattered as that host
scattered it (preemption included).

A replay prices every verify at its recorded median, so a policy that learns its costs from
noisy timings (the live first request of a fresh rule) looks better replayed than live: on the
padded target at depth 2K a fixed 3-node round took 12.8-29 ms live in one width study.
"""
import argparse
import json
import os
import sys
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--depth", type=int, default=2048)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 3, 5, 9])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", default="verify_noise.json")
    ap.add_argument("--recording", default=None, help="ratios from this replay recording")
    a = ap.parse_args()
    if a.recording:
        return from_recording(a)
    import sapwood
    from sapwood.benchmarks.width import depth_contexts

    model = sapwood.load(a.model, max_context=a.depth + 64)
    prompt = depth_contexts(model, [a.depth])[a.depth]
    eng = model.engine
    eng.reset()
    eng.prefill(prompt)
    root = prompt[-1]
    times = {w: [] for w in a.widths}
    for r in range(a.reps):
        for w in (a.widths if r % 2 == 0 else a.widths[::-1]):
            t = time.perf_counter()
            eng.verify([root] * w, list(range(-1, w - 1)))
            times[w].append(time.perf_counter() - t)
    ratios = sorted(t / float(np.median(v)) for v in times.values() for t in v)
    q = np.quantile(ratios, [0.1, 0.5, 0.9, 0.99])
    print(f"depth {a.depth}: {len(ratios)} verifies, time / its width's median: "
          f"p10 {q[0]:.3f} p50 {q[1]:.3f} p90 {q[2]:.3f} p99 {q[3]:.3f} max {ratios[-1]:.3f}")
    with open(a.out, "w") as f:
        json.dump({"model": a.model, "depth": a.depth, "widths": a.widths,
                   "medians_s": {w: float(np.median(v)) for w, v in times.items()},
                   "ratios": ratios}, f)


def from_recording(a):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import replay_width

    rec = json.load(open(a.recording))
    ratios = sorted(t / c for ctx in rec["contexts"]
                    for c, ts in zip(replay_width.charged(ctx, "verify"), ctx["verify_all_s"])
                    for t in ts)
    q = np.quantile(ratios, [0.1, 0.5, 0.9, 0.99])
    print(f"{a.recording}: {len(ratios)} verifies, time / its charged cost: p10 {q[0]:.3f} "
          f"p50 {q[1]:.3f} p90 {q[2]:.3f} p99 {q[3]:.3f} max {ratios[-1]:.3f}")
    with open(a.out, "w") as f:
        json.dump({"recording": a.recording, "ratios": ratios}, f)


if __name__ == "__main__":
    main()
