"""The CLI tests use the security folder's live stack: the whole app on PostgreSQL, Redis and moto's S3 under
uvicorn (one per session)."""
from tests.security.live_stack import stack  # noqa: F401
