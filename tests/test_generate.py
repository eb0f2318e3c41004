"""Speculative generation: identical tokens in every verify mode, width and drafter, greedy and
sampled; the tree's prefix property; the decoder's use of the policy; bad input. The policy's
own choices are tests/test_speculation_policy.py's."""
import numpy as np
import pytest

import sapwood
from sapwood.drafters import Lattice, LookupDrafter
from sapwood.generate import DecodeConfig, Decoder
from sapwood.policy import Acceptance, Policy, PolicyParams, Request, band_of
from sapwood.testing import make_tiny_checkpoint, random_lattice
from sapwood.tree import chain, grow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    make_tiny_checkpoint(root / "target", seed=1, layers=4)
    make_tiny_checkpoint(root / "draft", seed=2, layers=2, hidden=32)
    make_tiny_checkpoint(root / "other", seed=2, layers=2, hidden=32, vocab=300)
    target = sapwood.load(root / "target", max_context=512)
    target.generation_config["eos_token_id"] = []  # random models hit eos early; tests set it
    return target, root


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 240, n)]


MODES = [("off", None), ("chain", None), ("auto", None)] + [("tree", w) for w in range(1, 17)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("drafter", ["self", "draft", "lookup"])
@pytest.mark.parametrize("n_prompt", [1, 9, 40])
def test_identical_tokens_across_modes(models, drafter, temperature, n_prompt):
    """The target drafting for itself makes long accepted paths (max_tokens then cuts mid-tree);
    a different small model and prompt lookup make short ones."""
    target, root = models
    d = {"self": str(root / "target"), "draft": str(root / "draft"), "lookup": "lookup"}[drafter]
    p = prompt(n_prompt, seed=n_prompt)
    runs = {}
    for verify, width in MODES:
        r = target.generate(p, max_tokens=37, temperature=temperature, top_k=50, seed=5,
                            drafter=d, verify=verify, width=width)
        runs[(verify, width)] = r
    for verify in ("chain", "auto"):  # the fixed draft length as well as the adaptive one
        runs[(verify, "rows=8")] = target.generate(p, max_tokens=37, temperature=temperature,
                                                   top_k=50, seed=5, drafter=d, verify=verify,
                                                   adapt_rows=False)
    base = runs[("off", None)].tokens
    assert len(base) == 37
    for key, r in runs.items():
        assert r.tokens == base, f"{key} differs from plain decoding"
        assert r.finish_reason == runs[("off", None)].finish_reason
    if drafter == "self" and temperature == 0.0:
        # paths were long: the fixed draft length's chain (the adaptive one's depth follows
        # measured costs, so it depends on the machine's load)
        assert runs[("chain", "rows=8")].stats.tokens_per_cycle > 4


def test_identical_tokens_with_penalties_and_top_p(models):
    target, root = models
    p = prompt(12, seed=3)
    kw = dict(max_tokens=30, temperature=1.1, top_p=0.9, min_p=0.02, seed=9,
              repetition_penalty=1.3, presence_penalty=0.2, drafter=str(root / "target"))
    outs = [target.generate(p, verify=v, width=w, **kw) for v, w in [("off", None), ("chain", None), ("tree", 8), ("auto", None)]]
    assert all(o.tokens == outs[0].tokens for o in outs)
    assert outs[2].stats.wide_cycles == 0  # penalties: never wide


def test_stop_ids_and_max_tokens(models):
    target, root = models
    p = prompt(20, seed=4)
    full = target.generate(p, max_tokens=40, verify="off").tokens
    stop_tok = full[17]
    first = full.index(stop_tok)
    target.generation_config["eos_token_id"] = stop_tok
    try:
        for v, w in [("off", None), ("chain", None), ("tree", 16)]:
            r = target.generate(p, max_tokens=40, verify=v, width=w, drafter=str(root / "target"))
            assert r.tokens == full[:first] and r.finish_reason == "stop"
    finally:
        target.generation_config["eos_token_id"] = []
    for n in [1, 2, 5, 13]:
        r = target.generate(p, max_tokens=n, verify="chain", drafter=str(root / "target"))
        assert r.tokens == full[:n] and r.finish_reason == "length"


@pytest.mark.parametrize("verify,width", [("chain", None), ("tree", 16), ("auto", None)])
def test_rounds_draft_no_more_rows_than_the_request_can_emit(models, verify, width):
    # a round emits its accepted rows and one pick: near max_tokens or the context's end the
    # rows past that are drafted and verified for nothing (the target drafting for itself
    # keeps every row). max_tokens 100 with the context of 64: the context bounds the end.
    target, root = models
    small = sapwood.load(root / "target", max_context=64)
    small.generation_config["eos_token_id"] = []
    p = prompt(20, seed=5)
    for n in [2, 7, 13, 30, 100]:
        emitted, deepest = [1], []

        def on_round(tree, path, seconds):
            room = small.max_context - (len(p) + emitted[0] - 1)  # the root is not committed
            deepest.append((int(tree.depth.max()), min(room, n - emitted[0]) - 1))
            emitted[0] += len(path)

        r = small.generate(p, max_tokens=n, verify=verify, width=width,
                           drafter=str(root / "target"), on_round=on_round)
        assert r.tokens == target.generate(p, max_tokens=n, verify="off").tokens[:len(r.tokens)]
        assert r.finish_reason == ("context" if n == 100 else "length")
        assert all(depth <= can for depth, can in deepest), (n, deepest)
        assert deepest[-1][0] == deepest[-1][1]  # the last round drafts what is left, no less


def test_sampled_drafts_follow_the_target_sample(models):
    """A draft that is the target itself proposes, when sampling, the target's own keyed sample
    (the chain follows the sampler's noise): nearly every row is accepted. A greedy chain at
    the same temperature is accepted far less often, so this fails if the coupling is lost."""
    target, root = models
    # 8 rows every round (adapt_rows=False): the draft length policy, which starts a fresh band
    # short and carries what earlier tests timed, is not what this tests
    p = prompt(12, seed=4)
    kw = dict(max_tokens=60, temperature=0.8, seed=9, verify="chain", adapt_rows=False)
    coupled = target.generate(p, drafter=str(root / "target"), **kw)
    assert coupled.stats.tokens_per_cycle >= 0.9 * 9  # 8 rows + the root's pick
    greedy = target.resolve_drafter(str(root / "target"))
    greedy.set_sampling = lambda temperature, seed: None  # stays greedy
    plain = target.generate(p, drafter=greedy, **kw)
    assert plain.tokens == coupled.tokens
    assert plain.stats.tokens_per_cycle < 0.6 * coupled.stats.tokens_per_cycle


def test_stream_yields_the_same_tokens(models):
    target, root = models
    p = prompt(10, seed=6)
    want = target.generate(p, max_tokens=20, verify="tree", width=6, drafter="lookup").tokens
    gen = target.generate(p, max_tokens=20, verify="tree", width=6, drafter="lookup", stream=True)
    got = [t for chunk in gen for t in chunk.tokens]
    assert got == want and gen.result.tokens == want


def test_context_limit_ends_generation(models):
    target, root = models
    small = sapwood.load(root / "target", max_context=64)
    small.generation_config["eos_token_id"] = []
    r = small.generate(prompt(50), max_tokens=100, verify="chain", drafter=str(root / "target"))
    full = target.generate(prompt(50), max_tokens=100, verify="off")
    assert r.finish_reason == "context" and r.tokens == full.tokens[: len(r.tokens)]
    assert 50 + len(r.tokens) <= 65


# ---- trees ---------------------------------------------------------------------------------

def lattice(rows=6, k=4, seed=0):
    return random_lattice(rows, k, seed, vocab=1000)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("params", [dict(), dict(temperature=0.9, top_p=0.9, seed=5)])
def test_walk_follows_the_targets_pick_at_every_node(seed, params):
    """The engine's walk (_core.walk, what Engine.verify_walk runs) against the sampler's pick
    made node by node in Python: the same path and picks; NaN logits on the path rejected."""
    from sapwood import _core
    from sapwood.sampling import sample
    rng = np.random.default_rng(seed)
    lat = lattice(seed=seed)
    tree = grow(7, lat, 12)
    logits = rng.standard_normal((tree.width, 1000)).astype(np.float32)
    node = 0
    for _ in range(int(rng.integers(0, 6))):  # make a random path of children the picks
        kids = np.flatnonzero(tree.parents == node)
        if kids.size == 0:
            break
        node = int(rng.choice(kids))
        logits[tree.parents[node], tree.tokens[node]] = 30.0
    base = int(rng.integers(0, 5000))
    want_path, want_picks, node = [0], [], 0
    while True:
        want_picks.append(sample(logits[node], base + len(want_path), **params))
        kids = [c for c in np.flatnonzero(tree.parents == node) if tree.tokens[c] == want_picks[-1]]
        if not kids:
            break
        node = int(kids[0])
        want_path.append(node)
    assert _core.walk(logits, tree.tokens, tree.parents, base, **params) == (want_path,
                                                                             want_picks)
    logits[want_path[-1], 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        _core.walk(logits, tree.tokens, tree.parents, base, **params)


@pytest.mark.parametrize("seed", range(5))
def test_prefix_property_and_best_first_order(seed):
    lat = lattice(seed=seed)
    big = grow(7, lat, 16)
    assert big.width == 16 and big.parents[0] == -1
    for w in range(1, 17):
        small = grow(7, lat, w)
        for f in ("tokens", "parents", "depth", "rank"):
            assert (getattr(small, f) == getattr(big, f)[:w]).all()
    assert (np.diff(big.logp) <= 1e-12).all()               # pops in non-increasing chance
    assert all(big.parents[i] < i for i in range(1, 16))   # parents before children
    # every node's chance is its parent's times its candidate's probability
    for i in range(1, 16):
        row, rank = big.depth[i] - 1, big.rank[i]
        assert np.isclose(big.logp[i], big.logp[big.parents[i]] + lat.logprobs[row][rank])


def test_best_first_is_optimal_among_trees():
    """The w best nodes: no unpicked node (with its parent picked) beats the worst picked one."""
    lat = lattice(seed=11)
    t = grow(0, lat, 10)
    worst = t.logp[1:].min()
    for i in range(10):
        row = t.depth[i]
        if row < lat.rows:
            picked = {t.rank[j] for j in range(10) if t.parents[j] == i}
            for r in range(len(lat.tokens[row])):
                if r not in picked:
                    assert t.logp[i] + lat.logprobs[row][r] <= worst + 1e-12


def test_chain_is_top1():
    lat = lattice(seed=2)
    c = chain(5, lat, 4)
    assert list(c.tokens) == [5] + [int(x[0]) for x in lat.tokens[:4]]
    assert list(c.parents) == [-1, 0, 1, 2, 3]


def test_lookup_drafter_proposes_continuations():
    d = LookupDrafter()
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 8, 1, 2]
    lat = d.draft(ctx, 3, 4)
    assert lat.chain()[:2] == [4, 6]     # the most recent match of [.., 2, 3] continues 4, 6
    assert set(lat.tokens[1][:2]) == {5, 6}  # the other match continues 4, 5
    assert d.draft([1, 2, 3], 7, 4).rows == 0


# ---- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt=""), "empty prompt"),
    (dict(prompt=[]), "empty prompt"),
    (dict(prompt=[1, 999]), "token id 999"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(drafter="nonsense"), "unknown drafter"),
    (dict(verify="sideways"), "verify"),
    (dict(width=0), "width"),
    (dict(stop=[""]), "stop"),
    (dict(adapt_rows="yes"), "adapt_rows"),
])
def test_bad_input(models, kwargs, match):
    target, _ = models
    kwargs.setdefault("prompt", [1, 2, 3])
    with pytest.raises(ValueError, match=match):
        target.generate(**kwargs)
    assert len(target.generate([1, 2, 3], max_tokens=3).tokens) == 3  # still usable


def test_draft_with_other_vocabulary_rejected(models):
    target, root = models
    with pytest.raises(ValueError, match="vocabulary"):
        target.generate([1, 2, 3], drafter=str(root / "other"))


def test_chat_messages_use_the_checkpoint_template(tmp_path):
    import json
    make_tiny_checkpoint(tmp_path / "c", seed=1)
    tpl = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
           "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tmp_path / "c" / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl}))
    m = sapwood.load(tmp_path / "c")
    msgs = [{"role": "user", "content": "hi"}]
    text = m.apply_chat_template(msgs)
    assert text == "<user>hi\n<assistant>"
    a = m.generate(msgs, max_tokens=5, verify="off")
    b = m.generate(m.encode(text), max_tokens=5, verify="off")
    assert a.tokens == b.tokens
    plain = sapwood.load(tmp_path / "c")
    plain.chat_template = None  # none: ChatML, with a warning (tests/test_chat_template_rule.py)
    with pytest.warns(UserWarning, match="no chat template"):
        got = plain.generate(msgs, max_tokens=5, verify="off")
    assert got.tokens == plain.generate(plain.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), max_tokens=5,
        verify="off").tokens


@pytest.mark.parametrize("seed", range(3))
def test_calibrated_growth_keeps_prefix_property_and_goes_deep(seed):
    lat = lattice(rows=8, k=4, seed=seed)
    chance = lambda rank, q, depth, off: np.array([0.9, 0.05, 0.03, 0.02])[rank]  # confident top-1
    big = grow(0, lat, 16, chance=chance)
    for w in range(1, 17):
        assert (grow(0, lat, w, chance=chance).parents == big.parents[:w]).all()
    assert (np.diff(big.logp) <= 1e-12).all()
    assert big.depth.max() == 8  # the whole top-1 chain is in the tree
    assert (big.depth[:9] == np.arange(9)).all()


@pytest.mark.parametrize("pick_chain", [False, True])
def test_acceptance_learns_from_the_whole_grown_tree(models, monkeypatch, pick_chain):
    """A wide round verifies a prefix of the grown tree, or the drafter's chain where that
    prices better; either way the acceptance model reads the grown tree, with the committed
    path followed in it by its tokens and the target's picks along it: the counts are what
    observe() makes of that path on the grown tree, and the output is plain decoding's."""
    monkeypatch.setattr(Request, "plan", lambda self, behind, max_rows: ("wide", max_rows))
    if pick_chain:  # the drafter's whole chain, which a best-first tree rarely starts with
        monkeypatch.setattr(Policy, "choose", lambda self, cands, ctx, rows, kind, min_width=1: cands[0])
    seen, grown = [], [None]
    observe, grow_tree = Acceptance.observe, Acceptance.grow
    def spy(self, tree, path, picks=None):
        if self.parent is not None:  # the band's call (it passes the same tree to the drafter's)
            seen.append((tree, list(path), list(picks)))
        observe(self, tree, path, picks)
    def grow_spy(self, *a):
        grown[0] = grow_tree(self, *a)
        return grown[0]
    monkeypatch.setattr(Acceptance, "observe", spy)
    monkeypatch.setattr(Acceptance, "grow", grow_spy)
    target, root = models
    p = prompt(24, seed=5)
    off = target.generate(p, max_tokens=24, verify="off").tokens
    target.reset_policies()
    rounds = []  # (the round's grown tree or None, the verified tree, its path)
    def on_round(t, path, s):
        rounds.append((grown[0], t, list(path)))
        grown[0] = None
    r = target.generate(p, max_tokens=24, drafter=str(root / "draft"), verify="auto",
                        on_round=on_round)
    assert r.tokens == off
    rounds = [x for x in rounds if x[0] is not None or x[1].width > 1]  # not plain rounds
    assert len(seen) == len(rounds) > 0
    chain_won = 0
    for (g, t, path), (read, mapped, picks) in zip(rounds, seen):
        assert read is (t if g is None else g)
        toks = [int(x) for x in t.tokens[path]]
        assert [int(x) for x in read.tokens[mapped]] == toks[:len(mapped)]
        assert mapped == [0] or all(read.parents[mapped[i]] == mapped[i - 1]
                                    for i in range(1, len(mapped)))
        chain_won += g is not None and not g.has_prefix(t)
    assert chain_won > 0 or not pick_chain  # the forced chain is rarely the tree's prefix


def test_wide_rounds_are_judged_against_the_drafters_chain(models, monkeypatch):
    """Each wide round reaches Policy.judge with the tree it verified, the rows it drafted, the
    target's picks along its path (one per path node) and the drafter's chain of that round,
    root first; the band's judgement counts the rounds once verify costs are timed."""
    def plan(self, behind, max_rows):
        self.chain_rows = 3
        return "wide", max_rows
    monkeypatch.setattr(Request, "plan", plan)
    judged, rounds = [], []
    judge = Policy.judge
    def spy(self, band, tree, rows, picks, line, chain_rows):
        judged.append((tree, rows, list(picks), list(line), chain_rows))
        judge(self, band, tree, rows, picks, line, chain_rows)
    monkeypatch.setattr(Policy, "judge", spy)
    target, root = models
    target.reset_policies()
    r = target.generate(prompt(24, seed=6), max_tokens=24, drafter=str(root / "draft"),
                        verify="auto", on_round=lambda t, path, s: rounds.append((t, list(path))))
    path_of = {id(t): path for t, path in rounds}  # a plain round's tree is the root alone
    assert len(judged) >= sum(t.width > 1 for t, _ in rounds) > 2
    for tree, rows, picks, line, chain_rows in judged:
        t, path = tree, path_of[id(tree)]
        assert len(picks) == len(path) and chain_rows == 3
        assert line[0] == int(t.tokens[0]) and len(line) == rows + 1
        assert picks[:len(path) - 1] == [int(x) for x in t.tokens[path[1:]]]
    pol = target.speculation_policy(target.resolve_drafter(str(root / "draft")))
    # every round counted (the first calibrated the costs it is priced by), decayed at the end
    assert sum(v[2] for v in pol.wide_vs_chain.values()) == pytest.approx(
        pol.params.memory * len(judged))
    assert r.tokens == target.generate(prompt(24, seed=6), max_tokens=24, verify="off").tokens
    # a round's drafted chain is its own: gone after its _learn, judged or not (auto with a
    # fixed draft length takes wide rounds by the EMA alone, and judges none)
    learn, left, n = Decoder._learn, [], len(judged)
    def learn_spy(self, *a):
        learn(self, *a)
        left.append(self._chain)
    monkeypatch.setattr(Decoder, "_learn", learn_spy)
    monkeypatch.setattr(Request, "wide", lambda self: True)
    target.generate(prompt(24, seed=7), max_tokens=24, drafter=str(root / "draft"),
                    verify="auto", adapt_rows=False)
    assert len(left) > 2 and left == [None] * len(left) and len(judged) == n


def test_a_fresh_band_calibrates_verify_costs_on_its_first_speculative_round(models, monkeypatch):
    """A band with fewer than two node counts timed verifies the root alone, then the largest
    candidate, whose logits serve the chosen prefix: the output is still plain decoding's."""
    monkeypatch.setattr(Request, "plan", lambda self, behind, max_rows: ("wide", max_rows))
    target, root = models
    p = prompt(20, seed=11)
    off = target.generate(p, max_tokens=24, verify="off").tokens
    target.reset_policies()
    calls = []
    eng_verify = target.engine.verify
    class Spy:  # the engine's verify calls, by node count
        def __getattr__(self, k):
            return getattr(target.engine, k)
        def verify(self, tokens, parents):
            calls.append(len(tokens))
            return eng_verify(tokens, parents)
    pol = Policy()
    d = target.resolve_drafter(str(root / "draft"))
    dec = Decoder(Spy(), d, DecodeConfig(max_tokens=24, verify="auto").validate(), policy=pol)
    target.engine.reset()
    assert list(dec.run(p)) == off
    assert calls[0] == 1 and calls[1] > 1  # the calibration: root, then the whole tree
    assert pol.costs.calibrated(band_of(len(p)))
    assert set(pol.costs.verify_sizes(band_of(len(p)))) >= {1, calls[1]}


def test_the_clock_is_the_decoders_own(models):
    """Every cost the policy learns comes from the clock passed in: a clock that advances 1 ms
    a reading makes every timing a whole number of milliseconds."""
    target, root = models
    ticks = iter(range(10 ** 6))
    pol = Policy()
    d = target.resolve_drafter(str(root / "draft"))
    dec = Decoder(target.engine, d, DecodeConfig(max_tokens=30, verify="auto").validate(),
                  policy=pol, clock=lambda: next(ticks) * 1e-3)
    target.engine.reset()
    p = prompt(16, seed=2)
    assert list(dec.run(p)) == target.generate(p, max_tokens=30, verify="off").tokens
    times = [x for (b, part, size), v in pol.costs.t.items() if part in ("verify", "rest")
             for x in v]  # (draft and catch-up timings are per row and per token)
    assert times and all(abs(x * 1e3 - round(x * 1e3)) < 1e-9 for x in times)
    assert dec.stats.decode_s == pytest.approx(round(dec.stats.decode_s * 1e3) * 1e-3)


class WrongDrafter:
    """Proposes tokens the target never picks (ids above the tiny model's likely range are
    still valid ids); counts how many tokens it was given."""

    def __init__(self, start):
        self.start, self.given = start, 0  # start: the prompt's length

    def advance(self, committed):
        self.given += len(committed)

    def draft(self, context, root, rows):
        assert len(context) == self.given + self.start  # every committed token arrived first
        return Lattice(tokens=[np.array([250 + r % 5]) for r in range(rows)],
                       logprobs=[np.log([0.9])] * rows)


class RowsDrafter(LookupDrafter):
    """Prompt lookup that records how many rows each round asked for, and how many committed
    tokens it was given through advance()."""

    def __init__(self):
        super().__init__()
        self.asked = []
        self.advanced = 0

    def draft(self, context, root, rows):
        self.asked.append(rows)
        return super().draft(context, root, rows)

    def advance(self, committed):
        self.advanced += len(committed)
        super().advance(committed)


@pytest.mark.parametrize("width", [1, 2, 4, 16])
def test_tree_of_width_w_drafts_at_most_w_minus_1_rows(models, width):
    """Rows past a tree's reach are not drafted; the output is plain decoding's either way."""
    target, _ = models
    p = prompt(12, seed=5) * 3  # repeats: the lookup finds matches
    off = target.generate(p, max_tokens=40, verify="off").tokens
    d = RowsDrafter()
    r = target.generate(p, max_tokens=40, verify="tree", width=width, drafter=d, rows=8)
    assert r.tokens == off
    if width == 1:
        assert not d.asked  # the root alone: nothing to draft
        assert d.advanced == 0  # and nothing to keep the drafter up to date for
    else:
        assert d.asked and max(d.asked) == min(8, width - 1)


def test_the_first_round_drafts_first_rows_then_what_the_costs_say(models):
    """Nothing known of costs: the first round drafts first_rows; with every row rejected round
    after round, the chain shrinks to one row."""
    target, _ = models
    target.reset_policies()
    p = prompt(12, seed=21)
    widths = []
    target.generate(p, max_tokens=12, drafter=WrongDrafter(len(p)), verify="chain", rows=8,
                    on_round=lambda t, path, s: widths.append(t.width))
    first = PolicyParams().first_rows + 1
    assert first < 9 and widths[0] == first and widths[-2] == 2, widths  # the last: root alone


def test_auto_falls_back_to_plain_rounds_when_speculation_loses(models):
    """A drafter that is always wrong: after a few speculative rounds auto keeps to plain
    rounds, probing now and then. On a virtual clock, a verify of n nodes costing 1 + n/4 ms
    and nothing else any time: on the tiny model a round's Python outweighs its verify, so real
    timings made plain and speculative rounds cost alike and the outcome the host's load's.
    Output is plain decoding's, and the drafter still sees every committed token before
    drafting (checked in draft())."""
    target, _ = models
    p = prompt(12, seed=21)
    off = target.generate(p, max_tokens=80, verify="off").tokens
    now, eng = [0.0], target.engine

    class Timed:  # the target's engine; each verify advances the virtual clock
        def __getattr__(self, k):
            return getattr(eng, k)

        def verify(self, tokens, parents):
            now[0] += 1e-3 * (1 + len(tokens) / 4)
            return eng.verify(tokens, parents)

        def verify_walk(self, tokens, parents, **kw):
            now[0] += 1e-3 * (1 + len(tokens) / 4)
            return eng.verify_walk(tokens, parents, **kw)

    widths = []
    dec = Decoder(Timed(), WrongDrafter(len(p)), DecodeConfig(max_tokens=80, verify="auto"),
                  policy=Policy(), on_round=lambda t, path, s: widths.append(t.width),
                  clock=lambda: now[0])
    eng.reset()
    assert list(dec.run(p)) == off
    assert widths.count(1) >= 0.7 * len(widths), widths


def test_drafter_catches_up_in_order_after_plain_rounds(models, monkeypatch):
    """Plain rounds first, then speculation: the draft model must prefill the skipped tokens,
    in order. With the target as its
    own draft, a correct catch-up makes every drafted row accepted."""
    target, root = models
    p = prompt(15, seed=31)
    off = target.generate(p, max_tokens=40, verify="off").tokens
    calls = {"n": 0}

    def plan(self, behind, max_rows):
        calls["n"] += 1
        return ("plain", 0) if calls["n"] <= 6 else ("chain", max_rows)  # six plain, then drafts

    monkeypatch.setattr(Request, "plan", plan)
    rounds = []
    r = target.generate(p, max_tokens=40, drafter=str(root / "target"), verify="auto",
                        on_round=lambda t, path, s: rounds.append((t.width, len(path))))
    assert r.tokens == off
    assert [w for w, _ in rounds[:6]] == [1] * 6
    drafted = [(w, k) for w, k in rounds[6:] if w > 1]
    assert drafted and all(k == w for w, k in drafted if w <= 9), drafted  # every node accepted


def test_draft_model_takes_in_the_prompt_after_the_first_token(models, monkeypatch):
    """The first token comes from the target's prefill alone: the draft model prefills the
    prompt when it first drafts, and a request that never drafts never prefills it."""
    target, root = models
    p = prompt(20, seed=33)
    off = target.generate(p, max_tokens=12, verify="off").tokens
    # without a tokenizer a stream releases every token as it comes (no text to complete)
    monkeypatch.setattr(target, "tokenizer", None)
    gen = target.generate(p, max_tokens=12, drafter=str(root / "draft"), verify="chain",
                          stream=True)
    first = next(gen)
    draft = target._draft_models[str((root / "draft").resolve())].engine
    assert first.tokens == off[:1] and draft.position == 0
    rest = [t for chunk in gen for t in chunk.tokens]
    st = gen.result.stats
    assert first.tokens + rest == off and draft.position >= len(p)
    assert st.draft_prefill_s > 0 and st.decode_s > 0  # timed apart: decode_s excludes it
    assert st.tokens_per_s == st.tokens / (st.prefill_s + st.draft_prefill_s + st.decode_s)

    monkeypatch.setattr(Request, "plan", lambda self, behind, max_rows: ("plain", 0))
    r = target.generate(p, max_tokens=12, drafter=str(root / "draft"), verify="auto")
    assert r.tokens == off and draft.position == 0 and r.stats.draft_prefill_s == 0


def test_policy_state_is_per_drafter(models):
    """The policy's acceptance calibration and costs are a drafter's own: prompt lookup's
    rounds never reach the draft model's state, and each keeps its state across requests."""
    target, root = models
    target.reset_policies()
    p = prompt(16, seed=5)
    target.generate(p, max_tokens=16, drafter="lookup", verify="chain")
    lookup = target.speculation_policy(target.resolve_drafter("lookup"))
    model = target.speculation_policy(target.resolve_drafter(root / "draft"))
    assert lookup is not model
    seen = lookup.acceptance.offered.sum()
    assert seen > 0 and model.acceptance.offered.sum() == 0
    target.generate(p, max_tokens=16, drafter=root / "draft", verify="chain")
    assert model.acceptance.offered.sum() > 0
    assert target.speculation_policy(target.resolve_drafter(root / "draft")) is model
    assert lookup.acceptance.offered.sum() == seen


def test_a_second_process_starts_from_the_first_ones_calibration(models, tmp_path, monkeypatch):
    """With the policy cache on, a model loaded afresh (a new process) starts from what the
    last one learned for the same target, drafter and machine; with it off, from nothing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target, root = models
    p = prompt(16, seed=8)
    first = sapwood.load(root / "target", max_context=512)
    first.generation_config["eos_token_id"] = []
    a = first.generate(p, max_tokens=20, drafter=str(root / "draft"), verify="auto")
    learned = first.speculation_policy(first.resolve_drafter(str(root / "draft")))
    assert list((tmp_path / "sapwood" / "policy").glob("*.json"))
    second = sapwood.load(root / "target", max_context=512)
    second.generation_config["eos_token_id"] = []
    pol = second.speculation_policy(second.resolve_drafter(str(root / "draft")))
    assert pol.costs.t.keys() == learned.costs.t.keys()
    assert (pol.acceptance.offered == learned.acceptance.offered).all()
    assert second.generate(p, max_tokens=20, drafter=str(root / "draft"),
                           verify="auto").tokens == a.tokens
    off = sapwood.load(root / "target", max_context=512, policy_cache=False)
    assert not off.speculation_policy(off.resolve_drafter(str(root / "draft"))).costs.t
    monkeypatch.setenv("SAPWOOD_POLICY_CACHE", "0")
    env_off = sapwood.load(root / "target", max_context=512)
    assert not env_off.speculation_policy(env_off.resolve_drafter(str(root / "draft"))).costs.t


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.8, top_k=20, top_p=0.9, seed=3)])
def test_verify_walk_is_verify_then_walk_then_commit(models, params):
    """Engine.verify_walk (a round in one call) against its three steps: the same path, picks
    and logits, and the same state after; commit=False commits nothing; bad parameters raise
    with the value and leave the engine usable."""
    from sapwood import _core
    target, _ = models
    eng = target.engine
    eng.reset()
    eng.prefill(prompt(10, seed=2))
    tree = grow(7, random_lattice(6, 4, 9, vocab=240), 12)
    snap = eng.snapshot()
    logits = eng.verify(tree.tokens, tree.parents)
    want = _core.walk(logits, tree.tokens, tree.parents, eng.position, **params)
    eng.commit(want[0])
    after = eng.verify([5], [-1])
    eng.restore(snap)
    path, picks, z = eng.verify_walk(tree.tokens, tree.parents, logits=True, **params)
    assert (path, picks) == want and len(path) >= 1
    np.testing.assert_array_equal(z, logits)
    assert eng.position == snap.position + len(path)
    np.testing.assert_array_equal(eng.verify([5], [-1]), after)
    eng.restore(snap)
    assert eng.verify_walk(tree.tokens, tree.parents, commit=False, **params) == want
    assert eng.position == snap.position
    for bad, value in ((dict(temperature=-1.0), "-1"), (dict(top_p=0.0), "0"),
                       (dict(min_p=2.0), "2")):
        with pytest.raises(ValueError, match=value):
            eng.verify_walk(tree.tokens, tree.parents, **bad)
    assert eng.position == snap.position
    assert eng.verify_walk(tree.tokens, tree.parents, **params) == want


def test_penalised_chain_decoding_is_the_references(models):
    """Penalised sampling through generate (chain rounds, the engine's walk counting context
    and path) against a token-by-token loop over the numpy oracles: apply_penalties with the
    whole context, then the reference sampler."""
    from sapwood.reference import sampling as oracle
    from sapwood.sampling import SamplingParams
    target, root = models
    p = prompt(12, seed=5)
    kw = dict(temperature=0.9, seed=4, repetition_penalty=1.4, presence_penalty=0.3,
              frequency_penalty=0.2)
    got = target.generate(p, max_tokens=20, verify="chain", drafter=str(root / "target"),
                          **kw).tokens
    params = SamplingParams(**kw).validate()
    eng = target.engine
    eng.reset()
    logits, ctx, want = eng.prefill(p), list(p), []
    for _ in range(20):
        x = oracle.apply_penalties(logits, ctx, params)
        want.append(int(oracle.sample(x[None].astype(np.float64), np.array([len(ctx)], np.uint64),
                                      seed=4, temperature=0.9)[0]))
        ctx.append(want[-1])
        logits = eng.prefill([want[-1]])
    assert got == want
    assert got != target.generate(p, max_tokens=20, verify="off", temperature=0.9, seed=4).tokens
