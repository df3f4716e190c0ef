"""Speculative decoding in the serving benchmark: ``loraplex bench serve --speculative-method ngram|draft|replay``.

    ngram / draft    the engine speculates on every measured request; the scenario's figures carry the measured
                     acceptance (``speculative`` in the scenario's JSON: proposed, accepted, acceptance length, verify
                     steps, proposer ms)
    replay           acceptance means nothing on dummy weights, so each scenario first runs its plan with
                     speculation off (the requests opt out): that pass is recorded (``no_speculation`` in the JSON)
                     and its outputs are handed to the replay proposer; the measured pass then replays them at the
                     set acceptance rate (``--speculative-acceptance-length`` L with k drafts: rate r such that
                     1 + r + ... + r^k = L) and the target's verdict is overridden by the plan. Every figure of such
                     a scenario is labelled "replayed proposals"; the real costs (proposing, the verify forward, the
                     acceptance, the KV rollback) are measured, the acceptance is set.
"""
from __future__ import annotations

import dataclasses

from loraplex.bench.driver import closed_loop
from loraplex.engine.sampling_params import SamplingParams

SPEC_KEYS = ("proposed", "accepted", "verified", "emitted", "verify_steps", "graph_steps", "propose_ms", "verify_ms")


def speculative_config(cfg) -> dict | None:
    """``EngineConfig.speculative`` from a ServeBenchConfig (None: no speculation)."""
    method = getattr(cfg, "speculative_method", None)
    if method is None:
        return None
    from loraplex.engine.spec_decode import SpeculativeConfig, acceptance_rate_for

    k = cfg.num_speculative_tokens
    kw = dict(method=method, num_speculative_tokens=k, verify_cuda_graphs=cfg.speculative_verify_cuda_graphs)
    if method == "draft":
        kw.update(draft_model=cfg.speculative_draft_model, draft_load_format="dummy")
    if method == "replay":
        length = cfg.speculative_acceptance_length
        kw.update(replay_forced=True, replay_seed=cfg.seed,
                  **({"replay_acceptance_rate": acceptance_rate_for(length, k)} if length is not None else {}))
    SpeculativeConfig(**kw)  # checked now: a bad flag fails before any engine starts
    return kw


def snapshot(engine) -> dict | None:
    spec = getattr(engine, "spec", None)
    return spec.snapshot() if spec is not None else None


def delta(before: dict | None, after: dict | None) -> dict | None:
    """The speculative counters of one measured pass (after - before), with its acceptance length."""
    if after is None:
        return None
    d = {k: after[k] - (before[k] if before else 0) for k in SPEC_KEYS}
    d["acceptance_length"] = (d["accepted"] + d["verified"]) / d["verified"] if d["verified"] else None
    d["tokens_per_verify_step"] = d["emitted"] / d["verify_steps"] if d["verify_steps"] else None
    d["verify_step_ms"] = d["verify_ms"] / d["verify_steps"] if d["verify_steps"] else None
    d.update(method=after["method"], num_speculative_tokens=after["num_speculative_tokens"],
             verify_cuda_graphs=after["verify_cuda_graphs"], replay_agreement=after.get("replay_agreement"))
    if after["method"] == "replay":
        d["label"] = "replayed proposals at a set acceptance rate (dummy weights)"
    return d


class OptOutRecorder:
    """An engine seen through a benchmark driver: every request it adds opts out of speculative decoding, and each
    finished request's output is handed to the replay proposer (keyed by its prompt)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.proposer = engine.spec.proposer

    def add_request(self, request_id, prompt, params=None, *args, **kwargs):
        params = dataclasses.replace(params, speculative=False) if params is not None else \
            SamplingParams(speculative=False)
        return self.engine.add_request(request_id, prompt, params, *args, **kwargs)

    def step(self):
        outputs = self.engine.step()
        for o in outputs:
            if o.finished and o.finish_reason != "error":
                self.proposer.record(list(o.prompt_token_ids), list(o.output_token_ids))
        return outputs

    def __getattr__(self, name):
        return getattr(self.engine, name)


def record_for_replay(run, name: str, plan: list, concurrency: int, output_len: int, hard_deadline) -> dict:
    """The plan with speculation off, its outputs given to the replay proposer; returns that pass's figures."""
    import time

    from loraplex.bench.stats import summarize

    start = time.monotonic()
    timings, truncated = closed_loop(OptOutRecorder(run.engine), plan, run.adapter_refs, concurrency=concurrency,
                                     output_len=output_len, prefix=f"{name}-rec-", hard_deadline=hard_deadline)
    end = time.monotonic()
    s = summarize(f"{name} (no speculation, recorded)", timings, concurrency=concurrency, input_len=len(plan[0].prompt),
                  output_len=output_len, start=start, end=end, peak_memory_gib=None, peak_rss_gib=None,
                  truncated=truncated, extra={})
    return {k: v for k, v in s.to_dict().items() if k in ("name", "num_requests", "per_request_output_tok_s",
                                                           "per_request_decode_tok_s", "tpot_mean_ms",
                                                           "ttft_p50_ms", "duration_s", "truncated")}
