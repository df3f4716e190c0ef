"""Engine settings: what to load, where, and the cache / scheduler limits. Validated on construction."""
from __future__ import annotations

import os
from dataclasses import dataclass

from loraplex.engine.fairness import check_cost_weight
from loraplex.engine.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MAX_MODEL_LEN_CAP = 8192   # max_model_len unset: the model's max_position_embeddings, capped here
MAX_LORA_RANK = 4096               # as loraplex.engine.lora.format.MAX_RANK_ABSOLUTE


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
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # tenant-fair scheduling (docs/engine.md, "Scheduler"): "vtc" (virtual token counters) or "fcfs"
    scheduling_policy: str = "vtc"
    vtc_input_weight: float = 1.0           # counter cost of a prompt token (before the tenant's weight divides it)
    vtc_output_weight: float = 2.0          # counter cost of an output token
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
    max_loras: int = 4                      # GPU slots: distinct adapters in one step
    max_lora_rank: int = 16                 # slot buffers are padded to this rank; higher ranks are refused
    max_cpu_loras: int = 16                 # CPU LRU of loaded adapters (>= max_loras)
    adapter_cache_dir: str | None = None    # disk cache, content-addressed by sha256 (default: a temp folder)
    adapter_cache_max_bytes: int | None = 20 * 1024 ** 3  # disk cache LRU cap (None: unbounded; 0: no caching)
    # tensor parallelism (docs/engine.md, "Tensor parallelism"): ranks on this host, GPUs 0..N-1 or CPU processes
    tensor_parallel_size: int = 1
    # CUDA graphs for decode steps (docs/engine.md, "CUDA graphs"): CUDA and tensor_parallel_size 1 only
    enforce_eager: bool = False             # never capture graphs: every step runs eagerly
    cuda_graph_max_batch_size: int = 64     # largest decode batch replayed from a graph (capped at max_num_seqs)
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
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.scheduling_policy not in ("vtc", "fcfs"):
            raise ValueError(f"scheduling_policy {self.scheduling_policy!r} is not supported; choose vtc (tenant-fair) "
                             "or fcfs")
        check_cost_weight("vtc_input_weight", self.vtc_input_weight)
        check_cost_weight("vtc_output_weight", self.vtc_output_weight)
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
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        cg = self.cuda_graph_max_batch_size
        if isinstance(cg, bool) or not isinstance(cg, int) or cg < 1:
            raise ValueError(f"cuda_graph_max_batch_size must be an integer >= 1, got {cg!r}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be None (auto), True or False, got {self.async_scheduling!r}")
        if self.async_scheduling and tp > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size 1 (tensor-parallel steps run eagerly, "
                             "rank by rank); leave it unset or False")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): every "
                             "adapter in a GPU slot passes through the CPU tier; raise max_cpu_loras")
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
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
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
