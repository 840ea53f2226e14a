"""Prometheus metrics (prometheus-client), read from the engine handle at scrape time."""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Metrics:
    def __init__(self, state):
        """Args: state: the app's ServerState; gauges read state.engine when scraped."""
        r = self.registry = CollectorRegistry()

        def gauge(name, doc, fn):
            g = Gauge(name, doc, registry=r)
            g.set_function(lambda: fn(state.engine) if state.engine is not None else 0)
            return g

        gauge("luce_requests_running", "Requests holding a slot", lambda e: e.running())
        gauge("luce_requests_waiting", "Requests queued for a slot", lambda e: e.waiting())
        gauge("luce_kv_blocks_used", "KV blocks owned by sequences", lambda e: e.blocks_used())
        gauge(
            "luce_kv_blocks_free",
            "KV blocks neither owned nor reserved (cached ones no request holds included)",
            lambda e: e.blocks_free(),
        )
        gauge(
            "luce_kv_blocks_cached",
            "KV blocks the prefix cache can share (held by requests or evictable)",
            lambda e: e.prefix_stats()["blocks"],
        )
        gauge(
            "luce_compiles",
            "Step programs compiled (constant after warmup)",
            lambda e: e.compiles(),
        )
        self.prompt_tokens = Counter("luce_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("luce_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("luce_requests", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram(
            "luce_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "luce_inter_token_latency_seconds", "Time between tokens", buckets=_ITL, registry=r
        )
        self.e2e = Histogram(
            "luce_e2e_request_latency_seconds", "Request latency", buckets=_LATENCY, registry=r
        )
        self.step = Histogram("luce_step_seconds", "Engine step time", buckets=_ITL, registry=r)
        self.recent_ttft: deque = deque(maxlen=512)  # (unix time, seconds): the web page's plot
        r.register(_PrefixCollector(state))
        r.register(_SpecCollector(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCollector:
    """Prefix cache totals, read from the engine at scrape time."""

    def __init__(self, state):
        self.state = state

    def describe(self):
        return []

    def collect(self):
        engine = self.state.engine
        st = engine.prefix_stats() if engine is not None else {"queries": 0, "hits": 0}
        for name, doc, key in (
            ("luce_prefix_cache_queries_tokens", "Prompt tokens looked up", "queries"),
            ("luce_prefix_cache_hits_tokens", "Prompt tokens found cached", "hits"),
        ):
            yield CounterMetricFamily(name, doc, value=st[key])


class _SpecCollector:
    """Speculative decoding totals, read from the engine at scrape time (none when off)."""

    def __init__(self, state):
        self.state = state

    def describe(self):
        return []  # families depend on the engine, which loads after the app starts

    def collect(self):
        engine = self.state.engine
        st = engine.spec_stats() if engine is not None else None
        if not st:
            return
        for name, doc, key in (
            ("luce_spec_proposed_tokens", "Speculative proposals verified", "proposed"),
            ("luce_spec_accepted_tokens", "Speculative proposals accepted", "accepted"),
            ("luce_spec_verify_rows", "Sequence steps that verified proposals", "verify_rows"),
        ):
            c = CounterMetricFamily(name, doc, labels=["mode"])
            c.add_metric([st["mode"]], st[key])
            yield c
        # Proposals accepted per verify row: a histogram over 0..K (le = accepted count).
        lengths, cum, buckets = st["accept_lengths"], 0, []
        for n in range(st["max_proposals"] + 1):
            cum += lengths.get(n, 0)
            buckets.append((str(n), cum))
        buckets.append(("+Inf", cum))
        h = HistogramMetricFamily(
            "luce_spec_acceptance_length",
            "Proposals accepted per verify row",
            labels=["mode"],
        )
        h.add_metric([st["mode"]], buckets, sum(n * c for n, c in lengths.items()))
        yield h
        g = GaugeMetricFamily(
            "luce_spec_active",
            "1 while speculation runs; 0 while the auto policy's gate measures it slower",
            labels=["mode"],
        )
        g.add_metric([st["mode"]], int(st.get("active", True)))
        yield g
