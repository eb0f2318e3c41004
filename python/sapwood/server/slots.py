"""Slots: N sequences of one model serving requests side by side, a FIFO scheduler, and
turn-end snapshots.

A slot is a `Model` of its own sequence state: slot 0's is loaded, the others are its
`new_sequence()`s, so `--parallel N` holds one copy of the weights (and of the draft model's).
Each slot is entered by its own worker thread only, so a request's output is the one it would
get served alone.

A request's choices are jobs. Jobs wait in one FIFO queue; a free slot takes the head job
(the slot that holds a snapshot the job can resume from, if that one is free, else the first
free slot). A full queue refuses new jobs (the server answers 503), a request with more choices
than the queue and the slots hold together can never fit (TooManyChoices: 400); a cancelled job
(its client went away) stops at its next token and frees its slot.

Every job ends in exactly one report, whatever happens to it: ("done", ChoiceResult) when it ran
(finish_reason "cancelled" when stopped on the way), ("error", ChoiceError) when it raised,
("cancelled", index) when it was cancelled before a slot took it. A request waits for its
choices' reports, so a job that ended silently would hang it.
"""
from __future__ import annotations

import queue as queues
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from ..drafters import ModelDrafter
from ..generate import DecodeConfig, GenerationStats, walk_and_commit
from ..reference.ranking import logsumexp
from ..sampling import SamplingParams
from ..session import Session


class QueueFull(Exception):
    """The queue is full now: try again later (503)."""


class TooManyChoices(ValueError):
    """A request with more jobs than the queue and the slots hold together: it can never fit,
    so trying again is no use (400)."""


def report(job, kind: str, payload) -> None:
    """job.emit(kind, payload), never raising: the caller is a slot's worker thread or the
    scheduler, which must go on whatever the listener does (e.g. its event loop has closed)."""
    try:
        job.emit(kind, payload)
    except Exception:  # noqa: BLE001 - nobody is left to hear it
        pass


@dataclass
class Job:
    """One choice of a request. `emit(kind, payload)` is called on the slot's worker thread:
    ("delta", Delta) as text and tokens are released, then ("done", ChoiceResult) or
    ("error", exception)."""
    index: int
    prompt: list
    max_tokens: int
    params: SamplingParams
    verify: str
    width: int | None
    drafter: str | None          # "lookup", "model", "mtp", or None: the server's default
    stops: list
    logprobs: int | None         # None: no logprobs; k >= 0: the token's and the top k
    emit: object
    stream: bool = True          # emit deltas as they come (else only the result)
    # snapshot the prompt's end too: the next choice of the request resumes there, and so does
    # a chat's next turn whose template renders this turn's reply as other tokens than it had
    keep_prompt: bool = True
    cancelled: threading.Event = field(default_factory=threading.Event)
    constraint: object = None    # grammar.Constraint: structured output (each job its matcher)


@dataclass
class Delta:
    index: int
    text: str
    tokens: list                 # ids whose text is complete within the released text
    logprobs: list               # per token: (logprob, [(id, logprob), ...top]) when asked
    ends: list                   # per token: where its text ends in the choice's text
    start: int                   # where the first token's text starts


@dataclass
class ChoiceError:
    """A job that raised: its index and the exception."""
    index: int
    error: BaseException


@dataclass
class ChoiceResult:
    index: int
    tokens: list
    text: str
    finish_reason: str           # "stop" | "length" | "cancelled"
    logprobs: list
    stats: GenerationStats
    prompt_tokens: int
    cached_tokens: int           # prompt tokens restored from a snapshot instead of prefilled
    prefilled_tokens: int        # prompt tokens the target prefilled
    seed: int
    slot: int
    ends: list = field(default_factory=list)  # per token: where its text ends in `text`


def token_logprobs(row, tok: int, top: int):
    """(log-softmax of `row` at tok, the top `top` (id, log-softmax) pairs, ties to the lower
    id), in float64 from the engine's float32 logits: the target's own distribution, before
    temperature, penalties or filters."""
    x = np.asarray(row, np.float64)
    z = logsumexp(x)
    best = []
    if top:
        ids = np.argsort(-x, kind="stable")[:top]
        best = [(int(i), float(x[i] - z)) for i in ids]
    return float(x[tok] - z), best


class _Recorder:
    """The target engine as the Decoder sees it, keeping the logits rows each emitted token
    was picked from: the prompt's last row, then per round the rows of the committed path
    (pick i of a round comes from the row of path node i, DESIGN.md's walk). Rows are kept by
    reference until their token is emitted."""

    def __init__(self, engine, keep: bool, batcher=None):
        self._engine, self._keep, self._batcher = engine, keep, batcher
        self._last = None
        self.rows: deque = deque()
        self.decoding = False  # between first() and the job's end: its verifies are batched

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def verify(self, tokens, parents):
        if self.decoding:
            self._last = self._batcher.verify(self._engine, tokens, parents)
        else:
            self._last = self._engine.verify(tokens, parents)
        return self._last

    def verify_walk(self, tokens, parents, fold_in_background=False, **sampling):
        """Engine.verify_walk, with the verify batched and its rows kept as verify()'s."""
        if not self.decoding and not self._keep:
            return self._engine.verify_walk(tokens, parents,
                                            fold_in_background=fold_in_background, **sampling)
        return walk_and_commit(self._engine, self.verify(tokens, parents), tokens, parents,
                               fold_in_background, **sampling)

    def first(self, logits) -> None:
        """The prompt is in: the decode loop starts."""
        if self._keep:
            self.rows.append(logits)
        if self._batcher is not None and not self.decoding:
            self._batcher.enter()
            self.decoding = True

    def done(self) -> None:
        if self.decoding:
            self.decoding = False
            self._batcher.leave()

    def on_round(self, tree, path, seconds) -> None:
        if self._keep:
            self.rows.extend(self._last[int(n)] for n in path)


@dataclass
class _Entry:
    slot: int
    tokens: tuple
    target: object
    draft: object                 # the draft engine's snapshot (its own length) or None
    logits: object                # the last row at the snapshot when known (a prompt's end)
    nbytes: int


class SnapshotCache:
    """Engine snapshots at turn ends (and prompt ends), least recently used first out, within
    a byte budget. A snapshot belongs to the slot whose engine took it: it is restored into
    that engine only. Sizes are the engine's own counts at the snapshot (KV pages in use plus
    the GDN state and tape capacity), an upper bound of what a snapshot holds: the cache never
    holds more than its budget."""

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: _Entry) -> None:
        if entry.nbytes > self.budget:
            return
        with self._lock:
            key = (entry.slot, entry.tokens)
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._entries[key] = entry
            self.bytes += entry.nbytes
            while self.bytes > self.budget:
                _, gone = self._entries.popitem(last=False)
                self.bytes -= gone.nbytes

    def _matches(self, entry: _Entry, ids: list) -> bool:
        n = len(entry.tokens)
        return (n < len(ids) or (n == len(ids) and entry.logits is not None)) \
            and tuple(ids[:n]) == entry.tokens

    def lookup(self, slot: int, ids: list) -> _Entry | None:
        """The longest entry of `slot` whose tokens begin `ids` (and leave a token to prefill,
        unless it kept its last logits); marks it recently used."""
        with self._lock:
            best = None
            for key, e in self._entries.items():
                if e.slot == slot and (best is None or len(e.tokens) > len(best.tokens)) \
                        and self._matches(e, ids):
                    best = e
            if best is not None:
                self._entries.move_to_end((best.slot, best.tokens))
            return best

    def best_slot(self, ids: list, slots) -> int | None:
        """Of `slots`, the one holding the longest snapshot `ids` can resume from."""
        with self._lock:
            best, n = None, 0
            for e in self._entries.values():
                if e.slot in slots and len(e.tokens) > n and self._matches(e, ids):
                    best, n = e.slot, len(e.tokens)
            return best


def _snapshot_bytes(engine) -> int:
    m = engine.memory()
    return int(m["kv_used_bytes"] + m["gdn_state_bytes"])


class Slot:
    """One sequence (a Model sharing the weights) and the worker thread that alone enters it."""

    def __init__(self, index: int, model, draft_model, default_drafter: str, cache: SnapshotCache,
                 on_done, batcher=None):
        self.index, self.model, self.draft_model = index, model, draft_model
        self.batcher = batcher  # batching.VerifyBatcher shared by the slots, or None
        self.default_drafter = default_drafter  # "model", "mtp" or "lookup"
        self.cache, self._on_done = cache, on_done
        self._jobs: queues.Queue = queues.Queue(maxsize=1)
        self.job: Job | None = None
        self._thread = threading.Thread(target=self._loop, name=f"sapwood-slot-{index}",
                                        daemon=True)
        self._thread.start()

    def start(self, job: Job) -> None:
        self.job = job
        self._jobs.put_nowait(job)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            result = None
            try:
                if job.cancelled.is_set():  # cancelled after dispatch (a sibling failed): no run
                    event = ("cancelled", job.index)
                else:
                    result = self.run(job)
                    event = ("done", result)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - the request fails, the slot goes on
                # BaseException: a Rust panic inside the tokenizer (pyo3's PanicException) is
                # not an Exception; missed here it would end this thread, and the slot and the
                # request waiting for this job's report with it
                event = ("error", ChoiceError(job.index, e))
            finally:
                self.job = None
                try:
                    self._on_done(self, result)
                except Exception:  # noqa: BLE001 - metrics must not take the slot down
                    pass
            # the slot is idle (and its turn-end snapshot cached) before the client hears: its
            # next turn, sent at once, finds the slot that can resume it free
            report(job, *event)

    def _drafter(self, kind):
        kind = kind or self.default_drafter
        if kind == "model":
            d = self.model.resolve_drafter(self.draft_model)
            d.reset()  # a fresh request: the draft's state is restored or prefilled anew
            return d
        return self.model.resolve_drafter(kind)  # "mtp" (its head starts afresh) or "lookup"

    def _prefill(self, job, ids, drafter, rec, info):
        eng = self.model.engine
        hit = self.cache.lookup(self.index, ids) if self.cache.budget else None
        if hit is None:
            logits = eng.prefill(ids)
            info["cached"] = 0
        else:
            eng.restore(hit.target)
            rest = ids[len(hit.tokens):]
            logits = eng.prefill(rest) if rest else hit.logits
            info["cached"] = len(hit.tokens)
            if hit.draft is not None and isinstance(drafter, ModelDrafter):
                drafter.resume(hit.draft)
        info["prefilled"] = len(ids) - info["cached"]
        rec.first(logits)
        if job.keep_prompt and self.cache.budget:
            self._keep(tuple(ids), None, logits)
        return logits

    def _keep(self, tokens: tuple, drafter, logits=None) -> None:
        eng = self.model.engine
        if eng.position != len(tokens):
            return
        nbytes = _snapshot_bytes(eng)
        draft = None
        if isinstance(drafter, ModelDrafter) and 0 < drafter.engine.position <= len(tokens):
            draft = drafter.engine.snapshot()
            nbytes += _snapshot_bytes(drafter.engine)
        if logits is not None:
            nbytes += logits.nbytes
        self.cache.put(_Entry(self.index, tokens, eng.snapshot(), draft, logits, nbytes))

    def run(self, job: Job) -> ChoiceResult:
        model = self.model
        claimed = [model] + ([self.draft_model] if self.draft_model is not None else [])
        for m in claimed:  # only this slot's thread enters them; the claim says so loudly
            m._claim()
        try:
            return self._run(job)
        finally:
            for m in claimed:
                m._release()

    def _run(self, job: Job) -> ChoiceResult:
        model = self.model
        cfg = DecodeConfig(max_tokens=job.max_tokens, params=job.params, verify=job.verify,
                           width=job.width, stop_ids=model.eos_ids(),
                           constraint=job.constraint).validate()
        drafter = None if cfg.verify == "off" else self._drafter(job.drafter)
        model.engine.reset()
        rec = _Recorder(model.engine, keep=job.logprobs is not None, batcher=self.batcher)
        try:
            return self._decode(job, cfg, drafter, rec)
        finally:
            rec.done()

    def _decode(self, job, cfg, drafter, rec) -> ChoiceResult:
        info: dict = {}
        steps = Session(self.model, engine=rec).run(
            job.prompt, cfg, drafter, stops=job.stops, on_round=rec.on_round,
            prefill=lambda ids: self._prefill(job, ids, drafter, rec, info),
            cancelled=job.cancelled.is_set)
        logprobs = []
        try:
            while True:
                chunk = next(steps)
                if job.logprobs is not None:  # the rows of released tokens, in order
                    logprobs += [token_logprobs(rec.rows.popleft(), t, job.logprobs)
                                 for t in chunk.tokens]
                n = len(chunk.tokens)
                if job.stream and (chunk.text or n):
                    job.emit("delta", Delta(job.index, chunk.text, chunk.tokens,
                                            logprobs[len(logprobs) - n:] if job.logprobs is not None
                                            else [], chunk.ends, chunk.start))
        except StopIteration as fin:
            out = fin.value
        finish = "length" if out.finish_reason == "context" else out.finish_reason
        if finish != "cancelled" and self.cache.budget:
            self._keep(tuple(out.context), drafter)
        return ChoiceResult(job.index, out.tokens, out.text, finish, logprobs[:len(out.tokens)],
                            out.stats, len(job.prompt), info.get("cached", 0),
                            info.get("prefilled", 0), int(job.params.seed), self.index, out.ends)


class Scheduler:
    """FIFO admission of jobs to slots; see the module docstring."""

    def __init__(self, slots_factory, parallel: int, cache: SnapshotCache, max_queue: int,
                 on_done=None):
        self.cache, self.max_queue = cache, int(max_queue)
        self._lock = threading.Lock()
        self._queue: deque = deque()
        self._on_done = on_done
        self.slots = [slots_factory(i, self._done) for i in range(parallel)]
        self._idle = list(self.slots)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> int:
        return len(self.slots) - len(self._idle)

    @property
    def capacity(self) -> int:
        """The most jobs one request may have: the queue's and the slots' together."""
        return self.max_queue + len(self.slots)

    def submit(self, jobs) -> None:
        """Queue a request's jobs, all or none; QueueFull when they do not fit now,
        TooManyChoices when they never could."""
        if len(jobs) > self.capacity:
            raise TooManyChoices(f"the request has {len(jobs)} choices (n times the prompts); "
                                 f"this server holds at most {self.capacity} at once "
                                 f"({self.max_queue} waiting, --queue, and {len(self.slots)} "
                                 "running, --parallel)")
        with self._lock:
            waiting = sum(not j.cancelled.is_set() for j in self._queue)
            if waiting + len(jobs) > self.max_queue + len(self._idle):
                raise QueueFull(f"{waiting} requests are waiting (the queue holds "
                                f"{self.max_queue}); try again later")
            self._queue.extend(jobs)
            dropped = self._dispatch()
        self._report_dropped(dropped)

    def _dispatch(self) -> list:
        """Start queued jobs on idle slots; the cancelled jobs it dropped (to report outside
        the lock)."""
        dropped = []
        while self._queue and self._idle:
            job = self._queue.popleft()
            if job.cancelled.is_set():
                dropped.append(job)
                continue
            pick = self.cache.best_slot(job.prompt, {s.index for s in self._idle}) \
                if self.cache.budget else None
            slot = next((s for s in self._idle if s.index == pick), self._idle[0])
            self._idle.remove(slot)
            slot.start(job)
        return dropped

    def cancel(self, jobs) -> None:
        """Cancel jobs: a running one stops at its next token (and reports "done" with
        finish_reason "cancelled"); a queued one leaves the queue and reports "cancelled" now."""
        for j in jobs:
            j.cancelled.set()
        mine = {id(j) for j in jobs}
        with self._lock:
            dropped = [j for j in self._queue if id(j) in mine]
            if dropped:
                self._queue = deque(j for j in self._queue if id(j) not in mine)
        self._report_dropped(dropped)

    @staticmethod
    def _report_dropped(jobs) -> None:
        for job in jobs:  # never ran: their requests hear so, or they would wait for them
            report(job, "cancelled", job.index)

    def _done(self, slot: Slot, result) -> None:
        if self._on_done is not None:
            self._on_done(slot, result)
        with self._lock:
            self._idle.append(slot)
            self._idle.sort(key=lambda s: s.index)
            dropped = self._dispatch()
        self._report_dropped(dropped)

    def close(self) -> None:
        with self._lock:
            dropped = list(self._queue)
            for j in dropped:
                j.cancelled.set()
            self._queue.clear()
        self._report_dropped(dropped)
        for s in self.slots:
            if s.job is not None:
                s.job.cancelled.set()
            s.stop()
