"""Property-based fuzzing (hypothesis) of the torch-free upload validators: the safetensors header reader, the
adapter-config parser and the archive unpacker. Whatever the bytes, they return or raise their own error type
(``AdapterFormatError`` / ``UploadError``) with a message, never anything else; memory stays bounded whatever the
header or archive *declares*; nothing is ever written outside the destination folder.

Budget: EXAMPLES (500) per property, derandomized, no example database: ~4,000 inputs, ~30 s on 2 cores.
"""
from __future__ import annotations

import io
import json
import os
import struct
import tarfile
import tracemalloc
import zipfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.engine.lora.format import AdapterFormatError, parse_adapter_config, read_safetensors_header
from loraplex.platform.uploads.archive import extract_peft_files
from loraplex.platform.uploads.errors import UploadError

pytestmark = pytest.mark.filterwarnings("ignore:Duplicate name:UserWarning")   # zipfile, on purpose
EXAMPLES = 500
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
MEMORY_BOUND = 8 * 1024 * 1024     # bytes of Python allocations one call may peak at (inputs are < 64 KiB)
DTYPES = ["F32", "F16", "BF16", "I64", "F64", "U8", "BOOL", "F8_E4M3", "Q4", "", "f32"]
JSON_LEAF = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
JSON = st.recursive(JSON_LEAF, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                   max_size=4), max_leaves=20)


def bounded(fn, *args, **kw):
    """fn(*args) → ("ok", value) | ("refused", exception); asserts the allocation peak stays under MEMORY_BOUND."""
    tracemalloc.start()
    try:
        return "ok", fn(*args, **kw)
    except (AdapterFormatError, UploadError) as e:
        assert str(e), f"{type(e).__name__} without a message"
        return "refused", e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < MEMORY_BOUND, f"{fn.__name__} peaked at {peak} bytes"


# ---- safetensors header -------------------------------------------------------------------------------------
@FUZZ
@given(st.binary(max_size=256))
def test_header_reader_on_arbitrary_bytes(data):
    bounded(read_safetensors_header, io.BytesIO(data))


@st.composite
def safetensors_files(draw):
    """Plausible-looking files: a declared header length (honest or not), a JSON header of tensors with fuzzed
    dtypes, shapes and offsets (or any JSON at all), a data section of some length."""
    if draw(st.booleans()):
        entries = {}
        for name in draw(st.lists(st.text(max_size=20), max_size=4)):
            entries[name] = {"dtype": draw(st.sampled_from(DTYPES) | st.integers()),
                             "shape": draw(st.lists(st.integers(-3, 2**40), max_size=3) | JSON),
                             "data_offsets": draw(st.lists(st.integers(-10, 2**62), min_size=0, max_size=3) | JSON)}
        if draw(st.booleans()):
            entries["__metadata__"] = draw(JSON)
        header = json.dumps(entries).encode()
    else:
        header = json.dumps(draw(JSON)).encode()
    header += b" " * draw(st.integers(0, 8))
    declared = draw(st.sampled_from([len(header), 0, 1, 2**63 - 1, 2**64 - 1, 16 * 1024 * 1024 + 1]) |
                    st.integers(0, len(header) + 64))
    return struct.pack("<Q", declared) + header + b"\0" * draw(st.integers(0, 4096))


@FUZZ
@given(safetensors_files())
def test_header_reader_on_structured_files(data):
    status, value = bounded(read_safetensors_header, io.BytesIO(data), max_header_bytes=64 * 1024)
    if status == "ok":   # accepted: the tensors tile the data section exactly (no gap, no overlap, no overrun)
        data_len = len(data) - 8 - struct.unpack("<Q", data[:8])[0]
        spans = sorted((t.begin, t.end) for t in value.tensors.values()) if hasattr(value, "tensors") else []
        for (b0, e0), (b1, _) in zip(spans, spans[1:]):
            assert e0 == b1
        assert not spans or spans[-1][1] - spans[0][0] == data_len


@FUZZ
@given(st.data())
def test_header_reader_on_mutated_valid_adapter(data):
    from load_tests.adapters import rank1_adapter
    from loraplex.engine.testing.tiny import make_tiny_checkpoint

    global _VALID
    if "_VALID" not in globals():
        import tempfile

        base = make_tiny_checkpoint("llama", tempfile.mkdtemp(prefix="fuzz-base-"))
        _VALID = rank1_adapter(base)["adapter_model.safetensors"]
    raw = bytearray(_VALID)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    bounded(read_safetensors_header, io.BytesIO(bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw)))


# ---- adapter_config.json --------------------------------------------------------------------------------------
@FUZZ
@given(JSON | st.binary(max_size=64))
def test_config_parser_on_any_json(value):
    raw = value if isinstance(value, bytes) else json.dumps(value)
    bounded(parse_adapter_config, raw, max_rank=64)


@FUZZ
@given(st.fixed_dictionaries({}, optional={
    "peft_type": st.sampled_from(["LORA", "lora", "IA3", None]) | JSON_LEAF,
    "r": st.integers(-2, 2**40) | JSON_LEAF, "lora_alpha": st.floats() | JSON_LEAF,
    "target_modules": st.lists(st.text(max_size=12), max_size=4) | st.text(max_size=30) | JSON_LEAF,
    "target_parameters": st.lists(st.text(max_size=30), max_size=3) | JSON_LEAF,
    "rank_pattern": st.dictionaries(st.text(max_size=10), st.integers(-1, 2**33) | JSON_LEAF, max_size=3) | JSON_LEAF,
    "alpha_pattern": JSON, "use_dora": JSON_LEAF, "use_rslora": JSON_LEAF, "bias": JSON_LEAF,
    "modules_to_save": JSON, "fan_in_fan_out": JSON_LEAF, "base_model_name_or_path": JSON_LEAF}))
def test_config_parser_on_lora_shaped_configs(d):
    status, cfg = bounded(parse_adapter_config, d, max_rank=64)
    if status == "ok":   # accepted only with a usable rank, alpha and at least one target
        assert isinstance(cfg.r, int) and 1 <= cfg.r <= 64 and cfg.alpha > 0
        assert cfg.target_modules or cfg.target_parameters


# ---- archives -------------------------------------------------------------------------------------------------
NAMES = st.sampled_from(["adapter_config.json", "adapter_model.safetensors", "x/adapter_config.json",
                         "../adapter_config.json", "/etc/adapter_model.safetensors", "a/../../b", "", ".", "..",
                         "x/" * 40 + "adapter_model.safetensors", "dir/", "README.md"]) | st.text(max_size=30)


def unpack(tmp_path, archive: bytes, filename: str, *, max_bytes: int = 64 * 1024, max_members: int = 8):
    root = tmp_path / f"case-{os.urandom(6).hex()}"
    dest = root / "dest"
    dest.mkdir(parents=True)
    path = root / filename
    path.write_bytes(archive)
    status, value = bounded(extract_peft_files, str(path), filename, str(dest), max_bytes=max_bytes,
                            max_members=max_members)
    outside = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
               if not os.path.join(d, f).startswith(str(dest) + os.sep) and os.path.join(d, f) != str(path)]
    assert not outside, f"written outside the destination: {outside}"
    if status == "ok":
        for p in value.values():
            assert os.path.realpath(p).startswith(str(dest) + os.sep)
    else:
        assert value.status in (400, 413), value.status
    return status, value


@FUZZ
@given(st.binary(max_size=512), st.sampled_from(["a.zip", "a.tar.gz", "a.tgz", "a.tar"]))
def test_archive_on_arbitrary_bytes(tmp_path_factory, data, filename):
    unpack(tmp_path_factory.mktemp("arb"), data, filename)


@st.composite
def tar_archives(draw):
    buf = io.BytesIO()
    mode = draw(st.sampled_from(["w", "w:gz"]))
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for _ in range(draw(st.integers(0, 10))):
            info = tarfile.TarInfo(draw(NAMES) or "x")
            kind = draw(st.sampled_from([tarfile.REGTYPE, tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE,
                                         tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.FIFOTYPE]))
            info.type = kind
            payload = draw(st.binary(max_size=256)) if kind == tarfile.REGTYPE else b""
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = draw(st.sampled_from(["/etc/passwd", "../x", "adapter_config.json"]))
            info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload) if payload else None)
    return buf.getvalue(), "a.tar.gz" if mode == "w:gz" else "a.tar"


@FUZZ
@given(tar_archives())
def test_archive_on_hostile_tars(tmp_path_factory, archive):
    data, filename = archive
    unpack(tmp_path_factory.mktemp("tar"), data, filename)


@st.composite
def zip_archives(draw):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=draw(st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED]))) as zf:
        for _ in range(draw(st.integers(0, 10))):
            name = draw(NAMES) or "x"
            info = zipfile.ZipInfo(name)
            if draw(st.integers(0, 5)) == 0:
                info.external_attr = 0o120777 << 16        # a symbolic link
            size = draw(st.sampled_from([0, 10, 1000, 200 * 1024]))   # 200 KiB of zeros: a small bomb
            zf.writestr(info, b"\0" * size if draw(st.booleans()) else draw(st.binary(max_size=64)))
    data = bytearray(buf.getvalue())
    for _ in range(draw(st.integers(0, 3))):       # and some corruption
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@FUZZ
@given(zip_archives())
def test_archive_on_hostile_zips(tmp_path_factory, data):
    unpack(tmp_path_factory.mktemp("zip"), data, "a.zip")


def test_decompression_bomb_is_413_with_bounded_memory(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("adapter_model.safetensors", b"\0" * (64 * 1024 * 1024))    # 64 MiB → ~64 KiB compressed
    assert len(buf.getvalue()) < 256 * 1024
    status, err = unpack(tmp_path, buf.getvalue(), "a.zip", max_bytes=1024 * 1024)
    assert status == "refused" and err.status == 413 and "limit" in str(err)


def test_zip_with_invalid_utf8_member_name_is_400(tmp_path):
    """Found by the fuzzer: a member flagged UTF-8 whose name is not escaped zipfile as UnicodeDecodeError (500)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("adapter_\u00e9.json", b"{}")       # non-ASCII: zipfile sets the UTF-8 flag
    data = buf.getvalue().replace("\u00e9".encode(), b"\x80\x80")
    status, err = unpack(tmp_path, data, "a.zip")
    assert status == "refused" and err.status == 400 and err.code == "bad_archive", err
    assert "not a valid zip archive" in str(err)


def test_zip_of_unknown_version_is_400(tmp_path):
    """Found by the fuzzer: a central directory claiming zip version 6.4 escaped as NotImplementedError (500)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("adapter_config.json", b"{}")
    data = bytearray(buf.getvalue())
    central = data.index(b"PK\x01\x02")
    data[central + 6] = 64                # "version needed to extract": 6.4
    status, err = unpack(tmp_path, bytes(data), "a.zip")
    assert status == "refused" and err.status == 400 and err.code == "bad_archive", err
