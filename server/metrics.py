"""Prometheus metrics: the only module that touches prometheus_client.

Labels are bounded: route templates (never raw paths or session ids), status codes, memory kinds,
worker names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.interface import EngineStats, IngestDone, IngestProgress

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
RETRIEVAL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
THROUGHPUT_BUCKETS = (100, 250, 500, 1000, 2500, 5000, 10_000, 25_000, 50_000, 100_000, 250_000)


class _EngineCollector(Collector):
    """Gauges read from the engine's plain stats at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        yield GaugeMetricFamily("longdoc_ready", "1 once the models are loaded", value=float(stats.ready))
        yield GaugeMetricFamily("longdoc_active_sessions", "sessions held", value=stats.active_sessions)
        memory = GaugeMetricFamily("longdoc_session_memory_bytes", "bytes held by session memories", labels=["memory"])
        for kind, value in sorted(stats.session_memory_bytes.items()):
            memory.add_metric([kind], value)
        yield memory
        yield GaugeMetricFamily(
            "longdoc_session_memory_limit_bytes", "what all session memories may hold together", value=stats.memory_limit_bytes
        )
        yield GaugeMetricFamily(
            "longdoc_session_memory_reserved_bytes", "bytes promised to work in flight", value=stats.memory_reserved_bytes
        )
        yield GaugeMetricFamily("longdoc_sessions_on_disk", "sessions saved on disk, not in RAM", value=stats.sessions_on_disk)
        yield GaugeMetricFamily(
            "longdoc_session_snapshot_failures", "unreadable session snapshots met since start", value=stats.snapshot_failures
        )
        queue = GaugeMetricFamily("longdoc_queue_depth", "requests admitted and not finished", labels=["worker"])
        for worker, value in sorted(stats.queue_depth.items()):
            queue.add_metric([worker], value)
        yield queue
        yield GaugeMetricFamily("longdoc_queue_limit", "requests each worker admits before 429", value=stats.queue_limit)
        yield _per_model(GaugeMetricFamily, "longdoc_batch_rows", "answers in the model's decode batch", stats.batch_rows)
        yield _per_model(
            GaugeMetricFamily,
            "longdoc_batch_waiting",
            "answers queued for a place in the model's decode batch or for memory",
            stats.batch_waiting,
        )
        yield _per_model(GaugeMetricFamily, "longdoc_kv_blocks", "key/value blocks the model's answers hold", stats.kv_blocks)
        yield _per_model(GaugeMetricFamily, "longdoc_kv_block_bytes", "bytes of one key/value block", stats.kv_block_bytes)
        yield _per_model(
            CounterMetricFamily, "longdoc_kv_preemptions", "answers preempted when memory ran short", stats.kv_preemptions
        )
        yield _per_model(
            GaugeMetricFamily, "longdoc_prefix_cache_tokens", "positions of sessions' last prompts kept", stats.prefix_tokens
        )
        yield _per_model(
            CounterMetricFamily, "longdoc_prefix_cache_hits", "prompts started from a kept prefix", stats.prefix_hits
        )
        yield _per_model(
            CounterMetricFamily,
            "longdoc_prefix_cache_reused_tokens",
            "prompt tokens taken from a kept prefix instead of fed again",
            stats.prefix_reused_tokens,
        )


def _per_model(
    family: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, description: str, values: dict[str, int]
) -> Metric:
    metric = family(name, description, labels=["model"])
    for model, value in sorted(values.items()):
        metric.add_metric([model], value)
    return metric


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("longdoc_requests", "HTTP requests", ["route", "method", "status"], registry=r)
        self.ttft = Histogram(
            "longdoc_time_to_first_token_seconds",
            "request arrival to first text",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "longdoc_inter_token_latency_seconds",
            "time between streamed text deltas",
            ["endpoint"],
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "longdoc_e2e_request_latency_seconds",
            "request arrival to last token",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("longdoc_prompt_tokens", "prompt tokens processed", ["endpoint"], registry=r)
        self.generated_tokens = Counter("longdoc_generation_tokens", "tokens generated", ["endpoint"], registry=r)
        self.ingested_tokens = Counter("longdoc_ingested_tokens", "document tokens ingested", ["memory"], registry=r)
        self.retrieval = Histogram(
            "longdoc_retrieval_latency_seconds",
            "memory retrieval for one question",
            ["memory"],
            buckets=RETRIEVAL_BUCKETS,
            registry=r,
        )
        self.ingest_pending = Gauge(
            "longdoc_ingestion_pending_tokens", "tokens of documents being ingested, not yet in memory", ["memory"], registry=r
        )
        self.errors = Counter("longdoc_errors", "error responses and error events, by error type", ["type"], registry=r)
        self.ingest_throughput = Histogram(
            "longdoc_ingestion_tokens_per_second",
            "tokens per second of each ingested document",
            ["memory"],
            buckets=THROUGHPUT_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(stats))

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class GenerationTimer:
    """Follows one generation request and records TTFT, inter-token latency and end-to-end latency."""

    def __init__(self, metrics: Metrics, endpoint: str) -> None:
        self._metrics = metrics
        self._endpoint = endpoint
        self.started = time.perf_counter()
        self.first: float | None = None
        self._last: float | None = None

    def on_text(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self._metrics.ttft.labels(self._endpoint).observe(now - self.started)
        elif self._last is not None:
            self._metrics.itl.labels(self._endpoint).observe(now - self._last)
        self._last = now

    @property
    def ttft(self) -> float:
        return (self.first or time.perf_counter()) - self.started

    def finish(self, prompt_tokens: int, completion_tokens: int) -> float:
        total = time.perf_counter() - self.started
        self._metrics.e2e.labels(self._endpoint).observe(total)
        self._metrics.prompt_tokens.labels(self._endpoint).inc(prompt_tokens)
        self._metrics.generated_tokens.labels(self._endpoint).inc(completion_tokens)
        return total


class IngestionMeter:
    """Follows one document's ingestion: its tokens count as ingested as they are streamed in
    (so rates are live, not a burst at the end) and as pending until then, even if it is aborted."""

    def __init__(self, metrics: Metrics, memory: str) -> None:
        self._metrics, self._memory = metrics, memory
        self.started = time.perf_counter()
        self._done = 0
        self._pending = 0

    def _advance(self, tokens_done: int) -> None:
        step = max(0, tokens_done - self._done)
        self._metrics.ingested_tokens.labels(self._memory).inc(step)
        self._done += step
        self._set_pending(self._pending - step)

    def _set_pending(self, tokens: int) -> None:
        self._metrics.ingest_pending.labels(self._memory).inc(tokens - self._pending)
        self._pending = tokens

    def on_event(self, event: IngestProgress | IngestDone) -> None:
        if isinstance(event, IngestProgress):
            if self._done == 0 and self._pending == 0:
                self._set_pending(event.tokens_total)
            self._advance(event.tokens_done)
            return
        self._advance(event.document.tokens)
        seconds = max(1e-9, time.perf_counter() - self.started)
        self._metrics.ingest_throughput.labels(self._memory).observe(event.document.tokens / seconds)

    def close(self) -> None:
        """Whatever was not ingested is no longer pending."""
        self._set_pending(0)
