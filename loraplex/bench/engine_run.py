"""The in-process target of ``loraplex bench serve``: the workload's files, the engine of the current phase, and
measured runs on it.

    run = EngineRun(cfg, work_dir)            # config.json + adapters (reused when work_dir already holds them)
    run.start_phase(phase)                    # (re)start the engine with the phase's settings; time into setup_s
    row = run.measure(measurement, deadline)  # warm-up, then the measured load; the report row (dict) or None
    run.close()

Warm-up (``Measurement.warmup_requests``): that many requests at once with a few output tokens, cycling through
the run's adapters (each loaded once): the first 16 with full-length prompts (prefill chunks and mixed
prefill + decode steps at the real context compile their kernels), the rest with short prompts so the decode
batch reaches the level's size without prefilling C full prompts (decode kernels depend on the batch's shape,
never on context lengths).
"""
from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import replace

import torch

from loraplex.bench import speculative
from loraplex.bench.driver import drive
from loraplex.bench.engine_knobs import adapter_nbytes
from loraplex.bench.engine_setup import engine_info, engine_kwargs, timed_model_load, use_in_place_fetcher
from loraplex.bench.measure import Measurement, summarize_run
from loraplex.bench.probe import EngineProbe
from loraplex.bench.workload import SCALES, PlannedRequest, request_plan, write_model_config, write_random_adapter
from loraplex.kernels import compile_watch

WARMUP_OUTPUT_LEN = 8
WARMUP_FULL_PROMPTS = 16


def prepare_adapters(root: str, model_config: dict, *, num: int, rank: int, device: str,
                     dtype: torch.dtype) -> tuple[list[str], bool]:
    """``num`` random PEFT adapters under ``root`` (seeds 1..num); returns (folders, reused). A
    ``bench_adapters.json`` marker records what was written, so a later invocation with the same ``work_dir``
    (another stage of a device script) asking for the same model, rank and dtype reads the same files instead of
    writing 708 MB per adapter again; asking for more writes only the missing ones."""
    folders = [os.path.join(root, f"adapter-{k}") for k in range(num)]
    marker = os.path.join(root, "bench_adapters.json")
    want = json.loads(json.dumps(dict(model=model_config, rank=rank, dtype=str(dtype))))
    have_num = 0
    try:
        with open(marker, encoding="utf-8") as f:
            have = json.load(f)
        have_num = have.pop("num", 0)
        if have != want:
            have_num = 0
    except (OSError, ValueError, AttributeError):
        pass
    have_num = next((k for k in range(min(have_num, num)) if not os.path.isfile(
        os.path.join(folders[k], "adapter_model.safetensors"))), min(have_num, num))
    if have_num >= num:
        return folders, True
    if os.path.exists(marker):
        os.remove(marker)
    for k in range(have_num, num):
        write_random_adapter(folders[k], model_config, rank=rank, seed=k + 1, device=device, dtype=dtype)
    os.makedirs(root, exist_ok=True)
    with open(marker, "w", encoding="utf-8") as f:
        json.dump(dict(want, num=num), f)
    return folders, False


class EngineRun:
    """State shared by the phases of one invocation: the workload files, the engine of the current phase."""

    kind = "in-process"

    def __init__(self, cfg, work: str, *, num_adapter_files: int):
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
        self.adapter_bytes = adapter_nbytes(self.model_config, rank=cfg.rank, dtype=self.dtype)
        self.setup_s: dict[str, float] = {}
        self.notes: list[str] = []
        self.engine = None
        self.engine_info: dict = {}
        self.phase = None
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
        # adapter k reads file k % F: with fewer files than adapters, each file serves several adapter ids, which
        # the engine loads, holds and evicts one by one like any other adapters (the values do not change the cost)
        self.adapter_refs = ([AdapterRef(f"bench/adapter-{k}/1", file_uri(folders[k % len(folders)]))
                              for k in range(cfg.num_adapters)] if folders else [])
        if folders and len(folders) < cfg.num_adapters and not cfg.hf_only:
            self.notes.append(f"{cfg.num_adapters} adapters read from {len(folders)} files (adapter k reads file "
                              f"k mod {len(folders)}; each is loaded and kept as its own adapter)")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def start_phase(self, phase) -> None:
        """Start ``phase``'s engine (after closing the previous one); its start-up time goes to setup_s."""
        from loraplex.engine import LLMEngine

        self.close()
        label = phase.label
        kw = engine_kwargs(self.cfg, self.work, device=self.device.type, dtype=self.dtype,
                           quantization=phase.quantization, max_loras=phase.max_loras, extra=phase.engine_extra)
        if self.cfg.tensor_parallel_size > 1 and self.is_cuda:
            self.notes.append("tensor parallel: peak GPU memory and memory after start are rank 0's GPU")
        t0 = time.monotonic()
        with timed_model_load(self.setup_s, f"model_load_{label}"):
            self.engine = LLMEngine.from_pretrained(self.folder, **kw)
        use_in_place_fetcher(self.engine)
        self._sync()
        self.phase = phase
        self.setup_s[f"engine_start_{label}"] = time.monotonic() - t0
        info = engine_info(self.engine)
        info["memory_after_start_gib"] = (torch.cuda.memory_allocated(self.device) / 2**30) if self.is_cuda else None
        info["max_loras"] = kw.get("max_loras")
        info.update({k: v for k, v in phase.engine_extra.items()})
        if phase.description:
            info["description"] = phase.description
        if info["cuda_graphs"]:
            self.setup_s[f"graph_capture_{label}"] = info["cuda_graph_capture_seconds"]
        if info.get("eager_warmup"):
            self.setup_s[f"eager_warmup_{label}"] = info["eager_warmup"]["seconds"]
        self.engine_info[label] = info
        print(f"[bench] engine {label}: started in {self.setup_s[f'engine_start_{label}']:.1f} s (weights "
              f"{self.setup_s.get(f'model_load_{label}', float('nan')):.1f} s, graph capture "
              f"{self.setup_s.get(f'graph_capture_{label}', 0.0):.1f} s); TP "
              f"{info['tensor_parallel_size']}, CUDA graphs {info['cuda_graphs']}, async scheduling "
              f"{info.get('async_scheduling')}, quantization "
              f"{info['quantization']}, max_num_seqs {info['max_num_seqs']}, KV {info['kv_blocks']} blocks "
              f"({info['kv_gib']:.2f} GiB)", flush=True)

    def close(self) -> None:
        if self.engine is None:
            return
        self.engine.close()  # tensor parallel: stops the workers
        self.engine = None
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()

    def warmup(self, name: str, requests: int, adapters: int, deadline: float | None, seed: int) -> None:
        """Module docstring."""
        from loraplex.bench.driver import LoadGroup

        cfg = self.cfg
        plan = request_plan(num_requests=requests, num_adapters=adapters, mix="even", input_len=cfg.input_len,
                            vocab=self.model_config["vocab_size"], seed=seed + 1000)
        short = min(cfg.input_len, 2 * cfg.block_size)
        plan = [p if i < WARMUP_FULL_PROMPTS else PlannedRequest(p.index, p.prompt[:short], p.adapter)
                for i, p in enumerate(plan)]
        t0 = time.monotonic()
        drive(self.engine, [LoadGroup("warm", plan, min(WARMUP_OUTPUT_LEN, cfg.output_len), concurrency=len(plan))],
              self.adapter_refs, prefix=f"warm-{name}-", hard_deadline=deadline)
        self._sync()
        self.setup_s[f"warmup {name}"] = time.monotonic() - t0

    def measure(self, m: Measurement, deadline: float | None) -> dict | None:
        """Warm-up, then ``m``'s load; its report row, or None when the run's time limit came before any
        request finished."""
        cfg = self.cfg
        if cfg.warmup and m.warmup_requests:
            self.warmup(m.name, m.warmup_requests, m.warmup_adapters, deadline, cfg.seed)
        self._sync()
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        replayed = self._record_for_replay(m, deadline) if cfg.speculative_method == "replay" else None
        if replayed is not None:
            m = replace(m, name=m.name + " [replayed proposals]")
        spec0 = speculative.snapshot(self.engine)
        watch = compile_watch.install()
        compiled0 = watch.snapshot() if watch is not None else None
        probe = EngineProbe(self.engine)
        start = time.monotonic()
        soft = hard = None
        if m.time_s:
            soft, hard = start + m.time_s, start + (m.hard_s or 2 * m.time_s)
        if deadline is not None:
            hard = deadline if hard is None else min(hard, deadline)
        res = drive(self.engine, m.groups, self.adapter_refs, prefix=f"{m.name}-", soft_deadline=soft,
                    hard_deadline=hard, background_stop=start + m.background_s if m.background_s else None,
                    on_step=probe.on_step)
        primary = [t for t in res.timings if t.group == m.primary and t.finish is not None]
        if not primary:
            if deadline is not None and res.end >= deadline:
                return None
            sent = sum(t.group == m.primary for t in res.timings)
            raise RuntimeError(f"scenario {m.name!r}: no request of {m.primary!r} finished within its time cap "
                               f"({sent} sent); raise --scenario-time or shrink the workload")
        figures = probe.finish(res)
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.is_cuda else None
        info = self.engine_info.get(m.phase, {})
        return summarize_run(m, res, peak_memory_gib=peak, engine_figures=figures,
                             extra={"tensor_parallel_size": info.get("tensor_parallel_size"),
                                    "cuda_graphs": info.get("cuda_graphs"),
                                    "quantization": info.get("quantization"),
                                    "speculative": speculative.delta(spec0, speculative.snapshot(self.engine)),
                                    "no_speculation": replayed,
                                    # kernels compiled inside the run: each one stalled every running request
                                    "kernel_compiles": watch.since(compiled0) if watch is not None else None,
                                    }).to_dict()

    def _record_for_replay(self, m: Measurement, deadline: float | None) -> dict:
        """``m``'s primary load once with speculation off, its outputs recorded for the replay proposer."""
        group = next(g for g in m.groups if g.name == m.primary)
        return speculative.record_for_replay(self, m.name, group.plan, group.concurrency or self.cfg.concurrency,
                                             group.output_len, deadline)

    def profile(self, label: str, adapters: bool) -> str:
        from loraplex.bench.profile import profile_decode

        cfg = self.cfg
        n = cfg.num_adapters if adapters else 0
        plan = request_plan(num_requests=cfg.concurrency, num_adapters=n, mix="even", input_len=cfg.input_len,
                            vocab=self.model_config["vocab_size"], seed=cfg.seed + 2000)
        if cfg.speculative_method == "replay":  # the profiled requests (and the arrival, plan[0]'s prompt) replay
            speculative.record_for_replay(self, f"profile-{label}", plan, cfg.concurrency, cfg.output_len, None)
        return profile_decode(self.engine, plan, self.adapter_refs, concurrency=cfg.concurrency,
                              steps=cfg.profile_steps, output_len=cfg.output_len, prefix=f"profile-{label}-")
