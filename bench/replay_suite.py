"""The deterministic replay suite: every recording a policy change is judged on, replayed
through the real decoder on a virtual clock (bench/replay_width.py with `--python-ms`: no real
time, so two runs of one build print the same digits), one summary line each.

    python bench/replay_suite.py [--quiet] [--only NAME] [--old REV] [--table] [--seeds N]
                                 [--noise verify_noise.json]

Recordings from three hosts: bench/results/zen3_avx2/ (a 2-core Zen 3, AVX2 only; stops
29-31), bench/results/zen4_vnni/ (a 2-core Zen 4 with AVX-512 VNNI) and bench/results/xeon_amx/
(a 2-core Xeon with AVX-512 and AMX), the last two with the engine on one thread (issue 39).
Costs are the recording host's (charged as the policy prices its own timings: a low quantile,
no size dearer than a larger one; replay_width.charged), acceptance the bundled pair's. Each line: auto against the
best of plain decoding, the chain and every fixed width 1-16, per context (warm: the mean of
requests after the first; first: a fresh state's first request against the best arm's own
first, cold against cold; reloaded: auto's first request on a state saved and reloaded
through JSON, as a second process with the policy cache, against warm auto) and, for the
cohorts, on the geometric mean over prompts against the best single arm.
--old REV: the same recordings through the policy of git revision REV (its python/sapwood on
this install's compiled core), for side-by-side figures.
"""
import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import replay_width  # noqa: E402
from sapwood.benchmarks.common import geomean  # noqa: E402

Z3 = os.path.join(HERE, "results", "zen3_avx2")
Z4 = os.path.join(HERE, "results", "zen4_vnni")
XA = os.path.join(HERE, "results", "xeon_amx")
XQ = os.path.join(XA, "quiet")
PADDED = dict(requests=4, widths="1-16", python_ms=0.4)
UNPADDED = dict(requests=4, widths="1-16", python_ms=0.15, max_tokens=128)
# The round's Python per kind of round once the round runs in the engine (issue 53): `python
# bench/round_cost.py default --drafter default --kinds` (bench/results/zen4_vnni/stop48/
# python_per_kind.json.gz, a quiet host), medians. --python kinds (the default) charges every
# recording these instead of the flat figures above (--python flat): the rounds' Python
# before it moved into the engine.
KINDS = {"off": 0.022, "plain": 0.022, "chain": 0.31, "tree": 0.39, "wide": 0.34}


def xeon_set(name: str, folder: str) -> list:
    """One Xeon recording session's four entries: padded and bundled, depths and cohort."""
    return [
        (f"{name} padded depths", [os.path.join(folder, "padded", f) for f in (
            "replay_depths.json", "replay_depth32k.json")], PADDED),
        (f"{name} padded cohort", [os.path.join(folder, "padded", "replay_cohort.json")],
         dict(PADDED, shared=True)),
        (f"{name} bundled depths", [os.path.join(folder, f) for f in (
            "replay_depths_unpadded.json", "replay_depth32k_unpadded.json")],
         dict(UNPADDED, max_tokens=64)),
        (f"{name} bundled cohort", [os.path.join(folder, "replay_cohort_unpadded.json")],
         dict(UNPADDED, shared=True)),
    ]


# name, recordings, replay options (python_ms: the policy's Python a round on that target)
SUITE = [
    ("avx2 padded depths", [os.path.join(Z3, "padded", f) for f in (
        "replay_depths_1_2k_8k.json", "replay_depths_mid.json", "replay_depth2k_stop30.json")],
     PADDED),
    ("avx2 padded held out", [os.path.join(Z3, "padded", "replay_heldout.json")], PADDED),
    ("avx2 padded cohort", [os.path.join(Z3, "padded", "replay_cohort.json")],
     dict(PADDED, shared=True)),
    ("avx2 padded held-out cohort", [os.path.join(Z3, "padded", "replay_heldout.json")],
     dict(PADDED, shared=True)),
    ("avx2 bundled cohort", [os.path.join(Z3, "replay_cohort_unpadded.json")],
     dict(UNPADDED, shared=True)),
    ("vnni padded depths", [os.path.join(Z4, "padded", "replay_depths.json")], PADDED),
    ("vnni padded cohort", [os.path.join(Z4, "padded", "replay_cohort.json")],
     dict(PADDED, shared=True)),
    ("vnni bundled depths", [os.path.join(Z4, "replay_depths_unpadded.json")],
     dict(UNPADDED, max_tokens=64)),
    ("vnni bundled cohort", [os.path.join(Z4, "replay_cohort_unpadded.json")],
     dict(UNPADDED, shared=True)),
] + xeon_set("amx", XA) + [
    # recordings that kept every timing (issue 39, stop 42): charged at the policy's quantile
    ("amx bundled depths, every timing", [os.path.join(XA, f) for f in (
        "replay_depths_unpadded_alltimes.json", "replay_depth32k_unpadded_alltimes.json")],
     dict(UNPADDED, max_tokens=64)),
    ("amx padded depths, every timing", [os.path.join(XA, "padded", "replay_depths_alltimes.json")],
     PADDED),
    ("amx bundled cohort, every timing", [os.path.join(XA, "replay_cohort_unpadded_alltimes.json")],
     dict(UNPADDED, shared=True)),
    # xeon_set("amx quiet", XQ): recorded on a quiet host (stop 43: no other session's load)
] + xeon_set("amx quiet", XQ)


def run(name, recs, opts, quiet=True, table=None, seed=0, noise=None, bar=None) -> str:
    """The summary line of one suite entry; `table`: a list that gets its markdown rows (per
    depth context, or the cohort's geometric means); seed: the --noise draws;
    noise: replay_width's --noise (every verify's charge scattered by a host's ratios)."""
    ratios, cohort = {}, []
    for rec in recs:
        a = SimpleNamespace(rec=rec, requests=4, max_tokens=64, widths="", python_ms=None,
                            one_rule=False, shared=False, trace=None, noise=noise, seed=seed)
        for k, v in opts.items():
            setattr(a, k, v)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            r = replay_width.replay(a)
        if not quiet:
            print(out.getvalue(), end="")
        if "cohort" in r:
            cohort.append((r.pop("cohort"), r.pop("cohort_first")))
        if table is not None and opts.get("shared"):
            table.append(f"| {name} | geomean of {len(r['later'])} prompts | "
                         f"{cohort[-1][0]:.3f} | {cohort[-1][1]:.3f} | "
                         f"{geomean(r['persisted']):.3f} |")
        elif table is not None:
            with open(rec) as f:
                names = [c["name"] for c in json.load(f)["contexts"]]
            rows = list(zip(names, r["later"], r["first"], r["persisted"]))
            table.extend(f"| {name} | {n} | {w:.3f} | {c:.3f} | {p:.3f} |"
                         for n, w, c, p in rows if n.startswith("depth"))
            rest = [x[1:] for x in rows if not x[0].startswith("depth")]
            if rest:  # prompts, each against its own best arm
                table.append(f"| {name} | {len(rest)} prompts, each / its best (geomean) | " +
                             " | ".join(f"{geomean(v):.3f}" for v in zip(*rest)) + " |")
        for k, v in r.items():
            ratios.setdefault(k, []).extend(v)
    def gw(k):
        v = ratios.get(k) or [float("nan")]
        return f"x{geomean(v):.3f} (worst x{min(v):.3f})"
    line = (f"{name}: auto / best other arm, warm {gw('later')}, first {gw('first')}, "
            f"reloaded / warm {gw('persisted')}, over {len(ratios['later'])} contexts")
    if opts.get("shared") and cohort:
        c, f = cohort[0]
        line += f"; cohort geomean / best arm x{c:.3f}, first requests x{f:.3f}"
    if bar is not None:  # the issue-53 bar: the cohort's geomean, else the contexts' warm one
        bar.append(cohort[0][0] if opts.get("shared") and cohort else geomean(ratios["later"]))
    return line


def old_package(rev: str) -> str:
    """A directory holding revision `rev`'s python/sapwood with this install's compiled core."""
    import sapwood

    d = tempfile.mkdtemp(prefix="sapwood-old-")
    root = subprocess.run(["git", "-C", HERE, "rev-parse", "--show-toplevel"], check=True,
                          capture_output=True, text=True).stdout.strip()
    arc = subprocess.run(["git", "-C", root, "archive", rev, "python/sapwood"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", d], input=arc, check=True)
    pkg = os.path.join(d, "python", "sapwood")
    here = os.path.dirname(sapwood.__file__)
    for f in os.listdir(here):
        if f.startswith("_core") and not os.path.exists(os.path.join(pkg, f)):
            shutil.copy(os.path.join(here, f), pkg)
    shutil.copytree(os.path.join(here, "data"), os.path.join(pkg, "data"), dirs_exist_ok=True)
    return os.path.join(d, "python")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quiet", action="store_true", help="the summary lines only")
    ap.add_argument("--only", default=None, help="the lines whose name contains this")
    ap.add_argument("--old", default=None, help="replay the policy of this git revision instead")
    ap.add_argument("--table", action="store_true",
                    help="then a markdown table: auto / best per depth, and per cohort")
    ap.add_argument("--seeds", type=int, default=1,
                    help="with --noise, replay each entry with noise seeds 0..N-1; the table "
                         "gives median [min, max]: a replay is deterministic per seed, not "
                         "stable across seeds (one timing of another size changes what follows)")
    ap.add_argument("--noise", default=None,
                    help="scatter every verify's charge by the ratios in this file "
                         "(bench/verify_noise.py): the live policy's timings on a loaded host")
    ap.add_argument("--python", choices=["kinds", "flat"], default="kinds",
                    help="the Python a round is charged: per kind of round (KINDS) or one "
                         "figure per target (the rounds before the engine took them in)")
    a = ap.parse_args()
    if a.old:
        from sapwood.policy import PolicyParams

        # the same charges as the current policy's replays (replay_width.charged)
        env = dict(os.environ, PYTHONPATH=old_package(a.old),
                   SAPWOOD_REPLAY_QUANTILE=str(PolicyParams().quantile))
        args = [sys.executable, __file__] + (["--quiet"] if a.quiet else []) + (
            ["--only", a.only] if a.only else []) + (["--table"] if a.table else []) + (
            ["--seeds", str(a.seeds)]) + (["--noise", a.noise] if a.noise else []) + (
            ["--python", a.python])
        sys.exit(subprocess.run(args, env=env).returncode)
    table, bar = [], []
    for name, recs, opts in SUITE:
        if a.python == "kinds":
            opts = dict(opts, python_ms=KINDS)
        if a.only is None or a.only in name:
            if all(os.path.exists(r) for r in recs):
                rows = []
                for seed in range(a.seeds):
                    rows.append([])
                    line = run(name, recs, opts, quiet=a.quiet, table=rows[-1], seed=seed,
                               noise=a.noise, bar=bar)
                    print(line if a.seeds == 1 else f"seed {seed}: {line}", flush=True)
                table += [merge_rows(r) for r in zip(*rows)]
    if bar:  # issue 53's bar: geomean >= 1.0 with no line below 0.95
        print(f"bar: auto / best fixed over {len(bar)} lines (a cohort's geomean, else the "
              f"warm contexts'): geomean x{geomean(bar):.3f}, worst x{min(bar):.3f}, "
              f"{sum(b < 0.95 for b in bar)} below x0.95")
    if a.table:
        print("\n| recordings | context | warm | first (cold / cold) | reloaded / warm |\n"
              "|---|---|---|---|---|")
        print("\n".join(table))


def merge_rows(rows) -> str:
    """One table row from one row per seed: each figure as its median [min, max]."""
    cells = [r.strip("|").split("|") for r in rows]
    out = cells[0][:2]
    for j in range(2, len(cells[0])):
        v = sorted(float(c[j]) for c in cells)
        out.append(f" {v[0]:.3f} " if len(v) == 1 else
                   f" {statistics.median(v):.3f} [{v[0]:.3f}, {v[-1]:.3f}] ")
    return "|" + "|".join(out) + "|"


if __name__ == "__main__":
    main()
