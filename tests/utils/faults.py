"""Services that fault-injection tests can break on purpose, all on free loopback ports and owned by the test:

    redis = RedisProcess(); redis.kill(); redis.start()              # own redis-server, same port after restart
    pg = PostgresCluster(); pg.stop(); pg.start()                  # own initdb/pg_ctl cluster (trust auth)
    proxy = FaultProxy(target_port); proxy.down(); proxy.slow(2.0); proxy.up()   # TCP proxy in front of moto

Never touches the machine's own Redis or PostgreSQL services.
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time

from tests.utils.services import free_port, wait_for_port


class RedisProcess:
    """``redis-server --port N --save "" --appendonly no``: an empty, memory-only Redis that can be killed."""

    def __init__(self) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not on PATH; the fault tests start their own Redis (apt install "
                               "redis-server)")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, proc=self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def postgres_bin_dir() -> str | None:
    """The newest ``/usr/lib/postgresql/<v>/bin`` with initdb and pg_ctl, or None."""
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    for d in reversed(dirs):
        if os.path.exists(os.path.join(d, "initdb")) and os.path.exists(os.path.join(d, "pg_ctl")):
            return d
    return None


class PostgresCluster:
    """A throwaway PostgreSQL cluster (initdb under a fresh /tmp folder, trust auth, loopback, free port) that can be
    stopped and started. Runs as the ``postgres`` user when the test runs as root (initdb refuses root)."""

    def __init__(self) -> None:
        bindir = postgres_bin_dir()
        if bindir is None:
            raise RuntimeError("no /usr/lib/postgresql/*/bin with initdb and pg_ctl; install the PostgreSQL server")
        self.bindir, self.port = bindir, free_port()
        root = self.root = tempfile.mkdtemp(prefix="loraplex-pg-")   # in /tmp: the postgres user can reach it
        self.data = os.path.join(root, "pgdata")
        self.sock = os.path.join(root, "pgsock")
        os.makedirs(self.sock, exist_ok=True)
        self._as_user = os.geteuid() == 0
        if self._as_user:
            shutil.chown(root, "postgres")
            shutil.chown(self.sock, "postgres")
        self._run([os.path.join(bindir, "initdb"), "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync"])
        self.start()

    def _run(self, cmd: list[str]) -> None:
        if self._as_user:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.sock} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run([os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-o", opts, "-w", "-t", "60",
                   "-l", os.path.join(os.path.dirname(self.data), "pg.log"), "start"])
        wait_for_port(self.port)

    def stop(self, mode: str = "immediate") -> None:
        self._run([os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-m", mode, "-w", "stop"])

    def destroy(self) -> None:
        """Stops the cluster if it runs and removes its folder."""
        try:
            self.stop("immediate")
        except RuntimeError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


class ProxiedPostgres:
    """Fallback when no PostgreSQL server binaries exist: a fresh database on the machine's PostgreSQL, reached
    through a ``FaultProxy`` that ``stop()`` cuts (every connection dropped, new ones refused) and ``start()``
    restores. Same interface as ``PostgresCluster``; the server itself keeps running."""

    def __init__(self) -> None:
        from urllib.parse import urlsplit

        from tests.utils.services import PG_ADMIN_URL, create_database

        self._url, self.name = create_database()
        self.proxy = FaultProxy(urlsplit(PG_ADMIN_URL).port or 5432)
        self.port = self.proxy.port

    @property
    def url(self) -> str:
        head, _, tail = self._url.partition("@")
        return f"{head}@127.0.0.1:{self.port}/{tail.split('/', 1)[1]}"

    def start(self) -> None:
        self.proxy.up()

    def stop(self, mode: str = "immediate") -> None:
        self.proxy.down()

    def destroy(self) -> None:
        from tests.utils.services import drop_database

        self.proxy.close()
        drop_database(self.name)


def own_postgres() -> "PostgresCluster | ProxiedPostgres":
    """A PostgreSQL the caller may stop and start: its own cluster when initdb/pg_ctl exist, else the machine's
    behind a cuttable proxy (``LORAPLEX_TEST_PG_MODE=proxy`` forces the fallback)."""
    if os.environ.get("LORAPLEX_TEST_PG_MODE") == "proxy" or postgres_bin_dir() is None:
        return ProxiedPostgres()
    return PostgresCluster()


class FaultProxy:
    """TCP proxy 127.0.0.1:<port> → 127.0.0.1:<target_port> with three modes: ``up`` (forward), ``down`` (every
    open connection is dropped and new ones are closed at once, like a dead endpoint) and ``slow(delay_s)``
    (each chunk, either way, waits ``delay_s`` first)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.delay_s = 0.0
        self.is_down = False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        self.is_down, self.delay_s = False, 0.0

    def slow(self, delay_s: float) -> None:
        self.is_down, self.delay_s = False, delay_s

    def down(self) -> None:
        self.is_down = True
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            _close(s)

    def close(self) -> None:
        self._closed = True
        self.down()
        _close(self.listener)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.is_down:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._conns |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.delay_s:
                    time.sleep(self.delay_s)
                if self.is_down:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _close(s)
                with self._lock:
                    self._conns.discard(s)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
