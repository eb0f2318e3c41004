"""One-row matmul of a [rows, cols] random matrix from DRAM, GB/s of weights read beside a plain
streaming read (_core.read_bandwidth): python matmul_stream.py ROWS COLS THREADS q8,q4,bf16"""
import sys, time, statistics
import numpy as np
from sapwood import _core
rng = np.random.default_rng(0)
rows, cols, th = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
fmts = sys.argv[4].split(",")
W = rng.standard_normal((rows, cols), dtype=np.float32)
x = rng.standard_normal((1, cols), dtype=np.float32)
bw = max(_core.read_bandwidth(1 << 29, th, 3) for _ in range(2))
for f in fmts:
    m = _core.WeightMatrix(W, f)
    for _ in range(3): m.matmul(x, th)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(5): m.matmul(x, th)
        ts.append((time.perf_counter() - t) / 5)
    t = statistics.median(ts)
    print(f"{f} th{th}: {m.nbytes/1e6:.1f} MB {t*1e6:.0f} us  {m.nbytes/t/1e9:.1f} GB/s  of bw {m.nbytes/t/bw:.2f}  (bw {bw/1e9:.1f})")
