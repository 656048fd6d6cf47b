"""Prometheus metrics for the server (names follow vLLM's, prefix ``pagoda:``).

The engine loop hands a :class:`engine.stats.StepStats` to :meth:`Metrics.on_step`
after every step and every abort; HTTP handlers call :meth:`record_client_disconnect`;
``GET /metrics`` serves :meth:`render`, which also exposes the gateways' contract subset
under ``vllm:`` names (server/metrics_vllm.py: the same objects, renamed at render time).

prometheus_client appends ``_total`` to counter names in the exposition, so the
counter declared as ``pagoda:prompt_tokens`` is scraped as ``pagoda:prompt_tokens_total``
(as vLLM's ``vllm:prompt_tokens_total``). Every series carries a ``model_name`` label.
All prometheus_client metric objects are thread-safe, so the engine thread may record
while the event loop renders.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine.stats import StepStats
from server.metrics_vllm import ContractView

PREFIX = "pagoda:"

FINISH_REASONS = ("stop", "length", "abort")
ENDPOINTS = ("completions", "chat_completions", "responses", "messages")
"""The `endpoint` label of the per-endpoint series."""

# Bucket boundaries as in vLLM (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]

GRAMMAR_COMPILE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]

DEFAULT_MAX_MODEL_LEN = 8192


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including ``max_value`` (vLLM's helper)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class Metrics:
    """All of Pagoda's Prometheus series, in one registry (a fresh one by default)."""

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        # The LoRA series (server/serving_lora.py `LoraMetrics`), added by the app when LoRA is on.
        self.lora = None
        max_model_len = max_model_len or DEFAULT_MAX_MODEL_LEN
        token_buckets = build_1_2_5_buckets(max_model_len)
        iteration_buckets = build_1_2_5_buckets(max_num_batched_tokens or max_model_len)

        reg = self.registry
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(
                PREFIX + name, doc, labels, registry=reg, buckets=buckets
            ).labels(model_name)

        # Gauges: the state after the last step.
        self.num_requests_running = gauge(
            "num_requests_running", "Number of requests in the running batch.")
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Number of requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "KV-cache usage: fraction of blocks in use (0..1).")
        self.kv_cache_tail_waste_tokens = gauge(
            "kv_cache_tail_waste_tokens",
            "Allocated but unused KV slots in the last block of every running request.")

        # Counters.
        self.prompt_tokens = counter(
            "prompt_tokens", "Number of prefill (prompt) tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens produced.")
        self.num_preemptions = counter(
            "num_preemptions", "Cumulative number of request preemptions.")
        self.kv_events_dropped = counter(
            "kv_events_dropped", "KV-cache events dropped because the publisher's queue was full.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix-cache queries, in tokens.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.http_requests_client_disconnected = counter(
            "http_requests_client_disconnected",
            "HTTP requests whose client disconnected before the response finished.")
        self._request_success = Counter(
            PREFIX + "request_success",
            "Count of finished requests by finish reason; each sample counts (n=2 counts 2).",
            ["model_name", "finished_reason"], registry=reg)
        for reason in FINISH_REASONS:  # expose zeros from the start
            self._request_success.labels(model_name, reason)

        # Histograms.
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token, seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens, seconds.",
            ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency, seconds.",
            REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first scheduled, seconds.",
            REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", token_buckets)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.",
            token_buckets)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens scheduled per engine step.", iteration_buckets)

        # Structured outputs.
        self._structured_requests = Counter(
            PREFIX + "structured_output_requests",
            "Requests constrained by a grammar, by kind (json, json_object, regex, choice, grammar, tools).",
            ["model_name", "kind"], registry=reg)
        self.grammar_compile_time = histogram(
            "grammar_compile_seconds", "Time to compile a grammar (cache misses only), seconds.",
            GRAMMAR_COMPILE_BUCKETS)
        self.grammar_compile_failures = counter(
            "grammar_compile_failures", "Grammars that failed to compile (invalid, or past a limit).")

        # Speculative decoding (vLLM's names): acceptance rate = accepted / draft tokens;
        # per position j, accepted_tokens_per_pos{position=j} / num_drafts.
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Speculative decoding: verifications (a request's drafts checked in one step).")
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.")
        self._spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by position in the draft (0 = first).",
            ["model_name", "position"], registry=reg)

        # Per HTTP endpoint (completions, chat_completions, responses, messages): the engine's series
        # above cannot tell which API a request came through.
        endpoint_labels = ["model_name", "endpoint"]
        self._endpoint_requests = Counter(
            PREFIX + "endpoint_requests",
            "Finished requests by endpoint and finish reason, counted as request_success_total is: each "
            "sample, with the engine's finish reason (abort only if the engine aborted it).",
            ["model_name", "endpoint", "finished_reason"], registry=reg)
        self._endpoint_prompt_tokens = Counter(
            PREFIX + "endpoint_prompt_tokens",
            "Prompt tokens of finished requests, by endpoint; each prompt once, as usage.prompt_tokens.",
            endpoint_labels, registry=reg)
        self._endpoint_generation_tokens = Counter(
            PREFIX + "endpoint_generation_tokens", "Generated tokens of finished requests, by endpoint.",
            endpoint_labels, registry=reg)
        self._endpoint_latency = Histogram(
            PREFIX + "endpoint_e2e_request_latency_seconds", "Arrival to last token, seconds, by endpoint.",
            endpoint_labels, registry=reg, buckets=REQUEST_LATENCY_BUCKETS)
        for endpoint in ENDPOINTS:  # expose zeros from the start
            for reason in FINISH_REASONS:
                self._endpoint_requests.labels(model_name, endpoint, reason)
            self._endpoint_prompt_tokens.labels(model_name, endpoint)
            self._endpoint_generation_tokens.labels(model_name, endpoint)

        # Per API key (--api-keys-file), labelled by the key's name, never by the key.
        tenant_labels = ["model_name", "tenant"]
        self._api_keys = gauge("api_keys", "Named API keys in force (--api-keys-file).")
        self._tenant_requests = Counter(
            PREFIX + "tenant_requests", "Requests admitted, by API key name.", tenant_labels, registry=reg)
        self._tenant_rejections = Counter(
            PREFIX + "tenant_rejections",
            "Requests answered 429, by API key name and limit (requests, tokens, concurrency).",
            ["model_name", "tenant", "limit"], registry=reg)
        self._tenant_prompt_tokens = Counter(
            PREFIX + "tenant_prompt_tokens", "Prompt tokens admitted, by API key name.", tenant_labels, registry=reg)
        self._tenant_generation_tokens = Counter(
            PREFIX + "tenant_generation_tokens", "Generated tokens, by API key name.", tenant_labels, registry=reg)
        self._tenant_ttft = Histogram(
            PREFIX + "tenant_time_to_first_token_seconds", "Time to first token, seconds, by API key name.",
            tenant_labels, registry=reg, buckets=TTFT_BUCKETS)
        self._tenant_queue_time = Histogram(
            PREFIX + "tenant_request_queue_time_seconds",
            "Time from arrival to first scheduled, seconds, by API key name.",
            tenant_labels, registry=reg, buckets=REQUEST_LATENCY_BUCKETS)

        # The Responses API's store.
        self.responses_stored = gauge(
            "responses_stored", "Responses kept for previous_response_id and GET /v1/responses/{id}.")
        self.responses_store_bytes = gauge(
            "responses_store_bytes", "Size of the stored responses and their conversations as JSON, bytes.")

    # --- recording -------------------------------------------------------------------

    def record_endpoint_request(
        self, endpoint: str, finish_reason: str, num_prompt_tokens: int, num_generation_tokens: int, latency_s: float
    ) -> None:
        """One sample that the engine ended (finished or aborted), by the endpoint it came
        through; `num_prompt_tokens` is its prompt's for sample 0 only."""
        self._endpoint_requests.labels(self.model_name, endpoint, finish_reason).inc()
        self._endpoint_prompt_tokens.labels(self.model_name, endpoint).inc(num_prompt_tokens)
        self._endpoint_generation_tokens.labels(self.model_name, endpoint).inc(num_generation_tokens)
        self._endpoint_latency.labels(self.model_name, endpoint).observe(latency_s)

    def set_api_keys(self, names: list[str]) -> None:
        """The named keys now in force: their count, and zeroed series for each new name."""
        self._api_keys.set(len(names))
        for name in names:
            self._tenant_requests.labels(self.model_name, name)
            self._tenant_prompt_tokens.labels(self.model_name, name)
            self._tenant_generation_tokens.labels(self.model_name, name)

    def record_tenant_request(self, tenant: str) -> None:
        self._tenant_requests.labels(self.model_name, tenant).inc()

    def record_tenant_rejection(self, tenant: str, limit: str) -> None:
        self._tenant_rejections.labels(self.model_name, tenant, limit).inc()

    def record_tenant_tokens(self, tenant: str, prompt: int = 0, generation: int = 0) -> None:
        if prompt:
            self._tenant_prompt_tokens.labels(self.model_name, tenant).inc(prompt)
        if generation:
            self._tenant_generation_tokens.labels(self.model_name, tenant).inc(generation)

    def record_tenant_finished(self, tenant: str, ttft_s: float | None, queue_time_s: float | None) -> None:
        """A finished engine request of `tenant` (from the engine thread): its latencies."""
        if ttft_s is not None:
            self._tenant_ttft.labels(self.model_name, tenant).observe(ttft_s)
        if queue_time_s is not None:
            self._tenant_queue_time.labels(self.model_name, tenant).observe(queue_time_s)

    def set_response_store(self, num_entries: int, num_bytes: int) -> None:
        self.responses_stored.set(num_entries)
        self.responses_store_bytes.set(num_bytes)

    def on_step(self, stats: StepStats) -> None:
        """Record one engine step (or abort report). Called from the engine-loop thread."""
        if self.lora is not None:
            self.lora.on_step(stats)
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(min(max(stats.kv_cache_usage, 0.0), 1.0))
        self.kv_cache_tail_waste_tokens.set(stats.kv_cache_tail_waste_tokens)

        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        if stats.kv_events_dropped:
            self.kv_events_dropped.inc(stats.kv_events_dropped)
        if stats.num_scheduled_tokens > 0:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        self.record_prefix_cache(stats.prefix_cache_queries, stats.prefix_cache_hits)

        if stats.spec_num_drafts:
            self.spec_decode_num_drafts.inc(stats.spec_num_drafts)
            self.spec_decode_num_draft_tokens.inc(stats.spec_num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(stats.spec_num_accepted_tokens)
            for position in stats.spec_accepted_per_position:
                self._spec_accepted_per_pos.labels(self.model_name, str(position)).inc()

        for ttft in stats.time_to_first_token_s:
            self.time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latency_s:
            self.inter_token_latency.observe(itl)

        for req in stats.finished:
            if req.tenant is not None:
                self.record_tenant_finished(req.tenant, req.time_to_first_token_s, req.queue_time_s)
            self._request_success.labels(self.model_name, req.finish_reason).inc()
            self.e2e_request_latency.observe(req.e2e_latency_s)
            if req.queue_time_s is not None:
                self.request_queue_time.observe(req.queue_time_s)
            self.request_prompt_tokens.observe(req.num_prompt_tokens)
            self.request_generation_tokens.observe(req.num_generation_tokens)

    def record_prefix_cache(self, queries: int, hits: int) -> None:
        """Prefix-cache lookups (in tokens) and how many of them hit."""
        if queries:
            self.prefix_cache_queries.inc(queries)
        if hits:
            self.prefix_cache_hits.inc(hits)

    def set_engine_info(self, facts: dict[str, str]) -> None:
        """`pagoda:engine_info{...} 1`: what was loaded and how it runs, one label per fact
        (as vLLM's cache_config_info)."""
        names = sorted(facts)
        info = Gauge(PREFIX + "engine_info", "What the engine loaded and how it runs (labels); always 1.",
                     ["model_name", *names], registry=self.registry)
        info.labels(self.model_name, *[facts[n] for n in names]).set(1)

    def set_cache_config(self, block_size: int, num_blocks: int, cache_dtype: str, enable_prefix_caching: bool) -> None:
        """`pagoda:cache_config_info{block_size, num_gpu_blocks, ...} 1`, as vLLM's
        `cache_config_info` (also exposed under that name): gateways read the KV cache's
        block size and block count from it. `num_gpu_blocks` is the KV blocks of this
        device, CPU included (vLLM's CPU build names them so too)."""
        labels = {"block_size": str(block_size), "num_gpu_blocks": str(num_blocks), "cache_dtype": cache_dtype,
                  "enable_prefix_caching": str(enable_prefix_caching)}
        info = Gauge(PREFIX + "cache_config_info", "The KV cache's configuration (labels); always 1.",
                     ["model_name", *labels], registry=self.registry)
        info.labels(self.model_name, *labels.values()).set(1)

    def record_structured_request(self, kind: str) -> None:
        self._structured_requests.labels(self.model_name, kind).inc()

    def on_grammar_compiled(self, kind: str, seconds: float, error: BaseException | None) -> None:
        """A compile finished (on a compile thread): its time, or a failure."""
        self.grammar_compile_time.observe(seconds)
        if error is not None:
            self.grammar_compile_failures.inc()

    def record_client_disconnect(self) -> None:
        self.http_requests_client_disconnected.inc()

    # --- exposition ------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The body and Content-Type for ``GET /metrics``."""
        return generate_latest(ContractView(self.registry)), CONTENT_TYPE_LATEST
