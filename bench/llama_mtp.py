"""llama.cpp's own MTP speculation (`--spec-type draft-mtp`) on a checkpoint converted with its
converter keeping the head (scripts/convert_gguf.py --keep-mtp), beside its plain decoding, on
the frozen held-out prompts: bench/results/xeon_amx/mtp.md sets it beside sapwood's drafter="mtp".

    python bench/llama_mtp.py GGUF [--prompts 8] [--max-tokens 64] [--n-max 1 3] \
        [--temperature 0.0] [--threads 2] [--out llama_mtp.json]

Arms: plain (llama-completion's eval rate) and draft-mtp with each --spec-draft-n-max
(llama-speculative-simple's decode rate, its drafted and accepted counts). Per prompt the arms
run back to back, in forward order on even prompts and reversed on odd ones; speeds are medians
with ranges over prompts. Rounds are counted from the summary (each round emits its accepted
drafts plus one token: rounds = n_predict - n_accept); each is one target forward unless
llama.cpp says it "will use checkpoints" (a context without partial removal re-evaluates the
kept prefix after a partial acceptance), which is recorded. Sampling: T with no top-k, top-p or
min-p, as sapwood's T=0.8 arms.

Both run with --no-repack: on this AMX host ggml's AMX q8_0 kernels stop on an illegal
instruction (tilezero before a tile configuration), and -nr keeps the weights in the plain
CPU buffer.

LLAMA_BUILD (default /work/llama.cpp-build) as bench/llama_bench.py finds it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
from pathlib import Path

import sapwood
from sapwood.benchmarks.common import dump_json, source_revision

BUILD = Path(os.environ.get("LLAMA_BUILD", "/work/llama.cpp-build"))


def tool(name: str) -> Path:
    hits = [p for p in (BUILD / "bin" / name, BUILD / "build" / "bin" / name) if p.is_file()]
    if not hits:
        raise SystemExit(f"no {name} under {BUILD} (build llama.cpp there first)")
    return hits[0]


def _num(pattern: str, text: str, what: str) -> float:
    m = re.search(pattern, text)
    if m is None:
        raise RuntimeError(f"no {what} in llama.cpp's output:\n{text[-3000:]}")
    return float(m.group(1))


def _run(cmd: list, summary: str) -> str:
    """stdout + stderr of cmd. llama.cpp logs from a thread of its own; now and then a run that
    exits 0 ends before that thread has written the summary: such a run is made again (at most
    twice more), its timing with it."""
    for _ in range(3):
        out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900)
        text = out.stdout + out.stderr
        if out.returncode:
            raise RuntimeError(f"{cmd[0]} failed ({out.returncode}):\n{text[-3000:]}")
        if summary in out.stderr:
            return text
    raise RuntimeError(f"{cmd[0]}: no '{summary}' in three runs:\n{text[-3000:]}")


def run_plain(gguf, prompt, a) -> dict:
    text = _run([tool("llama-completion"), "-m", gguf, "-p", prompt, "-n", a.max_tokens, *_sampling(a),
                 "-t", a.threads, "-c", "2048", "--ignore-eos", "-no-cnv", "-nr"], "total time")
    return {"decode_tok_s": _num(r"(?<!prompt )eval time\s*=.*?([\d.]+) tokens per second", text,
                                 "eval rate")}


def _sampling(a) -> list:
    return ["--temp", str(a.temperature), "--seed", "1", "--top-k", "1" if a.temperature == 0 else "0",
            "--top-p", "1.0", "--min-p", "0.0"]


def run_mtp(gguf, prompt, n_max, a) -> dict:
    text = _run([tool("llama-speculative-simple"), "-m", gguf, "-p", prompt, "-n", a.max_tokens,
                 *_sampling(a), "-t", a.threads, "-c", "2048", "--spec-type", "draft-mtp",
                 "--spec-draft-n-max", n_max, "-nr"], "n_accept")
    n_predict = int(_num(r"n_predict\s*=\s*(\d+)", text, "n_predict"))
    n_accept = int(_num(r"n_accept\s*=\s*(\d+)", text, "n_accept"))
    n_drafted = int(_num(r"n_drafted\s*=\s*(\d+)", text, "n_drafted"))
    rounds = n_predict - n_accept
    return {"decode_tok_s": _num(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+)", text,
                                 "decode rate"),
            "n_predict": n_predict, "n_accept": n_accept, "n_drafted": n_drafted, "rounds": rounds,
            "uses_checkpoints": "will use checkpoints" in text,
            "tokens_per_round": n_predict / rounds if rounds else 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--n-max", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="llama_mtp.json")
    a = ap.parse_args(argv)
    prompts = json.loads(Path(sapwood.__file__).with_name("benchmarks")
                         .joinpath("heldout_prompts.json").read_text())["prompts"][:a.prompts]
    arms = ["plain"] + [f"mtp{n}" for n in a.n_max]
    res = {arm: [] for arm in arms}
    load = [os.getloadavg()]
    for i, p in enumerate(prompts):
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            r = run_plain(a.gguf, p["text"], a) if arm == "plain" else \
                run_mtp(a.gguf, p["text"], int(arm[3:]), a)
            res[arm].append(r)
    load.append(os.getloadavg())
    out = {"revision": source_revision(), "gguf": str(a.gguf), "llama_build": str(BUILD),
           "temperature": a.temperature, "max_tokens": a.max_tokens, "threads": a.threads,
           "prompts": [p["id"] for p in prompts], "loadavg": {"start": load[0], "end": load[1]},
           "runs": res, "rows": []}
    print(f"load average (1, 5, 15 min) at start {load[0]}, at end {load[1]}")
    for arm in arms:
        tps = [r["decode_tok_s"] for r in res[arm]]
        row = {"arm": arm, "decode_tok_s_median": statistics.median(tps),
               "decode_tok_s_range": [min(tps), max(tps)]}
        if arm != "plain":
            tot = {k: sum(r[k] for r in res[arm]) for k in ("n_predict", "n_accept", "n_drafted", "rounds")}
            row.update(tot, tokens_per_round=tot["n_predict"] / tot["rounds"],
                       accept_rate=tot["n_accept"] / max(1, tot["n_drafted"]),
                       uses_checkpoints=any(r["uses_checkpoints"] for r in res[arm]))
        out["rows"].append(row)
        extra = (f"  tokens/round {row['tokens_per_round']:.2f}  accepted {row['accept_rate']:.2f} "
                 f"of drafted  checkpoints {row['uses_checkpoints']}" if arm != "plain" else "")
        print(f"T={a.temperature:.1f} {arm:>6}  decode {row['decode_tok_s_median']:7.1f} tok/s "
              f"[{min(tps):.0f}, {max(tps):.0f}]{extra}", flush=True)
    print(f"raw JSON {a.out} sha256 {dump_json(out, a.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
