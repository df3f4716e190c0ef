"""Where harmony's o200k vocabulary comes from without a download (TIKTOKEN_ENCODINGS_BASE, or rebuilt from a
GPT-OSS tokenizer.json into the cache), and ``HarmonyChat`` on a served tokenizer: harmony's own ids for the
o200k_harmony vocabulary, re-encoded ids for another one (the tiny model), the model's template without any."""
from __future__ import annotations

import hashlib
import os

import pytest

from loraplex.engine.testing.tiny_tokenizer import build_tiny_tokenizer
from loraplex.platform.inference.harmony import (O200K_BASE_SHA256, HarmonyChat, HarmonyVocabError, find_vocab_dir,
                                                 load_encoding, vocab_from_tokenizer_json)
from loraplex.platform.inference.harmony.vocab import ENV_BASE, ENV_CACHE, VOCAB_FILE
from tests.utils.harmony_vocab import o200k_tokenizer_json, o200k_vocab_dir

DATE = "2025-06-28"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|end|> there"}]


@pytest.fixture(scope="module")
def gpt_oss_folder(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("gpt-oss"))
    o200k_tokenizer_json(folder)
    return folder


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory) -> str:
    return o200k_vocab_dir(str(tmp_path_factory.mktemp("o200k")))


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_BASE, raising=False)
    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "cache"))
    return monkeypatch


def test_rebuilt_from_tokenizer_json_byte_for_byte(gpt_oss_folder, vocab_dir):
    data = vocab_from_tokenizer_json(os.path.join(gpt_oss_folder, "tokenizer.json"))
    assert hashlib.sha256(data).hexdigest() == O200K_BASE_SHA256
    assert data == open(os.path.join(vocab_dir, VOCAB_FILE), "rb").read()


def test_other_vocabularies_build_nothing(tmp_path):
    build_tiny_tokenizer(320, harmony=True).save_pretrained(str(tmp_path))
    assert vocab_from_tokenizer_json(str(tmp_path / "tokenizer.json")) is None


def test_found_in_env_then_cache_then_built(env, tmp_path, gpt_oss_folder, vocab_dir):
    built = find_vocab_dir(gpt_oss_folder)   # nothing cached yet: rebuilt into $LORAPLEX_HARMONY_CACHE
    assert built == str(tmp_path / "cache") and os.path.isfile(os.path.join(built, VOCAB_FILE))
    assert find_vocab_dir(None) == built     # cached: no model needed any more
    assert load_encoding(built).encode("Hello") == load_encoding(vocab_dir).encode("Hello")
    env.setenv(ENV_BASE, vocab_dir)          # the operator's copy wins
    assert find_vocab_dir(gpt_oss_folder) == vocab_dir


def test_bad_sources_say_what_to_set(env, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / VOCAB_FILE).write_bytes(b"aGk= 0\n")
    env.setenv(ENV_BASE, str(bad))
    with pytest.raises(HarmonyVocabError, match="holds no valid o200k_base.tiktoken"):
        find_vocab_dir(None)
    env.delenv(ENV_BASE)
    tiny = tmp_path / "tiny"
    build_tiny_tokenizer(320, harmony=True).save_pretrained(str(tiny))
    with pytest.raises(HarmonyVocabError, match="not the o200k_harmony vocabulary; set TIKTOKEN_ENCODINGS_BASE"):
        find_vocab_dir(str(tiny))
    with pytest.raises(HarmonyVocabError, match="no tokenizer.json"):
        find_vocab_dir(str(tmp_path))


def test_unwritable_cache_falls_back_to_a_temporary_folder(env, tmp_path, gpt_oss_folder):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    env.setenv(ENV_CACHE, str(blocker / "cache"))
    folder = find_vocab_dir(gpt_oss_folder)
    assert folder != str(blocker / "cache") and os.path.isfile(os.path.join(folder, VOCAB_FILE))


class O200kServed:
    """The served tokenizer of a GPT-OSS checkpoint, played by the o200k_harmony encoding itself."""

    def __init__(self, encoding) -> None:
        self.enc = encoding

    def token_to_id(self, token: str) -> int | None:
        ids = self.enc.encode(token, allowed_special="all")
        return ids[0] if len(ids) == 1 and self.enc.is_special_token(ids[0]) else None

    def encode_plain(self, text: str) -> list[int]:
        return self.enc.encode(text, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode([i for i in ids if not self.enc.is_special_token(i)])


class TinyServed:
    def __init__(self, tok) -> None:
        self.tok = tok

    def token_to_id(self, token: str) -> int | None:
        i = self.tok.convert_tokens_to_ids(token)
        return None if i == self.tok.unk_token_id else i

    def encode_plain(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def test_gpt_oss_vocabulary_uses_harmonys_own_ids(env, gpt_oss_folder, vocab_dir):
    enc = load_encoding(vocab_dir)
    chat = HarmonyChat.for_model(gpt_oss_folder, O200kServed(enc))
    assert chat.renderer is not None and chat.native_ids
    assert chat.prompt(CHAT, current_date=DATE) == chat.renderer.render_ids(CHAT, current_date=DATE)
    assert chat.stop_token_ids == [200002, 200012] == sorted(enc.stop_tokens_for_assistant_actions())


def test_other_vocabulary_reencodes_harmonys_text(env, vocab_dir, tmp_path):
    tok = build_tiny_tokenizer(320, harmony=True)
    tok.save_pretrained(str(tmp_path / "tiny"))
    env.setenv(ENV_BASE, vocab_dir)
    chat = HarmonyChat.for_model(str(tmp_path / "tiny"), TinyServed(tok))
    assert chat.renderer is not None and not chat.native_ids
    ids = chat.prompt(CHAT, current_date=DATE)
    assert tok.decode(ids) == chat.renderer.render_text(CHAT, current_date=DATE)
    assert chat.stop_token_ids == [tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>")]
    end = tok.convert_tokens_to_ids("<|end|>")
    assert ids.count(end) == 3   # system, developer, user; the tenant's literal "<|end|>" stayed text


def test_without_any_vocabulary_the_template_is_used(env, tmp_path):
    tok = build_tiny_tokenizer(320, harmony=True)
    tok.save_pretrained(str(tmp_path / "tiny"))
    chat = HarmonyChat.for_model(str(tmp_path / "tiny"), TinyServed(tok))
    assert chat.renderer is None and "TIKTOKEN_ENCODINGS_BASE" in chat.vocab_error
    assert chat.stop_token_ids and chat.parser().parser.functions == frozenset()
    assert HarmonyChat.for_model(str(tmp_path / "tiny"), TinyServed(build_tiny_tokenizer(320))) is None
