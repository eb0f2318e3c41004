"""What loading says: one line a checkpoint (its files, the weights mode, the memory the engine
will take) on stderr for the CLI and for load(verbose=True), only logged otherwise; and one
warning when the model can produce ids its tokenizer cannot decode."""
import logging
import warnings

import pytest
from test_loading import shard

import sapwood
from sapwood.cli import main
from sapwood.memory import estimate
from sapwood.testing import make_tiny_checkpoint, make_tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    p = tmp_path_factory.mktemp("msg") / "m"
    make_tiny_checkpoint(p, seed=1)
    return p


def mb(b):
    return f"{b / 1e6:.0f} MB"


def test_the_python_api_is_quiet_unless_asked(ckpt, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="sapwood.loading"):
        sapwood.load(ckpt, max_context=256)
    assert capsys.readouterr().err == ""
    [rec] = [r for r in caplog.records if r.name == "sapwood.loading"]
    assert str(ckpt) in rec.getMessage() and "weights=q8" in rec.getMessage()


def test_verbose_names_the_file_the_mode_and_the_estimate(ckpt, capsys):
    sapwood.load(ckpt, weights="q4", max_context=512, verbose=True)
    err = capsys.readouterr().err.strip().splitlines()
    total = estimate(ckpt, weights="q4", max_context=512).total
    assert len(err) == 1 and err[0].startswith(f"sapwood: loading {ckpt} from model.safetensors")
    assert "F32" in err[0] and "weights=q4 kv=int8 max_context=512" in err[0]
    assert err[0].endswith(f"the engine will take about {mb(total)}")


def test_verbose_counts_the_shards(ckpt, tmp_path, capsys):
    shard(ckpt, tmp_path / "sh")
    sapwood.load(tmp_path / "sh", max_context=256, verbose=True)
    err = capsys.readouterr().err
    assert "from 2 shards (model-00001-of-00002.safetensors, ...)" in err


def test_the_cli_says_what_it_loads(ckpt, capsys):
    assert main(["generate", "--model", str(ckpt), "--max-tokens", "2", "--max-context", "256",
                 "--verify", "off", "x"]) == 0
    err = capsys.readouterr().err
    total = estimate(ckpt, max_context=256).total
    assert f"sapwood: loading {ckpt} from model.safetensors" in err
    assert f"the engine will take about {mb(total)}" in err
    sapwood.load(ckpt, max_context=256)  # the CLI's handler is gone once it returns
    assert capsys.readouterr().err == ""


def test_undecodable_ids_warn_once(tmp_path):
    make_tiny_checkpoint(tmp_path / "c", seed=1, vocab=256)
    make_tokenizer(250).save(str(tmp_path / "c" / "tokenizer.json"))  # ids 250..255: no token
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")  # count every one: the once is sapwood's own
        sapwood.load(tmp_path / "c", max_context=256)
        sapwood.load(tmp_path / "c", max_context=256)
    said = [str(w.message) for w in got if "decode" in str(w.message)]
    assert len(said) == 1
    assert "vocab_size=256" in said[0] and "250 tokens" in said[0] and "6 ids" in said[0]
    assert "the first is id 250" in said[0]


def test_a_full_tokenizer_does_not_warn(ckpt):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        sapwood.load(ckpt, max_context=256)
    assert not [w for w in got if "decode" in str(w.message)]
