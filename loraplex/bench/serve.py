"""``loraplex bench serve``: the GPT-OSS-20B multi-LoRA serving workload against the in-process engine or, with
``url``, end to end through the platform's OpenAI endpoint: a closed loop at one or several concurrency levels
(the sweep), adapter churn, two-tenant fairness (``loraplex/bench/scenarios.py``); base-only and with N adapters
in the same invocation (optionally INT8 / MXFP4 experts, tensor parallelism and an HF transformers + PEFT
baseline).

    report = run_serve_bench(ServeBenchConfig(scale="tiny", out_dir="/tmp/bench"))    # CPU smoke run
    report = run_serve_bench(ServeBenchConfig(scale="full", concurrency="1,16,64,128,256", mix="zipf",
                                              num_adapters=32, scenario_time_s=30))   # H200 sweep

Order: write config.json + adapters (reused when ``work_dir`` already holds the same ones) -> per engine phase
(quantization, churn's all-resident / budget engines, fairness's policies) start the engine (dummy weights, LoRA
enabled) -> per measured run a warm-up (``engine_run.py``) then the measured load -> ``hf_baseline``: HF
transformers, then the same model wrapped by PEFT. Setup costs (adapter writes, engine start, each warm-up) are
timed into ``setup_s``. The report is rewritten after every run, so a run stopped by a time limit still leaves
its figures; with ``results_dir`` it is also written there under its results name (``naming.py``).
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
import tempfile
import time
from dataclasses import asdict

import torch

from loraplex.bench.config import QUANTIZATIONS, ServeBenchConfig  # noqa: F401  (re-exported)
from loraplex.bench.engine_run import EngineRun, prepare_adapters  # noqa: F401  (re-exported)
from loraplex.bench.naming import result_stem
from loraplex.bench.ratios import report_ratios
from loraplex.bench.report import compiles_note, write_report
from loraplex.bench.scenarios import RunSequence, phases

logger = logging.getLogger(__name__)


def environment(device: torch.device | None) -> dict:
    env = dict(python=sys.version.split()[0], torch=torch.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if device is None:
        env["device"], env["visible_gpus"] = "remote (end to end)", None
    else:
        env["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        env["visible_gpus"] = torch.cuda.device_count() if device.type == "cuda" else 0
    env["kernels"] = os.environ.get("LORAPLEX_KERNELS", "auto")
    return env


def _row_line(label: str, s: dict) -> str:
    e = s.get("extra") or {}
    steady = s.get("steady_output_tok_s")
    return (f"[bench] {label}: {s['num_requests']} req, {s['per_request_output_tok_s']:.1f} out tok/s per req, "
            f"{s['output_throughput_tok_s']:.0f} out tok/s" + (f" ({steady:.0f} steady)" if steady else "") +
            f", TPOT {s['tpot_mean_ms']:.1f} ms, TTFT p50 {s['ttft_p50_ms']:.0f} ms p99 {s['ttft_p99_ms']:.0f} ms"
            + (f", graph steps {e['graph_steps']}/{e['engine_steps']}" if e.get("graph_steps") is not None
               and e.get("engine_steps") else "")
            + (f", {compiles_note(e)}: {e['kernel_compiles']['kernels']}" if compiles_note(e) else "")
            + f", {s['duration_s']:.1f} s{' (truncated)' if s['truncated'] else ''}")


def _skipped_names(phase) -> list[str]:
    seq, names = RunSequence(phase.runs()), []
    while (m := seq.next(None)) is not None:
        names.append(m.name)
    return names


def _target(cfg: ServeBenchConfig, work: str):
    if cfg.end_to_end:
        from loraplex.bench.remote import RemoteRun

        return RemoteRun(cfg)
    files = min(1, cfg.num_adapters) if cfg.hf_only else cfg.num_adapter_files
    return EngineRun(cfg, work, num_adapter_files=files)


def _untuned_kernels(kind: str) -> list[str] | None:
    """The kernel config lookups of this process's engine that fell back to the built-in defaults
    (``tuning.untuned``); None for an engine elsewhere (``--url``)."""
    if kind != "in-process":
        return None
    from loraplex.kernels import tuning

    return tuning.untuned()


def _untuned_note(untuned: list[str] | None) -> list[str]:
    """The report's note naming the lookups that ran on the built-in defaults (none when there are none)."""
    if not untuned:
        return []
    return [f"built-in default kernel configs (no tuned entry for this device) for: {'; '.join(untuned)}"]


def run_serve_bench(cfg: ServeBenchConfig) -> dict:
    """Run the scenarios; returns the report dict (also written to ``cfg.out_dir`` / ``cfg.results_dir``)."""
    t_start = time.monotonic()
    deadline = t_start + cfg.total_time_s if cfg.total_time_s else None
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as tmp:
        work = cfg.work_dir or tmp
        target = _target(cfg, work)
        dtype = getattr(target, "dtype", None)
        prec = "bf16" if dtype == "bfloat16" else (dtype or "remote")
        report = dict(command=cfg.command, scenario=cfg.scenario, mode=target.kind,
                      env=environment(getattr(target, "device", None)),
                      workload=dict(asdict(cfg), dtype=dtype, model=dict(target.model_config),
                                    levels=list(cfg.levels),
                                    adapter_bytes=getattr(target, "adapter_bytes", None)),
                      setup_s=target.setup_s, engine=target.engine_info, scenarios=[], hf_baseline=[], skipped=[],
                      notes=list(cfg.notes))
        report["workload"].pop("notes", None)
        report["workload"].pop("api_key", None)  # never a tenant's key in a report
        report["name"] = result_stem(report)

        def emit() -> None:
            report["ratios"] = report_ratios(report["scenarios"], report["hf_baseline"])
            report["untuned_kernels"] = _untuned_kernels(target.kind)
            report["notes"] = list(dict.fromkeys(cfg.notes + target.notes + _untuned_note(report["untuned_kernels"])))
            report["elapsed_s"] = time.monotonic() - t_start
            for folder, stem in ((cfg.out_dir, "bench_serve"), (cfg.results_dir, report["name"])):
                if folder:
                    write_report(report, folder, stem)

        profiled: set[str] = set()
        try:
            for i, phase in enumerate(phases(cfg, precision=prec, adapter_bytes=getattr(target, "adapter_bytes", 0))):
                if deadline is not None and time.monotonic() >= deadline:
                    report["skipped"] += [f"{name} (time limit)" for name in _skipped_names(phase)]
                    continue
                target.start_phase(phase)
                emit()
                seq, row = RunSequence(phase.runs()), None
                while (m := seq.next(row)) is not None:
                    row = None
                    if deadline is not None and time.monotonic() >= deadline:
                        report["skipped"].append(f"{m.name} (time limit)")
                        continue
                    try:
                        row = target.measure(m, deadline)
                    except RuntimeError as e:  # nothing of its primary load finished in its time cap
                        if "no request" not in str(e):
                            raise
                        report["skipped"].append(f"{m.name} ({e})")
                        emit()
                        continue
                    if row is None:
                        report["skipped"].append(f"{m.name} (time limit: no request finished)")
                        emit()
                        continue
                    report["scenarios"].append(row)
                    logger.info("%s: %.1f tok/s per request, TTFT p50 %.0f ms", m.name,
                                row["per_request_output_tok_s"], row["ttft_p50_ms"])
                    print(_row_line(m.name, row), flush=True)
                    emit()
                    kind = "adapters" if m.warmup_adapters else "base"
                    if (cfg.profile_steps and i == 0 and cfg.scenario == "load" and m.concurrency == cfg.concurrency
                            and kind not in profiled and (deadline is None or time.monotonic() < deadline)):
                        profiled.add(kind)
                        text = target.profile(m.name, kind == "adapters")
                        if cfg.out_dir:
                            os.makedirs(cfg.out_dir, exist_ok=True)
                            with open(os.path.join(cfg.out_dir, f"profile_{kind}.txt"), "w", encoding="utf-8") as f:
                                f.write(text)
        finally:
            target.close()
        if cfg.hf_baseline:
            _hf_runs(cfg, report, deadline, target.device, work, target.adapter_folders)
        emit()
        return report


def _hf_runs(cfg: ServeBenchConfig, report: dict, deadline: float | None, device: torch.device, work: str,
             adapter_folders: list[str]) -> None:
    from loraplex.bench.hf_baseline import hf_generate_baselines

    if deadline is not None and time.monotonic() >= deadline:
        report["skipped"].append("HF baseline (time limit)")
        return
    t0 = time.monotonic()

    def record(res: dict) -> None:
        report["hf_baseline"].append(res)
        print(f"[bench] {res['name']}: {res['per_request_output_tok_s']:.1f} out tok/s per req "
              f"(decode {res['per_request_decode_tok_s']:.1f}), TTFT {res['ttft_ms']:.0f} ms", flush=True)
        if cfg.out_dir:
            report["ratios"] = report_ratios(report["scenarios"], report["hf_baseline"])
            write_report(report, cfg.out_dir)

    hf_generate_baselines(os.path.join(work, "model"), adapter_folder=adapter_folders[0] if adapter_folders else None,
                          batch=cfg.concurrency, input_len=cfg.input_len,
                          output_len=cfg.hf_output_len or cfg.output_len, est_output_len=cfg.output_len,
                          device=device.type, dtype=getattr(torch, report["workload"]["dtype"]), seed=cfg.seed,
                          deadline=deadline, on_result=record)
    report["setup_s"]["hf_total"] = time.monotonic() - t0
    if device.type == "cuda":
        torch.cuda.empty_cache()
