"""Convert a Qwen3.5 checkpoint (HF layout, e.g. sapwood's bundled default) to GGUF with
llama.cpp's own converter, for `sapwood bench peers --gguf`.

    python scripts/convert_gguf.py MODEL_DIR LLAMA_CPP_DIR --outtype q8_0 --outfile target-q8_0.gguf
        [--keep-mtp]

--keep-mtp keeps the checkpoint's MTP head (`mtp.*`, the bundled target has one) as llama.cpp's
NextN layer, for its `--spec-type draft-mtp`; without it the head is left out (--no-mtp), as the
peers benchmark wants.

LLAMA_CPP_DIR is a llama.cpp source tree, e.g. the one vendored in llama-cpp-python's sdist
(`pip download --no-binary :all: --no-deps llama-cpp-python`, then vendor/llama.cpp), so the
converter matches the library the benchmark loads. Needs torch, numpy and safetensors.

One adaptation, outside the weights: llama.cpp recognises a BPE pre-tokenizer by hashing the
tokenization of a fixed text and looking the hash up in a table of published models. The bundled
tokenizer is our own byte-level BPE, so it is not in that table; it uses the GPT-2 byte-level
split, so the converter is told "gpt-2" for a hash it does not know. The benchmark feeds token
ids, so llama.cpp's tokenizer never runs in the comparison.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("llama_cpp", type=Path, help="llama.cpp source tree (has convert_hf_to_gguf.py)")
    ap.add_argument("--outtype", default="q8_0", choices=["f32", "f16", "bf16", "q8_0"])
    ap.add_argument("--outfile", type=Path, required=True)
    ap.add_argument("--keep-mtp", action="store_true", help="keep the MTP head (llama.cpp draft-mtp)")
    a = ap.parse_args(argv)
    conv = a.llama_cpp / "convert_hf_to_gguf.py"
    if not conv.is_file():
        ap.error(f"{conv} not found: LLAMA_CPP_DIR must be a llama.cpp source tree")
    sys.path[:0] = [str(a.llama_cpp / "gguf-py"), str(a.llama_cpp)]
    import convert_hf_to_gguf  # noqa: E402  (llama.cpp's converter, from the tree given)
    from conversion.base import TextModel  # noqa: E402

    known = TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:  # our own BPE: GPT-2 byte-level pre-tokenization
            return "gpt-2"

    TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", str(a.model), "--outtype", a.outtype, "--outfile", str(a.outfile)]
    if not a.keep_mtp:
        sys.argv.append("--no-mtp")
    convert_hf_to_gguf.main()
    print(f"wrote {a.outfile}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
