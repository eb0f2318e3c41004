"""The speculation policy's calibration kept across processes, so that a one-shot CLI run is
not always a cold first request: one JSON file per (target, drafter, machine) under the user's
cache directory ($XDG_CACHE_HOME/sapwood/policy, else ~/.cache/sapwood/policy), read when a
model first serves a drafter and written after each request. SAPWOOD_POLICY_CACHE=0 (or
`sapwood.load(..., policy_cache=False)`, `sapwood generate --no-policy-cache`) turns it off. A
file that cannot be read, or that was written for another target, drafter or machine, is ignored
with a warning: costs learned on other hardware would mislead the policy, never the output.

The file is input from outside the process (issue 50): only a regular file of at most MAX_BYTES
is read, without following a link or blocking on a FIFO, and every field is checked for type,
range and count before any of it is taken in, so a loaded state is one the policy could have
learned itself (its work per round bounded as its own state's is). Anything else is ignored
whole, with one warning per file and problem per process.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import stat
import tempfile
import warnings
from collections import deque
from dataclasses import asdict
from pathlib import Path

import numpy as np

from . import _core
from .policy import BANDS, Acceptance, Costs

VERSION = 2  # 2: the acceptance table gained the group of nodes off the drafter's line
OFF = ("0", "off", "false", "no")


def enabled(option: bool = True) -> bool:
    return bool(option) and os.environ.get("SAPWOOD_POLICY_CACHE", "1").strip().lower() not in OFF


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sapwood" / "policy"


def machine() -> dict:
    """What the costs depend on besides the models: the CPU, its core count, the kernel variant."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "arch": platform.machine(), "cores": os.cpu_count(),
            "isa": _core.isa() if hasattr(_core, "isa") else None}


def key(target: dict, drafter) -> dict:
    return {"target": target, "drafter": drafter, "machine": machine()}


def path_for(k: dict) -> Path:
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"{digest}.json"


# A legitimate file holds at most a few hundred KB (every band, part and node count timed, full
# acceptance tables): anything larger is not one, and reading it costs time and memory.
MAX_BYTES = 4 << 20
# The widest verify a round runs (DecodeConfig: width <= 64; a chain of rows <= 32 is 33 nodes):
# a file's timings of other node counts are not the policy's, and each one it holds makes
# every round's pricing slower (a Theil-Sen fit over the counts: thousands slowed generation
# 100-170x).
MAX_VERIFY_NODES = 64
MAX_SECONDS = 1e4      # one timing: far beyond any round
MAX_COUNT = 1e15       # acceptance and row counts (decayed sums of rounds)
MAX_LEVEL = 1e6        # the host's level is a ratio of timings
PARTS = ("verify", "draft", "catch_up", "rest")
REST_KINDS = ("plain", "chain", "tree")

_warned: set = set()  # (file, problem): each warned once per process


def _warn_once(path, problem, message: str) -> None:
    if (str(path), problem) not in _warned:
        _warned.add((str(path), problem))
        warnings.warn(f"sapwood: {message}", RuntimeWarning, stacklevel=3)


def _read_regular(p: Path) -> bytes | None:
    """The bytes of the regular file at p (None: there is none), at most MAX_BYTES. Never
    follows a link, never blocks on a FIFO or device, never reads past the cap (a link to
    /dev/zero read until memory ran out, a FIFO blocked forever)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    if not nofollow and os.path.islink(p):  # no O_NOFOLLOW here: check first
        raise ValueError("a symbolic link, not a regular file")
    try:
        fd = os.open(p, flags | nofollow)
    except FileNotFoundError:
        return None
    except OSError as e:
        if os.path.islink(p):  # O_NOFOLLOW's ELOOP
            raise ValueError("a symbolic link, not a regular file") from None
        raise ValueError(f"cannot be opened: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > MAX_BYTES:
            raise ValueError(f"{st.st_size} bytes, more than a policy cache holds ({MAX_BYTES})")
        chunks, n = [], 0
        while True:  # the size can change while it is read: the cap holds whatever st said
            b = os.read(fd, min(1 << 20, MAX_BYTES + 1 - n))
            if not b:
                return b"".join(chunks)
            chunks.append(b)
            n += len(b)
            if n > MAX_BYTES:
                raise ValueError(f"more than {MAX_BYTES} bytes")
    finally:
        os.close(fd)


def _no_constant(name):
    raise ValueError(f"{name} is not a number a policy cache holds")


def load(policy, k: dict) -> bool:
    """Fill `policy` from the file of key `k`; False if there is none or it is not a valid
    cache (a warning naming the file, once per process; `policy` unchanged). The file decides
    speed only: whatever it holds, a request's tokens are those without it."""
    p = path_for(k)
    try:
        raw = _read_regular(p)
        if raw is None:
            return False
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            got = data.get("version") if isinstance(data, dict) else None
            raise ValueError(f"version {got!r:.60}")
        if data.get("key") != json.loads(json.dumps(k)):
            raise ValueError("written for another target, drafter or machine")
        load_state(policy, data.get("state"))
    except Exception as e:  # noqa: BLE001 - whatever the file holds, the request goes on
        _warn_once(p, ("read", str(e)), f"ignoring the policy cache {p}: {e}")
        return False
    return True


def save(policy, k: dict) -> None:
    """Write the policy's state atomically (a reader never sees half a file): a temporary file
    in the same directory, renamed over the old one. A failure (a full disk, a directory in
    the way) warns once and leaves speculation as it is, and the temporary file is removed
    however the write ends."""
    p = path_for(k)
    tmp = None
    try:
        data = json.dumps({"version": VERSION, "key": k, "state": state(policy)},
                          allow_nan=False).encode()
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=p.name + ".", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
        tmp = None
    except Exception as e:  # noqa: BLE001 - a failed write never fails the request
        # keyed by the kind of failure: its message names the temporary file, new each time
        _warn_once(p, ("write", type(e).__name__, getattr(e, "errno", None)),
                   f"could not write the policy cache {p}: {e}")
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def attach(policy, k: dict) -> None:
    """Load `policy` from the cache and save it after every request."""
    load(policy, k)
    policy.on_request_end = lambda pol: save(pol, k)


def state(policy) -> dict:
    """What a Policy learned, as plain data (JSON)."""
    return {"params": asdict(policy.params),
            "costs": [[b, p, s, list(v)] for (b, p, s), v in policy.costs.t.items()],
            "level": {str(b): v for b, v in policy.costs.level.items()},
            "acceptance": {str(b): [a.offered.tolist(), a.accepted.tolist()]
                           for b, a in [(-1, policy.acceptance)] + sorted(policy.bands.items())},
            "rows": {str(b): [list(r), list(k)] for b, (r, k) in policy.rows.items()},
            "wide_vs_chain": {str(b): list(v) for b, v in policy.wide_vs_chain.items()}}


def _number(x, what: str, lo: float, hi: float) -> float:
    # JSON numbers only (a bool is an int to Python): a string, list or null is not a timing
    if type(x) not in (int, float):
        raise ValueError(f"{what}: {x!r:.60} is not a number")
    try:
        v = float(x)
    except OverflowError:
        raise ValueError(f"{what}: {x!r:.60} is out of range") from None
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ValueError(f"{what}: {x!r} is not in [{lo}, {hi}]")
    return v


def _band(b, what: str, lowest: int = 0) -> int:
    """A context band (band_of's 0..len(BANDS); -1: acceptance's pooled level) as state()
    writes it: an int in a list, its decimal string as a JSON key."""
    if isinstance(b, str) and b.lstrip("-").isdigit() and len(b) <= 3 and b == str(int(b)):
        b = int(b)
    if type(b) is not int or not lowest <= b <= len(BANDS):
        raise ValueError(f"{what}: band {b!r:.60} is not one of {lowest}..{len(BANDS)}")
    return b


def _dict(x, what: str, most: int) -> dict:
    if not isinstance(x, dict):
        raise ValueError(f"{what}: {type(x).__name__}, not an object")
    if len(x) > most:
        raise ValueError(f"{what}: {len(x)} entries, more than {most}")
    return x


def _list(x, what: str, least: int, most: int) -> list:
    if not isinstance(x, list):
        raise ValueError(f"{what}: {type(x).__name__}, not a list")
    if not least <= len(x) <= most:
        raise ValueError(f"{what}: {len(x)} entries, "
                         + (f"more than {most}" if len(x) > most else f"fewer than {least}"))
    return x


def load_state(policy, s: dict) -> None:
    """Take in state() of an earlier process; raises ValueError (leaving `policy` as it was) if
    any part does not fit: every field's type and range, and how many entries there are, are
    what state() can write, so the policy never meets a value it could not have made itself."""
    p = policy.params
    s = _dict(s, "state", 16)
    nbands = len(BANDS) + 1
    costs = Costs(p.window, p.min_samples, p.quantile)
    for entry in _list(s.get("costs"), "costs", 0, nbands * (MAX_VERIFY_NODES + 5)):
        if not isinstance(entry, list) or len(entry) != 4:
            raise ValueError(f"bad cost entry {entry!r:.80}")
        b, part, size, v = entry
        b = _band(b, "cost entry")
        ok = (type(size) is int and 1 <= size <= MAX_VERIFY_NODES if part == "verify" else
              size == 0 and type(size) is int if part in ("draft", "catch_up") else
              size in REST_KINDS if part == "rest" else False)
        if not ok or (b, part, size) in costs.t:
            raise ValueError(f"bad cost entry {(b, part, size)!r:.80}")
        times = [_number(x, f"cost {(b, part, size)}", 0.0, MAX_SECONDS)
                 for x in _list(v, f"cost {(b, part, size)}", 1, p.window)]
        costs.t[b, part, size] = deque(times, maxlen=p.window)
    for b, v in _dict(s.get("level", {}), "cost level", nbands).items():
        costs.level[_band(b, "cost level")] = _number(v, f"cost level for band {b}",
                                                      1.0 / MAX_LEVEL, MAX_LEVEL)
    root, bands = Acceptance(p.prior_strength), {}
    for b, counts in _dict(s.get("acceptance"), "acceptance", nbands + 1).items():
        b = _band(b, "acceptance", lowest=-1)
        a = root if b == -1 else Acceptance(p.prior_strength, parent=root)
        off, ok = _list(counts, f"acceptance counts for band {b}", 2, 2)
        try:  # nested lists of the table's shape, numbers only (dtype object otherwise)
            off, ok = np.array(off, dtype=object), np.array(ok, dtype=object)
        except ValueError:  # ragged
            raise ValueError(f"bad acceptance counts for band {b}") from None
        if off.shape != a.offered.shape or ok.shape != off.shape or not all(
                type(x) in (int, float) for x in np.concatenate([off.ravel(), ok.ravel()])):
            raise ValueError(f"bad acceptance counts for band {b}")
        off, ok = off.astype(float), ok.astype(float)
        if not (np.isfinite(off).all() and np.isfinite(ok).all() and (ok >= 0).all()
                and (ok <= off).all() and (off <= MAX_COUNT).all()):
            raise ValueError(f"bad acceptance counts for band {b}")
        a.offered, a.accepted = off, ok
        if b != -1:
            bands[b] = a
    rows = {}
    for b, pair in _dict(s.get("rows"), "row counts", nbands).items():
        b = _band(b, "row counts")
        r, k = _list(pair, f"row counts for band {b}", 2, 2)
        what = f"row counts for band {b}"
        r = [_number(x, what, 0.0, MAX_COUNT) for x in _list(r, what, 33, 33)]
        k = [_number(x, what, 0.0, MAX_COUNT) for x in _list(k, what, 33, 33)]
        if any(kj > rj * (1 + 1e-9) + 1e-9 for rj, kj in zip(r, k)):
            raise ValueError(f"bad row counts for band {b}: more kept than reached")
        rows[b] = (r, k)
    wide = {}
    for b, v in _dict(s.get("wide_vs_chain", {}), "wide_vs_chain", nbands).items():
        b = _band(b, "wide_vs_chain")
        v = _list(v, f"bad wide_vs_chain for band {b}", 3, 3)
        wide[b] = [_number(v[0], f"wide_vs_chain for band {b}", -MAX_COUNT, MAX_COUNT)] + [
            _number(x, f"wide_vs_chain for band {b}", 0.0, MAX_COUNT) for x in v[1:]]
    policy.costs, policy.acceptance, policy.bands = costs, root, bands
    policy.rows, policy.wide_vs_chain = rows, wide
