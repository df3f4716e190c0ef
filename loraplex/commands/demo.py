"""``loraplex demo``: the README's main job: the whole platform on embedded defaults, end to end.

    loraplex demo                                   # SQLite, local blob folder, in-process quotas and engine (CPU)
    loraplex demo --database-url postgresql+psycopg://postgres@127.0.0.1/loraplex --redis-url redis://127.0.0.1:6379/0 \\
                  --s3-endpoint-url http://127.0.0.1:9000 --s3-bucket adapters       # the same, on real services
    loraplex demo --serve                           # keep the API up afterwards (Ctrl-C stops it)

The base model is a tiny random checkpoint built for the demo: its answers are noise, and what they show is that
each adapter changes the answer (same prompt, greedy decoding). The demo's settings (its admin key, secret key, data
folder, model) are kept in ``<work-dir>/demo/demo.env`` (mode 0600) and reused by the next run, so the keys it
prints stay valid: ``set -a; . var/demo/demo.env; set +a; loraplex serve`` serves the same registry again.

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
ENV_FILE = "demo.env"
PERSISTED = ("LORAPLEX_ADMIN_KEY", "LORAPLEX_SECRET_KEY")


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="try the whole platform on CPU: a tiny random model, two adapters",
                              description="Run the whole platform on embedded defaults (SQLite, a local blob folder, "
                                          "the engine in-process on CPU) with a tiny random model built on the spot: "
                                          "create a tenant and an API key, upload two LoRA adapters, ask the base "
                                          "model and both adapters, print the answers (noise from a random model: "
                                          "they show that each adapter changes the answer) and the keys. The "
                                          "settings are kept in <work-dir>/demo/demo.env for the next run and for "
                                          "`loraplex serve`.")
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


def _saved(root: str) -> dict[str, str]:
    """The secrets an earlier run of the demo kept in ``<root>/demo.env``."""
    out: dict[str, str] = {}
    try:
        with open(os.path.join(root, ENV_FILE), encoding="utf-8") as f:
            for line in f:
                key, sep, value = line.strip().partition("=")
                if sep and key in PERSISTED:
                    out[key] = value
    except OSError:
        pass
    return out


def _save(root: str, settings, api_key: str) -> str:
    """``<root>/demo.env``: what `loraplex serve` and `loraplex adapters` need to use this demo again (0600)."""
    values = {"LORAPLEX_ADMIN_KEY": settings.admin_key.get_secret_value(),
              "LORAPLEX_SECRET_KEY": settings.secret_key.get_secret_value(),
              "LORAPLEX_DATA_DIR": os.path.abspath(settings.data_dir),
              "LORAPLEX_DATABASE_URL": settings.sqlalchemy_url, "LORAPLEX_BASE_MODEL_PATH": settings.base_model_path,
              "LORAPLEX_ENGINE_DEVICE": "cpu", "LORAPLEX_ENGINE_DTYPE": "float32",
              "LORAPLEX_URL": "http://127.0.0.1:8000", "LORAPLEX_API_KEY": api_key}
    if settings.redis_url:
        values["LORAPLEX_REDIS_URL"] = settings.redis_url
    if settings.blob_backend == "s3":
        values.update(LORAPLEX_BLOB_BACKEND="s3", LORAPLEX_S3_BUCKET=settings.s3_bucket)
        if settings.s3_endpoint_url:
            values["LORAPLEX_S3_ENDPOINT_URL"] = settings.s3_endpoint_url
    path = os.path.join(root, ENV_FILE)
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("# loraplex demo settings (secrets: keep this file private)\n")
        f.writelines(f"{k}={v}\n" for k, v in values.items())
    os.replace(path + ".tmp", path)
    return path


def _settings(args: argparse.Namespace, root: str, model: str):
    from loraplex.platform.core.config import Settings

    saved = _saved(root)
    overrides = dict(data_dir=os.path.join(root, "data"), base_model_path=model, engine_device="cpu",
                     engine_dtype="float32",
                     admin_key=os.environ.get("LORAPLEX_ADMIN_KEY") or saved.get("LORAPLEX_ADMIN_KEY")
                     or secrets.token_urlsafe(24),
                     secret_key=os.environ.get("LORAPLEX_SECRET_KEY") or saved.get("LORAPLEX_SECRET_KEY")
                     or secrets.token_urlsafe(24))
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
    from loraplex.platform.api.header_limit import SERVER_LIMITS
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
    print(f"building a tiny random {args.family} model (once, under {root}): it has never been trained, so its "
          "answers are noise; the demo shows that each adapter changes them")
    model = tiny_model_path(args.family, os.path.join(root, "models"))
    settings = _settings(args, root, model)
    if settings.blob_backend == "s3":
        from loraplex.platform.blobs import make_blob_store

        make_blob_store(settings).ensure_bucket()
    migrate("upgrade", "head", url=settings.sqlalchemy_url)
    port = args.port or _free_port(args.host)
    url = f"http://{args.host}:{port}"
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=args.host, port=port, log_level="warning",
                                            **SERVER_LIMITS))
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
            print(f"tenant {tenant['name']} created; its API key (the platform keeps only a hash): {key}")
            for name, seed in (("poet", 1), ("pirate", 2)):
                folder = _build_adapter(model, os.path.join(root, "adapters", f"{args.family}-{name}"), seed)
                files = [("files", (n, open(os.path.join(folder, n), "rb").read()))
                         for n in ("adapter_config.json", "adapter_model.safetensors")]
                r = http.post("/v1/adapters", data={"name": name}, files=files,
                              headers={"Authorization": f"Bearer {key}"})
                if r.status_code not in (200, 201):
                    print(f"upload of {name} failed: {r.status_code} {r.text}")
                    return 1
                v = r.json()
                print(f"uploaded adapter {name} v{v['number']} (rank {v['rank']}, {v['size_bytes']} bytes)")
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
        print(f"models: {', '.join(m.id for m in client.models.list())}")
        base = os.path.basename(model)
        print(f"asking {PROMPT!r} with greedy decoding; random weights make noise, but different noise per adapter:")
        for target in (base, "poet", "pirate"):
            answer = client.chat.completions.create(
                model=target, messages=[{"role": "user", "content": PROMPT}], max_tokens=args.max_tokens,
                temperature=0)
            print(f"[{target}] {answer.choices[0].message.content!r}")
        print(f"API docs: {url}/docs   (done in {time.perf_counter() - t0:.1f} s)")
        saved = _save(root, settings, key)
        print(f"admin key: {settings.admin_key.get_secret_value()}   (both keys stay valid: the settings are kept "
              f"in {saved})")
        print(f"use them again later:  set -a; . {saved}; set +a; loraplex serve    then, in another shell with the "
              "same file sourced:  loraplex adapters list")
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
