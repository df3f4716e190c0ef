"""A small synchronous Python client of the loraplex tenant API (adapters, imports, API keys), used by the
``loraplex adapters`` and ``loraplex keys`` commands. Inference goes through the official ``openai`` client.

    from loraplex.client import LoraplexClient

    client = LoraplexClient()                         # LORAPLEX_URL / LORAPLEX_API_KEY, else the config file
    version = client.upload("out/support-bot", name="support-bot")          # a PEFT folder or .tar.gz / .zip
    client.rollback("support-bot", 2)
    for v in client.versions("support-bot")["data"]: print(v["number"], v["status"], v["created_by"])

Configuration, first found wins: the arguments, the environment (``LORAPLEX_URL``, ``LORAPLEX_API_KEY``,
``LORAPLEX_PROFILE``), then the config file ``~/.config/loraplex/config.toml`` (``LORAPLEX_CONFIG`` names another),
whose ``[default]`` table or ``[profiles.<name>]`` tables hold ``url`` and ``api_key``::

    [default]
    url = "https://loraplex.example.com"
    api_key = "lpx_..."

    [profiles.staging]
    url = "https://staging.loraplex.example.com"
    api_key = "lpx_..."

Errors are ``LoraplexError`` with the API's ``status``, ``code``, ``param`` and message. Uploads and imports send an
``Idempotency-Key`` and are retried on connection errors and 502/503/504 with the same key, so a retry never makes
a second version.
"""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
RETRY_STATUSES = (502, 503, 504)
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
ARCHIVES = (".tar.gz", ".tgz", ".tar", ".zip")


class LoraplexError(Exception):
    """An error answer of the API (or no answer at all: ``status`` 0, ``code`` "connection_error")."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    @property
    def message(self) -> str:
        return str(self.args[0])

    def __str__(self) -> str:
        where = f" ({self.param})" if self.param else ""
        return f"{self.status} {self.code or 'error'}{where}: {self.args[0]}" if self.status else str(self.args[0])


@dataclass(frozen=True)
class ClientConfig:
    url: str
    api_key: str | None
    profile: str | None = None


def config_path() -> str:
    return os.environ.get("LORAPLEX_CONFIG") or os.path.join(
        os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config"), "loraplex", "config.toml")


def load_config(*, url: str | None = None, api_key: str | None = None, profile: str | None = None) -> ClientConfig:
    """Arguments, then ``LORAPLEX_*`` variables, then the config file's profile (``default`` unless named)."""
    import tomllib

    profile = profile or os.environ.get("LORAPLEX_PROFILE")
    table: dict[str, Any] = {}
    path = config_path()
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise LoraplexError(0, f"cannot read the config file {path}: {e}", code="bad_config") from None
        table = data.get("profiles", {}).get(profile, {}) if profile else data.get("default", {})
        if profile and not table:
            raise LoraplexError(0, f"no profile {profile!r} in {path} (add a [profiles.{profile}] table)",
                                code="bad_config")
    elif profile:
        raise LoraplexError(0, f"profile {profile!r} asked for but there is no config file at {path}",
                            code="bad_config")
    url = url or os.environ.get("LORAPLEX_URL") or table.get("url") or DEFAULT_URL
    api_key = api_key or os.environ.get("LORAPLEX_API_KEY") or table.get("api_key")
    return ClientConfig(url=url.rstrip("/"), api_key=api_key, profile=profile)


class _CountingReader:
    """A file object that reports the bytes read from it (httpx reads upload parts in chunks)."""

    def __init__(self, path: str, on_bytes: Callable[[int], None] | None) -> None:
        self._f = open(path, "rb")
        self._on_bytes = on_bytes

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        if data and self._on_bytes is not None:
            self._on_bytes(len(data))
        return data

    def fileno(self) -> int:            # lets httpx learn the length (a Content-Length, not a chunked body)
        return self._f.fileno()

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def close(self) -> None:
        self._f.close()


def upload_files(path: str) -> list[str]:
    """The files an upload of ``path`` sends: the two PEFT files of a folder, or the one archive."""
    if os.path.isdir(path):
        missing = [n for n in PEFT_FILES if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise LoraplexError(0, f"{path} has no {', '.join(missing)}; point at the folder PEFT's save_pretrained "
                                   "wrote, or at a .tar.gz / .zip of it", code="bad_path")
        return [os.path.join(path, n) for n in PEFT_FILES]
    if os.path.isfile(path) and path.lower().endswith(ARCHIVES):
        return [path]
    raise LoraplexError(0, f"{path} is neither a PEFT folder nor a .tar.gz / .tgz / .tar / .zip archive",
                        code="bad_path")


class LoraplexClient:
    """The tenant API over httpx (sync). ``max_retries``: attempts after the first for uploads and imports (and
    every idempotent GET) on connection errors and 502/503/504, with exponential backoff."""

    def __init__(self, url: str | None = None, api_key: str | None = None, *, profile: str | None = None,
                 timeout_s: float = 120.0, max_retries: int = 3, backoff_s: float = 0.5,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.config = load_config(url=url, api_key=api_key, profile=profile)
        if not self.config.api_key:
            raise LoraplexError(0, "no API key: set LORAPLEX_API_KEY, pass --api-key, or add api_key to "
                                   f"{config_path()}", code="no_api_key")
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.http = httpx.Client(base_url=self.config.url, timeout=timeout_s, transport=transport,
                                 headers={"Authorization": f"Bearer {self.config.api_key}",
                                          "User-Agent": "loraplex-client"})

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "LoraplexClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- transport ---------------------------------------------------------------------------------------------
    def _send(self, method: str, path: str, *, retry: bool = False, build: Callable[[], dict] | None = None,
              **kw) -> httpx.Response:
        attempts = 1 + (self.max_retries if retry else 0)
        for attempt in range(attempts):
            extra = build() if build is not None else {}
            try:
                r = self.http.request(method, path, **kw, **extra)
            except httpx.TransportError as e:
                if attempt + 1 >= attempts:
                    raise LoraplexError(0, f"cannot reach {self.config.url}: {e}", code="connection_error") from None
            else:
                if r.status_code not in RETRY_STATUSES or attempt + 1 >= attempts:
                    return self._checked(r)
            finally:
                for f in extra.get("files", []):
                    f[1][1].close()
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    @staticmethod
    def _checked(r: httpx.Response) -> httpx.Response:
        if r.status_code < 400:
            return r
        try:
            error = r.json().get("error") or {}
        except ValueError:
            error = {}
        raise LoraplexError(r.status_code, error.get("message") or r.text[:300] or r.reason_phrase,
                            code=error.get("code"), param=error.get("param"))

    def _json(self, method: str, path: str, **kw) -> Any:
        r = self._send(method, path, retry=method == "GET", **kw)
        return r.json() if r.content else None

    # ---- adapters ----------------------------------------------------------------------------------------------
    def list_adapters(self) -> list[dict]:
        """Every adapter of the tenant (all pages)."""
        out: list[dict] = []
        while True:
            page = self._json("GET", "/v1/adapters", params={"offset": len(out), "limit": 100})
            out += page["data"]
            if not page["data"] or len(out) >= page["count"]:
                return out

    def get_adapter(self, name: str) -> dict:
        return self._json("GET", f"/v1/adapters/{name}")

    def versions(self, name: str) -> dict:
        """The version history: ``{"adapter", "data": [versions newest first], "aliases": [...]}``."""
        return self._json("GET", f"/v1/adapters/{name}/versions")

    def upload(self, path: str, *, name: str, idempotency_key: str | None = None,
               on_bytes: Callable[[int], None] | None = None) -> dict:
        """Uploads a PEFT folder or archive as a new version of ``name``; the created (or identical existing)
        version, with ``"deduplicated"`` / ``"replayed"`` flags. ``on_bytes(n)`` sees the bytes as they go."""
        files = upload_files(path)
        key = idempotency_key or f"cli-{uuid.uuid4().hex}"

        def build() -> dict:
            return {"files": [("files", (os.path.basename(p), _CountingReader(p, on_bytes),
                                         "application/octet-stream")) for p in files]}
        r = self._send("POST", "/v1/adapters", retry=True, build=build, data={"name": name},
                       headers={"Idempotency-Key": key})
        return {**r.json(), "deduplicated": r.headers.get("Loraplex-Deduplicated") == "true",
                "replayed": r.headers.get("Idempotent-Replayed") == "true"}

    def set_alias(self, name: str, alias: str, version: int) -> dict:
        return self._json("PUT", f"/v1/adapters/{name}/aliases/{alias}", json={"version": version})

    def delete_alias(self, name: str, alias: str) -> None:
        self._json("DELETE", f"/v1/adapters/{name}/aliases/{alias}")

    def rollback(self, name: str, version: int) -> dict:
        return self._json("POST", f"/v1/adapters/{name}/rollback", json={"version": version})

    def delete(self, name: str, version: int | None = None, *, keep_adapter: bool = False) -> None:
        if version is None:
            self._json("DELETE", f"/v1/adapters/{name}")
        else:
            self._json("DELETE", f"/v1/adapters/{name}/versions/{version}",
                       params={"keep_adapter": "true"} if keep_adapter else None)

    # ---- imports -----------------------------------------------------------------------------------------------
    def import_adapter(self, name: str, source: str, *, credentials: dict | None = None, wait: bool = True,
                       poll_s: float = 1.0, timeout_s: float = 3600.0,
                       on_progress: Callable[[dict], None] | None = None) -> dict:
        """Imports a Hub-layout folder (``s3://bucket/prefix/`` or ``https://host/path/``) as a new version of
        ``name``; returns the import (``status`` "succeeded" with its ``version``, or raises for "failed").
        ``wait=False``: return the import as soon as it is accepted."""
        body = {"name": name, "source": source, **({"credentials": credentials} if credentials else {})}
        r = self._send("POST", "/v1/adapters/import", retry=True, json=body,
                       headers={"Idempotency-Key": f"cli-{uuid.uuid4().hex}"})
        job = r.json()
        deadline = time.monotonic() + timeout_s
        while wait and job["status"] == "running":
            if on_progress is not None:
                on_progress(job)
            if time.monotonic() > deadline:
                raise LoraplexError(0, f"import {job['id']} still running after {timeout_s:.0f} s; see "
                                       f"GET /v1/imports/{job['id']}", code="timeout")
            time.sleep(poll_s)
            job = self.get_import(job["id"])
        if job["status"] == "failed":
            e = job.get("error") or {}
            raise LoraplexError(e.get("status") or 0, e.get("message") or "the import failed", code=e.get("code"))
        return job

    def get_import(self, import_id: str) -> dict:
        return self._json("GET", f"/v1/imports/{import_id}")

    # ---- API keys ----------------------------------------------------------------------------------------------
    def list_keys(self) -> list[dict]:
        return self._json("GET", "/v1/keys")["data"]

    def create_key(self, name: str) -> dict:
        """A new API key of the caller's tenant; ``key`` is in this answer only."""
        return self._json("POST", "/v1/keys", json={"name": name})

    def revoke_key(self, key_id: str) -> dict:
        return self._json("DELETE", f"/v1/keys/{key_id}")


def iter_table(rows: list[dict], columns: list[tuple[str, str]]) -> Iterator[str]:
    """Lines of a plain text table: ``columns`` are (header, key) pairs; values rendered with ``str``."""
    cells = [[("" if r.get(k) is None else str(r.get(k))) for _, k in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _) in enumerate(columns)]
    yield "  ".join(h.upper().ljust(w) for (h, _), w in zip(columns, widths)).rstrip()
    for c in cells:
        yield "  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip()
