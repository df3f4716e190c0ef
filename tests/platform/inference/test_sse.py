"""SSE decoding used by tests and benchmark clients."""
from __future__ import annotations


def test_parse_sse_splits_events_only_at_cr_lf():
    """U+2028 / U+0085 inside a JSON string are not line ends for SSE (str.splitlines would split there)."""
    from loraplex.platform.inference.sse import parse_sse

    raw = 'data: {"text": "a\u2028b\u0085c"}\r\n\r\ndata: [DONE]\n\n'.encode()
    assert parse_sse(raw) == [{"text": "a\u2028b\u0085c"}, "[DONE]"]
