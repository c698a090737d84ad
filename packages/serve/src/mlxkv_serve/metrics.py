"""Prometheus metrics: requests, disconnects, failures, queue depth, batch size, tokens, speculative drafts, time to
first token, the prompt cache tiers, the memory budget."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, cache_stats: Callable[[], Mapping[str, int | float]], queue_depth: Callable[[], int],
                 batch_size: Callable[[], int], memory: Callable[[], Mapping[str, int | None]] | None = None) -> None:
        """`memory`: the memory budget's figures (`MemoryReporting.memory`), where the engine has one."""
        self.registry = CollectorRegistry()
        self.requests = Counter("mlxkv_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=self.registry)
        self.disconnects = Counter("mlxkv_client_disconnects", "requests the client abandoned before the answer was sent",
                                   ["endpoint"], registry=self.registry)
        self.failures = Counter("mlxkv_generation_failures", "generations that raised (reported as errors)", registry=self.registry)
        self.queue_depth = Gauge("mlxkv_queue_depth", "requests waiting for the engine", registry=self.registry)
        self.queue_depth.set_function(lambda: float(queue_depth()))
        self.batch_size = Gauge("mlxkv_batch_size", "generations running together", registry=self.registry)
        self.batch_size.set_function(lambda: float(batch_size()))
        self.prompt_tokens = Counter("mlxkv_prompt_tokens", "prompt tokens received", registry=self.registry)
        self.cached_tokens = Counter("mlxkv_cached_prompt_tokens", "prompt tokens served from the prompt cache", registry=self.registry)
        self.resumed_tokens = Counter("mlxkv_resumed_tokens", "generated tokens restored from checkpoints", registry=self.registry)
        self.completion_tokens = Counter("mlxkv_completion_tokens", "tokens generated", registry=self.registry)
        self.draft_tokens = Counter("mlxkv_speculative_draft_tokens", "speculative drafts verified", registry=self.registry)
        self.accepted_tokens = Counter("mlxkv_speculative_accepted_tokens", "speculative drafts accepted (each a step saved)",
                                       registry=self.registry)
        self.billing_headers = Counter("mlxkv_billing_headers_dropped",
                                       "Claude Code billing-header system blocks left out of prompts (they change every request)",
                                       registry=self.registry)
        self.ttft = Histogram("mlxkv_time_to_first_token_seconds", "time from request to first token", registry=self.registry,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
        self.registry.register(_GaugeCollector("cache", "prompt cache", cache_stats))
        if memory is not None:
            self.registry.register(_GaugeCollector("memory", "memory budget", memory))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GaugeCollector:
    """Exposes a mapping of figures as gauges `mlxkv_<prefix>_<name>` at scrape time (the engine's
    cache stats: hits and bytes per tier; the memory budget, the plan and the process's measured
    memory); a figure that is None (not measured here) is left out."""

    def __init__(self, prefix: str, what: str, figures: Callable[[], Mapping[str, int | float | None]]) -> None:
        self._prefix = prefix
        self._what = what
        self._figures = figures

    def collect(self) -> list[GaugeMetricFamily]:
        families = []
        for name, value in sorted(self._figures().items()):
            if value is not None:
                family = GaugeMetricFamily(f"mlxkv_{self._prefix}_{name}", f"{self._what}: {name.replace('_', ' ')}")
                family.add_metric([], float(value))
                families.append(family)
        return families

    def describe(self) -> list[GaugeMetricFamily]:
        return []
