"""RSS growth of 3 more sequences: new_sequence() vs sapwood.load() again (the padded testbed)."""
import sys, gc
import sapwood

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

path = sys.argv[1]
m = sapwood.load(path, threads=1, max_context=4096)
gc.collect(); r0 = rss_mb()
w = m.engine.memory()["weights_bytes"] / 2**20
sib = [m.new_sequence() for _ in range(3)]
for s in sib: s.generate(list(range(3, 40)), max_tokens=4, verify="off")
gc.collect(); r1 = rss_mb()
more = [sapwood.load(path, threads=1, max_context=4096) for _ in range(3)]
gc.collect(); r2 = rss_mb()
print(f"{path}: weights {w:.1f} MB per copy; RSS after load {r0:.0f} MB; +3 new_sequence() (each generated 4 tokens) +{r1 - r0:.0f} MB; +3 load() +{r2 - r1:.0f} MB")
