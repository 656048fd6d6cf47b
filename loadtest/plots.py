"""PNG plots with matplotlib (the optional `bench` extra): throughput vs latency across the
load levels, and the TTFT and ITL distributions (empirical CDFs) of every run."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from loadtest.client import RequestResult


@dataclass(slots=True)
class RunSeries:
    server: str
    label: str  # the load level, e.g. "concurrency 8"
    short_label: str  # "c=8"
    summary: dict
    results: list[RequestResult]


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_all(series: list[RunSeries], out_dir: Path, prefix: str) -> list[dict]:
    """Write the plots; return [{"path", "title"}]. Nothing (and a note) without matplotlib."""
    if not series:
        return []
    if not have_matplotlib():
        print("[loadtest] matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    path = out_dir / f"{prefix}throughput-latency.png"
    plot_throughput_latency(series, path)
    plots.append({"path": str(path), "title": "Output throughput vs median latency, per load level"})
    for metric, title in (("ttft", "TTFT distribution"), ("itl", "Inter-token latency distribution")):
        path = out_dir / f"{prefix}{metric}.png"
        if plot_distribution(series, metric, path):
            plots.append({"path": str(path), "title": title})
    return plots


def _servers(series: list[RunSeries]) -> list[str]:
    names: list[str] = []
    for s in series:
        if s.server not in names:
            names.append(s.server)
    return names


def plot_throughput_latency(series: list[RunSeries], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, name in ((axes[0], "itl", "median ITL (ms)"), (axes[1], "ttft", "median TTFT (ms)")):
        for server in _servers(series):
            points = [(s.summary["output_throughput"], s.summary[metric]["median_ms"], s.short_label)
                      for s in series if s.server == server and s.summary.get(metric)]
            if not points:
                continue
            xs, ys, labels = zip(*points)
            ax.plot(xs, ys, marker="o", label=server)
            for x, y, text in points:
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Throughput vs latency across load levels")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_distribution(series: list[RunSeries], metric: str, path: Path) -> bool:
    """Empirical CDFs, one panel per server, one line per load level; False if no data."""
    servers = _servers(series)
    data = {}
    for s in series:
        ok = [r for r in s.results if r.ok]
        values = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None] if metric == "ttft" else \
                 [g * 1000 for r in ok for g in r.itl_s]
        if values:
            data[(s.server, s.short_label)] = sorted(values)
    if not data:
        return False
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    low = min(v[0] for v in data.values())
    high = max(v[-1] for v in data.values())
    log_x = low > 0 and high / low > 20  # a log axis only where the spread needs one
    fig, axes = plt.subplots(1, len(servers), figsize=(5.5 * len(servers), 4.2), squeeze=False, sharex=True)
    for ax, server in zip(axes[0], servers):
        for s in series:
            values = data.get((server, s.short_label)) if s.server == server else None
            if not values:
                continue
            ys = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
            ax.step([values[0]] + values, ys, where="post", label=s.short_label)
        if log_x:
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"{metric.upper()} (ms{', log scale' if log_x else ''})")
        ax.set_ylabel("fraction of samples <= x")
        ax.set_title(server)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend()
    fig.suptitle(f"{metric.upper()} distribution per load level")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
