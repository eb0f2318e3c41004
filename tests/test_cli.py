"""The command line over the generate API (run in-process through main(argv))."""
import json
import re

import numpy as np
import pytest

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


@pytest.mark.parametrize("flag,name,value", [("--repetition-penalty", "repetition_penalty", 3.0),
                                             ("--presence-penalty", "presence_penalty", 2.0),
                                             ("--frequency-penalty", "frequency_penalty", 1.5)])
def test_penalties_reach_generate(tmp_path, capsys, flag, name, value):
    """Each penalty option gives the API call's tokens with that penalty, which differ from
    the tokens without it (sampled: on this tiny model greedy picks do not move)."""
    make_tiny_checkpoint(tmp_path / "m", seed=4)
    prompt, kw = "def f(x): return f(x)", dict(max_tokens=24, drafter="lookup", temperature=1.0,
                                               seed=3)
    assert main(["generate", prompt, "--model", str(tmp_path / "m"), "--max-tokens", "24",
                 "--drafter", "lookup", "--temperature", "1", "--seed", "3", flag, str(value),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = sapwood.load(tmp_path / "m")
    assert out["tokens"] == model.generate(prompt, **kw, **{name: value}).tokens
    assert out["tokens"] != model.generate(prompt, **kw).tokens


@pytest.mark.parametrize("bad,named", [(["--top-p", "2"], "top_p"),
                                       (["--presence-penalty", "9"], "presence_penalty"),
                                       (["--drafter", "/no/such/draft"], "unknown drafter"),
                                       (["--max-tokens", "0"], "max_tokens")])
def test_a_bad_value_is_reported_before_any_output(tmp_path, capsys, bad, named):
    make_tiny_checkpoint(tmp_path / "m", seed=4)
    assert main(["generate", "abc", "--model", str(tmp_path / "m"), *bad]) == 1
    cap = capsys.readouterr()
    # the line saying what loads (a drafter is checked once the model has loaded) aside
    errs = [x for x in cap.err.splitlines() if not x.startswith("sapwood: loading ")]
    assert cap.out == "" and named in cap.err and len(errs) == 1


def test_sampling_values_are_checked_before_the_model_loads(tmp_path, capsys):
    # the checkpoint does not exist: the error is the option's, found without loading
    assert main(["generate", "abc", "--model", str(tmp_path / "none"), "--top-k", "-1"]) == 1
    assert "top_k" in capsys.readouterr().err


# Runs `sapwood` with the model's stream watched: "started" on stderr once the second token is
# decoded (the command has the first), so that Ctrl-C lands mid-generation, not during load.
_WATCHED = r"""
import signal
import sys
import sapwood
from sapwood.cli import main

# Python leaves SIGINT ignored when it starts ignored (a test run in a background job)
signal.signal(signal.SIGINT, signal.default_int_handler)

generate = sapwood.Model.generate

class Watched:
    def __init__(self, stream):
        self.stream, self.n = stream, 0
        self.stats = stream.stats
    def __iter__(self):
        return self
    def __next__(self):
        tok = next(self.stream)
        self.n += 1
        if self.n == 2:
            print("started", file=sys.stderr, flush=True)
        return tok
    def close(self):
        self.stream.close()

sapwood.Model.generate = lambda self, *a, **kw: Watched(generate(self, *a, **kw))
sys.exit(main(sys.argv[1:]))
"""


def _interrupted(ckpt, *extra):
    """Run generate with no end in sight, Ctrl-C it once output has started: (stdout, stderr)."""
    import signal
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", _WATCHED, "generate", "abc", "--model", str(ckpt),
                          "--max-context", str(1 << 20), "--max-tokens", str(1 << 20),
                          "--drafter", "lookup", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = p.stderr.readline()
        while line.startswith(b"sapwood: loading "):  # what loads comes first
            line = p.stderr.readline()
        assert line == b"started\n"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 130, err.decode()
    return out.decode(), err.decode()


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    """The tiny checkpoint with no end-of-sequence token: it generates until stopped."""
    p = tmp_path_factory.mktemp("endless")
    make_tiny_checkpoint(p, seed=4)
    (p / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    return p


def test_ctrl_c_prints_the_stats_so_far(endless):
    out, err = _interrupted(endless)
    assert out.startswith("abc") and "Traceback" not in err
    m = re.search(r"\[interrupted\] (\d+) tokens, .* tok/s .* tokens/cycle", err)
    assert m and int(m.group(1)) >= 1, err


def test_ctrl_c_with_json_prints_one_object(endless):
    out, err = _interrupted(endless, "--json")
    r = json.loads(out)  # the whole output is one JSON object
    assert r["finish_reason"] == "interrupted" and len(r["tokens"]) >= 1, r
    assert r["stats"]["tokens"] == len(r["tokens"]) and r["stats"]["cycles"] >= 1
    assert r["stats"]["decode_s"] > 0 and r["stats"]["prompt_tokens"] == 3
    assert r["text"] == sapwood.load(endless).decode(r["tokens"])
