"""Streams a ``multipart/form-data`` request body to files in a spool folder, never holding a file in memory and
stopping as soon as the body passes the size cap: the files' bytes count against ``max_bytes`` and the whole body
(boundaries, part headers, a preamble, anything after the closing boundary) against ``max_bytes`` plus
``MULTIPART_SLACK``."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import AsyncIterator, BinaryIO

from python_multipart.multipart import MultipartParser, parse_options_header

from loraplex.platform.uploads.errors import UploadError, too_large

MAX_FIELD_BYTES = 4096
MAX_PARTS = 8
MULTIPART_SLACK = 64 * 1024  # boundaries and part headers on top of the files themselves


@dataclass
class SpooledFile:
    field: str
    filename: str  # the client's name, reduced to its last path component
    path: str
    size: int = 0


@dataclass
class SpooledForm:
    fields: dict[str, str] = field(default_factory=dict)
    files: list[SpooledFile] = field(default_factory=list)


async def spool_multipart(body: AsyncIterator[bytes], content_type: str | None, content_length: str | None, *,
                          dest_dir: str, max_bytes: int) -> SpooledForm:
    """Parses the streamed body into ``dest_dir``; files count against ``max_bytes`` together."""
    ctype, params = parse_options_header(content_type or "")
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise UploadError(415, "send the adapter as multipart/form-data: the files adapter_config.json and "
                               "adapter_model.safetensors, or one .tar.gz/.zip of the PEFT folder, plus a name "
                               "field", code="not_multipart")
    if content_length and content_length.isascii() and content_length.isdigit() \
            and (len(content_length) > 18 or int(content_length) > max_bytes + MULTIPART_SLACK):
        raise too_large(max_bytes)
    form, state = SpooledForm(), _PartState()
    total = 0

    def on_part_begin() -> None:
        state.reset()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state.header_field += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state.header_value += data[start:end]

    def on_header_end() -> None:
        state.headers[state.header_field.decode("latin-1").lower()] = state.header_value.decode("utf-8", "replace")
        state.header_field, state.header_value = b"", b""

    def on_headers_finished() -> None:
        if len(form.files) + len(form.fields) >= MAX_PARTS:
            raise UploadError(400, f"more than {MAX_PARTS} form parts; send the two PEFT files (or one archive) "
                                   "and the name field", code="too_many_parts")
        _, disp = parse_options_header(state.headers.get("content-disposition", ""))
        state.name = disp.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in disp:
            filename = re.split(r"[\\/]", disp[b"filename"].decode("utf-8", "replace"))[-1]
            path = os.path.join(dest_dir, f"part-{len(form.files)}")
            state.file = SpooledFile(field=state.name, filename=filename, path=path)
            state.out = open(path, "wb")
            form.files.append(state.file)

    def on_part_data(data: bytes, start: int, end: int) -> None:
        nonlocal total
        n = end - start
        if state.out is not None:
            total += n
            if total > max_bytes:
                raise too_large(max_bytes)
            state.out.write(data[start:end])
            state.file.size += n
        else:
            state.value += data[start:end]
            if len(state.value) > MAX_FIELD_BYTES:
                raise UploadError(400, f"form field {state.name!r} is over {MAX_FIELD_BYTES} bytes",
                                  code="field_too_large")

    def on_part_end() -> None:
        if state.out is not None:
            state.out.close()
            state.out = None
        else:
            form.fields[state.name] = state.value.decode("utf-8", "replace")

    parser = MultipartParser(params[b"boundary"], callbacks=dict(
        on_part_begin=on_part_begin, on_header_field=on_header_field, on_header_value=on_header_value,
        on_header_end=on_header_end, on_headers_finished=on_headers_finished, on_part_data=on_part_data,
        on_part_end=on_part_end))
    received = 0   # every byte of the body counts, the preamble and what follows the closing boundary too
    try:
        async for chunk in body:
            received += len(chunk)
            if received > max_bytes + MULTIPART_SLACK:
                raise too_large(max_bytes)
            parser.write(chunk)
        parser.finalize()
    except UploadError:
        raise
    except Exception as e:  # python-multipart's parse errors
        raise UploadError(400, f"malformed multipart body: {e}", code="bad_multipart") from None
    finally:
        if state.out is not None:
            state.out.close()
    return form


class _PartState:
    """What the parser callbacks know about the part being read."""

    def __init__(self) -> None:
        self.out: BinaryIO | None = None  # the open spool file of a file part
        self.reset()

    def reset(self) -> None:
        self.header_field, self.header_value = b"", b""
        self.headers: dict[str, str] = {}
        self.name = ""
        self.value = b""
        self.file: SpooledFile | None = None
