"""What a cold first request pays, from the replays: auto's first request on one context of
each depth recording in bench/replay_suite.py, on a fresh policy state, and on a fresh state
given one part of a warm one (auto's state after --requests requests on that context): its
costs, its acceptance and row counts, or all of it; each against the best fixed arm's first
request (cold / cold, as replay_suite's "first" column).

    python bench/first_request_parts.py [--only NAME]
"""
import argparse
import json
import os
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import replay_suite  # noqa: E402
import replay_width as R  # noqa: E402

PARTS = {"fresh": (), "+costs": ("costs", "level"), "+acceptance": ("acceptance", "rows"),
         "warm": ("costs", "level", "acceptance", "rows")}


def first_requests(rec, opts, requests):
    max_tokens = min(opts.get("max_tokens", 64), len(rec["seq"]) - 1)
    py = opts["python_ms"] / 1e3
    def run(arm, pol, i):
        return R.replay_request(rec, arm, pol, max_tokens, python_s=py,
                                seed=zlib.crc32(f"{rec['name']} {i}".encode()))
    lo, hi = (int(x) for x in opts["widths"].split("-"))
    cold = {arm: run(arm, R.new_state(), 0)
            for arm in [str(w) for w in range(lo, hi + 1)] + ["off", "chain"]}
    best = max(cold, key=cold.get)
    warm = R.new_state()
    for i in range(requests):
        run("auto", warm, i)
    fresh, full = json.loads(R.saved_state(R.new_state())), json.loads(R.saved_state(warm))
    out = {}
    for name, keys in PARTS.items():
        s = dict(fresh, **{k: full[k] for k in keys})
        out[name] = run("auto", R.new_state(json.dumps(s)), 0) / cold[best]
    return best, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None)
    ap.add_argument("--requests", type=int, default=4)
    a = ap.parse_args()
    print("| recordings | context | best cold arm | " + " | ".join(PARTS) + " |")
    print("|---|---|---|" + "---|" * len(PARTS))
    for name, recs, opts in replay_suite.SUITE:
        if opts.get("shared") or (a.only and a.only not in name):
            continue
        for path in recs:
            for rec in json.load(open(path))["contexts"]:
                if rec["name"].startswith("depth"):
                    best, r = first_requests(rec, opts, a.requests)
                    print(f"| {name} | {rec['name']} | {best} | " +
                          " | ".join(f"{v:.3f}" for v in r.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
