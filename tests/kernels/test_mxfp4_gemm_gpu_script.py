"""benchmarks/kernels/mxfp4_gemm_gpu.py off the GPU: its byte model, and one end-to-end run at tiny shapes through the
interpreter (copy roofline, sweep through the tuner, every variant checked against the reference, the table, the
JSON and the tuned file)."""
import json

import torch

from loraplex.kernels import tuning, tuning_cases
from loraplex.kernels.fused_moe_mxfp4 import FUSED_MAX_WARPS
from tests.utils.scripts import load_script


def _script():
    return load_script("kernels", "mxfp4_gemm_gpu")


def test_byte_model_at_gpt_oss_shapes():
    mod = _script()
    weights = 2 * 2880 * 2880 + 2880 * 2880  # w13 [5760, 2880] + w2 [2880, 2880] of one expert
    assert mod.expert_weight_bytes(2880, 2880, "mxfp4") == weights * 17 // 32  # 4.25 bits a weight
    assert mod.expert_weight_bytes(2880, 2880, "bf16") == 2 * weights
    assert mod.expert_weight_bytes(2880, 2880, "int8") == weights + 4 * (5760 + 2880)
    # M = 16 touching 28 experts: ~0.37 GB of codes and scales, ~89 us at 4.2 TB/s
    got = mod.moe_bytes(16, 28, 2880, 2880, 4, "mxfp4")
    assert got == 28 * 13_219_200 + 2 * (2 * 16 * 2880 + 2 * 16 * 4 * 2880)
    assert 0.36e9 < got < 0.38e9
    lora = mod.lora_extra_bytes(16, 60, 2880, 2880, 4, 32)
    assert lora == 2 * (60 * 32 * (3 * 2880 + 2 * 2880) + 4 * 16 * 4 * 2 * 2880)


def test_byte_model_matches_the_tuning_case():
    """The script's formula and tuning_cases' MXFP4 case (what the tuner and bench_kernels report) agree."""
    mod = _script()
    shapes = tuning_cases.ModelShapes("tiny", hidden=96, num_experts=4, top_k=2, moe_intermediate=64, num_heads=4,
                                      num_kv_heads=2, head_dim=16, activation="swiglu_clamp", expert_bias=True)
    torch.manual_seed(5)
    (case,) = tuning_cases.moe_cases(shapes, 3, torch.float32, "cpu", weights="mxfp4")
    torch.manual_seed(5)  # the same draws: x, w13, w2, biases, then the routing
    torch.randn(3, 96), torch.randn(4, 128, 96), torch.randn(4, 96, 64), torch.randn(4, 128), torch.randn(4, 96)
    _, ids = torch.topk(torch.randn(3, 4), 2, dim=-1)
    active = int(ids.unique().numel())
    assert case.nbytes == mod.moe_bytes(3, active, 96, 64, 2, "mxfp4", elem=4)


def test_tiny_run_end_to_end(tmp_path, monkeypatch):
    mod = _script()
    monkeypatch.setenv(tuning.TUNING_DIR_ENV, "")  # the run points it at its output; unset again after the test
    monkeypatch.setattr(tuning_cases, "bench_time_ms", tuning_cases.bench_time_ms)  # --tiny swaps the timer
    try:
        rc = mod.main(["--tiny", "--out", str(tmp_path)])
    finally:
        tuning.clear_cache()
    data = json.loads((tmp_path / "mxfp4_gemm.json").read_text())
    rows = data["rows"]
    assert rc == 0 and data["copy_tbs"] > 0
    variants = {(r["m"], r["variant"]) for r in rows}
    whole = ("kernel layout", "checkpoint layout", "bf16", "int8", "kernel layout, bits", *mod.DECODE_FAMILIES)
    for m in (1, 3):
        for v in whole:
            assert (m, v) in variants
        tuned = next(r["config"] for r in rows if r["m"] == m and r["variant"] == "kernel layout")
        knobs = mod.relative_variants(m, tuned)  # the knob rows that differ from the tuned config
        assert len(knobs) >= 4 and all((m, v) in variants for v in knobs)
    assert (1, "kernel layout, direct") in variants
    assert (3, "lora kernel layout") in variants and (3, "lora checkpoint layout") in variants
    assert (3, "lora kernel layout, L2 prefetch") in variants
    for name in ("kernel layout", *mod.DECODE_FAMILIES):  # each GEMM alone at --gemm-m
        assert (3, f"gate_up, {name}") in variants and (3, f"down, {name}") in variants
    assert (3, "align, BLOCK_M 8") in variants and (3, "align, BLOCK_M 16") in variants
    checked = [r for r in rows if "rel_err" in r]
    assert len(checked) >= 2 * len(whole) + 2 and all(r["ok"] and r["rel_err"] < 1e-4 for r in checked)
    assert all(r["us"] > 0 and "error" not in r for r in rows)
    assert all(r["nbytes"] > 0 for r in rows if not r["variant"].startswith("align"))
    assert any(n.startswith("sweep M=1: default") for n in data["notes"])
    table = (tmp_path / "mxfp4_gemm.md").read_text()
    assert table.startswith("| M | variant |") and table.count("\n| 3 |") >= 20
    tuned = json.loads((tmp_path / "fused_moe_mxfp4.json").read_text())  # flat in $OUT
    assert set(tuned) == {"E=4,A=2,H=96,I=64"} and set(tuned["E=4,A=2,H=96,I=64"]) == {"1", "3"}
    assert all(c["BLOCK_K"] % 64 == 0 and c["DECODE"] in ("asm", "bits") for c in tuned["E=4,A=2,H=96,I=64"].values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused_moe_mxfp4.json", "mxfp4_gemm.json", "mxfp4_gemm.md"]


def test_warm_up_lists_cover_the_rows():
    """The first warm-up compiles every sweep candidate and family config; the second every config the rows run
    from the winners (the nearest swept M's winner at each M and its knob variants), each once."""
    mod = _script()
    from loraplex.kernels.fused_moe_mxfp4 import DEFAULT_CONFIG
    from loraplex.kernels.tuning_cases import mxfp4_moe_space

    first = mod.warm_configs([1, 16, 2048])
    assert all(c in first for m in (1, 16, 2048) for c in mxfp4_moe_space(m))
    assert all(c in first for c in (*mod.DECODE_FAMILIES.values(), *mod.PREFILL_FAMILIES.values()))
    assert len(first) == len({tuple(sorted(c.items())) for c in first}) <= 150
    winners = {1: mxfp4_moe_space(1)[0], 16: mxfp4_moe_space(16)[0], 2048: mxfp4_moe_space(2048)[0]}
    second = mod.winner_variants(winners, [16, 1, 4, 2048])
    for m, near in ((16, 16), (1, 1), (4, 1), (2048, 2048)):
        tuned = {**DEFAULT_CONFIG, **winners[near]}
        assert tuned in second and all(c in second for c in mod.relative_variants(m, tuned).values())
    assert len(second) == len({tuple(sorted(c.items())) for c in second})
    assert mod.winner_variants({}, [1]) == []


def test_no_row_fuses_gate_and_up_over_two_warpgroups():
    """The launcher runs such a config unfused (``fused_moe_mxfp4.FUSED_MAX_WARPS``): a family or knob row of that
    kind would time another row's config under its own name."""
    mod = _script()
    wide = {**mod.PREFILL_FAMILIES["run-1 best: wgmma 128x128x64, 8 warps"]}
    assert "kernel layout, fused gate/up" not in mod.relative_variants(2048, wide)
    assert "kernel layout, fused gate/up" in mod.relative_variants(2048, {**wide, "num_warps": 4})
    for cfg in (*mod.DECODE_FAMILIES.values(), *mod.PREFILL_FAMILIES.values()):
        assert not (cfg["GU_FUSED"] and cfg["num_warps"] > FUSED_MAX_WARPS), cfg
