"""The summary table of scripts/gpu_serve.sh, read from the JSON files its stages wrote.

Per model NAME the script writes NAME_offline.json (`ember bench throughput`) and
NAME_serve_nN.json (`ember bench serve`, one per --api-server-count N; the largest N also holds a
Poisson run under "poisson"), and first_run.json (ember.bench.first_run). A stage that failed or
was cut leaves its file out; its cells then read "-".

    python -m ember.bench.serve_table OUT_DIR
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

MODEL_ORDER = ("smollm", "qwen3", "llama8b")


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _seconds(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.2f} s"


def serve_rows(out_dir: str) -> list[dict]:
    """One row per (model, api-server-count) that has a served result."""
    rows = []
    files = glob.glob(os.path.join(out_dir, "*_serve_n*.json"))
    files += glob.glob(os.path.join(out_dir, "*_offline.json"))
    names = sorted({re.sub(r"_(serve_n\d+|offline)\.json$", "", os.path.basename(p))
                    for p in files},
                   key=lambda n: (MODEL_ORDER.index(n) if n in MODEL_ORDER else 99, n))
    for name in names:
        offline = _load(os.path.join(out_dir, f"{name}_offline.json"))
        offline_tps = offline["ember"]["output_tok_s"] if offline else None
        paths = glob.glob(os.path.join(out_dir, f"{name}_serve_n*.json"))
        if not paths:  # the served stages failed or were cut: the offline number alone
            rows.append({"model": name, "offline_tok_s": offline_tps})
        for path in sorted(paths, key=lambda p: int(re.search(r"_n(\d+)", p).group(1))):
            record = _load(path)
            if record is None:
                continue
            served = record["results"]
            poisson = record.get("poisson") or {}
            rows.append({
                "model": name,
                "input_len": record["args"]["input_len"],
                "output_len": record["args"]["output_len"],
                "api_server_count": record.get("api_server_count"),
                "offline_tok_s": offline_tps,
                "served_tok_s": served["output_throughput"],
                "served_over_offline": served["output_throughput"] / offline_tps
                if offline_tps else None,
                "failed": served["failed"],
                "ttft_p50_ms": served["p50_ttft_ms"],
                "ttft_p99_ms": served["p99_ttft_ms"],
                "poisson_rate": poisson.get("request_rate"),
                "poisson_ttft_p50_ms": poisson.get("p50_ttft_ms"),
                "poisson_ttft_p99_ms": poisson.get("p99_ttft_ms"),
                "client_cpu_busy": served.get("client_cpu_busy"),
            })
    return rows


def render(out_dir: str) -> str:
    lines = [
        "| model | in/out | N | offline tok/s | served tok/s | served/offline | "
        "TTFT p50 / p99 (burst) | Poisson req/s | TTFT p50 / p99 (Poisson) | client CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in serve_rows(out_dir):
        if "served_tok_s" not in row:
            lines.append(f"| {row['model']} | - | - | {_num(row['offline_tok_s'])} |"
                         " - | - | - | - | - | - |")
            continue
        failed = f" ({row['failed']} failed)" if row["failed"] else ""
        lines.append(
            f"| {row['model']} | {row['input_len']}/{row['output_len']} | "
            f"{row['api_server_count']} | {_num(row['offline_tok_s'])} | "
            f"{_num(row['served_tok_s'])}{failed} | "
            f"{_percent(row['served_over_offline'])} | "
            f"{_seconds(row['ttft_p50_ms'])} / {_seconds(row['ttft_p99_ms'])} | "
            f"{_num(row['poisson_rate'], 1)} | "
            f"{_seconds(row['poisson_ttft_p50_ms'])} / {_seconds(row['poisson_ttft_p99_ms'])} | "
            f"{_percent(row['client_cpu_busy'])} |"
        )
    first = _load(os.path.join(out_dir, "first_run.json"))
    if first:
        lines.append("")
        lines.append(
            f"first run ({first['args']['model']}): start-up {first['startup_s']:.1f} s, "
            f"first generate {first['first']['output_tok_s']:,.0f} tok/s, "
            f"second {first['second']['output_tok_s']:,.0f} tok/s, "
            f"first/second {first['first_over_second']:.0%}"
        )
        breakdown = first.get("startup_breakdown") or {}
        if breakdown:
            stages = sorted(((k, v) for k, v in breakdown.items() if k != "total"),
                            key=lambda kv: -kv[1])
            lines.append("start-up by stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in stages))
        for seconds, message in first.get("startup_log", []):
            lines.append(f"  +{seconds:6.1f} s  {message}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m ember.bench.serve_table OUT_DIR", file=sys.stderr)
        return 2
    print(render(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
