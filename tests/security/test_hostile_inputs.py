"""Hostile inputs against the live app on PostgreSQL, Redis and S3: each case is one request a careless or hostile
client could send (adapter configs, safetensors headers, multipart bodies, inference bodies, admin and tenant API
parameters). Every one is answered 4xx in OpenAI's error shape with an ``x-request-id``, never a 500; and none of
them leaves anything behind (no version row beyond the fixture's, no blob beyond the fixture's)."""
from __future__ import annotations

import json

import pytest

from tests.security.live_stack import ADMIN_KEY, assert_openai_error, lora_files

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
Q = "base_model.model.model.layers.0.self_attn.q_proj"
DEEP = 100_000


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# ---- uploads: adapter_config.json -------------------------------------------------------------------------------
def config_case(status=None, **config):
    return ("upload", {"config": config}, status)


def raw_config_case(raw: bytes, status=None):
    return ("upload", {"config_bytes": raw}, status)


def header_case(status=None, **kw):
    return ("upload", kw, status)


UPLOADS = {
    "rank_pattern_lookahead": config_case(rank_pattern={"(?=q)q_proj": 2}),
    "rank_pattern_backreference": config_case(rank_pattern={r"(q)\1_proj": 2}),
    "rank_pattern_unbalanced": config_case(rank_pattern={"q_proj(": 2}),
    "rank_pattern_too_long": config_case(rank_pattern={"q" * 300: 2}),
    "rank_pattern_too_many": config_case(rank_pattern={f"layers.{i}.q_proj": 2 for i in range(1100)}),
    "rank_pattern_huge_repeat": config_case(rank_pattern={"((a{1000}){1000}){1000}": 2}),
    "rank_pattern_value_zero": config_case(rank_pattern={"q_proj": 0}),
    "rank_pattern_value_negative": config_case(rank_pattern={"q_proj": -4}),
    "rank_pattern_value_float": config_case(rank_pattern={"q_proj": 2.5}),
    "rank_pattern_value_bool": config_case(rank_pattern={"q_proj": True}),
    "rank_pattern_value_string": config_case(rank_pattern={"q_proj": "2"}),
    "rank_pattern_value_past_int32": config_case(rank_pattern={"q_proj": 2**31}),
    "rank_pattern_not_a_map": config_case(rank_pattern=["q_proj", 2]),
    "rank_above_the_engines_limit": ("upload", {"r": 16}, None),
    "r_past_int32": config_case(r=2147483648),
    "r_zero": config_case(r=0),
    "r_string": config_case(r="2"),
    "r_past_int_digit_limit": raw_config_case(b'{"peft_type": "LORA", "r": ' + b"9" * 5000 +
                                              b', "target_modules": ["q_proj"]}'),
    "lora_alpha_nan": raw_config_case(b'{"peft_type": "LORA", "r": 2, "lora_alpha": NaN, '
                                      b'"target_modules": ["q_proj"]}'),
    "lora_alpha_infinity": raw_config_case(b'{"peft_type": "LORA", "r": 2, "lora_alpha": Infinity, '
                                           b'"target_modules": ["q_proj"]}'),
    "lora_alpha_overflows_to_inf": raw_config_case(b'{"peft_type": "LORA", "r": 2, "lora_alpha": 1e999, '
                                                   b'"target_modules": ["q_proj"]}'),
    "lora_alpha_1e308": config_case(lora_alpha=1e308),
    "lora_alpha_negative": config_case(lora_alpha=-2),
    "alpha_pattern_scaling_too_large": config_case(alpha_pattern={"q_proj": 1e6}),
    "alpha_pattern_value_nan": raw_config_case(b'{"peft_type": "LORA", "r": 2, "alpha_pattern": {"q_proj": NaN}, '
                                               b'"target_modules": ["q_proj"]}'),
    "config_nested_past_parser": raw_config_case(b'{"peft_type": "LORA", "x": ' + _nested(DEEP) + b"}"),
    "config_nested_40_levels": raw_config_case(b'{"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"], '
                                               b'"x": ' + _nested(40) + b"}"),
    "config_duplicate_key": raw_config_case(b'{"peft_type": "LORA", "r": 2, "r": 64, "target_modules": ["q_proj"]}'),
    "config_lone_surrogate": config_case(base_model_name_or_path="\ud800"),
    "config_unknown_field_infinity": raw_config_case(b'{"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"], '
                                                     b'"extra": 1e999}'),
    "target_modules_lookbehind_regex": config_case(target_modules="(?<=self_attn\\.)q_proj"),
    "target_modules_too_many": config_case(target_modules=[f"q_proj{i}" for i in range(200)]),
    "use_rslora_not_bool": config_case(use_rslora="yes"),
    "peft_type_not_a_string": config_case(peft_type=5),
    # ---- uploads: adapter_model.safetensors header ----------------------------------------------------------
    "header_duplicate_tensor_name": header_case(raw_header=(
        b'{"' + Q.encode() + b'.lora_A.weight": {"dtype": "F32", "shape": [2, 64], "data_offsets": [0, 512]}, "'
        + Q.encode() + b'.lora_A.weight": {"dtype": "F32", "shape": [2, 64], "data_offsets": [0, 512]}}')),
    "header_nested_past_parser": header_case(raw_header=b'{"x": ' + _nested(DEEP) + b"}"),
    "header_int_past_digit_limit": header_case(raw_header=b'{"t": {"dtype": "F32", "shape": [' + b"9" * 5000 +
                                               b'], "data_offsets": [0, 4]}}'),
    "header_layer_index_past_int64": header_case(header={
        "base_model.model.model.layers.99999999999999999999.self_attn.q_proj.lora_A.weight":
            {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}),
    "header_tensor_name_too_long": header_case(header={
        "base_model.model.model.layers.0." + "x." * 400 + "lora_A.weight":
            {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}),
    "header_metadata_nested": header_case(header={"__metadata__": {"format": [[["pt"]]]}}),
    "header_metadata_lone_surrogate": header_case(header={"__metadata__": {"format": "\udfff"}}),
    "header_shape_of_nine_dims": header_case(header={"t": {"dtype": "F32", "shape": [1] * 9, "data_offsets": [0, 4]}}),
    "header_nan_offset": header_case(raw_header=b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, NaN]}}'),
}


def _upload_files(base: str, spec: dict) -> dict[str, bytes]:
    spec = dict(spec)
    r = spec.pop("r", 2)
    return lora_files(base, r=r, **spec)


# ---- inference ----------------------------------------------------------------------------------------------
def infer(body, path="/v1/completions", status=None):
    return ("infer", {"path": path, "body": body}, status)


def infer_raw(raw: bytes, path="/v1/completions", status=None):
    return ("infer", {"path": path, "raw": raw}, status)


CHAT = "/v1/chat/completions"
INFERENCE = {
    "prompt_lone_surrogate": infer({"model": "BASE", "prompt": "\ud800"}),
    "chat_content_lone_surrogate": infer({"model": "BASE", "messages": [{"role": "user", "content": "a\udfffb"}]},
                                         CHAT),
    "stop_lone_surrogate": infer({"model": "BASE", "prompt": "hi", "stop": ["\udbff"]}),
    "body_nested_past_parser": infer_raw(b'{"model": "BASE", "prompt": ' + _nested(DEEP) + b"}"),
    "body_nested_40_levels": infer_raw(b'{"model": "BASE", "prompt": "hi", "user": ' + _nested(40) + b"}"),
    "body_int_past_digit_limit": infer_raw(b'{"model": "BASE", "prompt": "hi", "seed": ' + b"9" * 5000 + b"}"),
    "body_a_list": infer([{"model": "BASE"}]),
    "body_not_json": infer_raw(b"{model: BASE"),
    "body_not_utf8": infer_raw(b'{"model": "\xff\xfe"}'),
    "body_over_the_cap": infer_raw(b'{"model": "BASE", "prompt": "' + b"a" * (300 * 1024) + b'"}', status=413),
    "seed_past_int64": infer({"model": "BASE", "prompt": "hi", "seed": 2**64}),
    "top_k_past_int32": infer({"model": "BASE", "prompt": "hi", "top_k": 2**40}),
    "token_id_past_int32": infer({"model": "BASE", "prompt": [2**31]}),
    "token_id_negative": infer({"model": "BASE", "prompt": [5, -1]}),
    "max_tokens_past_int32": infer({"model": "BASE", "prompt": "hi", "max_tokens": 2**31}),
    "min_tokens_negative": infer({"model": "BASE", "prompt": "hi", "min_tokens": -1}),
    "temperature_nan": infer_raw(b'{"model": "BASE", "prompt": "hi", "temperature": NaN}'),
    "n_huge": infer({"model": "BASE", "prompt": "hi", "n": 10**6}),
    "stop_empty_string": infer({"model": "BASE", "prompt": "hi", "stop": [""]}),
    "model_version_past_int32": infer({"model": "owned:2147483648", "prompt": "hi"}, status=404),
    "model_version_past_digit_limit": infer({"model": "owned:" + "9" * 5000, "prompt": "hi"}, status=404),
    "model_version_superscript_digit": infer({"model": "owned:\u00b2", "prompt": "hi"}, status=404),
    "model_other_tenants_adapter": infer({"model": "theirs", "prompt": "hi"}, status=404),
    "model_not_a_string": infer({"model": 7, "prompt": "hi"}),
}


# ---- admin and tenant API -----------------------------------------------------------------------------------
def api(method, path, *, admin=False, status=None, **kw):
    return ("api", {"method": method, "path": path, "admin": admin, **kw}, status)


API = {
    "quota_zero": api("PUT", "/admin/tenants/{owner}/quotas", admin=True, json={"requests_per_minute": 0}),
    "quota_past_int32": api("PUT", "/admin/tenants/{owner}/quotas", admin=True, json={"max_concurrency": 2**31}),
    "quota_negative": api("PUT", "/admin/tenants/{owner}/quotas", admin=True, json={"tokens_per_day": -1}),
    "quota_not_a_number": api("PUT", "/admin/tenants/{owner}/quotas", admin=True, json={"tokens_per_minute": "x"}),
    "tenant_name_lone_surrogate": api("POST", "/admin/tenants", admin=True,
                                      content=b'{"name": "a\\ud800"}', headers={"content-type": "application/json"}),
    "key_name_lone_surrogate": api("POST", "/admin/tenants/{owner}/keys", admin=True,
                                   content=b'{"name": "k\\udc00"}', headers={"content-type": "application/json"}),
    "admin_body_nested_past_parser": api("POST", "/admin/tenants", admin=True,
                                         content=b'{"name": ' + _nested(DEEP) + b"}",
                                         headers={"content-type": "application/json"}),
    "admin_body_over_the_cap": api("POST", "/admin/tenants", admin=True, status=413,
                                   content=b'{"name": "' + b"a" * (300 * 1024) + b'"}',
                                   headers={"content-type": "application/json"}),
    "tenant_id_too_long": api("GET", "/admin/tenants/" + "x" * 5000, admin=True),
    "tenants_offset_past_int32": api("GET", "/admin/tenants?offset=99999999999999999999", admin=True),
    "tenants_limit_zero": api("GET", "/admin/tenants?limit=0", admin=True),
    "adapters_offset_past_int32": api("GET", "/v1/adapters?offset=2147483648"),
    "adapters_offset_not_a_number": api("GET", "/v1/adapters?offset=ten"),
    "version_number_past_int32": api("DELETE", "/v1/adapters/owned/versions/2147483648"),
    "version_number_not_a_number": api("DELETE", "/v1/adapters/owned/versions/one"),
    "alias_version_past_int32": api("PUT", "/v1/adapters/owned/aliases/prod", json={"version": 2**40}),
    "alias_name_too_long": api("PUT", "/v1/adapters/owned/aliases/" + "a" * 40, json={"version": 1}),
    "alias_latest_reserved": api("DELETE", "/v1/adapters/owned/aliases/latest"),
    "rollback_version_past_int32": api("POST", "/v1/adapters/owned/rollback", json={"version": 2**40}),
    "import_source_file_scheme": api("POST", "/v1/adapters/import", json={"name": "x", "source": "file:///etc/"}),
    "import_source_metadata_address": api("POST", "/v1/adapters/import",
                                          json={"name": "x", "source": "http://169.254.169.254/latest/"}),
    "import_source_with_userinfo": api("POST", "/v1/adapters/import",
                                       json={"name": "x", "source": "https://u:p@huggingface.co/a/"}),
    "usage_export_bad_format": api("GET", "/v1/usage/export?format=xlsx"),
    "usage_date_out_of_range": api("GET", "/v1/usage?start=99999-01-01"),
    "usage_start_after_end": api("GET", "/v1/usage?start=2026-02-01&end=2026-01-01"),
    "admin_usage_tenant_id_too_long": api("GET", "/admin/usage?tenant_id=" + "t" * 100, admin=True),
    "unknown_route": api("GET", "/v1/nothing-here", status=404),
    "method_not_allowed": api("DELETE", "/v1/models", status=405),
    "models_retrieve_other_tenant": api("GET", "/v1/models/theirs", status=404),
    "models_retrieve_unknown": api("GET", "/v1/models/nope:3", status=404),
    "no_api_key": api("GET", "/v1/adapters", status=401, headers={"Authorization": ""}),
    "dashboard_cookie_superscript_digit": api("GET", "/admin/dashboard/data", status=401, headers={
        "Authorization": "", "Cookie": "loraplex_dashboard=\u00b2.abc".encode("latin-1")}),
    "dashboard_cookie_past_digit_limit": api("GET", "/admin/dashboard/data", status=401, headers={
        "Authorization": "", "Cookie": "loraplex_dashboard=" + "9" * 5000 + ".abc"}),
}

CASES = {**UPLOADS, **INFERENCE, **API}


def _send(stack, kind: str, spec: dict):
    http = stack.server.http
    if kind == "upload":
        return stack.upload(stack.owner_key, "hostile", _upload_files(stack.base, spec))
    if kind == "infer":
        headers = {**stack.auth(), "content-type": "application/json"}
        base = stack.server.gateway.model_name
        if "raw" in spec:
            return http.post(spec["path"], content=spec["raw"].replace(b"BASE", base.encode()), headers=headers)
        body = json.loads(json.dumps(spec["body"]).replace('"BASE"', json.dumps(base)))
        return http.post(spec["path"], content=json.dumps(body).encode(), headers=headers)
    headers = {**(ADMIN if spec["admin"] else stack.auth()), **spec.get("headers", {})}
    headers = {k: v for k, v in headers.items() if v}
    path = spec["path"].replace("{owner}", stack.owner_id)
    return http.request(spec["method"], path, headers=headers,
                        **{k: spec[k] for k in ("json", "content") if k in spec})


def test_there_are_at_least_forty_hostile_inputs():
    assert len(CASES) >= 40, len(CASES)


@pytest.mark.parametrize("kind,spec,status", list(CASES.values()), ids=list(CASES))
def test_hostile_input_is_a_4xx_in_openai_shape(stack, kind, spec, status):
    r = _send(stack, kind, spec)
    error = assert_openai_error(r, status)
    if kind == "upload":
        assert r.status_code in (400, 413, 422), r.text[:300]
        assert stack.server.http.get("/v1/adapters/hostile", headers=stack.auth()).status_code == 404


def test_refusals_name_what_to_fix(stack):
    """Spot checks of the messages, params and stable codes of a few refusals."""
    r = _send(stack, *UPLOADS["rank_pattern_lookahead"][:2])
    e = assert_openai_error(r, 422)
    assert e["code"] == "bad_pattern" and "rank_pattern" in e["message"] and "(?=q)q_proj" in e["message"]
    r = _send(stack, *UPLOADS["rank_above_the_engines_limit"][:2])
    e = assert_openai_error(r, 422)
    assert e["code"] == "rank_too_high" and "limit of 8" in e["message"], e
    r = _send(stack, *UPLOADS["lora_alpha_1e308"][:2])
    e = assert_openai_error(r, 422)
    assert "scaling" in e["message"] and e["code"] == "config_invalid"
    r = _send(stack, *UPLOADS["header_duplicate_tensor_name"][:2])
    assert assert_openai_error(r, 422)["code"] == "duplicate_tensor"
    r = _send(stack, *INFERENCE["prompt_lone_surrogate"][:2])
    e = assert_openai_error(r, 400)
    assert e["param"] == "prompt" and "surrogate" in e["message"]
    r = _send(stack, *API["quota_zero"][:2])
    e = assert_openai_error(r, 400)
    assert e["param"] == "requests_per_minute" and "disable the tenant" in e["message"]
    r = _send(stack, *API["adapters_offset_past_int32"][:2])
    assert assert_openai_error(r, 400)["param"] == "offset"
    r = _send(stack, *API["alias_latest_reserved"][:2])
    assert assert_openai_error(r, 422)["code"] == "reserved_alias"
    r = _send(stack, *API["method_not_allowed"][:2])
    assert assert_openai_error(r, 405)["code"] == "method_not_allowed" and r.headers.get("allow") == "GET"


def test_nothing_was_left_behind(stack):
    """Every hostile upload again: afterwards the same version rows and S3 objects as before, and no incomplete
    multipart upload."""
    import boto3
    from sqlalchemy import text

    s3 = boto3.client("s3", endpoint_url=stack.server.app.state.settings.s3_endpoint_url, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")

    def state():
        with stack.server.gateway.sessions() as s:
            rows = dict(s.execute(text("SELECT status, count(*) FROM adapter_versions GROUP BY status")).all())
        return rows, len(s3.list_objects_v2(Bucket=stack.bucket).get("Contents", []))

    before = state()
    for kind, spec, _ in UPLOADS.values():
        assert _send(stack, kind, spec).status_code in (400, 413, 422)
    assert state() == before
    assert set(before[0]) == {"ready"}, before
    assert not s3.list_multipart_uploads(Bucket=stack.bucket).get("Uploads")


def test_bytes_after_the_closing_boundary_count_toward_the_cap(stack):
    limit = stack.server.app.state.settings.max_upload_bytes
    files = lora_files(stack.base)
    boundary = "hostileboundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nepilogue\r\n'.encode()]
    for name, data in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{name}"\r\n'
                     f"Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()

    def chunks():            # streamed without a Content-Length, so only the running count can stop it
        yield body
        for _ in range(limit // 65536 + 4):
            yield b"x" * 65536

    r = stack.server.http.post("/v1/adapters", content=chunks(), headers={
        **stack.auth(), "content-type": f"multipart/form-data; boundary={boundary}"})
    assert assert_openai_error(r, 413)["code"] == "too_large"
    assert stack.server.http.get("/v1/adapters/epilogue", headers=stack.auth()).status_code == 404
