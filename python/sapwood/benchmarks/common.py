"""Shared by the benchmarks: run identity (revision, model hashes), arm specs, statistics."""
from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from pathlib import Path

import numpy as np

COHORT = Path(__file__).with_name("cohort.json")


def load_cohort(path=None) -> list[dict]:
    data = json.loads(Path(path or COHORT).read_text(encoding="utf-8"))
    return data["prompts"]


def parse_arm(spec: str) -> dict:
    """'verify=tree,width=8,drafter=lookup' -> generate() keyword arguments."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" not in part:
            raise ValueError(f"arm spec {spec!r}: expected key=value pairs, got {part!r}")
        k, v = part.split("=", 1)
        out[k.strip().replace("-", "_")] = _value(v.strip())
    return out


def _value(v: str):
    if v.lower() == "none":
        return None
    if v.lower() in ("true", "false"):  # adapt_rows=false
        return v.lower() == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_identity(model) -> dict:
    d = model.path
    files = sorted(p for p in d.iterdir() if p.suffix in (".safetensors", ".json")) if d else []
    ident = {"path": str(d), "weights": model.weights, "kv": model.kv,
             "files": {p.name: file_sha256(p) for p in files}}
    if getattr(model, "draft", None) is not None:
        ident["draft"] = model_identity(model.draft)
    return ident


def source_revision() -> str:
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        if rev:
            return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    from .. import __version__
    return f"sapwood {__version__} (no git checkout)"


def machine() -> dict:
    from .. import _core
    return {"platform": platform.platform(), "processor": platform.processor(),
            "isa": _core.isa(), "threads": _core.get_num_threads()}


def geomean(xs) -> float:
    xs = np.asarray(xs, np.float64)
    return float(np.exp(np.log(xs).mean())) if xs.size else float("nan")


def dump_json(obj, path) -> str:
    """Write JSON and return its SHA-256 (printed so a report can be matched to its file)."""
    text = json.dumps(obj, indent=1, sort_keys=True)
    Path(path).write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()


def arm_text(arm: dict) -> str:
    """An arm as its command line wrote it ('verify=tree,width=8'); {} -> generate()'s defaults."""
    return ",".join(f"{k}={v}" for k, v in arm.items()) or "generate() defaults"


def ratio_text(what: str, ratio: float, *, time: bool = False) -> str:
    """'B/A tokens/s x1.120: B faster': the ratio with its direction spelled out, so that
    nobody has to remember which arm is the numerator. time: a ratio of durations (less is
    better): 'B sooner' / 'B later'."""
    if ratio == 1.0:
        verdict = "the same"
    elif time:
        verdict = "B later" if ratio > 1.0 else "B sooner"
    else:
        verdict = "B faster" if ratio > 1.0 else "B slower"
    return f"B/A {what} x{ratio:.3f}: {verdict}"


def table(headers: list, rows: list) -> str:
    """A plain text table: each column as wide as its widest cell, the first (the row's name)
    left-aligned, the figures right-aligned."""
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.rjust(w) if k else c.ljust(w)
                               for k, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in cells)
