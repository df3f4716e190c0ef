"""The OpenAPI schema says what the API answers: every 4xx/5xx response (and the ``default`` response of every
operation: any status it does not list) has OpenAI's error body (``ErrorBody``),
and request validation is documented as the 400 it is (FastAPI's default documents a 422 ``HTTPValidationError``
that this API never sends)."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from loraplex.platform.inference.errors import ErrorBody

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
VALIDATION_REF = "#/components/schemas/HTTPValidationError"


def _error_content() -> dict:
    return {"application/json": {"schema": ERROR_REF}}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}").get(
                "$defs", {}).items():
            components.setdefault(name, definition)
        body = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        body.pop("$defs", None)
        components.setdefault("ErrorBody", body)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                responses = operation.get("responses", {})
                validation = responses.get("422", {})
                if validation.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref") \
                        == VALIDATION_REF:
                    del responses["422"]
                    responses.setdefault("400", {"description": "invalid parameter (the message names it)"})
                responses.setdefault("default", {"description": "an error, in OpenAI's shape (ErrorBody)"})
                for status, response in responses.items():
                    if status[:1] in ("4", "5") or status == "default":
                        example = response.get("content", {}).get("application/json", {}).get("example")
                        response["content"] = _error_content()
                        if example is not None:
                            response["content"]["application/json"]["example"] = example
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
