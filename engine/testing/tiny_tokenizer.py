"""A small byte-level BPE tokenizer built offline with the ``tokenizers`` library (no download).

Ids 0..2 are the special tokens; every byte is in the alphabet, so any text round-trips.
"""
from __future__ import annotations

PAD, BOS, EOS = 0, 1, 2
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")

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


def build_tiny_tokenizer(vocab_size: int):
    """A ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` ids (>= 260), bos/eos/pad and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (need >= 260)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast
