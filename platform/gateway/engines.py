"""Engine replicas from the settings: HTTP clients for ``ENGINE_URLS`` (separate ``loraplex engine serve``
processes), else one in-process replica: the embedded engine on ``BASE_MODEL_PATH`` or the null engine."""
from __future__ import annotations

import logging
import os

from loraplex.platform.core.config import Settings
from loraplex.platform.engines.http_client import HttpEngineClient
from loraplex.platform.engines.inprocess import InProcessEngineClient, NullEngineClient
from loraplex.platform.gateway.speculation import check_speculative_settings, embedded_speculative
from loraplex.platform.routing import Replica

logger = logging.getLogger(__name__)


class EngineConfigError(ValueError):
    """The settings name no engine the gateway can build; the message says which setting to change."""


def build_replicas(settings: Settings, *, model_name: str) -> list[Replica]:
    """One ``Replica`` per engine. ``ENGINE_URLS`` wins; else ``ENGINE_MODE`` embedded | null | none."""
    if settings.engine_urls:
        return [Replica(url.rstrip("/"), HttpEngineClient(url)) for url in settings.engine_urls]
    if settings.engine_mode == "null":
        return [Replica("null", NullEngineClient(num_tokens=settings.engine_null_tokens, model_name=model_name,
                                                 limits=null_engine_limits(settings)))]
    if settings.engine_mode == "none":
        return []
    if not settings.base_model_path:
        raise EngineConfigError("the embedded engine needs LORAPLEX_BASE_MODEL_PATH (an HF folder with weights and "
                                "a tokenizer); or set LORAPLEX_ENGINE_URLS, or LORAPLEX_ENGINE_MODE=null|none")
    return [Replica("embedded", embedded_engine_client(settings, model_name=model_name))]


def embedded_engine_kwargs(settings: Settings) -> dict:
    """``EngineConfig`` fields of the embedded engine (``EngineSettingsError`` for speculative settings that do not
    go together)."""
    return dict(device=settings.engine_device, dtype=settings.engine_dtype, progress=False,
                max_num_seqs=settings.engine_max_num_seqs, max_model_len=settings.max_model_len, enable_lora=True,
                max_loras=settings.engine_max_loras, max_lora_rank=settings.engine_max_lora_rank,
                max_cpu_loras=max(16, settings.engine_max_loras or 0),
                adapter_cache_dir=os.path.join(os.path.abspath(settings.data_dir), "adapter-cache"),
                speculative=embedded_speculative(settings))


def check_engine_settings(settings: Settings) -> None:
    """Refuses, before anything loads, engine settings the base model cannot honour (``EngineSettingsError``,
    one line: ``loraplex serve`` prints it and exits). Separate engines (``ENGINE_URLS``) check their own at start;
    the gateway's context length must still fit the base model; speculative settings must go together."""
    check_speculative_settings(settings)
    if not settings.base_model_path:
        return
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.engine_config import EngineConfig, EngineSettingsError, check_against_model

    model = ModelConfig.from_pretrained(settings.base_model_path)
    if settings.engine_urls or settings.engine_mode != "embedded":
        if settings.max_model_len is not None and settings.max_model_len > model.max_position_embeddings:
            raise EngineSettingsError(
                f"LORAPLEX_MAX_MODEL_LEN={settings.max_model_len} is above the base model's max_position_embeddings "
                f"({model.max_position_embeddings}); set it <= {model.max_position_embeddings}")
        return
    try:
        check_against_model(EngineConfig(model=settings.base_model_path, **embedded_engine_kwargs(settings)), model)
    except EngineSettingsError as e:
        raise EngineSettingsError(f"embedded engine: {e} (LORAPLEX_* settings)") from None


def null_engine_limits(settings: Settings) -> dict | None:
    """The null engine reports what the embedded engine on the same settings would serve (so the platform's limit
    checks run the same way without a model); nothing without a base model."""
    if not settings.base_model_path:
        return None
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.server.protocol import limits_dict

    return limits_dict(ModelConfig.from_pretrained(settings.base_model_path), lora=True,
                       max_lora_rank=settings.engine_max_lora_rank, max_loras=settings.engine_max_loras,
                       max_model_len=settings.max_model_len, quantization=None)


def embedded_engine_client(settings: Settings, *, model_name: str) -> InProcessEngineClient:
    """The engine in this process (LoRA on), with the blob store's fetcher registered for ``s3://`` references."""
    from loraplex.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_pretrained(settings.base_model_path, **embedded_engine_kwargs(settings))
    if settings.blob_backend == "s3":
        from loraplex.engine.lora.fetch_s3 import S3Fetcher

        engine.engine.adapters.register_fetcher("s3", S3Fetcher(
            endpoint_url=settings.s3_endpoint_url, region=settings.s3_region,
            access_key_id=settings.s3_access_key_id,
            secret_access_key=settings.s3_secret_access_key.get_secret_value()
            if settings.s3_secret_access_key else None))
    logger.info("embedded engine ready (model %s)", model_name)
    return InProcessEngineClient.from_engine(engine, model_name=model_name)
