"""Two builds of sapwood side by side: decode tokens/s of the same verify modes in alternated
pairs of fresh processes (A B, B A, A B, ...), for changes `sapwood bench ab` cannot compare
(it runs two configurations of one build in one process). Every process checks its output
tokens against the other build's: a change that moves bits fails here.

    python bench/ab_builds.py OLD_DIR NEW_DIR [--modes off,chain] [--pairs 6] [--max-tokens 128]

OLD_DIR and NEW_DIR each hold an importable `sapwood` package (a copy of python/sapwood with
its built _core beside it). Per mode: the per-pair ratio new/old of decode tokens/s over the
cohort (tokens after the first over decode seconds), its median and range, and how many pairs
the new build won.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import sys, json, hashlib
sys.path.insert(0, sys.argv[1])
import sapwood
prompts = [p["text"] for p in json.load(open(sys.argv[2]))["prompts"]]
modes, max_tokens, rounds = sys.argv[3].split(","), int(sys.argv[4]), int(sys.argv[5])
m = sapwood.load("default")
for p in prompts[:4]:  # warm-up, not timed
    for md in modes:
        m.generate(p, max_tokens=32, verify=md)
tokens = {md: 0 for md in modes}
secs = {md: 0.0 for md in modes}
digest = hashlib.sha256()
for r in range(rounds):
    for p in prompts:
        for md in (modes if r % 2 == 0 else modes[::-1]):
            g = m.generate(p, max_tokens=max_tokens, verify=md)
            tokens[md] += g.stats.tokens - 1
            secs[md] += g.stats.decode_s
            if r == 0 and md == modes[0]:
                digest.update(str(g.tokens).encode())
print(json.dumps({"tok_s": {md: tokens[md] / secs[md] for md in modes},
                  "tokens_sha256": digest.hexdigest(), "file": sapwood.__file__}))
"""


def run_child(pkg_dir: str, modes: str, max_tokens: int, rounds: int) -> dict:
    cohort = Path(__file__).with_name("cohort.json")
    out = subprocess.run([sys.executable, "-c", CHILD, pkg_dir, str(cohort), modes,
                          str(max_tokens), str(rounds)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"child for {pkg_dir} failed:\n{out.stderr}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["file"].startswith(str(Path(pkg_dir).resolve())):
        raise RuntimeError(f"{pkg_dir}: the child imported {r['file']} instead")
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--modes", default="off,chain")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the cohort a process")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    ratios = {md: [] for md in modes}
    digest = None
    for i in range(a.pairs):
        order = ("old", "new") if i % 2 == 0 else ("new", "old")
        res = {}
        for name in order:
            res[name] = run_child(getattr(a, name), a.modes, a.max_tokens, a.rounds)
            digest = digest or res[name]["tokens_sha256"]
            if res[name]["tokens_sha256"] != digest:
                raise AssertionError(f"pair {i}: {name}'s output tokens differ from the other build's")
        line = []
        for md in modes:
            o, n = res["old"]["tok_s"][md], res["new"]["tok_s"][md]
            ratios[md].append(n / o)
            line.append(f"{md} {o:7.0f} -> {n:7.0f} x{n / o:.3f}")
        print(f"pair {i} ({' '.join(order)}): " + " | ".join(line), flush=True)
    for md in modes:
        r = ratios[md]
        print(f"{md}: new/old x{statistics.median(r):.3f} [{min(r):.3f}, {max(r):.3f}], "
              f"new faster in {sum(x > 1 for x in r)} of {len(r)} pairs")


if __name__ == "__main__":
    main()
