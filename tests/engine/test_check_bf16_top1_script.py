"""benchmarks/engine/check_bf16_top1.py's CPU smoke run (``--device cpu --dtype float32``, tiny llama): the engine in
float32 gives transformers + PEFT's top-1 token at (near) every one of the 6 x 64 positions and at every clear one
(PASS), the HF bf16 column is scored, the JSON is written; with ``--trained`` (a few training steps) the training
table follows."""
from __future__ import annotations

import json

from tests.utils.scripts import load_script

check = load_script("engine", "check_bf16_top1")


def _run(tmp_path, monkeypatch, *extra: str) -> list[dict]:
    monkeypatch.setenv("OUT", str(tmp_path))
    assert check.main(["--device", "cpu", "--dtype", "float32", "--families", "llama", *extra]) == 0
    name = "bf16_top1_trained.json" if extra else "bf16_top1.json"
    return json.loads((tmp_path / name).read_text())


def test_float32_engine_agrees_at_every_position(tmp_path, monkeypatch, capsys):
    (row,) = _run(tmp_path, monkeypatch)
    assert row["family"] == "llama" and row["ok"] is True and not row["trained"]
    assert row["positions"] == 6 * check.STEPS and row["top1_agree"] >= check.TARGET
    assert row["clear_agree"] == 1.0  # a top-2 gap of 1% is far beyond float32's rounding
    assert 0 < row["clear_positions"] <= row["positions"]
    assert 0.5 < row["hf_bf16_agree"] <= 1.0 and 0 < row["ref_top1_prob"] < 1
    assert row["graphs"] == 0  # no CUDA graphs on the CPU
    out = capsys.readouterr().out
    assert "llama" in out.splitlines()[-1] and out.rstrip().endswith("PASS")


def test_trained_flow_prints_the_training_table(tmp_path, monkeypatch, capsys):
    (row,) = _run(tmp_path, monkeypatch, "--trained", "--train-steps", "4")
    assert row["trained"] is True and row["positions"] == 6 * check.STEPS and row["ok"] is True
    train = row["train"]
    assert set(train) >= {"base", "a4", "a8"}
    assert all(train[k]["loss_after"] > 0 and train[k]["train_s"] > 0 for k in ("base", "a4", "a8"))
    out = capsys.readouterr().out
    assert any(line.startswith("llama") and "->" in line for line in out.splitlines())  # the training table
