"""Names of committed results: ``<scenario>-<model>-<precision>[-e2e]-<YYYY-MM-DD>`` (``benchmarks/results/``).

    result_stem(report)   # "sweep-gpt-oss-20b-bf16-2026-12-01", "churn-gpt-oss-20b-bf16-e2e-2026-12-01"

scenario: ``--label`` if given, else ``sweep`` (several concurrency levels), ``serve`` (one), ``churn`` or
``fairness``; model: the scale's (``gpt-oss-20b`` / ``gpt-oss-tiny``), or end to end the base model's name at the
endpoint when given; precision: the experts' quantization, else the dtype (bf16, fp16, fp32); end to end it is
the deployment's and unknown to the bench, so ``e2e`` stands in its place; date: the report's (UTC).
"""
from __future__ import annotations

import re

MODEL_NAMES = {"full": "gpt-oss-20b", "tiny": "gpt-oss-tiny"}
PRECISIONS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.") or "x"


def scenario_kind(workload: dict) -> str:
    if workload.get("label"):
        return _slug(workload["label"])
    if workload.get("scenario", "load") != "load":
        return workload["scenario"]
    return "sweep" if len(workload.get("levels") or [1]) > 1 else "serve"


def result_stem(report: dict) -> str:
    wl = report["workload"]
    date = (report.get("env") or {}).get("date", "")[:10] or "undated"
    if report.get("mode") == "end-to-end":
        model = _slug(wl["base_model"]) if wl.get("base_model") else MODEL_NAMES.get(wl.get("scale"), "model")
        return f"{scenario_kind(wl)}-{model}-e2e-{date}"
    precision = wl.get("quantization") or PRECISIONS.get(wl.get("dtype"), _slug(str(wl.get("dtype"))))
    return f"{scenario_kind(wl)}-{MODEL_NAMES.get(wl.get('scale'), 'model')}-{precision}-{date}"
