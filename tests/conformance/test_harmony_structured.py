"""Structured outputs on a harmony-format base model (GPT-OSS): refused on chat with a 400 naming the field (the
grammar would constrain the reasoning channel too), before anything reaches the engine."""
from __future__ import annotations

import openai
import pytest

from loraplex.platform.engines.inprocess import NullEngineClient
from loraplex.platform.routing import Replica
from tests.platform.gateway.conftest import serve, settings_for  # noqa: F401  (fixture)
from tests.platform.gateway.test_harmony_chat import gpt_oss_base, harmony_env, vocab_dir  # noqa: F401  (fixtures)


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"extra_body": {"guided_choice": ["a", "b"]}}, "guided_choice"),
])
def test_chat_constraints_on_harmony_models_are_refused(serve, tmp_path, gpt_oss_base, harmony_env, kw, param):
    engine = NullEngineClient()
    server = serve(settings_for(tmp_path, gpt_oss_base), replicas=[Replica("null", engine)])
    _, key = server.new_tenant()
    with pytest.raises(openai.BadRequestError) as e:
        server.openai(key).chat.completions.create(model=server.gateway.model_name, max_tokens=2,
                                                   messages=[{"role": "user", "content": "hi"}], **kw)
    assert e.value.param == param and e.value.code == "unsupported_parameter" and "harmony" in e.value.message
    assert engine.service.num_requests == 0
