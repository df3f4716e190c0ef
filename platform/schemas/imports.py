"""Imports by reference, as the tenant API sees them."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from loraplex.platform.schemas.adapters import NAME_PATTERN, AdapterVersionPublic
from loraplex.platform.schemas.types import UtcDatetime


class ImportCredentials(BaseModel):
    """Used for this import only: never stored, never logged, never echoed."""

    aws_access_key_id: str | None = Field(default=None, max_length=256)
    aws_secret_access_key: str | None = Field(default=None, max_length=1024)
    aws_session_token: str | None = Field(default=None, max_length=8192)
    region: str | None = Field(default=None, max_length=64, pattern=r"^[a-z0-9-]+$", examples=["eu-west-1"])
    endpoint_url: str | None = Field(default=None, max_length=512,
                                     description="an S3-compatible endpoint the operator allows (default: AWS)")
    bearer_token: str | None = Field(default=None, max_length=4096,
                                     description="HTTPS sources: sent as Authorization: Bearer to the first host")


class ImportRequest(BaseModel):
    model_config = {"json_schema_extra": {"examples": [
        {"name": "support-bot", "source": "s3://acme-models/runs/42/",
         "credentials": {"aws_access_key_id": "AKIA...", "aws_secret_access_key": "...", "region": "eu-west-1"}},
        {"name": "support-bot", "source": "https://huggingface.co/acme/support-bot-lora/resolve/main/"}]}}

    name: str = Field(pattern=NAME_PATTERN, description="the adapter to add a version to (created on first import)")
    source: str = Field(min_length=1, max_length=2048,
                        description="a folder with adapter_config.json and adapter_model.safetensors: "
                                    "s3://bucket/prefix/ or https://host/path/")
    credentials: ImportCredentials | None = None


class ImportError_(BaseModel):
    message: str
    code: str | None
    status: int | None = Field(description="the HTTP status this failure answers")


class ImportPublic(BaseModel):
    id: str
    object: Literal["adapter.import"] = "adapter.import"
    adapter: str
    source: str
    status: Literal["running", "succeeded", "failed"]
    bytes_received: int
    version: AdapterVersionPublic | None = Field(description="the version it made (or found identical)")
    deduplicated: bool = Field(description="the weights and config equal a ready version's: that version")
    error: ImportError_ | None
    created_at: UtcDatetime
    updated_at: UtcDatetime


class ImportsPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[ImportPublic]
