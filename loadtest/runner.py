"""One run: warm-up, then the requests at a fixed concurrency or at a (bursty) arrival rate.

- Fixed concurrency (``request_rate`` infinite): at most ``concurrency`` requests in flight;
  each finished request lets the next one go (a closed loop).
- Arrival rate: inter-arrival times drawn from a gamma distribution with mean
  ``1 / request_rate`` and shape ``burstiness`` (1 = Poisson; < 1 burstier, > 1 steadier),
  on an absolute schedule so the rate does not drift; ``concurrency`` still caps in-flight
  requests when given.
- ``duration_s`` stops sending new requests; requests in flight finish (each is bounded by
  the request timeout), so the run is bounded in time as well as in count.

Server figures are scraped from /metrics after the warm-up and when the run has settled,
and sampled every ``sample_interval_s`` in between for the gauges' peaks.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field, replace

import httpx

from loadtest.client import RequestParams, RequestResult, send_request
from loadtest.datasets import BenchRequest
from loadtest.progress import NoProgress
from loadtest.server_metrics import PeakSampler, counter_deltas, scrape_settled

WARMUP_MAX_TOKENS = 8


@dataclass(frozen=True, slots=True)
class LoadSpec:
    concurrency: int | None = None  # most requests in flight; None: no cap
    request_rate: float = math.inf  # requests per second; inf: as fast as concurrency allows
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 = Poisson
    duration_s: float | None = None  # send no new request after this many seconds
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0, got {self.duration_s}")

    @property
    def label(self) -> str:
        parts = []
        if math.isfinite(self.request_rate):
            parts.append(f"rate {self.request_rate:g}/s" + (f" (gamma {self.burstiness:g})" if self.burstiness != 1 else ""))
        parts.append(f"concurrency {self.concurrency}" if self.concurrency else "no concurrency cap")
        return ", ".join(parts)

    def describe(self) -> dict:
        return {
            "concurrency": self.concurrency,
            "request_rate": self.request_rate if math.isfinite(self.request_rate) else "inf",
            "burstiness": self.burstiness, "duration_s": self.duration_s, "seed": self.seed,
        }


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times (seconds after the start) of ``n`` requests; all zero for an infinite rate."""
    if not math.isfinite(rate):
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)  # gamma mean = shape * scale = 1 / rate
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, theta)
        out.append(t)
    return out


@dataclass(slots=True)
class RunOutcome:
    results: list[RequestResult]
    wall_s: float
    warmup: dict
    metrics_before: dict | None = None
    metrics_after: dict | None = None
    metric_peaks: dict = field(default_factory=dict)
    metric_samples: int = 0

    def server_metrics(self) -> dict | None:
        if self.metrics_before is None or self.metrics_after is None:
            return None
        return {"deltas": counter_deltas(self.metrics_before, self.metrics_after),
                "peaks": self.metric_peaks, "samples": self.metric_samples}


async def run_load(
    base_url: str,
    requests: list[BenchRequest],
    warmup: list[BenchRequest],
    params: RequestParams,
    load: LoadSpec,
    *,
    headers: dict | None = None,
    progress=None,
    label: str = "run",
    sample_interval_s: float = 0.5,
) -> RunOutcome:
    progress = progress or NoProgress()
    in_flight = load.concurrency or max(len(requests), 1)
    limits = httpx.Limits(max_connections=in_flight + 4, max_keepalive_connections=in_flight + 4)
    timeout = httpx.Timeout(params.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout) as client:
        warm = await _warm_up(client, warmup, params, in_flight)
        before = await scrape_settled(client)
        sampler = PeakSampler(client, sample_interval_s)
        if before is not None:
            sampler.start()
        progress.start(label, len(requests))
        try:
            results, wall_s = await _drive(client, requests, params, load, progress)
        finally:
            progress.finish()
            peaks = await sampler.stop()
        after = await scrape_settled(client) if before is not None else None
    return RunOutcome(results, wall_s, warm, before, after, peaks, sampler.samples)


async def _warm_up(client: httpx.AsyncClient, warmup: list[BenchRequest], params: RequestParams, in_flight: int) -> dict:
    """Short versions of a few requests, to load lazy paths (model, kernels, pools) uncounted."""
    if not warmup:
        return {"requests": 0, "failed": 0}
    sem = asyncio.Semaphore(in_flight)
    t0 = time.perf_counter()

    async def one(req: BenchRequest) -> RequestResult:
        async with sem:
            return await send_request(client, replace(req, max_tokens=min(req.max_tokens, WARMUP_MAX_TOKENS)), params, t0)

    results = await asyncio.gather(*(one(r) for r in warmup))
    failed = [r for r in results if not r.ok]
    return {"requests": len(results), "failed": len(failed),
            "first_error": f"{failed[0].error_kind}: {failed[0].error}" if failed else None}


async def _drive(client: httpx.AsyncClient, requests: list[BenchRequest], params: RequestParams, load: LoadSpec, progress) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    schedule = arrival_times(len(requests), load.request_rate, load.burstiness, random.Random(load.seed))
    t0 = time.perf_counter()
    deadline = t0 + load.duration_s if load.duration_s else math.inf

    async def one(req: BenchRequest) -> RequestResult:
        try:
            result = await send_request(client, req, params, t0)
        finally:
            if sem is not None:
                sem.release()
        progress.advance(result)
        return result

    tasks = []
    for req, at in zip(requests, schedule):
        delay = min(t0 + at, deadline) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is not None:
            try:
                await asyncio.wait_for(sem.acquire(), timeout=max(deadline - time.perf_counter(), 0) if math.isfinite(deadline) else None)
            except asyncio.TimeoutError:
                break
        if time.perf_counter() >= deadline:
            if sem is not None:
                sem.release()
            break
        tasks.append(asyncio.create_task(one(req)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - t0
