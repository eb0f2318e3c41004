"""Two builds of sapwood side by side: decode tokens/s of the same verify modes in alternated
pairs of fresh processes (A B, B A, A B, ...), for changes `sapwood bench ab` cannot compare
(it runs two configurations of one build in one process). Every process checks its output
tokens against the other build's: a change that moves bits fails here.

    python bench/ab_builds.py OLD_DIR NEW_DIR [--modes off,chain] [--pairs 6] [--max-tokens 128]
    python bench/ab_builds.py OLD_DIR NEW_DIR --in-process [--blocks 4]

OLD_DIR and NEW_DIR each hold an importable `sapwood` package (a copy of python/sapwood with
its built _core beside it). Per mode: the per-pair ratio new/old of decode tokens/s over the
cohort (tokens after the first over decode seconds), its median and range, and how many pairs
the new build won.

--in-process loads both builds into one process and alternates their requests ABBA per
prompt, which this noisy host needs for changes of a few percent (process pairs here differ by
up to 2x). Two pybind11 modules that register the same types must not share pybind11's
internals: build one of them with -DCMAKE_CXX_FLAGS=-DPYBIND11_INTERNALS_VERSION=99, or, for
a change to the Python alone, give --share-core: both packages then run on NEW_DIR's _core
(OLD_DIR needs no _core: `git archive REV python/sapwood | tar -x -C OLD_DIR --strip-components 1`). Each
build has its own thread pool, so a build's helper spins on for 2 ms into the other's turn;
an A/A of two such builds of one source read x0.991 (off) and x0.988 (chain) over 4 blocks:
read smaller changes as none.
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
from sapwood.benchmarks.common import load_cohort
prompts = [p["text"] for p in load_cohort()]
modes, max_tokens, rounds = sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
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
    out = subprocess.run([sys.executable, "-c", CHILD, pkg_dir, modes, str(max_tokens),
                          str(rounds)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"child for {pkg_dir} failed:\n{out.stderr}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["file"].startswith(str(Path(pkg_dir).resolve())):
        raise RuntimeError(f"{pkg_dir}: the child imported {r['file']} instead")
    return r


def load_as(name: str, pkg_dir: str, core=None):
    """The `sapwood` package under pkg_dir, imported as `name` (its imports are relative);
    with `core`, that _core module instead of its own."""
    import importlib.util
    if core is not None:
        sys.modules[f"{name}._core"] = core
    init = Path(pkg_dir).resolve() / "sapwood" / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init,
                                                  submodule_search_locations=[str(init.parent)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def in_process(a, modes):
    import importlib
    # one _core for both with --share-core: NEW_DIR's, or the one this process has loaded
    # already (a second copy of it cannot register its types again)
    new = load_as("sapwood_new", a.new, core=sys.modules.get("sapwood._core") if a.share_core else None)
    old = load_as("sapwood_old", a.old, core=new._core if a.share_core else None)
    models = {k: m.load(a.model) for k, m in (("old", old), ("new", new))}
    # the new build's helpers: importing the installed sapwood here would load a third _core
    common = importlib.import_module("sapwood_new.benchmarks.common")
    geomean = common.geomean
    prompts = [p["text"] for p in common.load_cohort()]
    for md in modes:
        for p in prompts[:3]:  # warm-up, not timed
            for m in models.values():
                m.generate(p, max_tokens=32, verify=md, drafter=a.drafter)
        ratios = []
        for b in range(a.blocks):
            for p in prompts:
                tok = {"old": [0, 0.0], "new": [0, 0.0]}
                ref = None
                for k in ("old", "new", "new", "old") if b % 2 == 0 else ("new", "old", "old", "new"):
                    g = models[k].generate(p, max_tokens=a.max_tokens, verify=md,
                                           drafter=a.drafter)
                    ref = ref or g.tokens
                    if g.tokens != ref:
                        raise AssertionError(f"{md}: the builds' output tokens differ")
                    tok[k][0] += g.stats.tokens - 1
                    tok[k][1] += g.stats.decode_s
                ratios.append((tok["new"][0] / tok["new"][1]) / (tok["old"][0] / tok["old"][1]))
        per_block = [geomean(ratios[b * len(prompts):(b + 1) * len(prompts)])
                     for b in range(a.blocks)]
        print(f"{md}: new/old decode geomean x{geomean(ratios):.3f}, per block "
              f"{' '.join(f'x{x:.3f}' for x in per_block)}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--modes", default="off,chain")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the cohort a process")
    ap.add_argument("--in-process", action="store_true", help="both builds in one process")
    ap.add_argument("--blocks", type=int, default=4, help="ABBA blocks (--in-process)")
    ap.add_argument("--share-core", action="store_true",
                    help="--in-process, a Python change: the old package runs on the new _core")
    ap.add_argument("--model", default="default", help="--in-process: the target")
    ap.add_argument("--drafter", default=None, help="--in-process: the drafter")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    if a.in_process:
        return in_process(a, modes)
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
