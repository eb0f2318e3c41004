"""The CLI reports every failure on one line with exit code 1 (2 for usage), no traceback
unless --debug (issue 38: a bad config, a missing tokenizer, non-UTF-8 input and a closed
stdout ended in tracebacks)."""
import json
import subprocess
import sys

import pytest

from sapwood.cli import main
from sapwood.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    p = tmp_path_factory.mktemp("m")
    make_tiny_checkpoint(p, seed=4)
    return p


def one_error_line(err: str) -> str:
    # the line saying what loads (cli._loading_shown) comes before a failure past the load
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("sapwood: loading ")]
    assert len(lines) == 1 and lines[0].startswith("sapwood: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_bad_config_one_line(ckpt, tmp_path, capsys):
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = "false"
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "x", "--model", str(d)]) == 1
    assert "tie_word_embeddings" in one_error_line(capsys.readouterr().err)


def test_missing_tokenizer_one_line(ckpt, tmp_path, capsys):
    import shutil

    d = tmp_path / "notok"
    shutil.copytree(ckpt, d)
    (d / "tokenizer.json").unlink()
    assert main(["generate", "some text", "--model", str(d), "--max-tokens", "2"]) == 1
    assert "no tokenizer.json" in one_error_line(capsys.readouterr().err)


def test_debug_shows_the_traceback(ckpt, tmp_path):
    with pytest.raises(ValueError, match="max_tokens"):
        main(["--debug", "generate", "x", "--model", str(ckpt), "--max-tokens", "0"])


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate"])
    assert e.value.code == 2


def _run(args, **kw):
    return subprocess.run([sys.executable, "-m", "sapwood", *args], capture_output=True, timeout=120,
                          **kw)


def test_non_utf8_stdin_one_line(ckpt):
    r = _run(["generate", "-", "--model", str(ckpt), "--max-tokens", "2"], input=b"ab\xff\xfe")
    assert r.returncode == 1
    assert "not UTF-8" in one_error_line(r.stderr.decode())


def test_closed_stdout_one_line(ckpt):
    p = subprocess.Popen([sys.executable, "-m", "sapwood", "generate", "hello", "--model", str(ckpt),
                          "--max-tokens", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader goes away before anything is written
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 1
    assert "broken pipe" in one_error_line(err)
