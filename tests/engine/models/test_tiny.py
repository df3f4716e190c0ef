"""The tiny checkpoints: files, tokenizer round trip and chat template, consistent special tokens."""
from __future__ import annotations

import json
import os

import pytest
from transformers import AutoTokenizer

from loraplex.engine.config import ModelConfig
from loraplex.engine.testing.tiny import FAMILIES, make_tiny_checkpoint, tiny_config_overrides


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_files_and_config(family, tiny_checkpoints):
    path = tiny_checkpoints[family]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert os.path.isfile(os.path.join(path, name)), name
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.family == family and cfg.hidden_size == 72 and cfg.head_dim == 12
    gen = json.load(open(os.path.join(path, "generation_config.json")))
    tok = AutoTokenizer.from_pretrained(path)
    assert cfg.eos_token_ids == [tok.eos_token_id] == [gen["eos_token_id"]]
    assert cfg.bos_token_id == tok.bos_token_id == gen["bos_token_id"]
    assert len(tok) <= cfg.vocab_size


def test_tokenizer_round_trips_text(tiny_checkpoints):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])
    for text in ["Hello world!", "The quick brown fox, 42 times.", "unicode: é ü 漢字 🙂", "  spaces\tand\nlines "]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert all(0 <= i < len(tok) for i in ids)
        assert tok.decode(ids) == text
    assert len(tok("the quick brown fox")["input_ids"]) < len("the quick brown fox")  # merges exist
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<s><|user|>hi</s><|assistant|>"


def test_overrides_and_unknown_family(tmp_path):
    assert tiny_config_overrides("gpt_oss")["sliding_window"] == 8
    path = make_tiny_checkpoint("llama", tmp_path / "l", num_hidden_layers=1, vocab_size=300)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.num_layers == 1 and cfg.vocab_size == 300
    assert len(AutoTokenizer.from_pretrained(path)) == 300
    with pytest.raises(ValueError, match="unknown tiny family 'gpt2'"):
        make_tiny_checkpoint("gpt2", tmp_path / "g")
