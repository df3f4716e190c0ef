"""EAGLE-3 drafts in the published layout (eagle3_draft.py, eagle3_checkpoint.py, eagle3.py): every proposal equals
a dense, unpaged reference of the draft on transformers' (+ PEFT's) hidden states, step after step through
acceptances and rejections; greedy output is the non-speculative output token for token on a dense and a MoE
family with mixed adapters and an abort, nothing leaks in the draft's pool; sampled drafts carry probabilities
over the target vocabulary, zero outside the draft's; bad folders are refused naming what is wrong."""
from __future__ import annotations

import os

import pytest
import torch
from torch.nn import functional as F

from loraplex.engine import SamplingParams
from loraplex.engine.spec_decode import SpeculativeConfig
from loraplex.engine.testing.eagle3 import (DRAFT_VOCAB, EPS, HEAD_DIM, HEADS, KV_HEADS, THETA, VOCAB,
                                            write_random_eagle3 as write_eagle3)
from tests.engine.spec_decode.conftest import (adapter_refs, assert_all_free, drive, make_engine, prompt_list,
                                               record_proposals)

K = 3
BIAS = {7: 20.0, 11: 19.0}   # logit_bias, applied by target and draft alike: drafts right often, not always


# ---- the reference: dense, unpaged, from the published description ----------------------------------------------
def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x, pos):  # x [T, heads, D]; rotate-half with the default frequencies
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _layer(W, e, h, pos):
    """The draft layer over all rows (embeddings e, hidden h, positions pos) with a causal mask -> (normed, prenorm)."""
    a = torch.cat([_rms(e, W["midlayer.input_layernorm.weight"]), _rms(h, W["midlayer.hidden_norm.weight"])], -1)
    T = a.shape[0]
    q = _rope((a @ W["midlayer.self_attn.q_proj.weight"].T).view(T, HEADS, HEAD_DIM), pos)
    k = _rope((a @ W["midlayer.self_attn.k_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM), pos)
    v = (a @ W["midlayer.self_attn.v_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, 1) for t in (k, v))
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    x = o.transpose(0, 1).reshape(T, -1) @ W["midlayer.self_attn.o_proj.weight"].T + h
    m = _rms(x, W["midlayer.post_attention_layernorm.weight"])
    x = x + (F.silu(m @ W["midlayer.mlp.gate_proj.weight"].T) * (m @ W["midlayer.mlp.up_proj.weight"].T)) \
        @ W["midlayer.mlp.down_proj.weight"].T
    return _rms(x, W["norm.weight"]), x


def reference_drafts(W, lm, aux_ids, tokens: list[int], k: int, bias: dict[int, float],
                     norm_output: bool = False) -> list[int]:
    """k greedy drafts after ``tokens`` (x_0 .. x_{N-1}) from transformers' hidden states of x_0 .. x_{N-2}; the
    aux states through ``input_norm`` (norm_before_fc) or ``fc_norm.<i>`` (fc_norm) when W holds them, and with
    ``norm_output`` the normed output fed back along the chain."""
    ids = torch.tensor([tokens[:-1]])
    hs = lm(input_ids=ids, output_hidden_states=True).hidden_states
    parts = [hs[i][0] for i in aux_ids]
    if "fc_norm.0.weight" in W:
        parts = [_rms(p, W[f"fc_norm.{j}.weight"]) for j, p in enumerate(parts)]
    aux = torch.cat(parts, -1)
    if "input_norm.weight" in W:
        aux = _rms(aux, W["input_norm.weight"])
    h = aux @ W["fc.weight"].T                                                 # [N - 1, H], position t
    embed = lm.get_input_embeddings()
    e = embed(torch.tensor(tokens[1:]))                                        # x_{t+1} at position t
    pos = torch.arange(len(tokens) - 1)
    targets = torch.arange(DRAFT_VOCAB) + W["d2t"]
    drafts = []
    for _ in range(k):
        normed, prenorm = _layer(W, e, h, pos)
        logits = torch.full((VOCAB,), float("-inf"))
        logits[targets] = normed[-1] @ W["lm_head.weight"].T
        for t, b in bias.items():
            logits[t] += b
        d = int(logits.argmax())
        drafts.append(d)
        e = torch.cat([e, embed(torch.tensor([d]))])
        h = torch.cat([h, (normed if norm_output else prenorm)[-1:]])
        pos = torch.cat([pos, pos[-1:] + 1])
    return drafts


# ---- engine runs ---------------------------------------------------------------------------------------------
def _workload(refs: dict, bias: dict | None = None) -> list[tuple]:
    prompts = prompt_list((6, 9, 4, 11, 7, 5), seed=9)
    adapters = [None, "a", "b", "a", None, "b"]
    lengths = [16, 14, 17, 9, 12, 15]
    return [(f"r{i}", prompts[i], SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True,
                                                 logit_bias=bias if i % 2 else None),
             refs.get(adapters[i])) for i in range(len(prompts))]  # no refs: base requests only


def _run(path, refs, spec, cache, before_step=None, record=None, bias=BIAS):
    """Greedy outputs of the workload, and the engine; ``record`` gets (tokens, adapter, params, drafts) of every
    proposal and engine.accepted_counts every verification's number of accepted drafts."""
    engine = make_engine(path, spec, adapter_cache_dir=cache, enable_lora=True, max_loras=2, max_lora_rank=8)
    for ref in refs.values():
        assert engine.load_adapter(ref, wait=True) == "ready"
    engine.accepted_counts = set()
    if engine.spec is not None:
        observe = engine.spec.proposer.observe

        def observing(verified):
            engine.accepted_counts.update(v.num_accepted for v in verified)
            observe(verified)

        engine.spec.proposer.observe = observing
    if record is not None:
        record_proposals(engine, record, with_params=True)
    finals = drive(engine, _workload(refs, bias), arrivals={0: [0, 1, 2, 3], 3: [4, 5]}, before_step=before_step)
    assert_all_free(engine)
    return {rid: o.output_token_ids for rid, o in finals.items()}, engine


def test_eagle3_proposals_follow_the_reference_and_stay_lossless(tiny_checkpoint, peft_folders, tmp_path):
    """Llama (dense, LoRA on attention and MLP): every proposal, for base and adapter requests, equals the dense
    reference on transformers' hidden states, over steps that accept some drafts and reject others."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("llama", num_hidden_layers=4)
    folders = peft_folders(path)
    refs = adapter_refs(folders)
    aux_ids = [1, 2, 3]
    draft = write_eagle3(tmp_path / "draft", aux_ids)
    want, _ = _run(path, refs, None, str(tmp_path / "ref"))
    record: list = []
    got, engine = _run(path, refs, dict(method="eagle3", draft_head=draft, num_speculative_tokens=K),
                       str(tmp_path / "eagle3"), record=record)
    assert got == want
    assert engine.accepted_counts == {0, 1, 2, 3}  # rejections at every draft, and whole chains accepted
    stats = engine.spec.snapshot()
    assert stats["proposer"]["kv_blocks_free"] == stats["proposer"]["kv_blocks_total"]
    engine.close()

    W = load_file(os.path.join(draft, "model.safetensors"))
    models = {None: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()}
    for name, folder in folders.items():
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        models[f"t/{name}/1"] = PeftModel.from_pretrained(base, folder).eval().base_model.model
    with torch.no_grad():
        for tokens, adapter, params, drafts in record:
            lm = models[getattr(adapter, "adapter_id", None)]
            ref = reference_drafts(W, lm, aux_ids, tokens, len(drafts), params.logit_bias or {})
            assert drafts == ref, (tokens, adapter)
    assert len(record) >= 30 and {getattr(a, "adapter_id", None) for _, a, _, _ in record} == set(models)


VARIANTS = {  # the EAGLE-3.1 norms, where trainers write them
    "norm_before_fc in eagle_config (gpt-oss drafts)": dict(eagle={"norm_before_fc": True}),
    "fc_norm and norm_output at the top level": dict(fc_norm=True, norm_output=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_eagle3_norm_variants_follow_the_reference(variant, tiny_checkpoint, tmp_path):
    """Drafts that norm the aux states before fc (one RMSNorm over the concatenation, or one per layer) and feed
    the normed output back along the chain: every proposal equals the dense reference, output lossless."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("llama", num_hidden_layers=4)
    aux_ids = [1, 2, 3]
    draft = write_eagle3(tmp_path / "draft", aux_ids, **VARIANTS[variant])
    want, _ = _run(path, {}, None, str(tmp_path / "ref"))
    record: list = []
    got, engine = _run(path, {}, dict(method="eagle3", draft_head=draft, num_speculative_tokens=K),
                       str(tmp_path / "eagle3"), record=record)
    assert got == want and 0 in engine.accepted_counts and max(engine.accepted_counts) >= 2
    engine.close()
    W = load_file(os.path.join(draft, "model.safetensors"))
    assert ("input_norm.weight" in W) != ("fc_norm.0.weight" in W)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    norm_output = "norm_output" in VARIANTS[variant]
    with torch.no_grad():
        for tokens, _, params, drafts in record:
            assert drafts == reference_drafts(W, lm, aux_ids, tokens, len(drafts), params.logit_bias or {},
                                              norm_output), tokens
    # the same weights read without the norms draft differently somewhere: the norms are applied
    plain = {k: v for k, v in W.items() if not k.startswith(("input_norm", "fc_norm"))}
    with torch.no_grad():
        assert any(drafts != reference_drafts(plain, lm, aux_ids, tokens, len(drafts), params.logit_bias or {})
                   for tokens, _, params, drafts in record)
    assert len(record) >= 20


@pytest.mark.parametrize("family,aux_ids", [("llama", [1, 2, 4]), ("gpt_oss", [0, 1, 2])])
def test_eagle3_verify_steps_on_the_padded_graph_path(family, aux_ids, tiny_checkpoint, peft_folders, tmp_path):
    """verify_cuda_graphs: steps that keep aux rows run on the verify graphs' padded path (what a CUDA graph
    replays; eager here on the CPU), which also gives the aux rows: every proposal and every output token as on the
    eager multi-token forward, most steps on that path."""
    path = tiny_checkpoint(family, num_hidden_layers=4) if family == "llama" else tiny_checkpoint(family)
    refs = adapter_refs(peft_folders(path))
    draft = write_eagle3(tmp_path / "draft", aux_ids)
    runs = {}
    for graphs in (False, True):
        record: list = []
        spec = dict(method="eagle3", draft_head=draft, num_speculative_tokens=K, verify_cuda_graphs=graphs)
        got, engine = _run(path, refs, spec, str(tmp_path / f"eagle3-{graphs}"), record=record)
        executor = engine.spec.executor
        runs[graphs] = (got, [(t, getattr(a, "adapter_id", None), d) for t, a, _, d in record],
                        executor.num_graph_steps, executor.num_eager_steps)
        engine.close()
    (eager_out, eager_rec, eager_graph, _), (out, rec, graph_steps, eager_steps) = runs[False], runs[True]
    assert out == eager_out and rec == eager_rec and len(rec) >= 20
    assert eager_graph == 0 and graph_steps > eager_steps  # prefill chunks stay eager


@pytest.mark.parametrize("family,aux_ids", [("gpt_oss", [0, 1, 2]), ("qwen3_moe", [1, 2, 3])])
def test_eagle3_lossless_on_moe_with_adapters_and_abort(family, aux_ids, tiny_checkpoint, peft_folders, tmp_path):
    """MoE families with LoRA on attention and the experts; aux layer L (the last layer's output before the final
    norm) on qwen3_moe; a request aborted mid-run; the draft's pool ends empty (checked after every step)."""
    path = tiny_checkpoint(family)
    refs = adapter_refs(peft_folders(path))
    want, _ = _run(path, refs, None, str(tmp_path / "ref"))
    spec = dict(method="eagle3", draft_head=write_eagle3(tmp_path / "draft", aux_ids), num_speculative_tokens=K,
                draft_max_batched_tokens=8)

    def abort_r1(k, engine):
        if k == 5:
            engine.abort("r1")

    got, engine = _run(path, refs, spec, str(tmp_path / "eagle3"), before_step=abort_r1)
    assert "r1" not in got and got == {rid: t for rid, t in want.items() if rid != "r1"}
    # a rejection and a chain of several drafts accepted; which chain lengths occur beyond that rests on near-ties
    # of the random draft's logits (the bias gap of 1), which float rounding in the CPU GEMMs can flip in a long
    # test process (the dense test above covers every length)
    assert 0 in engine.accepted_counts and max(engine.accepted_counts) >= 2
    engine.close()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_eagle3_preemption_and_prefix_hits(mode, tiny_checkpoint, tmp_path):
    """A 22-block pool for six requests: preempted sequences drop their draft state and catch up again (from the
    first position the target computes after a swap); wave 2 prompts are wave 1's prompts plus outputs, so the
    target skips their cached prefix and the draft drafts from the positions after it. Greedy tokens equal the
    non-speculative run under the same limits; every block of both pools is free at the end."""
    path = tiny_checkpoint("llama", num_hidden_layers=4)
    limits = dict(num_kv_blocks=22, preemption_mode=mode, num_cpu_blocks=40 if mode == "swap" else 0, max_num_seqs=6)

    def reqs(prompts, lengths, prefix):
        return [(f"{prefix}{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logit_bias=BIAS),
                 None) for i, (p, n) in enumerate(zip(prompts, lengths))]

    first = reqs(prompt_list((9, 6, 12, 7, 10, 5), seed=4), (20, 18, 16, 22, 14, 19), "a")
    ref = make_engine(path, **limits)
    want1 = {rid: o.output_token_ids for rid, o in drive(ref, first).items()}
    assert ref.scheduler.num_preemptions > 0
    second = reqs([p + want1[rid] for rid, p, _, _ in first[:3]], (6, 8, 7), "b")
    want2 = {rid: o.output_token_ids for rid, o in drive(ref, second).items()}
    engine = make_engine(path, dict(method="eagle3", draft_head=write_eagle3(tmp_path / "draft", [1, 2, 3]),
                                    num_speculative_tokens=K), **limits)
    assert {rid: o.output_token_ids for rid, o in drive(engine, first).items()} == want1
    assert engine.scheduler.num_preemptions > 0 and engine.spec.snapshot()["accepted"] > 0
    if mode == "swap":
        assert engine.scheduler.num_swap_outs > 0
    drafted = []
    propose = engine.spec.proposer.propose

    def recording(batch):
        out = propose(batch)
        drafted.extend(s.request_id for s, p in zip(batch, out) if p is not None)
        return out

    engine.spec.proposer.propose = recording
    finals2 = drive(engine, second)
    assert {rid: o.output_token_ids for rid, o in finals2.items()} == want2
    assert sum(finals2[rid].num_cached_tokens > 0 for rid, _, _, _ in second) >= 2  # drafting after a cached prefix
    assert set(drafted) == {rid for rid, _, _, _ in second}
    assert_all_free(engine)


def test_eagle3_sampled_drafts_carry_target_vocab_probs(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama", num_hidden_layers=4)
    draft = write_eagle3(tmp_path / "draft", [1, 2, 3])
    spec = dict(method="eagle3", draft_head=draft, num_speculative_tokens=K)
    outs = []
    for _ in range(2):
        engine = make_engine(path, spec)
        propose, seen = engine.spec.proposer.propose, []

        def recording(batch, propose=propose, seen=seen):
            out = propose(batch)
            seen.extend(p for p in out if p is not None)
            return out

        engine.spec.proposer.propose = recording
        for i, prompt in enumerate(prompt_list((5, 8, 6), seed=4)):
            engine.add_request(f"s{i}", prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=i,
                                                               ignore_eos=True, logit_bias=BIAS))
        finals = drive(engine, [])
        outs.append({rid: o.output_token_ids for rid, o in finals.items()})
        assert_all_free(engine)
        engine.close()
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[engine.spec.proposer.runner.draft.draft_to_target] = False
        assert seen and all(p.probs is not None and p.probs.shape == (len(p.token_ids), VOCAB) for p in seen)
        for p in seen:
            torch.testing.assert_close(p.probs.sum(-1), torch.ones(len(p.token_ids)))
            assert not p.probs[:, outside].any() and not outside[p.token_ids].any()
    assert outs[0] == outs[1] and all(len(t) == 12 for t in outs[0].values())


def test_eagle3_checkpoint_variants_load_alike(tiny_checkpoint, tmp_path):
    """pytorch_model.bin with ``model.``-prefixed names reads as the safetensors folder does."""
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.spec_decode.eagle3_checkpoint import load_eagle3_draft

    target = ModelConfig.from_pretrained(tiny_checkpoint("llama", num_hidden_layers=4))
    kw = dict(target=target, max_model_len=128, device=torch.device("cpu"), dtype=torch.float32)
    a, aux_a = load_eagle3_draft(write_eagle3(tmp_path / "st", [3, 1, 2]), **kw)
    b, aux_b = load_eagle3_draft(write_eagle3(tmp_path / "bin", [3, 1, 2], fmt="bin", prefix="model."), **kw)
    assert aux_a == aux_b == (1, 2, 3)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)
    assert torch.equal(a.draft_to_target, b.draft_to_target) and a.embed_tokens is None


def test_speculators_layout_reads_as_the_published_one(tiny_checkpoint, tmp_path):
    """A draft as the speculators library saves it (Eagle3Speculator: the layer's config in transformer_layer_config,
    the EAGLE-3 fields at the top level, ``layers.0.`` names) is the same draft as in the published layout, with that
    layout's default norm_before_residual (true when absent): the same config and tensors, the same proposals."""
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.spec_decode.eagle3_checkpoint import load_eagle3_draft, read_eagle3_config

    path = tiny_checkpoint("llama", num_hidden_layers=4)
    target = ModelConfig.from_pretrained(path)
    kw = dict(target=target, max_model_len=128, device=torch.device("cpu"), dtype=torch.float32)
    published = write_eagle3(tmp_path / "published", [1, 2, 3], norm_before_residual=True)
    speculators = write_eagle3(tmp_path / "speculators", [1, 2, 3], layout="speculators")
    assert read_eagle3_config(speculators) == read_eagle3_config(published)
    assert read_eagle3_config(speculators).norm_before_residual
    (a, aux_a), (b, aux_b) = load_eagle3_draft(published, **kw), load_eagle3_draft(speculators, **kw)
    sa, sb = a.state_dict(), b.state_dict()
    assert aux_a == aux_b == (1, 2, 3) and sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)
    said = write_eagle3(tmp_path / "said", [1, 2, 3], layout="speculators", norm_before_residual=False)
    assert not read_eagle3_config(said).norm_before_residual  # a value the config gives is kept
    runs = []
    for folder in (published, speculators):
        record: list = []
        got, engine = _run(path, {}, dict(method="eagle3", draft_head=folder, num_speculative_tokens=K),
                           str(tmp_path / f"cache-{len(runs)}"), record=record)
        engine.close()
        runs.append((got, [drafts for *_, drafts in record]))
    want, _ = _run(path, {}, None, str(tmp_path / "plain"))
    assert runs[0] == runs[1] and runs[0][0] == want and len(runs[0][1]) >= 10


def test_bad_eagle3_drafts_are_refused(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama", num_hidden_layers=4)
    with pytest.raises(ValueError, match="'eagle3' needs draft_head"):
        SpeculativeConfig(method="eagle3")
    with pytest.raises(ValueError, match="one draft for every adapter"):
        SpeculativeConfig(method="eagle3", draft_head="/h", draft_heads={"t/a/1": "/x"})
    cases = [
        (dict(drop="midlayer.mlp.up_proj.weight"), "missing tensor.*midlayer.mlp.up_proj.weight"),
        (dict(reshape="fc.weight"), r"tensor fc.weight has shape \[72, 215\], expected \[72, 216\]"),
        (dict(reshape="midlayer.self_attn.q_proj.weight"), "tensor midlayer.self_attn.q_proj.weight has shape"),
        (dict(vocab_size=400), "vocabulary of 400 tokens, the target has 320"),
        (dict(target_hidden_size=64), "target hidden states of size 64.*hidden size is 72"),
        (dict(hidden_size=64, target_hidden_size=72), r"tensor fc.weight has shape \[72, 216\], expected \[64, 216\]"),
        (dict(architectures=["LlamaForCausalLM"]), "not an EAGLE-3 draft"),
        (dict(num_hidden_layers=2), "only one-layer EAGLE-3 drafts"),
        (dict(norm_before_fc=True, fc_norm=True), "norm_before_fc and fc_norm are both set"),
        (dict(norm_before_fc=True, drop="input_norm.weight"), "missing tensor.*input_norm.weight"),
        (dict(fc_norm=True, reshape="fc_norm.2.weight"), r"tensor fc_norm.2.weight has shape \[71\]"),
        (dict(drop="norm.weight", fc_norm="yes"), "fc_norm must be true or false"),
        (dict(layout="speculators", speculators_model_type="eagle"), "only 'eagle3' drafts are read"),
        (dict(layout="speculators", drop="midlayer.self_attn.o_proj.weight"), "missing tensor.*o_proj.weight"),
    ]
    from loraplex.engine.config import ConfigError
    from loraplex.engine.spec_decode.eagle3_draft import Eagle3Config

    with pytest.raises(ConfigError, match="needs transformer_layer_config"):
        Eagle3Config.from_dict({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3"}, "x")
    for i, (kw, msg) in enumerate(cases):
        folder = write_eagle3(tmp_path / f"bad{i}", [1, 2, 3], **kw)
        with pytest.raises(ValueError, match=msg):
            make_engine(path, dict(method="eagle3", draft_head=folder))
    with pytest.raises(ValueError, match=r"default aux layers .* \[2, 2, 1\] must be distinct"):
        make_engine(path, dict(method="eagle3", draft_head=write_eagle3(tmp_path / "default-ids", None)))
    with pytest.raises(ValueError, match="EAGLE-3 draft folder: no config.json"):
        make_engine(path, dict(method="eagle3", draft_head=str(tmp_path)))


def test_serve_flags_select_eagle3(serve_speculative):
    cfg = serve_speculative("--speculative-method", "eagle3", "--speculative-draft-head", "/e3",
                            "--speculative-draft-num-kv-blocks", "64")
    assert (cfg.method, cfg.draft_head, cfg.draft_num_kv_blocks) == ("eagle3", "/e3", 64)
