"""The tuner / benchmark / GPU-check glue, exercised on CPU with tiny shapes through the interpreter."""
import json

import pytest
import torch

from loraplex.kernels import tuning
from loraplex.kernels.tuning_cases import (AdapterMix, ModelShapes, adapter_indices, misc_cases, serving_mix,
                                           shared_metadata_cases, tunable_cases)

TINY = ModelShapes("tiny", hidden=32, num_experts=4, top_k=2, moe_intermediate=16, num_heads=4, num_kv_heads=2,
                   head_dim=16, activation="swiglu_clamp", expert_bias=True)


@pytest.mark.parametrize("m", [1, 7])
def test_cases_run_and_match_references(m):
    cases = tunable_cases(TINY, m, 3, 16, torch.float32, "cpu") + misc_cases(TINY, m, torch.float32, "cpu",
                                                                             context=32)
    labels = {c.label for c in cases}
    assert {"fused_moe", "fused_moe_int8", "lora_shrink[qkv]", "lora_expand[qkv]", "lora_shrink_expand[qkv]",
            "lora_shrink[o]", "lora_expand[o]", "lora_shrink_expand[o]", "fused_moe_lora[gate_up]",
            "fused_moe_lora[down]", "paged_attention[decode ctx=32]", "moe_align_pair",
            "rotary_embedding_and_cache"} <= labels
    for case in cases:
        assert case.check() < 1e-4, case.label
        assert case.nbytes > 0
        if case.default is not None:
            case.run(case.default)
            # every candidate sets at least the default's keys (optional ones, e.g. TMA, come on top)
            assert case.space and all(set(case.default) <= set(c) for c in case.space), case.label
            assert case.check(case.space[0]) < 1e-4, case.label  # the tuner checks candidates this way
        for name, cfg in case.variants.items():  # the one-kernel / PDL paths the benchmark and GPU check run
            assert case.check(cfg) < 1e-4, (case.label, name)
    assert {c.label for c in cases if c.variants} == {"lora_expand[qkv]", "lora_expand[o]", "fused_moe_lora[gate_up]",
                                                      "fused_moe_lora[down]"}


def test_fused_candidates_only_at_small_m():
    from loraplex.kernels.tuning_cases import FUSED_MAX_M, moe_lora_space

    small, large = moe_lora_space(1), moe_lora_space(FUSED_MAX_M + 1)
    assert any(c["FUSED"] for c in small) and not any(c["FUSED"] for c in large)
    assert any(c["PDL"] and not c["FUSED"] for c in large)  # PDL two-kernel candidates at every M
    assert len({tuple(sorted(c.items())) for c in small}) == len(small)  # no duplicate candidates


def test_time_budget_is_shared_out_over_cases_with_carry_over():
    from loraplex.commands.tune import case_deadline

    assert [case_deadline(100.0, 60.0, i, 6) for i in (1, 2, 6)] == [110.0, 120.0, 160.0]
    assert case_deadline(100.0, 0.0, 1, 6) == float("inf")


def test_tune_skips_candidates_that_fail_and_times_strictly(monkeypatch):
    """A candidate whose timing raises (launch error, or a graph capture the engine could not do either) is
    skipped; every timing asks for strict capture."""
    from loraplex.commands import tune

    case = [c for c in tunable_cases(TINY, 7, 3, 16, torch.float32, "cpu") if c.op == "lora_expand"][0]
    calls = []

    def fake(fn, **kw):
        calls.append(kw)
        if len(calls) == 2:
            raise RuntimeError("capture failed")
        return 2.0 if len(calls) == 3 else 4.0

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr("loraplex.kernels.tuning_cases.bench_time_ms", fake)
    best, best_ms, default_ms = tune.tune_case(case, deadline=float("inf"))
    assert (best, best_ms, default_ms) == (case.space[1], 2.0, 4.0)
    assert all(kw.get("strict") for kw in calls)


def test_tune_refuses_a_faster_candidate_that_is_wrong(monkeypatch, caplog):
    """The fastest candidate gives wrong output (a miscompiled tile): the tuner refuses it with a warning and keeps
    the fastest accurate one; a candidate slower than the best so far is never checked."""
    from loraplex.commands import tune

    case = [c for c in tunable_cases(TINY, 7, 3, 16, torch.float32, "cpu") if c.op == "lora_shrink"][0]
    wrong, second = case.space[2], case.space[4]
    times = {id(c): 3.0 for c in case.space}
    times.update({id(wrong): 1.0, id(second): 2.0})
    timings = iter([5.0] + [times[id(c)] for c in case.space])
    monkeypatch.setattr("loraplex.kernels.tuning_cases.bench_time_ms", lambda fn, **kw: next(timings))
    real_check, checked = case.check, []

    def check(cfg=None):
        checked.append(cfg)
        return 0.5 if cfg is wrong else real_check(cfg)

    case.check = check
    with caplog.at_level("WARNING", logger="loraplex.commands.tune"):
        best, best_ms, default_ms = tune.tune_case(case, deadline=float("inf"))
    assert (best, best_ms, default_ms) == (second, 2.0, 5.0)
    assert "refused: relative error 0.5" in caplog.text
    # the default, then the candidates that were faster than the best so far when timed: space[0] (3.0 < 5.0),
    # the wrong one (1.0) and the second (2.0); never the other 3.0 ms ones
    assert checked == [case.default, case.space[0], wrong, second]


def test_mxfp4_one_launch_candidates_build_on_the_winner():
    """The one-launch refinements keep every key of the two-launch winner (the expert LoRA path reads them from the
    same entry) and add valid ONE_ keys; one pair a block only at M <= 2; none above ONE_LAUNCH_MAX_M or over a
    checkpoint-layout winner."""
    from loraplex.kernels import fused_moe_mxfp4 as fm
    from loraplex.kernels import fused_moe_mxfp4_one_launch as ol
    from loraplex.kernels.tuning_cases import ONE_LAUNCH_MAX_M, mxfp4_one_launch_space

    best = {**fm.DEFAULT_CONFIG, "BLOCK_M": 8, "SPLIT_K": 2, "DOWN_BLOCK_N": 128}
    for m in range(1, ONE_LAUNCH_MAX_M + 1):
        cands = mxfp4_one_launch_space(m, best)
        assert cands and len({tuple(sorted(c.items())) for c in cands}) == len(cands)
        assert all({k: c[k] for k in best} == best and c["ONE_LAUNCH"] == 1 for c in cands)
        assert any(c["ONE_DIRECT"] for c in cands) == (m <= 2)
        for cfg in cands:
            ol.one_launch_constexprs(cfg, hidden=2880, inter=2880, top_k=4, act=1, has_b13=True, has_b2=True,
                                     pdl=True, fence=True)
    assert mxfp4_one_launch_space(ONE_LAUNCH_MAX_M + 1, best) == []
    assert mxfp4_one_launch_space(1, {**best, "LAYOUT": "checkpoint"}) == []


def test_tune_tries_the_refinements_after_the_space(monkeypatch):
    """After the space, the case's refinements of the winner (for fused_moe_mxfp4 at small M: the one launch) are
    timed and checked the same way; the fastest accurate one wins with the winner's keys kept."""
    from loraplex.commands import tune

    shapes = ModelShapes("tiny-mxfp4", hidden=32, num_experts=4, top_k=2, moe_intermediate=32, num_heads=4,
                         num_kv_heads=2, head_dim=16, activation="swiglu_clamp", expert_bias=True)
    case = tunable_cases(shapes, 2, 3, 16, torch.float32, "cpu", ops={"fused_moe_mxfp4"})[0]
    winner = case.space[0]
    refinements = case.refine(dict(winner))
    timings = iter([5.0] + [2.0 if c is winner else 3.0 for c in case.space]
                   + [1.0 if i == 2 else 4.0 for i in range(len(refinements))])
    monkeypatch.setattr("loraplex.kernels.tuning_cases.bench_time_ms", lambda fn, **kw: next(timings))
    best, best_ms, default_ms = tune.tune_case(case, deadline=float("inf"))
    assert (best, best_ms, default_ms) == (refinements[2], 1.0, 5.0)
    assert best["ONE_LAUNCH"] == 1 and {k: best[k] for k in winner} == winner
    assert case.check(best) < 1e-4  # the one launch at the tiny shape, through the interpreter


def test_accuracy_rule():
    from loraplex.commands.tune import ERR_FLOOR, accurate

    assert accurate(4e-3, 4e-3) and accurate(7.9e-3, 4e-3) and not accurate(1.0e-2, 4e-3)
    assert accurate(ERR_FLOOR, 1e-7) and not accurate(2 * ERR_FLOOR, 1e-7)
    assert not accurate(float("nan"), 4e-3) and not accurate(1.2, 4e-3)


def test_shared_metadata_cases_run_and_leave_the_tuner_alone():
    """Benchmark-only rows (metadata shared per step / per layer) match the references; op name empty so
    ``loraplex tune`` never writes them; default and tuned runs both launch."""
    cases = {c.label: c for c in shared_metadata_cases(TINY, 7, 3, 16, torch.float32, "cpu")}
    assert set(cases) == {"lora_segments", "lora_shrink[qkv] kernel", "lora_expand[qkv] kernel",
                          "fused_moe_lora[gate_up] kernels", "fused_moe_lora[down] kernels"}
    assert all(c.op == "" and not c.space for c in cases.values())
    for case in cases.values():
        assert case.check() < 1e-4, case.label
        if case.default is not None:
            case.run(case.default)
        for name, cfg in case.variants.items():
            assert case.check(cfg) < 1e-4, (case.label, name)
    assert {label for label, c in cases.items() if c.variants} == {
        "lora_expand[qkv] kernel", "fused_moe_lora[gate_up] kernels", "fused_moe_lora[down] kernels"}


def test_tune_picks_fastest_and_writes_through_naming_function(tmp_path, monkeypatch):
    from loraplex.commands import tune

    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path))
    tuning.clear_cache()
    case = [c for c in tunable_cases(TINY, 7, 3, 16, torch.float32, "cpu") if c.op == "lora_shrink"][0]
    fastest = case.space[3]
    timings = iter([5.0] + [1.0 if c is fastest else 3.0 for c in case.space])
    monkeypatch.setattr("loraplex.kernels.tuning_cases.bench_time_ms", lambda fn, **kw: next(timings))
    best, best_ms, default_ms = tune.tune_case(case, deadline=float("inf"))
    assert (best, best_ms, default_ms) == (fastest, 1.0, 5.0)
    path = tuning.write_configs(case.op, {tuning.shape_key(case.shape): {7: best}}, device_name="Fake GPU")
    assert path == tmp_path / "Fake_GPU" / "lora_shrink.json"
    assert json.loads(path.read_text())[tuning.shape_key(case.shape)]["7"] == fastest
    assert tuning.get_config("lora_shrink", case.shape, 9, {}, device_name="Fake GPU") == fastest
    tuning.clear_cache()


def test_tune_refuses_without_gpu(monkeypatch):
    from loraplex.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["tune", "--model", "gpt-oss-20b"])


def test_tune_rejects_bad_m():
    from loraplex.commands.tune import parse_ms

    with pytest.raises(SystemExit, match="--m must be comma-separated integers"):
        parse_ms("1,x")
    assert parse_ms("64,1,16,16") == [1, 16, 64]


def test_tune_reads_shapes_from_a_checkpoint_config(tmp_path):
    from loraplex.commands.tune import resolve_shapes

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 1000, "num_local_experts": 32,
        "num_experts_per_tok": 4, "intermediate_size": 2880, "sliding_window": 128}))
    shapes = resolve_shapes(str(tmp_path))
    preset = resolve_shapes("GPT-OSS-20B")
    assert (shapes.hidden, shapes.num_experts, shapes.top_k, shapes.moe_intermediate, shapes.qkv_slices,
            shapes.activation, shapes.expert_bias) == (preset.hidden, preset.num_experts, preset.top_k,
                                                        preset.moe_intermediate, preset.qkv_slices,
                                                        preset.activation, preset.expert_bias)


def test_serving_mix_follows_the_engine_batch():
    """32 adapters Zipf from M = 64 through a table as wide as the decode graph of M rows (capped by the
    engine's max_num_seqs), 8 round robin below; the committed files' M keys stay tunable."""
    assert serving_mix(16) == AdapterMix(8) and serving_mix(63).slots == 8
    assert serving_mix(64) == AdapterMix(32, "zipf", 64)
    assert serving_mix(128).slots == 128 and serving_mix(512).slots == 256
    assert serving_mix(2048) == AdapterMix(32, "prefill") and serving_mix(2048).slots == 32
    with pytest.raises(ValueError, match="table_slots 4 < num_adapters 8"):
        AdapterMix(8, "even", 4)
    with pytest.raises(ValueError, match="dist 'even', 'zipf' or 'prefill'"):
        AdapterMix(8, "pareto")


def test_prefill_mix_is_one_prompt_chunk_beside_zipf_decodes():
    """A mixed step's tokens: the first M - M/16 one adapter (slot 0, the Zipf head), the last M/16 Zipf draws."""
    idx = adapter_indices(2048, AdapterMix(32, "prefill"), "cpu")
    chunk, decodes = idx[:1920], idx[1920:]
    assert torch.equal(chunk, torch.zeros(1920, dtype=torch.int32))
    assert decodes.numel() == 128 and int(decodes.max()) + 1 == idx.unique().numel() > 8
    assert torch.equal(idx, adapter_indices(2048, AdapterMix(32, "prefill"), "cpu"))  # seeded


def test_moe_lora_space_puts_column_groups_after_the_first_three():
    from loraplex.kernels.tuning_cases import moe_lora_space

    decode = moe_lora_space(128)
    assert all(c.get("COLS", 1) == 1 for c in decode[:3]) and decode[3]["COLS"] > 1
    assert len({tuple(sorted(c.items())) for c in decode}) == len(decode)
    prefill = moe_lora_space(2048)
    lead = {k: prefill[0][k] for k in ("BLOCK_M", "SPLIT_K", "PDL", "COLS")}
    assert lead == {"BLOCK_M": 16, "SPLIT_K": 4, "PDL": 0, "COLS": 8}  # the H200 winner at prefill sizes leads
    assert len({tuple(sorted(c.items())) for c in prefill}) == len(prefill) > len(decode)
    assert all(c in prefill for c in decode)  # the decode space is searched there too
    small = moe_lora_space(16)
    assert [c["COLS"] > 1 for c in small[3:7]] == [True] * 4 and small[7]["FUSED"] == 1
    assert len({tuple(sorted(c.items())) for c in small}) == len(small)


def test_zipf_adapters_are_compact_skewed_and_seeded():
    from loraplex.kernels.tuning_cases import adapter_indices

    idx = adapter_indices(512, AdapterMix(32, "zipf", 256), "cpu")
    assert idx.dtype == torch.int32 and torch.equal(idx, adapter_indices(512, AdapterMix(32, "zipf"), "cpu"))
    used = idx.unique()
    assert torch.equal(used, torch.arange(used.numel(), dtype=torch.int32))  # step slots 0..k-1
    assert 16 <= used.numel() <= 32
    counts = torch.bincount(idx.long())
    assert counts[0] == counts.max() and counts[0] > 4 * counts[-1]  # the head adapter dominates
    assert torch.equal(adapter_indices(5, 3, "cpu"), torch.tensor([0, 1, 2, 0, 1], dtype=torch.int32))


def test_lora_cases_with_a_wide_table_of_zipf_adapters_match_references():
    """5 adapters Zipf over 19 tokens through a 23-slot table (idle slots have rank 0), as a decode graph runs
    them; the byte model counts only the adapters (pairs) the tokens use."""
    mix = AdapterMix(5, "zipf", 23)
    cases = tunable_cases(TINY, 19, mix, 16, torch.float32, "cpu",
                          ops={"lora_shrink", "lora_expand", "lora_shrink_expand", "fused_moe_lora"})
    assert {c.op for c in cases} == {"lora_shrink", "lora_expand", "lora_shrink_expand", "fused_moe_lora"}
    assert len(cases) == 8
    for case in cases:
        assert case.check() < 1e-4, case.label
        for name, cfg in case.variants.items():
            assert case.check(cfg) < 1e-4, (case.label, name)
    from loraplex.kernels.tuning_cases import adapter_indices

    used = int(adapter_indices(19, mix, "cpu").unique().numel())
    shrink = {c.label: c for c in cases}["lora_shrink[o]"]
    k_in = TINY.num_heads * TINY.head_dim
    assert shrink.nbytes == (19 * k_in * 4 + 19 * 16 * 4) + used * 16 * k_in * 4  # x, buf, A of the used


def test_tunable_cases_build_only_the_requested_ops(monkeypatch):
    import loraplex.kernels.tuning_cases as tc

    def boom(*a, **kw):
        raise AssertionError("expert GEMM inputs built although not requested")

    monkeypatch.setattr(tc, "moe_cases", boom)
    cases = tunable_cases(TINY, 3, 2, 16, torch.float32, "cpu", ops={"lora_expand"})
    assert [c.label for c in cases] == ["lora_expand[qkv]", "lora_expand[o]"]


def test_tunable_cases_build_only_the_requested_lora_targets(monkeypatch):
    """--lora-targets o tunes the o projection's LoRA alone (the qkv entries in the files stay as they are); an
    unknown or empty target list is refused, by the function and by the command's parser."""
    from loraplex.commands import tune

    cases = tunable_cases(TINY, 3, 2, 16, torch.float32, "cpu", ops={"lora_shrink", "lora_expand"},
                          lora_targets=("o",))
    assert [c.label for c in cases] == ["lora_shrink[o]", "lora_expand[o]"]
    k_in = TINY.num_heads * TINY.head_dim
    assert dict(cases[0].shape)["K"] == k_in and dict(cases[1].shape)["N"] == TINY.hidden
    with pytest.raises(ValueError, match="dense LoRA target 'v'"):
        tunable_cases(TINY, 3, 2, 16, torch.float32, "cpu", ops={"lora_expand"}, lora_targets=("v",))
    assert tune.parse_targets("o, qkv,o") == ("o", "qkv")
    for bad in ("", "q", "o,k"):
        with pytest.raises(SystemExit, match="--lora-targets takes one or more of qkv, o"):
            tune.parse_targets(bad)


def test_tune_defaults_cover_high_concurrency_m_with_the_serving_mix():
    import argparse

    from loraplex.commands import tune

    parser = argparse.ArgumentParser()
    tune.register(parser.add_subparsers())
    args = parser.parse_args(["tune", "--model", "gpt-oss-20b"])
    assert tune.parse_ms(args.m) == [1, 16, 64, 128, 256, 512] and args.max_loras is None
    assert tune.parse_targets(args.lora_targets) == ("qkv", "o")


def test_moe_lora_probe_refuses_without_a_gpu(tmp_path):
    """benchmarks/kernels/probe_moe_lora.py times the expert layer on the device: without CUDA it says so and
    writes nothing; an unknown adapter mix is refused by its arguments."""
    from tests.utils.scripts import load_script

    script = load_script("kernels", "probe_moe_lora")
    out = tmp_path / "probe.json"
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        script.main(["--m", "16", "--mix", "prefill", "--out", str(out)])
    assert not out.exists()
    with pytest.raises(SystemExit):
        script.main(["--mix", "uniform"])


def test_shrink_space_tries_fused_slices_first_at_prefill_sizes():
    from loraplex.kernels.tuning_cases import SHRINK_LARGE_MIN_M, SHRINK_SPACE, shrink_space

    assert shrink_space(SHRINK_LARGE_MIN_M - 1, 3) == SHRINK_SPACE
    qkv, one = shrink_space(SHRINK_LARGE_MIN_M, 3), shrink_space(2048, 1)
    assert qkv[0]["FUSE_SLICES"] == 1 and not any(c.get("FUSE_SLICES") for c in one)
    assert all(c in qkv for c in one) and all(c in one for c in SHRINK_SPACE)
    assert qkv[0]["BLOCK_M"] >= 32 and one[0]["BLOCK_M"] >= 64  # large token blocks lead
    for space in (qkv, one):
        assert len({tuple(sorted(c.items())) for c in space}) == len(space)
    # the fused candidates give the reference at a tiny qkv shape (the tuner's check)
    case = next(c for c in tunable_cases(TINY, 300, 3, 16, torch.float32, "cpu") if c.label == "lora_shrink[qkv]")
    assert case.space[0]["FUSE_SLICES"] == 1 and case.check(case.space[0]) < 1e-4


def test_float_moe_space_adds_tma_prefill_tiles_that_bf16_weights_can_take():
    """bf16 / fp16 experts also try prefill tiles with their weights read through TMA, each with a box row of at
    most 128 bytes in 16-bit weights; INT8 experts (pointer loads only) never see the key."""
    from loraplex.kernels import fused_moe_tma
    from loraplex.kernels.tuning_cases import MOE_FLOAT_SPACE, MOE_SPACE, moe_cases

    tma = [c for c in MOE_FLOAT_SPACE if c.get("TMA")]
    assert tma and MOE_FLOAT_SPACE[:len(MOE_SPACE)] == MOE_SPACE and not any("TMA" in c for c in MOE_SPACE)
    assert all(c["BLOCK_K"] * 2 <= fused_moe_tma.MAX_BOX_ROW_BYTES and c["BLOCK_M"] >= 64 for c in tma)
    (bf16,) = moe_cases(TINY, 8, torch.bfloat16, "cpu")
    (int8,) = moe_cases(TINY, 8, torch.bfloat16, "cpu", weights="int8")
    assert bf16.space == MOE_FLOAT_SPACE and int8.space == MOE_SPACE
