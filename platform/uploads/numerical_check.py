"""Upload-time numerical check: the engine's own conversion of an adapter must compute what PEFT computes.

    report = check_conversion(weights_path, config_dict, header, spec, model)   # raises UploadError 422

After validation (``validate.py``), every module of the adapter goes through the engine's loader conversion
(``loraplex.engine.lora.weights.converted_modules``: what ``load_adapter_weights`` gives an engine, scaling folded
into B, experts un-flattened to [E, r, K] / [E, N, r], GPT-OSS gate/up de-interleaved), is zero-padded to the
adapter's largest rank (rounded up to a multiple of 4) in a one-slot stacked layout (lora_a [1, 1, R, K] /
[1, E, R, K], lora_b [1, N, R] / [1, E, N, R]), and applied by the engine's LoRA ops -- the torch references of ``kernels/reference_lora.py`` that
the engine's CPU path runs (``lora_shrink_expand``, ``fused_moe_lora``) -- to a few random inputs per module
(every expert of an expert target gets its own). The result is compared with PEFT's delta of the same module
computed from the raw files by ``peft_reference.py`` (a separate implementation of PEFT's rules, float64):

    per module (and per expert):  max |engine - PEFT|  <=  RTOL * max(max |PEFT|, max |engine|)
                                                          + ROUNDING * max(|x| |A|^T |B|^T)

The second term is float32's rounding of the products summed: where a random input happens to be nearly
orthogonal to a low-rank A (likely for some expert among thousands at rank 1), the delta itself is tiny while
its rounding error is not, and a bound on the delta alone would refuse a correct adapter. A layout bug's error is
of the order of the delta, which is at least about max(|x| |A|^T |B|^T) / sqrt(K r) (1/900 at K = 2880, r = 256),
far above ROUNDING.

Rows are compared in the engine's order: a fused ``gate_up_proj`` is [gate rows; up rows] in the engine (the base
weights' layout its kernels split in halves), so PEFT's columns are taken as (gate, up) of the Hugging Face module
(``gate_up_columns``). A module PEFT applies but the engine does not serve, or the reverse, is compared against a
zero delta. A mismatch refuses the upload: ``UploadError(422, code="conversion_mismatch")`` naming the layer, the
module (and the expert) and the two magnitudes. CPU only, float32 on the engine side, no base model weights, no
forward pass: the cost is reading the adapter once more and a few small matrix products per module.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora.format import AdapterSpec, SafetensorsHeader
from loraplex.platform.uploads.errors import UploadError
from loraplex.platform.uploads.peft_reference import (PeftModule, gate_up_columns, peft_delta, peft_modules,
                                                       read_tensor)

logger = logging.getLogger(__name__)
RTOL = 1e-3             # float32 conversion vs a float64 reference: errors are ~1e-6; any layout bug is ~1
ROUNDING = 1e-5         # of |x| |A|^T |B|^T: float32 sums of K = 2880 random-sign terms round to ~3e-6 of it
TOKENS_PER_MODULE = 4   # random inputs per plain module
TOKENS_PER_EXPERT = 1   # random inputs per expert of a fused-expert target (one random vector probes the whole map)
SLOT_RANK_MULTIPLE = 4  # slots' rank padded to a multiple of 4 float32s: the LoRA ops want 16-byte-aligned slots


@dataclass(frozen=True)
class CheckReport:
    """What the check compared: modules, (module, expert) comparisons, the largest relative error, seconds."""

    modules: int
    comparisons: int
    worst_relative_error: float
    seconds: float


def check_conversion(weights_path: str, config: dict[str, Any], header: SafetensorsHeader, spec: AdapterSpec,
                     model: ModelConfig, *, seed: int | None = None) -> CheckReport:
    """Compares the engine's converted weights of every module with PEFT's; ``seed`` for the random inputs
    (default: from the file's header, so a given adapter always gets the same inputs)."""
    from loraplex.engine.lora.weights import converted_modules

    start = time.perf_counter()
    try:
        reference = {(m.layer, m.target): m for m in peft_modules(config, {n: t.shape for n, t in
                                                                          header.tensors.items()}, model)}
    except ValueError as e:
        raise UploadError(422, f"PEFT could not load this adapter onto the base model: {e}",
                          code="conversion_mismatch") from None
    if seed is None:
        seed = int.from_bytes(hashlib.blake2b(repr(sorted(header.tensors)).encode(), digest_size=4).digest(), "big")
    gen = torch.Generator().manual_seed(seed)
    worst, comparisons, served = 0.0, 0, set()
    def read(name: str) -> torch.Tensor:
        t = header.tensors[name]
        return read_tensor(f, t.dtype, t.shape, t.begin, t.end)

    with open(weights_path, "rb") as f:
        for mod, tensors in converted_modules(weights_path, spec, model, dtype=torch.float32):
            where = (mod.layer, mod.target)
            served.add(where)
            ref = reference.get(where)
            raw = (read(ref.lora_a), read(ref.lora_b)) if ref is not None else None
            for expert, engine_out, peft_out, bound in _deltas(mod.target, mod.in_features, tensors, spec.rank, ref,
                                                                raw, model, gen):
                worst = max(worst, _compare(where, expert, engine_out, peft_out, ref, bound))
                comparisons += 1
        for where, ref in sorted(reference.items()):
            if where in served or not ref.applied:
                continue
            a, b = read(ref.lora_a), read(ref.lora_b)
            shape = (ref.num_experts, TOKENS_PER_EXPERT) if ref.num_experts else (TOKENS_PER_MODULE,)
            peft_out = peft_delta(ref, a, b, torch.randn(*shape, a.shape[-1], generator=gen))  # vs no delta: no bound
            for expert, rows in (enumerate(peft_out) if ref.num_experts else ((None, peft_out),)):
                _compare(where, expert, torch.zeros_like(rows), rows, ref)
                comparisons += 1
    report = CheckReport(modules=len(served | set(reference)), comparisons=comparisons, worst_relative_error=worst,
                         seconds=time.perf_counter() - start)
    logger.info("numerical check: %d modules, %d comparisons, worst relative error %.2e, %.3f s", report.modules,
                report.comparisons, report.worst_relative_error, report.seconds)
    return report


def _deltas(target: str, fan_in: int, tensors, max_rank: int, ref: PeftModule | None, raw, model: ModelConfig,
            gen: torch.Generator):
    """(expert or None, engine delta [T, N] float32, PEFT delta [T, N] float64 in the engine's row order, the
    largest entry of |x| |A|^T |B|^T: the scale of the delta's rounding)."""
    from loraplex.kernels.reference_lora import fused_moe_lora, lora_shrink_expand

    a, b = tensors.lora_a, tensors.lora_b
    r = a.shape[-2]
    rank = -(-max_rank // SLOT_RANK_MULTIPLE) * SLOT_RANK_MULTIPLE   # zero-padded, as a slot of the stacked layout
    if a.dim() == 2:                                                  # plain: [r, K] / [N, r]
        lora_a = torch.zeros(1, 1, rank, fan_in)                      # [S=1, L=1, R, K]
        lora_b = torch.zeros(1, b.shape[0], rank)                     # [L=1, N, R]
        lora_a[0, 0, :r], lora_b[0, :, :r] = a, b
        x = probe_inputs((TOKENS_PER_MODULE,), a, gen)
        y = torch.zeros(x.shape[0], b.shape[0])
        lora_shrink_expand(y, x, lora_a, lora_b, torch.zeros(x.shape[0], dtype=torch.int32), torch.ones(1),
                           (b.shape[0],))
        yield None, y, _peft_rows(ref, raw, x, target, b.shape[0], model), _rounding_scale(x, a, b)
        return
    num_experts = a.shape[0]                                          # experts: [E, r, K] / [E, N, r]
    lora_a = torch.zeros(1, num_experts, rank, fan_in)                # [L=1, E, R, K]
    lora_b = torch.zeros(1, num_experts, b.shape[1], rank)            # [L=1, E, N, R]
    lora_a[0, :, :r], lora_b[0, :, :, :r] = a, b
    x = probe_inputs((num_experts, TOKENS_PER_EXPERT), a, gen)
    flat = x.reshape(-1, fan_in)
    topk_ids = torch.arange(num_experts).repeat_interleave(TOKENS_PER_EXPERT)[:, None]    # [T, A=1]
    y = torch.zeros(flat.shape[0], b.shape[1])
    fused_moe_lora(y, flat, lora_a, lora_b, topk_ids, torch.zeros(flat.shape[0], dtype=torch.int32), torch.ones(1))
    peft_out = _peft_rows(ref, raw, x, target, b.shape[1], model)     # [E, T, N]
    for e in range(num_experts):
        yield (e, y[e * TOKENS_PER_EXPERT:(e + 1) * TOKENS_PER_EXPERT], peft_out[e],
               _rounding_scale(x[e], a[e], b[e]))


def probe_inputs(shape: tuple[int, ...], lora_a: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The random inputs [*shape, K] a module (or each expert: shape [E, T]) is probed with; ``lora_a`` [r, K] or
    [E, r, K] is what they multiply (unused here: the inputs are plain normal draws)."""
    return torch.randn(*shape, lora_a.shape[-1], generator=gen)


def _rounding_scale(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """max of |x| |A|^T |B|^T (x [T, K], A [r, K], B [N, r]): what float32 rounds the delta's sums against."""
    if not x.numel() or not b.numel():
        return 0.0
    return ((x.double().abs() @ a.double().abs().T) @ b.double().abs().T).max().item()


def _peft_rows(ref: PeftModule | None, raw, x: torch.Tensor, target: str, width: int,
               model: ModelConfig) -> torch.Tensor:
    if ref is None:   # the engine serves a module PEFT has no tensors for: PEFT adds nothing there
        return torch.zeros(*x.shape[:-1], width, dtype=torch.float64)
    out = peft_delta(ref, raw[0], raw[1], x)
    if target == "mlp.experts.gate_up_proj" and ref.applied:
        gate, up = gate_up_columns(model.family, out.shape[-1])
        out = out[..., torch.cat((gate, up))]     # the engine's [gate; up] rows
    return out


def _compare(where: tuple[int, str], expert: int | None, engine_out: torch.Tensor, peft_out: torch.Tensor,
             ref: PeftModule | None, bound: float = 0.0) -> float:
    """The error relative to the delta's scale (or to its rounding scale ``bound`` where that allows more);
    raises the 422 past the tolerance (module docstring)."""
    layer, target = where
    engine_out = engine_out.double()
    if engine_out.shape != peft_out.shape:
        raise _mismatch(layer, target, expert, f"the engine's delta has shape {list(engine_out.shape)} where PEFT's "
                                               f"has {list(peft_out.shape)}")
    err = (engine_out - peft_out).abs().max().item() if peft_out.numel() else 0.0
    scale = max(peft_out.abs().max().item(), engine_out.abs().max().item()) if peft_out.numel() else 0.0
    allowed = RTOL * scale + ROUNDING * bound
    if err <= allowed + 1e-30:
        return err / (allowed / RTOL) if allowed else 0.0
    if ref is not None and not ref.applied:
        detail = f"PEFT applies no delta there ({ref.why}) but the engine would add one of magnitude {scale:.3g}"
    elif ref is None:
        detail = f"PEFT has no tensors for it but the engine would add a delta of magnitude {scale:.3g}"
    else:
        detail = (f"the engine's delta differs from PEFT's by up to {err:.3g} (PEFT's largest value "
                  f"{peft_out.abs().max().item():.3g}, the engine's {engine_out.abs().max().item():.3g})")
    raise _mismatch(layer, target, expert, detail)


def _mismatch(layer: int, target: str, expert: int | None, detail: str) -> UploadError:
    what = f"{target} of layer {layer}" + (f" (expert {expert})" if expert is not None else "")
    return UploadError(422, f"conversion check failed for {what}: {detail}. The engine would serve this adapter "
                            "differently from PEFT; it was not stored. This is a loraplex bug, not a problem with "
                            "the adapter: report it with the adapter's adapter_config.json",
                       code="conversion_mismatch")
