"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Latencies and token counters are observed by the async engine as outputs arrive; the engine's own state
(running, waiting, preemptions, KV pages, prefix cache) is read from its latest stats snapshot at scrape time.

Every value is served twice: under jaxserve's names (``jaxserve:*``, label ``model_name``) and under vLLM's
(``vllm:*``, labels ``model_name`` and ``engine``; vLLM's types, units and histogram buckets), which is what
routers written for vLLM read (the Gateway API inference extension's endpoint picker, vLLM's production stack).
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

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py), so that dashboards' and routers' ``le`` thresholds match.
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_VLLM_TTFT_BUCKETS += (20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_VLLM_TOKEN_BUCKETS += (20.0, 40.0, 80.0)
_VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
_VLLM_E2E_BUCKETS += (240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM creates every finish reason's series up front (at 0): a router sees them before the first request ends.
_FINISH_REASONS = ("stop", "length", "abort", "error")
ENGINE = "0"  # vLLM's ``engine`` label: the engine core's index. One engine here (data-parallel replicas summed).


def parse_metrics(text: str, prefix: str = "jaxserve") -> dict[str, float]:
    """A /metrics scrape's ``prefix:*`` series as {"prefix:name|label value|...": value}, labels sorted by name,
    model_name and engine left out; series that differ only by those are summed. For tests and benchmarks."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^({re.escape(prefix)}:[\w:]+)(\{{[^}}]*\}})? ([0-9.e+-]+|NaN)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            skip = ("model_name", "engine")
            key = m.group(1) + "".join(f"|{v}" for k, v in sorted(labels.items()) if k not in skip)
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


class _EngineCollector:
    """Engine gauges and counters from ``stats()`` (a dict of ``LLMEngine.get_stats()``), read at scrape time.

    ``cache_info``: the labels of ``vllm:cache_config_info`` (block_size, num_gpu_blocks, ...); None: not served.
    """

    def __init__(self, stats: Callable[[], dict], model: str, cache_info: dict[str, str] | None = None):
        self._stats, self._model, self._cache_info = stats, model, cache_info

    def collect(self):
        s = self._stats() or {}
        ours, theirs = ([self._model], ["model_name"]), ([self._model, ENGINE], ["model_name", "engine"])

        def family(kind, name, doc, value, labels=ours):
            f = kind(name, doc, labels=labels[1])
            f.add_metric(labels[0], float(value))
            return f

        def gauge(name, doc, value):
            return family(GaugeMetricFamily, f"jaxserve:{name}", doc, value)

        def counter(name, doc, value):
            return family(CounterMetricFamily, f"jaxserve:{name}", doc, value)

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
        yield from self._vllm(s, lambda kind, name, doc, value: family(kind, f"vllm:{name}", doc, value, theirs))

    def _vllm(self, s: dict, family):
        """The same state under vLLM's names (vllm/v1/metrics/loggers.py), including the deprecated ones vLLM's
        production-stack router still reads (``gpu_cache_usage_perc``, ``gpu_prefix_cache_*``)."""
        G, C = GaugeMetricFamily, CounterMetricFamily
        running, waiting, usage = s.get("num_running", 0), s.get("num_waiting", 0), s.get("kv_usage", 0.0)
        queries, hits = s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0)
        yield family(G, "num_requests_running", "Number of requests in model execution batches.", running)
        yield family(G, "num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        yield family(G, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield family(G, "gpu_cache_usage_perc", "KV-cache usage (DEPRECATED: vllm:kv_cache_usage_perc).", usage)
        yield family(
            C, "num_preemptions", "Cumulative number of preemption from the engine.", s.get("num_preemptions", 0)
        )
        yield family(C, "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", queries)
        yield family(C, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", hits)
        yield family(
            C, "gpu_prefix_cache_queries", "Prefix cache queries (DEPRECATED: vllm:prefix_cache_queries).", queries
        )
        yield family(C, "gpu_prefix_cache_hits", "Prefix cache hits (DEPRECATED: vllm:prefix_cache_hits).", hits)
        yield family(G, "gpu_prefix_cache_hit_rate", "Prefix cache hit rate (vLLM v0's gauge).", hits / max(queries, 1))
        if self._cache_info is not None:
            info = {**self._cache_info, "engine": ENGINE}
            g = GaugeMetricFamily(
                "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
            )
            g.add_metric(list(info.values()), 1.0)
            yield g


class ServerMetrics:
    """The server's metrics; ``registry`` is what /metrics renders.

    The async engine reports each request's life through ``first_token``, ``more_tokens``, ``request_done`` and
    ``finished``; each goes to jaxserve's series and vLLM's.

    Args:
        model: the ``model_name`` label.
        stats: the engine's latest ``get_stats()`` dict, read at scrape time.
        cache_info: the labels of ``vllm:cache_config_info`` (None: the series is left out).
    """

    def __init__(self, model: str, stats: Callable[[], dict], cache_info: dict[str, str] | None = None):
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
            "Requests turned away (answered 4xx or 503 instead of served), by status.",
            ["model_name", "status"],
            registry=r,
        )
        self._vllm_metrics(model)
        self.registry.register(_EngineCollector(stats, model, cache_info))

    def _vllm_metrics(self, model: str) -> None:
        r, label, values = self.registry, ["model_name", "engine"], (model, ENGINE)

        def histogram(name, doc, buckets):
            return Histogram(f"vllm:{name}", doc, label, registry=r, buckets=buckets).labels(*values)

        self.vllm_ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", _VLLM_TTFT_BUCKETS
        )
        self.vllm_itl = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _VLLM_TOKEN_BUCKETS
        )
        self.vllm_tpot = histogram(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds (DEPRECATED: vllm:inter_token_latency_seconds).",
            _VLLM_TOKEN_BUCKETS,
        )
        self.vllm_request_tpot = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _VLLM_TOKEN_BUCKETS,
        )
        self.vllm_e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _VLLM_E2E_BUCKETS
        )
        self.vllm_prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", label, registry=r
        ).labels(*values)
        self.vllm_generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", label, registry=r
        ).labels(*values)
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", label + ["finished_reason"], registry=r
        )
        self._vllm_success = {reason: success.labels(*values, reason) for reason in _FINISH_REASONS}
        self._vllm_success_family = success

    # ------------------------------------------------------------------ what the async engine reports
    def first_token(self, ttft: float, num_prompt_tokens: int, num_tokens: int) -> None:
        """A request's first output: ``ttft`` seconds after its arrival, ``num_tokens`` tokens in it."""
        self.ttft.observe(ttft)
        self.vllm_ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.vllm_prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_tokens)
        self.vllm_generation_tokens.inc(num_tokens)

    def more_tokens(self, itl: float, num_tokens: int) -> None:
        """A later output of a request: ``itl`` seconds after its previous one, ``num_tokens`` new tokens."""
        self.itl.observe(itl)
        self.vllm_itl.observe(itl)
        self.vllm_tpot.observe(itl)
        self.generation_tokens.inc(num_tokens)
        self.vllm_generation_tokens.inc(num_tokens)

    def request_done(self, e2e: float, decode_s: float, num_tokens: int) -> None:
        """A request's last output: ``e2e`` seconds after its arrival, ``decode_s`` after its first token, with
        ``num_tokens`` tokens in all (vLLM's mean time per output token leaves the first one out)."""
        self.e2e.observe(e2e)
        self.vllm_e2e.observe(e2e)
        self.vllm_request_tpot.observe(decode_s / (num_tokens - 1) if num_tokens > 1 else 0.0)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model, reason).inc()
        counter = self._vllm_success.get(reason)
        if counter is None:
            counter = self._vllm_success[reason] = self._vllm_success_family.labels(self.model, ENGINE, reason)
        counter.inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(self.model, str(status)).inc()
