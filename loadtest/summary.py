"""The figures of one run: throughput, latency distributions, errors by kind, goodput.

- TTFT: send to first content chunk. TPOT: (e2e - TTFT) / (output tokens - 1), per request.
- ITL: every gap between consecutive content chunks of every request (pooled).
- Throughput: completed requests and their output tokens over the run's wall time (first
  send to last finish), warm-up excluded.
- Goodput: requests per second that finished and met every SLO given (``--slo ttft:500``...).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from loadtest.client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True, slots=True)
class Slo:
    key: str  # ttft, tpot or e2e
    limit_ms: float

    @classmethod
    def parse(cls, text: str) -> "Slo":
        key, _, value = text.partition(":")
        if key not in SLO_KEYS:
            raise ValueError(f"SLO {text!r}: the key must be one of {', '.join(SLO_KEYS)} (e.g. ttft:500)")
        try:
            limit = float(value)
        except ValueError as e:
            raise ValueError(f"SLO {text!r}: expected KEY:MILLISECONDS") from e
        if limit <= 0:
            raise ValueError(f"SLO {text!r}: the limit must be positive")
        return cls(key, limit)

    def met_by(self, r: RequestResult) -> bool:
        value = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}[self.key]
        if value is None:  # a one-token answer has no TPOT: nothing to miss
            return self.key == "tpot"
        return value * 1000 <= self.limit_ms


def distribution(values_s: list[float]) -> dict | None:
    """mean / median / p90 / p99 / max in milliseconds, or None when there is nothing to measure."""
    if not values_s:
        return None
    a = np.asarray(values_s, dtype=np.float64) * 1000
    return {
        "count": int(a.size),
        "mean_ms": float(a.mean()),
        "median_ms": float(np.median(a)),
        "p90_ms": float(np.percentile(a, 90)),
        "p99_ms": float(np.percentile(a, 99)),
        "max_ms": float(a.max()),
    }


def summarize(results: list[RequestResult], wall_s: float, slos: tuple[Slo, ...] = ()) -> dict:
    ok = [r for r in results if r.ok]
    wall_s = max(wall_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_known = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    summary = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors_by_kind": dict(sorted(Counter(r.error_kind for r in results if not r.ok).items())),
        "first_errors": sorted({f"{r.error_kind}: {r.error}" for r in results if not r.ok})[:5],
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(prompt_known) if len(prompt_known) == len(ok) else None,
        "tokens_from_usage": all(r.tokens_from_usage for r in ok),
        # Outputs shorter than asked: EOS or a stop hit (expected without fixed lengths).
        "short_outputs": sum(1 for r in ok if r.output_tokens < r.max_tokens),
        "request_throughput": len(ok) / wall_s,
        "output_throughput": output_tokens / wall_s,
        "ttft": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl": distribution([g for r in ok for g in r.itl_s]),
        "e2e": distribution([r.e2e_s for r in ok]),
    }
    if slos:
        good = [r for r in ok if all(s.met_by(r) for s in slos)]
        summary["goodput"] = {
            "slos_ms": {s.key: s.limit_ms for s in slos},
            "good_requests": len(good),
            "request_goodput": len(good) / wall_s,
            "output_token_goodput": sum(r.output_tokens for r in good) / wall_s,
            "fraction_good": len(good) / len(results) if results else 0.0,
        }
    return summary
