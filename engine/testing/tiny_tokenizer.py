"""A small byte-level BPE tokenizer built offline with the ``tokenizers`` library (no download).

Ids 0..2 are the special tokens; every byte is in the alphabet, so any text round-trips. ``harmony=True`` (the
gpt_oss tiny model) adds GPT-OSS's harmony format tokens (``<|start|>``, ``<|channel|>``, ...) as special tokens
with the last ids of the vocabulary, as in the real o200k_harmony tokenizer.
"""
from __future__ import annotations

PAD, BOS, EOS = 0, 1, 2
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for tests of the loraplex engine.",
    "Once upon a time there was a model that served many adapters at once.",
    "user assistant system: what is the answer? The answer is 42.",
    "the and of to in is that it for on with as was at by an be this which",
]


def build_tiny_tokenizer(vocab_size: int, *, harmony: bool = False):
    """A ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` ids (>= 260), bos/eos/pad and a chat template;
    ``harmony``: the harmony tokens take the last ``len(HARMONY_TOKENS)`` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    extra = HARMONY_TOKENS if harmony else ()
    if vocab_size < 256 + len(SPECIAL_TOKENS) + len(extra) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (need >= "
                         f"{256 + len(SPECIAL_TOKENS) + len(extra) + 1})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(extra), special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    if extra:
        tok.add_special_tokens(list(extra))
        if tok.get_vocab_size() != vocab_size:
            raise ValueError(f"the tiny corpus gives {tok.get_vocab_size()} ids, not {vocab_size}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   **({"additional_special_tokens": list(extra)} if extra else {}))
    fast.chat_template = CHAT_TEMPLATE
    return fast
