"""Committed tokens per cycle and decode tokens/s of the bundled pair on the frozen held-out
prompts, for every verify mode and drafter, greedy and at T=0.8.

    python bench/tokens_per_cycle.py [--max-tokens 64] [--out tokens_per_cycle.json]
        [--arms off chain:mtp auto:mtp chain:default ...] [--prompts N] [--target DIR] [--threads N]

--target: another target (e.g. the padded testbed of scripts/pad_checkpoint.py) with the bundled
draft model attached; default: the bundled pair. The host's load average is recorded per
temperature (speeds on a shared host are only as good as its load).

Tokens per cycle is deterministic (the output is plain decoding's in every mode; checked here on
every prompt). Speeds are side by side: for each prompt all arms run back to back, in forward
order on even prompts and reversed on odd ones; each arm's speed is the median over prompts and
its ratio to off is the median of the per-prompt paired ratios. One warm-up request per arm runs
first and is not counted.
"""
import argparse
import json
import os
import statistics
from pathlib import Path

import sapwood
from sapwood.benchmarks.common import dump_json, machine, model_identity, source_revision

ARMS = [("off", None), ("chain", "default"), ("auto", "default"), ("tree", "default"),
        ("chain", "lookup"), ("auto", "lookup"), ("tree", "lookup")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="tokens_per_cycle.json")
    ap.add_argument("--arms", nargs="+", default=None,
                    help="verify:drafter pairs (drafter: mtp, default, lookup), 'off' first")
    ap.add_argument("--prompts", type=int, default=None, help="the first N held-out prompts")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: the engine's)")
    ap.add_argument("--target", default=None, help="target checkpoint directory (the bundled "
                    "draft is attached); default: the bundled pair")
    a = ap.parse_args()
    global ARMS
    if a.arms:
        ARMS = [(x, None) if x == "off" else tuple(x.split(":", 1)) for x in a.arms]
        if ARMS[0] != ("off", None):
            ap.error("the first arm must be 'off' (the ratios are to it)")
    prompts = json.loads(Path(sapwood.__file__).with_name("benchmarks")
                         .joinpath("heldout_prompts.json").read_text())["prompts"][:a.prompts]
    if a.target is None:
        m = sapwood.load("default", max_context=2048, threads=a.threads)
    else:
        from sapwood.loading import default_draft_path
        m = sapwood.load(a.target, max_context=2048, threads=a.threads)
        m.draft = sapwood.load(default_draft_path(), max_context=2048, threads=a.threads)
    out = {"revision": source_revision(), "model": model_identity(m), "machine": machine(),
           "max_tokens": a.max_tokens, "prompts": len(prompts), "rows": [], "loadavg": {}}
    for verify, drafter in ARMS:  # warm-up: first-request costs (page allocation, caches)
        m.generate(prompts[0]["text"], max_tokens=8, drafter=drafter, verify=verify)
    for temp in (0.0, 0.8):
        load = [os.getloadavg()]
        per_arm = {arm: {"tpc": [], "tps": [], "wide": []} for arm in ARMS}
        for i, p in enumerate(prompts):
            ref = None
            for verify, drafter in (ARMS if i % 2 == 0 else ARMS[::-1]):
                r = m.generate(p["text"], max_tokens=a.max_tokens, temperature=temp, seed=1,
                               drafter=drafter, verify=verify, width=16 if verify == "tree" else None)
                ref = ref or r.tokens
                if r.tokens != ref:
                    raise AssertionError(f"{p['id']}: {verify}/{drafter} differs from the first arm")
                d = per_arm[(verify, drafter)]
                d["tpc"].append(r.stats.tokens_per_cycle)
                d["tps"].append(r.stats.decode_tokens_per_s)
                d["wide"].append(r.stats.wide_cycles / max(1, r.stats.cycles))
        load.append(os.getloadavg())
        out["loadavg"][str(temp)] = {"start": load[0], "end": load[1]}
        print(f"T={temp:.1f} load average (1, 5, 15 min) at start {load[0]}, at end {load[1]}")
        off = per_arm[("off", None)]["tps"]
        for (verify, drafter), d in per_arm.items():
            ratios = [t / o for t, o in zip(d["tps"], off)]
            row = {"temperature": temp, "verify": verify, "drafter": drafter or "-",
                   "tokens_per_cycle": statistics.mean(d["tpc"]),
                   "decode_tok_s_median": statistics.median(d["tps"]),
                   "decode_tok_s_range": [min(d["tps"]), max(d["tps"])],
                   "vs_off_median": statistics.median(ratios),
                   "vs_off_range": [min(ratios), max(ratios)],
                   "wide_fraction": statistics.mean(d["wide"])}
            out["rows"].append(row)
            print(f"T={temp:.1f} {verify:>5} {row['drafter']:>8}  tokens/cycle {row['tokens_per_cycle']:5.2f}  "
                  f"decode {row['decode_tok_s_median']:7.1f} tok/s [{row['decode_tok_s_range'][0]:.0f}, "
                  f"{row['decode_tok_s_range'][1]:.0f}]  x{row['vs_off_median']:.2f} [{min(ratios):.2f}, {max(ratios):.2f}] vs off  "
                  f"wide {row['wide_fraction']:.2f}", flush=True)
    print(f"raw JSON {a.out} sha256 {dump_json(out, a.out)}")


if __name__ == "__main__":
    main()
