"""The A/B protocol of docs/design.md: two arms in one process on one engine, ABBA/BAAB blocks after
excluded warm-up samples, identical output tokens checked on every sample, per-block verdicts.
Each arm keeps its own speculation policy state (run_ab).

Per block each arm has two samples; spread = |t1 - t2| / mean(t1, t2) of an arm's pair. A block
with spread > 5% in either arm is inconclusive; otherwise B's change in tokens/s against A
passes (non-regression, not a gain) when the regression is at most max(2%, 2 * spread).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import (arm_text, dump_json, geomean, load_cohort, machine, model_identity, parse_arm,
                     ratio_text, source_revision, table)

INCONCLUSIVE_SPREAD = 0.05


def _sample(model, arm: dict, prompt: str, max_tokens: int, policy: dict) -> dict:
    with model.policy_state(policy):
        t0 = time.perf_counter()
        r = model.generate(prompt, max_tokens=max_tokens, **arm)
        wall = time.perf_counter() - t0
    s = r.stats
    return {"tokens": r.tokens, "wall_s": wall, "tok_s": s.tokens / wall,
            "decode_tok_s": s.decode_tokens_per_s, "ttft_s": s.prefill_s,
            "tokens_per_cycle": s.tokens_per_cycle, "cycles": s.cycles, "wide_cycles": s.wide_cycles}


def block_verdict(a_pair, b_pair) -> dict:
    """a_pair, b_pair: tokens/s of each arm's two samples in one block."""
    spread = max(abs(x[0] - x[1]) / np.mean(x) for x in (a_pair, b_pair))
    change = np.mean(b_pair) / np.mean(a_pair) - 1.0
    if spread > INCONCLUSIVE_SPREAD:
        verdict = "inconclusive"
    else:
        verdict = "pass" if change >= -max(0.02, 2 * spread) else "regression"
    return {"spread": float(spread), "change": float(change), "verdict": verdict}


def run_ab(model, arm_a: dict, arm_b: dict, prompts: list[dict], *, max_tokens=64, blocks=2,
           warmup=1, log=print) -> dict:
    arms = {"A": arm_a, "B": arm_b}
    # Each arm learns its own speculation policy (width rules: costs, calibration, draft
    # lengths), as a server running that configuration would. Shared, the chain arm's rounds
    # set the draft length the auto arm's requests started from, which sped the chain arm and
    # narrowed the auto / chain ratio (replayed: bench/replay_width.py --one-rule).
    policy = {"A": {}, "B": {}}
    per_prompt = []
    log(f"A = {arm_text(arm_a)}\nB = {arm_text(arm_b)}\n(every ratio is B/A)")
    for p in prompts:
        ref = None
        for _ in range(warmup):  # excluded from timing; also fixes the reference tokens
            for name in "AB":
                s = _sample(model, arms[name], p["text"], max_tokens, policy[name])
                ref = ref or s["tokens"]
                if s["tokens"] != ref:
                    raise AssertionError(f"{p['id']}: arm {name} output differs in warm-up")
        # the output once a prompt: every sample is checked equal to it (per-sample copies made
        # the record many times larger)
        rec = {"id": p["id"], "kind": p["kind"], "tokens": ref, "blocks": []}
        for b in range(blocks):
            order = "ABBA" if b % 2 == 0 else "BAAB"
            samples = {"A": [], "B": []}
            for name in order:
                s = _sample(model, arms[name], p["text"], max_tokens, policy[name])
                if s.pop("tokens") != ref:
                    raise AssertionError(f"{p['id']}: arm {name} output differs from the reference")
                samples[name].append(s)
            blk = {"order": order, "samples": samples}
            for metric in ("tok_s", "decode_tok_s"):
                blk[metric] = block_verdict([x[metric] for x in samples["A"]],
                                            [x[metric] for x in samples["B"]])
            ttft = [np.mean([x["ttft_s"] for x in samples[n]]) for n in "AB"]
            blk["ttft_change"] = float(ttft[1] / ttft[0] - 1.0)
            rec["blocks"].append(blk)
        for metric in ("tok_s", "decode_tok_s"):
            changes = [blk[metric]["change"] for blk in rec["blocks"]]
            rec[metric + "_change_median"] = float(np.median(changes))
            rec[metric + "_change_range"] = [float(min(changes)), float(max(changes))]
        rec["ttft_change_median"] = float(np.median([b["ttft_change"] for b in rec["blocks"]]))
        rec["verdicts"] = [b["tok_s"]["verdict"] for b in rec["blocks"]]
        rec["tokens_per_cycle"] = {n: float(np.mean([x["tokens_per_cycle"] for b in rec["blocks"] for x in b["samples"][n]])) for n in "AB"}
        per_prompt.append(rec)
        log(f"{p['id']:>18}  B/A tok/s x{1 + rec['tok_s_change_median']:.3f}  "
            f"decode x{1 + rec['decode_tok_s_change_median']:.3f}  "
            f"first token time x{1 + rec['ttft_change_median']:.3f}  "
            f"tok/cycle A {rec['tokens_per_cycle']['A']:.2f} B {rec['tokens_per_cycle']['B']:.2f}  "
            f"{','.join(rec['verdicts'])}")
    summary = {
        "geomean_tok_s_ratio": geomean([1 + r["tok_s_change_median"] for r in per_prompt]),
        "geomean_decode_tok_s_ratio": geomean([1 + r["decode_tok_s_change_median"] for r in per_prompt]),
        "geomean_ttft_ratio": geomean([1 + r["ttft_change_median"] for r in per_prompt]),
        "prompts_regressing": [r["id"] for r in per_prompt if "regression" in r["verdicts"]],
        "inconclusive_blocks": sum(v == "inconclusive" for r in per_prompt for v in r["verdicts"]),
    }
    return {"arms": arms, "max_tokens": max_tokens, "blocks": blocks, "warmup": warmup,
            "per_prompt": per_prompt, "summary": summary}


def summary_table(res: dict) -> str:
    """The run's one table: a row per prompt and their geometric mean, every ratio B/A, then
    each ratio's direction in words and the verdicts."""
    s, arms = res["summary"], res["arms"]
    rows = [[p["id"], f"x{1 + p['tok_s_change_median']:.3f}",
             f"x{1 + p['decode_tok_s_change_median']:.3f}", f"x{1 + p['ttft_change_median']:.3f}",
             f"{p['tokens_per_cycle']['A']:.2f}", f"{p['tokens_per_cycle']['B']:.2f}",
             ",".join(p["verdicts"])] for p in res["per_prompt"]]
    rows.append(["geometric mean", f"x{s['geomean_tok_s_ratio']:.3f}",
                 f"x{s['geomean_decode_tok_s_ratio']:.3f}", f"x{s['geomean_ttft_ratio']:.3f}",
                 "", "", ""])
    return "\n".join([
        f"A = {arm_text(arms['A'])}", f"B = {arm_text(arms['B'])}",
        table(["prompt", "B/A tok/s", "B/A decode tok/s", "B/A first-token time",
               "tok/cycle A", "tok/cycle B", "blocks"], rows),
        ratio_text("tokens/s", s["geomean_tok_s_ratio"]),
        ratio_text("decode tokens/s", s["geomean_decode_tok_s_ratio"]),
        ratio_text("time to first token", s["geomean_ttft_ratio"], time=True),
        f"prompts where B regressed: {', '.join(s['prompts_regressing']) or 'none'}; "
        f"inconclusive blocks (an arm's pair >5% apart): {s['inconclusive_blocks']}"])


def arm_speed(res: dict, arm: str, metric: str = "decode_tok_s") -> float:
    """The geometric mean over prompts of an arm's median `metric`: how fast the host ran that
    arm in the process (between processes it moves both arms, and their ratio with them)."""
    return geomean([np.median([x[metric] for b in p["blocks"] for x in b["samples"][arm]])
                    for p in res["per_prompt"]])


def across_processes(a) -> int:
    """The same A/B in `a.processes` fresh processes one after another: within a process the
    blocks cancel drift, between processes the host's state can move the verdict (on a shared
    2-core VM one off -> chain A/B read x0.82 to x1.13 within an hour), so the report is the
    spread of per-process verdicts, with each process's speed of arm A beside its ratio."""
    runs = []
    print(f"A = {arm_text(parse_arm(a.a))}\nB = {arm_text(parse_arm(a.b))}\n(every ratio is B/A)")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.processes):
            out = Path(tmp) / f"ab{i}.json"
            # the same command line, the last --processes and --out winning (argparse)
            cmd = [sys.executable, "-m", "sapwood", *a.argv, "--processes", "1", "--out", str(out)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:  # its own error message, then which process it was
                print(r.stderr[-2000:], end="", file=sys.stderr)
                print(f"sapwood: process {i + 1} of the A/B failed (exit {r.returncode})",
                      file=sys.stderr)
                return r.returncode
            runs.append(json.loads(out.read_text(encoding="utf-8")))
            s = runs[-1]["summary"]
            print(f"process {i + 1}/{a.processes}: B/A decode x{s['geomean_decode_tok_s_ratio']:.3f}, "
                  f"tok/s x{s['geomean_tok_s_ratio']:.3f}, arm A {arm_speed(runs[-1], 'A'):.0f} "
                  f"decode tok/s; regressing: {s['prompts_regressing'] or 'none'}", flush=True)
    dec = [r["summary"]["geomean_decode_tok_s_ratio"] for r in runs]
    tok = [r["summary"]["geomean_tok_s_ratio"] for r in runs]
    per_prompt, rows = [], []
    for i, p in enumerate(runs[0]["per_prompt"]):  # every process ran the same prompts in order
        ch = [r["per_prompt"][i]["decode_tok_s_change_median"] for r in runs]
        tpc = {n: float(np.mean([r["per_prompt"][i]["tokens_per_cycle"][n] for r in runs])) for n in "AB"}
        per_prompt.append({"id": p["id"], "decode_change_median": float(np.median(ch)),
                           "decode_change_range": [min(ch), max(ch)], "tokens_per_cycle": tpc})
        rows.append([p["id"], f"x{1 + np.median(ch):.3f}", f"[x{1 + min(ch):.3f}, x{1 + max(ch):.3f}]",
                     f"{tpc['A']:.2f}", f"{tpc['B']:.2f}"])
    summary = {
        "decode_ratio_median": float(np.median(dec)), "decode_ratio_range": [min(dec), max(dec)],
        "tok_s_ratio_median": float(np.median(tok)), "tok_s_ratio_range": [min(tok), max(tok)],
        "arm_a_decode_tok_s": [arm_speed(r, "A") for r in runs],
        "processes_b_faster": sum(d > 1.0 for d in dec),
        "per_prompt": per_prompt,  # decode change: median [range] over the processes
    }
    rows.append(["geometric mean", f"x{summary['decode_ratio_median']:.3f}",
                 f"[x{min(dec):.3f}, x{max(dec):.3f}]", "", ""])
    print(f"\nA = {arm_text(parse_arm(a.a))}\nB = {arm_text(parse_arm(a.b))}\n"
          f"medians and ranges over {a.processes} processes:\n"
          + table(["prompt", "B/A decode tok/s", "range", "tok/cycle A", "tok/cycle B"], rows))
    print(f"{ratio_text('decode tokens/s', summary['decode_ratio_median'])} (median of the "
          f"processes); {ratio_text('tokens/s', summary['tok_s_ratio_median'])} [x{min(tok):.3f}, "
          f"x{max(tok):.3f}]; B faster in {summary['processes_b_faster']} of {a.processes} processes")
    sha = dump_json({"processes": runs, "summary": summary}, a.out)
    print(f"raw JSON {a.out} sha256 {sha}")
    return 0


def main(a) -> int:
    import sapwood

    if a.processes < 1:
        raise ValueError(f"--processes must be at least 1, got {a.processes}")
    if a.processes > 1:
        return across_processes(a)
    model = sapwood.load(a.model, weights=a.weights, kv=a.kv, threads=a.threads,
                         max_context=a.max_context)
    prompts = load_cohort(a.cohort)[: a.prompts] if a.prompts else load_cohort(a.cohort)
    res = run_ab(model, parse_arm(a.a), parse_arm(a.b), prompts, max_tokens=a.max_tokens,
                 blocks=a.blocks, warmup=a.warmup)
    res.update(revision=source_revision(), model=model_identity(model), machine=machine(),
               protocol="ABBA/BAAB blocks; spread>5% inconclusive; pass if regression <= max(2%, 2*spread)")
    print("\n" + summary_table(res))
    sha = dump_json(res, a.out)
    print(f"raw JSON {a.out} sha256 {sha}")
    return 0
