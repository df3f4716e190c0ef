"""Fixtures of the bench tests: one tiny-scale serve benchmark run per session (CPU, a few seconds)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_report(tmp_path_factory):
    """(report dict, out_dir) of ``loraplex bench serve --scale tiny`` run through the CLI entry point."""
    from loraplex.cli import main

    out = tmp_path_factory.mktemp("bench-serve")
    rc = main(["bench", "serve", "--scale", "tiny", "--device", "cpu", "--num-requests", "7", "--concurrency", "3",
               "--output-len", "5", "--input-len", "20", "--num-adapters", "2", "--profile-steps", "2",
               "--out", str(out)])
    assert rc == 0
    import json

    with open(out / "bench_serve.json", encoding="utf-8") as f:
        return json.load(f), out
