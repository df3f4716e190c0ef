"""Real services for platform tests: a fresh PostgreSQL database, moto's S3 server as a separate process, and a
TCP proxy that can cut an S3 connection mid-transfer."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid

PG_ADMIN_URL = os.environ.get("LORAPLEX_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def create_database() -> tuple[str, str]:
    """A fresh PostgreSQL database; returns (SQLAlchemy URL, name). Fails loudly if PostgreSQL is not there."""
    import psycopg

    name = f"loraplex_test_{uuid.uuid4().hex[:10]}"
    try:
        conn = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as e:
        raise RuntimeError(f"platform tests need PostgreSQL at {PG_ADMIN_URL} (set LORAPLEX_TEST_PG to another "
                           f"admin URL): {e}") from e
    with conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return f"{base}/{name}", name


def drop_database(name: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class MotoServer:
    """moto's S3 server in its own process on a free loopback port."""

    def __init__(self, min_part_size: int = 1024) -> None:
        self.port = free_port()
        env = dict(os.environ, S3_UPLOAD_PART_MIN_SIZE=str(min_part_size), AWS_ACCESS_KEY_ID="testing",
                   AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, proc=self.proc)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class CuttingProxy:
    """Forwards 127.0.0.1:<port> to a target port until ``cut_after`` bytes went upstream; then it drops every
    connection and refuses new ones (the store 'goes down' mid-upload)."""

    def __init__(self, target_port: int, cut_after: int) -> None:
        self.target_port, self.cut_after, self.sent, self.down = target_port, cut_after, 0, False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.down:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while data := src.recv(65536):
                if upstream:
                    with self.lock:
                        self.sent += len(data)
                        if self.sent > self.cut_after:
                            self.cut()
                            return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self) -> None:
        self.down = True
        for s in [self.listener, *self.conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
