"""``loraplex bench serve``: the GPT-OSS-20B multi-LoRA serving workload against the in-process engine, base-only
and with N adapters in the same invocation (optionally INT8 / MXFP4 experts, tensor parallelism and an HF
transformers + PEFT baseline).

    report = run_serve_bench(ServeBenchConfig(scale="tiny", out_dir="/tmp/bench"))    # CPU smoke run
    report = run_serve_bench(ServeBenchConfig(scale="full", num_requests=64))          # H200

Order: write config.json + adapters (reused when ``work_dir`` already holds the same ones) -> start the engine
(dummy weights, LoRA enabled; ``quantization="int8"``: INT8 experts from the start) -> per scenario a warm-up
(``max(concurrency, adapters)`` full prompts, 8 output tokens: Triton JIT at the step shapes, adapter loads)
then the measured closed loop -> ``int8``: a second engine with INT8 experts and the same scenarios ->
``hf_baseline``: HF transformers, then the same model wrapped by PEFT. Setup costs (adapter writes, engine start,
each warm-up) are timed into ``setup_s``. The report is rewritten after every scenario, so a run stopped by a
time limit still leaves its figures.
"""
from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from loraplex.bench.driver import closed_loop
from loraplex.bench.engine_setup import engine_info, engine_kwargs, timed_model_load, use_in_place_fetcher
from loraplex.bench.report import write_report
from loraplex.bench.stats import summarize
from loraplex.bench.workload import MIXES, SCALES, request_plan, write_model_config, write_random_adapters

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "mxfp4")
WARMUP_OUTPUT_LEN = 8


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
    quantization: str | None = None       # "int8" / "mxfp4": the engine's experts quantised from the start (one phase)
    int8: bool = False                    # after the float phase, a second engine with INT8 experts, same scenarios
    tensor_parallel_size: int = 1
    enforce_eager: bool = False           # no CUDA graphs for decode steps
    async_scheduling: bool | None = None  # overlapped decode steps; None: the engine's default (on with graphs)
    hf_baseline: bool = False
    hf_only: bool = False                 # only the HF baseline (no engine scenarios)
    hf_output_len: int | None = None      # HF output tokens (default: output_len)
    warmup: bool = True
    stagger_s: float = 0.0                # client k starts k * stagger_s seconds in (0: all at once)
    profile_steps: int = 0                # > 0: profile this many decode steps per scenario kind (first phase)
    # speculative decoding (loraplex/bench/speculative.py): ngram | draft | replay (recorded outputs at a set rate)
    speculative_method: str | None = None
    num_speculative_tokens: int = 3
    speculative_draft_model: str | None = None
    speculative_acceptance_length: float | None = None  # replay: mean tokens per verification (sets the rate)
    speculative_verify_cuda_graphs: bool = False
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
        for name in ("rank", "concurrency", "num_requests", "input_len", "output_len", "block_size",
                     "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_adapters < 0:
            raise ValueError(f"num_adapters must be >= 0, got {self.num_adapters}")
        if self.num_adapters == 0 and not self.base_only and not self.hf_only:
            raise ValueError("nothing to run: num_adapters is 0 and the base-only scenario is off")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not supported; choose one of "
                             f"{', '.join(QUANTIZATIONS)}")
        if self.quantization is not None and self.int8:
            raise ValueError("quantization='int8' already runs INT8 experts; int8 (a second, INT8 phase after the "
                             "float one) goes with an unquantised engine only")
        if self.hf_only:
            self.hf_baseline = True
        for name in ("scenario_time_s", "total_time_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        from loraplex.bench.speculative import speculative_config

        speculative_config(self)  # bad speculative flags: ValueError now


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
    env["visible_gpus"] = torch.cuda.device_count() if device.type == "cuda" else 0
    env["kernels"] = os.environ.get("LORAPLEX_KERNELS", "auto")
    return env


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def prepare_adapters(root: str, model_config: dict, *, num: int, rank: int, device: str,
                     dtype: torch.dtype) -> tuple[list[str], bool]:
    """``num`` random PEFT adapters under ``root`` (seeds 1..num); returns (folders, reused). A
    ``bench_adapters.json`` marker records what was written, so a later invocation with the same ``work_dir``
    (another stage of a device script) asking for the same model, rank and dtype and at most as many adapters
    reads the same files instead of writing 708 MB per adapter again."""
    folders = [os.path.join(root, f"adapter-{k}") for k in range(num)]
    marker = os.path.join(root, "bench_adapters.json")
    want = json.loads(json.dumps(dict(model=model_config, rank=rank, dtype=str(dtype))))
    try:
        with open(marker, encoding="utf-8") as f:
            have = json.load(f)
        if have.pop("num", -1) >= num and have == want and all(
                os.path.isfile(os.path.join(d, "adapter_model.safetensors")) for d in folders):
            return folders, True
    except (OSError, ValueError, AttributeError):
        pass
    if os.path.exists(marker):
        os.remove(marker)
    folders = write_random_adapters(root, model_config, num=num, rank=rank, device=device, dtype=dtype)
    with open(marker, "w", encoding="utf-8") as f:
        json.dump(dict(want, num=num), f)
    return folders, False


class _Run:
    """State shared by the scenarios of one invocation: the workload files, the engine of the current phase."""

    def __init__(self, cfg: ServeBenchConfig, work: str, *, num_adapter_files: int):
        from loraplex.engine.lora.fetch import file_uri
        from loraplex.engine.lora.ref import AdapterRef

        self.cfg = cfg
        self.work = work
        self.model_config = SCALES[cfg.scale]
        self.folder = write_model_config(os.path.join(work, "model"), self.model_config)
        device = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else \
            ("cpu" if cfg.device == "auto" else cfg.device)
        self.device = torch.device(device)
        self.dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        self.setup_s: dict[str, float] = {}
        self.notes: list[str] = []
        self.engine = None
        self.engine_info: dict = {}
        t0 = time.monotonic()
        folders, reused = prepare_adapters(os.path.join(work, "adapters"), self.model_config, num=num_adapter_files,
                                           rank=cfg.rank, device=device, dtype=getattr(torch, self.dtype))
        self.setup_s["adapters_write"] = time.monotonic() - t0
        if reused:
            self.notes.append(f"{num_adapter_files} adapters reused from {os.path.join(work, 'adapters')}")
        size = sum(os.path.getsize(os.path.join(f, "adapter_model.safetensors")) for f in folders)
        print(f"[bench] adapters: {len(folders)} ({size / 2**20:.0f} MiB in all) "
              f"{'reused' if reused else 'written'} in {self.setup_s['adapters_write']:.1f} s", flush=True)
        self.adapter_folders = folders
        self.adapter_refs = [AdapterRef(f"bench/adapter-{k}/1", file_uri(f)) for k, f in enumerate(folders)]

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def start_engine(self, phase: str, quantization: str | None) -> None:
        """Start this phase's engine (after closing the previous one); its start-up time goes to setup_s."""
        from loraplex.engine import LLMEngine

        self.close_engine()
        kw = engine_kwargs(self.cfg, self.work, device=self.device.type, dtype=self.dtype, quantization=quantization)
        if self.cfg.tensor_parallel_size > 1 and self.is_cuda:
            self.notes.append("tensor parallel: peak GPU memory and memory after start are rank 0's GPU")
        t0 = time.monotonic()
        with timed_model_load(self.setup_s, f"model_load_{phase}"):
            self.engine = LLMEngine.from_pretrained(self.folder, **kw)
        use_in_place_fetcher(self.engine)
        self._sync()
        self.setup_s[f"engine_start_{phase}"] = time.monotonic() - t0
        info = engine_info(self.engine)
        info["memory_after_start_gib"] = (torch.cuda.memory_allocated(self.device) / 2**30) if self.is_cuda else None
        if info["cuda_graphs"]:
            self.setup_s[f"graph_capture_{phase}"] = info["cuda_graph_capture_seconds"]
        self.engine_info[phase] = info
        print(f"[bench] engine {phase}: started in {self.setup_s[f'engine_start_{phase}']:.1f} s (weights "
              f"{self.setup_s.get(f'model_load_{phase}', float('nan')):.1f} s, graph capture "
              f"{self.setup_s.get(f'graph_capture_{phase}', 0.0):.1f} s); TP "
              f"{info['tensor_parallel_size']}, CUDA graphs {info['cuda_graphs']}, async scheduling "
              f"{info.get('async_scheduling')}, quantization "
              f"{info['quantization']}, KV {info['kv_blocks']} blocks "
              f"({info['kv_gib']:.2f} GiB)", flush=True)

    def close_engine(self) -> None:
        if self.engine is None:
            return
        self.engine.close()  # tensor parallel: stops the workers
        self.engine = None
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()

    def warmup(self, name: str, adapters: bool, deadline: float | None, seed: int) -> None:
        """``max(concurrency, adapters)`` requests with full-length prompts and a few output tokens, all at once:
        the prefill chunks, mixed prefill + decode steps and decode batches of every size up to C compile their
        kernels, and every adapter is loaded into its slot before the measured loop."""
        cfg = self.cfg
        n = cfg.num_adapters if adapters else 0
        warm = request_plan(num_requests=max(cfg.concurrency, n), num_adapters=n, mix="even",
                            input_len=cfg.input_len, vocab=self.model_config["vocab_size"], seed=seed + 1000)
        t0 = time.monotonic()
        closed_loop(self.engine, warm, self.adapter_refs, concurrency=len(warm),
                    output_len=min(WARMUP_OUTPUT_LEN, cfg.output_len), prefix=f"warm-{name}-",
                    hard_deadline=deadline)
        self._sync()
        self.setup_s[f"warmup {name}"] = time.monotonic() - t0

    def scenario(self, name: str, adapters: bool, deadline: float | None, seed: int):
        cfg = self.cfg
        n = cfg.num_adapters if adapters else 0
        if cfg.warmup:
            self.warmup(name, adapters, deadline, seed)
        plan = request_plan(num_requests=cfg.num_requests, num_adapters=n, mix=cfg.mix, input_len=cfg.input_len,
                            vocab=self.model_config["vocab_size"], seed=seed)
        self._sync()
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        from loraplex.bench import speculative

        replayed = (speculative.record_for_replay(self, name, plan, cfg.concurrency, cfg.output_len, deadline)
                    if cfg.speculative_method == "replay" else None)
        if replayed is not None:
            name += " [replayed proposals]"
        spec0 = speculative.snapshot(self.engine)
        graphs = self.engine.runner.decode_graphs
        graph_steps0 = graphs.num_steps if graphs is not None else None
        counters: dict = {}
        start = time.monotonic()
        soft = hard = None
        if cfg.scenario_time_s:
            soft, hard = start + cfg.scenario_time_s, start + 2 * cfg.scenario_time_s
        if deadline is not None:
            hard = deadline if hard is None else min(hard, deadline)
        timings, truncated = closed_loop(self.engine, plan, self.adapter_refs, concurrency=cfg.concurrency,
                                         output_len=cfg.output_len, prefix=f"{name}-", soft_deadline=soft,
                                         hard_deadline=hard, stagger_s=cfg.stagger_s, counters=counters)
        end = time.monotonic()
        if deadline is not None and end >= deadline and not any(t.finish is not None for t in timings):
            return None  # the run's time limit came before any request of this scenario finished
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.is_cuda else None
        per_adapter = {}
        for t in timings:
            if t.finish is not None:
                per_adapter[str(t.adapter)] = per_adapter.get(str(t.adapter), 0) + 1
        info = self.engine_info.get(name.split(" ", 1)[0], {})
        return summarize(name, timings, concurrency=cfg.concurrency, input_len=cfg.input_len,
                         output_len=cfg.output_len, start=start, end=end, peak_memory_gib=peak,
                         peak_rss_gib=_peak_rss_gib(), truncated=truncated,
                         extra={"requests_per_adapter": per_adapter, "planned_requests": cfg.num_requests,
                                "tensor_parallel_size": info.get("tensor_parallel_size"),
                                "cuda_graphs": info.get("cuda_graphs"), "quantization": info.get("quantization"),
                                "engine_steps": counters.get("steps", 0),
                                # decode steps served by the padded static-buffer path (graph replays on CUDA)
                                "graph_steps": (graphs.num_steps - graph_steps0) if graph_steps0 is not None
                                else None,
                                "speculative": speculative.delta(spec0, speculative.snapshot(self.engine)),
                                "no_speculation": replayed})


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
        r["adapters per-request decode tok/s / HF+PEFT"] = (lora["per_request_decode_tok_s"]
                                                            / peft["per_request_decode_tok_s"])
        if peft.get("est_per_request_output_tok_s") and peft.get("est_output_len") == lora["output_len"]:
            r["adapters per-request tok/s / HF+PEFT (est. at same output)"] = (
                lora["per_request_output_tok_s"] / peft["est_per_request_output_tok_s"])
    return r


def _phases(cfg: ServeBenchConfig, float_label: str) -> list[tuple[str, str | None]]:
    """(label, quantization) per engine phase."""
    if cfg.hf_only:
        return []
    if cfg.quantization is not None:
        return [(cfg.quantization, cfg.quantization)]
    return [(float_label, None)] + ([("int8", "int8")] if cfg.int8 else [])


def run_serve_bench(cfg: ServeBenchConfig) -> dict:
    """Run the scenarios; returns the report dict (also written to ``cfg.out_dir`` when set)."""
    t_start = time.monotonic()
    deadline = t_start + cfg.total_time_s if cfg.total_time_s else None
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as tmp:
        work = cfg.work_dir or tmp
        # the HF stage reads one adapter; engine stages read all of them
        files = min(1, cfg.num_adapters) if cfg.hf_only else cfg.num_adapters
        run = _Run(cfg, work, num_adapter_files=files)
        prec = "bf16" if run.dtype == "bfloat16" else run.dtype
        report = dict(command=cfg.command, env=environment(run.device),
                      workload=dict(asdict(cfg), dtype=run.dtype, model=dict(run.model_config)),
                      setup_s=run.setup_s, engine=run.engine_info, scenarios=[], hf_baseline=[], skipped=[],
                      notes=list(cfg.notes))
        report["workload"].pop("notes", None)

        def emit() -> None:
            report["ratios"] = _ratios(report["scenarios"], report["hf_baseline"])
            report["notes"] = list(dict.fromkeys(cfg.notes + run.notes))
            report["elapsed_s"] = time.monotonic() - t_start
            if cfg.out_dir:
                write_report(report, cfg.out_dir)

        plan = []
        if cfg.base_only:
            plan.append(("base-only", False))
        if cfg.num_adapters:
            plan.append((f"{cfg.num_adapters} adapters r{cfg.rank}", True))
        phases = _phases(cfg, prec)
        try:
            for i, (phase, quant) in enumerate(phases):
                if deadline is not None and time.monotonic() >= deadline:
                    report["skipped"] += [f"{phase} {name} (time limit)" for name, _ in plan]
                    continue
                run.start_engine(phase, quant)
                emit()
                for k, (name, adapters) in enumerate(plan):
                    label = f"{phase} {name}"
                    if deadline is not None and time.monotonic() >= deadline:
                        report["skipped"].append(f"{label} (time limit)")
                        continue
                    s = run.scenario(label, adapters, deadline, seed=cfg.seed + k)
                    if s is None:
                        report["skipped"].append(f"{label} (time limit: no request finished)")
                        emit()
                        continue
                    report["scenarios"].append(s.to_dict())
                    logger.info("%s: %.1f tok/s per request, TTFT p50 %.0f ms", label, s.per_request_output_tok_s,
                                s.ttft_p50_ms)
                    print(f"[bench] {label}: {s.num_requests} req, {s.per_request_output_tok_s:.1f} out tok/s per "
                          f"req, TPOT {s.tpot_mean_ms:.1f} ms, TTFT p50 {s.ttft_p50_ms:.0f} ms p99 "
                          f"{s.ttft_p99_ms:.0f} ms, {s.duration_s:.1f} s{' (truncated)' if s.truncated else ''}",
                          flush=True)
                    emit()
                    if cfg.profile_steps and i == 0 and (deadline is None or time.monotonic() < deadline):
                        _write_profile(run, cfg, label, adapters)
        finally:
            run.close_engine()
        if cfg.hf_baseline:
            _hf_runs(cfg, report, deadline, run.device, work, run.adapter_folders)
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
            report["ratios"] = _ratios(report["scenarios"], report["hf_baseline"])
            write_report(report, cfg.out_dir)

    hf_generate_baselines(os.path.join(work, "model"), adapter_folder=adapter_folders[0] if adapter_folders else None,
                          batch=cfg.concurrency, input_len=cfg.input_len,
                          output_len=cfg.hf_output_len or cfg.output_len, est_output_len=cfg.output_len,
                          device=device.type, dtype=getattr(torch, report["workload"]["dtype"]), seed=cfg.seed,
                          deadline=deadline, on_result=record)
    report["setup_s"]["hf_total"] = time.monotonic() - t0
    if device.type == "cuda":
        torch.cuda.empty_cache()
