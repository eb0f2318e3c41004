"""The busy slots' verify rounds in one forward.

Each slot decodes on its own thread; when its Decoder verifies a tree, the slot hands the tree
to the batcher and waits. The batch runs (on the thread that completes it) when every decoding
slot has handed one, or when the first waiter's short wait passes: `_core.verify_many` verifies
all the trees in one forward, so each weight matrix is read once for all their rows. A
sequence's logits from verify_many are the bits of its own verify() (docs/design.md "Exactness"),
so a request's output does not depend on what it was batched with.
"""
from __future__ import annotations

import threading
import time

from .. import _core


class _Ticket:
    __slots__ = ("engine", "tokens", "parents", "out", "error", "done")

    def __init__(self, engine, tokens, parents):
        self.engine, self.tokens, self.parents = engine, tokens, parents
        self.out = self.error = None
        self.done = False


class VerifyBatcher:
    """Batches the verifies of the slots between enter() and leave() (their decode loops).

    wait_s: how long a handed-in tree waits for the other decoding slots' trees before its
    batch runs without them (a slot may be drafting a long chain, or about to finish). None:
    half the recent forwards' time, within [MIN_WAIT_S, MAX_WAIT_S]: slots drift apart by
    about their drafting time, which grows with the model as a forward does, and waiting half
    a forward to read the weights once for two trees is worth it while weights dominate."""

    MIN_WAIT_S, MAX_WAIT_S = 0.0005, 0.05

    def __init__(self, wait_s: float | None = None):
        if wait_s is not None and not wait_s >= 0:
            raise ValueError(f"wait_s={wait_s!r}: must be >= 0 (or None: adaptive)")
        self.wait_s = None if wait_s is None else float(wait_s)
        self._forward_s = 2 * self.MIN_WAIT_S  # moving average of the batches' forwards
        self._cv = threading.Condition()
        self._decoding = 0
        self._pending: list = []
        self.forwards = 0     # batches run
        self.sequences = 0    # trees verified in them

    def enter(self) -> None:
        with self._cv:
            self._decoding += 1

    def leave(self) -> None:
        with self._cv:
            self._decoding -= 1
            self._cv.notify_all()  # a waiting batch may be complete now

    def verify(self, engine, tokens, parents):
        """engine.verify(tokens, parents), batched with the other decoding slots' trees."""
        me = _Ticket(engine, tokens, parents)
        with self._cv:
            self._pending.append(me)
            deadline = time.monotonic() + self.wait()
            while True:
                if me.done:
                    return self._result(me)
                if me in self._pending:
                    now = time.monotonic()
                    if len(self._pending) >= self._decoding or now >= deadline:
                        batch, self._pending = self._pending, []
                        break
                    self._cv.wait(deadline - now)
                else:  # another thread runs the batch this tree is in
                    self._cv.wait()
        self._run(batch)
        return self._result(me)

    def wait(self) -> float:
        """How long a tree handed in now waits for the others."""
        if self.wait_s is not None:
            return self.wait_s
        return min(self.MAX_WAIT_S, max(self.MIN_WAIT_S, 0.5 * self._forward_s))

    @staticmethod
    def _result(t):
        if t.error is not None:
            raise t.error
        return t.out

    def _run(self, batch) -> None:
        t0 = time.perf_counter()
        together = len(batch) > 1
        if together:
            try:
                outs = _core.verify_many([(t.engine, t.tokens, t.parents) for t in batch])
                for t, o in zip(batch, outs):
                    t.out = o
            except Exception:  # noqa: BLE001 - each tree then gets its own result or error
                # (more nodes than one forward takes, engines of different models, a bad tree)
                together = False
        if not together:
            for t in batch:
                try:
                    t.out = t.engine.verify(t.tokens, t.parents)
                except Exception as e:  # noqa: BLE001 - raised on its own slot's thread
                    t.error = e
        seconds = time.perf_counter() - t0
        with self._cv:
            self._forward_s += 0.2 * (seconds - self._forward_s)
            self.forwards += 1
            self.sequences += len(batch)
            for t in batch:
                t.done = True
            self._cv.notify_all()
