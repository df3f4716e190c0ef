"""Engine-server fixtures: a tiny llama engine with LoRA behind the real HTTP app on a uvicorn thread (real
sockets), a PEFT adapter for it, and a helper that runs ``loraplex engine serve`` as a separate process."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tests.utils.services import free_port, wait_for_port


class ThreadServer:
    """uvicorn serving ``app`` on a free port from a background thread."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(20)


@pytest.fixture(scope="session")
def llama_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def llama_adapter(llama_path, tmp_path_factory):
    """A PEFT LoRA (attention, r=4, random non-zero weights) of the tiny llama; returns its folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     init_lora_weights=False)
    out = str(tmp_path_factory.mktemp("llama-lora"))
    get_peft_model(model, cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def engine_server(llama_path):
    """(service, ThreadServer): a real engine (LoRA on, 2 slots) behind the HTTP app."""
    from loraplex.engine.server.app import ServiceHolder, create_app
    from loraplex.engine.server.serve import real_service

    service = real_service(llama_path, model_name="tiny-llama", device="cpu", dtype="float32", enable_lora=True,
                           max_loras=2, max_lora_rank=8, max_cpu_loras=4, max_num_seqs=8, progress=False)
    server = ThreadServer(create_app(ServiceHolder(service=service)))
    yield service, server
    server.stop()  # the app's shutdown closes the service (and the engine thread)


@pytest.fixture
def engine_process():
    """``start(*args) -> (url, Popen)``: ``loraplex engine serve ARGS --port P`` as a child process, killed after."""
    procs: list[subprocess.Popen] = []

    def start(*args: str):
        port = free_port()
        cmd = [sys.executable, "-m", "loraplex.cli", "engine", "serve", *args, "--port", str(port),
               "--log-level", "warning"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs.append(proc)
        wait_for_port(port, timeout=30, proc=proc)
        return f"http://127.0.0.1:{port}", proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
