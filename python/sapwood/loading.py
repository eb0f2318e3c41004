"""`load(path)`: an HF checkpoint directory -> `Model` (engine + tokenizer + config).

Everything that can be checked in Python is checked before the engine is built: arguments, then
config.json, then every tensor's name and shape. A bad checkpoint fails with a ValueError naming
what is wrong instead of a crash or garbage logits inside C++.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _core
from .model import Model
from .reference.model import FULL, ModelConfig, expected_shapes, normalize_names
from .reference.mtp import MTP_CONFIG_KEY, check_mtp_tensors, mtp_tensors
from .safetensors_io import load_checkpoint_weights

WEIGHT_FORMATS = ("f32", "bf16", "q8", "q4")
KV_FORMATS = ("int8", "f32")
# Every backend sapwood knows, and what a user does to get one this install lacks.
KNOWN_BACKENDS = {
    "cpu": "",
    "metal": "it needs macOS on Apple silicon with Xcode's command-line tools (xcrun metal) "
             "when sapwood is built: reinstall there with `pip install --no-binary sapwood sapwood`",
    "metal-emulated": "rebuild sapwood from source (`pip install .`)",
    "sycl": "it needs a SYCL compiler (icpx or AdaptiveCpp's acpp) on PATH when sapwood is built: "
            "reinstall there with `pip install --no-binary sapwood sapwood`",
    "sycl-emulated": "rebuild sapwood from source (`pip install .`)",
    "cuda": "the CUDA backend is not built yet",
}


def available_backends() -> tuple:
    """The backends this install has ("cpu" first)."""
    return tuple(_core.available_backends())


def resolve_backend(backend: str) -> str:
    """"auto" -> Metal on Apple silicon when built, else the CPU; any other name as given."""
    if backend != "auto":
        return backend
    import platform
    if platform.system() == "Darwin" and platform.machine() == "arm64" and "metal" in available_backends():
        return "metal"
    return "cpu"
MAX_CONTEXT = 1 << 24                     # the engine's limit (Engine::kMaxContext)
# The largest logit the LM head could produce (a bound from its weights, see check_weights)
# may not exceed this: float32 overflows at 3.4e38, and a row of inf logits picks nothing.
MAX_LOGIT_BOUND = 1e30


def check_args(weights, kv, backend, threads, max_context) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r}: must be one of {', '.join(WEIGHT_FORMATS)}")
    if kv not in KV_FORMATS:
        raise ValueError(f"kv={kv!r}: must be one of {', '.join(KV_FORMATS)}")
    have = available_backends()
    if not isinstance(backend, str) or backend not in KNOWN_BACKENDS:
        raise ValueError(f"backend={backend!r}: unknown backend (known: auto, {', '.join(KNOWN_BACKENDS)}; "
                         f"this install has: {', '.join(have)})")
    if backend not in have:
        raise ValueError(f"backend={backend!r} is not built in this install (it has: {', '.join(have)}): "
                         f"{KNOWN_BACKENDS[backend]}")
    # bool is an int subclass; True as a thread count or context length is a caller mistake
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 0):
        raise ValueError(f"threads={threads!r}: must be None (engine default) or an int >= 0")
    if (not isinstance(max_context, int) or isinstance(max_context, bool)
            or not 0 < max_context <= MAX_CONTEXT):
        raise ValueError(f"max_context={max_context!r}: must be an int in [1, {MAX_CONTEXT}]")


def engine_dims(cfg: ModelConfig) -> dict:
    """The `dims` dict of `_core.Engine`: the model's shape, nothing about its weights."""
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        layer_is_attention=[t == FULL for t in cfg.layer_types],
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rotary_dim=cfg.rotary_dim, rope_theta=float(cfg.rope_theta), rms_norm_eps=float(cfg.rms_norm_eps),
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        hk=cfg.hk, dk=cfg.dk, hv=cfg.hv, dv=cfg.dv, conv_kernel=cfg.conv_kernel, head_order=cfg.head_order)


def _few(names, k=5) -> str:
    names = sorted(names)
    return ", ".join(names[:k]) + (f" ... ({len(names)} in all)" if len(names) > k else "")


def check_weights(cfg: ModelConfig, tensors: dict) -> dict[str, np.ndarray]:
    """Match checkpoint tensors (already normalize_names'd) to expected_shapes(cfg).

    Returns {name: C-contiguous float32} with exactly the expected names, in their order.
    """
    shapes = expected_shapes(cfg)
    tensors = dict(tensors)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # HF ties lm_head to embed_tokens whatever the file holds
    missing = [n for n in shapes if n not in tensors]
    if missing:
        hint = (" (config says tie_word_embeddings=false; is the model tied?)"
                if missing == ["lm_head.weight"] else "")
        raise ValueError(f"missing tensor {missing[0]!r}{hint}"
                         + (f"; {len(missing)} missing in all: {_few(missing)}" if len(missing) > 1 else ""))
    extra = set(tensors) - set(shapes)
    if extra:  # e.g. biases or MoE experts: ignoring them would silently compute another model
        raise ValueError(f"unexpected tensors not used by this model: {_few(extra)}")
    out = {}
    for name, shape in shapes.items():
        x = tensors[name]
        if tuple(x.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(x.shape)}, expected {shape}")
        if x.dtype.kind != "f":
            raise ValueError(f"tensor {name!r} has dtype {x.dtype}; expected a floating-point "
                             "tensor (pre-quantized checkpoints are not supported)")
        out[name] = np.ascontiguousarray(x, dtype=np.float32)
    # Non-finite values are refused by the engine, naming the tensor; finite ones that would
    # overflow are refused here. exp(A_log) is the GDN decay rate: past float32's range
    # (A_log >= 88.7) every decay is -inf.
    for name, x in out.items():
        if name.endswith("linear_attn.A_log") and x.size and np.isfinite(x).all() and x.max() >= 88.0:
            raise ValueError(f"tensor {name!r} has A_log={float(x.max())!r}: exp(A_log) overflows "
                             "float32 (must be < 88)")
    _check_logit_bound(cfg, out)
    return out


def _check_logit_bound(cfg: ModelConfig, w: dict) -> None:
    """A logit is a row of the LM head dotted with the final norm's output, whose entries are
    at most sqrt(H) * max|1 + norm weight| (the RMS-normalised vector has norm sqrt(H)), so
    |logit| <= H * max|head| * max|1 + w|: refuse a checkpoint where that bound overflows."""
    name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head, norm = w[name], w["model.norm.weight"]
    h = max(abs(float(head.max())), abs(float(head.min())))  # NaN and inf propagate
    g = float(np.abs(1.0 + norm.astype(np.float64)).max())
    if not (math.isfinite(h) and math.isfinite(g)):
        return  # the engine names the tensor and the value
    bound = cfg.hidden_size * h * g
    if bound > MAX_LOGIT_BOUND:
        raise ValueError(f"tensor {name!r} (largest |value| {h:.3g}) with model.norm.weight (largest "
                         f"|1 + w| {g:.3g}) could give logits up to {bound:.3g}, past "
                         f"{MAX_LOGIT_BOUND:.0e}: float32 logits would overflow")


def _read_json(p: Path, what: str) -> dict:
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{p}: {what} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{p}: {what} must be a JSON object")
    return d


def _chat_template(d: Path) -> str | None:
    """HF keeps the template in chat_template.jinja (newer) or tokenizer_config.json (older);
    the .jinja file wins, as in transformers. A list of named templates -> the "default" one."""
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    if not (d / "tokenizer_config.json").is_file():
        return None
    t = _read_json(d / "tokenizer_config.json", "tokenizer_config.json").get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


@dataclass
class Checkpoint:
    """What `read_checkpoint` found; `weights` is ready for the engine (see check_weights)."""
    path: Path
    config: ModelConfig
    weights: dict
    tokenizer: object
    generation_config: dict
    chat_template: str | None
    mtp_weights: dict | None = None  # the MTP head's tensors (config mtp_num_hidden_layers > 0)


def read_checkpoint(path) -> Checkpoint:
    """Read and validate an HF checkpoint directory without building an engine."""
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"{d}: not a directory (expected an HF checkpoint directory)")
    if not (d / "config.json").is_file():
        raise ValueError(f"{d}: no config.json")
    cfg = ModelConfig.from_dict(_read_json(d / "config.json", "config.json"))
    gen = {}
    if (d / "generation_config.json").is_file():
        gen = _read_json(d / "generation_config.json", "generation_config.json")
        eos = gen.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else [eos]
        if eos is not None and any(type(e) is not int or e < 0 for e in eos_list):
            raise ValueError(f"{d / 'generation_config.json'}: eos_token_id={eos!r}: must be a "
                             "token id or a list of them")
    tensors = load_checkpoint_weights(d)
    weights = check_weights(cfg, normalize_names(tensors))
    mtp = None
    if cfg.mtp_layers:  # a head the config does not announce is ignored, as transformers does
        mtp = mtp_tensors(tensors)
        try:
            check_mtp_tensors(cfg, mtp)
        except ValueError as e:
            raise ValueError(f"{d}: {e}") from None
        mtp = {n: np.ascontiguousarray(x, dtype=np.float32) for n, x in mtp.items()}
    tokenizer = None
    if (d / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        try:
            tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # tokenizers raises its own Exception type
            raise ValueError(f"{d / 'tokenizer.json'}: cannot be loaded: {e}") from None
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        if n > cfg.vocab_size:  # ids past the embedding table would index out of bounds
            raise ValueError(f"{d / 'tokenizer.json'}: {n} tokens, more than the model's "
                             f"vocab_size={cfg.vocab_size}")
    return Checkpoint(d, cfg, weights, tokenizer, gen, _chat_template(d), mtp)


DEFAULT_DIR = Path(__file__).parent / "data" / "default"


def _bundled(part: str) -> Path:
    d = DEFAULT_DIR / part
    if not (d / "config.json").is_file():
        raise ValueError(f"the bundled default model is not in this install ({d} is missing)")
    return d


def default_draft_path() -> Path:
    return _bundled("draft")


def default_target_path() -> Path:
    return _bundled("target")


def load(path, *, weights: str = "q8", kv: str = "int8", backend: str = "auto", threads=None,
         max_context: int = 4096, policy_cache: bool = True) -> Model:
    """Load an HF-format Qwen3.5 (dense, text) checkpoint directory into a `Model`;
    "default" loads the bundled target with its draft model attached.

    weights: how the engine stores matrices: "f32", "bf16", "q8" or "q4".
    kv: "int8" (paged int8 KV cache, the default) or "f32".
    threads: engine worker threads; None lets the engine choose.
    max_context: the most tokens a sequence may hold (prompt + generated + tree).
    backend: "auto" (Metal on Apple silicon when built, else "cpu"), "cpu", "metal",
    "metal-emulated" / "sycl-emulated" (the Metal / SYCL kernels run on the CPU by the emulator:
    slow, for tests and kernel ports), "sycl"; available_backends() lists what this install has.
    policy_cache: keep the speculation policy's calibration across processes (policy_cache.py;
    also off with SAPWOOD_POLICY_CACHE=0).
    """
    backend = resolve_backend(backend)
    check_args(weights, kv, backend, threads, max_context)
    if isinstance(path, str) and path == "default":  # the bundled pair: target + attached draft
        model = load(_bundled("target"), weights=weights, kv=kv, backend=backend,
                     threads=threads, max_context=max_context)
        model.draft = load(_bundled("draft"), weights=weights, kv=kv, backend=backend,
                           threads=threads, max_context=max_context)
        model.policy_cache = bool(policy_cache)
        return model
    ck = read_checkpoint(path)
    if not hasattr(_core, "Engine"):
        raise RuntimeError("this build of sapwood._core has no Engine; rebuild sapwood")
    engine = _core.Engine(engine_dims(ck.config), ck.weights, weights, kv, max_context,
                           0 if threads is None else threads, backend)
    model = Model(engine, ck.tokenizer, ck.config, ck.generation_config, ck.chat_template, ck.path,
                  weights=weights, kv=kv, backend=backend, max_context=max_context)
    model.policy_cache = bool(policy_cache)
    if ck.mtp_weights is not None and ck.config.mtp_layers == 1:
        model.mtp = _core.MtpHead(engine, ck.mtp_weights, weights, kv, max_context,
                                  0 if threads is None else threads, backend)
        model._mtp_tensors = ck.mtp_weights  # one layer: Model.new_sequence builds its head
    elif ck.mtp_weights is not None:  # vLLM cycles deeper heads by draft row; not done here
        model.mtp_unsupported = (f"{MTP_CONFIG_KEY}={ck.config.mtp_layers}: sapwood runs MTP "
                                 "heads of one layer")
    return model
