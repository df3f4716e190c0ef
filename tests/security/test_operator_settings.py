"""Operator settings the model cannot honour are refused at start, in one line, before any weight loads:
``max_model_len`` past ``max_position_embeddings`` (the tiny llama has 256 positions; 2048 used to be accepted
and the first step past 256 died with IndexError in the rotary embedding), a step budget no full prompt fits in
with chunked prefill off, and weight-only expert quantization on a dense model. ``loraplex engine serve`` and
``loraplex serve`` print the message without a traceback and exit 2."""
from __future__ import annotations

import pytest

from loraplex.engine.engine_config import EngineConfig, EngineSettingsError
from tests.utils.platform_cli import refused_serve_line


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("models") / "tiny-llama"))


@pytest.mark.parametrize("settings,message", [
    (dict(max_model_len=2048), "above the model's max_position_embeddings (256)"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64), "could never be scheduled"),
    (dict(quantization="int8"), "the model (llama) is dense"),
    (dict(enable_lora=True, max_lora_rank=10_000), "largest rank"),
])
def test_engine_refuses_at_start(tiny_llama, settings, message):
    from loraplex.engine.llm_engine import LLMEngine

    with pytest.raises(EngineSettingsError) as e:
        LLMEngine(EngineConfig(model=tiny_llama, device="cpu", **settings))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_max_model_len_at_the_limit_is_accepted(tiny_llama):
    from loraplex.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_llama, device="cpu", max_model_len=256, num_kv_blocks=64,
                                    progress=False))
    assert engine.max_model_len == 256


def test_engine_serve_prints_one_line_and_exits(tiny_llama, capsys):
    from loraplex.cli import main

    assert main(["engine", "serve", "--model", tiny_llama, "--max-model-len", "2048", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loraplex engine serve: error: max_model_len=2048") and "\n" not in err, err
    assert "Traceback" not in err


def test_platform_serve_prints_one_line_and_exits(tiny_llama, tmp_path, monkeypatch, capsys):
    err = refused_serve_line(monkeypatch, capsys, {"LORAPLEX_BASE_MODEL_PATH": tiny_llama,
                                                   "LORAPLEX_MAX_MODEL_LEN": "2048", "LORAPLEX_DATA_DIR": str(tmp_path)})
    assert err.startswith("loraplex serve: error: embedded engine: max_model_len=2048"), err
