"""Pydantic request/response schemas of the API (apart from the ORM models)."""
