"""Hostile and broken uploads on PostgreSQL + moto's S3. Each gets a 4xx whose message says what to fix, and
afterwards there is no ready row and no blob (database and bucket listing)."""
from __future__ import annotations

import io
import json
import struct
import tarfile
import zipfile

import pytest

from tests.platform.conftest import MAX_UPLOAD, read_files
from tests.utils.adapters import lora_tensors, safetensors_header


def files_of(folder, **replace):
    files = read_files(folder)
    files.update(replace)
    return files


def with_config(folder, **changes):
    cfg = json.loads(read_files(folder)["adapter_config.json"])
    cfg.update(changes)
    return files_of(folder, **{"adapter_config.json": json.dumps(cfg).encode()})


def parts(files: dict[str, bytes]):
    return [("files", (n, io.BytesIO(b))) for n, b in files.items()]


def tar_parts(members: dict[str, bytes | tuple], name="adapter.tar.gz"):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for member, data in members.items():
            info = tarfile.TarInfo(member)
            if isinstance(data, tuple):  # ("symlink", target)
                info.type, info.linkname = tarfile.SYMTYPE, data[1]
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return [("files", (name, io.BytesIO(buf.getvalue())))]


def zeros_tar(size: int) -> list:
    """A gzip'd tar whose one member inflates to ``size`` zero bytes (a few KiB on the wire)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        info = tarfile.TarInfo("out/adapter_model.safetensors")
        info.size = size

        class Zeros(io.RawIOBase):
            left = size

            def readable(self):
                return True

            def readinto(self, b):
                n = min(len(b), self.left)
                b[:n] = bytes(n)
                self.left -= n
                return n
        tf.addfile(info, io.BufferedReader(Zeros()))
    return [("files", ("bomb.tar.gz", io.BytesIO(buf.getvalue())))]


def zip_bomb(size: int) -> list:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("adapter_model.safetensors", bytes(size))
    return [("files", ("bomb.zip", io.BytesIO(buf.getvalue())))]


def hand_made(tensors, folder) -> dict:
    head, size = safetensors_header(tensors)
    return files_of(folder, **{"adapter_model.safetensors": head + bytes(size)})


def nan_weights(folder, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{folder}/adapter_model.safetensors")
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[7] = float("nan")
    save_file(tensors, str(tmp_path / "nan.safetensors"))
    return files_of(folder, **{"adapter_model.safetensors": (tmp_path / "nan.safetensors").read_bytes()})


Q = "base_model.model.model.layers.0.self_attn.q_proj"
CASES = {
    "not_safetensors": (lambda d, t: parts(files_of(d(), **{"adapter_model.safetensors": b"\x80\x04\x95" + b"x" * 500})),
                        422, "save_pretrained(..., safe_serialization=True)"),
    "text_not_safetensors": (lambda d, t: parts(files_of(d(), **{"adapter_model.safetensors": struct.pack("<Q", 5) + b"hello"})),
                             422, "safe_serialization=True"),
    "truncated": (lambda d, t: parts(files_of(d(), **{"adapter_model.safetensors": read_files(d())["adapter_model.safetensors"][:-100]})),
                  422, "truncated"),
    "header_length_bomb": (lambda d, t: parts(files_of(d(), **{"adapter_model.safetensors": struct.pack("<Q", 1 << 40) + b"{}"})),
                           422, "over the 16777216-byte limit"),
    "dtype_does_not_fit": (lambda d, t: parts(hand_made(lora_tensors(1, {"self_attn.q_proj": (40, 48)}, 4, dtype="I64"), d())),
                           422, "dtype I64 is not supported; save the adapter in one of F32, F16, BF16"),
    "shape_does_not_fit": (lambda d, t: parts(hand_made(lora_tensors(1, {"self_attn.q_proj": (41, 48)}, 4), d())),
                           422, "expected lora_A [4, 40] and lora_B [48, 4]"),
    "rank_above_limit": (lambda d, t: parts(read_files(d(r=32))), 422, "retrain with r <= 16"),
    "unsupported_target_config": (lambda d, t: parts(with_config(d(), target_modules=["q_proj", "lm_head"])),
                                  422, "unsupported target 'lm_head'"),
    "unsupported_target_tensor": (lambda d, t: parts(hand_made({"base_model.model.lm_head.lora_A.weight": ("F32", (4, 40)),
                                                                "base_model.model.lm_head.lora_B.weight": ("F32", (97, 4))}, d())),
                                  422, "not a LoRA weight of a supported target"),
    "dora_config": (lambda d, t: parts(read_files(d(use_dora=True, target_parameters=[]))), 422, "retrain with use_dora=False"),
    "modules_to_save": (lambda d, t: parts(with_config(d(), modules_to_save=["lm_head"])), 422, "modules_to_save=None"),
    "nan_weights": (lambda d, t: parts(nan_weights(d(), t)), 422, "contains NaN or Inf values"),
    "missing_config": (lambda d, t: [("files", ("adapter_model.safetensors", io.BytesIO(read_files(d())["adapter_model.safetensors"])))],
                       422, "missing adapter_config.json"),
    "missing_weights": (lambda d, t: [("files", ("adapter_config.json", io.BytesIO(read_files(d())["adapter_config.json"])))],
                        422, "missing adapter_model.safetensors"),
    "pickle_bin": (lambda d, t: [("files", ("adapter_config.json", io.BytesIO(read_files(d())["adapter_config.json"]))),
                                 ("files", ("adapter_model.bin", io.BytesIO(b"\x80\x04")))],
                   422, "upload adapter_model.safetensors"),
    "archive_path_traversal": (lambda d, t: tar_parts({**{f"x/{k}": v for k, v in read_files(d()).items()},
                                                       "../../etc/evil": b"pwned"}), 400, "path traversal"),
    "archive_absolute_path": (lambda d, t: tar_parts({"/tmp/adapter_config.json": read_files(d())["adapter_config.json"]}),
                              400, "relative paths"),
    "archive_symlink": (lambda d, t: tar_parts({"adapter_config.json": ("symlink", "/etc/passwd")}), 400, "is a link"),
    "zip_path_traversal": (lambda d, t: _zip({"../adapter_config.json": b"{}"}), 400, "path traversal"),
    "decompression_bomb_tar": (lambda d, t: zeros_tar(MAX_UPLOAD + 1), 413, "archive contents exceeds the 4194304-byte limit"),
    "decompression_bomb_zip": (lambda d, t: zip_bomb(MAX_UPLOAD + 1), 413, "archive contents exceeds the 4194304-byte limit"),
    "not_an_archive": (lambda d, t: [("files", ("adapter.zip", io.BytesIO(b"not a zip")))], 400, "not a valid zip archive"),
    "over_size_cap": (lambda d, t: parts(files_of(d(), **{"adapter_model.safetensors": bytes(MAX_UPLOAD + 1)})),
                      413, "exceeds the 4194304-byte limit"),
    "wrong_base_model": (lambda d, t: parts(with_config(d(), base_model_name_or_path="meta-llama/Llama-3.1-8B")),
                         422, "retrain on 'tiny-base'"),
    "config_not_json": (lambda d, t: parts(files_of(d(), **{"adapter_config.json": b"{not json"})), 422, "not valid JSON"),
}


def _zip(members):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for n, b in members.items():
            zf.writestr(n, b)
    return [("files", ("adapter.zip", io.BytesIO(buf.getvalue())))]


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_upload_is_refused_and_leaves_nothing(platform, adapter_dir, tmp_path, case):
    build, status, message = CASES[case]
    _, auth = platform.new_tenant()
    r = platform.upload(auth, "evil", build(adapter_dir, tmp_path))
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"], r.json()
    platform.assert_nothing_stored()
    assert platform.sql("SELECT count(*) FROM adapter_versions")[0][0] == 0


def test_refusals_leave_earlier_versions_alone(platform, adapter_dir):
    _, auth = platform.new_tenant()
    good = read_files(adapter_dir(seed=1))
    assert platform.upload(auth, "m", good).status_code == 201
    r = platform.upload(auth, "m", parts(with_config(adapter_dir(), use_dora=True)))
    assert r.status_code == 422
    assert platform.ready_rows() == 1 and len(platform.store.list_keys()) == 1
    assert platform.client.get("/v1/adapters/m", headers=auth).json()["aliases"] == {"latest": 1}


def test_good_archives_are_accepted(platform, adapter_dir):
    _, auth = platform.new_tenant()
    files = read_files(adapter_dir(seed=1))
    r = platform.upload(auth, "from-tar", tar_parts({f"my-adapter/{k}": v for k, v in files.items()}))
    assert r.status_code == 201, r.text
    r = platform.upload(auth, "from-zip", _zip(files))
    assert r.status_code == 201, r.text
    assert r.json()["sha256"] == platform.client.get("/v1/adapters/from-tar", headers=auth).json()["versions"][0]["sha256"]


@pytest.mark.parametrize("name,status,message", [
    ("", 422, "form field 'name'"), ("Bad/Name", 422, "form field 'name'"), ("a:b", 422, "form field 'name'")])
def test_bad_names(platform, adapter_dir, name, status, message):
    _, auth = platform.new_tenant()
    r = platform.upload(auth, name, read_files(adapter_dir()))
    assert r.status_code == status and message in r.json()["error"]["message"]
    platform.assert_nothing_stored()


def test_not_multipart_and_no_auth(platform):
    _, auth = platform.new_tenant()
    r = platform.client.post("/v1/adapters", content=b"{}", headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]["message"]
    r = platform.client.post("/v1/adapters", files=[("files", ("a", io.BytesIO(b"x")))])
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
    platform.assert_nothing_stored()
