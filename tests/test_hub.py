"""hub.resolve_checkpoint against a fake Hugging Face cache in tmp_path, laid out as
huggingface_hub writes it (models--Org--Name/{blobs,refs,snapshots}); no network."""
import sys

import pytest

from sapwood.hub import ALLOW_PATTERNS, resolve_checkpoint

pytest.importorskip("huggingface_hub")

MAIN = "a" * 40
OLD = "b" * 40


def fake_repo(cache, repo_id="Org/Name"):
    """Two snapshots (refs/main -> MAIN, tag v1 -> OLD), files as symlinks into blobs/."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for commit, text in ((MAIN, '{"v": 2}'), (OLD, '{"v": 1}')):
        blob = repo / "blobs" / (commit[:8] + "blob")
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_text(text)
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").symlink_to(f"../../blobs/{blob.name}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)  # no newline: huggingface_hub reads it raw
    (repo / "refs" / "v1").write_text(OLD)
    return repo


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    fake_repo(cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no stray ./Org/Name directory shadows the id
    return cache


def test_id_resolves_to_the_main_snapshot(cache):
    got = resolve_checkpoint("Org/Name")
    assert got == cache / "models--Org--Name" / "snapshots" / MAIN
    assert (got / "config.json").read_text() == '{"v": 2}'


@pytest.mark.parametrize("revision", [OLD, "v1"])
def test_revision_resolves_to_its_snapshot(cache, revision):
    got = resolve_checkpoint("Org/Name", revision=revision)
    assert got == cache / "models--Org--Name" / "snapshots" / OLD
    assert (got / "config.json").read_text() == '{"v": 1}'


def test_missing_id_says_how_to_fetch_it(cache):
    with pytest.raises(ValueError) as e:
        resolve_checkpoint("Qwen/Qwen3.5-9B")
    msg = str(e.value)
    for part in ("'Qwen/Qwen3.5-9B' is not in the Hugging Face cache", str(cache),
                 "HF_HUB_CACHE", "HF_HOME", "hf download Qwen/Qwen3.5-9B",
                 "huggingface-cli download Qwen/Qwen3.5-9B", "download=True", "--download"):
        assert part in msg


@pytest.mark.parametrize("revision", ["c" * 40, "dev"])
def test_uncached_revision_is_named(cache, revision):
    with pytest.raises(ValueError, match=f"revision '{revision}' of 'Org/Name' is not in the "
                                         f"Hugging Face cache.*--revision {revision}"):
        resolve_checkpoint("Org/Name", revision=revision)


def test_local_directory_wins(cache, tmp_path):
    (tmp_path / "Org" / "Name").mkdir(parents=True)
    assert resolve_checkpoint("Org/Name").resolve() == (tmp_path / "Org" / "Name").resolve()
    assert resolve_checkpoint(tmp_path / "Org" / "Name") == tmp_path / "Org" / "Name"


def test_hf_home_locates_the_cache(tmp_path, monkeypatch):
    fake_repo(tmp_path / "home" / "hub")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("Org/Name") == tmp_path / "home/hub/models--Org--Name/snapshots" / MAIN


@pytest.mark.parametrize("name", ["no-such-dir", "a/b/c", "./x/y", "Org/-bad", "Org/a..b", ""])
def test_neither_directory_nor_repo_id(cache, name):
    with pytest.raises(ValueError, match="not a directory or a Hugging Face repo id"):
        resolve_checkpoint(name)


def test_a_file_is_not_a_checkpoint(cache, tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file, not a checkpoint directory"):
        resolve_checkpoint("w.safetensors")


def test_without_huggingface_hub(cache, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(ValueError, match="pip install huggingface_hub"):
        resolve_checkpoint("Org/Name")
    (tmp_path / "local").mkdir()
    assert resolve_checkpoint("local") == tmp_path.joinpath("local").relative_to(tmp_path)


def test_download_asks_snapshot_download(cache, monkeypatch):
    import huggingface_hub

    seen = {}

    def fake(repo_id, **kw):  # stands in for the network
        seen.update(kw, repo_id=repo_id)
        return str(cache / "x")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_checkpoint("Org/Other", revision="v2", download=True) == cache / "x"
    assert seen == {"repo_id": "Org/Other", "revision": "v2", "local_files_only": False,
                    "cache_dir": str(cache), "allow_patterns": ALLOW_PATTERNS}
    resolve_checkpoint("Org/Other")
    assert seen["local_files_only"] is True


def test_load_and_cli_take_a_hub_id(tmp_path, monkeypatch, capsys):
    """sapwood.load, `sapwood inspect` and `--model` resolve an id from the cache, offline."""
    import shutil

    import sapwood
    from sapwood.cli import main
    from sapwood.testing import make_tiny_checkpoint

    cache = tmp_path / "hub"
    snap = fake_repo(cache, "Qwen/Tiny") / "snapshots" / MAIN
    (snap / "config.json").unlink()
    src = tmp_path / "src"
    make_tiny_checkpoint(src, seed=4)
    for f in src.iterdir():
        shutil.copy(f, snap / f.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    m = sapwood.load("Qwen/Tiny", max_context=64, quiet=True)
    assert m.path == snap and m.generate([1, 2, 3], max_tokens=4, verify="off").tokens == \
        sapwood.load(src, max_context=64).generate([1, 2, 3], max_tokens=4, verify="off").tokens
    assert main(["inspect", "Qwen/Tiny", "--weights", "q4"]) == 0
    out = capsys.readouterr().out
    assert str(snap) in out and "weights='q4'" in out and "total" in out
    assert main(["generate", "--model", "Qwen/Tiny", "--max-tokens", "3", "--json", "hi"]) == 0
    assert main(["inspect", "Qwen/Missing"]) == 1
    assert "hf download Qwen/Missing" in capsys.readouterr().err
