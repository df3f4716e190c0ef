"""Gateway overhead with the null engine (no model: every request streams fixed tokens at once).

    .venv/bin/python benchmarks/gateway/bench_overhead.py [--requests 2000] [--concurrency 32] [--seconds 10]

Starts the whole platform in a uvicorn subprocess (SQLite, local blobs, in-process quotas, the in-process null
engine, a tiny tokenizer built locally), creates a tenant and key through the API, then measures from this
process with a minimal keep-alive HTTP client (httpx only for the admin calls):

- latency: sequential chat completions (``max_tokens=8``; streaming and not), p50/p90/p99 of the full request;
- baseline: the same client against a bare endpoint of the same uvicorn that answers a fixed JSON body, so
  "added" = gateway p50 − baseline p50 is what authentication, parsing, templating, tokenization, quotas,
  routing, the engine client and response building cost;
- throughput: ``--concurrency`` clients in a loop for ``--seconds``, requests/s (client and server share the
  machine's cores).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADMIN = "bench-admin-key-0123456789"

SERVER = r"""
import sys, uvicorn
from fastapi.responses import Response
from loraplex.platform.core.config import Settings
from loraplex.platform.main import create_app
settings = Settings(environment="test", admin_key=sys.argv[2], secret_key="bench-secret-0123456789",
                    data_dir=sys.argv[3], base_model_path=sys.argv[4], engine_mode="null", engine_null_tokens=8)
app = create_app(settings)
BODY = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":" tok tok tok tok tok tok tok tok"},"finish_reason":"length"}],"usage":{"prompt_tokens":12,"completion_tokens":8,"total_tokens":20}}'
@app.post("/bench/baseline")
async def baseline():
    return Response(BODY, media_type="application/json")
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class RawConnection:
    """A minimal HTTP/1.1 keep-alive client (asyncio streams, prebuilt request bytes): it costs far less CPU than
    httpx, which matters when client and server share two cores. Handles Content-Length and chunked bodies."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader = self.writer = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def request(self, raw: bytes) -> int:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            i = lower.index(b"content-length:")
            length = int(lower[i + 15:lower.index(b"\r\n", i)])
            await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


def raw_post(path: str, body: dict, key: str) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


async def latencies(port: int, raw: bytes, n: int) -> list[float]:
    conn = RawConnection(port)
    await conn.open()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        status = await conn.request(raw)
        out.append(time.perf_counter() - t0)
        assert status == 200, status
    conn.close()
    return out


async def throughput(port: int, raw: bytes, concurrency: int, seconds: float) -> tuple[int, int]:
    done = errors = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        conn = RawConnection(port)
        await conn.open()
        while time.perf_counter() < stop:
            if await conn.request(raw) == 200:
                done += 1
            else:
                errors += 1
        conn.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, errors


async def run(args, port: int) -> dict:
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, timeout=30) as admin:
        r = await admin.post("/admin/tenants", json={"name": "bench"}, headers={"Authorization": f"Bearer {ADMIN}"})
        tid = r.json()["id"]
        r = await admin.post(f"/admin/tenants/{tid}/keys", json={"name": "k"},
                             headers={"Authorization": f"Bearer {ADMIN}"})
        key = r.json()["key"]
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello, how are you today?"}],
            "max_tokens": 8}
    chat, chat_stream = raw_post("/v1/chat/completions", body, key), \
        raw_post("/v1/chat/completions", {**body, "stream": True}, key)
    bare_raw = raw_post("/bench/baseline", body, key)
    await latencies(port, chat, 300)  # warm-up
    await latencies(port, bare_raw, 300)
    gw = await latencies(port, chat, args.requests)
    gw_stream = await latencies(port, chat_stream, args.requests)
    bare = await latencies(port, bare_raw, args.requests)
    done, errors = await throughput(port, chat, args.concurrency, args.seconds)
    bare_done, _ = await throughput(port, bare_raw, args.concurrency, args.seconds)
    ms = lambda xs, q: round(percentile(xs, q) * 1000, 3)  # noqa: E731
    return {
        "requests": args.requests, "concurrency": args.concurrency, "seconds": args.seconds,
        "gateway_ms": {"p50": ms(gw, .5), "p90": ms(gw, .9), "p99": ms(gw, .99)},
        "gateway_stream_ms": {"p50": ms(gw_stream, .5), "p90": ms(gw_stream, .9), "p99": ms(gw_stream, .99)},
        "baseline_ms": {"p50": ms(bare, .5), "p90": ms(bare, .9), "p99": ms(bare, .99)},
        "added_p50_ms": round((statistics.median(gw) - statistics.median(bare)) * 1000, 3),
        "added_stream_p50_ms": round((statistics.median(gw_stream) - statistics.median(bare)) * 1000, 3),
        "requests_per_s": round(done / args.seconds, 1), "errors": errors,
        "baseline_requests_per_s": round(bare_done / args.seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args(argv)
    sys.path.append(ROOT)
    from loraplex.commands.db import run as db
    from loraplex.engine.testing.tiny import make_tiny_checkpoint
    from tests.utils.services import free_port, wait_for_port

    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as work:
        model = make_tiny_checkpoint("llama", os.path.join(work, "tiny-llama"))
        data = os.path.join(work, "data")
        db("upgrade", "head", url=f"sqlite:///{data}/loraplex.db")
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), ADMIN, data, model], cwd=ROOT)
        try:
            wait_for_port(port, timeout=60, proc=proc)
            result = asyncio.run(run(args, port))
        finally:
            proc.terminate()
            proc.wait(10)
    result["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python " \
                        f"{platform.python_version()}"
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
