"""The model-server metrics contract under vLLM's names, for the gateways that read it.

LLM-aware gateways and routers (SMG, the llm-d / Gateway API Inference Extension endpoint
picker, vllm-router, AIBrix, Dynamo) score a replica by scraping `/metrics` for vLLM's
series: `vllm:num_requests_waiting` (queue depth), `vllm:kv_cache_usage_perc` (or its
older name `vllm:gpu_cache_usage_perc`), `vllm:num_requests_running`,
`vllm:lora_requests_info` (adapter affinity), `vllm:cache_config_info` (block size and
count), and the prefix-cache, token and latency series. Pagoda's own series
(`server/metrics.py`) already follow vLLM's names, types, labels and buckets under the
`pagoda:` prefix; this module exposes the contract's subset of them a second time under
`vllm:` when `/metrics` is rendered, from the same metric objects. No second bookkeeping:
one value recorded, both names scraped, so the two can never disagree.

Why both names rather than only `vllm:`: Pagoda's dashboards, alerts and tests read
`pagoda:`, and series Pagoda has that vLLM lacks (tenants, endpoints, grammar compiles)
would be odd under a `vllm:` prefix; why not only `pagoda:`: the gateways have no setting
for another prefix. The cost is ~5 KB more per scrape.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

PAGODA = "pagoda:"
VLLM = "vllm:"

CONTRACT = {
    # Load: what the gateways route on.
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),  # vLLM v1's name, then v0's
    "num_preemptions": ("num_preemptions",),
    # Prefix cache (tokens), as vLLM v1 counts them.
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    # Tokens and requests.
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    # Latency histograms (vLLM's buckets); ITL also under vLLM's older name.
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "iteration_tokens_total": ("iteration_tokens_total",),
    "cache_config_info": ("cache_config_info",),
}
"""`pagoda:` family name (without prefix) -> the `vllm:` names it is also exposed under."""


def _renamed(family: Metric, new_name: str) -> Metric:
    """A copy of `family` named `new_name`, its samples' names (`_total`, `_bucket`, ...) alike."""
    old = family.name
    copy = Metric(new_name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        copy.samples.append(sample._replace(name=new_name + sample.name[len(old):]))
    return copy


class ContractView:
    """What `GET /metrics` renders: every series of `registry`, then the contract's under
    `vllm:` (prometheus_client's `generate_latest` only calls `collect()`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        families = list(self.registry.collect())
        yield from families
        yield from self._contract(families)

    @staticmethod
    def _contract(families: Iterable[Metric]) -> Iterator[Metric]:
        for family in families:
            if not family.name.startswith(PAGODA):
                continue
            for name in CONTRACT.get(family.name[len(PAGODA):], ()):
                yield _renamed(family, VLLM + name)
