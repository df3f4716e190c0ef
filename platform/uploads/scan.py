"""One pass over a safetensors file: its sha256 and a NaN/Inf check of every tensor, in bounded memory."""
from __future__ import annotations

import hashlib

import numpy as np

from loraplex.engine.lora.format import AdapterFormatError, SafetensorsHeader

# Non-finite floats have every exponent bit set: check the bits, never convert.
_EXPONENT = {"F32": (np.uint32, 0x7F800000), "F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80)}
CHUNK_BYTES = 4 * 1024 * 1024  # a multiple of every item size


def hash_and_scan(path: str, header: SafetensorsHeader, *, chunk_bytes: int = CHUNK_BYTES) -> str:
    """The file's sha256 (hex); raises ``AdapterFormatError`` (code ``non_finite``) naming the first tensor that
    holds a NaN or an infinity. ``header`` must come from ``read_safetensors_header`` on the same file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(header.data_start))
        for t in sorted(header.tensors.values(), key=lambda t: t.begin):
            kind, mask = _EXPONENT.get(t.dtype, (None, 0))
            left = t.nbytes
            while left:
                chunk = f.read(min(left, chunk_bytes))
                if not chunk:
                    raise AdapterFormatError(f"adapter_model.safetensors ended inside tensor {t.name!r}; upload the "
                                             "complete file", code="truncated")
                left -= len(chunk)
                digest.update(chunk)
                if kind is not None and np.any((np.frombuffer(chunk, dtype=kind) & mask) == mask):
                    raise AdapterFormatError(f"tensor {t.name!r} contains NaN or Inf values; the training "
                                             "diverged — fix it (lower the learning rate, check for fp16 "
                                             "overflow) and save again", code="non_finite")
        while rest := f.read(chunk_bytes):  # nothing, for a checked header; hashed for completeness
            digest.update(rest)
    return digest.hexdigest()
