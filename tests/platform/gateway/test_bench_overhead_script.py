"""benchmarks/gateway/bench_overhead.py at its smallest: the whole platform in a uvicorn subprocess (SQLite, local
blobs, in-process quotas, the null engine: no PostgreSQL or Redis), a tenant and key made through the admin API,
sequential and concurrent chat completions all answered 200, and the report's percentiles in order."""
from __future__ import annotations

import json
import math

from tests.utils.scripts import load_script

bench = load_script("gateway", "bench_overhead")


def test_small_run_reports_latency_and_throughput(capsys):
    assert bench.main(["--requests", "20", "--concurrency", "2", "--seconds", "0.5"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    assert (report["requests"], report["concurrency"], report["seconds"]) == (20, 2, 0.5)
    for key in ("gateway_ms", "gateway_stream_ms", "baseline_ms"):
        p = report[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)
    assert report["errors"] == 0 and report["requests_per_s"] > 0 and report["baseline_requests_per_s"] > 0
    assert math.isfinite(report["added_p50_ms"]) and math.isfinite(report["added_stream_p50_ms"])
    assert "cores, Python" in report["machine"]


def test_percentile_picks_the_nearest_rank():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [bench.percentile(xs, q) for q in (0, 0.5, 0.9, 0.99, 1)] == [1.0, 3.0, 5.0, 5.0, 5.0]
    assert bench.percentile([7.0], 0.99) == 7.0


def test_raw_post_is_a_complete_request():
    raw = bench.raw_post("/v1/chat/completions", {"model": "m", "messages": []}, "key-1")
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/chat/completions HTTP/1.1" and "Authorization: Bearer key-1" in lines
    assert f"Content-Length: {len(body)}" in lines and json.loads(body) == {"model": "m", "messages": []}
