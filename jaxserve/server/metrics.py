"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Latencies and token counters are observed by the async engine as outputs arrive; the engine's own state
(running, waiting, preemptions, KV pages, prefix cache) is read from its latest stats snapshot at scrape time.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0)


def parse_metrics(text: str) -> dict[str, float]:
    """A /metrics scrape as {"jaxserve:name|label value|...": value}, labels sorted by name and model_name
    left out; series that differ only by model_name are summed. For tests and benchmarks."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(jaxserve:[\w:]+)(\{[^}]*\})? ([0-9.e+-]+|NaN)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            key = m.group(1) + "".join(f"|{v}" for k, v in sorted(labels.items()) if k != "model_name")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


class _EngineCollector:
    """Engine gauges and counters from ``stats()`` (a dict of ``LLMEngine.get_stats()``), read at scrape time."""

    def __init__(self, stats: Callable[[], dict], model: str):
        self._stats, self._model = stats, model

    def collect(self):
        s = self._stats() or {}
        label = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"jaxserve:{name}", doc, labels=label)
            g.add_metric([self._model], float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"jaxserve:{name}", doc, labels=label)
            c.add_metric([self._model], float(value))
            return c

        yield gauge("num_requests_running", "Sequences running in the engine.", s.get("num_running", 0))
        yield gauge("num_requests_waiting", "Sequences waiting in the engine.", s.get("num_waiting", 0))
        yield counter(
            "num_preemptions",
            "Preemptions (a request's pages taken back; it recomputes later).",
            s.get("num_preemptions", 0),
        )
        yield gauge("kv_cache_usage_perc", "Fraction of the KV page pool in use (1 = full).", s.get("kv_usage", 0.0))
        yield gauge("kv_cache_used_pages", "KV pages in use.", s.get("num_used_pages", 0))
        yield gauge("kv_cache_usable_pages", "KV pages in the pool.", s.get("num_usable_pages", 0))
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission.",
            s.get("prefix_cache_queries", 0),
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache (whole pages).", s.get("prefix_cache_hits", 0)
        )
        yield gauge(
            "prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries.", s.get("prefix_cache_hit_rate", 0.0)
        )
        yield counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed.", s.get("spec_draft_tokens", 0)
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Speculative decoding: proposed tokens accepted.",
            s.get("spec_accepted_tokens", 0),
        )
        yield counter("num_compilations", "Traces of the jitted step.", s.get("num_compilations", 0))
        yield counter("engine_steps", "Engine steps run.", s.get("num_steps", 0))


class ServerMetrics:
    """The server's metrics; ``registry`` is what /metrics renders."""

    def __init__(self, model: str, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.model = model
        r, label = self.registry, ["model_name"]
        self.ttft = Histogram(
            "jaxserve:time_to_first_token_seconds",
            "Time to first token (arrival to first token).",
            label,
            registry=r,
            buckets=_LATENCY_BUCKETS,
        ).labels(model)
        self.itl = Histogram(
            "jaxserve:inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence.",
            label,
            registry=r,
            buckets=_LATENCY_BUCKETS,
        ).labels(model)
        self.e2e = Histogram(
            "jaxserve:e2e_request_latency_seconds",
            "Arrival to the last token.",
            label,
            registry=r,
            buckets=_E2E_BUCKETS,
        ).labels(model)
        self.prompt_tokens = Counter(
            "jaxserve:prompt_tokens", "Prompt tokens of admitted requests.", label, registry=r
        ).labels(model)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "Generated tokens.", label, registry=r).labels(
            model
        )
        self._success = Counter(
            "jaxserve:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._rejected = Counter(
            "jaxserve:request_rejected",
            "Requests turned away before the engine, by status.",
            ["model_name", "status"],
            registry=r,
        )
        self.registry.register(_EngineCollector(stats, model))

    def finished(self, reason: str) -> None:
        self._success.labels(self.model, reason).inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(self.model, str(status)).inc()
