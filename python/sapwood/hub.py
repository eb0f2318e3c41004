"""Checkpoint names: a local directory, or a Hugging Face repo id ("Qwen/Qwen3.5-9B") found in
the local HF cache (downloaded into it only when asked: loading never touches the network
by surprise)."""
from __future__ import annotations

import os
import re
from pathlib import Path

# what a checkpoint directory needs: config, weights, tokenizer, chat template (not the
# .bin/.pt/.gguf copies many repos carry as well)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"]

# the Hub's rule for "org/name": letters, digits, - _ . ; no leading/trailing - or ., no -- or ..
_PART = r"(?![-.])(?!.*(?:--|\.\.))[A-Za-z0-9_.-]{1,96}(?<![-.])"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")


def hf_cache_dir() -> Path:
    """The HF hub cache as huggingface_hub would place it, from the environment now: it reads
    HF_HUB_CACHE/HF_HOME once at import, which would miss a later change (tests, a CLI
    flag that sets them)."""
    env = os.environ
    path = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")  # the latter: legacy
    if not path:
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
            "huggingface")
        path = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(path)))


def resolve_checkpoint(name_or_path, *, revision: str | None = None,
                       download: bool = False) -> Path:
    """The checkpoint directory (or GGUF file) `name_or_path` names.

    An existing local directory or GGUF file is returned as is (it wins over a repo id of the same
    spelling). Otherwise an "org/name" repo id resolves to its snapshot in the HF cache
    (revision: a branch, tag or commit; None: main); download=True fetches what is missing.
    ValueError says what was looked for, where, and how to fetch it.
    """
    name = os.fspath(name_or_path)
    p = Path(os.path.expanduser(name))
    if name and p.is_dir():  # Path("") is ".": an empty name is a mistake, not the cwd
        return p
    if name and p.exists():
        from .formats.gguf import is_gguf
        if is_gguf(p):  # a GGUF file is a checkpoint of one file (formats/gguf.py)
            return p
        raise ValueError(f"{name!r} is a file, not a checkpoint directory or a GGUF file")
    if not _REPO_ID.fullmatch(name):
        raise ValueError(f"{name!r} is not a directory or a Hugging Face repo id (org/name)")
    try:  # only here: a local directory needs no huggingface_hub
        import huggingface_hub
        from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError,
                                           LocalEntryNotFoundError, RepositoryNotFoundError,
                                           RevisionNotFoundError)
    except ImportError:
        raise ValueError(f"{name!r} is not a local directory; to resolve it as a Hugging Face "
                         "repo id: pip install huggingface_hub") from None
    cache = hf_cache_dir()
    what = f"{name!r}" if revision is None else f"revision {revision!r} of {name!r}"
    rev = "" if revision is None else f" --revision {revision}"
    fetch = (f"Fetch it with `hf download {name}{rev}` (older huggingface_hub: "
             f"`huggingface-cli download {name}{rev}`), or pass download=True (`--download` "
             "on the command line)")
    try:
        return Path(huggingface_hub.snapshot_download(
            name, revision=revision, local_files_only=not download, cache_dir=str(cache),
            allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError as e:
        if type(e).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 1.x only
            raise ValueError(f"{what} is only partly in the Hugging Face cache {cache} (an "
                             f"interrupted download?): {e} {fetch}") from None
        if not download:
            raise ValueError(
                f"{what} is not in the Hugging Face cache {cache} (the cache is $HF_HUB_CACHE, "
                "else $HF_HOME/hub, else ~/.cache/huggingface/hub), and there is no local "
                f"directory {name!r}. {fetch}") from None
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise ValueError(f"could not download {what} into {cache}{offline}: {e}") from None
    except RevisionNotFoundError:
        raise ValueError(f"the Hub has no {what}") from None
    except GatedRepoError:  # a RepositoryNotFoundError: caught first
        raise ValueError(f"{name!r} is gated: accept its terms on huggingface.co and log in "
                         "(hf auth login)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"no local directory {name!r}, and the Hub has no repo {name!r} "
                         "(or it is private: log in with hf auth login)") from None
    except HfHubHTTPError as e:  # the Hub down, rate limits, ...
        raise ValueError(f"could not download {what}: {e}") from None
