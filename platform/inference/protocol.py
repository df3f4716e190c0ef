"""OpenAI protocol models: chat.completions and completions requests, responses, stream chunks, usage, models.

Requests accept the fields of ``parameters.py``'s table: OpenAI's, plus the engine extensions the ``openai`` client
sends through ``extra_body`` (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``guided_*``, ``speculative``); ``parse_request`` refuses an unknown or refused field with a 400
``unsupported_parameter`` naming it before the body is validated. ``sampling_params()`` turns a request into the
engine's ``SamplingParams`` fields (structured outputs: ``structured_request.py``; ``logit_bias``); ``choice_plan()``
says how the ``n`` choices come out of the engine (``plan.py``).

Completions take a list of prompts (strings or token-id lists): each prompt is one engine request of ``n`` choices,
answered as choices ``prompt_index * n + choice``.

Choices and logprobs: ``n`` (both endpoints), chat ``logprobs`` + ``top_logprobs`` (0..20), completions
``logprobs`` (0..5), ``echo`` and ``best_of`` (>= n; the n best by cumulative logprob; not with ``stream``).

Reasoning models (GPT-OSS, harmony): ``reasoning_effort`` (low | medium | high) on the request; the chain of
thought comes back as ``reasoning_content`` on the message (``delta.reasoning_content`` when streaming), apart
from ``content``. ``tools`` (every family; ``platform/inference/tools/``) with ``tool_choice`` "auto", "none",
"required" or a named function, and ``parallel_tool_calls``, give ``tool_calls`` (finish reason "tool_calls").
Fields that are None (``reasoning_content``, ``tool_calls``) are left out of the JSON.
"""
from __future__ import annotations

import time
import uuid
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_serializer

from loraplex.platform.inference.errors import InferenceError
from loraplex.platform.inference.parameters import Endpoint, check_parameters
from loraplex.platform.inference.plan import MAX_N, ChoicePlan, plan_choices
from loraplex.platform.inference.structured_request import ResponseFormat, StructuredRequest, structured_of

FinishReason = Literal["stop", "length", "tool_calls"]
ReasoningEffort = Literal["low", "medium", "high"]
MAX_INT32 = 2**31 - 1
MAX_STOP_CHARS = 1024
MAX_PROMPTS = 128          # prompts of one completions request (each is an engine request of n choices)
MAX_LOGIT_BIAS = 1024
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


# ---- requests ---------------------------------------------------------------------------------------------------
class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = ""


class ToolCall(BaseModel):
    """An assistant message's tool call, in history (request) and in answers."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None      # assistant: calls it made
    tool_call_id: str | None = None               # tool: the call this answers
    reasoning_content: str | None = None          # assistant: its chain of thought (harmony drops it as due)

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


MAX_TOOLS = 128


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields common to both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | list[StopText] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = None
    # engine extensions (extra_body)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    min_tokens: int | None = Field(default=None, ge=0, le=MAX_INT32)
    ignore_eos: bool | None = None
    response_format: ResponseFormat | None = None   # completions: an extension
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None
    speculative: StrictBool | None = None    # false: this request never speculates (true / absent: as deployed)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if len(bias or {}) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}")
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_INT32):
                raise ValueError(f"keys must be token ids (integers >= 0 as strings), got {key[:20]!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {value}")
        return bias

    @cached_property
    def structured(self) -> StructuredRequest | None:
        """The output constraint (``response_format`` json_object / json_schema or a ``guided_*`` field), or None."""
        return structured_of(self)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _common_sampling(self, max_tokens: int) -> dict[str, Any]:
        d: dict[str, Any] = {"max_tokens": max_tokens}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise InferenceError(400, "'stop' takes at most 4 sequences", param="stop")
        if stop:
            d["stop"] = stop
        for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                     "repetition_penalty", "min_tokens", "ignore_eos", "speculative"):
            value = getattr(self, name)
            if value is not None:
                d[name] = value
        structured = self.structured
        if structured is not None:
            d["structured"] = structured.spec.to_dict()
        if self.logit_bias:
            d["logit_bias"] = {str(int(k)): v for k, v in self.logit_bias.items()}
        return d

    def _with_plan(self, max_tokens: int) -> dict[str, Any]:
        """The common fields plus what the choice plan asks of the engine (n, logprobs, prompt_logprobs)."""
        return {**self._common_sampling(max_tokens), **self.choice_plan().engine_fields()}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def choice_plan(self) -> ChoicePlan:
        if self.top_logprobs is not None and not self.logprobs:
            raise InferenceError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return plan_choices(n=self.n, best_of=None, temperature=self.temperature,
                            logprobs=(self.top_logprobs or 0) if self.logprobs else None, echo=False,
                            stream=self.stream)

    def sampling_params(self, max_tokens: int) -> dict[str, Any]:
        """Engine ``SamplingParams`` fields, ``max_tokens`` resolved by the caller (``resolve_max_tokens``); the
        tools' grammar is added by the gateway's tokenizer (``PromptTokenizer.chat_sampling``)."""
        return self._with_plan(max_tokens)


class CompletionRequest(_SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | list[TokenId] | \
        Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_INT32)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per entry: a string or a token-id list is one prompt; a list of them is several."""
        p = self.prompt
        if isinstance(p, str) or not p or all(isinstance(t, int) for t in p):
            return [p]
        return list(p)

    def choice_plan(self) -> ChoicePlan:
        return plan_choices(n=self.n, best_of=self.best_of, temperature=self.temperature, logprobs=self.logprobs,
                            echo=self.echo, stream=self.stream)

    def sampling_params(self, max_tokens: int) -> dict[str, Any]:
        return self._with_plan(max_tokens)


def resolve_max_tokens(requested: int | None, prompt_tokens: int, max_model_len: int) -> int:
    """The completion budget: what was asked, or all the context left; 400 when the prompt leaves no room or the
    ask does not fit (OpenAI's wording: the context length and both token counts)."""
    room = max_model_len - prompt_tokens
    if room < 1 or (requested is not None and requested > room):
        raise InferenceError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                             f"requested {prompt_tokens + (requested or 1)} tokens ({prompt_tokens} in the prompt, "
                             f"{requested or 1} for the completion). Reduce the prompt or max_tokens.",
                             param="max_tokens", code="context_length_exceeded")
    return requested if requested is not None else room


# ---- responses --------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def openai_finish_reason(engine_reason: str | None) -> FinishReason | None:
    """Engine reasons to OpenAI's: "length" and "tool_calls" (a parsed tool call) stay, everything else that
    ended the stream is "stop"."""
    if engine_reason is None:
        return None
    return engine_reason if engine_reason in ("length", "tool_calls") else "stop"


class _OmitNone(BaseModel):
    """Leaves ``_omit_none`` fields out of the JSON while they are None (fields only some models produce)."""

    _omit_none: tuple[str, ...] = ()

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        data = handler(self)
        for name in self._omit_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class AssistantMessage(_OmitNone):
    _omit_none = ("reasoning_content", "tool_calls")

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Chat ``choices[i].logprobs``: one entry per token of the choice (of the chunk, when streaming)."""

    content: list[ChatTokenLogprob] | None = None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token (echoed prompt tokens first; the very first
    prompt token has no logprob: null); ``text_offset`` is each token's character offset in ``text``."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class FunctionCallDelta(_OmitNone):
    _omit_none = ("name", "arguments")

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_OmitNone):
    """A streamed tool call's part: ``id``, ``type`` and ``function.name`` in its first chunk, then arguments."""

    _omit_none = ("id", "type")

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_OmitNone):
    _omit_none = ("reasoning_content", "tool_calls")

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """Both the whole answer and each stream chunk (OpenAI uses one shape, object "text_completion")."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """OpenAI's model object, plus ``servable``: false (with ``unservable_reason``) for an adapter version that no
    engine of the deployment can serve (its rank, targets or dtype are past what the engines report)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    servable: bool = True
    unservable_reason: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def parse_request(model_cls: type[BaseModel], data: Any) -> Any:
    """Validate a request body; the first problem becomes a 400 naming the parameter (OpenAI's style): an unknown or
    refused field (``parameters.py``) is ``unsupported_parameter``, a bad value ``invalid_value``."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise InferenceError(400, "the request body must be a JSON object")
    endpoint: Endpoint = "chat" if model_cls is ChatCompletionRequest else "completion"
    check_parameters(data, endpoint)
    data = {k: v for k, v in data.items() if v is not None}   # null is "not sent" (its default), as OpenAI takes it
    try:  # strict: a boolean, a string or a fraction where a number, flag or integer goes is refused, not coerced
        return model_cls.model_validate(data, strict=True)
    except ValidationError as e:
        err = _most_specific(e.errors())
        param = ".".join(str(x) for x in _field_path(err["loc"])) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise InferenceError(400, f"Invalid value for '{param}': {msg}" if param else msg, param=param,
                             code="invalid_value") from None


def _is_tag(x: Any) -> bool:
    """Whether a location entry is a union-member tag (``list[int]``, ``str``, ``constrained-str``), not a field."""
    return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool") or x.startswith("constrained-"))


def _field_path(loc: tuple) -> list:
    """The field names and indices of an error location, without pydantic's union-member tags
    (``("prompt", "list[int]", 3)`` -> ``["prompt", 3]``; ``("stop", "constrained-str")`` -> ``["stop"]``)."""
    return [x for x in loc if not _is_tag(x)]


def _most_specific(errors: list[dict]) -> dict:
    """Of a union's errors, the one that is not merely "wrong type for this member" (its bound or format); when
    all are, the first error of the member that matched best: one whose outer shape matched (a list, not a
    string, for ``[1, 2]``), then with the fewest errors, failing deepest and furthest along (``[[5, 6], "x"]`` as
    token lists: entry 1 should be a list; ``content[0].text``, not ``content``)."""
    first_path = _field_path(errors[0]["loc"])[:1]
    same = [err for err in errors if _field_path(err["loc"])[:1] == first_path]
    for err in same:
        if not err["type"].endswith("_type"):
            return err
    members: dict[tuple, list[dict]] = {}   # union member (the location up to its tag) -> its errors, in order
    for err in same:
        tags = [i for i, x in enumerate(err["loc"]) if _is_tag(x)]
        members.setdefault(tuple(err["loc"][:tags[0] + 1]) if tags else (), []).append(err)

    def score(key: tuple) -> tuple:
        found = members[key]
        inner = _field_path(found[0]["loc"][len(key):])   # where the member's first error is, inside the member
        index = next((x for x in inner if isinstance(x, int)), 0)
        return (all(len(err["loc"]) == len(key) for err in found), len(found), -len(inner), -index)

    return members[min(members, key=score)][0]
