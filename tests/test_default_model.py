"""The bundled default pair: loads offline through the same code as any checkpoint, has its
draft attached, and generates identically in every verify mode (greedy and sampled)."""
import json

import pytest

import sapwood
from sapwood.loading import DEFAULT_DIR


@pytest.fixture(scope="module")
def default():
    return sapwood.load("default", max_context=1024)


def test_bundled_files_and_recipe():
    for part in ("target", "draft"):
        d = DEFAULT_DIR / part
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (d / f).is_file(), f"{d / f} missing"
    recipe = json.loads((DEFAULT_DIR / "RECIPE.json").read_text())
    # how the shipped weights were made: seed, data list, tokenizer, both models' configs
    assert isinstance(recipe["seed"], int)
    assert len(recipe["corpus"]["list_sha256"]) == 64
    assert recipe["tokenizer"]["vocab_size"] == 4096
    assert {"target", "draft"} <= set(recipe)


def test_default_has_its_draft_and_one_tokenizer(default):
    assert default.draft is not None
    assert default.draft.config.vocab_size == default.config.vocab_size
    assert default.config.num_layers > default.draft.config.num_layers
    assert default.decode(default.encode("def merge(a, b):")) == "def merge(a, b):"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_identical_in_every_verify_mode(default, temperature):
    prompt = "def merge(a, b):\n"
    runs = {}
    for verify, width, drafter in [("off", None, None), ("chain", None, None), ("tree", 4, None),
                                   ("tree", 16, None), ("auto", None, None),
                                   ("auto", None, "lookup"), ("chain", None, "default")]:
        r = default.generate(prompt, max_tokens=48, temperature=temperature, seed=7,
                             verify=verify, width=width, drafter=drafter)
        runs[(verify, width, drafter)] = r
    base = runs[("off", None, None)]
    for key, r in runs.items():
        assert r.tokens == base.tokens, key
        assert r.text == base.text
    if temperature == 0.0:  # the bundled draft predicts the target: chain rounds keep rows
        assert runs[("chain", None, None)].stats.tokens_per_cycle > 1.5


def test_cache_prompt_restores_the_draft_models_prompt_too(default):
    """cache_prompt=True: an identical prompt's committed state is restored in the target and
    in the draft model (their snapshots are reused, not retaken), and the restored draft
    proposes the very trees a prefilled one does; restored tokens are not timed as a catch-up."""
    prompt = "def merge(a, b):\n    result = []\n"
    ids = default.encode(prompt)

    def run(cache):
        trees = []
        r = default.generate(prompt, verify="chain", adapt_rows=False, max_tokens=32,
                             cache_prompt=cache,
                             on_round=lambda t, p, s: trees.append(([int(x) for x in t.tokens], list(p))))
        return r.tokens, trees

    reference = run(False)
    first = run(True)
    assert default.draft.prompt_cached(ids) and default.prompt_cached(ids)
    snaps = default._prompt_cache[1], default.draft._prompt_cache[1]
    from sapwood.policy import band_of
    costs = default.speculation_policy(default.resolve_drafter(None)).costs
    timed = list(costs.t.get((band_of(len(ids)), "catch_up", 0), []))
    second = run(True)
    assert default._prompt_cache[1] is snaps[0] and default.draft._prompt_cache[1] is snaps[1]  # restored
    assert list(costs.t.get((band_of(len(ids)), "catch_up", 0), [])) == timed
    assert len(reference[1]) > 1 and reference == first == second
    assert not default.draft.prompt_cached(ids[:-1])
