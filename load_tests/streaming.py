"""An asyncio streaming client where token timing matters: time to first token and inter-token gaps per SSE
stream, over many concurrent streams; a fraction of clients disconnect on purpose after a few events.

    records = asyncio.run(stream_load(url, pop, duration_s=30, concurrency=8, disconnect_fraction=0.1))
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from load_tests.population import Population
from load_tests.records import Record, error_kind


async def sse_lines(response: httpx.Response):
    """Lines of an SSE body split on CR / LF only (as the SSE spec says). httpx's ``aiter_lines`` also splits on
    U+2028, U+0085 and other Unicode breaks, which may legitimately appear unescaped inside a JSON string."""
    buf = b""
    async for chunk in response.aiter_bytes():
        buf += chunk
        *lines, buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            yield line.decode("utf-8")
    if buf:
        yield buf.decode("utf-8")


async def one_stream(http: httpx.AsyncClient, tenant: dict, model: str, *, max_tokens: int, t0: float,
                     disconnect_after: int | None = None, scenario: str = "stream") -> Record:
    """One streamed chat completion; ``disconnect_after`` events, the client closes the connection."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.time()
    status, kind, rid, tokens, ttft, gaps, last = 0, "ok", None, 0, None, [], None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {tenant['key']}"}) as r:
            status, rid = r.status_code, r.headers.get("x-request-id")
            if status != 200:
                kind = error_kind(status, await r.aread())
            else:
                events, done = 0, False
                async for line in sse_lines(r):
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        kind = str(ev["error"].get("code") or ev["error"].get("type") or "stream_error")
                        continue
                    if ev.get("usage"):
                        tokens = ev["usage"]["completion_tokens"]
                    if ev.get("choices") and ev["choices"][0]["delta"].get("content") is not None:
                        now = time.time()
                        if ttft is None:
                            ttft = (now - start) * 1000
                        elif last is not None:
                            gaps.append((now - last) * 1000)
                        last = now
                    events += 1
                    if disconnect_after is not None and events >= disconnect_after:
                        kind = "client_disconnect"
                        break
                if not done and kind == "ok":
                    kind = "stream_cut_without_done"
    except httpx.HTTPError as e:
        kind = f"transport:{type(e).__name__}"
    return Record(scenario=scenario, tenant=tenant["id"], model=model, status=status, kind=kind,
                  latency_ms=(time.time() - start) * 1000, started_s=start - t0, request_id=rid,
                  completion_tokens=tokens, ttft_ms=ttft, itl_ms=gaps,
                  expected=kind in ("ok", "client_disconnect"))


async def stream_load(url: str, pop: Population, *, duration_s: float, concurrency: int = 8, max_tokens: int = 16,
                      disconnect_fraction: float = 0.1, t0: float | None = None, top_k: int = 20,
                      gate=None, records: list[Record] | None = None) -> list[Record]:
    """``concurrency`` loops of back-to-back streams on the ``top_k`` most popular adapters for ``duration_s``;
    no stream starts while ``gate.paused`` (``gate.Gate``). Records go to ``records`` as they come (if given)."""
    t0 = t0 or time.time()
    records = [] if records is None else records
    deadline = time.monotonic() + duration_s

    async def loop(http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            if gate is not None:
                gate.enter()                  # before looking at ``paused``: a pausing thread sees one or the other
                if gate.paused:
                    gate.leave()
                    await asyncio.sleep(0.05)
                    continue
            a = random.choice(pop.adapters[:top_k])
            cut = 3 if random.random() < disconnect_fraction else None
            try:
                records.append(await one_stream(http, pop.tenants[a["tenant"]], a["name"], max_tokens=max_tokens,
                                                t0=t0, disconnect_after=cut))
            finally:
                if gate is not None:
                    gate.leave()

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        await asyncio.gather(*(loop(http) for _ in range(concurrency)))
    return records


async def one_completion(http: httpx.AsyncClient, tenant: dict, model: str, *, max_tokens: int, t0: float,
                         scenario: str = "completion", timeout_s: float | None = None) -> Record:
    """One whole (non-streamed) completion; ``timeout_s`` makes the client give up (and disconnect) early."""
    start = time.time()
    status, kind, rid, tokens = 0, "ok", None, 0
    try:
        r = await http.post("/v1/completions", json={"model": model, "prompt": "Once upon a time",
                                                     "max_tokens": max_tokens, "ignore_eos": True},
                            headers={"Authorization": f"Bearer {tenant['key']}"},
                            timeout=timeout_s if timeout_s is not None else http.timeout)
        status, rid = r.status_code, r.headers.get("x-request-id")
        kind = error_kind(status, r.content)
        if kind == "ok":
            tokens = r.json()["usage"]["completion_tokens"]
    except httpx.TimeoutException:
        kind = "client_disconnect" if timeout_s is not None else "transport:Timeout"
    except httpx.HTTPError as e:
        kind = f"transport:{type(e).__name__}"
    return Record(scenario=scenario, tenant=tenant["id"], model=model, status=status, kind=kind,
                  latency_ms=(time.time() - start) * 1000, started_s=start - t0, request_id=rid,
                  completion_tokens=tokens, expected=kind == "ok")
