"""The command line over the generate API (run in-process through main(argv))."""
import json

import numpy as np

import sapwood
from sapwood.cli import main
from sapwood.testing import make_tiny_checkpoint


def test_generate_json_matches_api(tmp_path, capsys):
    make_tiny_checkpoint(tmp_path / "m", seed=4)
    argv = ["generate", "def f(x):", "--model", str(tmp_path / "m"), "--max-tokens", "12",
            "--drafter", "lookup", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    want = sapwood.load(tmp_path / "m").generate("def f(x):", max_tokens=12, drafter="lookup")
    assert out["tokens"] == want.tokens and out["text"] == want.text
    assert {"tokens_per_s", "tokens_per_cycle", "wide_cycles"} <= set(out["stats"])


def test_generate_streams_text_and_stats(tmp_path, capsys):
    make_tiny_checkpoint(tmp_path / "m", seed=4)
    assert main(["generate", "abc", "--model", str(tmp_path / "m"), "--max-tokens", "8",
                 "--verify", "tree", "--width", "4"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("abc") and "tokens/cycle" in cap.err and "tok/s" in cap.err


def test_bad_arguments_give_an_error_not_a_traceback(tmp_path, capsys):
    make_tiny_checkpoint(tmp_path / "m", seed=4)
    assert main(["generate", "x", "--model", str(tmp_path / "m"), "--max-tokens", "0"]) == 1
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(tmp_path / "nope")]) == 1
