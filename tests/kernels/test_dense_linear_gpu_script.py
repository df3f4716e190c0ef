"""benchmarks/kernels/dense_linear_gpu.py off the GPU: its byte roofline at GPT-OSS-20B's shapes, and its shape table
against the model's config (the timing needs cuBLAS on a GPU: without one the script says so and exits)."""
from __future__ import annotations

import pytest
import torch

from tests.utils.scripts import load_script

dense = load_script("kernels", "dense_linear_gpu")


def test_roofline_counts_weights_activations_and_bias():
    # qkv at M = 1: 2880 x 5120 bf16 weights, one row in and out, the bias; 29.5 MB at 4 TB/s is 7.38 µs
    nbytes = (5120 * 2880 + 2880 + 5120 + 5120) * 2
    assert dense.roofline_us(2880, 5120, 1, True, 4.0) == pytest.approx(nbytes / 4e12 * 1e6)
    assert dense.roofline_us(2880, 5120, 1, True, 4.0) == pytest.approx(7.3794, abs=1e-4)
    # the LM head has no bias; M = 64 rows add 64 x (2880 + 201088) bf16 values to its 1.16 GB
    assert dense.roofline_us(2880, 201088, 64, False, 2.0) == pytest.approx(
        (201088 * 2880 + 64 * (2880 + 201088)) * 2 / 2e12 * 1e6)
    assert dense.roofline_us(2880, 32, 16, True, 4.0) < dense.roofline_us(2880, 32, 64, True, 4.0)


def test_shapes_are_gpt_oss_20b():
    from loraplex.bench.workload import GPT_OSS_20B as c

    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    assert dense.SHAPES == {"qkv": (h, q + 2 * kv, True, layers), "o": (q, h, True, layers),
                            "router": (h, c["num_local_experts"], True, layers),
                            "lm_head": (h, c["vocab_size"], False, 1)}


def test_without_a_gpu_it_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="dense_linear_gpu.py needs a CUDA GPU"):
        dense.main(["--m", "1", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())
