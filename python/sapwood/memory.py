"""What an engine will hold, from config.json alone, and what the machine has free.

`estimate(path, weights=..., kv=..., max_context=...)` adds up the engine's parts as the C++
sizes them (csrc/weights.h's storage formats, the KV page pool, the GDN states) plus the
working buffers of a round; `sapwood.load` compares the total with `available_bytes()` before
reading any weight, so a model that cannot fit is refused with the figures instead of being
killed by the OOM killer half way through its load. `sapwood inspect PATH` prints the same.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from .config import FULL, LINEAR, ModelConfig

GB = 1e9
KV_PAGE = 64            # the engine's page size (positions per KV page)
KV_GROUP = 32           # int8 KV: dims per fp32 scale
PENDING_TOKENS = 33     # GDN tape kept pending between rounds (CpuBackend's kMaxPending)
TREE_NODES = 64         # the working set of a wide tree round (verify rows)
PREFILL_ROWS = 256      # rows per prefill forward (Engine::kPrefillChunk)
RUNTIME_BYTES = 300e6   # the interpreter, numpy, the tokenizer and the load's read buffer
WEIGHT_MODES = ("f32", "bf16", "q8", "q4")
SEQUENCE_PARTS = ("kv_cache", "gdn_states", "round_buffers", "mtp_drafter")


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def matrix_bytes(rows: int, cols: int, fmt: str) -> int:
    """Bytes of a [rows, cols] matrix in the engine's storage (QMatrix::bytes)."""
    if fmt == "f32":
        return _up(rows, 16) * cols * 4
    if fmt == "bf16":
        return _up(rows, 16) * cols * 2
    if fmt == "q8":  # int8 rows in groups of 16, plus a scale and an int32 sum per row
        return _up(rows, 16) * _up(cols, 32) + rows * 8
    if fmt in ("q4", "q4a", "q4a32"):  # two inputs a byte in groups of 16 rows, an fp32 scale
        cp, r16 = _up(cols, 64), _up(rows, 16)  # (q4a: and bias) per 64 inputs (q4a32: per 32)
        group = 32 if fmt == "q4a32" else 64
        return r16 * cp // 2 + r16 * (cp // group) * (4 if fmt == "q4" else 8)
    raise ValueError(f"weights={fmt!r}: must be one of {', '.join(WEIGHT_MODES)}")


def _layer_bytes(cfg: ModelConfig, kind: str, fmt: str) -> int:
    H, D, C = cfg.hidden_size, cfg.head_dim, cfg.conv_dim
    b = matrix_bytes(cfg.intermediate_size, H, fmt) * 2 + matrix_bytes(H, cfg.intermediate_size, fmt)
    b += 2 * H * 4  # input and post-attention norms
    if kind == LINEAR:
        V = cfg.hv * cfg.dv
        b += matrix_bytes(C, H, fmt) + matrix_bytes(V, H, fmt) + matrix_bytes(H, V, fmt)
        b += matrix_bytes(2 * cfg.hv, H, "f32")  # in_proj_b | in_proj_a, always f32
        b += 4 * (C * cfg.conv_kernel + 2 * cfg.hv + cfg.dv)
    else:
        b += matrix_bytes(2 * cfg.num_heads * D, H, fmt) + 2 * matrix_bytes(cfg.num_kv_heads * D, H, fmt)
        b += matrix_bytes(H, cfg.num_heads * D, fmt) + 2 * D * 4
    return b


def weight_bytes(cfg: ModelConfig, fmt: str) -> int:
    """The engine's `memory()["weights_bytes"]` for this config and weights format."""
    b = matrix_bytes(cfg.vocab_size, cfg.hidden_size, fmt) * (1 if cfg.tie_word_embeddings else 2)
    b += cfg.hidden_size * 4
    return b + sum(_layer_bytes(cfg, kind, fmt) for kind in cfg.layer_types)


def kv_bytes(cfg: ModelConfig, kv: str, max_context: int, attn_layers: int | None = None) -> int:
    """The KV page pool for max_context positions (`memory()["kv_pool_bytes"]`)."""
    n_attn = sum(t == FULL for t in cfg.layer_types) if attn_layers is None else attn_layers
    if not n_attn:  # the engine reserves a pool of one layer, never touched
        return 0
    D = max(32, cfg.head_dim)
    per_head = 2 * KV_PAGE * D + 2 * KV_PAGE * (D // KV_GROUP) * 4 if kv == "int8" else 2 * KV_PAGE * D * 4
    return _up(max_context, KV_PAGE) // KV_PAGE * per_head * max(1, cfg.num_kv_heads) * n_attn


def gdn_state_bytes(cfg: ModelConfig) -> int:
    """The GDN layers' recurrent states and conv windows (`memory()["gdn_state_bytes"]` of a
    fresh engine)."""
    per = cfg.hv * cfg.dk * cfg.dv + (cfg.conv_kernel - 1) * cfg.conv_dim
    return 4 * per * sum(t == LINEAR for t in cfg.layer_types)


def working_bytes(cfg: ModelConfig) -> int:
    """A round's buffers: the GDN tape kept pending between rounds and a tree's tape, a prefill
    chunk's activations, the logits of a tree."""
    n_gdn = sum(t == LINEAR for t in cfg.layer_types)
    n_attn = len(cfg.layer_types) - n_gdn
    token = 2 * cfg.hk * cfg.dk + cfg.hv * cfg.dv + 2 * cfg.hv
    tape = (PENDING_TOKENS * token + TREE_NODES * (cfg.conv_dim + token)) * 4 * n_gdn
    # a mixer's widths count only where its layers exist (a config may set the other's freely)
    widest = max(2 * cfg.intermediate_size,
                 cfg.conv_dim + 2 * cfg.hv * cfg.dv if n_gdn else 0,
                 2 * cfg.num_heads * cfg.head_dim + 2 * cfg.num_kv_heads * cfg.head_dim if n_attn else 0)
    acts = PREFILL_ROWS * (4 * cfg.hidden_size + widest) * 4
    return tape + acts + TREE_NODES * cfg.vocab_size * 4


def mtp_bytes(cfg: ModelConfig, fmt: str, kv: str, max_context: int) -> int:
    """The checkpoint's MTP head, the default drafter when it has one: one full-attention
    layer, fc split in two [H, H] halves, three norms, its own KV."""
    if not cfg.mtp_layers:
        return 0
    H = cfg.hidden_size
    return (_layer_bytes(cfg, FULL, fmt) + 2 * matrix_bytes(H, H, fmt) + 3 * H * 4
            + kv_bytes(cfg, kv, max_context, attn_layers=1))


@dataclass
class MemoryEstimate:
    """The parts of a loaded model in bytes; `total` is what load checks against what is free."""
    weights: str
    kv: str
    max_context: int
    parts: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return int(sum(self.parts.values()))

    @property
    def per_sequence(self) -> int:
        """What each further sequence (Model.new_sequence, a server slot) adds: its own KV,
        GDN state and round buffers, the weights being shared. The MTP head is counted too
        (each sequence builds its own on first use)."""
        return int(sum(self.parts.get(p, 0) for p in SEQUENCE_PARTS))

    def describe(self) -> str:
        rows = [f"  {name:<14} {b / GB:8.2f} GB" for name, b in self.parts.items()]
        return "\n".join([f"weights={self.weights!r} kv={self.kv!r} max_context={self.max_context}:",
                          *rows, f"  {'total':<14} {self.total / GB:8.2f} GB"])


def estimate_config(cfg: ModelConfig, *, weights: str = "q8", kv: str = "int8",
                    max_context: int = 4096, mtp: bool = True,
                    stored: str | None = None) -> MemoryEstimate:
    """stored: "q4a" ("q4a32") when the checkpoint's matrices are affine 4-bit groups of 64 (of
    32) a quantized load keeps as stored (formats.stored_matrices)."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights={weights!r}: must be one of {', '.join(WEIGHT_MODES)}")
    if kv not in ("int8", "f32"):
        raise ValueError(f"kv={kv!r}: must be one of int8, f32")
    e = MemoryEstimate(weights, kv, max_context)
    kept = stored in ("q4a", "q4a32") and weights in ("q4", "q8")
    e.parts["weights"] = weight_bytes(cfg, stored if kept else weights)
    e.parts["kv_cache"] = kv_bytes(cfg, kv, max_context)
    e.parts["gdn_states"] = gdn_state_bytes(cfg)
    e.parts["round_buffers"] = working_bytes(cfg)
    if mtp and cfg.mtp_layers == 1:
        e.parts["mtp_drafter"] = mtp_bytes(cfg, weights, kv, max_context)
    e.parts["runtime"] = int(RUNTIME_BYTES)
    return e


def estimate(path, *, weights: str = "auto", kv: str = "int8", max_context: int = 4096,
             revision: str | None = None) -> MemoryEstimate:
    """The memory `sapwood.load(path, weights=, kv=, max_context=)` will take, per part, from
    the checkpoint's config.json alone (a directory or a cached hub id)."""
    from .hub import resolve_checkpoint
    from .loading import read_config

    from .formats import auto_weights, stored_matrices
    from .loading import _read_json

    from .formats.gguf import gguf_file_config, is_gguf
    local = Path(os.path.expanduser(os.fspath(path)))
    if is_gguf(local):  # one file: its metadata is the config; nothing runs as stored
        from .config import ModelConfig
        return estimate_config(ModelConfig.from_dict(gguf_file_config(local)),
                               weights="q8" if weights == "auto" else weights, kv=kv,
                               max_context=max_context)
    d = resolve_checkpoint(path, revision=revision)
    raw = _read_json(d / "config.json", "config.json")
    if weights == "auto":  # what load(weights="auto") picks
        weights = auto_weights(raw)
    return estimate_config(read_config(d), weights=weights, kv=kv, max_context=max_context,
                           stored=stored_matrices(raw))


def _meminfo() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def _cgroup_free() -> int | None:
    """What a cgroup v2 memory limit leaves (containers, CI), if one is set."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        stat = dict(line.split() for line in Path("/sys/fs/cgroup/memory.stat").read_text().splitlines())
        reclaimable = int(stat.get("inactive_file", 0))  # page cache the kernel gives back
        return int(limit) - used + reclaimable
    except (OSError, ValueError):
        return None


def available_bytes() -> int:
    """Memory a load may take: MemAvailable on Linux (within a cgroup's limit); elsewhere 85%
    of physical memory (macOS keeps the rest for itself and wired GPU buffers).
    SAPWOOD_MEMORY_GB overrides it."""
    if os.environ.get("SAPWOOD_MEMORY_GB"):
        try:
            return int(float(os.environ["SAPWOOD_MEMORY_GB"]) * GB)
        except ValueError:
            raise ValueError(f"SAPWOOD_MEMORY_GB={os.environ['SAPWOOD_MEMORY_GB']!r}: must be a "
                             "number of gigabytes") from None
    if platform.system() == "Linux":
        avail = _meminfo().get("MemAvailable")
        cg = _cgroup_free()
        if avail is not None:
            return min(avail, cg) if cg is not None else avail
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.85)


def check_fits(cfg: ModelConfig, est: MemoryEstimate, where: str) -> None:
    """Refuse, before anything is allocated, a model whose estimate exceeds what is free,
    naming both figures and the weights mode that would fit."""
    free = available_bytes()
    if est.total <= free:
        return
    fits = [m for m in WEIGHT_MODES
            if estimate_config(cfg, weights=m, kv=est.kv, max_context=est.max_context,
                               mtp="mtp_drafter" in est.parts).total <= free]
    if fits:
        alt = estimate_config(cfg, weights=fits[0], kv=est.kv, max_context=est.max_context,
                              mtp="mtp_drafter" in est.parts)
        hint = f"; weights={fits[0]!r} needs {alt.total / GB:.1f} GB"
    else:
        hint = "; no weights mode fits at this max_context (a smaller max_context or kv='int8' may)"
    raise MemoryError(f"{where}: weights={est.weights!r} needs {est.total / GB:.1f} GB, "
                      f"{free / GB:.1f} GB available{hint}. Per part:\n{est.describe()}\n"
                      "(check_memory=False skips this check)")
