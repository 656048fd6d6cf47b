"""Results as JSON (everything, strict JSON: no NaN/Infinity) and as a Markdown summary.

The Markdown has: the exact command, the machine and the workload; when more than one
server ran, a side-by-side table with ratios against the first server (the reference);
per server the full latency distributions; the server-side /metrics figures; the plots.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

SCHEMA = "pagoda-loadtest/1"


# ---- JSON ------------------------------------------------------------------------------------


def _finite(value):
    """Replace non-finite floats (an infinite request rate) by strings, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(doc: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n")


def request_record(r, with_itl: bool) -> dict:
    rec = {
        "ok": r.ok, "start_s": round(r.start_s, 6), "e2e_s": round(r.e2e_s, 6),
        "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 6),
        "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens,
        "finish_reason": r.finish_reason, "error_kind": r.error_kind, "error": r.error,
    }
    if with_itl:
        rec["itl_ms"] = [round(g * 1000, 3) for g in r.itl_s]
    return rec


# ---- Markdown --------------------------------------------------------------------------------


def _num(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def _ratio(a, b) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def _get(summary: dict, metric: str, stat: str):
    dist = summary.get(metric)
    return dist.get(stat) if dist else None


def _dist_cell(summary: dict, metric: str) -> str:
    dist = summary.get(metric)
    if not dist:
        return "-"
    return " / ".join(f"{dist[k]:,.1f}" for k in ("mean_ms", "median_ms", "p90_ms", "p99_ms"))


def _table(header: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """A Markdown table: text columns (``left``) aligned left, figures right."""
    left = tuple(i % len(header) for i in left)
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if i in left else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return out


def _side_by_side(servers: list[dict]) -> list[str]:
    ref = servers[0]
    ref_runs = {run["label"]: run["summary"] for run in ref["runs"]}
    name = ref["name"]
    header = ["load", "server", "ok / failed", "output tok/s", f"{name} / this (tok/s)",
              "median TTFT ms", "median ITL ms", f"{name} / this (ITL)", "p99 ITL ms", "short outputs", "fixed length via"]
    rows = []
    labels = [run["label"] for run in ref["runs"]]
    for server in servers[1:]:
        labels += [run["label"] for run in server["runs"] if run["label"] not in labels]
    for label in labels:
        for server in servers:
            run = next((r for r in server["runs"] if r["label"] == label), None)
            if run is None:
                continue
            s, r = run["summary"], ref_runs.get(label)
            rows.append([
                label, server["name"], f"{s['completed']} / {s['failed']}", _num(s["output_throughput"]),
                _ratio(r["output_throughput"], s["output_throughput"]) if r else "-",
                _num(_get(s, "ttft", "median_ms")), _num(_get(s, "itl", "median_ms")),
                _ratio(_get(r, "itl", "median_ms"), _get(s, "itl", "median_ms")) if r else "-",
                _num(_get(s, "itl", "p99_ms")), f"{s['short_outputs']} of {s['completed']}",
                server.get("request_mode") or "-",
            ])
    return _table(header, rows, left=(0, 1, -1))


def _server_section(server: dict, with_goodput: bool) -> list[str]:
    lines = [f"### {server['name']}", ""]
    if server.get("command"):
        lines += [f"Started as `{server['command']}`" + (f" (ready in {server['startup_s']} s)." if server.get("startup_s") else "."), ""]
    memory = [(when, server.get(f"memory_mib_after_{when}")) for when in ("start", "run")]
    if any(mib is not None for _, mib in memory):
        lines += ["Resident memory (PSS of all its processes): "
                  + ", ".join(f"{mib:.0f} MiB after {when}" for when, mib in memory if mib is not None) + ".", ""]
    if server.get("request_note"):
        lines += [f"Requests: {server['request_note']}."]
        for rejected in server.get("rejected") or ():
            lines.append(f"- refused: {rejected}")
        lines.append("")
    if server.get("error"):
        lines += [f"**Did not run:** {server['error']}", ""]
    if not server["runs"]:
        return lines
    header = ["load", "ok / failed", "req/s", "output tok/s", "TTFT ms (mean / median / p90 / p99)",
              "TPOT ms", "ITL ms", "e2e ms", "other CPU (cores)"]
    if with_goodput:
        header.append("goodput req/s (good)")
    rows = []
    for run in server["runs"]:
        s = run["summary"]
        row = [run["label"], f"{s['completed']} / {s['failed']}", _num(s["request_throughput"], 2),
               _num(s["output_throughput"]), _dist_cell(s, "ttft"), _dist_cell(s, "tpot"),
               _dist_cell(s, "itl"), _dist_cell(s, "e2e"), _num(run.get("other_cpu_cores"), 2)]
        if with_goodput:
            g = s.get("goodput")
            row.append(f"{g['request_goodput']:.2f} ({g['good_requests']})" if g else "-")
        rows.append(row)
    lines += _table(header, rows)
    notes = []
    for run in server["runs"]:
        s = run["summary"]
        if s["errors_by_kind"]:
            kinds = ", ".join(f"{k} {v}" for k, v in s["errors_by_kind"].items())
            notes.append(f"- {run['label']}: errors: {kinds}; first: {'; '.join(s['first_errors'][:2])}")
        if run.get("warmup", {}).get("failed"):
            notes.append(f"- {run['label']}: warm-up failures: {run['warmup']['failed']} ({run['warmup']['first_error']})")
    if notes:
        lines += [""] + notes
    metric_rows = []
    for run in server["runs"]:
        m, s = run.get("server_metrics"), run["summary"]
        if not m:
            continue
        d, p = m["deltas"], m["peaks"]
        queries, hits = d.get("prefix_cache_queries_total"), d.get("prefix_cache_hits_total")
        metric_rows.append([
            run["label"],
            f"{_num(d.get('generation_tokens_total'), 0)} / {_num(s['output_tokens'])}",
            f"{_num(d.get('prompt_tokens_total'), 0)} / {_num(s['prompt_tokens'])}",
            _num(d.get("request_success_total"), 0), _num(d.get("num_preemptions_total"), 0),
            f"{hits / queries:.1%} of {queries:,.0f}" if queries else "-",
            f"{p['kv_cache_usage_perc']:.1%}" if "kv_cache_usage_perc" in p else "-",
            _num(p.get("num_requests_running"), 0), _num(p.get("num_requests_waiting"), 0),
        ])
    if metric_rows:
        lines += ["", "Server-side, from /metrics (after - before; peaks sampled during the run):", ""]
        lines += _table(["load", "generation tokens (server / client)", "prompt tokens (server / client)",
                         "requests finished", "preemptions", "prefix cache hits (tokens)", "KV usage peak",
                         "running peak", "waiting peak"], metric_rows)
    elif server["runs"]:
        lines += ["", "No server-side figures: the server has no Prometheus /metrics."]
    lines.append("")
    return lines


def markdown(doc: dict, md_path: Path | None = None) -> str:
    w = doc["workload"]
    env = doc["environment"]
    servers = doc["servers"]
    lines = [f"# {doc.get('title') or 'Serving benchmark'}", ""]
    lines += ["Command (run from the repository root):", "", "```", doc["command"], "```", ""]
    lines.append(f"- Date (UTC): {doc['created_utc']}. Machine: {env['machine']}.")
    lines.append(
        f"- Workload: dataset `{w['dataset']['dataset']}` (input {w['dataset']['input_len']} tokens, output "
        f"{w['dataset']['output_len']} tokens, prompts from {w['dataset']['tokenizer']}), {w['num_prompts']} prompts "
        f"per load level, warm-up {w['warmup']} requests (not counted), temperature {w['temperature']}, "
        f"fixed output lengths {'requested' if w['fixed_length'] else 'not requested'}; "
        f"the same prompts for every server."
    )
    if w.get("slos_ms"):
        lines.append("- SLOs for goodput: " + ", ".join(f"{k} <= {v:g} ms" for k, v in w["slos_ms"].items()) + ".")
    lines.append("- Latencies in ms; TTFT = time to first token, TPOT = time per output token after the first, "
                 "ITL = gap between streamed chunks, e2e = whole request. Throughput counts the "
                 "server-reported output tokens of completed requests over the run's wall time. "
                 "`other CPU` is what processes other than this client and the server's session "
                 "(its worker processes, e.g. vLLM's engine core) used meanwhile (0 on an idle machine; "
                 "above ~0.1 the figures are skewed); with --base-url it includes the server.")
    lines.append("")
    ran = [s for s in servers if s["runs"]]
    if len(ran) > 1:
        lines += ["## Side by side", "",
                  f"Ratios are {ran[0]['name']}'s figure divided by the server's: above 1 for tok/s means "
                  f"{ran[0]['name']} is faster, below 1 for ITL means {ran[0]['name']}'s tokens come sooner. "
                  "`short outputs` counts answers shorter than max_tokens (EOS was not suppressed).", ""]
        lines += _side_by_side(ran)
        lines.append("")
    lines += ["## Per server", ""]
    with_goodput = bool(w.get("slos_ms"))
    for server in servers:
        lines += _server_section(server, with_goodput)
    if doc.get("skipped"):
        lines += ["## Peers not run", ""]
        lines += [f"- {s['name']}: {s['reason']}" for s in doc["skipped"]]
        lines.append("")
    if doc.get("plots"):
        lines += ["## Plots", ""]
        base = md_path.parent if md_path else Path.cwd()
        for plot in doc["plots"]:
            rel = os.path.relpath(plot["path"], base)
            lines += [f"![{plot['title']}]({rel})", ""]
    return "\n".join(lines).rstrip() + "\n"
