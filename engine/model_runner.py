"""The model runner owns the model, the KV cache tensors (device pool and CPU swap pool) and every device buffer
of a step.

    SchedulerOutput ──▶ swap out (GPU→CPU) ─▶ swap in (CPU→GPU) ─▶ copy_blocks (copy-on-write, one call)
                    ──▶ prepare(): input_ids, positions, AttentionMetadata ──▶ model ──▶ logits of sampling rows
                    ──▶ Sampler ──▶ ModelStepOutput {seq_id: tokens, logprobs, beam log-prob rows, prompt logprobs}

A pure decode step (one new token per sequence) instead goes through ``DecodeGraphs`` (cuda_graphs.py) once
``init_decode_graphs`` ran: padded to a batch-size bucket in static buffers, a CUDA graph replay on CUDA. A step
with prefill chunks goes through ``MixedGraphs`` (mixed_graphs.py) once ``init_mixed_graphs`` ran: padded to a
token bucket, likewise.
``launch_decode`` runs such a step without reading its tokens back (overlapped scheduling, step_pipeline.py); it is
``launch_forward`` (the forward pass, enqueued) then ``sample_launched`` (sampling, enqueued), which the engine
calls apart when a grammar mask needs the previous step's tokens in between.

Grammar masks (structured outputs) come as a ``TokenBitmask`` (host rows by sequence id): each drawn row gets its
sequence's row on the device (a fork's copies share the parent's), free rows an all-allowed one; the sampler
applies it to the logits, outside any captured graph.

At a parallel-sampling fork step the parent's logits row is repeated ``num_samples`` times (one draw per future
sequence, each from its own generator); a beam's row becomes ``Sampler.beam_logprobs``.

The scheduler never builds a tensor; this module never decides who runs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from loraplex.engine.attention_metadata import AttentionMetadata, scheduled_tokens, token_slots
from loraplex.engine.config import ModelConfig
from loraplex.engine.engine_config import EngineConfig, with_device_defaults
from loraplex.engine.logprobs import prompt_logprobs
from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler_output import ModelStepOutput, SchedulerOutput
from loraplex.engine.step_pipeline import PendingTokens
from loraplex.kernels import ops

if TYPE_CHECKING:
    from loraplex.engine.cuda_graphs import DecodeGraphs
    from loraplex.engine.eager_warmup import WarmupReport
    from loraplex.engine.mixed_graphs import MixedGraphs
    from loraplex.engine.lora.slots import LoRASlots
    from loraplex.engine.structured.bitmask import TokenBitmask

logger = logging.getLogger(__name__)

CPU_KV_CACHE_CAP_BYTES = 256 << 20
CPU_ADAPTER_MEMORY_BYTES = 256 << 20  # default adapter budget off CUDA (at least 4 of the largest adapters)
CUDA_SWAP_SPACE_BYTES = 1 << 30  # default CPU swap pool beside a CUDA KV cache
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    attn: AttentionMetadata
    sample_rows: torch.Tensor      # [N] rows of the step's tokens whose logits are sampled
    sample_seqs: list              # [N] the sequences those rows belong to


@dataclass
class EarlyStep:
    """An eager step's forward and logits, enqueued before the overlapped step in flight was read back
    (``ModelRunner.launch_eager``; step_pipeline's docstring); ``execute(..., launched=...)`` samples it."""

    sample_seqs: list              # [N] the sequences whose rows are sampled
    logits: torch.Tensor | None    # [N, V] of their rows (None: no row samples)


class ModelRunner:
    def __init__(self, config: EngineConfig, max_model_len: int, max_num_seqs: int | None):
        self.device = resolve_device(config.device)
        # a config not through LLMEngine (a hand-started tensor-parallel worker) still gets the device defaults
        self.config = config = with_device_defaults(config, self.device.type)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model, self.model_config = self._load_model()
        if config.quantization != "auto":  # auto: the experts as the checkpoint stores them
            from loraplex.engine.quantization import apply_quantization

            converted = apply_quantization(self.model, config.quantization)
            logger.info("quantization %s: %s layers converted", config.quantization, converted)
        if self.device.type == "cuda":
            from loraplex.engine.quantization.mxfp4_experts import use_mxfp4_kernel_layout
            from loraplex.kernels import compile_watch

            compile_watch.install()  # the engine's stats count every Triton compile from here on

            if n := use_mxfp4_kernel_layout(self.model):
                logger.info("MXFP4 experts: %d layers repacked for the CUDA GEMMs", n)
        from loraplex.engine.loader import weights_bytes

        self.weights_bytes = weights_bytes(self.model)
        logger.info("weights: %.2f GiB on %s", self.weights_bytes / 2**30, self.device)
        self.model.eval()
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.decode_graphs: "DecodeGraphs | None" = None  # set by init_decode_graphs()
        self.mixed_graphs: "MixedGraphs | None" = None    # set by init_mixed_graphs()
        self.mixed_aux_layer_ids: tuple[int, ...] = ()    # their aux layers (a proposer reading them, EAGLE-3)
        self.max_num_seqs = max_num_seqs = max_num_seqs or config.max_num_seqs
        self.graph_reserved_bytes = self._graph_reserve_bytes(max_num_seqs)
        self.adapter_budget_bytes = 0  # GPU bytes for resident adapters (set by _size_kv_pool with enable_lora)
        self.num_blocks = self._size_kv_pool(max_model_len, max_num_seqs)
        cfg = self.model_config
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.empty(shape, dtype=self.dtype, device=self.device),
                           torch.empty(shape, dtype=self.dtype, device=self.device)) for _ in range(cfg.num_layers)]
        self.num_cpu_blocks = self._size_swap_pool()
        pin = self.device.type == "cuda"
        cpu_shape = (self.num_cpu_blocks, *shape[1:])
        self.cpu_kv_caches = [(torch.empty(cpu_shape, dtype=self.dtype, pin_memory=pin),
                               torch.empty(cpu_shape, dtype=self.dtype, pin_memory=pin))
                              for _ in range(cfg.num_layers)] if self.num_cpu_blocks else []
        self.sampler = Sampler(eos_token_ids=cfg.eos_token_ids)
        self.lora: "LoRASlots | None" = None  # set by init_lora()
        # Debug/test hook: called with (sequences, logits [N, V] float32) before sampling.
        self.logits_hook: Callable[[list, torch.Tensor], None] | None = None
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB, %s on %s (reserved beside it: adapters "
                    "%.2f GiB, CUDA graphs %.0f MiB)", self.num_blocks, self.block_size, self.kv_cache_tokens,
                    self.kv_cache_bytes / 2**30, self.dtype, self.device, self.adapter_budget_bytes / 2**30,
                    self.graph_reserved_bytes / 2**20)

    def _load_model(self):
        """(model on this runner's device and dtype, its ModelConfig); a tensor-parallel runner loads its shard."""
        from loraplex.engine.loader import load_model

        c = self.config
        return load_model(c.model, device=self.device, dtype=self.dtype, load_format=c.load_format,
                          progress=c.progress)

    # ---- KV pool sizing -------------------------------------------------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this runner's cache: all of the model's (a tensor-parallel rank holds its share)."""
        return self.model_config.num_kv_heads

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def bytes_per_block(self) -> int:
        cfg: ModelConfig = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * self.num_kv_heads * cfg.head_dim * elem

    def _size_kv_pool(self, max_model_len: int, max_num_seqs: int) -> int:
        """KV blocks, and (with ``enable_lora``) ``adapter_budget_bytes``. On CUDA both come from one budget:

            total x gpu_memory_utilization - in use (weights) - activation headroom - CUDA-graph headroom
              = available;  adapters = adapter_memory_bytes or adapter_memory_fraction x available;
              KV pool = available - adapters

        fixed at start: KV blocks are never given to adapters nor adapters' memory to KV."""
        per_block = self.bytes_per_block
        blocks_per_seq = -(-max_model_len // self.block_size)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            available = int(total * self.config.gpu_memory_utilization) - (total - free)
            available -= self._activation_headroom_bytes() + self.graph_reserved_bytes
            self.adapter_budget_bytes = self._adapter_budget(available)
            if self.config.num_kv_blocks is not None:
                return self.config.num_kv_blocks
            budget = available - self.adapter_budget_bytes
            if budget < per_block * blocks_per_seq:
                raise RuntimeError(
                    f"not enough GPU memory for one sequence of {max_model_len} tokens: {budget / 2**30:.2f} GiB left "
                    f"for the KV cache after weights and {self.adapter_budget_bytes / 2**30:.2f} GiB for adapters; "
                    f"raise gpu_memory_utilization, lower max_model_len or the adapter memory budget")
            return budget // per_block
        self.adapter_budget_bytes = self._adapter_budget(None)
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            budget = min(CPU_KV_CACHE_CAP_BYTES, per_block * blocks_per_seq * max_num_seqs)
        num = budget // per_block
        if num < blocks_per_seq:
            raise ValueError(f"KV cache budget of {budget} bytes holds {num} blocks, fewer than one sequence of "
                             f"max_model_len={max_model_len} needs ({blocks_per_seq}); raise kv_cache_memory_bytes")
        return num

    def _size_swap_pool(self) -> int:
        """CPU blocks for swap preemption: ``num_cpu_blocks``, else ``swap_space_bytes`` (default: 1 GiB beside a
        CUDA cache, none on CPU, where recompute is the better trade)."""
        if self.config.num_cpu_blocks is not None:
            return self.config.num_cpu_blocks
        budget = self.config.swap_space_bytes
        if budget is None:
            budget = CUDA_SWAP_SPACE_BYTES if self.device.type == "cuda" else 0
        return budget // self.bytes_per_block

    def _activation_bytes_per_token(self) -> int:
        cfg = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        widest = max(cfg.q_size + 2 * cfg.kv_size, 2 * max(cfg.intermediate_size, cfg.moe_intermediate_size)
                     * max(1, cfg.num_experts_per_tok))
        return widest * elem * 4 + cfg.vocab_size * 4

    def _activation_headroom_bytes(self) -> int:
        return self.config.max_num_batched_tokens * self._activation_bytes_per_token() + (1 << 30)

    def _adapter_budget(self, available: int | None) -> int:
        """GPU bytes resident adapters may take (0 without ``enable_lora``): ``adapter_memory_bytes``, else
        ``adapter_memory_fraction`` of ``available`` (CUDA), else 256 MiB but at least four of the largest adapters
        this deployment accepts (CPU)."""
        c = self.config
        if not c.enable_lora:
            return 0
        if c.adapter_memory_bytes is not None:
            return c.adapter_memory_bytes
        if available is not None:
            return max(0, int(available * c.adapter_memory_fraction))
        from loraplex.engine.lora.slots import max_adapter_bytes

        return max(CPU_ADAPTER_MEMORY_BYTES, 4 * max_adapter_bytes(self.model, max_rank=c.max_lora_rank,
                                                                   dtype=self.dtype))

    def graphs_enabled(self) -> bool:
        """Decode steps replay CUDA graphs: CUDA, one rank (tensor-parallel workers receive each step in a forward
        pre-hook, which a graph replay would skip), and ``enforce_eager`` off."""
        c = self.config
        return (self.device.type == "cuda" and not getattr(c, "enforce_eager", False)
                and c.tensor_parallel_size == 1)

    def _graph_max_batch_size(self, max_num_seqs: int) -> int:
        """The largest decode batch with a graph: ``cuda_graph_max_batch_size`` (None: max_num_seqs), at most
        max_num_seqs."""
        cap = getattr(self.config, "cuda_graph_max_batch_size", None) or max_num_seqs
        return max(1, min(max_num_seqs, cap))

    def _graph_reserve_bytes(self, max_num_seqs: int) -> int:
        """Headroom for the graphs' private memory pools (each path's largest bucket's activations plus slack;
        the mixed steps' graphs hold no logits)."""
        if not self.graphs_enabled():
            return 0
        per_token = self._activation_bytes_per_token()
        decode = self._graph_max_batch_size(max_num_seqs) * per_token + (256 << 20)
        if not self.config.mixed_cuda_graphs:
            return decode
        # 72 graphs in one pool at GPT-OSS-20B took 1.7 GiB at 4096 tokens with an output per graph (about 2.4x one
        # forward's estimate); with one shared output buffer less (the reserve is left with that margin)
        logits = self.model_config.vocab_size * 4
        return decode + int(2.5 * self.config.max_num_batched_tokens * (per_token - logits)) + (256 << 20)

    # ---- CUDA graphs ----------------------------------------------------------------------------------------
    def init_decode_graphs(self, capture: bool | None = None) -> "DecodeGraphs | None":
        """Set up the padded decode path (call after ``init_lora``: graphs capture the LoRA kernels).

        ``capture=None``: graphs when ``graphs_enabled()``, else nothing (the plain eager path). ``capture=False``
        runs the padded static-buffer path eagerly (tests; any device). A failed capture logs a warning and leaves
        the eager path."""
        from loraplex.engine.cuda_graphs import DecodeGraphs

        if capture is None:
            if not self.graphs_enabled():
                if self.device.type == "cuda":
                    logger.info("CUDA graphs off (%s): decode steps run eagerly", "enforce_eager"
                                if getattr(self.config, "enforce_eager", False) else
                                f"tensor_parallel_size={self.config.tensor_parallel_size}")
                self.decode_graphs = None
                return None
            capture = True
        max_batch = self._graph_max_batch_size(self.max_num_seqs)
        graphs = DecodeGraphs(self, max_batch, self.max_model_len, capture=capture)
        if capture and not graphs.capture_all(getattr(self.config, "cuda_graph_capture_budget_s", None)):
            self.decode_graphs = None
            return None
        self.decode_graphs = graphs
        return graphs

    def init_mixed_graphs(self, capture: bool | None = None, granule: int | None = None) -> "MixedGraphs | None":
        """Set up the padded path of steps with prefill chunks (after ``init_lora``), buckets of up to
        ``max_num_batched_tokens`` tokens. ``capture=None``: graphs when ``graphs_enabled()`` and
        ``mixed_cuda_graphs``, else nothing (those steps run eagerly); ``capture=False`` runs the padded path
        eagerly (tests; any device). ``granule``: the bucket step (default mixed_graphs.DEFAULT_GRANULE). The graphs
        also give the residual stream entering ``mixed_aux_layer_ids`` (set by a proposer that reads it)."""
        from loraplex.engine.mixed_graphs import DEFAULT_GRANULE, MixedGraphs

        if capture is None:
            if not (self.graphs_enabled() and self.config.mixed_cuda_graphs):
                self.mixed_graphs = None
                return None
            capture = True
        graphs = MixedGraphs(self, self.config.max_num_batched_tokens, self.max_num_seqs, self.max_model_len,
                             capture=capture, granule=granule or DEFAULT_GRANULE,
                             aux_layer_ids=self.mixed_aux_layer_ids)
        if capture and not graphs.capture_all(getattr(self.config, "cuda_graph_capture_budget_s", None)):
            self.mixed_graphs = None
            return None
        self.mixed_graphs = graphs
        return graphs

    def warm_up_eager_steps(self) -> "WarmupReport | None":
        """Compile the eager steps' kernel variants now (``engine/eager_warmup.py``), within
        ``eager_warmup_budget_s``: CUDA and one rank only (elsewhere nothing compiles, or each rank would need the
        same dummy steps). Call at start, before any sequence holds KV blocks."""
        from loraplex.engine import eager_warmup

        budget = getattr(self.config, "eager_warmup_budget_s", 0.0)
        if not budget or self.device.type != "cuda" or self.config.tensor_parallel_size != 1:
            return None
        report = eager_warmup.run(self, budget_s=budget)
        logger.info("eager warm-up: %s", report.summary())
        return report

    @property
    def num_cuda_graphs(self) -> int:
        g = self.decode_graphs
        return g.num_graphs if g is not None else 0

    @property
    def cuda_graph_buckets(self) -> list[int]:
        g = self.decode_graphs
        return list(g.buckets) if g is not None and g.num_graphs else []

    @property
    def num_mixed_cuda_graphs(self) -> int:
        g = self.mixed_graphs
        return g.num_graphs if g is not None else 0

    # ---- one step -------------------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, pending: PendingTokens | None = None) -> StepInputs:
        """The eager step's inputs, built with a few array operations over all sequences (a mixed step of a prefill
        chunk and many decodes is host-bound: no per-sequence tensors here). ``pending``: the sampled tokens of the
        overlapped step in flight; a sequence whose input token is still pending takes it from them on the device.
        On CUDA the inputs go up from pinned memory, so building them never waits for the device."""
        scheduled = out.scheduled
        n = len(scheduled)
        ids, starts, counts, qsl = scheduled_tokens(scheduled)
        width = max(len(s.block_ids) for s in scheduled)
        block_tables = np.zeros((n, width), dtype=np.int32)
        for i, s in enumerate(scheduled):
            block_tables[i, :len(s.block_ids)] = s.block_ids
        positions, slot_mapping = token_slots(starts, counts, qsl, block_tables, self.block_size)
        seq_lens = (starts + counts).astype(np.int32)
        sample = [i for i, s in enumerate(scheduled) if s.sample]
        sample_rows = qsl[1:][sample] - 1
        dev = self.device
        pin = dev.type == "cuda"  # a pageable host->device copy can wait for the work already on the stream

        def to_dev(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a)
            return (t.pin_memory() if pin else t).to(dev, non_blocking=True)

        input_ids = torch.tensor(ids, dtype=torch.int64, pin_memory=pin).to(dev, non_blocking=True)
        src = self._pending_rows(scheduled, starts, counts, qsl, pending)
        if src is not None:  # rows whose token the step in flight samples: gathered from its tokens
            src_dev = to_dev(src)
            input_ids = torch.where(src_dev >= 0, pending.device_ids[src_dev.clamp(min=0)], input_ids)

        attn = AttentionMetadata(
            slot_mapping=to_dev(slot_mapping), block_tables=to_dev(block_tables), seq_lens=to_dev(seq_lens),
            query_start_loc=to_dev(qsl.astype(np.int32)), max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return StepInputs(
            input_ids=input_ids, positions=to_dev(positions), attn=attn,
            sample_rows=to_dev(sample_rows.astype(np.int64)), sample_seqs=[scheduled[i].seq for i in sample],
        )

    @staticmethod
    def _pending_rows(scheduled: list, starts: np.ndarray, counts: np.ndarray, qsl: np.ndarray,
                      pending: PendingTokens | None) -> np.ndarray | None:
        """[T] row of ``pending`` whose token is the input at each position (-1: known on the host), or None when
        no input is pending. A pending input without ``pending`` holding its sequence is an error."""
        src = None
        for i, s in enumerate(scheduled):
            seq = s.seq
            if not seq.num_pending_tokens:
                continue
            at = seq.num_tokens - 1  # the pending token is always the last
            if not starts[i] <= at < starts[i] + counts[i]:
                continue
            if pending is None or seq.seq_id not in pending.row_of:
                raise RuntimeError(f"sequence {seq.seq_id}'s input token is pending and no step in flight holds it")
            if src is None:
                src = np.full(int(qsl[-1]), -1, dtype=np.int64)
            src[qsl[i] + at - starts[i]] = pending.row_of[seq.seq_id]
        return src

    # ---- multi-LoRA -----------------------------------------------------------------------------------------
    def init_lora(self, *, max_rank: int, copier=None) -> "LoRASlots":
        """Attach multi-LoRA to the model, on this runner's device and dtype (adapters of up to ``max_rank``, up to
        ``max_num_seqs`` distinct ones per step). Returns the slots (for the AdapterManager);
        ``execute(..., lora_slots=...)`` then routes tokens to them. ``copier``: see ``LoRASlots``."""
        from loraplex.engine.lora.slots import LoRASlots

        self.lora = LoRASlots(self.model, self.model_config, max_rank=max_rank, max_step_slots=self.max_num_seqs,
                              device=self.device, dtype=self.dtype, copier=copier)
        self._recapture_after_lora()
        return self.lora

    def _recapture_after_lora(self) -> None:
        """Graphs captured before LoRA was attached lack its kernels: capture (or rebuild) them again."""
        if self.decode_graphs is not None:
            logger.info("LoRA attached after the decode path was set up: rebuilding it")
            self.init_decode_graphs(capture=self.decode_graphs.capture)
        if self.mixed_graphs is not None:
            logger.info("LoRA attached after the mixed-step path was set up: rebuilding it")
            self.init_mixed_graphs(capture=self.mixed_graphs.capture, granule=self.mixed_graphs.granule)

    def _set_lora_tokens(self, out: SchedulerOutput, lora_slots: dict[int, int] | None) -> None:
        """token_lora_idx [T] (-1 = base) in the step's token order, built once per step; None when no scheduled
        sequence has an adapter, so no layer does LoRA work."""
        used = self._check_lora_slots(out, lora_slots)
        if self.lora is None:
            return
        if not used:
            self.lora.set_token_slots(None)
            return
        idx = [lora_slots.get(s.seq.seq_id, -1) for s in out.scheduled]
        counts = [s.num_new_tokens for s in out.scheduled]
        self.lora.set_token_slots(torch.tensor(idx, dtype=torch.int32).repeat_interleave(torch.tensor(counts)))

    def _check_lora_slots(self, out: SchedulerOutput, lora_slots: dict[int, int] | None) -> bool:
        """Whether a scheduled sequence has an adapter; ValueError when it has one and LoRA is not attached."""
        used = lora_slots is not None and any(lora_slots.get(s.seq.seq_id, -1) >= 0 for s in out.scheduled)
        if used and self.lora is None:
            raise ValueError("execute() got adapter slots but LoRA is not attached; call init_lora() first")
        return used

    # ---- block moves ----------------------------------------------------------------------------------------
    def move_blocks(self, out: SchedulerOutput) -> None:
        """The step's block moves, before its forward pass: swap-outs, then swap-ins, then copy-on-write copies
        (all copies of the step in one ``copy_blocks`` call)."""
        if out.blocks_to_swap_out:
            self._copy_between(out.blocks_to_swap_out, self.kv_caches, self.cpu_kv_caches)
        if out.blocks_to_swap_in:
            self._copy_between(out.blocks_to_swap_in, self.cpu_kv_caches, self.kv_caches)
        if out.blocks_to_copy:
            ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches],
                            torch.tensor(out.blocks_to_copy, dtype=torch.int64, device=self.device))

    @staticmethod
    def _copy_between(pairs: list[tuple[int, int]], src_caches: list, dst_caches: list) -> None:
        """Copy block ``a`` of ``src_caches`` into block ``b`` of ``dst_caches`` for each (a, b), every layer."""
        if not dst_caches:
            raise RuntimeError("the scheduler moved blocks to a swap pool this runner does not have; set "
                               "num_cpu_blocks or swap_space_bytes")
        src_dev, dst_dev = src_caches[0][0].device, dst_caches[0][0].device
        src = torch.tensor([a for a, _ in pairs], dtype=torch.int64, device=src_dev)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=dst_dev)
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches):
            dk[dst] = sk[src].to(dst_dev)  # device -> host blocks: the data is on the host when this returns
            dv[dst] = sv[src].to(dst_dev)

    # ---- the step -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sampling: dict[int, tuple[SamplingParams, object]],
                lora_slots: dict[int, int] | None = None,
                token_bitmask: "TokenBitmask | None" = None, launched: EarlyStep | None = None) -> ModelStepOutput:
        """Run one step. ``sampling`` maps each sampling sequence id to its params and generator (None: unseeded;
        at a fork step a list of ``num_samples`` generators, one per future sequence); ``lora_slots`` maps
        sequence ids to the LoRA slot of their adapter (absent / None: base model); ``token_bitmask`` holds the
        grammar masks of constrained sequences. ``launched``: this step's forward, already enqueued by
        ``launch_eager`` for a schedule that may since have lost sequences (finished when the step in flight was
        read): their rows are dropped and the rest sampled."""
        result = ModelStepOutput()
        if launched is not None:
            if not out.scheduled or launched.logits is None:
                return result
            sampling_ids = {s.seq.seq_id for s in out.scheduled if s.sample}
            rows = [j for j, seq in enumerate(launched.sample_seqs) if seq.seq_id in sampling_ids]
            if not rows:
                return result
            sample_seqs = [launched.sample_seqs[j] for j in rows]
            logits = launched.logits if len(rows) == len(launched.sample_seqs) else launched.logits[rows]
            return self._sample_step(out, sampling, sample_seqs, logits, result, token_bitmask)
        self.move_blocks(out)
        if not out.scheduled:
            return result
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(out):
            self._check_lora_slots(out, lora_slots)
            hidden = graphs.run(out, lora_slots)  # [n, H]: one row per sequence, no prompt logprobs
            rows = [i for i, s in enumerate(out.scheduled) if s.sample]
            sample_seqs = [out.scheduled[i].seq for i in rows]
            # every row samples on a plain decode step: no index tensor (its pageable host->device copy would wait
            # for the replay) and no gather; hidden is the graph's output view, untouched until the next replay
            sample_rows = None if len(rows) == len(out.scheduled) else \
                torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        elif self.mixed_graphs is not None and self.mixed_graphs.can_run(out, lora_slots):
            self._check_lora_slots(out, lora_slots)
            hidden, sample_seqs, sample_rows = self._run_mixed(out, lora_slots, None)
        else:
            inputs = self.prepare(out)
            self._set_lora_tokens(out, lora_slots)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_caches)
            self._prompt_logprobs(out, hidden, result)
            sample_seqs, sample_rows = inputs.sample_seqs, inputs.sample_rows
        if not sample_seqs:
            return result
        logits = self.model.compute_logits(hidden if sample_rows is None else hidden[sample_rows])
        return self._sample_step(out, sampling, sample_seqs, logits, result, token_bitmask)

    def _sample_step(self, out: SchedulerOutput, sampling: dict, sample_seqs: list, logits: torch.Tensor,
                     result: ModelStepOutput, token_bitmask: "TokenBitmask | None") -> ModelStepOutput:
        """The sampling half of ``execute``: logits [N, V] of ``sample_seqs`` -> drawn tokens or beam rows."""
        if self.logits_hook is not None:
            self.logits_hook(sample_seqs, logits)
        by_id = {s.seq.seq_id: s for s in out.scheduled if s.sample}
        draw_rows, beam_rows = [], []
        for j, seq in enumerate(sample_seqs):
            (beam_rows if by_id[seq.seq_id].beam else draw_rows).append(j)
        if beam_rows:
            seqs = [sample_seqs[j] for j in beam_rows]
            rows = self.sampler.beam_logprobs(logits[beam_rows], [sampling[s.seq_id][0] for s in seqs], seqs)
            for k, seq in enumerate(seqs):
                result.beam_logprobs[seq.seq_id] = rows[k]
        if draw_rows:
            self._draw(logits, draw_rows, sample_seqs, by_id, sampling, result, token_bitmask)
        return result

    def can_launch_early(self, out: SchedulerOutput) -> bool:
        """Whether ``out`` may be enqueued by ``launch_eager`` before the overlapped step in flight is read back: it
        runs the eager path (not the padded decode path), moves no blocks and asks for no prompt logprobs (their
        rows are read by the schedule as it was, which the read-back may change)."""
        if not out.scheduled or out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy:
            return False
        if self.decode_graphs is not None and self.decode_graphs.can_run(out):
            return False
        return all(s.prompt_logprobs is None for s in out.scheduled)

    @torch.inference_mode()
    def launch_eager(self, out: SchedulerOutput, lora_slots: dict[int, int] | None,
                     pending: PendingTokens) -> EarlyStep:
        """Enqueue an eager step's forward and its sampled rows' logits while the overlapped step in flight still
        runs (``can_launch_early``): inputs whose token that step samples are gathered from ``pending`` on the
        device, nothing is read back; ``execute(..., launched=...)`` samples it once the step in flight is read."""
        self._check_lora_slots(out, lora_slots)
        if self.mixed_graphs is not None and self.mixed_graphs.can_run(out, lora_slots):
            hidden, sample_seqs, sample_rows = self._run_mixed(out, lora_slots, pending)
        else:
            inputs = self.prepare(out, pending)
            self._set_lora_tokens(out, lora_slots)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_caches)
            sample_seqs, sample_rows = inputs.sample_seqs, inputs.sample_rows
        logits = self.model.compute_logits(hidden[sample_rows]) if sample_seqs else None
        return EarlyStep(sample_seqs, logits)

    def _run_mixed(self, out: SchedulerOutput, lora_slots: dict[int, int] | None, pending: PendingTokens | None
                   ) -> tuple[torch.Tensor, list, torch.Tensor]:
        """A step on the mixed-step path: (hidden [T, H], the sampling sequences, their rows on the device)."""
        hidden, qsl = self.mixed_graphs.run(out, lora_slots, pending)
        sample = [i for i, s in enumerate(out.scheduled) if s.sample]
        rows = torch.from_numpy(qsl[1:][sample] - 1)
        if self.device.type == "cuda":
            rows = rows.pin_memory()
        return hidden, [out.scheduled[i].seq for i in sample], rows.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def launch_decode(self, out: SchedulerOutput, sampling: dict[int, tuple[SamplingParams, object]],
                      lora_slots: dict[int, int] | None = None, prev: PendingTokens | None = None,
                      token_bitmask: "TokenBitmask | None" = None) -> PendingTokens:
        """Launch one overlappable decode step (``step_pipeline.can_overlap``) and return without waiting for it:
        the padded decode path, rows whose input token is pending taking it from ``prev`` on the device, then
        logits and sampling on the device. ``sampling``: as in ``execute`` (one generator per sequence)."""
        logits = self.launch_forward(out, lora_slots, prev)
        return self.sample_launched(out, sampling, logits, token_bitmask)

    @torch.inference_mode()
    def launch_forward(self, out: SchedulerOutput, lora_slots: dict[int, int] | None = None,
                       prev: PendingTokens | None = None) -> torch.Tensor:
        """The forward half of ``launch_decode``: enqueue the padded decode step and its logits [n, V] (one row
        per scheduled sequence); nothing is read back."""
        self._check_lora_slots(out, lora_slots)
        pending = (prev.device_ids, prev.row_of) if prev is not None else None
        hidden = self.decode_graphs.run(out, lora_slots, pending)  # [n, H]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def sample_launched(self, out: SchedulerOutput, sampling: dict[int, tuple[SamplingParams, object]],
                        logits: torch.Tensor, token_bitmask: "TokenBitmask | None" = None) -> PendingTokens:
        """The sampling half of ``launch_decode``: enqueue sampling of ``launch_forward``'s logits (with the grammar
        masks, uploaded without a host sync) and the tokens' copy to the host."""
        seqs = [s.seq for s in out.scheduled]
        mask = token_bitmask.rows_for([s.seq_id for s in seqs], self.device) if token_bitmask is not None else None
        tokens = self.sampler.choose(logits, [sampling[s.seq_id][0] for s in seqs],
                                     [sampling[s.seq_id][1] for s in seqs], token_bitmask=mask)
        return PendingTokens([s.seq_id for s in seqs], tokens)

    def _draw(self, logits: torch.Tensor, rows: list[int], seqs: list, by_id: dict, sampling: dict,
              result: ModelStepOutput, token_bitmask: "TokenBitmask | None" = None) -> None:
        """Sample the drawing rows; a fork row is repeated ``num_samples`` times, one generator per copy (and its
        grammar mask row with it)."""
        index, params, gens, hist, owners = [], [], [], [], []
        for j in rows:
            seq = seqs[j]
            p, g = sampling[seq.seq_id]
            k = by_id[seq.seq_id].num_samples
            g_list = list(g) if isinstance(g, (list, tuple)) else [g] * k
            if len(g_list) != k:
                raise ValueError(f"sequence {seq.seq_id} draws {k} tokens but got {len(g_list)} generators")
            index += [j] * k
            params += [p] * k
            gens += g_list
            hist += [seq] * k
            owners += [seq.seq_id] * k
        # every row drawn once, in order (no fork, no beam): the logits as they are, no gather (on CUDA a gather by
        # a Python list also copies the index to the device, which waits for the step's kernels)
        rows_logits = logits if index == list(range(logits.shape[0])) else logits[index]
        mask = token_bitmask.rows_for(owners, self.device) if token_bitmask is not None else None
        sampled = self.sampler.forward(rows_logits, params, gens, hist, token_bitmask=mask)
        for seq_id, token, entry in zip(owners, sampled.token_ids, sampled.logprobs):
            result.sampled.setdefault(seq_id, []).append(token)
            result.logprobs.setdefault(seq_id, []).append(entry)

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor, result: ModelStepOutput) -> None:
        """Logprobs of the prompt tokens predicted inside this step's chunks, for sequences that ask."""
        offset = 0
        for s in out.scheduled:
            if s.prompt_logprobs is not None:
                seq, start = s.seq, s.seq.num_computed_tokens
                rows = max(0, min(start + s.num_new_tokens, seq.num_prompt_tokens - 1) - start)
                logits = self.model.compute_logits(hidden[offset:offset + rows])
                result.prompt_logprobs[seq.seq_id] = (start, prompt_logprobs(logits, seq.prompt_token_ids,
                                                                             s.prompt_logprobs, start))
            offset += s.num_new_tokens

    def make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g
