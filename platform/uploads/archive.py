"""Pulls ``adapter_config.json`` and ``adapter_model.safetensors`` out of a .tar(.gz) or .zip of a PEFT folder,
refusing path traversal, links and archives that expand past the size cap (decompression bombs)."""
from __future__ import annotations

import lzma
import os
import posixpath
import stat
import tarfile
import zipfile
import zlib
from typing import IO

from loraplex.platform.uploads.errors import UploadError, too_large

WANTED = ("adapter_config.json", "adapter_model.safetensors")
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")


def is_archive(filename: str) -> bool:
    return filename.lower().endswith(ARCHIVE_SUFFIXES)


def _check_member(name: str) -> None:
    clean = name.replace("\\", "/")
    if clean.startswith("/") or (len(clean) > 1 and clean[1] == ":") or ".." in clean.split("/"):
        raise UploadError(400, f"archive member {name!r} points outside the archive folder (path traversal); pack "
                               "the PEFT folder with relative paths, e.g. `tar czf adapter.tar.gz -C out .`",
                          code="path_traversal")


def _copy_capped(src: IO[bytes], dest: str, budget: list[int], limit: int) -> None:
    with open(dest, "wb") as out:
        while chunk := src.read(1 << 20):
            budget[0] -= len(chunk)
            if budget[0] < 0:
                raise too_large(limit, "archive contents")
            out.write(chunk)


def extract_peft_files(archive: str, filename: str, dest_dir: str, *, max_bytes: int,
                       max_members: int) -> dict[str, str]:
    """{basename: extracted path} for the PEFT files found; the caller checks which are missing."""
    found: dict[str, str] = {}
    budget = [max_bytes]
    if filename.lower().endswith(".zip"):
        try:
            zf = zipfile.ZipFile(archive)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError):
            # ValueError: a member name flagged UTF-8 that is not; NotImplementedError: an unknown zip version
            raise UploadError(400, f"{filename!r} is not a valid zip archive; upload a .zip or .tar.gz of the "
                                   "PEFT folder, or the two files", code="bad_archive") from None
        with zf:
            infos = zf.infolist()
            if len(infos) > max_members:
                raise UploadError(400, f"archive has {len(infos)} members, over the limit of {max_members}; pack only "
                                       "the PEFT folder", code="too_many_members")
            for info in infos:
                _check_member(info.filename)
                if stat.S_ISLNK(info.external_attr >> 16):
                    raise UploadError(400, f"archive member {info.filename!r} is a symbolic link; pack plain files",
                                      code="path_traversal")
            if sum(i.file_size for i in infos) > max_bytes:
                raise too_large(max_bytes, "archive contents")
            for info in infos:
                base = posixpath.basename(info.filename)
                if base in WANTED and not info.is_dir():
                    dest = _claim(found, base, dest_dir)
                    try:
                        with zf.open(info) as src:
                            _copy_capped(src, dest, budget, max_bytes)
                    except (zipfile.BadZipFile, EOFError, OSError, zlib.error, lzma.LZMAError, ValueError,
                            NotImplementedError, RuntimeError) as e:  # corrupt data, unknown compression method, encrypted member
                        raise UploadError(400, f"archive member {info.filename!r} is corrupt ({e}); pack it again",
                                          code="bad_archive") from None
        return found
    try:
        tf = tarfile.open(archive, mode="r:*")
    except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError):
        raise UploadError(400, f"{filename!r} is not a valid tar/tar.gz archive; upload a .tar.gz or .zip of the "
                               "PEFT folder, or the two files", code="bad_archive") from None
    with tf:
        count, declared = 0, 0
        try:
            for member in tf:  # streaming: members are read in order, never all listed first
                count += 1
                if count > max_members:
                    raise UploadError(400, f"archive has more than {max_members} members; pack only the PEFT folder",
                                      code="too_many_members")
                _check_member(member.name)
                if member.issym() or member.islnk():
                    raise UploadError(400, f"archive member {member.name!r} is a link; pack plain files "
                                           "(links could point outside the folder)", code="path_traversal")
                if not (member.isfile() or member.isdir()):
                    raise UploadError(400, f"archive member {member.name!r} is not a regular file",
                                      code="bad_archive")
                declared += member.size
                if declared > max_bytes:
                    raise too_large(max_bytes, "archive contents")
                base = posixpath.basename(member.name)
                if member.isfile() and base in WANTED:
                    _copy_capped(tf.extractfile(member), _claim(found, base, dest_dir), budget, max_bytes)
        except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as e:
            raise UploadError(400, f"archive {filename!r} is corrupt or truncated ({e}); pack it again",
                              code="bad_archive") from None
    return found


def _claim(found: dict[str, str], base: str, dest_dir: str) -> str:
    if base in found:
        raise UploadError(400, f"archive holds more than one {base}; pack exactly one PEFT adapter folder",
                          code="ambiguous_archive")
    found[base] = os.path.join(dest_dir, base)
    return found[base]
