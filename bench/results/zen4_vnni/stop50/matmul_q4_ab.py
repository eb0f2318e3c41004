"""One q4 matmul of 1 and 16 rows at 9B widths, 2 threads: median ms and GB/s of stored bytes.
Run under each build's PYTHONPATH (matmul_q4_ab.txt); an optional argument forces a kernel
variant (`avx2`, `avx512`: _core.available_isas())."""
import sys, time, json, numpy as np
from sapwood import _core
if len(sys.argv) > 1:
    _core.set_isa(sys.argv[1])
rng = np.random.default_rng(0)
out = {}
for (o, i) in [(12288, 4096), (4096, 12288), (248320 // 4, 4096)]:
    w = (rng.standard_normal((o, i)) * 0.02).astype(np.float32)
    for fmt in ("q4",):
        m = _core.WeightMatrix(w, fmt)
        for n in (1, 16):
            x = rng.standard_normal((n, i)).astype(np.float32)
            m.matmul(x, threads=2)
            ts = []
            for _ in range(15):
                t = time.perf_counter(); m.matmul(x, threads=2); ts.append(time.perf_counter() - t)
            ts.sort()
            out[f"{o}x{i} n{n}"] = (ts[len(ts) // 2] * 1e3, m.nbytes / ts[len(ts) // 2] / 1e9)
print(json.dumps(out))
