"""The width study: at several context depths, verify at the widest tree, log what every
narrower prefix w = 1..W would have accepted (exact by the prefix property: the accepted path
at width w is the wide path cut at the first node >= w), time forced-width runs, and compare
the width rule against the best fixed width; the first request of a fresh process (no cost
or acceptance history) is reported separately, paired side by side with the best fixed width.
Every arm keeps its own policy state, fresh at each depth.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from ..generate import DecodeConfig
from .common import dump_json, machine, model_identity, source_revision, table


def context_text(n_chars: int) -> str:
    """Deterministic long context: standard-library Python source in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in sorted(root.glob("*.py")):
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(t)
        total += len(t)
        if total >= n_chars:
            break
    return "".join(out)[:n_chars]


def accepted_by_width(tree, path, max_width) -> np.ndarray:
    """acc[w-1] = draft rows the path keeps when only nodes < w were verified."""
    acc = np.zeros(max_width, np.int64)
    for w in range(1, max_width + 1):
        for n in path[1:]:  # node indices grow along a path (parents come first)
            if n >= w:
                break
            acc[w - 1] += 1
    return acc


def rule_rows(max_width: int) -> int:
    """Draft rows of the rule's rounds: a chain of r rows verifies r + 1 nodes, and in auto
    mode the chain competes with the tree whatever `width` says, so without this cap the rule
    verified chains of 9 nodes in a study of widths up to 4."""
    return max(1, min(DecodeConfig.rows, max_width - 1))


def study_depth(model, ids, max_width, max_tokens, drafter, temperature, reps, log, depth=None):
    """The study at one context: (its results, each arm's policy state by arm). depth: the
    label asked for (default len(ids); depth 0 runs on a one-token context)."""
    gen = dict(max_tokens=max_tokens, temperature=temperature, drafter=drafter, cache_prompt=True)
    depth = len(ids) if depth is None else depth
    res = {"depth": depth, "context_tokens": len(ids)}
    # Each arm learns its own policy state (Model.policy_state), as a server running that
    # configuration would: sharing one, the rule learned from the forced widths' rounds too.
    arms = list(range(1, max_width + 1)) + ["rule", "plain"]  # plain: no draft, a reference
    states = {arm: {} for arm in arms}
    # 1. Rounds at the widest tree: per-round acceptance of every prefix width.
    accs = []
    with model.policy_state(states[max_width]):
        model.generate(ids, verify="tree", width=max_width, **gen,
                       on_round=lambda t, p, s: accs.append(accepted_by_width(t, p, max_width)))
    acc = np.mean(accs, axis=0) if accs else np.zeros(max_width)
    res["derived_tokens_per_round"] = (1 + acc).tolist()
    # 2. Forced widths and the rule, timed (decode only: prompt cached), `reps` passes over all
    #    arms in alternating order (ABBA) so drifts of a shared machine hit every arm alike;
    #    the first request of a fresh rule is measured apart, in first_requests().
    tps = {arm: [] for arm in arms}
    widths = arms[:-2]
    round_s = {w: [] for w in widths}
    rule_widths = []
    for rep in range(reps):
        for arm in (arms if rep % 2 == 0 else arms[::-1]):
            with model.policy_state(states[arm]):
                if arm == "rule":
                    r = model.generate(ids, verify="auto", width=max_width,
                                       rows=rule_rows(max_width), **gen,
                                       on_round=lambda t, p, s: rule_widths.append(t.width))
                elif arm == "plain":
                    r = model.generate(ids, verify="off", **gen)
                else:
                    r = model.generate(ids, verify="tree", width=arm, **gen,
                                       on_round=lambda t, p, s, w=arm: round_s[w].append(s))
            tps[arm].append(r.stats.decode_tokens_per_s)
    med = {arm: float(np.median(x)) for arm, x in tps.items()}
    res["fixed_tokens_per_s"] = [med[w] for w in widths]
    res["fixed_tokens_per_s_samples"] = [tps[w] for w in widths]
    res["round_ms"] = [1e3 * float(np.median(round_s[w])) for w in widths]
    res["plain_tokens_per_s"], res["rule_over_plain"] = med["plain"], med["rule"] / med["plain"]
    res["derived_tokens_per_s"] = [(1 + a) / (ms / 1e3) for a, ms in zip(acc, res["round_ms"])]
    best = int(np.argmax(res["fixed_tokens_per_s"]))
    res["best_fixed_width"], res["best_fixed_tokens_per_s"] = best + 1, med[best + 1]
    res["rule_tokens_per_s"], res["rule_tokens_per_s_samples"] = med["rule"], tps["rule"]
    res["rule_ratio"] = med["rule"] / med[best + 1]
    paired = [r / b for r, b in zip(tps["rule"], tps[best + 1])]
    res["rule_ratio_paired"] = {"median": float(np.median(paired)), "range": [min(paired), max(paired)]}
    res["rule_widths"] = rule_widths
    log(f"depth {depth:>6}: best fixed w={best + 1} {med[best + 1]:.1f} tok/s; rule "
        f"{med['rule']:.1f} tok/s (x{res['rule_ratio']:.3f}, paired per pass "
        f"{res['rule_ratio_paired']['median']:.3f} [{min(paired):.3f}, {max(paired):.3f}]); "
        f"mean rule width {np.mean(rule_widths) if rule_widths else 0:.1f}; plain decoding "
        f"{med['plain']:.1f} tok/s")
    return res, states


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'sapwood[bench]'); no plot written"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        w = np.arange(1, len(r["fixed_tokens_per_s"]) + 1)
        line, = ax.plot(w, r["fixed_tokens_per_s"], marker=".", label=f"depth {r['depth']}")
        wr = np.mean(r["rule_widths"]) if r["rule_widths"] else 1
        ax.plot([wr], [r["rule_tokens_per_s"]], marker="*", markersize=14, color=line.get_color())
        if "plain_tokens_per_s" in r:
            ax.axhline(r["plain_tokens_per_s"], ls=":", lw=1, color=line.get_color())
    ax.set_xlabel("tree width (verified nodes)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("fixed widths (lines), the width rule (stars, at its mean width),\n"
                 "plain decoding (dotted)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def first_requests(model, ids, best_width, a, warm: dict | None = None,
                   warm_requests: int = 3) -> dict:
    """The first request of a fresh rule (no cost or acceptance history) against the best fixed
    width, `reps` rounds of three arms side by side in rotating order: on a shared machine a
    ratio of medians taken minutes apart swung 0.6-1.2 between runs; paired, each ratio sees
    the same minute of the machine. Arms, each in its own policy state (Model.policy_state):
    the rule, fresh every time; the fixed width on `warm` (its state from the study; without
    one, a state warmed by `warm_requests` requests of it first); the fixed width fresh every
    time too, whose ratio to the warm one is what a fresh acceptance calibration costs any tree
    (its shapes), the rule's choices aside. The process is warm (allocations, first touches,
    the draft model's first forwards, the prompt in both prompt caches), not the policy."""
    gen = dict(max_tokens=a.max_tokens, drafter=a.drafter, temperature=a.temperature,
               cache_prompt=True)
    if warm is None:
        warm = {}
        with model.policy_state(warm):
            for _ in range(warm_requests):
                model.generate(ids, verify="tree", width=best_width, **gen)
    arms = ("rule", "fixed", "fixed_fresh")
    tps = {arm: [] for arm in arms}
    for rep in range(a.reps):
        for arm in (arms if rep % 2 == 0 else arms[::-1]):
            with model.policy_state(warm if arm == "fixed" else {}):
                if arm == "rule":
                    r = model.generate(ids, verify="auto", width=a.max_width,
                                       rows=rule_rows(a.max_width), **gen)
                else:
                    r = model.generate(ids, verify="tree", width=best_width, **gen)
            tps[arm].append(r.stats.decode_tokens_per_s)

    def paired(num, den):
        x = [n / d for n, d in zip(tps[num], tps[den])]
        return {"median": float(np.median(x)), "range": [min(x), max(x)]}

    return {"rule_tokens_per_s": tps["rule"], "fixed_tokens_per_s": tps["fixed"],
            "fresh_fixed_tokens_per_s": tps["fixed_fresh"],
            "ratio_paired": paired("rule", "fixed"),
            "fresh_fixed_ratio_paired": paired("fixed_fresh", "fixed"),
            "rule_over_fresh_fixed_paired": paired("rule", "fixed_fresh")}


def depth_contexts(model, depths) -> dict:
    """The study's context at each depth: the first max(d, 1) tokens of one context_text (one
    encode for every depth), as the width study, the replays and their helpers read them."""
    ids = model.encode(context_text(6 * max(depths) + 1000))
    if len(ids) < max(depths):
        raise ValueError(f"only {len(ids)} context tokens available, depth {max(depths)} asked")
    return {d: ids[:max(d, 1)] for d in depths}


def check_args(a) -> None:
    """Bad values named before the model loads."""
    if not 2 <= a.max_width <= 64:
        raise ValueError(f"--max-width {a.max_width}: must be 2 to 64 (the rule is measured "
                         "against every fixed width from 1 to it)")
    bad = [d for d in a.depths if d < 0]
    if bad:
        raise ValueError(f"--depths {bad[0]}: a context depth is a number of tokens, >= 0")


def summary_table(depths: list) -> str:
    """The run's one table, a row per depth as asked; ratios are rule / the arm named."""
    rows = [[r["depth"], r["best_fixed_width"], f"{r['best_fixed_tokens_per_s']:.1f}",
             f"{r['rule_tokens_per_s']:.1f}", f"x{r['rule_ratio']:.3f}",
             f"x{r['first_request_ratio']:.3f}", f"x{r['fresh_fixed_ratio']:.3f}",
             f"{r['plain_tokens_per_s']:.1f}", f"x{r['rule_over_plain']:.3f}"] for r in depths]
    return table(["depth (tokens)", "best fixed width", "its tok/s", "rule tok/s",
                  "rule/best fixed", "first request rule/best fixed", "fresh/warm fixed",
                  "plain tok/s", "rule/plain"], rows)


def main(a) -> int:
    import sapwood

    check_args(a)
    model = sapwood.load(a.model, weights=a.weights, kv=a.kv, threads=a.threads,
                         max_context=max(a.depths) + a.max_tokens + 64)
    prompt_of = depth_contexts(model, a.depths)
    out = {"revision": source_revision(), "model": model_identity(model), "machine": machine(),
           "max_width": a.max_width, "max_tokens": a.max_tokens, "reps": a.reps,
           "first_request": {}, "depths": []}
    model.generate(prompt_of[a.depths[0]], verify="chain", drafter=a.drafter, max_tokens=16,
                   cache_prompt=True)  # warm-up
    for d in a.depths:
        res, states = study_depth(model, prompt_of[d], a.max_width, a.max_tokens, a.drafter,
                                  a.temperature, a.reps, print, depth=d)
        # The first request of a fresh process, after the study has found the best fixed width
        first = first_requests(model, prompt_of[d], res["best_fixed_width"], a,
                               warm=states[res["best_fixed_width"]])
        out["first_request"][d] = first["rule_tokens_per_s"]
        res["first_request_rule_tokens_per_s"] = float(np.median(first["rule_tokens_per_s"]))
        res["first_request_fixed_tokens_per_s"] = first["fixed_tokens_per_s"]
        res["first_request_ratio"] = first["ratio_paired"]["median"]
        res["first_request_ratio_range"] = first["ratio_paired"]["range"]
        res["fresh_fixed_ratio"] = first["fresh_fixed_ratio_paired"]["median"]
        res["first_request_over_fresh_fixed"] = first["rule_over_fresh_fixed_paired"]["median"]
        lo, hi = res["first_request_ratio_range"]
        print(f"depth {d:>6}: first request of a fresh rule / fixed w={res['best_fixed_width']}, "
              f"paired: x{res['first_request_ratio']:.3f} [{lo:.3f}, {hi:.3f}]; the fixed "
              f"width's own first request x{res['fresh_fixed_ratio']:.3f} of it (a fresh rule "
              f"/ a fresh fixed width x{res['first_request_over_fresh_fixed']:.3f})")
        out["depths"].append(res)
    print(f"\nwidths 1 to {a.max_width}; decode tokens/s, medians of {a.reps} passes")
    print(summary_table(out["depths"]))
    out["plot"] = plot(out["depths"], Path(a.out).with_suffix(".png"))
    print(f"plot: {out['plot']}")
    sha = dump_json(out, a.out)
    print(f"raw JSON {a.out} sha256 {sha}")
    return 0
