"""`loraplex engine serve` passes the CUDA-graph, quantization, batch and adapter-memory flags to the engine's
config (defaults: the engine's own)."""
import pytest

from loraplex.engine.engine_config import EngineConfig


def test_graph_and_quantization_flags_reach_the_engine_config(monkeypatch):
    import loraplex.commands.engine as engine_cmd
    import loraplex.engine.server.serve as serve_mod
    from loraplex.cli import main

    seen = []
    monkeypatch.setattr(engine_cmd, "_check_settings", lambda model, kwargs: None)   # "/m" has no config.json
    monkeypatch.setattr(serve_mod, "real_service", lambda model, **kw: seen.append(kw))
    monkeypatch.setattr(serve_mod, "serve", lambda make, **kw: make())
    main(["engine", "serve", "--model", "/m"])
    main(["engine", "serve", "--model", "/m", "--enforce-eager", "--cuda-graph-max-batch-size", "16",
          "--quantization", "int8"])
    main(["engine", "serve", "--model", "/m", "--enable-lora", "--adapter-memory", "8GiB", "--max-loras", "12",
          "--max-num-seqs", "128"])
    main(["engine", "serve", "--model", "/m", "--enable-lora", "--adapter-memory-fraction", "0.5"])
    main(["engine", "serve", "--model", "/m", "--quantization", "none"])  # float experts (MXFP4 dequantised)
    main(["engine", "serve", "--model", "/m", "--eager-warmup-budget-s", "0"])
    assert [(kw["enforce_eager"], kw["cuda_graph_max_batch_size"], kw["quantization"]) for kw in seen[:2]] == [
        (False, None, "auto"), (True, 16, "int8")]
    assert seen[4]["quantization"] is None
    assert seen[0]["max_num_seqs"] is None and seen[0]["cuda_graph_capture_budget_s"] == 120.0
    assert (seen[0]["eager_warmup_budget_s"], seen[5]["eager_warmup_budget_s"]) == (90.0, 0.0)
    assert (seen[2]["adapter_memory_bytes"], seen[2]["max_loras"], seen[2]["max_num_seqs"]) == (8 << 30, 12, 128)
    assert (seen[3]["adapter_memory_bytes"], seen[3]["adapter_memory_fraction"], seen[3]["max_loras"]) == \
        (None, 0.5, None)
    for kw in seen:  # every passed setting is an EngineConfig field with a valid value
        EngineConfig(model="/m", **{k: v for k, v in kw.items() if k != "model_name"})
    with pytest.raises(SystemExit):
        main(["engine", "serve", "--model", "/m", "--quantization", "int4"])


def test_vtc_preempt_gap_flag_reaches_the_engine_config(monkeypatch, capsys):
    import loraplex.commands.engine as engine_cmd
    import loraplex.engine.server.serve as serve_mod
    from loraplex.cli import main
    from loraplex.engine.fairness import DEFAULT_PREEMPT_GAP

    seen = []
    monkeypatch.setattr(engine_cmd, "_check_settings", lambda model, kwargs: None)
    monkeypatch.setattr(serve_mod, "real_service", lambda model, **kw: seen.append(kw))
    monkeypatch.setattr(serve_mod, "serve", lambda make, **kw: make())
    for flags in ([], ["--vtc-preempt-gap", "256"], ["--vtc-preempt-gap", "none"]):
        main(["engine", "serve", "--model", "/m", *flags])
    assert [kw["vtc_preempt_gap"] for kw in seen] == [DEFAULT_PREEMPT_GAP, 256.0, None]
    for kw in seen:
        assert EngineConfig(model="/m", **{k: v for k, v in kw.items() if k != "model_name"}).vtc_preempt_gap == \
            kw["vtc_preempt_gap"]
    with pytest.raises(SystemExit):
        main(["engine", "serve", "--model", "/m", "--vtc-preempt-gap", "-1"])
    assert "expected a finite number >= 0 or 'none', got '-1'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="vtc_preempt_gap must be None"):
        EngineConfig(model="/m", vtc_preempt_gap=float("nan"))
