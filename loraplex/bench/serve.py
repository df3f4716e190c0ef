"""``loraplex bench serve``: the issue-6 serving workload against the in-process engine, base-only and with N
adapters in the same invocation (optionally INT8 experts and an HF transformers + PEFT baseline).

    report = run_serve_bench(ServeBenchConfig(scale="tiny", out_dir="/tmp/bench"))    # CPU smoke run
    report = run_serve_bench(ServeBenchConfig(scale="full", num_requests=64))          # H200

Order: write config.json + adapters -> one engine (dummy weights, LoRA enabled) -> per scenario a warm-up
(concurrency requests, 4 output tokens: compiles kernels, loads adapters) then the measured closed loop ->
optionally INT8 experts (transform of the same engine) and the same scenarios -> optionally the HF baseline.
The report is rewritten after every scenario, so a run stopped by a time limit still leaves its figures.
"""
from __future__ import annotations

import datetime
import gc
import logging
import os
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from loraplex.bench.driver import closed_loop
from loraplex.bench.report import write_report
from loraplex.bench.stats import summarize
from loraplex.bench.workload import (MIXES, SCALES, PlannedRequest, request_plan, write_model_config,
                                     write_random_adapters)

logger = logging.getLogger(__name__)


@dataclass
class ServeBenchConfig:
    scale: str = "full"                   # full (GPT-OSS-20B shape) | tiny (CPU smoke)
    num_adapters: int = 8
    rank: int = 32
    concurrency: int = 16
    num_requests: int = 64                # per scenario
    input_len: int = 1600
    output_len: int = 600
    mix: str = "even"                     # even | zipf | uniform
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"                   # auto: bfloat16 on CUDA, float32 on CPU
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    base_only: bool = True                # also run the base-only scenario
    int8: bool = False                    # then quantise experts to INT8 and run the scenarios again
    hf_baseline: bool = False
    hf_output_len: int | None = None      # HF output tokens (default: output_len)
    warmup: bool = True
    stagger_s: float = 0.0                # client k starts k * stagger_s seconds in (0: all at once)
    profile_steps: int = 0                # > 0: profile this many decode steps per scenario kind (first phase)
    scenario_time_s: float | None = None  # no new request starts after this many seconds of a scenario
    total_time_s: float | None = None     # hard stop for the whole run (running requests aborted)
    out_dir: str | None = None
    work_dir: str | None = None           # where config.json and adapters are written (default: a temp dir)
    command: str = ""
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(f"scale {self.scale!r} is not supported; choose one of {', '.join(SCALES)}")
        if self.mix not in MIXES:
            raise ValueError(f"mix {self.mix!r} is not supported; choose one of {', '.join(MIXES)}")
        if self.stagger_s < 0:
            raise ValueError(f"stagger_s must be >= 0, got {self.stagger_s}")
        for name in ("rank", "concurrency", "num_requests", "input_len", "output_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_adapters < 0:
            raise ValueError(f"num_adapters must be >= 0, got {self.num_adapters}")
        if self.num_adapters == 0 and not self.base_only:
            raise ValueError("nothing to run: num_adapters is 0 and the base-only scenario is off")


def environment(device: torch.device) -> dict:
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
    env["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    env["kernels"] = os.environ.get("LORAPLEX_KERNELS", "auto")
    return env


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class _Run:
    """State shared by the scenarios of one invocation."""

    def __init__(self, cfg: ServeBenchConfig, work: str):
        from loraplex.engine import LLMEngine
        from loraplex.engine.lora.fetch import file_uri
        from loraplex.engine.lora.ref import AdapterRef

        self.cfg = cfg
        self.model_config = SCALES[cfg.scale]
        self.folder = write_model_config(os.path.join(work, "model"), self.model_config)
        device = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else \
            ("cpu" if cfg.device == "auto" else cfg.device)
        self.device = torch.device(device)
        dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        self.dtype = dtype
        t0 = time.monotonic()
        folders = write_random_adapters(os.path.join(work, "adapters"), self.model_config, num=cfg.num_adapters,
                                        rank=cfg.rank, device=device, dtype=getattr(torch, dtype))
        self.adapter_folders = folders
        self.adapter_refs = [AdapterRef(f"bench/adapter-{k}/1", file_uri(f)) for k, f in enumerate(folders)]
        self.setup_s = {"adapters": time.monotonic() - t0}
        bs = cfg.block_size
        per_seq = -(-(cfg.input_len + cfg.output_len + bs) // bs)
        t0 = time.monotonic()
        self.engine = LLMEngine.from_pretrained(
            self.folder, dtype=dtype, device=device, load_format="dummy", progress=False,
            max_model_len=cfg.input_len + cfg.output_len + bs, max_num_seqs=max(cfg.concurrency, cfg.num_adapters),
            max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=bs,
            num_kv_blocks=per_seq * max(cfg.concurrency, cfg.num_adapters) + 64, swap_space_bytes=0,
            enable_prefix_caching=False, enable_lora=cfg.num_adapters > 0, max_loras=max(1, cfg.num_adapters),
            max_lora_rank=cfg.rank, max_cpu_loras=max(16, cfg.num_adapters),
            adapter_cache_dir=os.path.join(work, "adapter-cache"))
        self._sync()
        self.setup_s["engine"] = time.monotonic() - t0
        self.weights_gib = (torch.cuda.memory_allocated(self.device) / 2**30) if self.is_cuda else None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def scenario(self, name: str, adapters: bool, deadline: float | None, seed: int):
        cfg = self.cfg
        n = cfg.num_adapters if adapters else 0
        if cfg.warmup:
            warm = request_plan(num_requests=max(cfg.concurrency, n), num_adapters=n, mix="even",
                                input_len=cfg.input_len, vocab=self.model_config["vocab_size"], seed=seed + 1000)
            # two full prompts compile the prefill shapes; short ones fill the decode batch and load every adapter
            warm = [w if w.index < 2 else PlannedRequest(w.index, w.prompt[:16], w.adapter) for w in warm]
            closed_loop(self.engine, warm, self.adapter_refs, concurrency=len(warm),
                        output_len=min(4, cfg.output_len), prefix=f"warm-{name}-", hard_deadline=deadline)
        plan = request_plan(num_requests=cfg.num_requests, num_adapters=n, mix=cfg.mix, input_len=cfg.input_len,
                            vocab=self.model_config["vocab_size"], seed=seed)
        self._sync()
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.monotonic()
        soft = start + cfg.scenario_time_s if cfg.scenario_time_s else None
        timings, truncated = closed_loop(self.engine, plan, self.adapter_refs, concurrency=cfg.concurrency,
                                         output_len=cfg.output_len, prefix=f"{name}-", soft_deadline=soft,
                                         hard_deadline=deadline, stagger_s=cfg.stagger_s)
        end = time.monotonic()
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.is_cuda else None
        per_adapter = {}
        for t in timings:
            if t.finish is not None:
                per_adapter[str(t.adapter)] = per_adapter.get(str(t.adapter), 0) + 1
        return summarize(name, timings, concurrency=cfg.concurrency, input_len=cfg.input_len,
                         output_len=cfg.output_len, start=start, end=end, peak_memory_gib=peak,
                         peak_rss_gib=_peak_rss_gib(), truncated=truncated,
                         extra={"requests_per_adapter": per_adapter})


def _ratios(scenarios: list[dict], hf: list[dict]) -> dict:
    by = {s["name"]: s for s in scenarios}
    r = {}
    for prefix in dict.fromkeys(n.split(" ", 1)[0] for n in by):
        base, lora = by.get(f"{prefix} base-only"), next((s for n, s in by.items()
                                                           if n.startswith(prefix) and "adapters" in n), None)
        if base and lora:
            r[f"{prefix} TPOT adapters / base"] = lora["tpot_mean_ms"] / base["tpot_mean_ms"]
    if "bf16 base-only" in by and "int8 base-only" in by:
        r["int8 / bf16 base-only per-request tok/s"] = (by["int8 base-only"]["per_request_output_tok_s"]
                                                        / by["bf16 base-only"]["per_request_output_tok_s"])
    peft = next((h for h in hf if "PEFT" in h["name"]), None)
    lora = next((s for s in scenarios if "adapters" in s["name"]), None)
    if peft and lora:
        r["adapters per-request tok/s / HF+PEFT"] = lora["per_request_output_tok_s"] / peft["per_request_output_tok_s"]
    return r


def run_serve_bench(cfg: ServeBenchConfig) -> dict:
    """Run the scenarios; returns the report dict (also written to ``cfg.out_dir`` when set)."""
    t_start = time.monotonic()
    deadline = t_start + cfg.total_time_s if cfg.total_time_s else None
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as tmp:
        work = cfg.work_dir or tmp
        run = _Run(cfg, work)
        prec = "bf16" if run.dtype == "bfloat16" else run.dtype
        report = dict(command=cfg.command, env=environment(run.device),
                      workload=dict(asdict(cfg), dtype=run.dtype, model=dict(run.model_config)),
                      setup_s=run.setup_s, weights_gib=run.weights_gib, scenarios=[], hf_baseline=[],
                      skipped=[], notes=list(cfg.notes))
        report["workload"].pop("notes", None)

        def emit() -> None:
            report["ratios"] = _ratios(report["scenarios"], report["hf_baseline"])
            report["elapsed_s"] = time.monotonic() - t_start
            if cfg.out_dir:
                write_report(report, cfg.out_dir)

        plan = []
        if cfg.base_only:
            plan.append(("base-only", False))
        if cfg.num_adapters:
            plan.append((f"{cfg.num_adapters} adapters r{cfg.rank}", True))
        phases = [prec] + (["int8"] if cfg.int8 else [])
        for phase in phases:
            if phase == "int8":
                if deadline is not None and time.monotonic() >= deadline:
                    report["skipped"].append("int8 (time limit)")
                    break
                from loraplex.engine.quantization import quantize_experts_int8

                t0 = time.monotonic()
                n = quantize_experts_int8(run.engine.runner.model, lora_slots=run.engine.runner.lora)
                if run.is_cuda:
                    torch.cuda.empty_cache()
                run._sync()
                report["setup_s"]["int8_quantize"] = time.monotonic() - t0
                report["int8_layers"] = n
                report["int8_weights_gib"] = (torch.cuda.memory_allocated(run.device) / 2**30) if run.is_cuda else None
            for k, (name, adapters) in enumerate(plan):
                label = f"{phase} {name}"
                if deadline is not None and time.monotonic() >= deadline:
                    report["skipped"].append(f"{label} (time limit)")
                    continue
                s = run.scenario(label, adapters, deadline, seed=cfg.seed + k)
                report["scenarios"].append(s.to_dict())
                logger.info("%s: %.1f tok/s per request, TTFT p50 %.0f ms", label, s.per_request_output_tok_s,
                            s.ttft_p50_ms)
                print(f"[bench] {label}: {s.num_requests} req, {s.per_request_output_tok_s:.1f} out tok/s per req, "
                      f"TPOT {s.tpot_mean_ms:.1f} ms, TTFT p50 {s.ttft_p50_ms:.0f} ms p99 {s.ttft_p99_ms:.0f} ms, "
                      f"{s.duration_s:.1f} s{' (truncated)' if s.truncated else ''}", flush=True)
                emit()
                if cfg.profile_steps and phase == phases[0] and (deadline is None or time.monotonic() < deadline):
                    _write_profile(run, cfg, label, adapters)
        if cfg.hf_baseline:
            engine_device = run.device
            del run
            gc.collect()
            if engine_device.type == "cuda":
                torch.cuda.empty_cache()
            _hf_runs(cfg, report, deadline, engine_device, work)
        emit()
        return report


def _write_profile(run: "_Run", cfg: ServeBenchConfig, label: str, adapters: bool) -> None:
    from loraplex.bench.profile import profile_decode

    n = cfg.num_adapters if adapters else 0
    plan = request_plan(num_requests=cfg.concurrency, num_adapters=n, mix="even", input_len=cfg.input_len,
                        vocab=run.model_config["vocab_size"], seed=cfg.seed + 2000)
    text = profile_decode(run.engine, plan, run.adapter_refs, concurrency=cfg.concurrency, steps=cfg.profile_steps,
                          output_len=cfg.output_len, prefix=f"profile-{label}-")
    if cfg.out_dir:
        name = "profile_" + ("adapters" if adapters else "base") + ".txt"
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, name), "w", encoding="utf-8") as f:
            f.write(text)


def _hf_runs(cfg: ServeBenchConfig, report: dict, deadline: float | None, device: torch.device, work: str) -> None:
    from loraplex.bench.hf_baseline import hf_generate_baseline

    dtype = getattr(torch, report["workload"]["dtype"])
    folder = os.path.join(work, "model")
    adapters = [None] + ([os.path.join(work, "adapters", "adapter-0")] if cfg.num_adapters else [])
    for adapter in adapters:
        if deadline is not None and time.monotonic() >= deadline:
            report["skipped"].append(f"HF baseline {'PEFT' if adapter else 'base'} (time limit)")
            continue
        res = hf_generate_baseline(folder, adapter_folder=adapter, batch=cfg.concurrency, input_len=cfg.input_len,
                                   output_len=cfg.hf_output_len or cfg.output_len, device=device.type, dtype=dtype,
                                   seed=cfg.seed)
        report["hf_baseline"].append(res)
        print(f"[bench] {res['name']}: {res['per_request_output_tok_s']:.1f} out tok/s per req, TTFT "
              f"{res['ttft_ms']:.0f} ms", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
