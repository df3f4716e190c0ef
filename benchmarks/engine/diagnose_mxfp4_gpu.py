"""Where the engine and transformers + PEFT part on tiny GPT-OSS MXFP4 checkpoints (float32): one run that bisects.

The checkpoints, adapters and requests of ``check_mxfp4_checkpoint.py`` stage "tiny" (single file; sharded with
E4 H96 I64), 6 requests (a4, base, a8, a4, base, a8). Every engine variant's greedy tokens are scored against every
transformers variant by one teacher-forced forward per request (greedy agreement, worst relative logits error
max|d| / max|ref|), per request, so base and adapter requests are seen apart:

    engine variants          cpu (torch references) | cuda (the CUDA defaults: graphs; the logits hook keeps steps
                             synchronous) | cuda-overlap (no hook: tokens only) | cuda-eager (no graphs, no overlap)
                             | cuda-eager-ckpt-layout (MXFP4 codes as stored, not repacked for the GEMMs)
                             | cuda-eager-ref-kernels (LORAPLEX_KERNELS=reference: the torch references on CUDA)
    transformers variants    cpu, cuda: as transformers' loader leaves it (Mxfp4Config(dequantize=True), float32
                             asked, eager attention) | cpu-fp32, cuda-fp32: the check's reference (its ``hf_model``:
                             the same, then every parameter upcast to float32)

Facts recorded beside: versions, the dtypes and experts implementation transformers gives the dequantised model,
whether its expert weights equal the checkpoint's codes decoded exactly, and transformers on CUDA against
transformers on CPU on the same tokens. For the first request some CUDA variant gets wrong, a layer probe runs
that request's tokens through one prefill (no paging effects: a fresh eager engine, prefix caching off) on the
engine (CUDA and CPU) and through transformers (CUDA and CPU) with hooks, and reports per layer the relative
differences of the attention output, the router logits (and top-k choices, with transformers' smallest top-k
margin: a near tie), the MoE output and the layer output, then the logits.

    PYTHONPATH=$PWD python3 benchmarks/engine/diagnose_mxfp4_gpu.py                    # H200: ~60-100 s
    PYTHONPATH=$PWD python3 benchmarks/engine/diagnose_mxfp4_gpu.py --device cpu --cases single --new-tokens 6
Writes $OUT/diagnose_mxfp4_gpu.json (OUT defaults to .); prints the matrix, the probe and a verdict last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

from check_mxfp4_checkpoint import TINY_CASES, hf_model, make_adapter, tiny_requests  # noqa: E402

ENGINE_VARIANTS = {  # name: (device, engine kwargs, logits hook, MXFP4 kernel layout allowed, LORAPLEX_KERNELS)
    "cpu": ("cpu", {}, True, True, "auto"),
    "cuda": ("cuda", {}, True, True, "auto"),
    "cuda-overlap": ("cuda", {}, False, True, "auto"),
    "cuda-eager": ("cuda", dict(enforce_eager=True, async_scheduling=False), True, True, "auto"),
    "cuda-eager-ckpt-layout": ("cuda", dict(enforce_eager=True, async_scheduling=False), True, False, "auto"),
    "cuda-eager-ref-kernels": ("cuda", dict(enforce_eager=True, async_scheduling=False), True, True, "reference"),
}
HF_VARIANTS = {"cpu": ("cpu", False), "cuda": ("cuda", False), "cpu-fp32": ("cpu", True),
               "cuda-fp32": ("cuda", True)}  # name: (device, upcast to float32 as the check's hf_model does)


def rel(a, b) -> float:
    """max |a - b| / max |b| (float64, on the CPU)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---- transformers ---------------------------------------------------------------------------------------------
def hf_load(base: str, device: str, adapter: str | None, fp32: bool):
    """``fp32``: the check's reference (``check_mxfp4_checkpoint.hf_model``: every parameter upcast to float32);
    else transformers (+ PEFT) exactly as its loader leaves it (``Mxfp4Config(dequantize=True)``, float32 asked,
    eager attention)."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    if fp32:
        return hf_model(base, device, adapter)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager",
                                                 quantization_config=Mxfp4Config(dequantize=True))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.to(device).eval()


def hf_inner(model):
    """The transformers CausalLM inside a PeftModel (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def hf_facts(base: str) -> dict:
    """What transformers makes of the checkpoint: versions, dtypes, experts implementation, and its dequantised
    expert weights and biases against the checkpoint's codes decoded by the engine's exact decoder."""
    import peft
    import torch
    import transformers
    from safetensors.torch import load_file

    from loraplex.engine.quantization.mxfp4_checkpoint import merge_blocks
    from loraplex.kernels.mxfp4 import dequantize_mxfp4

    model = hf_load(base, "cpu", None, False)
    tensors = {}
    for f in sorted(os.listdir(base)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(base, f)))
    weight_err, bias_err = 0.0, 0.0
    for i, layer in enumerate(model.model.layers):
        ex, p = layer.mlp.experts, f"model.layers.{i}.mlp.experts"
        for proj in ("gate_up_proj", "down_proj"):
            want = dequantize_mxfp4(merge_blocks(tensors[f"{p}.{proj}_blocks"]), tensors[f"{p}.{proj}_scales"])
            got = getattr(ex, proj).detach().float().transpose(1, 2)  # transformers: [E, K, N]
            weight_err = max(weight_err, float((got - want).abs().max()))
            bias_err = max(bias_err, float((getattr(ex, f"{proj}_bias").detach().float()
                                            - tensors[f"{p}.{proj}_bias"].float()).abs().max()))
    ex = model.model.layers[0].mlp.experts
    return dict(transformers=transformers.__version__, torch=torch.__version__, peft=peft.__version__,
                experts_class=type(ex).__name__,
                experts_implementation=getattr(model.config, "_experts_implementation", None),
                expert_param_dtypes={n: str(t.dtype) for n, t in ex.named_parameters()},
                param_dtypes=sorted({str(t.dtype) for t in model.parameters()}),
                quantizer=type(getattr(model, "hf_quantizer", None)).__name__,
                expert_weights_vs_codes_max_abs=weight_err, expert_bias_vs_file_max_abs=bias_err)


def hf_logits(model, prompt: list[int], tokens: list[int]):
    """Teacher-forced logits [len(tokens), V] (float32, CPU) at the generated positions, as the check computes."""
    import torch

    dev = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens[:-1]], device=dev)
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(prompt) - 1:].float().cpu()


# ---- engine -----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def engine_setting(kernel_layout: bool, kernels: str):
    """MXFP4 kernel layout off (codes as stored) and/or LORAPLEX_KERNELS for the duration."""
    from loraplex.engine.quantization.mxfp4_experts import Mxfp4FusedExperts

    saved_layout, saved_env = Mxfp4FusedExperts.use_kernel_layout, os.environ.get("LORAPLEX_KERNELS")
    if not kernel_layout:
        Mxfp4FusedExperts.use_kernel_layout = lambda self: False
    os.environ["LORAPLEX_KERNELS"] = kernels
    try:
        yield
    finally:
        Mxfp4FusedExperts.use_kernel_layout = saved_layout
        if saved_env is None:
            os.environ.pop("LORAPLEX_KERNELS", None)
        else:
            os.environ["LORAPLEX_KERNELS"] = saved_env


def make_engine(base: str, device: str, cache: str, **kw):
    from loraplex.engine import LLMEngine

    return LLMEngine.from_pretrained(base, device=device, dtype="float32", block_size=4, max_num_seqs=8,
                                     max_num_batched_tokens=64, num_kv_blocks=512, progress=False, enable_lora=True,
                                     max_loras=2, max_lora_rank=8, adapter_cache_dir=cache, **kw)


def adapter_ref(folders: dict, name: str | None):
    from loraplex.engine.lora.ref import AdapterRef

    return AdapterRef(f"t/{name}/1", f"file://{folders[name]}") if name else None


def run_engine(variant: str, base: str, folders: dict, requests: list, new_tokens: int, tmp: str) -> dict:
    """One engine variant over the requests: tokens and (with the hook) logits rows per request id."""
    import torch

    from loraplex.engine import SamplingParams
    from loraplex.engine.quantization import Mxfp4FusedExperts

    device, kw, hook, layout, kernels = ENGINE_VARIANTS[variant]
    with engine_setting(layout, kernels):
        t0 = time.perf_counter()
        engine = make_engine(base, device, os.path.join(tmp, f"cache-{variant}"), **kw)
        logits: dict[str, list] = {}
        if hook:
            engine.runner.logits_hook = lambda seqs, lg: [logits.setdefault(s.request_id, []).append(
                lg[j].float().cpu()) for j, s in enumerate(seqs)]
        for rid, name, prompt in requests:
            engine.add_request(rid, prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                               adapter=adapter_ref(folders, name))
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.output_token_ids)
        experts = [getattr(layer.mlp.experts, "base", layer.mlp.experts) for layer in engine.runner.model.model.layers]
        g = engine.runner.decode_graphs
        info = dict(seconds=round(time.perf_counter() - t0, 1), graph_replays=g.num_steps if g is not None else 0,
                    overlapped_steps=engine.num_overlapped_steps,
                    mxfp4_experts=all(isinstance(m, Mxfp4FusedExperts) for m in experts),
                    kernel_layout=all(getattr(m, "in_kernel_layout", False) for m in experts))
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(tokens=tokens, logits={k: torch.stack(v) for k, v in logits.items()}, info=info)


# ---- the layer probe ------------------------------------------------------------------------------------------
def _capture(cap: dict, key, t, n: int) -> None:
    if t.shape[0] == n and key not in cap:  # the prefill of the probe's n tokens only
        cap[key] = t.detach().float().cpu().clone()


def engine_probe(base: str, folders: dict, name: str | None, ids: list[int], device: str, tmp: str) -> dict:
    """One prefill of ``ids`` by a fresh eager engine (prefix caching off): per layer the attention output, router
    logits, MoE output and layer output (h + residual), the final norm's output and the logits, [T, ...] each."""
    import torch

    from loraplex.engine import SamplingParams

    kw = dict(enforce_eager=True, enable_prefix_caching=False)
    if device == "cuda":
        kw["async_scheduling"] = False
    engine = make_engine(base, device, os.path.join(tmp, f"cache-probe-{device}"), **kw)
    model, n, cap = engine.runner.model, len(ids), {}
    handles = []
    def router_logits(moe, args, kwargs):
        """The logits the MoE block routes by: computed with the norm before it (its ``router_logits``) or by its
        router (which then runs once more here, on the same input)."""
        logits = kwargs.get("router_logits")
        return logits if logits is not None else moe.router_layer(args[0])

    for i, layer in enumerate(model.model.layers):
        handles += [
            layer.self_attn.register_forward_hook(lambda m, a, o, i=i: _capture(cap, ("attn", i), o, n)),
            layer.mlp.register_forward_pre_hook(
                lambda m, a, kw, i=i: _capture(cap, ("router", i), router_logits(m, a, kw), n), with_kwargs=True),
            layer.mlp.register_forward_hook(lambda m, a, o, i=i: _capture(cap, ("moe", i), o, n)),
            layer.register_forward_hook(lambda m, a, o, i=i: _capture(cap, ("layer", i), o[0] + o[1], n))]
    handles.append(model.model.norm.register_forward_hook(lambda m, a, o: _capture(cap, ("norm", 0), o[0], n)))
    engine.add_request("probe", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                       adapter=adapter_ref(folders, name))
    while engine.has_unfinished_requests():
        engine.step()
    for h in handles:
        h.remove()
    with torch.no_grad():
        cap[("logits", 0)] = model.compute_logits(cap[("norm", 0)].to(engine.runner.device)).float().cpu()
    del engine
    return cap


def hf_probe(model, ids: list[int]) -> dict:
    """The same quantities from transformers (hooks on its decoder layers, attention, router and MoE block)."""
    import torch

    inner, n, cap = hf_inner(model), len(ids), {}

    def first(o):
        return o[0] if isinstance(o, (tuple, list)) else o

    handles = []
    for i, layer in enumerate(inner.model.layers):
        handles += [
            layer.self_attn.register_forward_hook(lambda m, a, o, i=i: _capture(cap, ("attn", i), first(o)[0], n)),
            layer.mlp.router.register_forward_hook(lambda m, a, o, i=i: _capture(cap, ("router", i), first(o), n)),
            layer.mlp.register_forward_hook(lambda m, a, o, i=i: _capture(cap, ("moe", i), first(o)[0], n)),
            layer.register_forward_hook(lambda m, a, o, i=i: _capture(cap, ("layer", i), first(o)[0], n))]
    dev = next(model.parameters()).device
    with torch.no_grad():
        cap[("logits", 0)] = model(input_ids=torch.tensor([ids], device=dev)).logits[0].float().cpu()
    for h in handles:
        h.remove()
    return cap


def compare_probes(got: dict, want: dict, top_k: int) -> list[dict]:
    """Per layer: relative differences, tokens whose router top-k sets differ, ``want``'s smallest top-k margin."""
    rows = []
    layers = sorted({i for kind, i in want if kind == "layer"})
    for i in layers:
        row = dict(layer=i)
        for kind in ("attn", "router", "moe", "layer"):
            if (kind, i) in got and (kind, i) in want:
                row["out" if kind == "layer" else kind] = rel(got[(kind, i)], want[(kind, i)])
        if ("router", i) in got and ("router", i) in want:
            g, w = got[("router", i)], want[("router", i)]
            gs, ws = g.topk(top_k, -1).indices.sort(-1).values, w.topk(top_k, -1).indices.sort(-1).values
            row["topk_mismatch_tokens"] = int((gs != ws).any(-1).sum())
            top = w.topk(min(top_k + 1, w.shape[-1]), -1).values
            row["min_topk_margin"] = float((top[:, top_k - 1] - top[:, top_k]).min()) if top.shape[-1] > top_k \
                else None
        rows.append(row)
    rows.append(dict(layer="logits", logits=rel(got[("logits", 0)], want[("logits", 0)]),
                     argmax_differs=int((got[("logits", 0)].argmax(-1) != want[("logits", 0)].argmax(-1)).sum())))
    return rows


# ---- one case -------------------------------------------------------------------------------------------------
def score(tokens: list[int], logits, ref) -> dict:
    """Greedy agreement and the relative logits error per step of one request against one reference."""
    ref_tokens = ref.argmax(-1).tolist()
    first_diff = next((j for j, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    out = dict(agree=ref_tokens == tokens, first_token_diff=first_diff)
    if logits is not None:
        err = (logits - ref).abs().amax(-1) / ref.abs().amax(-1)
        bad = (err > 1e-4).nonzero().flatten()
        out.update(worst_rel_err=float(err.max()), first_step_over_1e4=int(bad[0]) if len(bad) else None)
    return out


def run_case(case: str, args, tmp: str, deadline: float) -> dict:
    import torch

    from loraplex.engine.testing.tiny import make_tiny_mxfp4_checkpoint

    overrides, shard = TINY_CASES[case]
    base = make_tiny_mxfp4_checkpoint(os.path.join(tmp, case), max_shard_size=shard, **overrides)
    folders = {"a4": make_adapter(base, os.path.join(tmp, f"{case}-a4"), 4, 1),
               "a8": make_adapter(base, os.path.join(tmp, f"{case}-a8"), 8, 2)}
    requests = tiny_requests()
    res = dict(case=case, requests=[dict(id=r, adapter=n, prompt_len=len(p)) for r, n, p in requests],
               hf_facts=hf_facts(base), engines={}, skipped=[])
    devices = {"cpu"} | ({"cuda"} if args.device == "cuda" else set())
    engine_runs = {}
    for variant in args.engine_variants.split(","):
        if ENGINE_VARIANTS[variant][0] not in devices:
            continue
        if time.perf_counter() > deadline:
            res["skipped"].append(f"engine {variant}: over --budget-s")
            continue
        try:
            engine_runs[variant] = run_engine(variant, base, folders, requests, args.new_tokens, tmp)
        except Exception as e:  # noqa: BLE001 - one variant's failure is a finding; the others still run
            traceback.print_exc()
            res["engines"][variant] = dict(error=f"{type(e).__name__}: {e}")
    hf = {}  # (variant, adapter name) -> model
    for hv, (dev, fp32) in HF_VARIANTS.items():
        if dev in devices:
            for name in ("a4", None, "a8"):
                hf[(hv, name)] = hf_load(base, dev, folders[name] if name else None, fp32)
    hf_variants = sorted({v for v, _ in hf}, key=list(HF_VARIANTS).index)
    refs: dict = {}  # (engine variant, hf variant, request id) -> teacher-forced logits
    for ev, run in engine_runs.items():
        per_hf = {}
        for hv in hf_variants:
            rows = []
            for rid, name, prompt in requests:
                refs[(ev, hv, rid)] = ref = hf_logits(hf[(hv, name)], prompt, run["tokens"][rid])
                rows.append(dict(id=rid, adapter=name, **score(run["tokens"][rid], run["logits"].get(rid), ref)))
            per_hf[hv] = rows
        res["engines"][ev] = dict(info=run["info"], vs_hf=per_hf, tokens=run["tokens"])
    # transformers against itself on the same tokens (the CPU engine's): the device, the upcast
    if "cpu" in engine_runs:
        pairs = [(a, b) for a, b in (("cuda", "cpu"), ("cpu-fp32", "cpu"), ("cuda-fp32", "cpu-fp32"),
                                     ("cuda", "cuda-fp32")) if a in hf_variants and b in hf_variants]
        res["hf_vs_hf"] = {f"{a} vs {b}": {rid: rel(refs[("cpu", a, rid)], refs[("cpu", b, rid)])
                                           for rid, _, _ in requests} for a, b in pairs}
    res["probe"] = probe(res, engine_runs, hf, requests, base, folders, tmp, devices, deadline, args)
    del hf
    if "cuda" in devices:
        torch.cuda.empty_cache()
    return res


def first_bad(res: dict, engine_runs: dict, device: str, tol: float) -> tuple[str, str] | None:
    """(engine variant, request id) of the first request an engine variant on ``device`` gets wrong (tokens, or
    error > ``tol``) against transformers on the same device."""
    for ev in engine_runs:
        rows = res["engines"][ev]["vs_hf"].get(device) if ENGINE_VARIANTS[ev][0] == device else None
        for row in rows or []:
            if not row["agree"] or row.get("worst_rel_err", 0.0) > tol:
                return ev, row["id"]
    return None


def probe(res, engine_runs, hf, requests, base, folders, tmp, devices, deadline, args) -> dict | None:
    """The layer probe on the first request a CUDA engine variant gets wrong (the CPU engine when no CUDA ran);
    ``args.probe``: on that request id (of the first engine variant run) instead."""
    pick = first_bad(res, engine_runs, "cuda" if "cuda" in devices else "cpu", args.tol)
    if args.probe and engine_runs:
        pick = (next(iter(engine_runs)), args.probe)
    if pick is None:
        return None
    if time.perf_counter() > deadline:
        res["skipped"].append("probe: over --budget-s")
        return dict(engine_variant=pick[0], request=pick[1], skipped=True)
    ev, rid = pick
    name, prompt = next((n, p) for r, n, p in requests if r == rid)
    ids = prompt + engine_runs[ev]["tokens"][rid][:-1]
    top_k = json.load(open(os.path.join(base, "config.json"), encoding="utf-8"))["num_experts_per_tok"]
    caps = {f"engine-{d}": engine_probe(base, folders, name, ids, d, tmp) for d in sorted(devices)}
    caps.update({f"hf-{hv}": hf_probe(hf[(hv, n)], ids) for hv, n in hf if n == name})
    pairs = [("engine-cuda", "hf-cuda"), ("engine-cuda", "hf-cuda-fp32"), ("engine-cpu", "hf-cpu"),
             ("engine-cpu", "hf-cpu-fp32"), ("engine-cuda", "engine-cpu"), ("hf-cuda", "hf-cpu"),
             ("hf-cuda", "hf-cuda-fp32")]
    return dict(engine_variant=ev, request=rid, adapter=name, tokens=len(ids), prompt_len=len(prompt),
                layers={f"{a} vs {b}": compare_probes(caps[a], caps[b], top_k) for a, b in pairs
                        if a in caps and b in caps})


# ---- report ---------------------------------------------------------------------------------------------------
def verdict(res: dict, tol: float) -> list[str]:
    """Plain-language readings of one case's matrix (each line states the evidence it rests on)."""
    def ok(ev, hv):
        rows = res["engines"].get(ev, {}).get("vs_hf", {}).get(hv)
        if rows is None:
            return None
        return all(r["agree"] and r.get("worst_rel_err", 0.0) <= tol for r in rows)

    lines = []
    facts = res["hf_facts"]
    if facts["param_dtypes"] != ["torch.float32"]:
        lines.append(f"transformers' dequantised model is not all float32: {facts['param_dtypes']} "
                     f"(experts {facts['expert_param_dtypes']})")
    if facts["expert_weights_vs_codes_max_abs"] > 0:
        lines.append(f"transformers' expert weights differ from the decoded codes by "
                     f"{facts['expert_weights_vs_codes_max_abs']:.2e}")
    for key, errs in res.get("hf_vs_hf", {}).items():
        if max(errs.values()) > tol:
            lines.append(f"transformers {key}: worst {max(errs.values()):.2e} on the same tokens")
    for hv in ("cpu-fp32", "cuda-fp32", "cpu", "cuda"):
        if ok("cpu", hv) is not None:
            lines.append(f"engine cpu vs transformers {hv}: {'agrees' if ok('cpu', hv) else 'DIFFERS'}")
    ref = "cuda-fp32" if ok("cpu", "cuda-fp32") is not None else "cpu-fp32"
    for ev in ENGINE_VARIANTS:
        if ev != "cpu" and ok(ev, ref) is not None:
            lines.append(f"engine {ev} vs transformers {ref}: {'agrees' if ok(ev, ref) else 'DIFFERS'}")
    return lines


def cell(rows: list[dict]) -> str:
    agree = sum(r["agree"] for r in rows)
    errs = [r["worst_rel_err"] for r in rows if "worst_rel_err" in r]
    return f"{agree}/{len(rows)} {max(errs):.1e}" if errs else f"{agree}/{len(rows)} tokens"


def print_report(results: list[dict], tol: float) -> None:
    for res in results:
        if "error" in res:
            print(f"\n[{res['case']}] ERROR {res['error']}")
            continue
        f = res["hf_facts"]
        dtypes = sorted(set(f["expert_param_dtypes"].values()))
        print(f"\n[{res['case']}] transformers {f['transformers']} torch {f['torch']} peft {f['peft']}; experts "
              f"{f['experts_class']} impl={f['experts_implementation']} dtypes={dtypes}; weights vs codes "
              f"{f['expert_weights_vs_codes_max_abs']:.1e}")
        hvs = [hv for hv in HF_VARIANTS if any(hv in e.get("vs_hf", {}) for e in res["engines"].values())]
        head = "engine / transformers"
        print(f"{head:<26}" + "".join(f"{hv:<16}" for hv in hvs) + f"per request (vs {hvs[-1]}): agree/worst err")
        for ev, e in res["engines"].items():
            if "error" in e:
                print(f"{ev:<26}ERROR {e['error']}")
                continue
            per = " ".join(f"{r['id']}({r['adapter'] or 'base'}):{'ok' if r['agree'] else 'X'}"
                           + (f"/{r['worst_rel_err']:.0e}" if "worst_rel_err" in r else "")
                           for r in e["vs_hf"][hvs[-1]])
            print(f"{ev:<26}" + "".join(f"{cell(e['vs_hf'][hv]):<16}" for hv in hvs) + per)
        for key, errs in res.get("hf_vs_hf", {}).items():
            print(f"transformers {key}: worst {max(errs.values()):.1e} on the CPU engine's tokens")
        p = res.get("probe")
        if p and "layers" in p:
            print(f"layer probe (one prefill; rel. diff, router: rel. diff/tokens with another top-k): "
                  f"{p['request']} ({p['adapter'] or 'base'}, {p['tokens']} tokens; engine {p['engine_variant']})")
            for pair, rows in p["layers"].items():
                cols = []
                for r in rows:
                    if r["layer"] == "logits":
                        cols.append(f"logits {r['logits']:.1e} ({r['argmax_differs']} argmax)")
                    else:
                        cols.append(f"L{r['layer']} attn {r.get('attn', float('nan')):.0e} router "
                                    f"{r.get('router', float('nan')):.0e}/{r.get('topk_mismatch_tokens', '-')}tk moe "
                                    f"{r.get('moe', float('nan')):.0e} out {r.get('out', float('nan')):.0e}")
                print(f"  {pair:<32}" + " | ".join(cols))
        for s in res["skipped"]:
            print(f"skipped: {s}")
        print("verdict:")
        for line in verdict(res, tol):
            print(f"  {line}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda: the full matrix; cpu: the CPU cells only (smoke run)")
    p.add_argument("--cases", default="single,sharded", help=f"comma list of: {', '.join(TINY_CASES)}")
    p.add_argument("--engine-variants", default=",".join(ENGINE_VARIANTS), help="comma list (see the docstring)")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--tol", type=float, default=1e-4, help="worst relative logits error counted as agreement")
    p.add_argument("--budget-s", type=float, default=105.0, help="start no new engine run or probe past this")
    p.add_argument("--probe", default=None, help="run the layer probe on this request id (e.g. r0) regardless")
    p.add_argument("--tmp", default="/tmp")
    args = p.parse_args()
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    results = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for case in args.cases.split(","):
            try:
                results.append(run_case(case, args, tmp, deadline))
            except Exception as e:  # noqa: BLE001 - reported; the next case still runs
                traceback.print_exc()
                results.append(dict(case=case, error=f"{type(e).__name__}: {e}"))
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "diagnose_mxfp4_gpu.json"), "w", encoding="utf-8") as f:
        json.dump(dict(device=args.device, seconds=round(time.perf_counter() - t0, 1), cases=results), f, indent=1)
    print_report(results, args.tol)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; JSON: {os.path.join(out, 'diagnose_mxfp4_gpu.json')}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
