"""The engine's speed table of issue 37 against the roofs this run measures itself, on
bench/realistic.py's random 0.65B Qwen3.5 shape, per weight format and kernel variant (ISA),
with llama.cpp beside it when it is built (bench/llama_bench.py).

    python bench/engine_table.py [--weights q8 q4] [--isa amx avx512] [--contexts 64 4096 32768]
                                 [--reps 6] [--json out.json]

Rows: decode step (verify of one token) at each context against the memory floor (bytes a
step reads / read bandwidth, both measured here, paired per block); verify(1) against
verify(2) (a chain of two); verify(16) (a 16-node tree) against its roof, max(bytes / bandwidth,
multiply-adds / int8 peak), the peak from the variant's own register-only microkernel
(`_core.int8_peak`); 16-row tree attention at 4K and 32K against its roof and one row; prefill
of a 4K prompt (tok/s); decode tokens/s beside one competing CPU-bound process over quiet.
Beside llama.cpp (llama-bench on GGUFs of the same weights, the first ISA's engine): decode,
16 tokens at once and the prefill prompt, the two engines' runs alternated ABBA block by
block, with sapwood / llama.cpp per block.

Protocol (a shared host): every arm of a section is timed once per block, the order of the
arms reversed on odd blocks (ABBA), ISAs interleaved inside the block; medians and ranges over
blocks; ratios are taken per block then summarised. The load average is recorded before and
after each section. "Quiet" means no competitor of ours, not an idle host. Cost: one engine
(~0.7 GB q8 + KV) at a time, the random weights (2.6 GB of float32), and a few minutes per
format; 32K contexts are filled with synthetic K/V (Engine.fill_synthetic) as realistic.py does.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_bench  # noqa: E402  (bench/llama_bench.py)
from realistic import SHAPE, random_weights, step_bytes  # noqa: E402

from sapwood import _core  # noqa: E402

# --smoke: the whole command at a toy size (tests/test_bench_smoke.py); its timings mean nothing
TINY = dict(SHAPE, vocab_size=512, hidden_size=64, intermediate_size=128,
            layer_is_attention=[False, False, False, True], num_heads=2, num_kv_heads=1,
            head_dim=32, rotary_dim=16, hk=2, dk=16, hv=2, dv=16)


def load_avg() -> list[float]:
    return list(os.getloadavg())


def summ(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def abba(arms: dict, blocks: int, isas: list[str], extra=None, warm=True) -> dict:
    """{(isa, arm): [seconds per block]}: each block times every arm once under every ISA,
    the order reversed on odd blocks; extra(block) runs once per block first (bandwidth)."""
    keys = [(i, a) for a in arms for i in isas]
    out = {k: [] for k in keys}
    for isa in isas if warm else []:  # warm-up under each variant, not timed
        _core.set_isa(isa)
        for f in arms.values():
            f()
    for b in range(blocks):
        if extra:
            extra(b)
        for isa, arm in (keys if b % 2 == 0 else keys[::-1]):
            _core.set_isa(isa)
            out[(isa, arm)].append(timed(arms[arm]))
    return out


def matmul_macs(weights: dict) -> int:
    """Multiply-adds of one row through every matrix (the tied embedding once, as the head)."""
    return sum(v.size for v in weights.values() if v.ndim == 2)


def attn_macs(shape: dict, rows: int, ctx: int) -> int:
    """QK and PV multiply-adds of `rows` query rows over ctx positions, every attention layer."""
    return 2 * rows * ctx * shape["num_heads"] * shape["head_dim"] * sum(shape["layer_is_attention"])


def bench_steps(eng, shape, weights, ctx: int, isas, blocks: int, peaks: dict, rng) -> dict:
    """Decode step, verify(2), verify(16) at one context; floors and roofs per block."""
    eng.reset()
    eng.prefill(rng.integers(0, shape["vocab_size"], min(64, ctx)))
    if ctx > eng.position:
        eng.fill_synthetic(ctx - eng.position, 7)
    toks = rng.integers(0, shape["vocab_size"], 16)
    tree16 = np.array([-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, 16)])
    arms = {"verify1": lambda: eng.verify(toks[:1], [-1]),
            "verify2": lambda: eng.verify(toks[:2], [-1, 0]),
            "verify16": lambda: eng.verify(toks, tree16)}
    bws = []
    t = abba(arms, blocks, isas, extra=lambda b: bws.append(_core.read_bandwidth(1 << 29, 0, 1)))
    nbytes = step_bytes(eng, ctx, shape)
    macs16 = 16 * matmul_macs(weights) + attn_macs(shape, 16, ctx)
    res = {"ctx": ctx, "step_bytes": nbytes, "read_GBps": summ([b / 1e9 for b in bws]),
           "verify16_macs": macs16, "isa": {}}
    for isa in isas:
        v1, v2, v16 = (t[(isa, a)] for a in ("verify1", "verify2", "verify16"))
        floor = [nbytes / bw for bw in bws]
        roof16 = [max(nbytes / bw, macs16 / peaks[isa]) for bw in bws]
        res["isa"][isa] = {
            "verify1_ms": summ([1e3 * x for x in v1]), "verify2_ms": summ([1e3 * x for x in v2]),
            "verify16_ms": summ([1e3 * x for x in v16]),
            "floor_ms": summ([1e3 * f for f in floor]),
            "decode_of_floor": summ([f / x for f, x in zip(floor, v1)]),
            "verify1_over_verify2": summ([a / b for a, b in zip(v1, v2)]),
            "verify16_over_verify1": summ([a / b for a, b in zip(v16, v1)]),
            "verify16_roof_ms": summ([1e3 * r for r in roof16]),
            "verify16_of_roof": summ([r / x for r, x in zip(roof16, v16)])}
    return res


def bench_attention(shape, ctxs, isas, blocks: int, peaks: dict, bw: float) -> dict:
    """16-row tree attention (the shape's heads, one layer) over ctx int8 positions, and 1 row."""
    rng = np.random.default_rng(3)
    n_q, n_kv, d, rows = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"], 16
    out = {}
    for ctx in ctxs:
        pool = _core.KVPagePool(num_pages=ctx // 64 + 2, page_size=64, n_kv_heads=n_kv, head_dim=d)
        seq = _core.KVSequence(pool)
        for a in range(0, ctx, 4096):
            x = rng.standard_normal((min(4096, ctx - a), n_kv, d)).astype(np.float32)
            seq.append(x, x)
        parents = np.array([-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, rows)])
        q = rng.standard_normal((rows, n_q, d)).astype(np.float32)
        k = rng.standard_normal((rows, n_kv, d)).astype(np.float32)
        arms = {"rows16": lambda: _core.tree_attention(seq, q, k, k, parents),
                "rows1": lambda: _core.tree_attention(seq, q[:1], k[:1], k[:1], parents[:1])}
        t = abba(arms, blocks, isas)
        nbytes = ctx * n_kv * 2 * (d + 4 * d // 32)  # int8 K and V, a float scale per 32
        macs = 2 * rows * ctx * n_q * d
        r = {"bytes": nbytes, "macs": macs, "isa": {}}
        for isa in isas:
            t16, t1 = t[(isa, "rows16")], t[(isa, "rows1")]
            roof = max(nbytes / bw, macs / peaks[isa])
            r["isa"][isa] = {"rows16_ms": summ([1e3 * x for x in t16]),
                             "rows1_ms": summ([1e3 * x for x in t1]),
                             "rows16_over_rows1": summ([a / b for a, b in zip(t16, t1)]),
                             "roof_ms": 1e3 * roof, "of_roof": summ([roof / x for x in t16])}
        out[ctx] = r
    return out


def bench_prefill(eng, shape, n: int, isas, reps: int, rng) -> dict:
    prompt = rng.integers(0, shape["vocab_size"], n)

    def run():
        eng.reset()
        eng.prefill(prompt)
    eng.reset()
    eng.prefill(prompt[:64])  # warm-up: a short prompt (a long one's rows are its own warm-up)
    t = abba({"prefill": run}, reps, isas, warm=False)
    return {isa: summ([n / x for x in t[(isa, "prefill")]]) for isa in isas}


def decode_tok_s(eng, snap, tokens: int) -> float:
    """Plain decoding of `tokens` steps (verify one token, commit it) from the snapshot."""
    eng.restore(snap)
    t = time.perf_counter()
    tok = 1
    for _ in range(tokens):
        tok = int(np.argmax(eng.verify([tok], [-1])[0]))
        eng.commit([0])
    return tokens / (time.perf_counter() - t)


class Competitor:
    """One CPU-bound process of ours (a Python busy loop) for the duration of a with-block."""
    def __enter__(self):
        self.p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.05)  # let it start
        return self

    def __exit__(self, *exc):
        self.p.kill()
        self.p.wait()


def bench_load(eng, shape, isas, blocks: int, tokens: int, rng) -> dict:
    """Decode tok/s quiet and beside one competitor, alternated Q L L Q per block and ISA."""
    eng.reset()
    eng.prefill(rng.integers(0, shape["vocab_size"], 64))
    snap = eng.snapshot()
    res = {isa: {"quiet": [], "loaded": []} for isa in isas}
    for isa in isas:
        _core.set_isa(isa)
        decode_tok_s(eng, snap, 4)  # warm-up
    for b in range(blocks):
        for isa in (isas if b % 2 == 0 else isas[::-1]):
            _core.set_isa(isa)
            for arm in ("quiet", "loaded", "loaded", "quiet"):
                if arm == "loaded":
                    with Competitor():
                        res[isa][arm].append(decode_tok_s(eng, snap, tokens))
                else:
                    res[isa][arm].append(decode_tok_s(eng, snap, tokens))
    out = {}
    for isa, r in res.items():
        q, l = r["quiet"], r["loaded"]
        # per block: the mean of its two loaded runs over the mean of its two quiet ones
        ratios = [(l[2 * i] + l[2 * i + 1]) / (q[2 * i] + q[2 * i + 1]) for i in range(blocks)]
        out[isa] = {"quiet_tok_s": summ(q), "loaded_tok_s": summ(l), "loaded_over_quiet": summ(ratios)}
    return out


def bench_side_by_side(eng, shape, tools, gguf: Path, isa: str, threads: int, blocks: int,
                       prefill: int, load_blocks: int, rng) -> dict:
    """sapwood (kernel variant `isa`) and llama-bench on the same weights, arm by arm: per block
    sapwood, llama, llama, sapwood (reversed on odd blocks) for decode (32 tokens after 64),
    16 tokens at once after 64 (pp16), a `prefill`-token prompt; tok/s and sapwood / llama per
    block. llama.cpp's own loaded / quiet (Q L L Q blocks) beside sapwood's load row. 32K is
    left out: llama-bench prefills the depth again for every run (minutes here)."""
    _core.set_isa(isa)
    eng.reset()
    eng.prefill(rng.integers(0, shape["vocab_size"], 64))
    snap = eng.snapshot()
    p16 = rng.integers(0, shape["vocab_size"], 16)
    big = rng.integers(0, shape["vocab_size"], prefill)

    def sw_pp16():
        eng.restore(snap)
        return 16 / timed(lambda: eng.prefill(p16))

    def sw_prefill():
        eng.reset()
        return prefill / timed(lambda: eng.prefill(big))

    def llama(**kw):
        return lambda: statistics.median(
            llama_bench.llama_bench(tools, gguf, threads, reps=1, **kw)["samples_tok_s"])
    tests = {"decode_d64": (lambda: decode_tok_s(eng, snap, 32), llama(gen=32, depth=64)),
             "pp16_d64": (sw_pp16, llama(prompt=16, depth=64)),
             "prefill": (sw_prefill, llama(prompt=prefill))}
    out = {"gguf": str(gguf), "isa": isa}
    for name, (sw, ll) in tests.items():
        s_tok, l_tok, ratios = [], [], []
        for b in range(blocks if name != "prefill" else max(1, blocks // 2)):
            order = [sw, ll, ll, sw] if b % 2 == 0 else [ll, sw, sw, ll]
            got = [(f is sw, f()) for f in order]
            s2 = [t for is_sw, t in got if is_sw]
            l2 = [t for is_sw, t in got if not is_sw]
            s_tok += s2
            l_tok += l2
            ratios.append(sum(s2) / sum(l2))
        out[name] = {"sapwood_tok_s": summ(s_tok), "llama_tok_s": summ(l_tok),
                     "sapwood_over_llama": summ(ratios)}
    quiet, loaded = [], []
    tg = llama(gen=32, depth=64)
    for _ in range(load_blocks):  # Q L L Q
        quiet.append(tg())
        for _ in range(2):
            with Competitor():
                loaded.append(tg())
        quiet.append(tg())
    out["llama_loaded_over_quiet"] = summ([(loaded[2 * i] + loaded[2 * i + 1]) / (quiet[2 * i] + quiet[2 * i + 1])
                                           for i in range(load_blocks)])
    return out


def fmt_range(s: dict, scale=1.0, digits=1) -> str:
    return f"{s['median'] * scale:.{digits}f} [{s['min'] * scale:.{digits}f}, {s['max'] * scale:.{digits}f}]"


def print_table(out: dict) -> None:
    isas = out["isas"]
    print(f"\nhost: {out['host']['cpu']} ({' '.join(out['host']['flags'])}), revision "
          f"{out['host']['revision']}; {out['threads']} threads; load average "
          f"{out['load_start'][0]:.1f} at start, {out['load_end'][0]:.1f} at end")
    for isa in isas:
        print(f"  {isa}: int8 peak {out['int8_peak_GMACps'][isa]['max']:.0f} GMAC/s "
              f"(runs {', '.join(f'{x:.0f}' for x in out['int8_peak_GMACps'][isa]['runs'])})")
    print("  median [range] over blocks; ratios per block; X/roof: the roof's time over the "
          "measured one (1.0 = at the roof)")
    for fr in out["formats"]:
        print(f"\n{fr['weights']}: weights {fr['weights_bytes'] / 1e6:.0f} MB")
        print(f"{'':34}" + "".join(f"{c:>30}" for c in isas))

        def row(label, cells):
            print(f"{label:34}" + "".join(f"{c:>30}" for c in cells))
        for s in fr["steps"]:
            c = s["ctx"]
            row(f"decode step ms @{c}", [fmt_range(s["isa"][i]["verify1_ms"]) for i in isas])
            row(f"  floor ms ({s['read_GBps']['median']:.1f} GB/s)", [fmt_range(s["isa"][i]["floor_ms"]) for i in isas])
            row("  floor / step", [fmt_range(s["isa"][i]["decode_of_floor"], digits=2) for i in isas])
            row(f"verify(1) / verify(2) @{c}", [fmt_range(s["isa"][i]["verify1_over_verify2"], digits=2) for i in isas])
            row(f"verify(16) ms @{c}", [fmt_range(s["isa"][i]["verify16_ms"]) for i in isas])
            row("  / decode step", [fmt_range(s["isa"][i]["verify16_over_verify1"], digits=2) for i in isas])
            row("  roof / verify(16)", [fmt_range(s["isa"][i]["verify16_of_roof"], digits=2) for i in isas])
        row(f"prefill {out['prefill_tokens']} tok/s", [fmt_range(fr["prefill_tok_s"][i], digits=0) for i in isas])
        row("decode tok/s quiet", [fmt_range(fr["load"][i]["quiet_tok_s"], digits=1) for i in isas])
        row("  beside 1 busy process", [fmt_range(fr["load"][i]["loaded_tok_s"], digits=1) for i in isas])
        row("  loaded / quiet", [fmt_range(fr["load"][i]["loaded_over_quiet"], digits=2) for i in isas])
        ll = fr.get("llama")
        if isinstance(ll, dict):
            print(f"\n{fr['weights']} beside llama.cpp ({ll['isa']}; arms alternated ABBA, tok/s)")
            print(f"{'':34}" + "".join(f"{c:>30}" for c in ("sapwood", "llama.cpp", "sapwood / llama.cpp")))
            for name, label in (("decode_d64", "decode @64"), ("pp16_d64", "16 tokens at once @64"),
                                ("prefill", f"prefill {out['prefill_tokens']}")):
                r = ll[name]
                row(label, [fmt_range(r["sapwood_tok_s"]), fmt_range(r["llama_tok_s"]),
                            fmt_range(r["sapwood_over_llama"], digits=2)])
            row("llama.cpp loaded / quiet", ["", fmt_range(ll["llama_loaded_over_quiet"], digits=2), ""])
        elif ll:
            print(f"\nllama.cpp: {ll}")
    print(f"\ntree attention, 16 rows (a tree) over int8 K/V, {out['attention_heads']}; roof: "
          "max(bytes / read bandwidth, multiply-adds / int8 peak)")
    print(f"{'':34}" + "".join(f"{c:>30}" for c in isas))
    for c, a in out["attention"].items():
        print(f"{f'16 rows ms @{c}':34}" + "".join(f"{fmt_range(a['isa'][i]['rows16_ms'], digits=2):>30}" for i in isas))
        print(f"{'  / 1 row':34}" + "".join(f"{fmt_range(a['isa'][i]['rows16_over_rows1'], digits=2):>30}" for i in isas))
        print(f"{'  roof / measured':34}" + "".join(f"{fmt_range(a['isa'][i]['of_roof'], digits=2):>30}" for i in isas))
    if out.get("llama") != "run":
        print(f"\nllama.cpp: {out.get('llama')}")


def host_info() -> dict:
    cpu, flags = "?", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "?":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = [f for f in line.split(":", 1)[1].split()
                         if f.startswith(("avx", "amx", "fma"))]
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        rev = "?"
    return {"cpu": cpu, "flags": flags, "cores": os.cpu_count(), "revision": rev}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", nargs="+", default=["q8", "q4"], choices=["q8", "q4", "bf16", "f32"])
    ap.add_argument("--isa", nargs="+", default=None,
                    help="kernel variants to interleave (default: the one in use)")
    ap.add_argument("--contexts", nargs="+", type=int, default=[64, 4096, 32768])
    ap.add_argument("--attention-contexts", nargs="+", type=int, default=[4096, 32768])
    ap.add_argument("--reps", type=int, default=6, help="blocks per section")
    ap.add_argument("--prefill", type=int, default=4096, help="prompt tokens of the prefill row")
    ap.add_argument("--prefill-reps", type=int, default=2)
    ap.add_argument("--load-reps", type=int, default=3, help="Q L L Q blocks of the load row")
    ap.add_argument("--load-tokens", type=int, default=32)
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp out even if built")
    ap.add_argument("--llama-reps", type=int, default=4,
                    help="ABBA blocks of the side-by-side rows (the prefill row: half)")
    ap.add_argument("--gguf-dir", type=Path, default=Path("/tmp/sapwood_engine_table_gguf"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="a toy shape, no llama.cpp (tests)")
    a = ap.parse_args(argv)
    isas = a.isa or [_core.isa()]
    for isa in isas:
        if isa not in _core.available_isas():
            ap.error(f"--isa {isa}: not available here (available: {_core.available_isas()})")
    if min(a.contexts) < 1 or a.reps < 1 or a.prefill < 1:
        ap.error("contexts, --reps and --prefill must be positive")
    threads = _core.get_num_threads()
    out = {"host": host_info(), "threads": threads, "smoke": a.smoke, "isas": isas, "load_start": load_avg(),
           "prefill_tokens": a.prefill, "argv": sys.argv[1:], "formats": []}
    peaks = {i: [] for i in isas}
    for order in (isas, isas[::-1]):
        for isa in order:
            _core.set_isa(isa)
            peaks[isa].append(_core.int8_peak(threads, 0.2, 2))
    out["int8_peak_GMACps"] = {i: {"max": max(p) / 1e9, "runs": [x / 1e9 for x in p]} for i, p in peaks.items()}
    peak = {i: max(p) for i, p in peaks.items()}  # the roof: the best the instruction sustained
    shape = TINY if a.smoke else SHAPE
    weights = random_weights(shape)
    rng = np.random.default_rng(1)
    tools, out["llama"] = ((None, "not run: --no-llama or --smoke") if a.no_llama or a.smoke
                           else llama_bench.find_build())
    ggufs = {}
    if tools:
        try:
            ggufs = llama_bench.make_ggufs(tools, SHAPE, weights, a.gguf_dir)
            out["llama"] = "run"
        except (RuntimeError, subprocess.SubprocessError, OSError) as e:
            tools, out["llama"] = None, f"failed: {e}"
    for fmt in a.weights:
        eng = _core.Engine(shape, weights, fmt, "int8", max(a.contexts + [a.prefill]) + 64, 0)
        fr = {"weights": fmt, "weights_bytes": eng.memory()["weights_bytes"], "steps": []}
        for ctx in a.contexts:
            fr["steps"].append(bench_steps(eng, shape, weights, ctx, isas, a.reps, peak, rng))
            print(f"{fmt} steps @{ctx} done (load {load_avg()[0]:.1f})", file=sys.stderr)
        fr["prefill_tok_s"] = bench_prefill(eng, shape, a.prefill, isas, a.prefill_reps, rng)
        fr["load"] = bench_load(eng, shape, isas, a.load_reps, a.load_tokens, rng)
        if tools and fmt in ggufs:
            try:
                fr["llama"] = bench_side_by_side(eng, shape, tools, ggufs[fmt], isas[0], threads,
                                                 a.llama_reps, a.prefill, a.load_reps, rng)
            except (RuntimeError, subprocess.SubprocessError, OSError) as e:
                fr["llama"] = f"failed: {e}"
        fr["load_avg_after"] = load_avg()
        out["formats"].append(fr)
        del eng
    bw = statistics.median(s["read_GBps"]["median"] for f in out["formats"] for s in f["steps"]) * 1e9
    out["attention_heads"] = (f"{shape['num_heads']} query heads, {shape['num_kv_heads']} KV heads "
                              f"of dim {shape['head_dim']}, one layer")
    out["attention"] = bench_attention(shape, a.attention_contexts, isas, a.reps, peak, bw)
    out["load_end"] = load_avg()
    print_table(out)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=str))
        print(f"\nraw JSON: {a.json}")


if __name__ == "__main__":
    main()
