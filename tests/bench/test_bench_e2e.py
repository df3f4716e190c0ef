"""``loraplex bench serve --url`` end to end against a real platform on embedded defaults (SQLite, a local blob
folder, the in-process engine on the tiny llama on CPU, served by uvicorn): two tenants with their own keys and
adapters, uploaded through the API; the sweep (C=1,2), the churn run and the fairness run stream through the
official ``openai`` client and give the same report format as in process."""
from __future__ import annotations

import json

import pytest

from tests.platform.gateway.conftest import settings_for


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    """(LiveServer, keys file path, {tenant: [adapter names]}) of a platform with two tenants."""
    from loraplex.commands.db import run
    from loraplex.engine.testing.tiny import make_tiny_checkpoint
    from loraplex.platform.main import create_app
    from tests.platform.gateway.conftest import LiveServer, make_adapter

    root = tmp_path_factory.mktemp("bench-e2e")
    base = make_tiny_checkpoint("llama", str(root / "tiny-llama"))
    settings = settings_for(root, base, engine_mode="embedded", engine_device="cpu", engine_dtype="float32")
    run("upgrade", "head", url=settings.sqlalchemy_url)
    server = LiveServer(create_app(settings))
    tenants = []
    for name, seed in (("light", 1), ("heavy", 2)):
        _, key = server.new_tenant()
        adapter = f"{name}-bot"
        server.upload(key, adapter, make_adapter(base, str(root / f"adapter-{name}"), seed=seed))
        tenants.append({"name": name, "key": key, "adapters": [adapter]})
    keys = root / "keys.json"
    keys.write_text(json.dumps({"tenants": tenants}), encoding="utf-8")
    yield server, str(keys), tenants
    server.stop()


def _bench(server, keys, out, *args) -> dict:
    from loraplex.cli import main

    rc = main(["bench", "serve", "--scale", "tiny", "--url", server.url + "/v1", "--keys-file", keys,
               "--vocab-size", "300", "--input-len", "12", "--output-len", "4", "--out", str(out), *args])
    assert rc == 0
    return json.loads((out / "bench_serve.json").read_text(encoding="utf-8"))


def test_sweep_through_the_platform_counts_every_streamed_token(platform, tmp_path):
    server, keys, tenants = platform
    report = _bench(server, keys, tmp_path / "sweep", "--concurrency", "1,2", "--num-requests", "3",
                    "--results-dir", str(tmp_path / "results"))
    assert report["mode"] == "end-to-end" and report["scenario"] == "load"
    assert tenants[0]["key"] not in json.dumps(report)                                  # no tenant key in a report
    names = [s["name"] for s in report["scenarios"]]
    assert names == ["e2e base-only C=1", "e2e base-only C=2", "e2e 2 adapters r4 C=1", "e2e 2 adapters r4 C=2"]
    for s in report["scenarios"]:
        e = s["extra"]
        assert e["errors"] == 0 and not s["truncated"]
        assert s["num_requests"] == e["planned_requests"] == max(3, 2 * e["level"])   # sweep: >= 2 per client
        assert s["total_output_tokens"] == 4 * s["num_requests"]                       # usage of the final chunk
        assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"] and s["tpot_mean_ms"] > 0
        assert "graph_steps" not in e and e["engine_steps"] is None                    # not seen from outside
    assert report["scenarios"][2]["extra"]["requests_per_adapter"] == {"0": 2, "1": 1}  # even over both tenants'
    assert report["engine"]["e2e"]["base_model"] == server.gateway.model_name
    stem = report["name"]
    assert stem.startswith("sweep-gpt-oss-tiny-e2e-") and (tmp_path / "results" / f"{stem}.json").is_file()


def test_fairness_through_the_platform_sends_each_tenant_with_its_key(platform, tmp_path):
    server, keys, _ = platform
    report = _bench(server, keys, tmp_path / "fair", "--scenario", "fairness", "--light-rate", "2",
                    "--heavy-factor", "3", "--arrivals", "fixed", "--scenario-time", "3")
    alone, beside = report["scenarios"]
    assert alone["name"] == "e2e light alone" and beside["name"] == "e2e light beside heavy"
    assert alone["extra"]["groups"]["light"]["requests_started"] == 6                  # 2 req/s for 3 s, fixed
    heavy = beside["extra"]["groups"]["heavy"]
    assert heavy["requests_started"] >= 1 and heavy["output_tokens"] > 0
    assert beside["extra"]["errors"] == 0
    assert set(report["ratios"]) == {"light TTFT p50 e2e beside heavy / alone", "light TTFT p99 e2e beside heavy / alone"}
    md = (tmp_path / "fair" / "bench_serve.md").read_text(encoding="utf-8")
    assert "| e2e light beside heavy | heavy |" in md


def test_churn_through_the_platform_with_one_tenants_key(platform, tmp_path):
    server, _, tenants = platform
    from loraplex.cli import main

    light = tenants[0]
    rc = main(["bench", "serve", "--scale", "tiny", "--url", server.url + "/v1", "--api-key", light["key"],
               "--adapters", ",".join(light["adapters"]), "--scenario", "churn", "--mix", "zipf", "--concurrency", "2",
               "--num-requests", "4", "--vocab-size", "300", "--input-len", "12", "--output-len", "4", "--out",
               str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "bench_serve.json").read_text(encoding="utf-8"))
    (row,) = report["scenarios"]
    assert row["name"] == "e2e 1 adapters r4" and row["num_requests"] == 4 and row["extra"]["errors"] == 0
    assert row["extra"]["requests_per_adapter"] == {"0": 4}
    assert "--api-key KEY" in report["command"] and light["key"] not in json.dumps(report)


def test_a_refused_key_is_counted_not_raised(platform, tmp_path):
    server, _, tenants = platform
    from loraplex.cli import main

    bad = tmp_path / "keys.json"
    bad.write_text(json.dumps({"tenants": [{"name": "x", "key": "lpx-not-a-key", "adapters": ["light-bot"]}],
                               "base_model": server.gateway.model_name}), encoding="utf-8")
    rc = main(["bench", "serve", "--scale", "tiny", "--url", server.url + "/v1", "--keys-file", str(bad),
               "--vocab-size", "300", "--input-len", "8", "--output-len", "2", "--concurrency", "1",
               "--num-requests", "2", "--no-warmup", "--out", str(tmp_path / "o")])
    assert rc == 0
    report = json.loads((tmp_path / "o" / "bench_serve.json").read_text(encoding="utf-8"))
    assert report["scenarios"] == []
    assert all("AuthenticationError" in s for s in report["skipped"]) and len(report["skipped"]) == 2
