"""The embedded engine's speculative decoding, from the settings:

    LORAPLEX_ENGINE_SPECULATIVE_METHOD          unset / none: off; ngram | draft | eagle | eagle3
    LORAPLEX_ENGINE_NUM_SPECULATIVE_TOKENS      k, 1..16 (default 3)
    LORAPLEX_ENGINE_SPECULATIVE_DRAFT_MODEL     draft: a small causal LM's folder (the base model's tokenizer)
    LORAPLEX_ENGINE_SPECULATIVE_DRAFT_HEAD      eagle / eagle3: the folder of the draft head

``embedded_speculative(settings)`` is ``EngineConfig.speculative`` (a ``SpeculativeConfig`` dict, or None). Wrong
combinations are refused with ``EngineSettingsError``, one line naming the setting, before any weight loads.
Engines at ``ENGINE_URLS`` speculate by their own flags (``loraplex engine serve --speculative-method ...``).
"""
from __future__ import annotations

import os

from loraplex.engine.engine_config import EngineSettingsError
from loraplex.platform.core.config import Settings

METHOD = "LORAPLEX_ENGINE_SPECULATIVE_METHOD"
DRAFT_MODEL = "LORAPLEX_ENGINE_SPECULATIVE_DRAFT_MODEL"
DRAFT_HEAD = "LORAPLEX_ENGINE_SPECULATIVE_DRAFT_HEAD"
NEEDS = {"draft": (DRAFT_MODEL, "engine_speculative_draft_model",
                   "the folder of a small causal LM that shares the base model's tokenizer"),
         "eagle": (DRAFT_HEAD, "engine_speculative_draft_head",
                   "the folder of a draft head trained on the base model's hidden states"),
         "eagle3": (DRAFT_HEAD, "engine_speculative_draft_head",
                    "the folder of a published EAGLE-3 draft of the base model")}
FOLDERS = ((DRAFT_MODEL, "engine_speculative_draft_model", ("draft",)),
           (DRAFT_HEAD, "engine_speculative_draft_head", ("eagle", "eagle3")))


def embedded_speculative(settings: Settings) -> dict | None:
    """``SpeculativeConfig`` fields of the embedded engine, or None when it does not speculate."""
    method = settings.engine_speculative_method
    for env, attr, methods in FOLDERS:
        if getattr(settings, attr) and method not in methods:
            raise EngineSettingsError(
                f"{env} is set but {METHOD} is {method or 'unset'}; it is read with {METHOD}="
                f"{' or '.join(methods)} only: set that method or unset {env}")
    if method is None:
        return None
    if method in NEEDS:
        env, attr, what = NEEDS[method]
        folder = getattr(settings, attr)
        if not folder:
            raise EngineSettingsError(f"{METHOD}={method} needs {env}: {what}")
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise EngineSettingsError(f"{env}={folder!r} has no config.json; point it at {what}")
    fields = {"method": method, "num_speculative_tokens": settings.engine_num_speculative_tokens}
    if settings.engine_speculative_draft_model:
        fields["draft_model"] = settings.engine_speculative_draft_model
    if settings.engine_speculative_draft_head:
        fields["draft_head"] = settings.engine_speculative_draft_head
    from loraplex.engine.spec_decode.config import SpeculativeConfig

    try:   # the engine's own checks, so nothing it would refuse gets past the start
        SpeculativeConfig(**fields)
    except ValueError as e:
        raise EngineSettingsError(f"{METHOD}={method}: {e}") from None
    return fields


def check_speculative_settings(settings: Settings) -> None:
    """Refuses speculative settings that name nothing the deployment can use (``check_engine_settings`` calls it):
    wrong combinations, and a method set where no embedded engine runs (it would be ignored)."""
    embedded_speculative(settings)
    if settings.engine_speculative_method is None:
        return
    if settings.engine_urls:
        raise EngineSettingsError(
            f"{METHOD} configures the embedded engine, but LORAPLEX_ENGINE_URLS names separate engines: start them "
            f"with `loraplex engine serve --speculative-method {settings.engine_speculative_method}` and unset "
            f"{METHOD}")
    if settings.engine_mode != "embedded":
        raise EngineSettingsError(
            f"{METHOD} configures the embedded engine, but LORAPLEX_ENGINE_MODE={settings.engine_mode}; set "
            f"LORAPLEX_ENGINE_MODE=embedded or unset {METHOD}")
