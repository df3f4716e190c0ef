"""benchmarks/kernels/probe_moe_lora.py off the GPU: every variant of the expert layer it times runs through the
interpreter at tiny shapes, with 8-pair row blocks so that the MXFP4 + LoRA rows take the epilogue path, and each
computes what its label says."""
import torch

from loraplex.kernels import fused_moe_mxfp4 as fm4
from loraplex.kernels import moe_experts_lora as mel
from tests.utils.scripts import load_script


def test_every_variant_runs_and_computes_what_its_label_says(monkeypatch):
    gemm = load_script("kernels", "mxfp4_gemm_gpu")
    probe = load_script("kernels", "probe_moe_lora")
    from loraplex.kernels.tuning_cases import AdapterMix, adapter_indices

    # no tuning file on the CPU: the default config, at the decode path's row blocks (expands in the epilogues)
    monkeypatch.setattr(fm4, "DEFAULT_CONFIG", dict(fm4.DEFAULT_CONFIG, BLOCK_M=8, BLOCK_N=32, BLOCK_K=64))
    m = 5
    inp = gemm.moe_inputs(gemm.TINY, m, "cpu", 3, torch.float32)
    lo = gemm.lora_inputs(gemm.TINY, m, inp["ids"], 3, 4, "cpu", torch.float32)
    lo["idx"] = adapter_indices(m, AdapterMix(3, "even"), "cpu")
    calls = probe.variants(inp, lo, 16, (1, 3))
    epilogue_calls = []
    real = mel._kernel_layout_epilogue
    monkeypatch.setattr(mel, "_kernel_layout_epilogue", lambda *a, **k: (epilogue_calls.append(1), real(*a, **k))[1])
    got = {label: fn() for label, fn in calls.items()}
    # LoRA, waits first, shrinks only, epilogues only, the two split-K rows, up to 16-row blocks (not the expands apart)
    assert len(epilogue_calls) == 7
    for label, out in got.items():
        assert out.shape == (m, gemm.TINY.hidden) and torch.isfinite(out).all(), label
    want = got["mxfp4 + LoRA, expands apart"]
    assert (want - got["mxfp4"]).abs().max() > 1e-2  # the adapters change the output
    for label in probe.CHECKED + (probe.epilogue_label(16), probe.split_label(1), probe.split_label(3)):
        torch.testing.assert_close(got[label], want, rtol=1e-4, atol=1e-4)
    # timing-only rows: the shrinks without any expand give the base layer; the epilogues fed by rows shrunk once
    # (on the first call) give the layer with LoRA
    torch.testing.assert_close(got["mxfp4 + LoRA, shrinks only"], got["mxfp4"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["mxfp4 + LoRA, epilogues only"], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(calls["mxfp4 + LoRA, epilogues only"](), want, rtol=1e-4, atol=1e-4)
