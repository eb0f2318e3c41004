"""The first request of a fresh width rule against a fixed width, paired in one process: the
width study's first-request measure (`sapwood bench width` reports it with --reps pairs after
the whole study) alone and with more pairs, for comparing builds.

    python bench/first_request.py --model /tmp/padded --depth 2048 --width 3 [--pairs 8]

Per pair (rotating order, sapwood.benchmarks.width.first_requests): a request of the fixed
width on its own policy state (warmed by three requests first), one of auto on a fresh state
(what a fresh process knows) and one of the fixed width on a fresh state too (what a fresh
calibration costs the fixed width itself), all of
--max-tokens on the width study's context at --depth with the prompt cached. Prints the median
and range of the paired ratios of decode tokens/s. Two builds side by side: run it under each in turn, e.g. with
PYTHONPATH=OTHER:SITE_PACKAGES python -S (an editable install otherwise imports the working tree).
"""
import argparse

import numpy as np

import sapwood
from sapwood.benchmarks.width import depth_contexts, first_requests


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--width", type=int, required=True, help="the fixed width (the best, per the study)")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    m = sapwood.load(a.model, max_context=max(a.depth, 1) + a.max_tokens + 200)
    ids = depth_contexts(m, [a.depth])[a.depth]
    m.generate(ids, verify="chain", max_tokens=16, drafter=a.drafter, cache_prompt=True)  # warm-up
    # the width study's own pairing (sapwood bench width), its arguments named as there
    r = first_requests(m, ids, a.width, argparse.Namespace(
        max_tokens=a.max_tokens, drafter=a.drafter, temperature=0.0, reps=a.pairs, max_width=16))
    lo, hi = r["ratio_paired"]["range"]
    print(f"{sapwood.__file__}: depth {a.depth}: first request / fixed w{a.width}: median "
          f"x{r['ratio_paired']['median']:.3f} [{lo:.3f}, {hi:.3f}] (rule "
          f"{np.median(r['rule_tokens_per_s']):.1f}, fixed {np.median(r['fixed_tokens_per_s']):.1f} "
          f"decode tok/s, {a.pairs} pairs); the fixed width's own first request x"
          f"{r['fresh_fixed_ratio_paired']['median']:.3f}, a fresh rule / a fresh fixed width x"
          f"{r['rule_over_fresh_fixed_paired']['median']:.3f}")


if __name__ == "__main__":
    main()
