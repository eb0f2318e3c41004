"""Replays recorded chain rounds through the plain fallback (PlainFallback) to compare its
parameters without the noise of live A/Bs.

    python bench/replay_fallback.py record [--out rounds.json] [--depths 2048 8192]
    python bench/replay_fallback.py replay rounds.json [--z 2 --z-early 4 --min-rounds 8 --pooled-rounds 16
                                                        --prior-requests 3 ...] [--fresh]

record: for each cohort prompt (and the width study's context at each --depths), the rounds of
a greedy chain request (tokens committed, seconds) and the plain decode rate.
replay: per prompt, a request of --max-tokens under the policy. A speculative round starting
at output position p commits up to the next position where the recorded chain failed (the
draft misses the same tokens wherever its chain starts; at most rows + 1) and costs the
prompt's median chain round; a plain round costs 1 / plain rate. Costs the recording does not
hold are parameters: --switch (the first plain round after a speculative one, which runs the
committed path's GDN steps), --catch-up (the drafter's prefill of skipped tokens: a fixed part
and a per-token part) and --overhead (auto's extra Python a speculative round). The cohort's
prompts share one policy object in cohort order, as a server's band would; each depth is a
band of its own asked again and again, as the width study does (--passes rounds of all of it).
Reported for the first and the last pass: auto against the chain (geometric mean, worst
prompt, prompts below 0.98) and against plain decoding. --fresh instead replays every prompt
(the depths too) as the first request of a fresh process, a policy with no history: auto
against the better of the chain and plain decoding on that prompt, and against plain.
"""
import argparse
import json
import statistics

import numpy as np

from sapwood.policy import PlainFallback


def record(a):
    import sapwood
    from sapwood.benchmarks.width import depth_contexts

    model = sapwood.load("default", max_context=max(a.depths + [0]) + a.max_tokens + 300)
    prompts = [(p["id"], p["text"]) for p in json.load(open(a.cohort))["prompts"]]
    if a.depths:
        prompts += [(f"depth{d}", ids) for d, ids in depth_contexts(model, a.depths).items()]
    model.generate(prompts[0][1], verify="chain", max_tokens=16)  # warm-up
    out = {}
    for pid, p in prompts:
        rounds = []
        model.generate(p, verify="chain", max_tokens=a.max_tokens, cache_prompt=True,
                       on_round=lambda t, path, s: rounds.append((len(path), s)))
        plain = model.generate(p, verify="off", max_tokens=a.max_tokens, cache_prompt=True)
        out[pid] = {"chain_rounds": rounds, "plain_tok_s": plain.stats.decode_tokens_per_s}
        print(pid, len(rounds), "chain rounds;", round(plain.stats.decode_tokens_per_s), "tok/s plain")
    json.dump(out, open(a.out, "w"))


def replay_prompt(rec, mode, pf, a):
    fails = np.cumsum([k for k, _ in rec["chain_rounds"]])  # where each chain round stopped
    spec_s = statistics.median(s for _, s in rec["chain_rounds"][1:])
    plain_s = 1.0 / rec["plain_tok_s"]
    if pf is not None:
        pf.begin_request(a.rows + 1)
    pos, t, behind, after_spec, first = 0, 0.0, 0, False, True
    while pos < a.max_tokens:
        plain = mode == "off" or (mode == "auto" and pf.skip_draft(behind))
        caught = (0, 0.0)
        if plain:
            dt, tok = plain_s + (a.switch * 1e-3 if after_spec else 0.0), 1
            behind += 1
        else:
            nxt = fails[fails > pos]
            tok = int(min(nxt[0] - pos if nxt.size else a.rows + 1, a.rows + 1))
            cu = (a.catch_up[0] + a.catch_up[1] * behind) * 1e-3 if behind else 0.0
            dt = spec_s + cu + (a.overhead * 1e-3 if mode == "auto" else 0.0)
            caught, behind = (behind, cu), 0
            if mode == "auto" and caught[0]:
                pf.observe_catch_up(*caught)
        if mode == "auto" and not first:  # the first round after prefill is not observed
            pf.observe(plain, tok, dt, caught[1])
        first, after_spec = False, not plain
        pos, t = pos + tok, t + dt
    return pos / t


def replay_fresh(rec, kw, a):
    """Every prompt as the first request of a fresh process (a policy with no history)."""
    rows = []
    for pid in rec:
        r = {m: replay_prompt(rec[pid], m, PlainFallback(**kw) if m == "auto" else None, a)
             for m in ("chain", "off", "auto")}
        rows.append((pid, r["auto"] / max(r["chain"], r["off"]), r["auto"] / r["off"]))
        if a.verbose:
            print(f"  {pid:>18}: auto/best {rows[-1][1]:.3f}  auto/off {rows[-1][2]:.3f}")
    best = [b for _, b, _ in rows]
    print(f"fresh {kw}: auto vs the better of chain and off x{np.exp(np.mean(np.log(best))):.3f}, "
          f"worst x{min(best):.3f} ({rows[int(np.argmin(best))][0]}); auto vs off "
          f"x{np.exp(np.mean(np.log([o for _, _, o in rows]))):.3f}")


def replay(a):
    rec = json.load(open(a.rounds))
    kw = dict(z=a.z, z_early=a.z_early, min_rounds=a.min_rounds, pooled_rounds=a.pooled_rounds,
              prior_requests=a.prior_requests, recent_requests=a.recent_requests)
    if a.fresh:
        return replay_fresh(rec, kw, a)
    cohort = [p for p in rec if not p.startswith("depth")]
    depths = [p for p in rec if p.startswith("depth")]
    # the cohort shares one band; each depth is its own band, asked `passes` times (as the
    # width study asks one context again and again)
    rates = [{m: {} for m in ("chain", "off", "auto")} for _ in range(a.passes)]
    bands = [(PlainFallback(**kw), cohort)] + [(PlainFallback(**kw), [d]) for d in depths]
    for pf, group in bands:
        for k in range(a.passes):
            for pid in group:
                for m in rates[k]:
                    rates[k][m][pid] = replay_prompt(rec[pid], m, pf if m == "auto" else None, a)
    for k in (0, a.passes - 1):
        r = [rates[k]["auto"][p] / rates[k]["chain"][p] for p in cohort]
        off = [rates[k]["auto"][p] / rates[k]["off"][p] for p in cohort]
        print(f"pass {k + 1} {kw}: cohort auto vs chain x{np.exp(np.mean(np.log(r))):.3f}, "
              f"worst x{min(r):.3f}, {sum(x < 0.98 for x in r)} below 0.98; auto vs off "
              f"x{np.exp(np.mean(np.log(off))):.3f}; " + ", ".join(
                  f"{d} auto/off {rates[k]['auto'][d] / rates[k]['off'][d]:.3f}" for d in depths))
    if a.verbose:
        for p in rec:
            print(f"  {p:>18}: auto/chain {rates[-1]['auto'][p] / rates[-1]['chain'][p]:.3f}  "
                  f"auto/off {rates[-1]['auto'][p] / rates[-1]['off'][p]:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rc = sub.add_parser("record")
    rc.add_argument("--out", default="rounds.json")
    rc.add_argument("--cohort", default="bench/cohort.json")
    rc.add_argument("--depths", nargs="*", type=int, default=[2048, 8192])
    rc.add_argument("--max-tokens", type=int, default=128)
    rp = sub.add_parser("replay")
    rp.add_argument("rounds")
    rp.add_argument("--z", type=float, default=2.0)
    rp.add_argument("--z-early", type=float, default=4.0)
    rp.add_argument("--min-rounds", type=int, default=8)
    rp.add_argument("--pooled-rounds", type=int, default=16,
                    help="rounds judged with the band's pooled spread (0: the request's own)")
    rp.add_argument("--prior-requests", type=int, default=3,
                    help="recent requests, all lost with speculation, before a band starts requests plain "
                         "(0: never)")
    rp.add_argument("--recent-requests", type=int, default=8,
                    help="how many of the band's latest requests that judgement looks at")
    rp.add_argument("--fresh", action="store_true",
                    help="each prompt as the first request of a fresh process")
    rp.add_argument("--passes", type=int, default=3)
    rp.add_argument("--verbose", action="store_true")
    rp.add_argument("--max-tokens", type=int, default=128)
    rp.add_argument("--rows", type=int, default=8)
    rp.add_argument("--switch", type=float, default=0.2, help="ms")
    rp.add_argument("--catch-up", type=float, nargs=2, default=[0.1, 0.015], help="ms, ms/token")
    rp.add_argument("--overhead", type=float, default=0.0, help="ms")
    a = ap.parse_args()
    record(a) if a.cmd == "record" else replay(a)


if __name__ == "__main__":
    main()
