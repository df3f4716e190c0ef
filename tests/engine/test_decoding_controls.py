"""Sampling controls on seeded engine runs against transformers' logits processors or a written reference:
repetition / presence / frequency penalties, min-p, stop strings across token boundaries, and the top-n
logprobs of sampled and prompt tokens."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.sampler import make_generator


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def make_engine(path) -> LLMEngine:
    return LLMEngine.from_pretrained(path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                                     progress=False)


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_with_logits(engine: LLMEngine, prompt, params):
    """The final output and the raw logits row [V] of every sampled step."""
    logits = defaultdict(list)
    engine.runner.logits_hook = lambda seqs, lg: [logits[s.seq_id].append(lg[i].clone()) for i, s in enumerate(seqs)]
    out = engine.generate([prompt], params)[0]
    (rows,) = logits.values()
    return out, rows


def test_repetition_penalty_matches_transformers_processor(path):
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt = prompt_ids(8, seed=1)
    out, rows = run_with_logits(make_engine(path), prompt, SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.8))
    proc = RepetitionPenaltyLogitsProcessor(1.8)
    changed = 0
    for i, (raw, tok) in enumerate(zip(rows, out.output_token_ids)):
        ids = torch.tensor([prompt + out.output_token_ids[:i]])
        ref = proc(ids, raw.unsqueeze(0).clone())[0]
        assert tok == ref.argmax().item(), f"step {i}"
        changed += tok != raw.argmax().item()
    assert changed, "the penalty never changed a choice; the check is vacuous"


def test_presence_and_frequency_penalties_match_written_reference(path):
    prompt = prompt_ids(8, seed=2)
    out, rows = run_with_logits(make_engine(path), prompt, SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0))
    changed = 0
    for i, (raw, tok) in enumerate(zip(rows, out.output_token_ids)):
        counts = torch.bincount(torch.tensor(out.output_token_ids[:i], dtype=torch.long), minlength=raw.numel())
        ref = raw - 1.0 * counts - 1.5 * (counts > 0).float()  # OpenAI: over output tokens only
        assert tok == ref.argmax().item(), f"step {i}"
        changed += tok != raw.argmax().item()
    assert changed, "the penalties never changed a choice; the check is vacuous"


def test_min_p_matches_transformers_warper_and_the_seeded_draw(path):
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    prompt = prompt_ids(8, seed=3)
    seed, temp, min_p = 99, 1.3, 0.1
    out, rows = run_with_logits(make_engine(path), prompt, SamplingParams(
        max_tokens=16, temperature=temp, min_p=min_p, seed=seed, ignore_eos=True))
    g = make_generator(seed)
    dropped = 0
    for i, (raw, tok) in enumerate(zip(rows, out.output_token_ids)):
        ids = torch.tensor([prompt + out.output_token_ids[:i]])
        scores = MinPLogitsWarper(min_p)(ids, TemperatureLogitsWarper(temp)(ids, raw.unsqueeze(0).clone()))[0]
        probs = torch.softmax(scores, -1)
        q = torch.empty_like(probs).exponential_(generator=g)  # the engine's draw: argmax(p / q), q ~ Exp(1)
        assert tok == (probs / q).argmax().item(), f"step {i}"
        assert probs[tok] > 0
        dropped += int((probs == 0).sum()) > 0
    assert dropped == len(rows), "min-p removed nothing at some step"


def test_stop_string_across_token_boundary_is_cut_from_the_output(path):
    engine = make_engine(path)
    tok = engine.tokenizer
    greedy = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    for seed in range(20):  # find a greedy run with two adjacent printable tokens (a stop string spans them)
        prompt = prompt_ids(6, seed=100 + seed)
        free = engine.generate([prompt], SamplingParams(**greedy))[0].output_token_ids
        pieces = [tok.decode([t]) for t in free]
        k = next((k for k in range(2, len(free) - 1) if pieces[k].isascii() and pieces[k + 1].isascii()
                  and pieces[k].strip() and pieces[k + 1].strip()), None)
        if k is not None:
            break
    else:
        pytest.fail("no run with two adjacent printable tokens")
    stop = pieces[k][-1] + pieces[k + 1][0]
    # written reference: the first token count whose text holds the stop string, cut where it starts
    m = next(m for m in range(1, len(free) + 1) if stop in tok.decode(free[:m]))
    text = tok.decode(free[:m])
    before = tok.decode(free[:m - 1])
    assert stop not in before and len(before) < text.index(stop) + len(stop)
    out = engine.generate([prompt], SamplingParams(stop=[stop, "\x00never"], **greedy))[0]
    assert out.output_token_ids == free[:m]
    assert out.text == text[:text.index(stop)] and stop not in out.text
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    kept = engine.generate([prompt], SamplingParams(stop=[stop], include_stop_str_in_output=True, **greedy))[0]
    assert kept.text == text[:text.index(stop) + len(stop)]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_logprobs_of_sampled_and_prompt_tokens_match_the_model(path):
    from transformers import AutoModelForCausalLM

    prompt = prompt_ids(10, seed=4)
    engine = make_engine(path)
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.7, seed=1, ignore_eos=True,
                                                   logprobs=5, prompt_logprobs=3))[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    full = prompt + out.output_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)  # [L, V]

    def check(entry, pos, top_n):
        row = ref[pos - 1]  # position pos - 1 predicts token pos
        assert entry.token_id == full[pos]
        assert entry.logprob == pytest.approx(row[full[pos]].item(), abs=1e-4)
        assert entry.rank == int((row > row[full[pos]]).sum()) + 1
        top_lp, top_ids = row.topk(top_n)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top_lp.tolist(), abs=1e-4)

    lps = out.outputs[0].logprobs
    assert len(lps) == len(out.output_token_ids) == 8
    for i, entry in enumerate(lps):
        check(entry, len(prompt) + i, 5)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        check(out.prompt_logprobs[pos], pos, 3)
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(e.logprob for e in lps), abs=1e-4)
