"""The speculation policy's estimators against definitions written out with numpy: the
acceptance counts, the cost fit's medians, the chain tree's shape. These run every round in
plain Python for speed; the oracles here are the straightforward array versions."""
import statistics

import numpy as np
import pytest

from sapwood.drafters import Lattice
from sapwood.policy import Acceptance, Costs, PolicyParams, capped_by_larger, quantile
from sapwood.tree import chain, grow


def random_lattice(rng, rows, k):
    lat = Lattice()
    for _ in range(rows):
        p = np.sort(rng.dirichlet(np.ones(k) * 0.5))[::-1]
        lat.tokens.append(rng.choice(1000, k, replace=False))
        lat.logprobs.append(np.log(np.maximum(p, 1e-30)))
    return lat


def random_path(rng, tree):
    """A root-to-node path: each step to a random child, stopping at random or at a leaf."""
    path = [0]
    while True:
        kids = np.flatnonzero(tree.parents == path[-1])
        if kids.size == 0 or rng.random() < 0.25:
            return path
        path.append(int(rng.choice(kids)))


def off_line_by_definition(tree, n) -> bool:
    """Has node n an ancestor other than the root that is not its row's first candidate?"""
    a = int(tree.parents[n])
    while a > 0:
        if tree.rank[a] > 0:
            return True
        a = int(tree.parents[a])
    return False


def cell_by_definition(tree, n):
    """A node's cell: group DEPTHS off the drafter's line, else depth - 1 capped at DEPTHS - 1;
    rank capped at RANKS - 1; the bucket of exp(q) among EDGES, right side."""
    g = (Acceptance.DEPTHS if off_line_by_definition(tree, n)
         else min(tree.depth[n], Acceptance.DEPTHS) - 1)
    return (g, min(tree.rank[n], Acceptance.RANKS - 1),
            np.searchsorted(Acceptance.EDGES, np.exp(tree.q[n]), side="right"))


@pytest.mark.parametrize("seed", range(8))
def test_acceptance_counts_nodes_whose_parent_the_path_reached(seed):
    """Offered: every node whose parent is on the committed path; accepted: those on it, in
    cell_by_definition's cells."""
    rng = np.random.default_rng(seed)
    acc = Acceptance(4.0)
    want_off, want_acc = np.zeros_like(acc.offered), np.zeros_like(acc.accepted)
    for i in range(21):
        if i < 20:
            tree = grow(0, random_lattice(rng, rows=6, k=6), int(rng.integers(1, 17)))
            path = random_path(rng, tree)
        else:  # and a chain kept whole, which reaches past the last depth group
            tree = chain(0, random_lattice(rng, rows=6, k=6), 6)
            path = list(range(7))
        acc.observe(tree, path)
        on = np.zeros(tree.width, bool)
        on[path] = True
        for n in range(1, tree.width):
            if on[tree.parents[n]]:
                cell = cell_by_definition(tree, n)
                want_off[cell] += 1
                want_acc[cell] += on[n]
    assert want_off.sum() > 0 and want_acc.sum() > 0
    assert (acc.offered == want_off).all() and (acc.accepted == want_acc).all()
    assert (want_off[Acceptance.DEPTHS - 1] > 0).any()  # a depth past the last group
    assert (want_off[Acceptance.DEPTHS] > 0).any()  # nodes off the drafter's line
    # chance() reads the same cells observe() counts: a depth's cell with the cell pooled over
    # depths as its prior
    r, q, d = np.array([0, 1, 5, 17]), np.array([-0.01, -1.0, -3.0, -0.5]), np.array([1, 2, 3, 7])
    rb = (np.minimum(r, 15), np.searchsorted(Acceptance.EDGES, np.exp(q), side="right"))
    pooled = ((want_acc.sum(0)[rb] + acc.strength * acc.prior[rb])
              / (want_off.sum(0)[rb] + acc.strength))
    k = acc.strength
    for off in (False, True):
        cells = (np.full(4, Acceptance.DEPTHS) if off else np.minimum(d, Acceptance.DEPTHS) - 1,) + rb
        want = (want_acc[cells] + k * pooled) / (want_off[cells] + k)
        assert (acc.chance(r, q, d, off) == want).all()


@pytest.mark.parametrize("seed", range(6))
def test_acceptance_counts_the_grown_trees_unverified_nodes_by_the_picks(seed):
    """With the target's picks along the path, a grown tree of which only a prefix was
    verified counts every node whose parent the path reached, accepted iff it carries its
    parent's pick; on the verified prefix that is exactly the path (the walk follows the
    pick), so the prefix's counts are those of observe(prefix, path)."""
    rng = np.random.default_rng(seed)
    extra = 0  # nodes counted past the verified prefix, over the trials
    for _ in range(10):
        full = grow(0, random_lattice(rng, rows=6, k=4), 16)
        w = int(rng.integers(1, full.width + 1))
        prefix = full.prefix(w)
        path = random_path(rng, prefix)
        # the walk's picks: each path node's child token, then one that no verified child of
        # the last node carries: a child past the prefix (accepted there, unverified) or none
        picks = [int(full.tokens[n]) for n in path[1:]]
        kids = [n for n in np.flatnonzero(full.parents == path[-1]) if n >= w]
        picks.append(int(full.tokens[kids[0]]) if kids and rng.random() < 0.7 else -5)
        got, verified = Acceptance(4.0), Acceptance(4.0)
        got.observe(full, path, picks)
        verified.observe(prefix, path)
        want_off, want_acc = np.zeros_like(got.offered), np.zeros_like(got.accepted)
        pick_at = dict(zip(path, picks))
        for n in range(1, full.width):
            if full.parents[n] in pick_at:
                cell = cell_by_definition(full, n)
                want_off[cell] += 1
                want_acc[cell] += full.tokens[n] == pick_at[full.parents[n]]
        assert (got.offered == want_off).all() and (got.accepted == want_acc).all()
        assert got.offered.sum() >= verified.offered.sum()
        extra += got.offered.sum() - verified.offered.sum()
        # the prefix alone, with the picks, counts what the path says
        again = Acceptance(4.0)
        again.observe(prefix, path, picks)
        assert (again.offered == verified.offered).all() and (again.accepted == verified.accepted).all()
    assert extra > 0


def expected_by_definition(acc, tree):
    """E(w): the sum over the first w nodes of each one's reach, the product of chance() along
    its path from the root (off the drafter's line by off_line_by_definition)."""
    reach = [1.0]
    for i in range(1, tree.width):
        ch = acc.chance(tree.rank[i], tree.q[i], tree.depth[i], off_line_by_definition(tree, i))
        reach.append(reach[tree.parents[i]] * float(ch))
    return np.cumsum(reach)


def trained_band(rng):
    """A context band's Acceptance under a drafter-level parent, both with counts."""
    parent = Acceptance(4.0)
    band = Acceptance(4.0, parent=parent)
    for model in (band, parent, band):
        for _ in range(15):
            tree = grow(0, random_lattice(rng, rows=6, k=4), int(rng.integers(2, 17)))
            model.observe(tree, random_path(rng, tree))
    return band


@pytest.mark.parametrize("seed", range(10))
def test_grow_in_cpp_is_the_python_growth_bit_for_bit(seed):
    """Acceptance.grow (C++) against tree.grow with the model's chance() (Python): the same
    nodes in the same order and the same doubles, over ragged, empty and -inf rows and equal
    path sums (cells share a chance, so ties are common); its E and expected_tokens() against
    the definition, exactly (the same products and sums in the same order)."""
    rng = np.random.default_rng(seed)
    band = trained_band(rng)
    for trial in range(12):
        rows = int(rng.integers(0, 9))
        lat = random_lattice(rng, rows=rows, k=4)
        if rows and trial % 3 == 1:  # ragged: a row may run out, or be empty
            r = int(rng.integers(rows))
            lat.tokens[r], lat.logprobs[r] = lat.tokens[r][:int(rng.integers(0, 4))], lat.logprobs[r][:0]
            lat.logprobs[r] = np.log(np.full(len(lat.tokens[r]), 0.3))
        if rows and trial % 3 == 2:  # the drafter's arrays: [rows, k], float32, a -inf candidate
            lat = Lattice(np.stack(lat.tokens), np.stack(lat.logprobs).astype(np.float32))
            lat.logprobs[0, -1] = -np.inf
        width = int(rng.integers(1, 21))
        root = int(rng.integers(1000))
        got, want = band.grow(root, lat, width), grow(root, lat, width, chance=band.chance)
        for name in ("tokens", "parents", "depth", "rank", "logp", "q"):
            assert (getattr(got, name) == getattr(want, name)).all(), name
        assert (band.expected_tokens(got) == expected_by_definition(band, want)).all()
        assert (band.expected_tokens(got.prefix(3)) == expected_by_definition(band, want)[:3]).all()
        full_rows = next((r for r in range(rows) if len(lat.tokens[r]) == 0), rows)
        c = chain(root, lat, full_rows)
        assert (band.expected_tokens(c) == expected_by_definition(band, c)).all()
    # E follows the counts: the chance table is recomputed after observe()
    tree = band.grow(1, random_lattice(rng, rows=4, k=4), 8)
    before = band.expected_tokens(tree).copy()
    for _ in range(30):
        band.observe(tree, [0])
    assert (band.expected_tokens(tree) == expected_by_definition(band, tree)).all()
    assert (band.expected_tokens(tree) != before).any()


def test_grow_in_cpp_rejects_bad_lattices():
    band = Acceptance(4.0)
    chance, log_step = band.tables()
    edges = Acceptance.LOG_EDGES
    from sapwood import _core
    with pytest.raises(ValueError, match="NaN"):
        band.grow(0, Lattice(np.zeros((2, 3), np.int64), np.full((2, 3), np.nan)), 8)
    with pytest.raises(ValueError, match="logprobs have shape"):
        _core.grow_tree(0, np.zeros((2, 3), np.int64), np.zeros((2, 2)), None, 8, chance, log_step, edges)
    with pytest.raises(ValueError, match=r"counts\[1\] = 4"):
        _core.grow_tree(0, np.zeros((2, 3), np.int64), np.zeros((2, 3)), [3, 4], 8, chance, log_step, edges)
    with pytest.raises(ValueError, match="width must be >= 1"):
        _core.grow_tree(0, np.zeros((2, 3), np.int64), np.zeros((2, 3)), None, 0, chance, log_step, edges)
    with pytest.raises(ValueError, match="edges"):
        _core.grow_tree(0, np.zeros((2, 3), np.int64), np.zeros((2, 3)), None, 8, chance, log_step, edges[:-1])
    with pytest.raises(ValueError, match="3-D"):
        _core.grow_tree(0, np.zeros((2, 3), np.int64), np.zeros((2, 3)), None, 8, chance[0], log_step[0], edges)
    with pytest.raises(ValueError, match="log_step has shape"):
        _core.grow_tree(0, np.zeros((2, 3), np.int64), np.zeros((2, 3)), None, 8, chance, log_step[:2], edges)
    with pytest.raises(ValueError, match="parents"):
        _core.expected_tokens([-1, 5], [0, 1], [-1, 0], [0.0, -1.0], chance, log_step, edges)
    with pytest.raises(ValueError, match=r"depth\[1\] = 0"):
        _core.expected_tokens([-1, 0], [0, 0], [-1, 0], [0.0, -1.0], chance, log_step, edges)
    with pytest.raises(ValueError, match="lengths differ"):
        _core.expected_tokens([-1, 0], [0], [-1, 0], [0.0, -1.0], chance, log_step, edges)
    assert band.grow(0, Lattice(np.zeros((2, 3), np.int64), np.zeros((2, 3))), 20).width == 1 + 3 + 9


def test_cost_fit_is_theil_sen_of_per_width_medians():
    """The verify line: slope the median of pairwise slopes between node counts' median
    timings, intercept the median residual (both clamped at 0), written out with statistics
    here; a count timed min_samples times is priced by its own median, others by the line,
    both times the host's level (costs as medians: q = 0.5)."""
    rng = np.random.default_rng(0)
    cm = Costs(window=16, min_samples=3, q=0.5)
    for i in range(60):
        w = int(rng.integers(1, 10)) if i else 12  # 12: timed once
        cm.observe(0, "verify", w, 1e-3 + 2e-4 * w + 1e-4 * rng.random())
    obs = {w: list(cm.t[0, "verify", w]) for w in cm.verify_sizes(0)}
    ws = sorted(obs)
    med = [statistics.median(obs[w]) for w in ws]
    b = statistics.median([(med[j] - med[i]) / (ws[j] - ws[i])
                           for i in range(len(ws)) for j in range(i + 1, len(ws))])
    a = statistics.median([t - b * w for w, t in zip(ws, med)])
    assert cm._table(0)[0] == (max(a, 0.0), max(b, 0.0))
    # the stored timings are divided by the host's level when taken, priced at today's
    level = cm.level.get(0, 1.0)
    assert cm.verify(0, 4) == statistics.median(obs[4]) * level and len(obs[4]) >= 3
    assert cm.verify(0, 12) == (max(a, 0.0) + max(b, 0.0) * 12) * level and len(obs[12]) == 1
    assert cm.verify(0, 16) == (max(a, 0.0) + max(b, 0.0) * 16) * level
    assert cm.calibrated(0) and not cm.calibrated(3) and cm.verify(3, 1) is None


def test_costs_keep_the_last_window_timings_and_ignore_a_preempted_minority():
    """Each (band, part, size) keeps its last `window` timings; a few timings three times the
    rest (a preempted round) leave the median where it was."""
    cm = Costs(window=8, min_samples=3, q=0.5)
    for i in range(20):
        cm.observe(1, "verify", 4, 0.010 if i % 5 else 0.030)
    assert len(cm.t[1, "verify", 4]) == 8 and cm.verify(1, 4) == 0.010
    for i in range(8):
        cm.observe(1, "verify", 4, 0.02)
    assert cm.verify(1, 4) == 0.02  # and it follows the host when the change lasts
    cm.observe(1, "draft", 0, 1e-4)
    cm.observe(1, "rest", "chain", 5e-4)
    cm.observe(1, "verify", 1, 0.005)
    assert cm.round(1, "chain", 4, 3) == pytest.approx(0.02 + 3e-4 + 5e-4)
    assert cm.round(1, "tree", 4, 3) == cm.round(1, "chain", 4, 3)  # no tree rest yet: the chain's


def test_costs_follow_the_hosts_level_where_two_node_counts_agree():
    """Every count turning dearer at once (the host's load) moves the level, so a count last
    timed before the change is priced at the new level; one count alone turning dear is that
    count's cost: the others keep their price."""
    cm = Costs(window=16, min_samples=3, q=0.1)
    base = {n: 1e-3 * (1 + 0.2 * n) for n in (1, 4, 5, 9)}
    for _ in range(3):
        for n, t in base.items():
            cm.observe(0, "verify", n, t)
    assert cm.verify(0, 9) == pytest.approx(base[9])
    for _ in range(3):  # the load rises: the counts in use, 4 and 5, cost 1.5x
        cm.observe(0, "verify", 4, 1.5 * base[4])
        cm.observe(0, "verify", 5, 1.5 * base[5])
    assert cm.level[0] == pytest.approx(1.5)
    assert cm.verify(0, 9) == pytest.approx(1.5 * base[9])  # last timed before the change
    assert cm.verify(0, 4) == pytest.approx(1.5 * base[4])
    one = Costs(window=16, min_samples=3, q=0.1)
    for _ in range(3):
        for n, t in base.items():
            one.observe(0, "verify", n, t)
    for _ in range(16):  # count 1 alone turns dear for a whole window, count 5 does not
        one.observe(0, "verify", 1, 1.4 * base[1])
        one.observe(0, "verify", 5, base[5])
    assert one.level.get(0, 1.0) == pytest.approx(1.0)
    assert one.verify(0, 1) == pytest.approx(1.4 * base[1]) and one.verify(0, 9) == base[9]


@pytest.mark.parametrize("n", [1, 2, 3, 8, 16, 25])
def test_quantile_is_numpys(n):
    rng = np.random.default_rng(n)
    for q in (0.0, 0.1, 0.25, 0.5, 1.0):
        xs = rng.random(n).tolist()
        assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)), rel=1e-12)


def test_costs_are_a_low_quantile_that_ignores_a_preempted_majority():
    """With the policy's quantile, a count whose timings are mostly preempted (two in three
    at three times the cost, as on a loaded 2-core host) keeps its unpreempted cost, where
    the median takes the preempted one; every part is priced alike."""
    q = PolicyParams().quantile
    low, mid = Costs(window=16, min_samples=3, q=q), Costs(window=16, min_samples=3, q=0.5)
    for cm in (low, mid):
        for i in range(30):
            for part, size, t in (("verify", 4, 0.010), ("draft", 0, 1e-4), ("rest", "chain", 5e-4)):
                cm.observe(1, part, size, t if i % 3 == 0 else 3 * t)
    assert low.verify(1, 4) == 0.010 and mid.verify(1, 4) == 0.030
    assert low.round(1, "chain", 4, 3) == pytest.approx(0.010 + 3e-4 + 5e-4)


def test_a_count_is_never_priced_above_a_larger_one():
    """A verify of more nodes does the work of fewer: a count timed dearer than a larger count
    (preempted at every timing) is priced at the larger count's cost, and so is an untimed
    count whose line value lies above a larger count's; capped_by_larger does it."""
    assert capped_by_larger({1: 3.0, 2: 1.0, 5: 4.0, 9: 2.0}) == {1: 1.0, 2: 1.0, 5: 2.0, 9: 2.0}
    cm = Costs(window=16, min_samples=3, q=0.1)
    for _ in range(3):
        for n, t in ((1, 1e-3), (4, 9e-3), (5, 2e-3), (8, 2.6e-3)):
            cm.observe(0, "verify", n, t)
    assert cm.level.get(0, 1.0) == 1.0
    assert cm.verify(0, 4) == cm.verify(0, 5) == pytest.approx(2e-3)
    assert cm.verify(0, 1) == pytest.approx(1e-3)  # below every larger count: its own
    steep = Costs(window=16, min_samples=3, q=0.1)
    for _ in range(3):
        for n, t in ((1, 1e-3), (2, 2e-3), (3, 3e-3), (10, 4e-3)):
            steep.observe(0, "verify", n, t)
    a, b = steep._table(0)[0]
    assert a + b * 8 > 4e-3 and steep.verify(0, 8) == pytest.approx(4e-3)  # the line, capped
    assert steep.verify(0, 12) == pytest.approx(a + b * 12)  # no larger count timed: the line


@pytest.mark.parametrize("as_array", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 8])
def test_chain_tree_shape(rows, as_array):
    """A lattice of per-row lists and one of [rows, k] arrays (a model drafter's) give the
    same chain."""
    lat = random_lattice(np.random.default_rng(rows), rows=8, k=4)
    if as_array:
        lat = Lattice(np.array(lat.tokens), np.array(lat.logprobs))
    t = chain(7, lat, rows)
    n = rows + 1
    assert t.tokens.tolist() == [7] + [int(x[0]) for x in lat.tokens[:rows]]
    assert t.parents.tolist() == list(range(-1, n - 1))
    assert t.depth.tolist() == list(range(n)) and t.rank.tolist() == [-1] + [0] * rows
    assert t.q.tolist() == [0.0] + [float(x[0]) for x in lat.logprobs[:rows]]
    assert (t.logp == 0).all() and t.is_chain
    # the shape arrays are shared between rounds: nobody may write to them
    with pytest.raises(ValueError):
        t.parents[0] = 3
    assert chain(7, lat, rows).parents.tolist() == list(range(-1, n - 1))
