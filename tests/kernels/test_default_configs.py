"""Configs for shapes without a tuned entry: split-K grows with K (measured on the H200: lora_shrink at K = 2880 took
32.7 us with SPLIT_K = 1 and 5.2 us with 16), and small test shapes keep the plain single-split config."""
import pytest

from loraplex.kernels import fused_moe_lora as fml
from loraplex.kernels import lora_shrink as sh
from loraplex.kernels import tuning


@pytest.mark.parametrize("k, expected", [(40, 1), (256, 1), (257, 2), (2880, 12), (4096, 16), (65536, 16)])
def test_split_k_grows_with_k_and_is_capped(k, expected):
    assert sh.split_k_for(k, 64) == expected


def test_defaults_for_real_shapes_use_split_k_and_small_shapes_do_not():
    assert sh.default_config(72) == sh.DEFAULT_CONFIG
    big = sh.default_config(4096)
    assert big["SPLIT_K"] == 16 and big["num_warps"] == 2
    assert fml.default_config(72) == fml.DEFAULT_CONFIG
    moe = fml.default_config(2880)
    assert moe["SPLIT_K"] == 12 and moe["BLOCK_N"] == 128 and moe["FUSED"] == 0 and moe["PDL"] == 0


def test_missing_tuned_entry_falls_back_to_the_shape_aware_default(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_TUNING_DIR", str(tmp_path))
    tuning.clear_cache()
    try:
        cfg = tuning.get_config("lora_shrink", {"S": 1, "L": 8, "R": 32, "K": 4096}, 16, sh.default_config(4096),
                                device_name="NVIDIA H200")
        assert cfg["SPLIT_K"] == 16
    finally:
        tuning.clear_cache()
