"""``loraplex demo``: the README's main job: the whole platform on embedded defaults, end to end.

    loraplex demo                                   # SQLite, local blob folder, in-process quotas and engine (CPU)
    loraplex demo --database-url postgresql+psycopg://postgres@127.0.0.1/loraplex --redis-url redis://127.0.0.1:6379/0 \\
                  --s3-endpoint-url http://127.0.0.1:9000 --s3-bucket adapters       # the same, on real services
    loraplex demo --serve                           # keep the API up afterwards (Ctrl-C stops it)

Steps: build a tiny model with a tokenizer (once, under ``--work-dir``), migrate the registry, start the API
(uvicorn) with the engine in-process, create the ``demo`` tenant and an API key through the admin API, build
two small LoRA adapters with PEFT (random non-zero weights, so their answers differ), upload them through the
API, ask the base model and both adapters through the ``openai`` client, and print the answers, the address of
the API docs and of the admin dashboard with a one-time login link (valid 10 minutes; ``--serve`` keeps the
dashboard up to open it). Every ``LORAPLEX_*`` env var is honoured; the flags override them.
"""
from __future__ import annotations

import argparse
import os
import secrets
import threading
import time

PROMPT = "Once upon a time"


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run the whole platform on embedded defaults and ask two adapters")
    p.add_argument("--family", default="qwen3_moe", help="tiny model family (default: qwen3_moe)")
    p.add_argument("--work-dir", default=os.environ.get("LORAPLEX_HOME", "var"),
                   help="model, data and adapters go under <work-dir>/demo (default: ./var)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="API port (default: a free one)")
    p.add_argument("--database-url", default=None, help="e.g. postgresql+psycopg://user@host/db (default: SQLite)")
    p.add_argument("--redis-url", default=None, help="quota store (default: in-process)")
    p.add_argument("--s3-endpoint-url", default=None, help="S3-compatible blob store (default: a local folder)")
    p.add_argument("--s3-bucket", default=None)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--serve", action="store_true", help="keep serving after the demo until Ctrl-C")
    p.set_defaults(func=run)


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _build_adapter(base: str, out_dir: str, seed: int) -> str:
    """A small PEFT LoRA of the tiny model: attention everywhere, fused experts on MoE models."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(out_dir, "adapter_model.safetensors")):
        return out_dir
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    moe = getattr(model.config, "num_experts", None) or getattr(model.config, "num_local_experts", None)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if moe else None)
    get_peft_model(model, cfg).save_pretrained(out_dir)
    return out_dir


def _settings(args: argparse.Namespace, root: str, model: str):
    from loraplex.platform.core.config import Settings

    overrides = dict(data_dir=os.path.join(root, "data"), base_model_path=model, engine_device="cpu",
                     engine_dtype="float32", admin_key=os.environ.get("LORAPLEX_ADMIN_KEY") or secrets.token_urlsafe(24))
    if not os.environ.get("LORAPLEX_ENGINE_URLS"):
        overrides["engine_mode"] = "embedded"
    if args.database_url:
        overrides["database_url"] = args.database_url
    if args.redis_url:
        overrides["redis_url"] = args.redis_url
    if args.s3_endpoint_url or args.s3_bucket:
        overrides.update(blob_backend="s3", s3_endpoint_url=args.s3_endpoint_url)
        if args.s3_bucket:
            overrides["s3_bucket"] = args.s3_bucket
    return Settings(**overrides)


def run(args: argparse.Namespace) -> int:
    import logging

    import httpx
    import openai
    import uvicorn

    from loraplex.commands.db import run as migrate
    from loraplex.commands.generate import tiny_model_path
    from loraplex.platform.main import create_app

    import warnings

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    root = os.path.abspath(os.path.join(args.work_dir, "demo"))
    model = tiny_model_path(args.family, os.path.join(root, "models"))
    settings = _settings(args, root, model)
    if settings.blob_backend == "s3":
        from loraplex.platform.blobs import make_blob_store

        make_blob_store(settings).ensure_bucket()
    migrate("upgrade", "head", url=settings.sqlalchemy_url)
    port = args.port or _free_port(args.host)
    url = f"http://{args.host}:{port}"
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=args.host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="loraplex-demo-api", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            print("the API failed to start (see the log above)")
            return 1
        time.sleep(0.05)
    try:
        admin = {"Authorization": f"Bearer {settings.admin_key.get_secret_value()}"}
        with httpx.Client(base_url=url, timeout=120) as http:
            r = http.post("/admin/tenants", json={"name": f"demo-{secrets.token_hex(3)}"}, headers=admin)
            r.raise_for_status()
            tenant = r.json()
            r = http.post(f"/admin/tenants/{tenant['id']}/keys", json={"name": "demo"}, headers=admin)
            r.raise_for_status()
            key = r.json()["key"]
            print(f"tenant {tenant['name']} created; API key {key[:15]}... (shown once)")
            for name, seed in (("poet", 1), ("pirate", 2)):
                folder = _build_adapter(model, os.path.join(root, "adapters", f"{args.family}-{name}"), seed)
                files = [("files", (n, open(os.path.join(folder, n), "rb").read()))
                         for n in ("adapter_config.json", "adapter_model.safetensors")]
                r = http.post("/v1/adapters", data={"name": name}, files=files,
                              headers={"Authorization": f"Bearer {key}"})
                if r.status_code != 201:
                    print(f"upload of {name} failed: {r.status_code} {r.text}")
                    return 1
                v = r.json()
                print(f"uploaded adapter {name} v{v['number']} (rank {v['rank']}, {v['size_bytes']} bytes)")
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
        print(f"models: {', '.join(m.id for m in client.models.list())}")
        base = os.path.basename(model)
        for target in (base, "poet", "pirate"):
            answer = client.chat.completions.create(
                model=target, messages=[{"role": "user", "content": PROMPT}], max_tokens=args.max_tokens,
                temperature=0)
            print(f"[{target}] {answer.choices[0].message.content!r}")
        print(f"API docs: {url}/docs   (done in {time.perf_counter() - t0:.1f} s)")
        r = httpx.post(f"{url}/admin/dashboard/links", headers=admin, timeout=30)
        r.raise_for_status()
        print(f"dashboard: {url}/admin/dashboard   one-time login link (10 min): {url}{r.json()['url']}"
              + ("" if args.serve else "   (add --serve to keep it up)"))
        if args.serve:
            print("serving until Ctrl-C")
            while thread.is_alive():
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        thread.join(30)
    return 0
