"""Two builds of sapwood's _core in one process, for kernel changes: q8/q4 matmuls of
bench/realistic.py's shapes and the engine's verify(1) / verify(2) / verify(16) on its random
0.65B checkpoint, timed in alternation (old new new old, then new old old new, ...), every
output checked bitwise equal between the builds.

    python bench/ab_cores.py OLD_CORE NEW_CORE [--isa amx avx512] [--weights q8 q4] [--blocks 8]
                             [--rows 1 2 16] [--no-engine] [--threads 1 --fastest]
                             [--attention 4096 32768]

--attention CTX...: instead, tree attention of --rows rows over CTX int8 positions (the shape's
heads, one layer, engine_table.py's bench_attention inputs). A change of numerics is allowed
there: the builds' outputs are compared by their largest difference, printed, not bitwise.

OLD_CORE / NEW_CORE: paths of built _core extension files (`_core.cpython-*.so`). Two pybind11
modules that register the same types must not share pybind11's internals: build one of them
with -DCMAKE_CXX_FLAGS=-DPYBIND11_INTERNALS_VERSION=99 (bench/ab_builds.py). Both share the
machine's cores but not their thread pools: each build's helper spins on for a while into the
other's turn, so read changes of a few percent as none.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from realistic import SHAPE, random_weights  # noqa: E402

MATRICES = {"up 3584x1024": (3584, 1024), "down 1024x3584": (1024, 3584),
            "head 151936x1024": (151936, 1024)}


def load_core(name: str, path: str):
    """The extension at `path` as module `name` (its init function is PyInit__core); the module
    already imported from that file if there is one (realistic.py imports sapwood._core: a
    second initialisation of one file would register its types twice)."""
    for mod in list(sys.modules.values()):
        if getattr(mod, "__file__", None) and Path(mod.__file__).resolve() == Path(path).resolve():
            return mod
    loader = importlib.machinery.ExtensionFileLoader(f"{name}._core", path)
    spec = importlib.util.spec_from_file_location(f"{name}._core", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def alternate(arms: dict, blocks: int, calls: int, fastest: bool = False) -> dict:
    """{(build, arm): [seconds per call, two a block]}, old new new old / new old old new; a
    sample is the mean of `calls` calls, or with `fastest` their minimum (a compute-bound
    kernel on a loaded host: preemption only ever adds time)."""
    out = {k: [] for k in arms}
    for f in arms.values():
        f()
    names = ["old", "new"]
    for blk in range(blocks):
        for arm in sorted({a for _, a in arms}):
            order = [names[0], names[1], names[1], names[0]]
            for b in (order if blk % 2 == 0 else order[::-1]):
                ts = []
                for _ in range(calls):
                    t = time.perf_counter()
                    arms[(b, arm)]()
                    ts.append(time.perf_counter() - t)
                out[(b, arm)].append(min(ts) if fastest else sum(ts) / calls)
    return out


def report(t: dict, label: str) -> list[str]:
    lines = []
    for arm in sorted({a for _, a in t}, key=str):
        old, new = t[("old", arm)], t[("new", arm)]
        # pairs of one block: the old's two samples against the new's two
        r = [(old[2 * i] + old[2 * i + 1]) / (new[2 * i] + new[2 * i + 1]) for i in range(len(old) // 2)]
        lines.append(f"{label} {arm}: old {1e3 * statistics.median(old):.3f} ms "
                     f"new {1e3 * statistics.median(new):.3f} ms; old/new x{statistics.median(r):.3f} "
                     f"[{min(r):.3f}, {max(r):.3f}] over {len(r)} blocks")
    return lines


def attention(cores: dict, isas, ctxs, rows_list, blocks: int, threads: int, lines: list) -> None:
    """Tree attention, old build against new, at each context and row count (threads 0: all)."""
    n_q, n_kv, d = SHAPE["num_heads"], SHAPE["num_kv_heads"], SHAPE["head_dim"]
    for ctx in ctxs:
        rng = np.random.default_rng(3)
        seqs = {}
        hist = [rng.standard_normal((min(4096, ctx - a), n_kv, d)).astype(np.float32)
                for a in range(0, ctx, 4096)]
        for b, c in cores.items():
            pool = c.KVPagePool(num_pages=ctx // 64 + 2, page_size=64, n_kv_heads=n_kv, head_dim=d)
            seq = c.KVSequence(pool)
            for x in hist:
                seq.append(x, x)
            seqs[b] = (pool, seq)
        big = max(rows_list)
        parents = np.array([-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, big)])
        q = rng.standard_normal((big, n_q, d)).astype(np.float32)
        k = rng.standard_normal((big, n_kv, d)).astype(np.float32)
        for isa in isas:
            for c in cores.values():
                c.set_isa(isa)
            arms = {}
            for rows in rows_list:
                p = parents[:rows] if rows > 1 else parents[:1]
                outs = {b: cores[b].tree_attention(seqs[b][1], q[:rows], k[:rows], k[:rows], p)
                        for b in cores}
                diff = float(np.abs(outs["old"] - outs["new"]).max())
                lines.append(f"{isa} attention ctx {ctx} rows {rows}: max |old - new| {diff:.3g}")
                for b in cores:
                    arms[(b, rows)] = (lambda b=b, rows=rows, p=p: cores[b].tree_attention(
                        seqs[b][1], q[:rows], k[:rows], k[:rows], p, threads=threads))
            print("\n".join(lines[-len(rows_list):]), flush=True)
            lines += report(alternate(arms, blocks, 3 if ctx <= 8192 else 1),
                            f"{isa} attention ctx {ctx} rows")
            print("\n".join(lines[-len(rows_list):]), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--isa", nargs="+", default=None)
    ap.add_argument("--weights", nargs="+", default=["q8"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 16])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="matmul threads (0: all)")
    ap.add_argument("--fastest", action="store_true",
                    help="matmul samples: the fastest of 20 calls (default: the mean of 10)")
    ap.add_argument("--smoke", action="store_true", help="one toy matrix, no engine (tests)")
    ap.add_argument("--attention", nargs="+", type=int, default=None, metavar="CTX")
    a = ap.parse_args(argv)
    cores = {"old": load_core("sapwood_old", a.old), "new": load_core("sapwood_new", a.new)}
    isas = a.isa or [cores["new"].isa()]
    rng = np.random.default_rng(0)
    lines = [f"threads {a.threads or cores['new'].get_num_threads()}"]
    if a.attention:
        attention(cores, isas, a.attention, a.rows, a.blocks, a.threads, lines)
        return
    for isa in isas:
        for c in cores.values():
            c.set_isa(isa)
        for fmt in a.weights:
            for label, shape in ({"toy 48x64": (48, 64)} if a.smoke else MATRICES).items():
                w = rng.standard_normal(shape).astype(np.float32)
                mats = {b: c.WeightMatrix(w, fmt) for b, c in cores.items()}
                arms = {}
                for rows in a.rows:
                    x = rng.standard_normal((rows, shape[1])).astype(np.float32)
                    y = {b: m.matmul(x) for b, m in mats.items()}
                    assert (y["old"] == y["new"]).all(), f"{label} rows {rows}: the builds differ"
                    for b, m in mats.items():
                        arms[(b, rows)] = (lambda m=m, x=x: m.matmul(x, a.threads))
                calls = 2 if shape[0] > 10000 else (20 if a.fastest else 10)
                lines += report(alternate(arms, a.blocks, calls, a.fastest),
                                f"{isa} {fmt} {label} rows")
                print("\n".join(lines[-len(a.rows):]), flush=True)
            if a.no_engine or a.smoke:
                continue
            weights = random_weights()
            engs = {b: c.Engine(SHAPE, weights, fmt, "int8", 256, 0) for b, c in cores.items()}
            del weights
            prompt = rng.integers(0, SHAPE["vocab_size"], 64)
            toks = rng.integers(0, SHAPE["vocab_size"], 16)
            tree = np.array([-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, 16)])
            arms = {}
            for b, e in engs.items():
                e.prefill(prompt)
                for n in a.rows:
                    arms[(b, n)] = (lambda e=e, n=n: e.verify(toks[:n], tree[:n] if n > 2 else np.arange(n) - 1))
            for n in a.rows:
                lo, ln = arms[("old", n)](), arms[("new", n)]()
                assert (lo == ln).all(), f"verify({n}): the builds differ"
            lines += report(alternate(arms, a.blocks, 1), f"{isa} {fmt} engine verify")
            print("\n".join(lines[-len(a.rows):]), flush=True)
            del engs


if __name__ == "__main__":
    main()
