"""How an import source's host name is resolved: a name that does not exist is the tenant's mistake (422, says to
check the URI), a resolver that cannot answer is transient (503, retry), addresses must be public."""
from __future__ import annotations

import socket

import pytest

from loraplex.platform.uploads.errors import UploadError
from loraplex.platform.uploads.sources import resolve_checked


def _fail_with(monkeypatch, errno: int) -> None:
    def fake(*_a, **_k):
        raise socket.gaierror(errno, "resolver answer")
    monkeypatch.setattr(socket, "getaddrinfo", fake)


@pytest.mark.parametrize("errno", [socket.EAI_NONAME] + ([socket.EAI_NODATA] if hasattr(socket, "EAI_NODATA") else []))
def test_a_host_that_does_not_exist_is_a_422(monkeypatch, errno):
    _fail_with(monkeypatch, errno)                             # the resolver's answer, not this machine's DNS
    with pytest.raises(UploadError) as e:
        resolve_checked("adapters.imports.invalid", 443, private_ok=False)
    assert (e.value.status, e.value.code) == (422, "source_not_found")
    assert "does not exist" in str(e.value) and "check the source URI" in str(e.value)


def test_a_resolver_that_cannot_answer_is_a_503(monkeypatch):
    _fail_with(monkeypatch, socket.EAI_AGAIN)
    with pytest.raises(UploadError) as e:
        resolve_checked("huggingface.co", 443, private_ok=False)
    assert (e.value.status, e.value.code) == (503, "source_unavailable")
    assert "retry" in str(e.value)


def test_loopback_is_refused_unless_the_host_is_allowed_private():
    with pytest.raises(UploadError) as e:
        resolve_checked("127.0.0.1", 443, private_ok=False)
    assert (e.value.status, e.value.code) == (403, "source_not_allowed")
    assert resolve_checked("127.0.0.1", 443, private_ok=True) == "127.0.0.1"
