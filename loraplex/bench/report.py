"""The benchmark report as JSON and Markdown: one row per measured run (the same columns in process and end to
end), then what the engine did during each run (CUDA-graph steps, KV usage peak, resident adapters, adapter load
latency and the wait for admission), then the tenants of the fairness runs."""
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
    """Truncation, how many of the scenario's engine steps replayed a CUDA graph (decode steps), and kernels
    compiled inside the run (each a stall of every running request)."""
    extra = s.get("extra") or {}
    parts = ["truncated"] if s["truncated"] else []
    if extra.get("graph_steps") is not None and extra.get("engine_steps"):
        parts.append(f"graph steps {extra['graph_steps']}/{extra['engine_steps']}")
    parts.append(compiles_note(extra))
    return "; ".join(filter(None, parts))


def compiles_note(extra: dict) -> str:
    """"N kernel compiles (S s)" for a run that compiled kernels, else ""."""
    c = extra.get("kernel_compiles") or {}
    if not c.get("compiles"):
        return ""
    return f"{c['compiles']} kernel compiles ({c['seconds']:.1f} s)"


def to_markdown(report: dict) -> str:
    env, wl = report["env"], report["workload"]
    levels = wl.get("levels") or [wl["concurrency"]]
    lines = [f"# loraplex bench serve ({wl['scale']}, {report.get('scenario', 'load')}, "
             f"{report.get('mode', 'in-process')})", "",
             f"- device: {env.get('device')}; torch {env.get('torch')}, triton {env.get('triton')}, "
             f"transformers {env.get('transformers')}; date {env.get('date')}",
             f"- workload: {wl['num_adapters']} adapters of rank {wl['rank']} ({wl['mix']} mix), input "
             f"{wl['input_len']}, output {wl['output_len']} (EOS ignored), concurrency "
             f"{','.join(map(str, levels))}, {wl['num_requests']} requests planned per scenario"
             + (f" (at least {wl['requests_per_client']} per client)" if wl.get("requests_per_client") else "")
             + (f", each level measured {wl['repeats']} times" if (wl.get("repeats") or 1) > 1 else "")
             + f", dtype {wl['dtype']}" + (f", endpoint {wl['url']}" if wl.get("url") else ""),
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
    lines += _engine_table(report["scenarios"]) + _tenant_table(report["scenarios"])
    if report.get("ratios"):
        lines += ["", "Ratios: " + ", ".join(f"{k} {_fmt(v, 2)}" for k, v in report["ratios"].items())]
    if report.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(report["skipped"])]
    if report.get("notes"):
        lines += [""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def _pair(d: dict | None, digits: int = 0) -> str:
    if not d or d.get("p50") is None:
        return "-"
    return f"{_fmt(d['p50'], digits)} / {_fmt(d['p99'], digits)}"


def _loads(loads: dict, key: str) -> str:
    """This run's load times, else (marked) those since the engine started."""
    run = loads.get(key)
    if run and run.get("n"):
        return f"{_pair(run, 1)} ({run['n']})"
    start = (loads.get("since_start") or {}).get(key)
    if start and start.get("n"):
        return f"{_pair(start, 1)} ({start['n']}, since start)"
    return "-"


def _step_p50(step_ms: dict, kind: str) -> str:
    return _fmt((step_ms.get(kind) or {}).get("p50"))


def _engine_table(scenarios: list[dict]) -> list[str]:
    rows = [s for s in scenarios if (s.get("extra") or {}).get("level") is not None]
    if not rows:
        return []
    out = ["", "| scenario | C | ramp s | steady output tok/s | queue wait p50 / p99 ms | graph / other steps | "
               "step ms p50, graph / eager | KV usage peak | adapters resident peak | GPU loads / evictions | "
               "adapter load disk→CPU p50 / p99 ms (n) | CPU→GPU p50 / p99 ms (n) | wait, adapter cold p50 / p99 ms | "
               "wait, adapter resident p50 / p99 ms |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in rows:
        e = s["extra"]
        step_ms = e.get("step_ms") or {}
        loads = e.get("adapter_loads") or {}
        waits = e.get("adapter_wait_ms") or {}
        queue = {"p50": s.get("queue_wait_p50_ms"), "p99": s.get("queue_wait_p99_ms")}
        steps = (f"{e['graph_steps']} / {e['eager_steps']}" if e.get("eager_steps") is not None
                 else _fmt(e.get("engine_steps")))
        kv = e.get("kv_usage_peak")
        counters = e.get("adapter_counters") or {}
        swaps = (f"{counters.get('activations', 0)} / {counters.get('evictions', 0)}" if counters else "-")
        out.append(f"| {s['name']} | {e['level'] or 'open'} | {_fmt(e.get('ramp_s'))} | "
                   f"{_fmt(s.get('steady_output_tok_s'))} | {_pair(queue)} | {steps} | "
                   f"{_step_p50(step_ms, 'graph')} / {_step_p50(step_ms, 'eager')} | "
                   f"{'-' if kv is None else f'{100 * kv:.0f}%'} | {_fmt(e.get('adapters_resident_peak'))} | {swaps} | "
                   f"{_loads(loads, 'disk_to_cpu_ms')} | {_loads(loads, 'cpu_to_gpu_ms')} | "
                   f"{_pair(waits.get('cold'))} | {_pair(waits.get('warm'))} |")
    return out


def _tenant_table(scenarios: list[dict]) -> list[str]:
    rows = [s for s in scenarios if (s.get("extra") or {}).get("groups")]
    if not rows:
        return []
    out = ["", "| run | tenant | requests completed / started | TTFT p50 ms | TTFT p99 ms | output tok/s | "
               "out tok/s per req |", "|---|---|---:|---:|---:|---:|---:|"]
    for s in rows:
        for name, g in s["extra"]["groups"].items():
            out.append(f"| {s['name']} | {name} | {g['requests_completed']} / {g['requests_started']} | "
                       f"{_fmt(g['ttft_p50_ms'], 0)} | {_fmt(g['ttft_p99_ms'], 0)} | {_fmt(g['output_tok_s'])} | "
                       f"{_fmt(g['per_request_output_tok_s'])} |")
    return out


def write_report(report: dict, out_dir: str, stem: str = "bench_serve") -> tuple[str, str]:
    """Write ``<stem>.json`` and ``<stem>.md`` into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    jp, mp = os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")
    with open(jp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
    with open(mp, "w", encoding="utf-8") as f:
        f.write(to_markdown(report))
    return jp, mp
