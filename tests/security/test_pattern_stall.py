"""A tenant's ``rank_pattern`` / ``alpha_pattern`` cannot stall the platform.

These tests are timed on purpose: the defect they guard against *is* time. Under Python's backtracking ``re``,
PEFT's rule ``re.match(rf"(.*\\.)?({P})$", key)`` takes exponential time in the key's length for patterns such as
``((\\w|\\.)*)*X`` (minutes to hours for a 30-character module key), and the upload held the GIL throughout: every
tenant's ``/healthz`` stalled. With linear-time matching the same work is microseconds. The bounds are chosen to
hold on a loaded 2-core CI machine: the pattern work is measured in CPU time of the calling thread (other
processes' load does not count) against 50 ms (~100x what it takes), and ``/healthz`` by its median latency over
many probes during concurrent uploads (a stall would make nearly every probe slow, so the median catches it while
ignoring scheduler hiccups)."""
from __future__ import annotations

import json
import statistics
import threading
import time

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora.format import (SUPPORTED_TARGETS, check_adapter, parse_adapter_config,
                                         read_safetensors_header)
from tests.security.live_stack import lora_files

# Each is exponential for a backtracking engine against "model.layers.N.self_attn.q_proj" (or a long key).
CATASTROPHIC = [r"((\w|\.)*)*X", r"(.*.*)*q_proj_", r"(a+)+$", r"((a|a)*)*b", r"(\w+\.?)*zz", r"(.*a){25}",
                r"([a-z_.0-9]+)*:", r"(x+x+)+y"]
PATTERN_CPU_BUDGET_S = 0.05
HEALTHZ_MEDIAN_BUDGET_S = 0.05


def _config(patterns: list[str]) -> dict:
    return {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
            "rank_pattern": {p: 4 for p in patterns}, "alpha_pattern": {p: 8 for p in patterns}}


def test_catastrophic_patterns_are_matched_in_linear_time(tmp_path):
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    base = make_tiny_checkpoint("llama", str(tmp_path / "base"))
    files = lora_files(base, config=_config(CATASTROPHIC))
    (tmp_path / "adapter_model.safetensors").write_bytes(files["adapter_model.safetensors"])
    header = read_safetensors_header(str(tmp_path / "adapter_model.safetensors"))
    model = ModelConfig.from_pretrained(base)
    keys = [f"model.layers.{i}.{t}" for i in range(8) for t in SUPPORTED_TARGETS]   # an 8-layer model's modules
    long_keys = ["a" * 20_000, "model." + "layers." * 3_000 + "q_proj", "x" * 20_000 + "y"]

    start = time.thread_time()
    config = parse_adapter_config(files["adapter_config.json"], max_rank=64)   # compiles every pattern
    spec = check_adapter(config, header, model, max_rank=64)                  # matches them per module (upload)
    for key in keys + long_keys:                                              # ...and as an engine load does
        config.rank_for(key), config.alpha_for(key)
    spent = time.thread_time() - start

    assert spent < PATTERN_CPU_BUDGET_S, f"{len(CATASTROPHIC)} patterns x {len(keys) + len(long_keys)} keys took " \
                                         f"{spent * 1000:.1f} ms of CPU"
    assert {m.rank for m in spec.modules} == {2}          # none of them names a real module: r applies
    assert config.rank_for("a" * 20_000) == 4             # (a+)+$ does match an all-'a' key, in linear time


def test_healthz_stays_fast_while_hostile_patterns_are_uploaded(stack):
    http = stack.server.http
    bodies = [lora_files(stack.base, config=_config(CATASTROPHIC[i:] + CATASTROPHIC[:i]))
              for i in range(len(CATASTROPHIC))]
    bad = lora_files(stack.base, config=_config(CATASTROPHIC + ["(?=lookahead)"]))   # refused, naming the key
    results: list[tuple[int, float]] = []

    def upload(i: int, files: dict) -> None:
        started = time.perf_counter()
        r = stack.upload(stack.owner_key, f"patterns-{i}", files)
        results.append((r.status_code, time.perf_counter() - started))

    threads = [threading.Thread(target=upload, args=(i, files)) for i, files in enumerate(bodies + [bad])]
    probes: list[float] = []
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) or len(probes) < 20:
        started = time.perf_counter()
        assert http.get("/healthz").status_code == 200
        probes.append(time.perf_counter() - started)
    for t in threads:
        t.join()

    assert sorted(code for code, _ in results) == [201] * len(bodies) + [422], results
    assert max(seconds for _, seconds in results) < 30, results       # each upload is bounded too
    assert statistics.median(probes) < HEALTHZ_MEDIAN_BUDGET_S, \
        f"/healthz median {statistics.median(probes) * 1000:.1f} ms over {len(probes)} probes during the uploads"
    r = http.get("/v1/adapters/patterns-0", headers=stack.auth())
    assert r.status_code == 200 and r.json()["versions"][0]["rank"] == 2


def test_a_pattern_refusal_names_the_key(stack):
    r = stack.upload(stack.owner_key, "lookbehind", lora_files(stack.base, config={
        "rank_pattern": {"(?<=self_attn\\.)q_proj": 4}}))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "bad_pattern" and "rank_pattern" in error["message"]
    assert "(?<=self_attn\\\\.)q_proj" in error["message"] or "(?<=self_attn\\.)q_proj" in error["message"]
    assert json.loads(r.text)["error"]["type"] == "invalid_request_error"
