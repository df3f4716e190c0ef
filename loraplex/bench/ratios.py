"""The ratios a report states beside its rows: adapter TPOT over base-only TPOT (same run, per level in a sweep),
INT8 over bf16, the engine over HF + PEFT, the churn run over the all-resident one, the light tenant's TTFT
beside the heavy one over alone."""
from __future__ import annotations


def _variant_rows(scenarios: list[dict]) -> dict[tuple, list[dict]]:
    """(phase, variant, level) -> its rows (one per sample, in order), for rows that carry them."""
    out: dict[tuple, list[dict]] = {}
    for s in scenarios:
        e = s.get("extra") or {}
        if e.get("variant") is not None:
            out.setdefault((e.get("phase"), e["variant"], e.get("level")), []).append(s)
    return out


def _mean_tpot(rows: list[dict]) -> float:
    return sum(s["tpot_mean_ms"] for s in rows) / len(rows)


def report_ratios(scenarios: list[dict], hf: list[dict]) -> dict:
    by = {s["name"]: s for s in scenarios}
    r: dict[str, float] = {}
    rows = _variant_rows(scenarios)
    for (phase, variant, level), samples in rows.items():
        if variant == "base-only":
            continue
        base = rows.get((phase, "base-only", level))
        if base is not None and "adapters" in variant and _mean_tpot(base) > 0:
            sweep = any(k[2] != level for k in rows if k[0] == phase and k[1] == variant)
            key = f"{phase} TPOT adapters / base" + (f" C={level}" if sweep else "")
            r[key] = _mean_tpot(samples) / _mean_tpot(base)  # the samples' mean TPOTs (repeats)
            pairs = [a["tpot_mean_ms"] / b["tpot_mean_ms"] for a, b in zip(samples, base) if b["tpot_mean_ms"] > 0]
            if len(pairs) > 1:  # each sample against the base-only sample of the same index
                r[key + " sample min"], r[key + " sample max"] = min(pairs), max(pairs)
    if "bf16 base-only" in by and "int8 base-only" in by:
        r["int8 / bf16 base-only per-request tok/s"] = (by["int8 base-only"]["per_request_output_tok_s"]
                                                        / by["bf16 base-only"]["per_request_output_tok_s"])
    peft = next((h for h in hf if "PEFT" in h["name"]), None)
    lora = next((s for s in scenarios if "adapters" in s["name"]), None)
    if peft and lora:
        r["adapters per-request decode tok/s / HF+PEFT"] = (lora["per_request_decode_tok_s"]
                                                            / peft["per_request_decode_tok_s"])
        if peft.get("est_per_request_output_tok_s") and peft.get("est_output_len") == lora["output_len"]:
            r["adapters per-request tok/s / HF+PEFT (est. at same output)"] = (
                lora["per_request_output_tok_s"] / peft["est_per_request_output_tok_s"])
    full = next((s for s in scenarios if (s.get("extra") or {}).get("phase", "").endswith("all-resident")), None)
    if full is not None:
        for s in scenarios:
            phase = (s.get("extra") or {}).get("phase") or ""
            if s is full or not phase.startswith(full["extra"]["phase"].rsplit(" ", 1)[0]) or "all-resident" in phase:
                continue
            r[f"churn TTFT p99 {phase} / all-resident"] = s["ttft_p99_ms"] / full["ttft_p99_ms"]
            r[f"churn OTPS per request {phase} / all-resident"] = (s["per_request_output_tok_s"]
                                                                   / full["per_request_output_tok_s"])
    alone = next((s for s in scenarios if (s.get("extra") or {}).get("variant") == "light alone"), None)
    if alone is not None:
        for s in scenarios:
            e = s.get("extra") or {}
            if str(e.get("variant", "")).startswith("beside heavy"):
                r[f"light TTFT p50 {e['phase']} {e['variant']} / alone"] = s["ttft_p50_ms"] / alone["ttft_p50_ms"]
                r[f"light TTFT p99 {e['phase']} {e['variant']} / alone"] = s["ttft_p99_ms"] / alone["ttft_p99_ms"]
    return r
