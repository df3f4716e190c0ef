"""Forced replay (the benchmarks' set acceptance length) when the target would not produce the recording: as on a
GPU in bf16 with near-flat dummy logits, where the target's own token at a rejected position, at the bonus
position or after a prefill differs from the recorded one. Here the recording is another run's (a different
adapter, then a perturbed copy), so the target disagrees with it almost everywhere; the run must still reproduce
the recording token for token, at the set acceptance length, in about output_len / L steps."""
from __future__ import annotations

import pytest

from loraplex.engine import SamplingParams
from loraplex.engine.spec_decode import acceptance_rate_for
from tests.engine.spec_decode.conftest import adapter_refs, assert_all_free, drive, make_engine, prompt_list

OUTPUT_LEN = 48
LENGTH, K = 3.0, 3


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


def run(engine, prompts, adapters, speculative: bool, tag: str):
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True, speculative=speculative)
    steps = []
    finals = drive(engine, [(f"{tag}-{i}", p, params, a) for i, (p, a) in enumerate(zip(prompts, adapters))],
                   before_step=lambda k, e: steps.append(k))
    return [finals[f"{tag}-{i}"].output_token_ids for i in range(len(prompts))], len(steps)


def test_forced_replay_keeps_a_recording_the_target_disagrees_with(llama, peft_folders):
    refs = adapter_refs(peft_folders(llama))
    engine = make_engine(llama, dict(method="replay", num_speculative_tokens=K, replay_forced=True,
                                     replay_acceptance_rate=acceptance_rate_for(LENGTH, K)),
                         enable_lora=True, max_loras=2, max_lora_rank=8)
    for ref in refs.values():
        engine.load_adapter(ref, wait=True)
    prompts = prompt_list((9, 14, 6, 11), seed=7)
    plain_a, plain_steps = run(engine, prompts, [refs["a"]] * 4, False, "rec")
    plain_b, _ = run(engine, prompts, [refs["b"]] * 4, False, "other")
    # recordings the target on adapter b does not produce: adapter a's run, and adapter b's with tokens changed
    perturbed = [[(t + 7) % 320 if j % 5 == 2 else t for j, t in enumerate(o)] for o in plain_b]
    vocab = engine.model_config.vocab_size
    for n, recording in enumerate((plain_a, perturbed)):
        assert all(r != b for r, b in zip(recording, plain_b))  # every request: the target would leave it
        replay = engine.spec.proposer
        for p, toks in zip(prompts, recording):
            replay.record(p, toks)
        before = engine.spec.snapshot()
        got, steps = run(engine, prompts, [refs["b"]] * 4, True, f"replay{n}")
        after = engine.spec.snapshot()
        assert got == recording  # the sequence never left its recording
        verified = after["verified"] - before["verified"]
        accepted = after["accepted"] - before["accepted"]
        assert verified > 0 and abs((accepted + verified) / verified - LENGTH) <= 0.1 * LENGTH
        assert after["replay_agreement"] < 1.0  # the target's own tokens were drawn, and differ
        # plain: one step per token; replayed at L: about OUTPUT_LEN / L decode-or-verify steps (plus the prefill)
        assert plain_steps >= OUTPUT_LEN
        assert steps <= 1.25 * OUTPUT_LEN / LENGTH + 4, (steps, plain_steps)
        assert all(max(t) < vocab for t in got)
    assert_all_free(engine)
    engine.close()

