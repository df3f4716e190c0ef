"""A torch-profiler look at decode steps of the running workload (where the step time goes).

    text = profile_decode(engine, plan, adapter_refs, concurrency=16, steps=5)

Starts ``concurrency`` requests, steps until every prompt is computed (all sequences decoding), then profiles
``steps`` engine steps and returns the operator table (CPU and device time, call counts) as text. Counts of
``aten::_local_scalar_dense`` / ``cudaStreamSynchronize`` / ``aten::item`` are the host syncs of a step.

Then one request is replaced by a new one and the steps that compute its prompt (the prefill a closed-loop
client's next request brings, mixed with the other sequences' decodes) are profiled too: what an arrival costs
every running request.
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
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    head = (f"# decode profile {prefix}: {len(rids)} sequences decoding, {steps} steps, {wall_ms:.1f} ms per step "
            f"(wall, profiler on)\n")
    text = (head + "\n## by device time\n" + prof.key_averages().table(sort_by=sort, row_limit=row_limit)
            + "\n## by CPU time\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit))
    if rids:
        text += _profile_arrival(engine, plan, adapter_refs, rids, params, prefix, cuda, sort, row_limit)
    for rid in rids:
        engine.abort(rid)
    return text


def _arrive(engine, req, adapter_refs, rids, params, rid, cuda) -> tuple[int, float]:
    """Replace the oldest request by ``rid`` (same prompt as ``req``) and step until its first token: (steps, ms)."""
    engine.abort(rids.pop(0))
    engine.add_request(rid, req.prompt, params, adapter=adapter_refs[req.adapter] if req.adapter is not None else None)
    rids.append(rid)
    if cuda:
        torch.cuda.synchronize()
    n, t0 = 0, time.monotonic()
    for _ in range(1000):
        n += 1
        outs = engine.step()
        if any(o.request_id == rid and o.output_token_ids for o in outs):
            break
    if cuda:
        torch.cuda.synchronize()
    return n, (time.monotonic() - t0) * 1e3


def _profile_arrival(engine, plan, adapter_refs, rids, params, prefix, cuda, sort, row_limit) -> str:
    """Arrivals: the oldest request replaced by a fresh one with the same prompt length, stepped until the new
    one's first token (its prefill mixed with the others' decodes). Two arrivals timed without the profiler, then
    one profiled (with speculation: the draft tokens its steps verified), then one under cProfile."""
    req = plan[0]
    walls = [_arrive(engine, req, adapter_refs, rids, params, f"{prefix}arrival{i}", cuda) for i in range(2)]
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    drafts = _drafts_verified(engine)
    with torch.profiler.profile(activities=activities) as prof:
        n, wall_ms = _arrive(engine, req, adapter_refs, rids, params, f"{prefix}arrival", cuda)
    plain = ", ".join(f"{k} steps {ms:.1f} ms" for k, ms in walls)
    spec = f"; drafts verified during it: {_drafts_verified(engine) - drafts}" if drafts is not None else ""
    python = _python_profile(lambda: _arrive(engine, req, adapter_refs, rids, params, f"{prefix}arrival-py", cuda))
    head = (f"\n# arrival profile {prefix}: a {len(req.prompt)}-token prompt joins {len(rids) - 1} decoding "
            f"sequences; without the profiler: {plain}; profiled: {n} steps until its first token, {wall_ms:.1f} ms "
            f"in all{spec}\n")
    return (head + "\n## by device time\n" + prof.key_averages().table(sort_by=sort, row_limit=row_limit)
            + "\n## by CPU time\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)
            + "\n## Python functions (cProfile, one more arrival; times inflated by the profiler)\n" + python)


def _drafts_verified(engine) -> int | None:
    """Draft tokens the engine has verified since it started (None: it does not speculate)."""
    spec = getattr(engine, "spec", None)
    return spec.stats.total.proposed if spec is not None else None


def _python_profile(fn, limit: int = 30) -> str:
    """cProfile of ``fn()``: the top functions by own time, then by cumulative time (where host time goes)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs()
    stats.sort_stats("tottime").print_stats(limit)
    stats.sort_stats("cumulative").print_stats(limit)
    return buf.getvalue()
