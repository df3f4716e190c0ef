"""The benchmark report as JSON and Markdown."""
from __future__ import annotations

import json
import math
import os


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{digits}f}"
    return str(v)


def _note(s: dict) -> str:
    """Truncation, and how many of the scenario's engine steps replayed a CUDA graph (decode steps)."""
    extra = s.get("extra") or {}
    parts = ["truncated"] if s["truncated"] else []
    if extra.get("graph_steps") is not None and extra.get("engine_steps"):
        parts.append(f"graph steps {extra['graph_steps']}/{extra['engine_steps']}")
    return "; ".join(parts)


def to_markdown(report: dict) -> str:
    env, wl = report["env"], report["workload"]
    lines = [f"# loraplex bench serve ({wl['scale']})", "",
             f"- device: {env.get('device')}; torch {env.get('torch')}, triton {env.get('triton')}, "
             f"transformers {env.get('transformers')}; date {env.get('date')}",
             f"- workload: {wl['num_adapters']} adapters of rank {wl['rank']} ({wl['mix']} mix), input "
             f"{wl['input_len']}, output {wl['output_len']} (EOS ignored), concurrency {wl['concurrency']}, "
             f"{wl['num_requests']} requests planned per scenario, dtype {wl['dtype']}",
             f"- command: `{report.get('command', '')}`"]
    for phase, info in (report.get("engine") or {}).items():
        lines.append(f"- engine {phase}: tensor parallel {info.get('tensor_parallel_size')}, CUDA graphs "
                     f"{_fmt(info.get('cuda_graphs'))}, enforce_eager {info.get('enforce_eager')}, async scheduling "
                     f"{info.get('async_scheduling')}, quantization {info.get('quantization')}, KV pool "
                     f"{info.get('kv_blocks')} blocks "
                     f"({_fmt(info.get('kv_gib'), 2)} GiB), GPU memory after start "
                     f"{_fmt(info.get('memory_after_start_gib'))} GiB")
    if report.get("setup_s"):
        lines.append("- setup s: " + ", ".join(f"{k} {_fmt(v)}" for k, v in report["setup_s"].items()))
    lines += ["",
             "| scenario | requests | out tok/s per req | decode tok/s per req | TTFT p50 ms | TTFT p99 ms | "
             "TPOT mean ms | TPOT p99 ms | output tok/s | total tok/s | peak GPU GiB | wall s | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in report["scenarios"]:
        lines.append(
            f"| {s['name']} | {s['num_requests']} | {_fmt(s['per_request_output_tok_s'])} | "
            f"{_fmt(s['per_request_decode_tok_s'])} | {_fmt(s['ttft_p50_ms'], 0)} | {_fmt(s['ttft_p99_ms'], 0)} | "
            f"{_fmt(s['tpot_mean_ms'])} | {_fmt(s['tpot_p99_ms'])} | {_fmt(s['output_throughput_tok_s'])} | "
            f"{_fmt(s['total_throughput_tok_s'])} | {_fmt(s['peak_memory_gib'])} | {_fmt(s['duration_s'])} | "
            f"{_note(s)} |")
    for h in report.get("hf_baseline", []):
        lines.append(f"| {h['name']} (batch {h['batch']}, static) | {h['batch']} | "
                     f"{_fmt(h['per_request_output_tok_s'])} | {_fmt(h['per_request_decode_tok_s'])} | "
                     f"{_fmt(h['ttft_ms'], 0)} | - | - | - | {_fmt(h['output_throughput_tok_s'])} | - | "
                     f"{_fmt(h['peak_memory_gib'])} | {_fmt(h['generate_s'])} | output {h['output_len']}"
                     + (f"; est. {_fmt(h['est_per_request_output_tok_s'])} tok/s per req at {h['est_output_len']}"
                        if h.get("est_per_request_output_tok_s") else "") + " |")
    if report.get("ratios"):
        lines += ["", "Ratios: " + ", ".join(f"{k} {_fmt(v, 2)}" for k, v in report["ratios"].items())]
    if report.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(report["skipped"])]
    if report.get("notes"):
        lines += [""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str, stem: str = "bench_serve") -> tuple[str, str]:
    """Write ``<stem>.json`` and ``<stem>.md`` into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    jp, mp = os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")
    with open(jp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
    with open(mp, "w", encoding="utf-8") as f:
        f.write(to_markdown(report))
    return jp, mp
