"""The embedded engine's speculative settings (``LORAPLEX_ENGINE_SPECULATIVE_*``, gateway/speculation.py): what the
engine gets, and every wrong combination refused before anything loads, in one line naming the setting
(``loraplex serve`` prints it and exits 2)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from loraplex.engine.engine_config import EngineSettingsError
from loraplex.platform.core.config import Settings
from loraplex.platform.gateway.engines import build_replicas, check_engine_settings, embedded_engine_kwargs
from loraplex.platform.gateway.speculation import embedded_speculative
from tests.utils.platform_cli import refused_serve_line


def settings(**kw) -> Settings:
    return Settings(_env_file=None, **kw)


def test_off_by_default_and_for_none():
    assert settings().engine_speculative_method is None and settings().engine_num_speculative_tokens == 3
    for off in ("none", "None", "", "off"):
        assert settings(engine_speculative_method=off).engine_speculative_method is None
    assert embedded_speculative(settings()) is None
    assert embedded_engine_kwargs(settings())["speculative"] is None


def test_what_the_embedded_engine_gets(tiny_base, tmp_path):
    from loraplex.engine.engine_config import EngineConfig

    s = settings(engine_speculative_method="NGRAM", engine_num_speculative_tokens=5)
    assert embedded_engine_kwargs(s)["speculative"] == {"method": "ngram", "num_speculative_tokens": 5}
    draft = settings(engine_speculative_method="draft", engine_speculative_draft_model=tiny_base)
    assert embedded_speculative(draft) == {"method": "draft", "num_speculative_tokens": 3, "draft_model": tiny_base}
    for method in ("eagle", "eagle3"):
        head = settings(engine_speculative_method=method, engine_speculative_draft_head=tiny_base)
        assert embedded_speculative(head) == {"method": method, "num_speculative_tokens": 3, "draft_head": tiny_base}
    config = EngineConfig(model=tiny_base, **embedded_engine_kwargs(draft))
    assert config.speculative.method == "draft" and config.speculative.draft_model == tiny_base


def test_k_bounds_are_the_engines():
    from loraplex.engine.spec_decode.config import MAX_SPECULATIVE_TOKENS

    bounds = Settings.model_fields["engine_num_speculative_tokens"].metadata
    assert {getattr(m, "ge", None) for m in bounds} >= {1} and {getattr(m, "le", None) for m in bounds} >= {
        MAX_SPECULATIVE_TOKENS}
    settings(engine_num_speculative_tokens=MAX_SPECULATIVE_TOKENS)


@pytest.mark.parametrize("env,value,message", [
    ("LORAPLEX_ENGINE_SPECULATIVE_METHOD", "replay", "'replay' is for benchmarks only"),
    ("LORAPLEX_ENGINE_SPECULATIVE_METHOD", "medusa", "Input should be 'ngram', 'draft', 'eagle' or 'eagle3'"),
    ("LORAPLEX_ENGINE_NUM_SPECULATIVE_TOKENS", "0", "greater than or equal to 1"),
    ("LORAPLEX_ENGINE_NUM_SPECULATIVE_TOKENS", "17", "less than or equal to 16"),
    ("LORAPLEX_ENGINE_NUM_SPECULATIVE_TOKENS", "three", "valid integer"),
])
def test_values_that_do_not_parse(monkeypatch, env, value, message):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValidationError) as e:
        Settings(_env_file=None)
    assert message in str(e.value), str(e.value)


def _refusal(tmp_path, **kw) -> str:
    with pytest.raises(EngineSettingsError) as e:
        check_engine_settings(settings(data_dir=str(tmp_path), **kw))
    message = str(e.value)
    assert "\n" not in message
    return message


def test_wrong_combinations_are_refused(tiny_base, tmp_path):
    no_config = tmp_path / "empty"
    no_config.mkdir()
    cases = [
        (dict(engine_speculative_method="draft"),
         "LORAPLEX_ENGINE_SPECULATIVE_METHOD=draft needs LORAPLEX_ENGINE_SPECULATIVE_DRAFT_MODEL"),
        (dict(engine_speculative_method="eagle"),
         "LORAPLEX_ENGINE_SPECULATIVE_METHOD=eagle needs LORAPLEX_ENGINE_SPECULATIVE_DRAFT_HEAD"),
        (dict(engine_speculative_method="eagle3"),
         "LORAPLEX_ENGINE_SPECULATIVE_METHOD=eagle3 needs LORAPLEX_ENGINE_SPECULATIVE_DRAFT_HEAD"),
        (dict(engine_speculative_method="draft", engine_speculative_draft_model=str(no_config)),
         f"LORAPLEX_ENGINE_SPECULATIVE_DRAFT_MODEL='{no_config}' has no config.json"),
        (dict(engine_speculative_method="eagle3", engine_speculative_draft_head=str(no_config)),
         f"LORAPLEX_ENGINE_SPECULATIVE_DRAFT_HEAD='{no_config}' has no config.json"),
        (dict(engine_speculative_method="ngram", engine_speculative_draft_model=tiny_base),
         "LORAPLEX_ENGINE_SPECULATIVE_DRAFT_MODEL is set but LORAPLEX_ENGINE_SPECULATIVE_METHOD is ngram"),
        (dict(engine_speculative_draft_head=tiny_base),
         "LORAPLEX_ENGINE_SPECULATIVE_DRAFT_HEAD is set but LORAPLEX_ENGINE_SPECULATIVE_METHOD is unset"),
        (dict(engine_speculative_method="draft", engine_speculative_draft_model=tiny_base,
              engine_speculative_draft_head=tiny_base),
         "LORAPLEX_ENGINE_SPECULATIVE_DRAFT_HEAD is set but LORAPLEX_ENGINE_SPECULATIVE_METHOD is draft"),
        (dict(engine_speculative_method="ngram", engine_urls=["http://engine-0:8101"]),
         "LORAPLEX_ENGINE_URLS names separate engines: start them with `loraplex engine serve "
         "--speculative-method ngram`"),
        (dict(engine_speculative_method="ngram", engine_mode="null"),
         "LORAPLEX_ENGINE_MODE=null; set LORAPLEX_ENGINE_MODE=embedded"),
    ]
    for kw, message in cases:
        assert message in _refusal(tmp_path, **kw), kw
        assert message in _refusal(tmp_path, base_model_path=tiny_base, **kw), kw


def test_refused_before_anything_loads(tiny_base, tmp_path, monkeypatch):
    """The gateway builds no engine on refused settings (Gateway.build logs the line; inference answers 503)."""
    from loraplex.engine.async_engine import AsyncEngine

    def no_load(*a, **kw):
        raise AssertionError("the engine was loaded")

    monkeypatch.setattr(AsyncEngine, "from_pretrained", no_load)
    with pytest.raises(EngineSettingsError, match="needs LORAPLEX_ENGINE_SPECULATIVE_DRAFT_MODEL"):
        build_replicas(settings(data_dir=str(tmp_path), base_model_path=tiny_base, engine_speculative_method="draft"),
                       model_name="tiny")


@pytest.mark.parametrize("env,line", [
    ({"LORAPLEX_ENGINE_SPECULATIVE_METHOD": "draft"},
     "loraplex serve: error: LORAPLEX_ENGINE_SPECULATIVE_METHOD=draft needs LORAPLEX_ENGINE_SPECULATIVE_DRAFT_MODEL"),
    ({"LORAPLEX_ENGINE_SPECULATIVE_METHOD": "replay"},
     "loraplex serve: error: LORAPLEX_ENGINE_SPECULATIVE_METHOD: 'replay' is for benchmarks only"),
    ({"LORAPLEX_ENGINE_SPECULATIVE_METHOD": "ngram", "LORAPLEX_ENGINE_NUM_SPECULATIVE_TOKENS": "32"},
     "loraplex serve: error: LORAPLEX_ENGINE_NUM_SPECULATIVE_TOKENS: Input should be less than or equal to 16"),
])
def test_platform_serve_prints_one_line_and_exits(tiny_base, tmp_path, monkeypatch, capsys, env, line):
    err = refused_serve_line(monkeypatch, capsys, {"LORAPLEX_BASE_MODEL_PATH": tiny_base,
                                                   "LORAPLEX_DATA_DIR": str(tmp_path), **env})
    assert err.startswith(line), err
