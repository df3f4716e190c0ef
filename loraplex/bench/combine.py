"""Several ``bench_serve.json`` reports (the stages of a device script) as one table, with the targets of the
GPT-OSS-20B multi-LoRA serving workload.

    combined = combine_reports(["bf16=out/s1/bench_serve.json", "out/s2/bench_serve.json"])
    text = write_combined(combined, out_dir)     # bench_combined.json + bench_combined.md; returns the Markdown

A run's label is ``LABEL=`` before its path, else the name of the folder the report is in. Checks compare the
figures of whichever runs hold them (first match wins): bf16 with adapters >= 100 tok/s per request, TTFT p50
<= 150 ms, adapter TPOT <= 1.10 x base TPOT (same run), INT8 with adapters >= 170 tok/s per request, adapter
decode rate >= 15 x HF + PEFT's; MXFP4 experts with adapters >= 180 tok/s per request, TTFT p50 <= 100 ms,
adapter TPOT <= 1.10 x base TPOT; and with speculative decoding (replayed proposals at acceptance length 3) the
goals of >= 200 tok/s per request with bf16 experts and >= 300 with MXFP4. Speculative rows count for those
goals only. A check with no figures is "n/a", never a pass.
"""
from __future__ import annotations

import json
import math
import os

from loraplex.bench.report import _fmt


def _load(spec: str) -> tuple[str, dict]:
    label, sep, path = spec.partition("=")
    if not sep:
        label, path = os.path.basename(os.path.dirname(os.path.abspath(spec))) or spec, spec
    if not os.path.isfile(path):
        raise ValueError(f"report {path!r} does not exist (did that stage fail? see its log)")
    with open(path, encoding="utf-8") as f:
        return label, json.load(f)


def combine_reports(specs: list[str]) -> dict:
    """Rows of every scenario and HF baseline of every report that exists; missing ones are listed, not fatal
    (a device script combines whatever its stages left)."""
    runs, missing = [], []
    for spec in specs:
        try:
            label, report = _load(spec)
        except ValueError as e:
            missing.append(str(e))
            continue
        runs.append(dict(label=label, report=report))
    if not runs:
        raise ValueError("no report to combine: " + "; ".join(missing))
    rows = []
    for run in runs:
        rep, engines = run["report"], run["report"].get("engine") or {}
        workload = rep.get("workload") or {}
        spec_length = workload.get("speculative_acceptance_length") \
            if workload.get("speculative_method") == "replay" else None
        for s in rep.get("scenarios", []):
            info = engines.get(s["name"].split(" ", 1)[0], {})
            rows.append(dict(run=run["label"], scenario=s["name"], kind="engine",
                             tp=info.get("tensor_parallel_size", (s.get("extra") or {}).get("tensor_parallel_size")),
                             cuda_graphs=info.get("cuda_graphs"), requests=s["num_requests"],
                             per_request_output_tok_s=s["per_request_output_tok_s"],
                             per_request_decode_tok_s=s["per_request_decode_tok_s"], ttft_p50_ms=s["ttft_p50_ms"],
                             ttft_p99_ms=s["ttft_p99_ms"], tpot_mean_ms=s["tpot_mean_ms"],
                             output_throughput_tok_s=s["output_throughput_tok_s"],
                             total_throughput_tok_s=s["total_throughput_tok_s"], peak_memory_gib=s["peak_memory_gib"],
                             truncated=s["truncated"], adapters="adapters" in s["name"],
                             speculative=((s.get("extra") or {}).get("speculative") or {}).get("method"),
                             spec_length=spec_length,
                             graph_steps=(s.get("extra") or {}).get("graph_steps"),
                             engine_steps=(s.get("extra") or {}).get("engine_steps")))
        for h in rep.get("hf_baseline", []):
            rows.append(dict(run=run["label"], scenario=f"{h['name']} (static batch {h['batch']}, output "
                                                         f"{h['output_len']})", kind="hf", tp=1, cuda_graphs=None,
                             requests=h["batch"], per_request_output_tok_s=h["per_request_output_tok_s"],
                             per_request_decode_tok_s=h["per_request_decode_tok_s"], ttft_p50_ms=h["ttft_ms"],
                             ttft_p99_ms=None, tpot_mean_ms=1e3 / h["per_request_decode_tok_s"]
                             if h["per_request_decode_tok_s"] else None,
                             output_throughput_tok_s=h["output_throughput_tok_s"], total_throughput_tok_s=None,
                             peak_memory_gib=h["peak_memory_gib"], truncated=False, peft="PEFT" in h["name"],
                             est_per_request_output_tok_s=h.get("est_per_request_output_tok_s")))
    setup = {r["label"]: r["report"].get("setup_s", {}) for r in runs}
    return dict(runs=[dict(label=r["label"], command=r["report"].get("command"), env=r["report"].get("env"),
                           engine=r["report"].get("engine"), skipped=r["report"].get("skipped"),
                           notes=r["report"].get("notes")) for r in runs],
                rows=rows, setup_s=setup, checks=serving_checks(rows), tp=tp_comparison(rows), missing=missing,
                reports={r["label"]: r["report"] for r in runs})


def tp_comparison(rows: list[dict]) -> list[dict]:
    """For each scenario (name without its precision prefix) run at TP > 1: its output tok/s per request, total
    output tok/s and TTFT p50 against every TP = 1 run of the same scenario."""
    eng = [r for r in rows if r["kind"] == "engine"]
    out = []
    for tp_row in (r for r in eng if (r["tp"] or 1) > 1):
        what = tp_row["scenario"].split(" ", 1)[-1]
        for one in (r for r in eng if (r["tp"] or 1) == 1 and r["scenario"].split(" ", 1)[-1] == what):
            out.append(dict(scenario=what, tp_run=tp_row["run"], tp=tp_row["tp"], tp1_run=one["run"],
                            per_request_output=tp_row["per_request_output_tok_s"] / one["per_request_output_tok_s"],
                            output_throughput=tp_row["output_throughput_tok_s"] / one["output_throughput_tok_s"],
                            ttft_p50=tp_row["ttft_p50_ms"] / one["ttft_p50_ms"]))
    return out


def _first(rows: list[dict], pred) -> dict | None:
    return next((r for r in rows if pred(r)), None)


def _check(name: str, value: float | None, target: float, higher: bool, detail: str = "") -> dict:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return dict(check=name, value=None, target=target, verdict="n/a", detail=detail or "no figures")
    ok = value >= target if higher else value <= target
    return dict(check=name, value=value, target=target, verdict="PASS" if ok else "FAIL", detail=detail)


def serving_checks(rows: list[dict]) -> list[dict]:
    """The serving workload's targets (docs/performance.md, "GPT-OSS-20B multi-LoRA serving workload") against the
    figures of ``rows``; TP = 1 engine rows only."""
    one = [r for r in rows if r["kind"] == "engine" and (r["tp"] in (None, 1))]
    eng = [r for r in one if not r.get("speculative")]
    bf16_checks, bf16_lora = _adapter_checks(eng, "bf16", "bf16", min_tok_s=100, max_ttft_ms=150)
    int8_lora = _first(eng, lambda r: r["scenario"].startswith("int8") and r["adapters"])
    peft = _first(rows, lambda r: r["kind"] == "hf" and r.get("peft"))
    checks = bf16_checks + [
        _check("INT8 experts, adapters: output tok/s per request >= 170",
               (int8_lora or {}).get("per_request_output_tok_s"), 170, True, (int8_lora or {}).get("run", "")),
        _check("bf16 adapters decode tok/s per request / HF+PEFT >= 15",
               bf16_lora["per_request_decode_tok_s"] / peft["per_request_decode_tok_s"]
               if bf16_lora and peft and peft["per_request_decode_tok_s"] else None, 15, True,
               "HF+PEFT decode rate from its static batch"),
    ]
    checks += _adapter_checks(eng, "mxfp4", "MXFP4 experts", min_tok_s=180, max_ttft_ms=100)[0]
    for prefix, label, goal in (("bf16", "bf16", 200), ("mxfp4", "MXFP4 experts", 300)):
        spec = _first(one, lambda r, p=prefix: r.get("speculative") == "replay" and r["scenario"].startswith(p)
                      and r["adapters"] and r.get("spec_length") == 3.0)
        checks.append(_check(f"{label}, adapters, speculative (replayed, acceptance length 3): output tok/s per "
                             f"request >= {goal}", (spec or {}).get("per_request_output_tok_s"), goal, True,
                             (spec or {}).get("run", "")))
    if bf16_lora and peft and peft.get("est_per_request_output_tok_s"):
        checks.append(_check("bf16 adapters output tok/s per request / HF+PEFT (est. at the same output) >= 15",
                             bf16_lora["per_request_output_tok_s"] / peft["est_per_request_output_tok_s"], 15, True,
                             "HF+PEFT extrapolated from its short run"))
    return checks


def _adapter_checks(eng: list[dict], prefix: str, label: str, *, min_tok_s: float,
                    max_ttft_ms: float) -> tuple[list[dict], dict | None]:
    """One precision's targets with 8 adapters (output tok/s per request, TTFT p50, adapter TPOT / base-only TPOT of
    the same run) from the first run whose scenarios start with ``prefix``; (checks, that adapters row)."""
    lora = _first(eng, lambda r: r["scenario"].startswith(prefix) and r["adapters"])
    base = _first(eng, lambda r: r["scenario"].startswith(prefix) and not r["adapters"]
                  and r["run"] == (lora or {}).get("run"))
    run = (lora or {}).get("run", "")
    return [
        _check(f"{label}, adapters: output tok/s per request >= {min_tok_s}",
               (lora or {}).get("per_request_output_tok_s"), min_tok_s, True, run),
        _check(f"{label}, adapters: TTFT p50 ms <= {max_ttft_ms}", (lora or {}).get("ttft_p50_ms"), max_ttft_ms,
               False, run),
        _check(f"{label}: adapter TPOT / base TPOT <= 1.10",
               lora["tpot_mean_ms"] / base["tpot_mean_ms"] if lora and base else None, 1.10, False, run),
    ], lora


def to_markdown(combined: dict) -> str:
    lines = ["# loraplex bench serve: combined runs", ""]
    for run in combined["runs"]:
        env = run.get("env") or {}
        lines.append(f"- **{run['label']}**: `{run.get('command') or ''}` on {env.get('device')} "
                     f"(torch {env.get('torch')}, triton {env.get('triton')})")
        for phase, info in (run.get("engine") or {}).items():
            lines.append(f"  - engine {phase}: TP {info.get('tensor_parallel_size')}, CUDA graphs "
                         f"{info.get('cuda_graphs')}, enforce_eager {info.get('enforce_eager')}, quantization "
                         f"{info.get('quantization')}, KV {info.get('kv_blocks')} blocks")
        for item in (run.get("skipped") or []):
            lines.append(f"  - skipped: {item}")
        for note in (run.get("notes") or []):
            lines.append(f"  - note: {note}")
    for m in combined.get("missing", []):
        lines.append(f"- missing: {m}")
    lines += ["", "| run | scenario | TP | graphs | requests | out tok/s per req | decode tok/s per req | "
              "TTFT p50 ms | TTFT p99 ms | TPOT ms | output tok/s | total tok/s | peak GPU GiB | note |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in combined["rows"]:
        note = "truncated" if r["truncated"] else ""
        if r.get("graph_steps") is not None and r.get("engine_steps"):
            note = "; ".join(filter(None, [note, f"graph steps {r['graph_steps']}/{r['engine_steps']}"]))
        if r.get("est_per_request_output_tok_s"):
            note = f"est. {_fmt(r['est_per_request_output_tok_s'])} tok/s per req at the engine's output length"
        lines.append(f"| {r['run']} | {r['scenario']} | {_fmt(r['tp'])} | {_fmt(r['cuda_graphs'])} | {r['requests']} | "
                     f"{_fmt(r['per_request_output_tok_s'])} | {_fmt(r['per_request_decode_tok_s'])} | "
                     f"{_fmt(r['ttft_p50_ms'], 0)} | {_fmt(r['ttft_p99_ms'], 0)} | {_fmt(r['tpot_mean_ms'], 2)} | "
                     f"{_fmt(r['output_throughput_tok_s'])} | {_fmt(r['total_throughput_tok_s'])} | "
                     f"{_fmt(r['peak_memory_gib'])} | {note} |")
    lines += ["", "Setup (s): " + "; ".join(
        f"{label}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in s.items()) for label, s in combined["setup_s"].items())]
    if combined.get("tp"):
        lines += ["", "| scenario | TP run | vs TP=1 run | out tok/s per req ratio | output tok/s ratio | "
                  "TTFT p50 ratio |", "|---|---|---|---:|---:|---:|"]
        for c in combined["tp"]:
            lines.append(f"| {c['scenario']} | {c['tp_run']} (TP {c['tp']}) | {c['tp1_run']} | "
                         f"{_fmt(c['per_request_output'], 2)} | {_fmt(c['output_throughput'], 2)} | "
                         f"{_fmt(c['ttft_p50'], 2)} |")
    lines += ["", "| serving target | value | target | verdict | from |", "|---|---:|---:|---|---|"]
    for c in combined["checks"]:
        lines.append(f"| {c['check']} | {_fmt(c['value'], 2)} | {c['target']} | {c['verdict']} | {c['detail']} |")
    return "\n".join(lines) + "\n"


def write_combined(combined: dict, out_dir: str | None, stem: str = "bench_combined") -> str:
    """Markdown of ``combined``; with ``out_dir``, also ``<stem>.json`` and ``<stem>.md`` there."""
    text = to_markdown(combined)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{stem}.json"), "w", encoding="utf-8") as f:
            json.dump(combined, f, indent=1, default=str)
        with open(os.path.join(out_dir, f"{stem}.md"), "w", encoding="utf-8") as f:
            f.write(text)
    return text
