"""`loraplex engine serve` passes the CUDA-graph and quantization flags to the engine's config."""
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
    main(["engine", "serve", "--model", "/m", "--quantization", "none"])  # float experts (MXFP4 dequantised)
    assert [(kw["enforce_eager"], kw["cuda_graph_max_batch_size"], kw["quantization"]) for kw in seen] == [
        (False, 64, "auto"), (True, 16, "int8"), (False, 64, None)]
    for kw in seen:  # every passed setting is an EngineConfig field with a valid value
        EngineConfig(model="/m", **{k: v for k, v in kw.items() if k != "model_name"})
    with pytest.raises(SystemExit):
        main(["engine", "serve", "--model", "/m", "--quantization", "int4"])
