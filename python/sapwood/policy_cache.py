"""The speculation policy's calibration kept across processes, so that a one-shot CLI run is
not always a cold first request: one JSON file per (target, drafter, machine) under the user's
cache directory ($XDG_CACHE_HOME/sapwood/policy, else ~/.cache/sapwood/policy), read when a
model first serves a drafter and written after each request. SAPWOOD_POLICY_CACHE=0 (or
`sapwood.load(..., policy_cache=False)`, `sapwood generate --no-policy-cache`) turns it off. A
file that cannot be read, or that was written for another target, drafter or machine, is ignored
with a warning: costs learned on other hardware would mislead the policy, never the output.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import warnings
from collections import deque
from dataclasses import asdict
from pathlib import Path

import numpy as np

from . import _core
from .policy import Acceptance, Costs

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


def load(policy, k: dict) -> bool:
    """Fill `policy` from the file of key `k`; False (with a warning for a bad file) if none."""
    p = path_for(k)
    if not p.exists():
        return False
    try:
        with open(p) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"version {data.get('version') if isinstance(data, dict) else None!r}")
        if data.get("key") != json.loads(json.dumps(k)):
            raise ValueError("written for another target, drafter or machine")
        load_state(policy, data["state"])
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        warnings.warn(f"sapwood: ignoring the policy cache {p}: {e}", RuntimeWarning, stacklevel=2)
        return False
    return True


def save(policy, k: dict) -> None:
    """Write the policy's state atomically (a reader never sees half a file); a failure to
    write warns and leaves speculation as it is."""
    p = path_for(k)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": VERSION, "key": k, "state": state(policy)}, f)
        os.replace(tmp, p)
    except OSError as e:
        warnings.warn(f"sapwood: could not write the policy cache {p}: {e}", RuntimeWarning,
                      stacklevel=2)


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


def load_state(policy, s: dict) -> None:
    """Take in state() of an earlier process; raises ValueError (leaving `policy` as it was) if
    it does not fit."""
    p = policy.params
    costs = Costs(p.window, p.min_samples, p.quantile)
    for b, part, size, v in s["costs"]:
        if part not in ("verify", "draft", "catch_up", "rest") or not all(
                isinstance(x, (int, float)) and x >= 0 for x in v):
            raise ValueError(f"bad cost entry {(b, part, size)!r}")
        costs.t[int(b), part, size] = deque(map(float, v), maxlen=p.window)
    for b, v in s.get("level", {}).items():
        if not (isinstance(v, (int, float)) and v > 0):
            raise ValueError(f"bad cost level {v!r} for band {b}")
        costs.level[int(b)] = float(v)
    root, bands = Acceptance(p.prior_strength), {}
    for b, (off, ok) in s["acceptance"].items():
        a = root if int(b) == -1 else Acceptance(p.prior_strength, parent=root)
        off, ok = np.array(off, float), np.array(ok, float)
        if off.shape != a.offered.shape or ok.shape != off.shape or (ok > off).any() or (
                ok < 0).any():
            raise ValueError(f"bad acceptance counts for band {b}")
        a.offered, a.accepted = off, ok
        if int(b) != -1:
            bands[int(b)] = a
    rows = {int(b): (list(map(float, r)), list(map(float, k)))
            for b, (r, k) in s["rows"].items()}
    if any(len(r) != 33 or len(k) != 33 for r, k in rows.values()):
        raise ValueError("bad row counts")
    wide = {int(b): list(map(float, v)) for b, v in s.get("wide_vs_chain", {}).items()}
    if any(len(v) != 3 or min(v[1:]) < 0 for v in wide.values()):
        raise ValueError(f"bad wide_vs_chain {s['wide_vs_chain']!r}")
    policy.costs, policy.acceptance, policy.bands = costs, root, bands
    policy.rows, policy.wide_vs_chain = rows, wide
