"""fork() after the engine's worker pool started (issue 50, case 10): a child has only the
forking thread, so the pool's workers it copied do not exist, and generate() with threads >= 2
and a draft model (whose rounds fold the target's GDN steps on a pool worker) never returned.
The child now builds a pool of its own at its first parallel region, and a fork waits for a
running background fold, so the child computes exactly what the parent does. Every child runs
under a deadline: a regression fails instead of hanging the run."""
from __future__ import annotations

import multiprocessing
import os
import json
import signal
import time
from queue import Empty

import numpy as np
import pytest

import sapwood
from sapwood import _core
from sapwood.testing import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
DEADLINE = 60  # seconds; the children below take well under one
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 240, 30)]


def in_child(fn):
    """fn() in a forked child: its result (through JSON: arrays come back as lists), or the
    child's exception re-raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's cleanup
        code = 0
        try:
            os.close(r)
            try:
                out = ("ok", fn())
            except BaseException as e:
                out = ("error", repr(e))
            data = json.dumps(out, default=lambda x: np.asarray(x).tolist()).encode()
            while data:
                data = data[os.write(w, data):]
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + DEADLINE
    os.set_blocking(r, False)
    try:
        while True:
            try:
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    pytest.fail(f"the forked child did not finish within {DEADLINE} s")
                time.sleep(0.01)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    status, value = json.loads(b"".join(chunks))
    assert status == "ok", f"the child raised {value}"
    return value


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("fork")
    make_tiny_checkpoint(d, seed=2)
    target = sapwood.load(d, weights="f32", max_context=256, threads=2, policy_cache=False)
    draft = sapwood.load(d, weights="f32", max_context=256, threads=2, policy_cache=False)
    return target, draft


def generate(target, draft):
    return target.generate(PROMPT, max_tokens=12, drafter=draft, verify="chain").tokens


def test_generate_in_a_forked_child_returns_the_parents_tokens(models):
    target, draft = models
    want = generate(target, draft)  # the pool and its workers are running now
    assert in_child(lambda: generate(target, draft)) == want
    # a grandchild too (its parent's pool was itself rebuilt after a fork)
    assert in_child(lambda: in_child(lambda: generate(target, draft))) == want
    assert generate(target, draft) == want  # the parent's pool is untouched


def test_fork_while_a_background_fold_runs(models):
    """commit(fold_in_background=True) folds on a pool worker while the caller goes on: a fork
    right after it waits for the fold, so the child's state is the parent's, folded."""
    eng = models[0].engine
    eng.reset()
    eng.prefill(PROMPT)
    eng.verify([5, 6, 7, 8], [-1, 0, 1, 2])
    eng.commit([0, 1, 2, 3], fold_in_background=True)
    child = in_child(lambda: eng.verify([9, 10], [-1, 0]))
    assert (np.array(child, np.float32) == eng.verify([9, 10], [-1, 0])).all()


def _generate_in_process(queue):
    target, draft = _MODELS
    queue.put(generate(target, draft))


_MODELS = None


def test_multiprocessing_fork_context(models):
    """multiprocessing's default start method on Linux before Python 3.14."""
    global _MODELS
    _MODELS = models
    try:
        _run_multiprocessing_fork(models)
    finally:
        _MODELS = None  # a module global would keep the models (and their memory) past the module


def _run_multiprocessing_fork(models):
    want = generate(*models)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    p = ctx.Process(target=_generate_in_process, args=(queue,))
    p.start()
    try:
        got = queue.get(timeout=DEADLINE)
    except Empty:
        got = None
    finally:
        p.join(None if got is not None else 1)
        if p.is_alive():
            p.kill()
            p.join()
    assert got is not None, f"the forked process did not answer within {DEADLINE} s"
    assert got == want and p.exitcode == 0


def test_pool_regions_in_a_child_run_every_job_once(models):
    """The pool's contract (each job of a region once, a job's error reaches the caller) in a
    child, whose pool is a new one."""
    generate(*models)  # the parent's pool is running
    counts, raised = in_child(lambda: _core.pool_job_counts(64, 2, 5, -1))
    assert list(counts) == [5] * 64 and not raised
    counts, raised = in_child(lambda: _core.pool_job_counts(17, 2, 3, 4))
    assert list(counts) == [3] * 17 and raised == 3
