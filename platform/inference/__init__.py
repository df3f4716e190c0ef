"""The OpenAI-compatible protocol of the gateway: pydantic models, SSE encoding, chat templates, ``model``
parsing and OpenAI-shaped errors. No engine or database here; the routes (phase 2) wire these together."""
from loraplex.platform.inference.chat_template import FALLBACK_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError
from loraplex.platform.inference.errors import ErrorBody, ErrorDetail, InferenceError, model_not_found
from loraplex.platform.inference.model_name import ModelNameError, ModelTarget, parse_model
from loraplex.platform.inference.sse import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, parse_sse, sse_event

__all__ = ["ChatTemplate", "ChatTemplateError", "FALLBACK_CHAT_TEMPLATE", "ErrorBody", "ErrorDetail",
           "InferenceError", "model_not_found", "ModelNameError", "ModelTarget", "parse_model", "SSE_DONE",
           "SSE_HEADERS", "SSE_MEDIA_TYPE", "parse_sse", "sse_event"]
