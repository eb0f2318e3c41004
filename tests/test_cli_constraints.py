"""`sapwood generate --json-schema FILE|JSON / --regex / --grammar` over generate()'s
constraints (grammar.py)."""
import json
import re

import sapwood
from sapwood.cli import main
from sapwood.testing import make_tiny_checkpoint

SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "boolean"}},
          "required": ["k", "n"], "additionalProperties": False}


def test_json_schema_from_a_file_and_from_text(tmp_path, capsys):
    make_tiny_checkpoint(tmp_path / "m", seed=4)
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    outs = []
    for value in (str(tmp_path / "s.json"), json.dumps(SCHEMA)):
        assert main(["generate", "x", "--model", str(tmp_path / "m"), "--max-tokens", "40",
                     "--temperature", "0.9", "--seed", "2", "--verify", "tree", "--width", "6",
                     "--drafter", "lookup", "--json-schema", value, "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["tokens"] == outs[1]["tokens"]
    doc = json.loads(outs[0]["text"])
    assert doc["k"] in ("a", "b") and isinstance(doc["n"], bool)
    want = sapwood.load(tmp_path / "m").generate("x", max_tokens=40, temperature=0.9, seed=2,
                                                 verify="off", json_schema=SCHEMA)
    assert outs[0]["tokens"] == want.tokens


def test_regex_and_grammar_options(tmp_path, capsys):
    make_tiny_checkpoint(tmp_path / "m", seed=4)
    assert main(["generate", "x", "--model", str(tmp_path / "m"), "--max-tokens", "20",
                 "--regex", "[0-9]{4}", "--json"]) == 0
    assert re.fullmatch("[0-9]{4}", json.loads(capsys.readouterr().out)["text"])
    (tmp_path / "g.lark").write_text('start: "on" | "off"')
    assert main(["generate", "x", "--model", str(tmp_path / "m"), "--max-tokens", "20",
                 "--grammar", str(tmp_path / "g.lark"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("on", "off")


def test_bad_constraints_are_one_line_errors(tmp_path, capsys):
    make_tiny_checkpoint(tmp_path / "m", seed=4)
    for bad, named in ((["--json-schema", "{nope"], "--json-schema"),
                       (["--json-schema", '{"type": "frobnicate"}'], "json_schema"),
                       (["--regex", "a(", "--grammar", "start: \"a\""], "give one of")):
        assert main(["generate", "x", "--model", str(tmp_path / "m"), *bad]) == 1
        cap = capsys.readouterr()
        errors = [ln for ln in cap.err.splitlines() if "error" in ln]  # (past the load line)
        assert cap.out == "" and len(errors) == 1 and named in errors[0], cap.err
