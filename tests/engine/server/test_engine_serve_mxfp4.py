"""``loraplex engine serve --model <folder>`` on a GPT-OSS folder in the published layout (config.json with
``quantization_config`` mxfp4, tokenizer files, ``model.safetensors.index.json`` + shards of MXFP4 expert codes,
generation_config.json), as a separate process: it becomes ready and answers with transformers' greedy tokens
(transformers dequantising the same checkpoint)."""
from __future__ import annotations

import asyncio
import os
import time

import httpx
import torch

from loraplex.engine.testing.tiny import make_tiny_mxfp4_checkpoint
from loraplex.platform.engines.http_client import HttpEngineClient
from loraplex.platform.engines.messages import EngineRequest

PROMPT = [5, 17, 42, 99, 7, 13, 250, 31]
GREEDY = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}


def _wait_ready(url: str, proc, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        health = httpx.get(f"{url}/health", timeout=5).json()
        if health.get("ready"):
            return health
        assert "failed to load" not in health.get("detail", ""), health
        time.sleep(0.2)
    raise RuntimeError(f"engine not ready after {timeout}s: {httpx.get(f'{url}/health').json()}")


def test_engine_serve_loads_gpt_oss_as_published(engine_process, tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    path = make_tiny_mxfp4_checkpoint(tmp_path / "gpt-oss-tiny", max_shard_size="40KB")
    files = set(os.listdir(path))
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"} <= files
    assert "model.safetensors" not in files and sum(f.endswith(".safetensors") for f in files) > 1
    url, proc = engine_process("--model", path, "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "4")
    health = _wait_ready(url, proc)
    assert health["model"] == "gpt-oss-tiny"

    async def main():
        client = HttpEngineClient(url)
        try:
            return [c async for c in client.generate(EngineRequest("r1", "t", PROMPT, GREEDY))]
        finally:
            await client.close()

    chunks = asyncio.run(main())
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 10 and chunks[-1].finish_reason == "length"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    ids = torch.tensor([PROMPT + tokens[:-1]])
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(PROMPT) - 1:]
    assert logits.argmax(-1).tolist() == tokens  # transformers' greedy tokens
