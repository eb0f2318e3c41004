"""Threads on every stateful object the Python API hands out (issue 50, case 4), as
test_threads.py does for the Engine: the MTP head used from several threads corrupted the heap,
and the other _core objects with state (GDNLayer, KVSequence, BackendOps) and the drafters with
state had the same hole. Now a call that finds one busy raises EngineBusyError at once, a nested
call on the holding thread passes (BackendOps: raises too), and the winners' results are exact.

Two ways to overlap calls: threads released together by a barrier into calls that drop the GIL
(many rounds: some overlap), and, deterministically, an argument whose __array__ runs another
thread's call while the first call holds the object (a conversion of a Python argument is
where a call that keeps the GIL lets another thread in)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import sapwood
from sapwood import _core
from sapwood.drafters import ModelDrafter, MtpDrafter
from sapwood.loading import engine_dims, read_checkpoint
from sapwood.testing import make_tiny_checkpoint

PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, 240, 24)]  # ids any vocab has


def hammer(n_threads, rounds, setup, call, repeat=1):
    """`rounds` times: setup() on this thread, then every thread makes call(i) `repeat` times,
    all starting at once. Returns ([(round, result) of each call that ran], number of
    EngineBusyErrors); any other error fails the test."""
    barrier = threading.Barrier(n_threads + 1)
    results, busy, errors = [], [0], []
    lock = threading.Lock()

    def run(i):
        for r in range(rounds):
            barrier.wait()
            for _ in range(repeat):
                try:
                    out = call(i)
                    with lock:
                        results.append((r, out))
                except _core.EngineBusyError as e:
                    assert "in use by another thread" in str(e)
                    with lock:
                        busy[0] += 1
                except BaseException as e:  # pragma: no cover - reported below
                    errors.append(e)
            barrier.wait()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in ts:
        t.start()
    for _ in range(rounds):
        setup()
        barrier.wait()  # the threads call
        barrier.wait()  # and are done
    for t in ts:
        t.join()
    assert not errors, errors[:3]
    return results, busy[0]


class CallsBack:
    """An integer argument (token ids, parents, a path) whose conversion (numpy's __array__)
    runs `fn` on another thread and waits for it: that call lands while the call converting
    this argument holds its object."""

    def __init__(self, value, fn):
        self.value, self.fn, self.raised = np.asarray(value, np.int64), fn, []

    def __array__(self, dtype=None, copy=None):
        def other():
            try:
                self.fn()
            except BaseException as e:
                self.raised.append(e)
        t = threading.Thread(target=other)
        t.start()
        t.join()
        return self.value if dtype is None else self.value.astype(dtype)


# ---- the MTP head ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    # wide enough that a draft's forwards (a 4096-row LM head) outlast a thread's wake-up
    make_tiny_checkpoint(d, mtp=True, vocab=4096, hidden=256, intermediate=512)
    return sapwood.load(d, weights="f32", kv="f32", max_context=256, threads=2)


def hidden_rows(model):
    eng = model.engine
    eng.reset()
    eng.keep_hidden = True
    eng.prefill(PROMPT)
    start, h = eng.take_hidden()
    assert start == 0
    return h, PROMPT[1:] + [7]


def test_mtp_head_from_several_threads_raises_busy_never_crashes(mtp_model):
    head = mtp_model.mtp
    h, nxt = hidden_rows(mtp_model)
    h, nxt = h[:1], nxt[:1]
    threads, repeat = 4, 15
    # each call commits one row: the k-th call that runs after a reset drafts from position
    # k, and its draft is want[k]
    head.reset()
    want = []
    for _ in range(threads * repeat):
        ids, logp = head.draft(h, nxt, 2, 3)
        want.append((ids.tolist(), logp.tolist()))
    results, busy = hammer(threads, 40, head.reset, lambda i: head.draft(h, nxt, 2, 3),
                           repeat=repeat)
    assert busy > 0 and results
    by_round = {}
    for r, (ids, logp) in results:
        by_round.setdefault(r, []).append((ids.tolist(), logp.tolist()))
    for got in by_round.values():  # the winners of a round ran one after another, exactly
        assert sorted(got) == sorted(want[:len(got)])
    head.reset()  # and the head still computes what it did
    assert [head.draft(h, nxt, 2, 3)[0].tolist() for _ in range(3)] == [w[0] for w in want[:3]]


def test_mtp_head_and_its_target_run_side_by_side(mtp_model):
    """The head reads the target's embedding table and LM head, which no call changes: the
    target engine and its head on two threads do not block each other, and each computes
    exactly what it computes alone."""
    model = mtp_model
    head, eng = model.mtp, model.engine
    h, nxt = hidden_rows(model)
    head.reset()
    want_head = head.draft(h, nxt, 4, 3)[0].tolist()
    eng.reset()
    want_eng = eng.prefill(PROMPT, all_logits=True)
    got_head, got_eng, errors = [], [], []

    def heads():
        try:
            for _ in range(30):
                head.reset()
                got_head.append(head.draft(h, nxt, 4, 3)[0].tolist())
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    def target():
        try:
            for _ in range(30):
                eng.reset()
                got_eng.append(eng.prefill(PROMPT, all_logits=True))
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    ts = [threading.Thread(target=heads), threading.Thread(target=target)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert all(g == want_head for g in got_head) and len(got_head) == 30
    assert all((g == want_eng).all() for g in got_eng) and len(got_eng) == 30


# ---- GDNLayer, KVSequence ------------------------------------------------------------------

S = dict(hk=2, hv=4, dk=16, dv=16, conv_k=4)
C = 2 * S["hk"] * S["dk"] + S["hv"] * S["dv"]


def gdn_layer():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((C, S["conv_k"])) * 0.5).astype(np.float32)
    layer = _core.GDNLayer(S["hk"], S["hv"], S["dk"], S["dv"], w)
    x = rng.standard_normal((6, C)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (6, S["hv"])).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (6, S["hv"])).astype(np.float32)
    return layer, x, g, beta


def test_gdn_layer_busy_while_one_call_holds_it():
    layer, x, g, beta = gdn_layer()
    layer.prefill(x, g, beta)
    parents = [-1, 0, 1, 1]
    want = layer.verify(x[:4], g[:4], beta[:4], parents)
    # another thread's commit lands while verify converts its parents: refused, verify exact
    arg = CallsBack(parents, lambda: layer.commit([0]))
    got = layer.verify(x[:4], g[:4], beta[:4], arg)
    assert len(arg.raised) == 1 and isinstance(arg.raised[0], _core.EngineBusyError)
    assert (got == want).all()
    results, busy = hammer(3, 60, lambda: None,
                           lambda i: layer.verify(x[:4], g[:4], beta[:4], parents, threads=2))
    assert all((out == want).all() for _, out in results) and results
    layer.commit([0, 1])  # the tape of the last verify: still usable
    assert layer.n_pending >= 0


def test_kv_sequence_busy_while_tree_attention_reads_it():
    pool = _core.KVPagePool(num_pages=8, page_size=32, n_kv_heads=2, head_dim=32, dtype="f32")
    seq = _core.KVSequence(pool)
    rng = np.random.default_rng(3)
    kv = lambda n: rng.standard_normal((n, 2, 32)).astype(np.float32)  # noqa: E731
    seq.append(kv(40), kv(40))
    q, kt, vt = rng.standard_normal((3, 4, 32)).astype(np.float32), kv(3), kv(3)
    parents = [-1, 0, 0]
    want = _core.tree_attention(seq, q, kt, vt, parents)
    more = kv(70)  # two more pages: the page table moves
    seq.append(more, more)
    want_longer = _core.tree_attention(seq, q, kt, vt, parents)
    seq.truncate(40)
    arg = CallsBack(parents, lambda: seq.append(more, more))
    got = _core.tree_attention(seq, q, kt, vt, arg)
    assert len(arg.raised) == 1 and isinstance(arg.raised[0], _core.EngineBusyError)
    assert (got == want).all() and seq.length == 40

    def call(i):
        if i == 0:  # appends and takes them back; the others read
            seq.append(more, more)  # busy: nothing appended
            while True:
                try:
                    seq.truncate(40)
                    return None
                except _core.EngineBusyError:
                    pass
        return _core.tree_attention(seq, q, kt, vt, parents, threads=1)

    results, busy = hammer(3, 60, lambda: None, call)
    assert busy > 0
    assert all(out is None or (out == want).all() or (out == want_longer).all()
               for _, out in results)
    assert seq.length == 40 and (_core.tree_attention(seq, q, kt, vt, parents) == want).all()


# ---- BackendOps --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    p = tmp_path_factory.mktemp("ops")
    make_tiny_checkpoint(p, seed=3)
    ck = read_checkpoint(p)
    return _core.BackendOps(engine_dims(ck.config), ck.weights, "f32", "cpu"), ck.config


def test_backend_ops_refuse_a_call_from_another_thread_or_from_inside(ops):
    o, cfg = ops
    H = cfg.hidden_size
    x = np.random.default_rng(4).standard_normal((3, H)).astype(np.float32)
    want = o.embed([1, 2, 3])
    arg = CallsBack([1, 2, 3], lambda: o.rms_norm(x, "model.norm.weight"))  # another thread
    assert (o.embed(arg) == want).all()
    assert len(arg.raised) == 1 and isinstance(arg.raised[0], _core.EngineBusyError)
    assert "another thread" in str(arg.raised[0])

    class Reenters:  # this thread, from inside the op converting it
        raised = []

        def __array__(self, dtype=None, copy=None):
            try:
                o.rms_norm(x, "model.norm.weight")
            except _core.EngineBusyError as e:
                self.raised.append(str(e))
            return np.array([1, 2, 3])

    arg = Reenters()
    assert (o.embed(arg) == want).all()
    assert len(arg.raised) == 1 and "do not nest" in arg.raised[0]


# ---- drafters ----------------------------------------------------------------------------

class Gate:
    """A stand-in for a drafter's engine or head: `name` blocks until released, so a second
    thread can call the drafter while the first is inside it."""

    def __init__(self, real, name):
        self._real, self._name = real, name
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, attr):
        value = getattr(self._real, attr)
        if attr != self._name:
            return value

        def held(*a, **kw):
            self.entered.set()
            assert self.release.wait(30)
            return value(*a, **kw)
        return held


def second_call_while_first_runs(drafter, first, second):
    errors, out = [], []

    def run():
        try:
            out.append(first())
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    gate = drafter.engine if isinstance(drafter, ModelDrafter) else drafter.head
    assert gate.entered.wait(30)
    try:
        with pytest.raises(_core.EngineBusyError, match="in use by another thread"):
            second()
    finally:
        gate.release.set()
        t.join()
    assert not errors and out


def test_model_drafter_refuses_a_second_thread(tmp_path):
    make_tiny_checkpoint(tmp_path, seed=5)
    draft = sapwood.load(tmp_path, weights="f32", max_context=256)
    d = ModelDrafter(draft)
    d.engine = Gate(draft.engine, "draft_candidates")
    second_call_while_first_runs(d, lambda: d.draft(PROMPT, 9, 3), lambda: d.reset())
    d.engine = draft.engine  # and the drafter goes on as before
    assert d.draft(PROMPT, 9, 3).rows == 3


def test_mtp_drafter_refuses_a_second_thread(mtp_model):
    d = MtpDrafter(mtp_model)
    mtp_model.engine.reset()
    mtp_model.engine.prefill(PROMPT)
    d.head = Gate(d.head, "draft_target")
    second_call_while_first_runs(d, lambda: d.draft(PROMPT, 9, 3),
                                 lambda: d.draft(PROMPT, 9, 3))
