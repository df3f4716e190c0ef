"""Engine settings: what to load, where, and the cache / scheduler limits. Validated on construction."""
from __future__ import annotations

import os
from dataclasses import dataclass

from loraplex.engine.fairness import DEFAULT_PREEMPT_GAP, check_cost_weight, check_preempt_gap
from loraplex.engine.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MAX_MODEL_LEN_CAP = 8192   # max_model_len unset: the model's max_position_embeddings, capped here
MAX_LORA_RANK = 4096               # as loraplex.engine.lora.format.MAX_RANK_ABSOLUTE
CUDA_MAX_NUM_SEQS = 256   # max_num_seqs=None on CUDA: decode batches up to 256 fill an H200 at MoE sizes
CPU_MAX_NUM_SEQS = 64     # max_num_seqs=None elsewhere
# max_num_batched_tokens=None on CUDA: up to 4096 tokens a step, the largest mixed-step graph bucket (a prompt chunk
# beside the decodes; engine/mixed_graphs.py)
CUDA_MAX_NUM_BATCHED_TOKENS = 4096
CPU_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class EngineConfig:
    model: str                              # folder with config.json (+ safetensors unless load_format="dummy")
    tokenizer: str | None = None            # defaults to the model folder
    dtype: str = "auto"                     # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"                    # auto: cuda when available
    load_format: str = "auto"               # auto | safetensors | dummy
    # expert weights (docs/engine.md, "Loading checkpoints and quantization"): "auto" = as the checkpoint stores
    # them (MXFP4 for an MXFP4 checkpoint, else float); None = float (an MXFP4 checkpoint is dequantised at load);
    # "int8" | "mxfp4" = weight-only, quantised at load (an MXFP4 checkpoint's experts stay as published for "mxfp4")
    quantization: str | None = "auto"
    seed: int = 0
    # scheduler
    max_model_len: int | None = None        # defaults to the model's max_position_embeddings (capped at 8192)
    max_num_seqs: int | None = None         # None: 256 on CUDA, 64 elsewhere (``with_device_defaults``)
    max_num_batched_tokens: int | None = None  # tokens per step; None: 4096 on CUDA, 2048 elsewhere
    enable_chunked_prefill: bool = True
    # tenant-fair scheduling (docs/engine.md, "Scheduler"): "vtc" (virtual token counters) or "fcfs"
    scheduling_policy: str = "vtc"
    vtc_input_weight: float = 1.0           # counter cost of a prompt token (before the tenant's weight divides it)
    vtc_output_weight: float = 2.0          # counter cost of an output token
    vtc_preempt_gap: float | None = DEFAULT_PREEMPT_GAP  # counter lead beyond which running groups yield sequence
                                            # slots to a waiting tenant's request; None: never
    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None        # explicit pool size; else sized from memory
    kv_cache_memory_bytes: int | None = None  # CPU budget (default: enough for max_num_seqs full sequences, ≤ 1 GiB)
    gpu_memory_utilization: float = 0.90    # CUDA: fraction of total memory the engine may use
    enable_prefix_caching: bool = True
    # preemption (docs/engine.md, "Forking, copy-on-write and swapping")
    preemption_mode: str = "auto"           # recompute | swap | auto (swap groups of several or long sequences)
    num_cpu_blocks: int | None = None       # explicit CPU swap pool size in blocks; else from swap_space_bytes
    swap_space_bytes: int | None = None     # CPU swap pool budget (default: 1 GiB beside a CUDA cache, 0 on CPU)
    progress: bool = True                   # progress bar while loading weights
    # LoRA adapters (docs/adapters.md)
    enable_lora: bool = False
    max_loras: int | None = None            # optional cap on GPU-resident adapters (None: memory alone decides)
    max_lora_rank: int = 16                 # highest rank accepted (adapters are stored at their own rank)
    max_cpu_loras: int = 16                 # CPU LRU of loaded adapters
    # GPU memory for resident adapters (docs/adapters.md, "GPU memory"): bytes, else a share of what is left after
    # weights, activation and CUDA-graph headroom (the KV pool gets the rest); on CPU default 256 MiB
    adapter_memory_bytes: int | None = None
    adapter_memory_fraction: float = 0.35
    adapter_cache_dir: str | None = None    # disk cache, content-addressed by sha256 (default: a temp folder)
    adapter_cache_max_bytes: int | None = 20 * 1024 ** 3  # disk cache LRU cap (None: unbounded; 0: no caching)
    # tensor parallelism (docs/engine.md, "Tensor parallelism"): ranks on this host, GPUs 0..N-1 or CPU processes
    tensor_parallel_size: int = 1
    # CUDA graphs for decode steps (docs/engine.md, "CUDA graphs"): CUDA and tensor_parallel_size 1 only
    enforce_eager: bool = False             # never capture graphs: every step runs eagerly
    cuda_graph_max_batch_size: int | None = None  # largest decode batch replayed from a graph (None: max_num_seqs)
    cuda_graph_capture_budget_s: float = 120.0   # start-up time allowed for capturing (buckets past it run padded)
    # steps with prefill chunks replay graphs of token buckets up to max_num_batched_tokens (engine/mixed_graphs.py)
    mixed_cuda_graphs: bool = True
    # start-up compile of the eager steps' kernel variants (docs/engine.md, "Eager warm-up"; engine/eager_warmup.py):
    # seconds allowed, CUDA and tensor_parallel_size 1 only; 0 = off (variants then compile on first use)
    eager_warmup_budget_s: float = 90.0
    # overlapped scheduling (docs/engine.md, "Overlapped scheduling"): launch decode step n+1 before step n's tokens
    # are read. None: on when decode steps replay CUDA graphs; True: also on the eager padded path (any device);
    # False: off
    async_scheduling: bool | None = None
    # speculative decoding (docs/engine.md, "Speculative decoding"): None = off; a SpeculativeConfig or its dict
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is not supported; choose one of {', '.join(DEVICES)}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format {self.load_format!r}: expected auto, safetensors or dummy")
        if self.quantization not in ("auto", None, "int8", "mxfp4"):
            raise ValueError(f"quantization {self.quantization!r} is not supported; choose 'auto', None (float "
                             "experts), 'int8' or 'mxfp4'")
        if self.max_num_seqs is not None and (isinstance(self.max_num_seqs, bool) or
                                              not isinstance(self.max_num_seqs, int) or self.max_num_seqs <= 0):
            raise ValueError(f"max_num_seqs must be None (device default) or a positive integer, got "
                             f"{self.max_num_seqs!r}")
        mbt = self.max_num_batched_tokens
        if mbt is not None and (isinstance(mbt, bool) or not isinstance(mbt, int) or mbt <= 0):
            raise ValueError(f"max_num_batched_tokens must be None (device default) or a positive integer, got "
                             f"{mbt!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.scheduling_policy not in ("vtc", "fcfs"):
            raise ValueError(f"scheduling_policy {self.scheduling_policy!r} is not supported; choose vtc (tenant-fair) "
                             "or fcfs")
        check_cost_weight("vtc_input_weight", self.vtc_input_weight)
        check_cost_weight("vtc_output_weight", self.vtc_output_weight)
        check_preempt_gap(self.vtc_preempt_gap)
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode {self.preemption_mode!r} is not supported; choose recompute, swap "
                             "or auto")
        for name in ("num_cpu_blocks", "swap_space_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
        self.speculative = SpeculativeConfig.from_value(self.speculative)
        if self.speculative is not None and self.tensor_parallel_size != 1:
            raise ValueError("speculative decoding needs tensor_parallel_size 1 (the verify step is not shipped to "
                             "tensor-parallel workers yet); leave speculative unset")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        for name in ("max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        ml = self.max_loras
        if ml is not None and (isinstance(ml, bool) or not isinstance(ml, int) or ml < 1):
            raise ValueError(f"max_loras must be None (no cap) or an integer >= 1, got {ml!r}")
        amb = self.adapter_memory_bytes
        if amb is not None and (isinstance(amb, bool) or not isinstance(amb, int) or amb < 1):
            raise ValueError(f"adapter_memory_bytes must be None or a positive integer, got {amb!r}")
        if not 0.0 < self.adapter_memory_fraction < 1.0:
            raise ValueError(f"adapter_memory_fraction must be in (0, 1), got {self.adapter_memory_fraction}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        cg = self.cuda_graph_max_batch_size
        if cg is not None and (isinstance(cg, bool) or not isinstance(cg, int) or cg < 1):
            raise ValueError(f"cuda_graph_max_batch_size must be None (max_num_seqs) or an integer >= 1, got {cg!r}")
        if not self.cuda_graph_capture_budget_s > 0:
            raise ValueError(f"cuda_graph_capture_budget_s must be positive, got {self.cuda_graph_capture_budget_s}")
        if not self.eager_warmup_budget_s >= 0:
            raise ValueError(f"eager_warmup_budget_s must be >= 0 (0: off), got {self.eager_warmup_budget_s}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be None (auto), True or False, got {self.async_scheduling!r}")
        if self.async_scheduling and tp > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size 1 (tensor-parallel steps run eagerly, "
                             "rank by rank); leave it unset or False")
        if self.adapter_cache_dir is not None and os.path.exists(self.adapter_cache_dir) \
                and not os.path.isdir(self.adapter_cache_dir):
            raise ValueError(f"adapter_cache_dir {self.adapter_cache_dir!r} exists and is not a folder")
        cap = self.adapter_cache_max_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"adapter_cache_max_bytes must be None (unbounded) or an integer >= 0, got {cap!r}")


class EngineSettingsError(ValueError):
    """A setting the model cannot honour; the one-line message names the setting, the model's limit and the fix.
    Raised at engine start, before any weight is loaded."""


def check_against_model(config: EngineConfig, model) -> int:
    """Checks ``config`` against the model's ``ModelConfig``; returns the ``max_model_len`` the engine runs with
    (the setting, or the model's ``max_position_embeddings`` capped at ``DEFAULT_MAX_MODEL_LEN_CAP``).

    Refused: a ``max_model_len`` past the positions the rotary table has (the first step that reached it failed
    deep in the model); chunked prefill off with a token budget smaller than one full prompt (such prompts could
    never be scheduled); weight-only expert quantization on a dense model (nothing to quantise); LoRA slots for a
    rank above ``MAX_LORA_RANK``. (mxfp4's block sizes are checked where the weights are quantised, per rank.)"""
    positions = model.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > positions:
        raise EngineSettingsError(
            f"max_model_len={config.max_model_len} is above the model's max_position_embeddings ({positions}): "
            f"positions past it have no rotary embedding; set max_model_len <= {positions}")
    max_model_len = config.max_model_len or min(positions, DEFAULT_MAX_MODEL_LEN_CAP)
    if (not config.enable_chunked_prefill and config.max_num_batched_tokens is not None
            and config.max_num_batched_tokens < max_model_len):
        raise EngineSettingsError(
            f"max_num_batched_tokens={config.max_num_batched_tokens} is below max_model_len={max_model_len} with "
            "chunked prefill off: a prompt longer than the budget could never be scheduled; raise "
            "max_num_batched_tokens, lower max_model_len or enable chunked prefill")
    if config.quantization not in (None, "auto") and not model.is_moe:  # auto / None: the weights as stored
        raise EngineSettingsError(
            f"quantization={config.quantization!r} quantises mixture-of-experts expert weights, but the model "
            f"({model.family}) is dense; leave quantization at its default ('auto')")
    if config.enable_lora and config.max_lora_rank > MAX_LORA_RANK:
        raise EngineSettingsError(f"max_lora_rank={config.max_lora_rank} is above {MAX_LORA_RANK}, the largest rank "
                                  "an adapter may have; lower it")
    return max_model_len


def with_device_defaults(config: EngineConfig, device_type: str) -> EngineConfig:
    """``config`` with the device-dependent defaults filled in: ``max_num_seqs`` (256 on CUDA, 64 elsewhere),
    ``max_num_batched_tokens`` (4096 on CUDA, 2048 elsewhere) and ``cuda_graph_max_batch_size`` (= max_num_seqs:
    every decode batch replays a graph)."""
    from dataclasses import replace

    cuda = device_type == "cuda"
    seqs = config.max_num_seqs or (CUDA_MAX_NUM_SEQS if cuda else CPU_MAX_NUM_SEQS)
    tokens = config.max_num_batched_tokens or (CUDA_MAX_NUM_BATCHED_TOKENS if cuda else CPU_MAX_NUM_BATCHED_TOKENS)
    graphs = config.cuda_graph_max_batch_size or seqs
    if (seqs, tokens, graphs) == (config.max_num_seqs, config.max_num_batched_tokens,
                                  config.cuda_graph_max_batch_size):
        return config
    return replace(config, max_num_seqs=seqs, max_num_batched_tokens=tokens, cuda_graph_max_batch_size=graphs)
