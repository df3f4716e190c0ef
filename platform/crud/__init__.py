"""Data access: keyword-only functions over a session. They flush but never commit; callers own transactions."""
