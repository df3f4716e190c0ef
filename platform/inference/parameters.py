"""Every request parameter of ``chat.completions.create`` and ``completions.create``, and what loraplex does with it.

    status      meaning
    supported   OpenAI's parameter, honoured as OpenAI documents it (``note`` says how, where it differs)
    refused     OpenAI's parameter this deployment cannot honour: 400 ``unsupported_parameter`` naming it, unless
                its value is one of ``neutral`` (the value that asks for nothing: ``store: false``)
    extension   not OpenAI's: a vLLM-style engine option, sent by the ``openai`` client through ``extra_body``

A field in the body that is in neither list is a 400 ``unsupported_parameter`` too (OpenAI: "Unrecognized request
argument supplied"), so a misspelt ``max_token`` is never silently ignored. JSON ``null`` is "not sent" for every
parameter. ``check_parameters`` runs before the body is validated; the compatibility table of docs/platform.md is
``compat_table()`` (a test keeps the two equal).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from loraplex.platform.inference.errors import InferenceError

Endpoint = Literal["chat", "completion"]
Status = Literal["supported", "refused", "extension"]
CHAT: tuple[Endpoint, ...] = ("chat",)
COMPLETION: tuple[Endpoint, ...] = ("completion",)
BOTH: tuple[Endpoint, ...] = ("chat", "completion")


@dataclass(frozen=True)
class Parameter:
    name: str
    endpoints: tuple[Endpoint, ...]
    status: Status
    note: str                       # supported / extension: what it does; refused: why, and what to do instead
    neutral: tuple[Any, ...] = ()   # refused: values accepted because they ask for nothing


def _s(name: str, endpoints: tuple[Endpoint, ...], note: str) -> Parameter:
    return Parameter(name, endpoints, "supported", note)


def _r(name: str, endpoints: tuple[Endpoint, ...], note: str, *neutral: Any) -> Parameter:
    return Parameter(name, endpoints, "refused", note, neutral)


def _x(name: str, endpoints: tuple[Endpoint, ...], note: str) -> Parameter:
    return Parameter(name, endpoints, "extension", note)


PARAMETERS: tuple[Parameter, ...] = (
    # ---- both endpoints
    _s("model", BOTH, "the base model or a tenant's adapter (`name`, `name:<version>`, `name:<alias>`)"),
    _s("frequency_penalty", BOTH, "[-2, 2], over the output tokens"),
    _s("presence_penalty", BOTH, "[-2, 2], over the output tokens"),
    _s("logit_bias", BOTH, "{token id: bias in [-100, 100]}, at most 1024 ids, added before any other control"),
    _s("n", BOTH, "1..128 choices; greedy (temperature 0) choices are copies of one sequence"),
    _s("seed", BOTH, "reproducible sampling: the same tokens whatever else shares the batch"),
    _s("stop", BOTH, "up to 4 strings, cut from the text"),
    _s("stream", BOTH, "server-sent events, ending with `[DONE]`"),
    _s("stream_options", BOTH, "`include_usage`: a last chunk with the usage"),
    _s("temperature", BOTH, "[0, 2]; 0 is greedy"),
    _s("top_p", BOTH, "(0, 1]"),
    _s("user", BOTH, "accepted; not used for generation"),
    # ---- chat.completions
    _s("messages", CHAT, "rendered with the base model's chat template (GPT-OSS: harmony)"),
    _s("max_tokens", BOTH, "the completion budget per choice (default: the context left; completions: 16)"),
    _s("max_completion_tokens", CHAT, "as `max_tokens` (wins when both are set)"),
    _s("logprobs", BOTH, "chat: true/false; completions: 0..5 alternatives per token"),
    _s("top_logprobs", CHAT, "0..20 alternatives per token (needs `logprobs: true`)"),
    _s("response_format", CHAT, "`text`, `json_object`, `json_schema` (grammar-constrained decoding; `strict: "
                                "false` leaves keywords the grammar cannot enforce unchecked instead of refusing "
                                "them)"),
    _s("reasoning_effort", CHAT, "GPT-OSS: low, medium, high (a 400 on other base models)"),
    _s("tools", CHAT, "function tools"),
    _s("tool_choice", CHAT, "which tool the model may call"),
    _s("parallel_tool_calls", CHAT, "whether the model may call several tools in one turn"),
    _s("safety_identifier", CHAT, "accepted; not used for generation"),
    _s("prompt_cache_key", CHAT, "accepted; prefix caching is automatic (`usage.prompt_tokens_details`)"),
    _r("audio", CHAT, "audio output is not supported; leave `audio` unset"),
    _r("modalities", CHAT, "only text output is supported; send [\"text\"] or leave `modalities` unset", ["text"]),
    _r("functions", CHAT, "the deprecated functions API is not supported; send `tools` instead"),
    _r("function_call", CHAT, "the deprecated functions API is not supported; send `tool_choice` instead"),
    _r("prediction", CHAT, "predicted outputs are not supported; leave `prediction` unset"),
    _r("store", CHAT, "completions are not stored; send false or leave `store` unset", False),
    _r("metadata", CHAT, "metadata belongs to stored completions, which are not kept; leave `metadata` unset", {}),
    _r("service_tier", CHAT, "there is one service tier; send \"auto\" or \"default\", or leave it unset",
       "auto", "default"),
    _r("web_search_options", CHAT, "web search is not available; leave `web_search_options` unset"),
    _r("verbosity", CHAT, "output verbosity is not supported; ask for brevity in the prompt instead"),
    _r("moderation", CHAT, "moderation is not available; leave `moderation` unset"),
    _r("prompt_cache_retention", CHAT, "prefix-cache retention is managed by the engine; leave it unset"),
    _r("prompt_cache_options", CHAT, "prefix-cache options are managed by the engine; leave them unset"),
    # ---- completions
    _s("prompt", COMPLETION, "a string, a list of strings, a token-id list or a list of them; choice `index` is "
                             "prompt_index * n + choice"),
    _s("echo", COMPLETION, "the prompt before each choice's text"),
    _s("best_of", COMPLETION, ">= n candidates, the n of highest cumulative logprob kept (not with `stream`)"),
    _r("suffix", COMPLETION, "insertion (text after the completion) is not supported; leave `suffix` unset"),
    # ---- extensions (extra_body)
    _x("response_format", COMPLETION, "as on chat.completions"),
    _x("top_k", BOTH, "keep the k most likely tokens (0 or -1: off)"),
    _x("min_p", BOTH, "[0, 1]: drop tokens below min_p times the top token's probability"),
    _x("repetition_penalty", BOTH, "(0, 100]: transformers' penalty over prompt and output (1: off)"),
    _x("min_tokens", BOTH, "EOS and stop tokens are masked until this many tokens were generated"),
    _x("ignore_eos", BOTH, "keep generating past EOS until `max_tokens`"),
    _x("guided_json", BOTH, "a JSON schema (object or JSON text) the output must match"),
    _x("guided_regex", BOTH, "a regular expression the output must match"),
    _x("guided_choice", BOTH, "a list of strings; the output is one of them"),
    _x("guided_grammar", BOTH, "a Lark (llguidance dialect) or GBNF grammar the output must match"),
    _x("speculative", BOTH, "true/false (default true): false opts the request out of speculative decoding where "
                            "the deployment speculates (the output is the same; only its speed differs)"),
)

_BY_ENDPOINT: dict[str, dict[str, Parameter]] = {
    e: {p.name: p for p in PARAMETERS if e in p.endpoints} for e in ("chat", "completion")}
DOCS_URL_HINT = "the compatibility table in docs/platform.md lists what is accepted"


def parameters_of(endpoint: Endpoint) -> dict[str, Parameter]:
    """The parameters ``endpoint`` knows, by name."""
    return _BY_ENDPOINT[endpoint]


def check_parameters(data: dict, endpoint: Endpoint) -> None:
    """400 ``unsupported_parameter`` for the first field of ``data`` that is unknown or refused (null is unset)."""
    known = _BY_ENDPOINT[endpoint]
    for name, value in data.items():
        p = known.get(name)
        if p is None:
            shown = name if len(name) <= 64 else name[:61] + "..."
            raise InferenceError(400, f"Unrecognized request argument supplied: {shown}; remove it "
                                      f"({DOCS_URL_HINT})", param=shown, code="unsupported_parameter")
        if p.status == "refused" and value is not None and not any(_same(value, v) for v in p.neutral):
            raise InferenceError(400, f"'{name}' is not supported: {p.note}", param=name,
                                 code="unsupported_parameter")


def _same(value: Any, neutral: Any) -> bool:
    return type(value) is type(neutral) and value == neutral


ENDPOINT_TITLES = {"chat": "chat.completions", "completion": "completions"}


def compat_table() -> str:
    """The compatibility table (Markdown): one row per parameter and endpoint, supported, then refused, then
    extensions."""
    order = {"supported": 0, "refused": 1, "extension": 2}
    rows = sorted(((order[p.status], e, p) for p in PARAMETERS for e in p.endpoints),
                  key=lambda r: (r[0], r[1] != "chat", r[2].name))
    lines = ["| parameter | endpoint | status | notes |", "|---|---|---|---|"]
    for _, endpoint, p in rows:
        note = p.note.replace("|", "\\|")
        lines.append(f"| `{p.name}` | {ENDPOINT_TITLES[endpoint]} | {p.status} | {note} |")
    return "\n".join(lines) + "\n"
