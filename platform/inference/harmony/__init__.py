"""The harmony chat format of GPT-OSS: prompts rendered by openai-harmony (its o200k vocabulary found or rebuilt
locally, never downloaded) and an incremental, forgiving parser of the model's output channels.

    render.py   OpenAI messages + tools + reasoning_effort -> harmony conversation -> ids / text
    parser.py   completion ids or text -> content, reasoning, tool calls, finish reason (streaming)
    vocab.py    o200k_base.tiktoken from TIKTOKEN_ENCODINGS_BASE or the model's tokenizer.json
    chat.py     the three together for a served tokenizer (what the gateway uses)
    render_pool.py  long conversations rendered in worker processes (harmony holds the GIL while it renders)
"""
from loraplex.platform.inference.harmony.chat import HarmonyChat
from loraplex.platform.inference.harmony.parser import (CALL, CHANNEL, CONSTRAIN, END, MARKERS, MESSAGE, RETURN, START,
                                                        STOP_MARKERS, HarmonyDelta, HarmonyParser, TextFeed,
                                                        TokenFeed, ToolCall, ToolCallDelta)
from loraplex.platform.inference.harmony.render import (DEFAULT_REASONING_EFFORT, REASONING_EFFORTS,
                                                        HarmonyRenderer, HarmonyRenderError, harmony_messages,
                                                        load_encoding, tool_descriptions)
from loraplex.platform.inference.harmony.vocab import (O200K_BASE_SHA256, HarmonyVocabError, find_vocab_dir,
                                                       vocab_from_tokenizer_json)

__all__ = ["HarmonyChat", "HarmonyDelta", "HarmonyParser", "TextFeed", "TokenFeed", "ToolCall", "ToolCallDelta",
           "MARKERS", "STOP_MARKERS", "START", "END", "MESSAGE", "CHANNEL", "CONSTRAIN", "RETURN", "CALL",
           "DEFAULT_REASONING_EFFORT", "REASONING_EFFORTS", "HarmonyRenderer", "HarmonyRenderError",
           "harmony_messages", "load_encoding", "tool_descriptions", "O200K_BASE_SHA256", "HarmonyVocabError",
           "find_vocab_dir", "vocab_from_tokenizer_json"]
