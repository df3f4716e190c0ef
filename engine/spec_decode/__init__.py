"""Speculative decoding: proposers draft tokens, one target forward verifies them, rejected drafts' KV slots are
rolled back. Lossless: greedy output is the non-speculative output token for token; sampling keeps its
distribution (rejection sampling). docs/engine.md, "Speculative decoding".

    config.py       SpeculativeConfig (EngineConfig.speculative)
    proposer.py     the proposer interface (SpecSequence -> Proposal), the registry of methods
    ngram.py        prompt lookup          draft_model.py  a small causal LM with its own paged KV
    draft_lora.py   per-adapter draft LoRAs of the draft model
    eagle_head.py   an EAGLE-style draft head   eagle.py  its proposer, on the target's hidden states
    eagle3_draft.py a published EAGLE-3 draft   eagle3_checkpoint.py  its loader   eagle3.py  its proposer, on
                    the target's aux hidden states, with its own paged KV
    replay.py       recorded tokens at a set acceptance rate (benchmarks)
    rejection.py    acceptance: greedy prefix match, speculative rejection sampling
    verifier.py     the verify step: one forward, sampling controls per position, acceptance, stop cuts
    verify_graphs.py verify rows through the decode path's CUDA graphs
    decoder.py      SpecDecoder: candidates, proposals, the engine's hooks, counters (stats.py)
"""
from loraplex.engine.spec_decode.config import (METHODS, SpeculativeConfig, acceptance_rate_for,
                                                expected_acceptance_length)
from loraplex.engine.spec_decode.proposer import (PROPOSERS, Proposal, Proposer, ProposerContext, SpecSequence,
                                                  Verified, register_proposer)

__all__ = ["METHODS", "PROPOSERS", "Proposal", "Proposer", "ProposerContext", "SpecSequence", "SpeculativeConfig",
           "Verified", "acceptance_rate_for", "expected_acceptance_length", "register_proposer"]
