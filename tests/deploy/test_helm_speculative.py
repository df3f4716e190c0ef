"""Speculative decoding in the chart (engine.speculative) and its Grafana row, rendered by real Helm:

    off by default      no speculative flag in any values file; the engine's config gets speculative=None
    each method         the flags rendered, parsed by the real `loraplex engine serve` into the engine's config
    bad combinations    `fail` at render time, the message naming the value (schema: types and unknown keys)
    end to end          the rendered args start a real engine (tiny model, CPU) that speculates; its /metrics
                        carries every metric the engines dashboard's queries name
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import helm_python as helm
import httpx
import kubernetes_validate
import pytest

from tests.deploy.conftest import CHART, KUBE_VERSION, REPO, VALUES_FILES, engine_config_of, load_values, render
from tests.utils.grafana import check_grid

ENGINES_DASHBOARD = REPO / "deploy" / "grafana" / "loraplex-engines-dashboard.json"
SPEC_FLAG = re.compile(r"^--(num-)?speculative")


def engine_args(rendering) -> list[str]:
    return rendering.one("StatefulSet", "-engine")["spec"]["template"]["spec"]["containers"][0]["args"]


def speculative_args(rendering) -> list[str]:
    """The speculative part of the engine's args (flags and their values), in order."""
    args = engine_args(rendering)
    starts = [i for i, a in enumerate(args) if SPEC_FLAG.match(a)]
    return args[starts[0]:starts[-1] + 2] if starts else []


def flag_values(args: list[str]) -> dict[str, list[str | None]]:
    """--flag -> its values (None for a switch), repeated flags in order."""
    out: dict[str, list[str | None]] = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            out.setdefault(a, []).append(value)
    return out


# ----------------------------------------------------------------------------------------------------- off


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_speculation_is_off_by_default(rendered, name, monkeypatch):
    args = engine_args(rendered[name])
    assert not [a for a in args if SPEC_FLAG.match(a)], args
    assert engine_config_of(rendered[name], monkeypatch)["speculative"] is None


def test_an_empty_method_turns_speculation_off_whatever_else_is_set():
    r = render({"engine": {"speculative": {"method": "", "draftModel": "/models/small", "numSpeculativeTokens": 99,
                                           "draftAdapters": {"t/a/1": "/models/d"}}}})
    assert speculative_args(r) == []


# ------------------------------------------------------------------------------------------------ methods


METHODS = {
    "ngram": ({"method": "ngram", "numSpeculativeTokens": 4, "ngramMin": 2, "ngramMax": 6},
              ["--speculative-method", "ngram", "--num-speculative-tokens", "4", "--speculative-verify-cuda-graphs",
               "--speculative-ngram-min", "2", "--speculative-ngram-max", "6"],
              {"method": "ngram", "num_speculative_tokens": 4, "ngram_min": 2, "ngram_max": 6,
               "verify_cuda_graphs": True, "draft_model": None, "draft_head": None}),
    "draft": ({"method": "draft", "draftModel": "/models/Qwen3-0.6B", "draftNumKvBlocks": 4096},
              ["--speculative-method", "draft", "--num-speculative-tokens", "3", "--speculative-draft-model",
               "/models/Qwen3-0.6B", "--speculative-verify-cuda-graphs", "--speculative-draft-num-kv-blocks", "4096"],
              {"method": "draft", "num_speculative_tokens": 3, "draft_model": "/models/Qwen3-0.6B",
               "draft_num_kv_blocks": 4096, "verify_cuda_graphs": True, "ngram_min": 1, "ngram_max": 4}),
    "draft-adapters": ({"method": "draft", "draftModel": "/models/small", "verifyCudaGraphs": False,
                        "draftAdapters": {"t1/bot/v2": "/models/drafts/bot", "t0/qa/v1": "/models/drafts/qa"},
                        "discoverDraftAdapters": True, "draftMaxLoraRank": 32},
                       ["--speculative-method", "draft", "--num-speculative-tokens", "3", "--speculative-draft-model",
                        "/models/small", "--speculative-draft-adapter", "t0/qa/v1=/models/drafts/qa",
                        "--speculative-draft-adapter", "t1/bot/v2=/models/drafts/bot",
                        "--speculative-discover-draft-adapters", "--speculative-draft-max-lora-rank", "32"],
                       {"method": "draft", "verify_cuda_graphs": False, "discover_draft_adapters": True,
                        "draft_adapters": {"t0/qa/v1": "/models/drafts/qa", "t1/bot/v2": "/models/drafts/bot"},
                        "draft_max_lora_rank": 32}),
    "eagle": ({"method": "eagle", "draftHead": "/models/heads/base", "numSpeculativeTokens": 2,
               "adapterDraftHeads": {"t1/bot/v2": "/models/heads/bot"}},
              ["--speculative-method", "eagle", "--num-speculative-tokens", "2", "--speculative-draft-head",
               "/models/heads/base", "--speculative-verify-cuda-graphs", "--speculative-adapter-draft-head",
               "t1/bot/v2=/models/heads/bot"],
              {"method": "eagle", "num_speculative_tokens": 2, "draft_head": "/models/heads/base",
               "draft_heads": {"t1/bot/v2": "/models/heads/bot"}, "verify_cuda_graphs": True}),
    "eagle3": ({"method": "eagle3", "draftHead": "/models/EAGLE3-LLaMA3.1-Instruct-8B", "draftNumKvBlocks": 2048,
                "numSpeculativeTokens": 16},
               ["--speculative-method", "eagle3", "--num-speculative-tokens", "16", "--speculative-draft-head",
                "/models/EAGLE3-LLaMA3.1-Instruct-8B", "--speculative-verify-cuda-graphs",
                "--speculative-draft-num-kv-blocks", "2048"],
               {"method": "eagle3", "num_speculative_tokens": 16, "draft_head": "/models/EAGLE3-LLaMA3.1-Instruct-8B",
                "draft_num_kv_blocks": 2048, "draft_model": None}),
}


@pytest.mark.parametrize("case", list(METHODS))
def test_each_method_renders_its_flags_and_the_engine_parses_them(case, monkeypatch):
    values, want_args, want_config = METHODS[case]
    r = render({"engine": {"speculative": values}})
    assert speculative_args(r) == want_args
    args = engine_args(r)
    assert args[-len(want_args):] == want_args                      # after the chart's own flags, before extraArgs
    kubernetes_validate.validate(r.one("StatefulSet", "-engine"), KUBE_VERSION, strict=True)
    spec = engine_config_of(r, monkeypatch)["speculative"]          # the real CLI: argparse + speculative_config
    assert {k: spec.get(k) for k in want_config} == want_config

    from loraplex.engine.spec_decode.config import SpeculativeConfig

    SpeculativeConfig.from_value(spec)                              # and the engine's own checks pass


def test_extra_args_still_come_last_and_production_values_take_speculation():
    values = {**load_values("production")}
    values["engine"] = {**values["engine"], "extraArgs": ["--max-model-len", "16384"],
                        "speculative": {"method": "ngram"}}
    r = render(values)
    args = engine_args(r)
    assert args[-2:] == ["--max-model-len", "16384"]
    assert flag_values(args)["--speculative-method"] == ["ngram"]
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], (problems, report["errors"])


# -------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("values,message", [
    ({"method": "replay"}, 'engine.speculative.method "replay" is for benchmarks only'),
    ({"method": "medusa"}, 'engine.speculative.method "medusa" is not supported; choose "" (off), ngram, draft, eagle '
                           'or eagle3'),
    ({"method": "ngram", "numSpeculativeTokens": 0}, "engine.speculative.numSpeculativeTokens must be in 1..16, got 0"),
    ({"method": "ngram", "numSpeculativeTokens": 17},
     "engine.speculative.numSpeculativeTokens must be in 1..16, got 17"),
    ({"method": "draft"}, "engine.speculative.method draft needs engine.speculative.draftModel"),
    ({"method": "eagle"}, "engine.speculative.method eagle needs engine.speculative.draftHead"),
    ({"method": "eagle3"}, "engine.speculative.method eagle3 needs engine.speculative.draftHead"),
    ({"method": "ngram", "draftModel": "/models/small"}, 'engine.speculative.draftModel is set but method is "ngram"'),
    ({"method": "draft", "draftModel": "/models/small", "draftHead": "/models/h"},
     'engine.speculative.draftHead is set but method is "draft"'),
    ({"method": "draft", "draftModel": "models/small"},
     'engine.speculative.draftModel "models/small" must be an absolute path'),
    ({"method": "eagle3", "draftHead": "/models/e3", "draftAdapters": {"t/a/1": "/models/d"}},
     'engine.speculative.draftAdapters / discoverDraftAdapters are set but method is "eagle3"'),
    ({"method": "ngram", "discoverDraftAdapters": True},
     'engine.speculative.draftAdapters / discoverDraftAdapters are set but method is "ngram"'),
    ({"method": "eagle3", "draftHead": "/models/e3", "adapterDraftHeads": {"t/a/1": "/models/h"}},
     'engine.speculative.adapterDraftHeads is set but method is "eagle3"'),
    ({"method": "ngram", "ngramMin": 5}, "engine.speculative.ngramMin (5) must be <= engine.speculative.ngramMax (4)"),
])
def test_bad_combinations_fail_the_render_naming_the_value(values, message):
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render({"engine": {"speculative": values}})


@pytest.mark.parametrize("extra", [["--tensor-parallel-size", "2"], ["--tensor-parallel-size=4"]])
def test_speculation_with_tensor_parallel_extra_args_fails_the_render(extra):
    with pytest.raises(helm.HelmRenderError, match="engine.speculative.method ngram needs tensor parallel size 1"):
        render({"engine": {"extraArgs": extra, "speculative": {"method": "ngram"}}})
    render({"engine": {"extraArgs": extra}})                         # without speculation the chart lets it through
    render({"engine": {"extraArgs": ["--tensor-parallel-size", "1"], "speculative": {"method": "ngram"}}})


@pytest.mark.parametrize("values,key", [
    ({"method": "ngram", "numSpeculativeTokens": "3"}, "numSpeculativeTokens"),
    ({"method": "ngram", "verifyCudaGraphs": "yes"}, "verifyCudaGraphs"),
    ({"method": "ngram", "ngramMax": 65}, "ngramMax"),
    ({"method": "draft", "draftModel": "/m", "draftNumKvBlocks": 0}, "draftNumKvBlocks"),
    ({"method": "draft", "draftModel": "/m", "draftAdapters": {"t/a/1": ""}}, "draftAdapters"),
    ({"method": "draft", "drafModel": "/m"}, "drafModel"),          # a typo: refused, not ignored
])
def test_schema_refuses_wrong_types_and_unknown_keys(values, key):
    with pytest.raises(helm.HelmValuesError, match=key):
        render({"engine": {"speculative": values}})


# ---------------------------------------------------------------------------------------------- Grafana


def _dashboard() -> dict:
    with open(ENGINES_DASHBOARD) as f:
        return json.load(f)


def _exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_engines_dashboard_has_a_speculative_decoding_row_laid_out_cleanly():
    dash = _dashboard()
    assert dash["uid"] == "loraplex-engines" and dash["uid"] != "loraplex-overview"
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == ["Speculative decoding"]
    titles = {p["title"] for p in dash["panels"]}
    assert {"Acceptance length by adapter (top 10)", "Draft tokens proposed vs accepted /s",
            "Acceptance rate by adapter (top 10)"} <= titles
    check_grid(dash)
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    for expr in _exprs(dash):
        for open_, close in ("()", "[]", "{}"):
            assert expr.count(open_) == expr.count(close), expr
        assert 'pod=~"$pod"' in expr, expr                           # every query follows the pod picker
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "pod"}
    by_title = {p["title"]: p for p in dash["panels"]}
    top = by_title["Acceptance length by adapter (top 10)"]["targets"][0]["expr"]
    assert "topk(10, sum by (adapter) (rate(loraplex_engine_server_spec_verifications_total" in top


@pytest.fixture(scope="module")
def speculating_engine(tiny_checkpoint, tmp_path_factory):
    """The engine container's args as the chart renders them with engine.speculative.method=ngram, run as a real
    `loraplex engine serve` on the tiny llama (CPU): host, port and cache folder swapped for local ones."""
    from tests.utils.services import free_port, wait_for_port

    model = tiny_checkpoint("llama")
    r = render({"model": {"path": model}, "engine": {"dtype": "float32", "speculative": {"method": "ngram"}}})
    args = engine_args(r)
    port, work = free_port(), tmp_path_factory.mktemp("speculating-engine")
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port)), ("--adapter-cache-dir", str(work / "cache"))):
        args[args.index(flag) + 1] = value
    log = work / "engine.log"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", *args, "--device", "cpu",
                                 "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=stderr,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_port(port, timeout=60, proc=proc)
        deadline = time.monotonic() + 120
        while not httpx.get(f"{url}/health", timeout=5).json().get("ready"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


def test_rendered_args_start_an_engine_whose_metrics_feed_every_dashboard_query(speculating_engine):
    from prometheus_client.parser import text_string_to_metric_families

    from loraplex.platform.engines.http_client import HttpEngineClient
    from loraplex.platform.engines.messages import EngineRequest

    async def generate():
        client = HttpEngineClient(speculating_engine)
        try:                                                         # a repeated prompt: n-gram lookups hit
            return [c async for c in client.generate(EngineRequest(
                "r-spec", "tenant-s", [5, 17, 42, 99] * 4, {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}))]
        finally:
            await client.close()

    assert asyncio.run(generate())[-1].completion_tokens == 12
    text = httpx.get(f"{speculating_engine}/metrics", timeout=10).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    names = {name for name, _ in samples}
    assert samples[("loraplex_engine_server_spec_verifications_total", (("adapter", "_base"),))] >= 1
    assert samples[("loraplex_engine_server_spec_proposed_tokens_total", (("adapter", "_base"),))] >= 1
    assert samples[("loraplex_engine_server_spec_verify_steps_total", ())] >= 1
    used = {n for e in _exprs(_dashboard()) for n in re.findall(r"\bloraplex_[a-z0-9_]+", e)}
    assert {f"loraplex_engine_server_spec_{n}_total" for n in
            ("proposed_tokens", "accepted_tokens", "verifications", "emitted_tokens", "verify_steps")} <= used
    assert used <= names, sorted(used - names)
    variable = next(v for v in _dashboard()["templating"]["list"] if v["name"] == "pod")
    assert re.search(r"label_values\((loraplex_[a-z0-9_]+), pod\)", variable["definition"]).group(1) in names
