"""The speculation policy (policy.Policy) and its persistence (policy_cache): the admission
EMA as docs/design.md states it, the choice of the option with the most expected tokens per second,
the row survival and the plain-or-speculate plan, and the cache file's life."""
import json
import warnings

import numpy as np
import pytest

from sapwood import policy_cache
from sapwood.drafters import Lattice
from sapwood.policy import BANDS, Acceptance, Policy, PolicyParams, band_of
from sapwood.testing import random_lattice
from sapwood.tree import chain, grow


def lattice(rows=8, k=4, seed=0):
    return random_lattice(rows, k, seed, vocab=200)


def timed(pol, cost_fn, ctx=64, draft_row=0.0, rest=0.0):
    """Feed `pol` verify timings of every node count from cost_fn (1% noise), a draft cost per
    row and the rest of a round of each kind."""
    rng, b = np.random.default_rng(0), band_of(ctx)
    for _ in range(8):
        for w in range(1, 17):
            pol.costs.observe(b, "verify", w, cost_fn(w) * (1 + 0.01 * rng.standard_normal()))
    pol.costs.observe(b, "draft", 0, draft_row)
    for kind in ("plain", "chain", "tree"):
        pol.costs.observe(b, "rest", kind, rest)
    return pol


def with_chances(pol, chances, ctx=64):
    """The band's (and the drafter's) acceptance set to these chances by rank, any depth."""
    acc = pol.acceptance_for(ctx)
    for a in (acc, pol.acceptance):
        a.offered[:] = 1e6
        for r, c in enumerate(chances):
            a.accepted[:, r, :] = 1e6 * c
        a.version += 1
    return pol


def test_admission_ema_is_designs():
    """avg starts at 8, avg += 0.125 * (kept - avg) after each speculative round, wide only
    while avg < 6.5; the parameters are exposed."""
    req = Policy().request(10, 8)
    assert req.avg == 8 and not req.wide()
    for kept in [8, 8, 8]:
        req.observe(8, kept, True)
    assert req.avg == 8 and not req.wide()
    req.observe(8, 0, True)
    assert req.avg == pytest.approx(7.0) and not req.wide()
    req.observe(8, 0, True)
    assert req.avg == pytest.approx(6.125) and req.wide()
    for _ in range(3):
        req.observe(8, 8, True)
    assert req.avg == pytest.approx(8 - 1.875 * 0.875 ** 3) and not req.wide()
    assert Policy(PolicyParams(ema_start=4, ema_wide_below=5)).request(10, 8).wide()
    with pytest.raises(ValueError, match="ema_weight"):
        Policy(PolicyParams(ema_weight=0))
    with pytest.raises(ValueError, match="probe_budget"):
        Policy(PolicyParams(probe_budget=1.5))


@pytest.mark.parametrize("cost_fn, deep", [
    (lambda w: 0.010 + 0.0001 * w, True),   # nodes nearly free: verify many
    (lambda w: 0.001 + 0.003 * w, False),   # each node costs three root verifies: few
])
def test_choose_takes_the_prefix_with_most_tokens_per_second(cost_fn, deep):
    pol = with_chances(timed(Policy(), cost_fn), [0.6, 0.2, 0.1, 0.05])
    tree = grow(0, lattice(seed=3), 16)
    e = pol.acceptance_for(64).expected_tokens(tree)
    true = e / np.array([cost_fn(w) for w in range(1, 17)])
    got = pol.choose([tree], 64, rows=8)
    assert tree.has_prefix(got)
    assert true[got.width - 1] >= 0.98 * true.max()
    assert (got.width >= 8) == deep


def test_a_confident_chain_beats_a_bushy_tree_and_plain_is_an_option():
    pol = with_chances(timed(Policy(), lambda w: 0.010 + 0.001 * w),
                       [0.95, 0.3, 0.2, 0.1])
    lat = Lattice(tokens=[np.arange(4) + 10 * r for r in range(8)],
                  logprobs=[np.log([0.3, 0.29, 0.28, 0.13])] * 8)
    bushy = grow(1, lat, 16)  # by draft probabilities: siblings first
    assert bushy.depth.max() < 8
    best = pol.choose([chain(1, lat, 8), bushy], 64, rows=8)
    assert best.is_chain and best.width == 9
    # a draft the target never takes, nodes costly: the root alone (a plain step) wins, and a
    # probe (min_width=2) verifies two nodes
    bad = with_chances(timed(Policy(), lambda w: 0.01 * w), [0.01])
    assert bad.choose([chain(1, lat, 8), bushy], 64, rows=8).width == 1
    assert bad.choose([chain(1, lat, 8)], 64, rows=8, min_width=2).width == 2


def test_acceptance_follows_draft_confidence_and_choose_cuts_unsure_tails():
    lat = Lattice(tokens=[np.array([10 * r]) for r in range(8)],
                  logprobs=[np.log([0.95])] * 4 + [np.log([0.1])] * 4)
    t = chain(1, lat, 8)
    pol = timed(Policy(), lambda w: 0.010 + 0.002 * w)
    acc = pol.acceptance_for(64)
    assert acc.chance([0], [np.log(0.95)], [1])[0] == acc.chance([0], [np.log(0.1)], [1])[0]
    for _ in range(200):
        acc.observe(t, [0, 1, 2, 3, 4])  # the four sure rows kept, the first unsure one not
    for depth in (1, 3, 5):
        assert acc.chance([0], [np.log(0.95)], [depth])[0] > 0.95
        assert acc.chance([0], [np.log(0.1)], [depth])[0] < 0.05
    assert pol.choose([t], 64, rows=8).width == 5


def test_acceptance_is_calibrated_per_context_band_over_the_drafters():
    pol = Policy()
    near, far = pol.acceptance_for(100), pol.acceptance_for(5000)
    assert near is pol.acceptance_for(900) and near is not far
    assert near.parent is pol.acceptance and far.parent is pol.acceptance
    t = chain(1, Lattice(tokens=[np.array([10 + r]) for r in range(4)],
                         logprobs=[np.log([0.5])] * 4), 4)
    for _ in range(40):
        near.observe(t, [0, 1, 2, 3, 4])
        far.observe(t, [0])
    def c(acc):
        return acc.chance([0], [np.log(0.5)], [1])[0]
    assert c(near) > 0.9 and c(far) < 0.1
    assert c(far) < c(pol.acceptance) < c(near)
    assert c(pol.acceptance_for(40000)) == c(pol.acceptance)


def test_survival_pools_a_bands_requests_and_follows_the_request():
    pol = Policy()
    req = pol.request(100, 8)
    prior = req.survival()
    assert prior == sorted(prior, reverse=True) and 0 < prior[-1] < prior[0] < 1
    for _ in range(20):
        req.observe(8, 2, True)  # rows 1-2 kept, row 3 rejected
    s = req.survival()
    assert s[1] > 0.8 and s[2] < 0.2 * s[1]
    req.finish()
    fresh = pol.request(200, 8)  # the same band: the last request's counts are its prior
    assert fresh.survival()[2] < prior[2]
    assert pol.request(50000, 8).survival() == prior  # another band: nothing seen there
    censored = Policy().request(100, 8)
    for _ in range(20):
        censored.observe(3, 2, False)  # row 3 never judged: not a rejection
    assert censored.survival()[2] / censored.survival()[1] == pytest.approx(prior[2] / prior[1])


def test_plan_goes_plain_when_speculation_loses_and_probes_within_budget():
    p = PolicyParams(probe_budget=0.05)
    pol = timed(Policy(p), lambda w: 0.001 + 0.0002 * w, draft_row=2e-4)
    req = pol.request(64, 8)
    assert req.plan(0, 8)[0] in ("chain", "wide")  # nothing kept yet: rows look worth it
    for _ in range(30):
        req.observe(3, 0, True)  # every first row rejected
    kinds = [req.plan(0, 8)[0] for _ in range(400)]
    probes = [i for i, k in enumerate(kinds) if k != "plain"]
    assert kinds.count("plain") > 0.75 * len(kinds) and len(probes) > 3
    # each probe's excess over plain decoding is at most probe_budget of the plain run before it
    rows, rate = req.chain_plan(8)
    t = pol.costs.round(band_of(64), "chain", rows + 1, rows)
    plain_s = pol.costs.round(band_of(64), "plain", 1, 0)
    assert rate * plain_s < 1  # plain wins
    gap = np.diff([-1] + probes) - 1
    assert (gap * p.probe_budget * plain_s >= t - rate * t * plain_s - 1e-12).all()
    good = pol.request(64, 8)
    for _ in range(30):
        good.observe(8, 8, True)
    assert good.plan(0, 8) == ("chain", 8)  # all kept: the EMA stays at 8, the chain


def test_a_wide_round_drafts_one_row_more_while_the_last_tree_reached_its_deepest_row():
    """Wide rounds draft one row past the chain's best depth, for a tree to extend its
    likeliest path; a wide round whose tree stopped short of its deepest row makes the next
    one draft the chain's depth only, until a tree reaches that depth again."""
    pol = with_chances(timed(Policy(), lambda w: 0.01 + 0.001 * w, draft_row=1e-4), [0.6, 0.3])
    req = pol.request(64, 8)
    for _ in range(12):
        req.observe(2, 1, True)  # the EMA falls below ema_wide_below: wide rounds
    assert req.wide()
    def plan_and_best():
        best = req.chain_plan(8, near=0.9)[0]
        return req.plan(0, 8), best
    (kind, rows), best = plan_and_best()
    assert kind == "wide" and rows == best + 1 < 8
    req.observe(rows - 1, 1, True)  # its tree stopped a row short
    (kind, rows), best = plan_and_best()
    assert kind == "wide" and rows == best
    req.observe(rows, 1, True)  # this one reached the deepest row drafted
    (kind, rows), best = plan_and_best()
    assert kind == "wide" and rows == best + 1


def test_wide_rounds_are_taken_unless_they_lose_to_the_chain_rounds_they_replace():
    """docs/design.md's EMA admits wide rounds; they are taken unless, over the band's wide rounds,
    a wide round kept fewer tokens than the plan's chain round would have in its time (both
    priced by the band's costs), by plain_sd standard errors, until that evidence decays."""
    pol = with_chances(timed(Policy(), lambda w: 0.01 + 0.001 * w, draft_row=1e-4), [0.6, 0.3])
    req, b, tree = pol.request(64, 8), band_of(64), grow(1, lattice(), 8)
    for _ in range(12):
        req.observe(2, 1, True)
    assert req.wide() and req.plan(0, 8)[0] == "wide" and req.chain_rows > 0
    price = pol.costs.round(b, "tree", 8, 4) / pol.costs.round(b, "chain", 4, 3)
    line = [1, 10, 11, 12]  # the drafter's chain, root first
    lucky = [10, 98, 5]  # 3 tokens; the chain would have kept its first row: 2
    # 2 tokens, the tree stopped at its first row; the chain would have kept its second (3
    # tokens), and maybe more: a lower bound
    unlucky = [10, 11]
    def judged(picks, chain_rows=3):
        before = list(pol.wide_vs_chain.get(b, [0.0] * 3))
        pol.judge(b, tree, 4, picks, line, chain_rows)
        return pol.wide_vs_chain[b][0] - before[0]
    assert judged(lucky) == pytest.approx(3 - 2 * price)
    assert judged(unlucky) == pytest.approx(2 - 3 * price)
    for _ in range(pol.params.window - 3):
        judged(unlucky)
    assert pol.wide_pays(b)  # too few rounds to tell (window - 1)
    judged(unlucky)
    assert not pol.wide_pays(b)
    # four lucky rounds to an unlucky one: a little below the chain, and the rounds vary
    del pol.wide_vs_chain[b]
    for _ in range(4):
        for picks in [lucky] * 4 + [unlucky]:
            judged(picks)
    assert price > 1 and pol.wide_vs_chain[b][0] < 0 and pol.wide_pays(b)
    for _ in range(200):
        for picks in [lucky] * 4 + [unlucky]:
            judged(picks)
    assert not pol.wide_pays(b)  # a thousand rounds tell
    assert [req.plan(0, 8)[0] for _ in range(50)] == ["chain"] * 50
    n = pol.wide_vs_chain[b][2]
    req.finish()  # the evidence decays per request
    assert pol.wide_vs_chain[b][2] == pytest.approx(pol.params.memory * n)
    requests = 1
    while not pol.wide_pays(b):
        assert req.plan(0, 8)[0] == "chain"
        pol.end_request(req)
        requests += 1
    assert requests >= 3 and req.plan(0, 8)[0] == "wide"  # the evidence faded: tried again
    for _ in range(100):
        judged([10, 98, 5, 6, 7])  # wide rounds turn luckier
    assert pol.wide_pays(b) and req.plan(0, 8)[0] == "wide"
    assert pol.request(64, 8).plan(0, 8)[0] == "chain"  # the EMA at 8 admits no wide round
    # the plan's rows cap the chain's (2 rows: 3 tokens), priced as such
    assert judged([10, 11, 12, 13], chain_rows=2) == pytest.approx(4 - 3 * price * pol.costs.round(
        b, "chain", 4, 3) / pol.costs.round(b, "chain", 3, 2))
    fresh = Policy()
    fresh.judge(b, tree, 4, [10, 11, 99], line, 3)  # no costs timed: nothing to judge by
    assert fresh.wide_vs_chain == {} and fresh.wide_pays(b)


def test_the_policy_state_survives_json_and_rejects_bad_state():
    pol = with_chances(timed(Policy(), lambda w: 0.01 + 0.001 * w), [0.6, 0.3])
    req = pol.request(3000, 8)
    req.observe(5, 3, True)
    pol.judge(band_of(64), grow(1, lattice(), 8), 4, [5, 6], [1, 5, 7], 2)
    req.finish()
    again = Policy()
    policy_cache.load_state(again, json.loads(json.dumps(policy_cache.state(pol))))
    assert again.costs.t.keys() == pol.costs.t.keys()
    assert all(list(again.costs.t[k]) == list(v) for k, v in pol.costs.t.items())
    for b in [-1] + list(pol.bands):
        a, z = (pol.acceptance, again.acceptance) if b == -1 else (pol.bands[b], again.bands[b])
        assert (a.offered == z.offered).all() and (a.accepted == z.accepted).all()
    assert again.request(3000, 8).survival() == pol.request(3000, 8).survival()
    assert again.wide_vs_chain == pol.wide_vs_chain
    assert pol.wide_vs_chain[band_of(64)][2] == pol.params.memory  # one round, one request
    assert (again.acceptance_for(64).tables()[0] == pol.acceptance_for(64).tables()[0]).all()
    bad = policy_cache.state(pol)
    bad["acceptance"]["2"] = bad["acceptance"]["-1"]
    bad["acceptance"]["2"][1][0][0][0] = 1e9  # accepted > offered, after valid bands
    before = json.dumps(policy_cache.state(again))
    with pytest.raises(ValueError, match="acceptance"):
        policy_cache.load_state(again, bad)
    assert json.dumps(policy_cache.state(again)) == before  # a bad state changes nothing
    bad = policy_cache.state(pol)
    bad["wide_vs_chain"][str(band_of(64))] = [1.0, -2.0, 3]
    with pytest.raises(ValueError, match="wide_vs_chain"):
        policy_cache.load_state(Policy(), bad)
    bad = policy_cache.state(pol)
    bad["costs"][0][3] = [-1.0]
    with pytest.raises(ValueError, match="cost"):
        policy_cache.load_state(Policy(), bad)
    # the host's level travels with the timings it divides
    pol.costs.level[0] = 1.5
    policy_cache.load_state(again, json.loads(json.dumps(policy_cache.state(pol))))
    assert again.costs.verify(0, 4) == pol.costs.verify(0, 4)
    bad = policy_cache.state(pol)
    bad["level"]["0"] = 0.0
    with pytest.raises(ValueError, match="level"):
        policy_cache.load_state(Policy(), bad)


def test_policy_cache_round_trip_corrupt_and_foreign_files(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = policy_cache.key({"path": "t"}, "lookup")
    pol = timed(Policy(), lambda w: 0.01 * w)
    policy_cache.attach(pol, key)  # nothing there yet
    pol.request(10, 8).finish()    # saved at the request's end
    f = policy_cache.path_for(key)
    assert f.parent == tmp_path / "sapwood" / "policy" and f.exists()
    loaded = Policy()
    assert policy_cache.load(loaded, key)
    assert loaded.costs.verify(band_of(10), 4) == pol.costs.verify(band_of(10), 4)
    other = policy_cache.key({"path": "another target"}, "lookup")
    assert policy_cache.path_for(other) != f
    data = json.loads(f.read_text())
    data["key"]["machine"]["cpu"] = "some other CPU"  # a file copied from another machine
    f.write_text(json.dumps(data))
    with pytest.warns(RuntimeWarning, match="another target, drafter or machine"):
        assert not policy_cache.load(Policy(), key)
    f.write_text("{not json")
    fresh = Policy()
    with pytest.warns(RuntimeWarning, match="ignoring the policy cache"):
        assert not policy_cache.load(fresh, key)
    assert not fresh.costs.t  # nothing half-loaded
    monkeypatch.setenv("SAPWOOD_POLICY_CACHE", "0")
    assert not policy_cache.enabled() and not policy_cache.enabled(True)
    monkeypatch.setenv("SAPWOOD_POLICY_CACHE", "1")
    assert policy_cache.enabled() and not policy_cache.enabled(False)


def test_bands_are_powers_of_two():
    assert [band_of(c) for c in (0, 1023, 1024, 2047, 2048, 10 ** 6)] == [0, 0, 1, 1, 2, 8]
    assert BANDS[0] == 1024 and Acceptance.DEPTHS == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Policy().request(0, 8).finish()  # no cache attached: nothing written, nothing warned
