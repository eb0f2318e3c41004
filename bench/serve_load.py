"""A bounded load test of `sapwood serve`: latency percentiles and aggregate tokens/s at 1, 2
and 4 slots, and what a chat's second turn saves by resuming from the first turn's snapshot.

    python bench/serve_load.py [--model default] [--slots 1 2 4] [--clients 4] [--requests 32]
                               [--max-tokens 64] [--time-limit 120] [--out serve_load.json]

Each slot count gets a fresh server in this process (uvicorn in a thread, a free loopback
port) and the same requests: the frozen cohort's prompts in turn, greedy, sent by `--clients`
threads over HTTP (streamed, so time to first token is the first content event). Every
response's tokens are checked against the same request run alone (Model.generate,
verify="off"): exactness holds whatever the slots. Caps: --requests per slot count,
--time-limit seconds per slot count (requests not started by then are not sent, and the run
says so). Every engine runs --threads threads (default 1) at every slot count, so the slot
counts compare the same engines; on a shared, loaded machine a pool of several threads waits
for whichever of them is descheduled.

The reuse saving: a conversation of two turns whose first prompt is --turn-tokens long, the
second turn sent to a server with the snapshot cache and to one without (--cache-mb 0),
alternating ABBA; reported: the second turn's time to first token and its prefilled tokens.
Memory: the engines' own count of their weights, once per copy (the slots are new_sequence()s
of slot 0's model and share its weights, docs/server.md).

--batch: whether the decoding slots' verify rounds run in one forward (server.build's
batch_verify); "both" runs each slot count off, on, on, off (ABBA) and reports every run.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

import sapwood
from sapwood import server

COHORT = Path(__file__).with_name("cohort.json")


def stream_request(url, model_id, body):
    """(seconds to the first content event, seconds in all, token ids, the sapwood field)."""
    t0 = time.perf_counter()
    first, ext = None, None
    body = {**body, "model": model_id, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices") and ev["choices"][0].get("text") and first is None:
                first = time.perf_counter() - t0
            if "usage" in ev:
                ext = ev["sapwood"]
    total = time.perf_counter() - t0
    return first if first is not None else total, total, ext["choices"][0]["token_ids"], ext


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def run_load(a, slots, bodies, want, batch=True):
    st = server.build(a.model, parallel=slots, max_context=a.max_context, cache_mb=0,
                      max_queue=max(64, a.requests), model_id="bench", threads=a.threads,
                      drafter=a.drafter, batch_verify=batch)
    copies = []  # one model per copy of weights
    for m in _slot_models(st):
        if not any(m.engine.shares_weights(c.engine) for c in copies):
            copies.append(m)
    weights = sum(m.engine.memory()["weights_bytes"] for m in copies) / 2 ** 20
    batcher = st.scheduler.slots[0].batcher
    live = server.start(st)
    deadline = time.monotonic() + a.time_limit
    try:
        # warm-up: one request per slot, not timed
        with ThreadPoolExecutor(slots) as pool:
            list(pool.map(lambda b: stream_request(live.url, "bench", b), bodies[:slots]))

        def one(i):
            if time.monotonic() > deadline:
                return None
            return i, stream_request(live.url, "bench", bodies[i])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.clients) as pool:
            done = [r for r in pool.map(one, range(len(bodies))) if r is not None]
        wall = time.perf_counter() - t0
    finally:
        live.close()
    bad = [i for i, (_, _, toks, _) in done if toks != want[i]]
    tokens = sum(len(toks) for _, (_, _, toks, _) in done)
    lat = [r[1] for _, r in done]
    ttft = [r[0] for _, r in done]
    return dict(slots=slots, requests=len(done), skipped=len(bodies) - len(done), wall_s=wall,
                tokens=tokens, tokens_per_s=tokens / wall,
                latency_s={q: pct(lat, q) for q in (50, 90, 99)},
                ttft_s={q: pct(ttft, q) for q in (50, 90, 99)},
                mismatches=bad, weights_mb=weights, batch=batcher is not None,
                trees_per_forward=(batcher.sequences / batcher.forwards
                                   if batcher is not None and batcher.forwards else None))


def _slot_models(st):
    for s in st.scheduler.slots:
        yield s.model
        if s.draft_model is not None:
            yield s.draft_model


def reuse_saving(a, cohort):
    text = "".join(p["text"] for p in cohort)
    arms = {}
    for name, mb in (("reuse", 256), ("no_reuse", 0)):
        st = server.build(a.model, parallel=1, max_context=a.max_context, cache_mb=mb,
                          model_id="bench", threads=a.threads, drafter=a.drafter)
        arms[name] = (st, server.start(st))
    tok = arms["reuse"][0].model
    ids = (tok.encode(text) * (a.turn_tokens // max(1, len(tok.encode(text))) + 1))[:a.turn_tokens]
    rows = {"reuse": [], "no_reuse": []}
    try:
        for rep, order in enumerate((("reuse", "no_reuse"), ("no_reuse", "reuse")) * a.turn_reps):
            for name in order:
                live = arms[name][1]
                p1 = ids[:a.turn_tokens - rep]  # a new conversation each time: no earlier snapshot
                body = {"prompt": p1, "max_tokens": 32, "temperature": 0,
                        "sapwood": {"return_token_ids": True}}
                _, _, t1, _ = stream_request(live.url, "bench", body)
                p2 = p1 + t1 + tok.encode("\nNext question: and the other case?\n")
                first, total, t2, ext = stream_request(live.url, "bench", {**body, "prompt": p2})
                c = ext["choices"][0]
                rows[name].append(dict(ttft_s=first, total_s=total, prefill_s=c["stats"]["prefill_s"],
                                       prefilled=c["prefilled_tokens"], cached=c["cached_tokens"],
                                       prompt=len(p2), tokens=t2))
    finally:
        for st, live in arms.values():
            live.close()
    same = all(r["tokens"] == s["tokens"] for r, s in zip(rows["reuse"], rows["no_reuse"]))
    out = {}
    for name, rs in rows.items():
        out[name] = dict(prompt_tokens=rs[0]["prompt"],
                         prefilled_tokens=statistics.median(r["prefilled"] for r in rs),
                         ttft_ms=statistics.median(r["ttft_s"] for r in rs) * 1e3,
                         prefill_ms=statistics.median(r["prefill_s"] for r in rs) * 1e3,
                         ttft_ms_range=[min(r["ttft_s"] for r in rs) * 1e3,
                                        max(r["ttft_s"] for r in rs) * 1e3])
    out["outputs_equal"] = same
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--drafter", default=None, help="as sapwood serve --drafter")
    ap.add_argument("--slots", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=120, help="seconds per slot count")
    ap.add_argument("--threads", type=int, default=1,
                    help="engine threads per slot (0: the engine's default, every core, per slot)")
    ap.add_argument("--turn-tokens", type=int, default=1024)
    ap.add_argument("--turn-reps", type=int, default=2, help="ABBA blocks of the reuse test")
    ap.add_argument("--batch", choices=("on", "off", "both"), default="off",
                    help="verify rounds of the slots in one forward (both: ABBA per slot count)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not (1 <= a.clients <= 64 and 1 <= a.requests <= 1000 and 0 < a.time_limit <= 1800):
        ap.error("caps: 1 <= clients <= 64, 1 <= requests <= 1000, 0 < time-limit <= 1800")
    cohort = json.loads(COHORT.read_text())["prompts"]
    bodies = [{"prompt": cohort[i % len(cohort)]["text"], "max_tokens": a.max_tokens,
               "temperature": 0, "sapwood": {"return_token_ids": True}} for i in range(a.requests)]
    rev = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    print(f"sapwood serve load test at {rev}, {platform.processor() or platform.machine()}, "
          f"model {a.model} (drafter {a.drafter or 'its own'}), {a.clients} clients, {a.requests} requests of {a.max_tokens} tokens "
          f"(greedy, verify auto, streamed), {a.threads} engine thread(s) per slot")
    ref = sapwood.load(a.model, max_context=a.max_context, threads=a.threads)
    solo = {}
    for b in bodies:  # each request alone: what every response must equal
        if b["prompt"] not in solo:
            solo[b["prompt"]] = ref.generate(b["prompt"], max_tokens=a.max_tokens,
                                             verify="off").tokens
    want = [solo[b["prompt"]] for b in bodies]
    del ref
    print(f"{'slots':>5} {'batch':>5} {'req':>4} {'tok/s':>7} {'lat p50':>8} {'p90':>7} {'p99':>7} "
          f"{'ttft p50':>9} {'p90':>7} {'weights MB':>10} {'trees/fwd':>9}")
    results = []
    arms = {"on": [True], "off": [False], "both": [False, True, True, False]}[a.batch]
    for slots in a.slots:
        for batch in (arms if slots > 1 else [False]):
            r = run_load(a, slots, bodies, want, batch)
            results.append(r)
            tpf = f"{r['trees_per_forward']:>9.2f}" if r["trees_per_forward"] else f"{'-':>9}"
            print(f"{slots:>5} {'on' if r['batch'] else 'off':>5} {r['requests']:>4} {r['tokens_per_s']:>7.1f} "
                  f"{r['latency_s'][50] * 1e3:>6.0f}ms {r['latency_s'][90] * 1e3:>5.0f}ms "
                  f"{r['latency_s'][99] * 1e3:>5.0f}ms {r['ttft_s'][50] * 1e3:>7.0f}ms "
                  f"{r['ttft_s'][90] * 1e3:>5.0f}ms {r['weights_mb']:>10.1f} {tpf}"
                  + (f"  ({r['skipped']} not sent: time limit)" if r["skipped"] else "")
                  + (f"  MISMATCH in {r['mismatches']}" if r["mismatches"] else ""))
    reuse = reuse_saving(a, cohort)
    print(f"\nsecond chat turn ({reuse['reuse']['prompt_tokens']}-token prompt, first turn "
          f"{a.turn_tokens} tokens + 32 generated), median of {2 * a.turn_reps} (ABBA):")
    for name in ("reuse", "no_reuse"):
        x = reuse[name]
        print(f"  {name:>8}: {x['prefilled_tokens']:>5.0f} tokens prefilled, time to first token "
              f"{x['ttft_ms']:.1f} ms (range {x['ttft_ms_range'][0]:.1f}-{x['ttft_ms_range'][1]:.1f}),"
              f" prefill {x['prefill_ms']:.1f} ms")
    print(f"  outputs equal with and without reuse: {reuse['outputs_equal']}")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(revision=rev, args=vars(a), load=results,
                                               reuse=reuse, python=sys.version), indent=1))
    bad = any(r["mismatches"] for r in results) or not reuse["outputs_equal"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
