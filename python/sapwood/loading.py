"""`load(path)`: an HF checkpoint directory -> `Model` (engine + tokenizer + config).

Everything that can be checked in Python is checked before the engine is built: arguments, then
config.json, then every tensor's name and shape. A bad checkpoint fails with a ValueError naming
what is wrong instead of a crash or garbage logits inside C++.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import _core
from .config import (FULL, LINEAR, MTP_CONFIG_KEY, ModelConfig, check_mtp_tensors, expected_shapes,
                     mtp_tensors, normalize_names)
from .formats import (auto_weights, describe, int4_config, requantized, stored_matrices,
                      stored_view)
from .formats.gguf import is_gguf
from .memory import check_fits, estimate_config
from .model import Model
from .safetensors_io import (INDEX_FILE, SINGLE_FILE, TensorReader, checkpoint_index,
                             numpy_dtype_name)

log = logging.getLogger("sapwood.loading")

# "auto": the checkpoint decides (formats.auto_weights); the others name an engine mode
WEIGHT_FORMATS = ("auto", "f32", "bf16", "q8", "q4")
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


class CheckpointTensors(Mapping):
    """The tensors an engine reads, by engine name, streamed from the checkpoint's files.

    The engine (csrc/weight_source.h) reads `shapes` once, then asks `read(name, r0, r1)` for
    bounded chunks of rows in the file's own dtype and widens and stores them on its worker
    threads: a load holds the engine plus one chunk. As a Mapping, `tensors[name]` reads a
    whole tensor as float32 (tests, small tensors). `amax` holds the largest |value| of the
    tensors named in `watch` once streamed; `on_bytes(n)` is told of every chunk read.
    """

    def __init__(self, infos: dict, *, chunk_bytes: int = 32 << 20, watch=(), on_bytes=None):
        self.infos = dict(infos)
        self.shapes = {n: list(i.shape) for n, i in self.infos.items()}
        self.chunk_bytes = int(chunk_bytes)
        self.nbytes = sum(i.nbytes for i in self.infos.values())
        self.watch, self.amax, self.on_bytes = set(watch), {}, on_bytes
        self._reader = TensorReader(self.chunk_bytes)

    def read(self, name: str, r0: int, r1: int) -> np.ndarray:
        info = self.infos[name]
        if hasattr(info, "rows"):  # a format's view (formats/)
            x = info.rows(self._reader, int(r0), int(r1))
        else:
            x = self._reader.rows(info, int(r0), int(r1))
        if name in self.watch and x.size:
            self.amax[name] = max(self.amax.get(name, 0.0), _amax(x))
        if self.on_bytes is not None:
            self.on_bytes((r1 - r0) * info.row_bytes)
        return x

    @property
    def q4_affine_names(self) -> dict:
        """{name: group size}: the matrices stored as affine 4-bit groups the engine runs as
        stored (formats/)."""
        return {n: i.q4_group for n, i in self.infos.items() if getattr(i, "q4_group", 0)}

    def read_q4_affine(self, name: str, r0: int, r1: int):
        info = self.infos[name]
        *out, amax = info.q4_affine_rows(self._reader, int(r0), int(r1))
        if name in self.watch:
            self.amax[name] = max(self.amax.get(name, 0.0), amax)
        if self.on_bytes is not None:
            self.on_bytes((r1 - r0) * info.row_bytes)
        return tuple(out)

    def __getitem__(self, name: str) -> np.ndarray:
        info = self.infos[name]
        if hasattr(info, "rows"):
            return info.rows(self._reader, 0, info.shape[0]).reshape(info.shape)
        return self._reader.read(info)

    def __iter__(self):
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def close(self) -> None:
        self._reader.close()


def _amax(x: np.ndarray) -> float:
    """Largest |value| of a chunk as read (bf16 as its uint16 bits): NaN and inf propagate."""
    if x.dtype == np.uint16:  # bf16: clear the sign; for finite values the bit order is the order
        top = int((x & 0x7FFF).max())
        return float(np.array([top << 16], np.uint32).view(np.float32)[0])
    return float(np.abs(x).max())


def check_tensors(cfg: ModelConfig, infos: dict) -> dict:
    """Match checkpoint tensors (already normalize_names'd; anything with .shape and .dtype,
    TensorInfo or arrays) to expected_shapes(cfg): exactly the expected names, in their order,
    each floating point. Reads no tensor data."""
    shapes = expected_shapes(cfg)
    infos = dict(infos)
    if cfg.tie_word_embeddings:
        infos.pop("lm_head.weight", None)  # HF ties lm_head to embed_tokens whatever the file holds
    missing = [n for n in shapes if n not in infos]
    if missing:
        hint = (" (config says tie_word_embeddings=false; is the model tied?)"
                if missing == ["lm_head.weight"] else "")
        raise ValueError(f"missing tensor {missing[0]!r}{hint}"
                         + (f"; {len(missing)} missing in all: {_few(missing)}" if len(missing) > 1 else ""))
    extra = set(infos) - set(shapes)
    if extra:  # e.g. biases or MoE experts: ignoring them would silently compute another model
        raise ValueError(f"unexpected tensors not used by this model: {_few(extra)}")
    for name, shape in shapes.items():
        x = infos[name]
        if tuple(x.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(x.shape)}, expected {shape}")
        dtype = numpy_dtype_name(x.dtype) if isinstance(x.dtype, str) else np.dtype(x.dtype).name
        if not dtype.startswith(("float", "bfloat")):
            raise ValueError(f"tensor {name!r} has dtype {dtype}; expected a floating-point "
                             "tensor (pre-quantized checkpoints are not supported)")
    return {n: infos[n] for n in shapes}


def _check_values(cfg: ModelConfig, tensors) -> None:
    """Finite values that would overflow are refused here (non-finite ones by the engine, naming
    the tensor). exp(A_log) is the GDN decay rate: past float32's range (A_log >= 88.7) every
    decay is -inf. Reads only the small A_log tensors."""
    for i, kind in enumerate(cfg.layer_types):
        if kind != LINEAR:
            continue
        name = f"model.layers.{i}.linear_attn.A_log"
        x = tensors[name]  # a Mapping's `in` would read the tensor once more
        if x.size and np.isfinite(x).all() and x.max() >= 88.0:
            raise ValueError(f"tensor {name!r} has A_log={float(x.max())!r}: exp(A_log) overflows "
                             "float32 (must be < 88)")


def head_name(cfg: ModelConfig) -> str:
    return "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"


def _check_logit_bound(cfg: ModelConfig, norm: np.ndarray, h: float) -> None:
    """A logit is a row of the LM head dotted with the final norm's output, whose entries are
    at most sqrt(H) * max|1 + norm weight| (the RMS-normalised vector has norm sqrt(H)), so
    |logit| <= H * max|head| * max|1 + w|: refuse a checkpoint where that bound overflows.
    h: max|head|, measured while the head streamed into the engine."""
    name = head_name(cfg)
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


SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _special_tokens(d: Path) -> dict:
    """The special tokens transformers hands a chat template as variables: tokenizer_config.json's
    bos_token, eos_token, pad_token, unk_token (a string or an {"content": ...} entry)."""
    if not (d / "tokenizer_config.json").is_file():
        return {}
    cfg = _read_json(d / "tokenizer_config.json", "tokenizer_config.json")
    out = {}
    for k in SPECIAL_TOKENS:
        v = cfg.get(k)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[k] = v
    return out


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
    """What `read_checkpoint` found. `weights` streams the engine's tensors from the files
    (CheckpointTensors: a Mapping, read on demand); `mtp_weights` the MTP head's, when the
    config announces one."""
    path: Path
    config: ModelConfig
    weights: CheckpointTensors
    tokenizer: object
    generation_config: dict
    chat_template: str | None
    mtp_weights: CheckpointTensors | None = None
    stored_format: str | None = None  # formats.describe: a pre-quantized checkpoint's format
    stored_matrices: str | None = None  # formats.stored_matrices
    auto_weights: str = "q8"  # formats.auto_weights: the mode weights="auto" loads in
    special_tokens: dict = field(default_factory=dict)  # bos_token, eos_token, ... (templates)


def read_config(d: Path) -> ModelConfig:
    d = Path(d)
    if not d.is_dir():
        raise ValueError(f"{d}: not a directory (expected an HF checkpoint directory)")
    if not (d / "config.json").is_file():
        ggufs = sorted(p.name for p in d.glob("*.gguf"))
        if ggufs:  # a GGUF repository holds one file per quantization: the file is the model
            raise ValueError(f"{d}: no config.json, but GGUF files: {_few(ggufs)}; load one of "
                             "them (its path)")
        raise ValueError(f"{d}: no config.json")
    return ModelConfig.from_dict(_read_json(d / "config.json", "config.json"))


def read_checkpoint(path) -> Checkpoint:
    """Read and validate an HF checkpoint directory without building an engine: config, every
    tensor's name, shape and dtype from the file headers, the tokenizer. Of the weights only the
    small A_log tensors are read (their range is checked); the rest stream into the engine."""
    d = Path(path)
    if is_gguf(d):
        return read_gguf_checkpoint(d)
    cfg = read_config(d)
    gen = {}
    if (d / "generation_config.json").is_file():
        gen = _read_json(d / "generation_config.json", "generation_config.json")
        eos = gen.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else [eos]
        if eos is not None and any(type(e) is not int or e < 0 for e in eos_list):
            raise ValueError(f"{d / 'generation_config.json'}: eos_token_id={eos!r}: must be a "
                             "token id or a list of them")
    raw_config = _read_json(d / "config.json", "config.json")
    try:
        index = stored_view(checkpoint_index(d), raw_config)
    except ValueError as e:
        raise ValueError(f"{d}: {e}") from None
    weights = CheckpointTensors(check_tensors(cfg, normalize_names(index)), watch={head_name(cfg)})
    _check_values(cfg, weights)
    mtp = None
    # a head the config does not announce is ignored, as transformers does; mlx-lm's
    # conversion drops the head and keeps the config's announcement, and a GPTQ/AWQ quantizer
    # may too (their MTP head, when kept, stays bf16)
    dropped = not mtp_tensors(index) and ("quantization" in raw_config or int4_config(raw_config))
    if cfg.mtp_layers and not dropped:
        infos = mtp_tensors(index)
        try:
            check_mtp_tensors(cfg, infos)
        except ValueError as e:
            raise ValueError(f"{d}: {e}") from None
        mtp = CheckpointTensors(infos)
    tokenizer = None
    if (d / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        from . import tokenizing
        tf = d / "tokenizer.json"
        try:
            tokenizer = Tokenizer.from_file(str(tf))
        except BaseException as e:  # its own Exception type, or a Rust panic (tokenizing.py)
            if not isinstance(e, Exception) and not tokenizing.is_panic(e):
                raise
            raise ValueError(f"{tf}: cannot be loaded: {tokenizing.describe(e)}") from None
        _check_tokenizer(tokenizer, cfg, tf)
    return Checkpoint(d, cfg, weights, tokenizer, gen, _chat_template(d), mtp, describe(raw_config),
                      stored_matrices(raw_config), auto_weights(raw_config), _special_tokens(d))


def _check_tokenizer(tokenizer, cfg: ModelConfig, where) -> None:
    from . import tokenizing
    try:
        vocab = tokenizer.get_vocab(with_added_tokens=True)
    except BaseException as e:  # its own Exception type, or a Rust panic (tokenizing.py)
        if not isinstance(e, Exception) and not tokenizing.is_panic(e):
            raise
        raise ValueError(f"{where}: cannot be loaded: {tokenizing.describe(e)}") from None
    # ids past the embedding table would index out of bounds: their count, and the largest
    # (an added token may have any id)
    top = max(vocab.values(), default=-1)
    if len(vocab) > cfg.vocab_size or top >= cfg.vocab_size:
        raise ValueError(f"{where}: {len(vocab)} tokens, the largest id {top}, more than the "
                         f"model's vocab_size={cfg.vocab_size}")
    tokenizing.check(tokenizer, where)  # a tokenizer that panics on plain text: ValueError


def read_gguf_checkpoint(path) -> Checkpoint:
    """A GGUF file (formats/gguf.py) as read_checkpoint reads a directory: its metadata as the
    config, every tensor checked by name and shape from the tensor table, the tokenizer it
    holds; only the small A_log tensors are read."""
    from .formats.gguf import read_gguf
    p = Path(path)
    g = read_gguf(p)
    try:
        cfg = ModelConfig.from_dict(g.config)
        weights = CheckpointTensors(check_tensors(cfg, normalize_names(g.tensors)),
                                    watch={head_name(cfg)})
        mtp = None
        if cfg.mtp_layers:
            infos = mtp_tensors(g.tensors)
            check_mtp_tensors(cfg, infos)
            mtp = CheckpointTensors(infos)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
    _check_values(cfg, weights)
    if g.tokenizer is not None:
        _check_tokenizer(g.tokenizer, cfg, f"{p} (its tokenizer)")
    gen = {} if g.eos is None else {"eos_token_id": g.eos}
    specials = {}  # the file names token ids; their text is what a template writes
    if g.tokenizer is not None and g.eos is not None and g.tokenizer.id_to_token(g.eos) is not None:
        specials["eos_token"] = g.tokenizer.id_to_token(g.eos)
    return Checkpoint(p, cfg, weights, g.tokenizer, gen, g.chat_template, mtp, g.stored_format,
                      None, "q8", specials)


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


def load(path, *, weights: str = "auto", kv: str = "int8", backend: str = "auto", threads=None,
         max_context: int = 4096, policy_cache: bool = True, quiet: bool = False,
         check_memory: bool = True, revision: str | None = None, download: bool = False,
         verbose: bool = False) -> Model:
    """Load a Qwen3.5 (dense, text) checkpoint into a `Model`: an HF-format directory, a GGUF
    file (llama.cpp's converter's `qwen35` files, any of their tensor types), a hub id
    ("Qwen/Qwen3.5-9B", from the local Hugging Face cache; `download=True` fetches it when the
    network allows; `revision` picks a branch, tag or commit), or "default": the bundled target
    with its draft model attached.

    weights: how the engine stores matrices: "f32", "bf16", "q8" or "q4"; "auto" (the default)
    lets the checkpoint decide (formats.auto_weights): "q4" for an MLX 4-bit file whose groups
    run as stored, "q8" for the rest (a float file; FP8, 8-bit, GPTQ/AWQ, GGUF: 4-bit matrices
    the engine runs as stored stay so in q8 too). A mode that rounds a pre-quantized file's
    values a second time says so with a warning (f32 never does: it widens them exactly).
    kv: "int8" (paged int8 KV cache, the default) or "f32".
    threads: engine worker threads; None lets the engine choose.
    max_context: the most tokens a sequence may hold (prompt + generated + tree).
    backend: "auto" (Metal on Apple silicon when built, else "cpu"), "cpu", "metal",
    "metal-emulated" / "sycl-emulated" (the Metal / SYCL kernels run on the CPU by the emulator:
    slow, for tests and kernel ports), "sycl"; available_backends() lists what this install has.
    policy_cache: keep the speculation policy's calibration across processes (policy_cache.py;
    also off with SAPWOOD_POLICY_CACHE=0).
    quiet: no progress bar (it shows on a terminal for loads over a second).
    check_memory: refuse, before reading any weight, a model whose estimated footprint
    (sapwood.estimate) exceeds the memory available (MemoryError naming both).
    verbose: print what is loaded (files, weights mode, the memory the engine will take) to
    stderr, one line a checkpoint; otherwise that line goes to the "sapwood.loading" logger at
    INFO (the CLI shows it).
    """
    backend = resolve_backend(backend)
    check_args(weights, kv, backend, threads, max_context)
    if isinstance(path, str) and path == "default":  # the bundled pair: target + attached draft
        model = load(_bundled("target"), weights=weights, kv=kv, backend=backend,
                     threads=threads, max_context=max_context, quiet=quiet, verbose=verbose)
        model.draft = load(_bundled("draft"), weights=weights, kv=kv, backend=backend,
                           threads=threads, max_context=max_context, quiet=quiet,
                           verbose=verbose)
        model.policy_cache = bool(policy_cache)
        return model
    from .hub import resolve_checkpoint

    # the checkpoint checked from its headers first (a config that the tensors contradict is
    # named as such), then its footprint, before any weight is read
    local = Path(os.path.expanduser(os.fspath(path)))
    ck = read_checkpoint(local if is_gguf(local) else
                         resolve_checkpoint(path, revision=revision, download=download))
    asked, weights = weights, ck.auto_weights if weights == "auto" else weights
    again = requantized(ck.weights.infos, weights)
    if again:  # no kernel runs them as stored: exact in f32, rounded again in q8/q4/bf16
        how = " (what weights='auto' picks for this format)" if asked == "auto" else ""
        warnings.warn(f"{ck.path.name}: {again} {ck.stored_format} tensors are rounded again "
                      f"for weights={weights!r}{how}; weights='f32' keeps their values exactly",
                      stacklevel=2)
    est = estimate_config(ck.config, weights=weights, kv=kv, max_context=max_context,
                          stored=ck.stored_matrices)
    if check_memory:
        check_fits(ck.config, est, str(ck.path))
    _warn_undecodable(ck)
    _announce(describe_load(ck, est), verbose)
    if not hasattr(_core, "Engine"):
        raise RuntimeError("this build of sapwood._core has no Engine; rebuild sapwood")
    nthreads = 0 if threads is None else threads
    with _progress(ck, quiet) as bar:
        ck.weights.on_bytes = bar.update
        try:
            engine = _core.Engine(engine_dims(ck.config), ck.weights, weights, kv, max_context,
                                  nthreads, backend)
            head = head_name(ck.config)
            amax = ck.weights.amax.get(head)
            if amax is None:  # an engine that did not stream (a test's stand-in)
                amax = _amax(ck.weights[head])
            _check_logit_bound(ck.config, ck.weights["model.norm.weight"], amax)
        finally:
            ck.weights.on_bytes = None
            ck.weights.close()
    model = Model(engine, ck.tokenizer, ck.config, ck.generation_config, ck.chat_template, ck.path,
                  weights=weights, kv=kv, backend=backend, max_context=max_context)
    model.special_tokens = dict(ck.special_tokens)
    model.policy_cache = bool(policy_cache)
    if ck.mtp_weights is not None and ck.config.mtp_layers == 1:
        # built on first use (Model.mtp), from the files: a load reads only what it runs
        infos = ck.mtp_weights.infos  # a reader per build: sequences may build theirs at once
        model.mtp_loader = lambda eng, nthreads: _core.MtpHead(
            eng, CheckpointTensors(infos), weights, kv, max_context, nthreads, backend)
    elif ck.mtp_weights is not None:  # vLLM cycles deeper heads by draft row; not done here
        model.mtp_unsupported = (f"{MTP_CONFIG_KEY}={ck.config.mtp_layers}: sapwood runs MTP "
                                 "heads of one layer")
    return model


def describe_load(ck: Checkpoint, est) -> str:
    """One line: the checkpoint, its files, how it is stored and loaded, and the memory the
    engine will take (memory.py's estimate, what check_memory compares with what is free)."""
    files = weight_files(ck.path)
    shown = files[0] if len(files) == 1 else f"{len(files)} shards ({files[0]}, ...)"
    stored = ck.stored_format or "/".join(sorted({i.dtype for i in ck.weights.infos.values()}))
    return (f"loading {ck.path} from {shown} ({_size(ck.weights.nbytes)} {stored}) as "
            f"weights={est.weights} kv={est.kv} max_context={est.max_context}: the engine will "
            f"take about {_size(est.total)}")


def _size(b: int) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.0f} MB"


def weight_files(d: Path) -> list:
    """The files a checkpoint's weights come from, as checkpoint_index read them (already
    validated there): a GGUF file itself, the single safetensors file, else the index's shards."""
    if d.is_file():  # GGUF
        return [d.name]
    if (d / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    return sorted(set(_read_json(d / INDEX_FILE, INDEX_FILE)["weight_map"].values()))


def _announce(line: str, verbose: bool) -> None:
    # the Python API stays quiet unless asked; the CLI asks through the logger (cli.py)
    if verbose:
        print(f"sapwood: {line}", file=sys.stderr, flush=True)
    else:
        log.info(line)


_undecodable_warned: set = set()  # checkpoints warned about: once each per process


def _warn_undecodable(ck: Checkpoint) -> None:
    """Warn (once per checkpoint) when the model can produce ids the tokenizer has no token for:
    vocab_size past the tokenizer's tokens, added ones included (Qwen pads its embedding table
    to a round size). Such ids decode to nothing, so their text silently goes missing."""
    if ck.tokenizer is None or str(ck.path) in _undecodable_warned:
        return
    have = set(ck.tokenizer.get_vocab(with_added_tokens=True).values())
    missing = ck.config.vocab_size - len(have)  # read_checkpoint: every id < vocab_size
    if missing <= 0:
        return
    first = next(i for i in range(ck.config.vocab_size) if i not in have)
    _undecodable_warned.add(str(ck.path))
    warnings.warn(f"{ck.path.name}: the model's vocab_size={ck.config.vocab_size} exceeds the "
                  f"tokenizer's {len(have)} tokens: {missing} ids the model can produce (the first "
                  f"is id {first}) have no text and decode to nothing (a trained model seldom "
                  "picks them)", stacklevel=3)


def _progress(ck: Checkpoint, quiet: bool):
    """A tqdm bar over the bytes read, on stderr; on a terminal only, after the first second."""
    from tqdm import tqdm

    return tqdm(total=ck.weights.nbytes, unit="B", unit_scale=True, desc=f"loading {ck.path.name}",
                file=sys.stderr, delay=1.0, leave=False, disable=True if quiet else None)
