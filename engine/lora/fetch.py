"""Fetchers: bring an adapter's PEFT folder from its URI to a local folder, chosen by URI scheme.

    fetchers = default_fetchers()                  # {"file": FileFetcher()}
    fetchers["s3"] = control_plane_s3_fetcher      # registered by the platform; anything with .fetch(uri, dest)
    folder = fetchers[ref.scheme].fetch(ref.uri, dest_dir)

A fetcher writes ``adapter_config.json`` and ``adapter_model.safetensors`` into ``dest_dir`` (an empty folder the
caller owns and deletes on failure) and returns the folder that holds them (normally ``dest_dir``).
"""
from __future__ import annotations

import os
import shutil
from typing import Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from loraplex.engine.lora.fetch_errors import AdapterFetchError, AdapterFetchUnavailableError

__all__ = ["ADAPTER_FILES", "AdapterFetchError", "AdapterFetchUnavailableError", "Fetcher", "FileFetcher",
           "default_fetchers", "file_uri"]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@runtime_checkable
class Fetcher(Protocol):
    def fetch(self, uri: str, dest_dir: str) -> str:
        """Copy the adapter at ``uri`` into ``dest_dir``; return the local folder holding the PEFT files."""
        ...


class FileFetcher:
    """``file:///abs/path/to/peft-folder``: copies the two PEFT files into ``dest_dir``.

    Copying (rather than reading in place) makes the local disk cache the single source the loader reads, and
    keeps the cached bytes immune to later edits of the source folder."""

    def fetch(self, uri: str, dest_dir: str) -> str:
        parsed = urlparse(uri)
        if parsed.scheme != "file":
            raise AdapterFetchError(f"FileFetcher handles file:// URIs, got {uri!r}")
        if parsed.netloc not in ("", "localhost"):
            raise AdapterFetchError(f"file URI {uri!r} names host {parsed.netloc!r}; use file:///absolute/path")
        src = unquote(parsed.path)
        if not os.path.isdir(src):
            raise AdapterFetchError(f"adapter folder {src!r} (from {uri!r}) does not exist or is not a folder")
        for name in ADAPTER_FILES:
            path = os.path.join(src, name)
            if not os.path.isfile(path):
                raise AdapterFetchError(f"adapter folder {src!r} has no {name}; save the adapter with PEFT's "
                                        "save_pretrained (safe_serialization=True)")
            shutil.copyfile(path, os.path.join(dest_dir, name))
        return dest_dir


def default_fetchers() -> dict[str, Fetcher]:
    """``file://`` and ``s3://`` (boto3 is imported only when an s3 URI is fetched; settings from LORAPLEX_S3_*)."""
    from loraplex.engine.lora.fetch_s3 import S3Fetcher

    return {"file": FileFetcher(), "s3": S3Fetcher()}


def file_uri(folder: str | os.PathLike) -> str:
    """``file://`` URI of a local folder (absolute)."""
    return "file://" + os.path.abspath(os.fspath(folder))
