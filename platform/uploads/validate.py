"""Turns spooled form parts into two checked files: the PEFT config and weights, validated against the base model."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora.format import (MAX_CONFIG_BYTES, AdapterFormatError, AdapterSpec, check_adapter,
                                         parse_adapter_config, read_safetensors_header)
from loraplex.platform.core.config import Settings
from loraplex.platform.engines.limits import EngineLimits, unservable
from loraplex.platform.uploads.archive import WANTED, extract_peft_files, is_archive
from loraplex.platform.uploads.errors import UploadError
from loraplex.platform.uploads.intake import SpooledForm
from loraplex.platform.uploads.numerical_check import check_conversion
from loraplex.platform.uploads.scan import hash_and_scan

CONFIG, WEIGHTS = WANTED


@dataclass(frozen=True)
class ValidatedAdapter:
    """A checked adapter waiting to be stored."""

    weights_path: str
    config: dict[str, Any]
    spec: AdapterSpec
    sha256: str
    size_bytes: int


def peft_files(form: SpooledForm, work_dir: str, settings: Settings) -> tuple[str, str]:
    """(config path, weights path) from the two uploaded files or one archive."""
    if not form.files:
        raise UploadError(422, f"no files in the upload; attach {CONFIG} and {WEIGHTS}, or one .tar.gz/.zip of "
                               "the PEFT folder", code="missing_files")
    archives = [f for f in form.files if is_archive(f.filename)]
    if archives:
        if len(form.files) != 1:
            raise UploadError(422, "send either one archive or the two PEFT files, not both", code="mixed_upload")
        found = extract_peft_files(archives[0].path, archives[0].filename, work_dir,
                                   max_bytes=settings.max_upload_bytes, max_members=settings.max_archive_members)
        os.unlink(archives[0].path)
    else:
        found = {}
        for f in form.files:
            if f.filename in found:
                raise UploadError(422, f"{f.filename} was attached twice; attach it once", code="duplicate_file")
            found[f.filename] = f.path
    if WEIGHTS not in found and any(n.endswith(".bin") for n in found):
        raise UploadError(422, "adapter_model.bin (a pickle) is not accepted; save the adapter with "
                               "save_pretrained(..., safe_serialization=True) and upload adapter_model.safetensors",
                          code="not_safetensors")
    for name in (CONFIG, WEIGHTS):
        if name not in found:
            code = {CONFIG: "missing_adapter_config", WEIGHTS: "missing_adapter_model"}[name]
            raise UploadError(422, f"missing {name}; upload it beside the other PEFT file (the folder PEFT's "
                                   "save_pretrained wrote)", code=code)
    return found[CONFIG], found[WEIGHTS]


def validate_adapter(config_path: str, weights_path: str, *, settings: Settings, model: ModelConfig,
                     limits: EngineLimits | None = None) -> ValidatedAdapter:
    """Config, header against the base model and the engines' serving ``limits`` (the deployment's, learnt from
    the engines; None: the settings' alone), a full NaN/Inf scan and sha256 of the weights, then the numerical
    check of the engine's conversion against PEFT (``numerical_check.py``). CPU-bound: the route runs it in a
    worker thread."""
    max_rank = settings.max_rank if limits is None else max(1, min(settings.max_rank, limits.max_lora_rank))
    try:
        if os.path.getsize(config_path) > MAX_CONFIG_BYTES:
            raise AdapterFormatError(f"{CONFIG} is over {MAX_CONFIG_BYTES} bytes; upload the file PEFT wrote",
                                     code="config_invalid")
        with open(config_path, "rb") as f:
            raw = f.read()
        config = parse_adapter_config(raw, max_rank=max_rank)
        header = read_safetensors_header(weights_path, max_header_bytes=settings.max_header_bytes)
        spec = check_adapter(config, header, model, max_rank=max_rank, base_model_name=settings.served_model_name,
                             base_model_aliases=tuple(settings.base_model_aliases))
        refused = unservable(limits, rank=spec.rank, targets=spec.targets, dtype=spec.dtype,
                             size_bytes=header.file_size)
        if refused is not None:
            code, reason = refused
            raise UploadError(413 if code == "too_large" else 422, f"no engine of this deployment can serve this "
                              f"adapter: {reason}", code=code)
        sha256 = hash_and_scan(weights_path, header)
        parsed = json.loads(raw)
        check_conversion(weights_path, parsed, header, spec, model)
    except AdapterFormatError as e:
        raise UploadError(422, str(e), code=e.code) from None
    return ValidatedAdapter(weights_path=weights_path, config=parsed, spec=spec, sha256=sha256,
                            size_bytes=header.file_size)
