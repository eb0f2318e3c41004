"""Tokens per cycle and decode tok/s on the held-out prompts for the bundled pair, for every
verify mode and drafter, greedy and T=0.8:  python bench/tokens_per_cycle.py [max_tokens]"""
import json, sys, time, statistics
import sapwood
from pathlib import Path
prompts = json.loads(Path(sapwood.__file__).with_name("benchmarks").joinpath("heldout_prompts.json").read_text())["prompts"]
m = sapwood.load("default", max_context=2048)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 64
rows = []
for temp in [0.0, 0.8]:
    for drafter in ["default", "lookup"]:
        for verify in ["off", "chain", "auto", "tree"]:
            if verify == "off" and drafter == "lookup":
                continue
            tpc, tps, wide, toks = [], [], [], []
            for p in prompts:
                r = m.generate(p["text"], max_tokens=N, temperature=temp, seed=1, drafter=drafter, verify=verify, width=16 if verify=="tree" else None)
                tpc.append(r.stats.tokens_per_cycle); tps.append(r.stats.decode_tokens_per_s); wide.append(r.stats.wide_cycles / max(1, r.stats.cycles))
            rows.append(dict(temperature=temp, drafter=drafter if verify != "off" else "-", verify=verify, tokens_per_cycle=statistics.mean(tpc), decode_tok_s_median=statistics.median(tps), wide_fraction=statistics.mean(wide)))
            print(rows[-1], flush=True)
json.dump(rows, open("tokens_per_cycle.json", "w"), indent=1)
