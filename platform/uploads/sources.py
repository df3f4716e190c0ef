"""Fetching an adapter by reference (``POST /v1/adapters/import``): a Hub-layout folder (``adapter_config.json`` +
``adapter_model.safetensors``) from the tenant's S3 bucket or an HTTPS URL, into the upload spool, under the SSRF
rules of OWASP's API top 10 (API7):

    source          s3://bucket/prefix/  |  https://host/path/   (no user:password@, no query, no fragment)
    allow-list      HTTPS hosts (every redirect hop): IMPORT_ALLOWED_HOSTS ("host", "host:port", "*.domain";
                    "http://host[:port]" also allows plain HTTP); S3 buckets: IMPORT_S3_BUCKETS; S3 endpoints:
                    AWS's, or IMPORT_S3_ENDPOINTS; the platform's own bucket never
    addresses       each hop's host is resolved here and every address must be public (not private, loopback,
                    link-local, multicast, reserved, shared or unspecified) unless IMPORT_PRIVATE_HOSTS names the
                    host; the connection goes to the address checked (the Host header and TLS SNI keep the name and
                    the certificate is verified against it), so DNS cannot switch it between check and connect
    redirects       followed by hand, at most IMPORT_MAX_REDIRECTS, each one checked as above; credentials (a bearer
                    token) are sent to the first host only
    bounds          connect and read timeouts, a deadline for the whole import, the config ≤ 1 MiB and the weights
                    ≤ MAX_UPLOAD_BYTES (Content-Length checked first, every byte counted while streaming)
    credentials     S3 keys and bearer tokens the tenant sends live in memory for the import only: never stored,
                    never logged; without keys, the operator's credentials (IMPORT_S3_PROFILE or boto3's chain, e.g. a
                    workload role) only for buckets IMPORT_S3_OPERATOR_BUCKETS names

Errors are ``UploadError`` with a code: ``bad_source`` (400), ``source_not_allowed`` / ``source_access_denied``
(403), ``source_not_found`` (422: nothing at the source, or a host name that does not exist), ``too_large`` (413),
``source_unavailable`` (503, retry).
"""
from __future__ import annotations

import fnmatch
import ipaddress
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urljoin, urlsplit

from loraplex.platform.core.config import Settings
from loraplex.platform.uploads.errors import UploadError, too_large

FILES = ("adapter_config.json", "adapter_model.safetensors")
MAX_CONFIG_BYTES = 1024 * 1024
CHUNK = 1 << 20
REDIRECTS = (301, 302, 303, 307, 308)
# The resolver's "this name does not exist" answers (the tenant's mistake, 422); anything else, e.g. a resolver
# timeout (EAI_AGAIN), is transient (503, retry).
_NO_SUCH_HOST = {socket.EAI_NONAME} | ({socket.EAI_NODATA} if hasattr(socket, "EAI_NODATA") else set())


@dataclass(frozen=True)
class Credentials:
    """What the tenant sent for this import (kept in memory only; ``repr`` hides the secrets)."""

    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = field(default=None, repr=False)
    aws_session_token: str | None = field(default=None, repr=False)
    region: str | None = None
    endpoint_url: str | None = None
    bearer_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Source:
    scheme: str           # "s3" | "https" | "http"
    uri: str              # as given, normalised to end with "/"
    host: str             # bucket for s3
    prefix: str           # key prefix (s3) or path (https), ending with "/"


def _bad(message: str) -> UploadError:
    return UploadError(400, message, code="bad_source")


def _not_allowed(message: str) -> UploadError:
    return UploadError(403, message, code="source_not_allowed")


def _unavailable(message: str) -> UploadError:
    return UploadError(503, message + "; nothing was stored — retry the import later", code="source_unavailable")


def _write_capped(chunks, dest: str, max_bytes: int, what: str, on_bytes: Callable[[int], None], deadline) -> None:
    """Streams ``chunks`` into ``dest``, counting every byte against ``max_bytes`` (413 naming ``what`` past it) and
    the import's deadline after each chunk."""
    got = 0
    with open(dest, "wb") as out:
        for chunk in chunks:
            got += len(chunk)
            if got > max_bytes:
                raise too_large(max_bytes, what)
            out.write(chunk)
            on_bytes(len(chunk))
            deadline.left()


def parse_source(uri: str) -> Source:
    """``s3://bucket/prefix/`` or ``http(s)://host[:port]/path/``; refused: other schemes, user:password@, a
    query or fragment (credentials go in ``credentials``, never in the URI, which is stored)."""
    if not isinstance(uri, str) or not uri or len(uri) > 2048 or any(ord(c) < 33 or ord(c) == 127 for c in uri):
        raise _bad("source must be an s3:// or https:// URI of at most 2048 characters without spaces")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in ("s3", "https", "http"):
        raise _bad(f"source scheme {parts.scheme!r} is not supported; use s3://bucket/prefix/ or "
                   "https://host/path/ (a folder with adapter_config.json and adapter_model.safetensors)")
    if "@" in parts.netloc:
        raise _bad("source must not hold credentials (user:password@); send them in 'credentials', which are "
                   "never stored")
    if parts.query or parts.fragment:
        raise _bad("source must not have a query or fragment; it names a folder")
    if not parts.hostname:
        raise _bad("source has no host (or bucket)")
    path = parts.path if parts.path.endswith("/") else parts.path + "/"
    if scheme == "s3":
        return Source("s3", f"s3://{parts.netloc}{path}", parts.netloc, path.lstrip("/"))
    return Source(scheme, f"{scheme}://{parts.netloc}{path}", parts.netloc.lower(), path)


def _split(netloc: str) -> tuple[str, int | None]:
    parts = urlsplit(f"//{netloc}")
    try:
        return (parts.hostname or "").lower(), parts.port
    except ValueError:
        return (parts.hostname or "").lower(), -1


def _host_matches(netloc: str, scheme: str, patterns: list[str]) -> bool:
    """``netloc`` ("host" or "host:port") against allow-list entries ("host", "host:port", "*.domain", each
    optionally "http://..." to allow plain HTTP too); an entry without a port matches every port."""
    host, port = _split(netloc)
    for entry in patterns:
        entry = entry.strip().lower().rstrip("/")
        entry_scheme, _, rest = entry.rpartition("://")
        if scheme == "http" and entry_scheme != "http":
            continue
        want_host, want_port = _split(rest)
        if want_port is not None and want_port != port:
            continue
        if want_host.startswith("*."):
            if host.endswith(want_host[1:]):
                return True
        elif host == want_host:
            return True
    return False


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def resolve_checked(host: str, port: int, *, private_ok: bool) -> str:
    """One address of ``host`` after checking every address it resolves to (all must be public unless
    ``private_ok``)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in _NO_SUCH_HOST:
            raise UploadError(422, f"the source host {host!r} does not exist (no DNS name); check the source URI",
                              code="source_not_found") from None
        raise _unavailable(f"the source host {host!r} does not resolve ({e})") from None
    except UnicodeError:
        raise _bad(f"the source host {host!r} is not a valid host name") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise _unavailable(f"the source host {host!r} has no address")
    if not private_ok:
        bad = [a for a in addresses if not _public(a)]
        if bad:
            raise _not_allowed(f"the source host {host!r} resolves to a non-public address; imports reach public "
                               "addresses only (the operator can allow a mirror with LORAPLEX_IMPORT_PRIVATE_HOSTS)")
    return addresses[0]


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise _unavailable(f"the import did not finish within {self.seconds:.0f} s")
        return left


# ---- HTTPS ----------------------------------------------------------------------------------------------------
def check_http(source: Source, settings: Settings) -> None:
    """The allow-list check of the first hop (before anything is fetched)."""
    if not _host_matches(source.host, source.scheme, settings.import_allowed_hosts):
        what = "plain HTTP to" if source.scheme == "http" else "HTTPS host"
        raise _not_allowed(f"imports from {what} {source.host!r} are not allowed on this deployment (allowed: "
                           f"{', '.join(settings.import_allowed_hosts) or 'none'}); ask the operator to add it to "
                           "LORAPLEX_IMPORT_ALLOWED_HOSTS")


def fetch_http(url: str, dest: str, *, max_bytes: int, settings: Settings, deadline: Deadline,
               credentials: Credentials | None, on_bytes: Callable[[int], None]) -> None:
    """``url`` into ``dest`` over pinned, checked connections (see the module docstring)."""
    import httpx

    first = urlsplit(url).netloc.lower()
    verify = settings.import_ca_bundle or True
    for _hop in range(settings.import_max_redirects + 1):
        parts = urlsplit(url)
        scheme, netloc = parts.scheme.lower(), parts.netloc.lower()
        if scheme not in ("https", "http") or "@" in netloc or not parts.hostname:
            raise _not_allowed(f"the source redirected to {scheme}://{netloc}, which imports may not follow")
        if not _host_matches(netloc, scheme, settings.import_allowed_hosts):
            raise _not_allowed(f"the source redirected to {scheme}://{netloc}, which is not an allowed import host")
        host = parts.hostname
        port = parts.port or (443 if scheme == "https" else 80)
        private_ok = _host_matches(netloc, "https", settings.import_private_hosts)
        address = resolve_checked(host, port, private_ok=private_ok)
        pinned = f"{scheme}://{f'[{address}]' if ':' in address else address}:{port}{parts.path or '/'}"
        headers = {"Host": netloc, "Accept-Encoding": "identity", "User-Agent": "loraplex-import"}
        if credentials is not None and credentials.bearer_token and netloc == first:
            headers["Authorization"] = f"Bearer {credentials.bearer_token}"
        timeout = httpx.Timeout(min(settings.import_read_timeout_s, deadline.left()),
                                connect=min(settings.import_connect_timeout_s, deadline.left()))
        try:
            with httpx.Client(verify=verify, timeout=timeout, follow_redirects=False, trust_env=False) as client:
                with client.stream("GET", pinned, headers=headers,
                                   extensions={"sni_hostname": host} if scheme == "https" else {}) as r:
                    if r.status_code in REDIRECTS and r.headers.get("location"):
                        url = urljoin(url, r.headers["location"])
                        continue
                    _check_status(r.status_code, url)
                    declared = r.headers.get("content-length")
                    if declared and declared.isdigit() and int(declared) > max_bytes:
                        raise too_large(max_bytes, f"{os.path.basename(dest)} at the source")
                    _write_capped(r.iter_raw(CHUNK), dest, max_bytes, f"{os.path.basename(dest)} at the source",
                                  on_bytes, deadline)
                    return
        except httpx.TimeoutException:
            raise _unavailable(f"the source {netloc} timed out") from None
        except httpx.HTTPError as e:
            raise _unavailable(f"the source {netloc} could not be reached ({type(e).__name__})") from None
    raise _not_allowed(f"the source redirected more than {settings.import_max_redirects} times")


def _check_status(status: int, url: str) -> None:
    name = url.rsplit("/", 1)[-1]
    if status in (401, 403):
        raise UploadError(403, f"the source refused access to {name} ({status}); check the URL and the bearer token",
                          code="source_access_denied")
    if status in (404, 410):
        raise UploadError(422, f"the source has no {name} ({status}); point at the folder holding "
                               "adapter_config.json and adapter_model.safetensors", code="source_not_found")
    if status >= 500 or status == 429:
        raise _unavailable(f"the source answered {status} for {name}")
    if status != 200:
        raise UploadError(422, f"the source answered {status} for {name}; expected 200", code="source_not_found")


# ---- S3 -------------------------------------------------------------------------------------------------------
def check_s3(source: Source, settings: Settings, credentials: Credentials | None) -> None:
    """Bucket, endpoint and credential rules (before anything is fetched)."""
    bucket = source.host
    own_endpoint = (settings.s3_endpoint_url or "").rstrip("/")
    endpoint = (credentials.endpoint_url or "").rstrip("/") if credentials else ""
    if settings.blob_backend == "s3" and bucket == settings.s3_bucket and endpoint == own_endpoint:
        raise _not_allowed("imports cannot read the platform's own adapter bucket")
    has_keys = credentials is not None and bool(credentials.aws_access_key_id)
    patterns = settings.import_s3_buckets if has_keys else settings.import_s3_operator_buckets
    if not any(fnmatch.fnmatchcase(bucket, p) for p in patterns):
        raise _not_allowed(f"imports from bucket {bucket!r} " + (
            "are not allowed on this deployment (LORAPLEX_IMPORT_S3_BUCKETS)" if has_keys else
            "need credentials: send aws_access_key_id and aws_secret_access_key (the operator's own credentials are "
            "not offered for this bucket)"))
    if endpoint and endpoint not in [e.rstrip("/") for e in settings.import_s3_endpoints]:
        raise _not_allowed(f"the S3 endpoint {endpoint!r} is not allowed on this deployment (allowed: AWS"
                           f"{', ' + ', '.join(settings.import_s3_endpoints) if settings.import_s3_endpoints else ''})")
    if has_keys and not credentials.aws_secret_access_key:
        raise _bad("aws_access_key_id needs aws_secret_access_key")


def _s3_client(settings: Settings, credentials: Credentials | None):
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=settings.import_connect_timeout_s, read_timeout=settings.import_read_timeout_s,
                    retries={"max_attempts": 2, "mode": "standard"}, signature_version="s3v4")
    c = credentials or Credentials()
    if c.aws_access_key_id:
        session = boto3.session.Session(aws_access_key_id=c.aws_access_key_id,
                                        aws_secret_access_key=c.aws_secret_access_key,
                                        aws_session_token=c.aws_session_token, region_name=c.region)
    else:
        session = boto3.session.Session(profile_name=settings.import_s3_profile, region_name=c.region)
    return session.client("s3", endpoint_url=c.endpoint_url or None, config=config)


def fetch_s3(source: Source, name: str, dest: str, *, max_bytes: int, settings: Settings, deadline: Deadline,
             credentials: Credentials | None, on_bytes: Callable[[int], None], client=None) -> None:
    """``s3://bucket/prefix/<name>`` into ``dest`` (size checked first, then every byte counted)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    client = client or _s3_client(settings, credentials)
    key = source.prefix + name
    try:
        head = client.head_object(Bucket=source.host, Key=key)
        if int(head.get("ContentLength", 0)) > max_bytes:
            raise too_large(max_bytes, f"{name} at the source")
        body = client.get_object(Bucket=source.host, Key=key)["Body"]
        _write_capped(body.iter_chunks(CHUNK), dest, max_bytes, f"{name} at the source", on_bytes, deadline)
    except NoCredentialsError:
        raise UploadError(403, "no S3 credentials: send aws_access_key_id and aws_secret_access_key",
                          code="source_access_denied") from None
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                    "InvalidToken", "AllAccessDisabled") or status == 403:
            raise UploadError(403, f"S3 refused the credentials for s3://{source.host}/{key} ({code or status}); "
                                   "check the keys, the region and the bucket policy", code="source_access_denied") \
                from None
        if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound") or status == 404:
            raise UploadError(422, f"s3://{source.host}/{key} does not exist; point at the folder holding "
                                   "adapter_config.json and adapter_model.safetensors", code="source_not_found") \
                from None
        raise _unavailable(f"S3 answered {code or status} for s3://{source.host}/{key}") from None
    except BotoCoreError as e:   # endpoint unreachable, timeouts, broken streams
        raise _unavailable(f"S3 could not be reached for s3://{source.host}/{key} ({type(e).__name__})") from None


def fetch_folder(source: Source, dest_dir: str, *, settings: Settings, credentials: Credentials | None,
                 on_bytes: Callable[[int], None]) -> tuple[str, str]:
    """Both PEFT files of ``source`` into ``dest_dir``; returns (config path, weights path)."""
    deadline = Deadline(settings.import_timeout_s)
    paths = []
    client = _s3_client(settings, credentials) if source.scheme == "s3" else None
    for name, cap in zip(FILES, (MAX_CONFIG_BYTES, settings.max_upload_bytes)):
        dest = os.path.join(dest_dir, name)
        if source.scheme == "s3":
            fetch_s3(source, name, dest, max_bytes=cap, settings=settings, deadline=deadline,
                     credentials=credentials, on_bytes=on_bytes, client=client)
        else:
            fetch_http(source.uri + name, dest, max_bytes=cap, settings=settings, deadline=deadline,
                       credentials=credentials, on_bytes=on_bytes)
        paths.append(dest)
    return paths[0], paths[1]
