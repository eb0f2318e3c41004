"""The deterministic replay suite: every recording a policy change is judged on, replayed
through the real decoder on the virtual clock (bench/replay_width.py, `--python-ms`: no real
time, so two runs of one build print the same digits), summarized in one line each.

    python bench/replay_suite.py [--quiet]

- width: the width study's contexts (padded target, depths 1 .. 8K): auto against the best
  fixed width, later requests and a fresh rule's first, geometric mean and worst context, and
  the best fixed width's own first request against its later ones;
- width held out: the same on a recording made after the policy's parameters were chosen
  (depths 512 and 4096 and 30 held-out prompts, padded/replay_heldout.json);
- cohort, cohort held out, unpadded: one rule serving every prompt in turn (as `sapwood bench
  ab` does), auto against the chain.
The recordings live in bench/results/zen3_avx2/ (a 2-core Zen 3, AVX2): costs are that
machine's, acceptance the bundled pair's.
"""
import argparse
import contextlib
import io
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replay_width  # noqa: E402
from sapwood.benchmarks.common import geomean  # noqa: E402

R = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "zen3_avx2")
P = os.path.join(R, "padded")
WIDTH = ["replay_depths_1_2k_8k.json", "replay_depths_mid.json", "replay_depth2k_stop30.json"]
# name, recordings, replay options (python_ms: the policy's Python a round on that target)
SUITE = [
    ("width", [os.path.join(P, f) for f in WIDTH], dict(requests=6, widths="1-16", python_ms=0.4)),
    ("width held out", [os.path.join(P, "replay_heldout.json")],
     dict(requests=4, widths="1-16", python_ms=0.4)),
    ("cohort", [os.path.join(P, "replay_cohort.json")],
     dict(requests=4, widths="", shared=True, python_ms=0.4)),
    ("cohort held out", [os.path.join(P, "replay_heldout.json")],
     dict(requests=4, widths="", shared=True, python_ms=0.4)),
    ("unpadded cohort", [os.path.join(R, "replay_cohort_unpadded.json")],
     dict(requests=4, widths="", shared=True, python_ms=0.15, max_tokens=128)),
]


def run(name, recs, opts, quiet=True) -> str:
    ratios = {}
    for rec in recs:
        a = SimpleNamespace(rec=rec, requests=4, max_tokens=64, widths="", python_ms=None,
                            one_rule=False, shared=False, trace=None, noise=None)
        for k, v in opts.items():
            setattr(a, k, v)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            r = replay_width.replay(a)
        if not quiet:
            print(out.getvalue(), end="")
        for k, v in r.items():
            ratios.setdefault(k, []).extend(v)
    g = geomean
    if ratios["best_later"]:
        return (f"{name}: auto / best fixed width, later x{g(ratios['best_later']):.3f} (worst "
                f"x{min(ratios['best_later']):.3f}), first x{g(ratios['best_first']):.3f} (worst "
                f"x{min(ratios['best_first']):.3f}); the best fixed width's own first x"
                f"{g(ratios['fixed_first']):.3f}, over {len(ratios['best_later'])} contexts")
    return (f"{name}: auto / chain, later x{g(ratios['later']):.3f} (worst "
            f"x{min(ratios['later']):.3f}), first x{g(ratios['first']):.3f} over "
            f"{len(ratios['later'])} prompts")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quiet", action="store_true", help="the summary lines only")
    ap.add_argument("--only", default=None, help="the lines whose name contains this")
    a = ap.parse_args()
    for name, recs, opts in SUITE:
        if a.only is None or a.only in name:
            print(run(name, recs, opts, quiet=a.quiet), flush=True)


if __name__ == "__main__":
    main()
