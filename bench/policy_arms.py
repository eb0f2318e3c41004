"""Live A/B of speculation policy variants in one process: each arm a verify mode and PolicyParams
fields, with its own policy state (as a server of that configuration would have), the arms'
requests rotated per prompt over the cohort. Prints each block's decode tokens/s per arm and,
per arm, its ratio to the first arm (median and range over blocks).

    python bench/policy_arms.py chain:chain auto:auto never_wide:auto:'{"ema_wide_below": 0}'
                                [--blocks 4] [--max-tokens 128] [--model default] [--drafter D]

`sapwood bench ab` compares two configurations of generate(); this compares PolicyParams too,
which replays (bench/replay_suite.py) cannot judge where the policy's own Python matters: they
charge every arm the same Python a round.
"""
import argparse
import json
import statistics

import sapwood
from sapwood.benchmarks.common import load_cohort
from sapwood.policy import Policy, PolicyParams


def parse_arm(text: str):
    name, verify, *params = text.split(":", 2)
    return name, verify, json.loads(params[0]) if params else {}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("arms", nargs="+", help="NAME:VERIFY[:JSON of PolicyParams fields]")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default="default")
    ap.add_argument("--drafter", default=None,
                    help="as generate()'s (default: the model's own: its draft, else its MTP head, "
                         "else lookup); 'default' is the bundled draft model")
    a = ap.parse_args(argv)
    arms = [parse_arm(t) for t in a.arms]
    prompts = [p["text"] for p in load_cohort()]
    model = sapwood.load(a.model, policy_cache=False)
    states = {}
    for name, _, params in arms:  # each arm's own policy, with its parameters
        states[name] = {}
        with model.policy_state(states[name]):
            model.speculation_policy(model.resolve_drafter(a.drafter))
        for key in states[name]:
            states[name][key] = Policy(PolicyParams(**params))

    def run(arm, prompt, max_tokens):
        with model.policy_state(states[arm[0]]):
            return model.generate(prompt, max_tokens=max_tokens, verify=arm[1], drafter=a.drafter)

    for p in prompts[:4]:  # warm-up: not timed, the arms' states learn from it
        for arm in arms:
            run(arm, p, 32)
    ratios = {arm[0]: [] for arm in arms}
    for b in range(a.blocks):
        tokens, seconds = dict.fromkeys(ratios, 0), dict.fromkeys(ratios, 0.0)
        for i, p in enumerate(prompts):
            k = (i + b) % len(arms)
            order = arms[k:] + arms[:k]
            for arm in (order if (i + b) % 2 == 0 else order[::-1]):
                g = run(arm, p, a.max_tokens)
                tokens[arm[0]] += g.stats.tokens - 1
                seconds[arm[0]] += g.stats.decode_s
        rate = {n: tokens[n] / seconds[n] for n in ratios}
        for n in ratios:
            ratios[n].append(rate[n] / rate[arms[0][0]])
        print(f"block {b}: " + ", ".join(f"{n} {r:.1f} tok/s" for n, r in rate.items()), flush=True)
    for n, r in ratios.items():
        print(f"{n:>16}: x{statistics.median(r):.3f} [{min(r):.3f}, {max(r):.3f}] of {arms[0][0]}")
    return states


if __name__ == "__main__":
    main()
