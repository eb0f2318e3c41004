"""Prometheus metrics of a server (prometheus_client, one registry per server)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self, scheduler, cache):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sapwood_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("sapwood_prompt_tokens", "prompt tokens of finished choices",
                                     registry=r)
        self.prefill_tokens = Counter("sapwood_prefill_tokens",
                                      "prompt tokens the target prefilled", registry=r)
        self.cached_tokens = Counter("sapwood_cached_prompt_tokens",
                                     "prompt tokens restored from a snapshot instead", registry=r)
        self.tokens = Counter("sapwood_generation_tokens", "tokens returned", registry=r)
        self.cycles = Counter("sapwood_cycles", "decoding rounds (one target verify each)",
                              registry=r)
        self.wide = Counter("sapwood_wide_cycles", "rounds that verified a wide tree", registry=r)
        self.accepted = Counter("sapwood_draft_rows_accepted", "draft tokens the target kept",
                                registry=r)
        self.verified = Counter("sapwood_nodes_verified", "tree nodes verified", registry=r)
        self.cancelled = Counter("sapwood_choices_cancelled",
                                 "choices stopped because the client went away", registry=r)
        self.tokens_per_s = Gauge("sapwood_tokens_per_second",
                                  "the last finished choice's tokens per second (prefill "
                                  "included)", registry=r)
        self.tokens_per_cycle = Gauge("sapwood_tokens_per_cycle",
                                      "the last finished choice's tokens per round", registry=r)
        self.acceptance = Gauge("sapwood_acceptance",
                                "the last finished choice's kept draft tokens per drafted node "
                                "verified", registry=r)
        self.latency = Histogram("sapwood_request_seconds", "request time, arrival to last byte",
                                 ["endpoint"], registry=r,
                                 buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.ttft = Histogram("sapwood_time_to_first_token_seconds",
                              "a choice's prefill and first pick", registry=r,
                              buckets=(.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))
        g = Gauge("sapwood_queue_depth", "choices waiting for a slot", registry=r)
        g.set_function(lambda: scheduler.queue_depth)
        g = Gauge("sapwood_slots_busy", "slots running a choice", registry=r)
        g.set_function(lambda: scheduler.busy)
        g = Gauge("sapwood_slots", "slots (--parallel)", registry=r)
        g.set_function(lambda: len(scheduler.slots))
        g = Gauge("sapwood_snapshot_cache_bytes", "bytes held by turn-end snapshots", registry=r)
        g.set_function(lambda: cache.bytes)
        g = Gauge("sapwood_snapshot_cache_entries", "turn-end snapshots held", registry=r)
        g.set_function(lambda: len(cache))

    def choice_done(self, result) -> None:
        """Called on a slot's worker thread when a choice ends (None when it failed)."""
        if result is None:
            return
        if result.finish_reason == "cancelled":
            self.cancelled.inc()
        s = result.stats
        self.prompt_tokens.inc(result.prompt_tokens)
        self.prefill_tokens.inc(result.prefilled_tokens)
        self.cached_tokens.inc(result.cached_tokens)
        self.tokens.inc(len(result.tokens))
        self.cycles.inc(s.cycles)
        self.wide.inc(s.wide_cycles)
        self.accepted.inc(s.draft_rows_accepted)
        self.verified.inc(s.nodes_verified)
        self.ttft.observe(s.prefill_s)
        if s.cycles:
            self.tokens_per_s.set(s.tokens_per_s)
            self.tokens_per_cycle.set(s.tokens_per_cycle)
            drafted = s.nodes_verified - s.cycles  # every round verifies its root
            self.acceptance.set(s.draft_rows_accepted / drafted if drafted else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
