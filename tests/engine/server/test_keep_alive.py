"""Both servers keep an idle keep-alive connection open for ``LORAPLEX_KEEP_ALIVE_S`` (default 75 s, above the
idle timeouts of load balancers and client pools), so a pooled connection reused after a pause is not closed under
the request (uvicorn's own default is 5 s: load tests saw ``ConnectionError`` from exactly that race).

This test is about time: one idle gap of 6 s (just past uvicorn's 5 s default) on real sockets, shared by every
server under test; a server started with ``LORAPLEX_KEEP_ALIVE_S=1`` is the control that closes it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from loraplex.engine.server.keep_alive import DEFAULT_KEEP_ALIVE_S, keep_alive_seconds
from tests.utils.services import free_port, wait_for_port

IDLE_S = 6.0


def _start(args: list[str], env: dict[str, str]) -> tuple[int, subprocess.Popen]:
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k != "LORAPLEX_KEEP_ALIVE_S"}     # unset: the default
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", *args, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**base, "PYTHONUNBUFFERED": "1", **env})
    return port, proc


def _get(sock: socket.socket, path: str) -> bytes:
    """One HTTP/1.1 request on an open connection; the response's status line (b"" when the server closed it)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n")[0]


@pytest.fixture
def servers(tmp_path):
    procs = []
    platform_env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_ENGINE_MODE": "none",
                    "LORAPLEX_ENVIRONMENT": "development"}
    for name, args, env in [
        ("platform", ["serve", "--upgrade-db"], platform_env),
        ("engine", ["engine", "serve", "--null", "--log-level", "warning"], {}),
        ("engine-1s", ["engine", "serve", "--null", "--log-level", "warning"], {"LORAPLEX_KEEP_ALIVE_S": "1"}),
    ]:
        port, proc = _start(args, env)
        procs.append((name, port, proc))
    try:
        for _, port, proc in procs:
            wait_for_port(port, timeout=60, proc=proc)
        yield {name: port for name, port, _ in procs}
    finally:
        for _, _, proc in procs:
            proc.kill()
            proc.wait(10)


def test_idle_keep_alive_connection_is_reused_after_six_seconds(servers):
    paths = {"platform": "/healthz", "engine": "/health", "engine-1s": "/health"}
    socks = {name: socket.create_connection(("127.0.0.1", port), timeout=10) for name, port in servers.items()}
    try:
        first = {name: _get(s, paths[name]) for name, s in socks.items()}
        assert all(line.startswith(b"HTTP/1.1 200") for line in first.values()), first
        time.sleep(IDLE_S)
        second = {name: _get(s, paths[name]) for name, s in socks.items()}
    finally:
        for s in socks.values():
            s.close()
    assert second["platform"].startswith(b"HTTP/1.1 200"), second
    assert second["engine"].startswith(b"HTTP/1.1 200"), second
    assert second["engine-1s"] == b"", "the control server (1 s keep-alive) should have closed the idle connection"


def test_keep_alive_setting_is_validated():
    assert keep_alive_seconds({}) == DEFAULT_KEEP_ALIVE_S == 75
    assert keep_alive_seconds({"LORAPLEX_KEEP_ALIVE_S": " 620 "}) == 620
    for bad in ("0", "-3", "nan", "inf", "1e9", "soon"):
        with pytest.raises(ValueError, match="LORAPLEX_KEEP_ALIVE_S"):
            keep_alive_seconds({"LORAPLEX_KEEP_ALIVE_S": bad})


@pytest.mark.parametrize("args", [["engine", "serve", "--null"], ["serve"]])
def test_a_bad_keep_alive_is_one_line_at_start(args, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "loraplex.cli", *args, "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LORAPLEX_KEEP_ALIVE_S": "forever", "LORAPLEX_ENGINE_MODE": "none",
                               "LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ENVIRONMENT": "development"})
    assert proc.returncode != 0
    assert "LORAPLEX_KEEP_ALIVE_S" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
