"""Per-request timings of a load run and their summary (percentiles, rates)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class RequestTiming:
    """Times are seconds on the driver's clock (``time.monotonic()`` in a real run). ``first_token`` is when the
    first output token was returned; ``scheduled`` when the engine first scheduled the request (its
    ``RequestMetrics.first_scheduled_time``: admission, after any wait for a seat, KV blocks or its adapter);
    ``adapter_cold``: its adapter was not resident on the GPU when the request was sent (None: base model or
    unknown). ``output_tokens`` counts every completion of an ``n > 1`` request."""

    request_id: str
    adapter: int | None
    prompt_tokens: int
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    output_tokens: int = 0
    group: str | None = None
    tenant: str | None = None
    scheduled: float | None = None
    adapter_cold: bool | None = None

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def queue_wait(self) -> float | None:
        """Arrival -> admission (None when the engine did not report it)."""
        return None if self.scheduled is None else max(0.0, self.scheduled - self.arrival)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def p50_p99(values: list[float], scale: float = 1.0) -> dict:
    """``{"n", "p50", "p99"}`` of ``values`` times ``scale`` (None percentiles for no values)."""
    if not values:
        return {"n": 0, "p50": None, "p99": None}
    return {"n": len(values), "p50": percentile(values, 50) * scale, "p99": percentile(values, 99) * scale}


@dataclass
class ScenarioSummary:
    """What one scenario reports. Rates per request are means over completed requests."""

    name: str
    num_requests: int
    concurrency: int
    input_len: int
    output_len: int
    total_output_tokens: int
    duration_s: float
    per_request_output_tok_s: float      # mean of output_tokens / end-to-end latency
    per_request_decode_tok_s: float      # mean of 1 / TPOT (the decode rate once the first token is out)
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_mean_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    e2e_p50_s: float
    output_throughput_tok_s: float       # all output tokens / wall time of the scenario
    total_throughput_tok_s: float        # prompt + output tokens / wall time
    peak_memory_gib: float | None        # GPU: torch.cuda.max_memory_allocated; None on CPU
    peak_rss_gib: float
    truncated: bool = False              # the time limit stopped it before every planned request ran
    queue_wait_p50_ms: float | None = None   # arrival -> admission by the engine (None: not reported)
    queue_wait_p99_ms: float | None = None
    steady_output_tok_s: float | None = None  # output tokens / time while all C clients had a request in flight
    extra: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(name: str, timings: list[RequestTiming], *, concurrency: int, input_len: int, output_len: int,
              start: float, end: float, peak_memory_gib: float | None, peak_rss_gib: float,
              truncated: bool = False, steady_output_tok_s: float | None = None,
              extra: dict | None = None) -> ScenarioSummary:
    done = [t for t in timings if t.finish is not None and t.first_token is not None]
    if not done:
        raise RuntimeError(f"scenario {name!r}: no request finished; raise the time limit or shrink the workload")
    ttft = [t.ttft * 1e3 for t in done]
    tpots = [t.tpot * 1e3 for t in done if t.tpot is not None]
    waits = p50_p99([t.queue_wait for t in done if t.queue_wait is not None], 1e3)
    out_tokens = sum(t.output_tokens for t in done)
    prompt_tokens = sum(t.prompt_tokens for t in done)
    duration = end - start
    return ScenarioSummary(
        name=name, num_requests=len(done), concurrency=concurrency, input_len=input_len, output_len=output_len,
        total_output_tokens=out_tokens, duration_s=duration,
        per_request_output_tok_s=sum(t.output_tokens / t.e2e for t in done) / len(done),
        per_request_decode_tok_s=(sum(1e3 / x for x in tpots) / len(tpots)) if tpots else float("nan"),
        ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
        tpot_mean_ms=(sum(tpots) / len(tpots)) if tpots else float("nan"),
        tpot_p50_ms=percentile(tpots, 50) if tpots else float("nan"),
        tpot_p99_ms=percentile(tpots, 99) if tpots else float("nan"),
        e2e_p50_s=percentile([t.e2e for t in done], 50),
        output_throughput_tok_s=out_tokens / duration, total_throughput_tok_s=(out_tokens + prompt_tokens) / duration,
        peak_memory_gib=peak_memory_gib, peak_rss_gib=peak_rss_gib, truncated=truncated,
        queue_wait_p50_ms=waits["p50"], queue_wait_p99_ms=waits["p99"], steady_output_tok_s=steady_output_tok_s,
        extra=extra)
