"""``/metrics``: Prometheus text, named as vLLM's metrics with a ``kiln:`` prefix.

Engine-wide figures (running/waiting requests, KV usage, prefix-cache and
token counters) are read from the engine when scraped; per-request latencies
are observed by the front end as requests finish, labelled with the model the request
named (a LoRA adapter's name, as vLLM labels them; else the first served name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kiln.outputs import RequestOutput
from kiln.spec_decode.stats import SpecDecodeStats

if TYPE_CHECKING:
    from kiln.engine.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self):
        stats = self.stats()
        label = ["model_name"], [self.model_name]
        for name, doc, key in (
            ("kiln:num_requests_running", "Requests being generated.", "num_running"),
            ("kiln:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
            ("kiln:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", "kv_cache_usage"),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=label[0])
            gauge.add_metric(label[1], stats[key])
            yield gauge
        for name, doc, key in (
            ("kiln:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
            ("kiln:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
            ("kiln:prompt_tokens", "Prompt tokens computed.", "prompt_tokens"),
            ("kiln:generation_tokens", "Tokens generated.", "generation_tokens"),
            ("kiln:num_preemptions", "Requests preempted to free KV-cache blocks.", "num_preemptions"),
        ):
            counter = CounterMetricFamily(name, doc, labels=label[0])
            counter.add_metric(label[1], stats[key])
            yield counter
        if stats["spec_decode"] is not None:
            yield from _spec_decode_metrics(stats["spec_decode"], label)


def _spec_decode_metrics(spec: SpecDecodeStats, label: tuple[list[str], list[str]]):
    """vLLM's speculative-decoding counters (only when speculative decoding is on)."""
    for name, doc, value in (
        ("kiln:spec_decode_num_drafts", "Drafts verified (one per sequence per step with drafts).", spec.num_drafts),
        ("kiln:spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
        ("kiln:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
    ):
        counter = CounterMetricFamily(name, doc, labels=label[0])
        counter.add_metric(label[1], value)
        yield counter
    per_pos = CounterMetricFamily(
        "kiln:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 = first).",
        labels=[*label[0], "position"],
    )
    for pos, value in enumerate(spec.accepted_per_pos):
        per_pos.add_metric([*label[1], str(pos)], value)
    yield per_pos


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(engine.get_stats, model_name))
        labels = ["model_name"]
        self.ttft = Histogram(
            "kiln:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "kiln:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kiln:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_len = Histogram(
            "kiln:request_prompt_tokens", "Prompt length.", labels, buckets=_TOKEN_BUCKETS, registry=self.registry
        )
        self.output_len = Histogram(
            "kiln:request_generation_tokens",
            "Tokens generated per request.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            "kiln:request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "kiln:request_rejected",
            "Requests refused before they were queued, by reason.",
            labels + ["reason"],
            registry=self.registry,
        )

    def observe_finished(self, out: RequestOutput, generated: list[int], model_name: str | None = None) -> None:
        """Record a finished request; ``generated`` is each completion's token count (streams send deltas)."""
        m, name = out.metrics, model_name or self.model_name
        for completion in out.outputs:
            self.finished.labels(name, completion.finish_reason or "abort").inc()
        self.prompt_len.labels(name).observe(len(out.prompt_token_ids))
        self.output_len.labels(name).observe(sum(generated))
        if m is None or m.first_token_time is None:
            return
        self.ttft.labels(name).observe(m.first_token_time)
        if m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)
        if generated and generated[0] > 1 and m.last_token_time is not None:
            first = m.arrival_time + m.first_token_time
            self.tpot.labels(name).observe((m.last_token_time - first) / (generated[0] - 1))

    def observe_aborted(self, count: int = 1, model_name: str | None = None) -> None:
        self.finished.labels(model_name or self.model_name, "abort").inc(count)

    def observe_rejected(self, reason: str, model_name: str | None = None) -> None:
        """A request refused before it was queued (e.g. ``overloaded``: past ``--max-queued-requests``)."""
        self.rejected.labels(model_name or self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
