"""Server-side figures from Prometheus ``/metrics``: counters before/after, gauge peaks during.

Names are read without their prefix (``pagoda:`` or ``vllm:``, which share the names), so
one scraper serves both. A server without ``/metrics`` (transformers serve) just has no
server-side figures in the report.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = (
    "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "request_success_total",
)
PEAK_GAUGES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")


def parse_metrics(text: str) -> dict[str, float]:
    """Unprefixed sample name -> value summed over label sets; ``request_success_total``
    is also split by ``finished_reason`` (``request_success_total:stop``). Pagoda exposes the
    contract's series under both prefixes (server/metrics_vllm.py): where ``pagoda:`` series are
    present the ``vllm:`` ones are skipped, so nothing is counted twice."""
    out: dict[str, float] = {}
    found = list(text_string_to_metric_families(text))
    twins = any(f.name.startswith("pagoda:") for f in found)  # then vllm: repeats pagoda:
    for family in found:
        for sample in family.samples:
            if sample.name.endswith("_created") or (twins and sample.name.startswith("vllm:")):
                continue
            name = sample.name.rpartition(":")[2]
            if name not in COUNTERS and name not in PEAK_GAUGES:
                continue
            out[name] = out.get(name, 0.0) + sample.value
            reason = sample.labels.get("finished_reason")
            if reason:
                key = f"{name}:{reason}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


async def scrape(client: httpx.AsyncClient, timeout_s: float = 5.0) -> dict[str, float] | None:
    """The server's figures now, or None when it has no (readable) /metrics."""
    try:
        r = await client.get("/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        return parse_metrics(r.text)
    except ValueError:
        return None


async def scrape_settled(client: httpx.AsyncClient, deadline_s: float = 3.0) -> dict[str, float] | None:
    """A scrape taken once the server is idle and two scrapes agree (bounded by ``deadline_s``).

    The engine publishes a step's counters around the time the last response goes out;
    waiting for an idle, stable reading keeps a race from shaving tokens off the delta.
    """
    end = time.monotonic() + deadline_s
    last = await scrape(client)
    while last is not None and time.monotonic() < end:
        await asyncio.sleep(0.1)
        now = await scrape(client)
        if now is None:
            return last
        idle = now.get("num_requests_running", 0) == 0 and now.get("num_requests_waiting", 0) == 0
        if idle and now == last:
            return now
        last = now
    return last


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    keys = sorted(k for k in after if k.partition(":")[0] in COUNTERS)
    return {k: after[k] - before.get(k, 0.0) for k in keys}


class PeakSampler:
    """Polls /metrics every ``interval_s`` while a run is going and keeps each gauge's peak."""

    def __init__(self, client: httpx.AsyncClient, interval_s: float = 0.5) -> None:
        self.client = client
        self.interval_s = interval_s
        self.peaks: dict[str, float] = {}
        self.samples = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        return dict(self.peaks)

    async def _run(self) -> None:
        while True:
            figures = await scrape(self.client, timeout_s=min(2.0, self.interval_s * 4))
            if figures is not None:
                self.samples += 1
                for name in PEAK_GAUGES:
                    if name in figures:
                        self.peaks[name] = max(self.peaks.get(name, 0.0), figures[name])
            await asyncio.sleep(self.interval_s)
