"""A torch-profiler look at decode steps of the running workload (where the step time goes).

    text = profile_decode(engine, plan, adapter_refs, concurrency=16, steps=5)

Starts ``concurrency`` requests, steps until every prompt is computed (all sequences decoding), then profiles
``steps`` engine steps and returns the operator table (CPU and device time, call counts) as text. Counts of
``aten::_local_scalar_dense`` / ``cudaStreamSynchronize`` / ``aten::item`` are the host syncs of a step.
"""
from __future__ import annotations

import time

import torch

from loraplex.bench.workload import PlannedRequest


def profile_decode(engine, plan: list[PlannedRequest], adapter_refs: list, *, concurrency: int, steps: int,
                   output_len: int, prefix: str, row_limit: int = 40) -> str:
    from loraplex.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    rids = []
    for req in plan[:concurrency]:
        rid = f"{prefix}{req.index}"
        engine.add_request(rid, req.prompt, params,
                           adapter=adapter_refs[req.adapter] if req.adapter is not None else None)
        rids.append(rid)
    started: set[str] = set()
    for _ in range(10_000):  # until every request has its first token (prefills done)
        for out in engine.step():
            if out.output_token_ids:
                started.add(out.request_id)
        if len(started) == len(rids):
            break
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t0 = time.monotonic()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    wall_ms = (time.monotonic() - t0) * 1e3 / steps
    for rid in rids:
        engine.abort(rid)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    head = (f"# decode profile {prefix}: {len(rids)} sequences decoding, {steps} steps, {wall_ms:.1f} ms per step "
            f"(wall, profiler on)\n")
    return (head + "\n## by device time\n" + prof.key_averages().table(sort_by=sort, row_limit=row_limit)
            + "\n## by CPU time\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit))
