"""benchmarks/kernels/moe_prefill_tma_gpu.py off the GPU: its TMA-fed gate_up and down kernels give fused_moe's
outputs (one small routed float32 case under the interpreter), so the figures it times are of the same op. Its
products are plain ``tl.dot`` (tf32 on float32 operands, as the probe is for bf16), hence a tf32-sized tolerance: a
wrong row, column or expert gives errors of order 1."""
from tests.utils.scripts import load_script

probe = load_script("kernels", "moe_prefill_tma_gpu")


def test_the_tma_kernels_match_fused_moe_on_the_cpu():
    rows = probe.main()
    assert rows and all("error" not in r for r in rows), rows
    for r in rows:
        assert r["err_gu"] < 2e-3 and r["err_dn"] < 2e-3, r
