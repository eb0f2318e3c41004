"""Load time and memory: `python bench/load.py CKPT [CKPT ...] --weights q8 q4`.

Each load runs in a fresh process that reports its own resident memory before, at peak during
(VmHWM) and after `sapwood.load`, and the engine's weight bytes; beside it, in another fresh
process, the time to read the same checkpoint bytes with plain 32 MiB reads (what a load cannot
beat). Both see the file as the page cache holds it: run once to warm it, or report cold figures
only after dropping the cache. Linux only (/proc/self/status).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from .common import dump_json, machine, source_revision

_LOAD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import sapwood

    def status(key):  # this process's own figures (ru_maxrss keeps the parent's across exec)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

    base = status("VmRSS")
    t1 = time.perf_counter()
    m = sapwood.load(sys.argv[1], weights=sys.argv[2], max_context=int(sys.argv[3]), quiet=True,
                     threads=int(sys.argv[4]) or None)
    t2 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "base": base, "peak": status("VmHWM"),
                      "final": status("VmRSS"), "engine": m.engine.memory()["weights_bytes"]}))
""")

_READ = textwrap.dedent("""
    import json, sys, time
    from sapwood.safetensors_io import checkpoint_index
    files = sorted({i.path for i in checkpoint_index(sys.argv[1]).values()})
    buf, n, t0 = bytearray(32 << 20), 0, time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while (k := f.readinto(buf)):
                n += k
    print(json.dumps({"read_s": time.perf_counter() - t0, "bytes": n}))
""")


def _run(script: str, *args) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{args}: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_load(path, weights: str, max_context: int = 64, threads: int = 0) -> dict:
    """One load in a fresh process: seconds, and resident bytes before / at peak / after."""
    return _run(_LOAD, path, weights, max_context, threads)


def read_seconds(path) -> dict:
    """Seconds to read the checkpoint's safetensors files once, in a fresh process."""
    return _run(_READ, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--weights", nargs="+", default=["q8", "q4"])
    ap.add_argument("--reps", type=int, default=2, help="loads per checkpoint and mode")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="write every run as JSON here")
    a = ap.parse_args(argv)
    runs = []
    host = {**machine(), "revision": source_revision(), "load_average": os.getloadavg()[0]}
    print(f"# {host}; GB = 1e9 bytes; load s: median [range]")
    print(f"{'checkpoint':<28} {'mode':<5} {'load s':>12} {'read s':>7} {'peak GB':>8} "
          f"{'final GB':>8} {'engine GB':>9} {'peak/final':>10}")
    for ck in a.checkpoints:
        for w in a.weights:
            rs = [measure_load(ck, w, threads=a.threads) for _ in range(a.reps)]
            rd = read_seconds(ck)
            grew = [r["peak"] - r["base"] for r in rs]
            held = [r["final"] - r["base"] for r in rs]
            loads = sorted(r["load_s"] for r in rs)
            mid = statistics.median(loads)
            runs.append({"checkpoint": str(ck), "weights": w, "loads": rs, "read": rd,
                         "time": time.time()})
            print(f"{Path(ck).name:<28} {w:<5} {mid:6.1f} "
                  f"[{loads[0]:.1f}-{loads[-1]:.1f}] {rd['read_s']:7.1f} {max(grew) / 1e9:8.2f} "
                  f"{held[0] / 1e9:8.2f} {rs[0]['engine'] / 1e9:9.2f} {max(grew) / min(held):10.2f}",
                  flush=True)
    if a.out:
        print(f"# {a.out} sha256 {dump_json({'host': host, 'runs': runs}, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
