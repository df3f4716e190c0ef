"""``loraplex demo``: the README's main job on embedded defaults.

For now it builds a tiny random GPT-OSS-shaped checkpoint on CPU and serves a few prompts through the engine with
continuous batching; the gateway issue grows it into the whole platform (API, tenants, adapters, openai client).
"""
from __future__ import annotations

import argparse
import os


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run the platform's demo on embedded defaults (tiny model on CPU)")
    p.add_argument("--family", default="gpt_oss", help="tiny model family (default: gpt_oss)")
    p.add_argument("--work-dir", default=os.environ.get("LORAPLEX_HOME", "var"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loraplex.commands.generate import run as generate

    ns = argparse.Namespace(model=None, tiny=args.family, prompt=None, max_tokens=24, temperature=0.0, top_p=1.0,
                            top_k=0, seed=None, device="cpu", dtype="float32", load_format="auto",
                            work_dir=args.work_dir)
    return generate(ns)
