"""Tuned launch configs: ``tuning_configs/<device>/<op>.json``, keyed by the op's shape, then by M (tokens).

File layout (written by ``loraplex tune`` through :func:`config_path`, read by :func:`get_config`)::

    {
      "E=32,N=5760,K=2880": {               # shape key: the op's static dims, see shape_key()
        "1":  {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
        "16": {...},
        "64": {...}
      }
    }

The M entry nearest to the call's M wins (ties go to the smaller M). ``LORAPLEX_TUNING_DIR`` replaces the
``tuning_configs`` folder. A missing file, or a shape the file lacks, falls back to the launcher's default with
one warning per (folder, device, op[, shape]), and :func:`untuned` lists such lookups. Files are read once and
cached; :func:`clear_cache` forgets them.

A device folder may hold ``same_as.json`` instead of (or beside) op files, to read another device's configs::

    {"device": "NVIDIA_H200", "reason": "both are sm_90 Hopper parts with 132 SMs"}

``device`` names a sibling folder under the same root. Reading an op (:func:`get_config`, :func:`tuned_ms`) uses
the device folder's own ``<op>.json`` when it exists, else the aliased folder's (and so on along a chain of
aliases; a cycle, a bad ``same_as.json`` or a missing aliased folder raises :class:`TuningConfigError`).
:func:`read_path` and :func:`device_files` give the files a read uses. Writing (:func:`write_configs`,
:func:`config_path`) always targets the device's own folder: the first write of an op there starts from the
aliased file's entries, and the own file then wins over the alias for that op.
Torch-free and triton-free so the CPU path may import it.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)

TUNING_DIR_ENV = "LORAPLEX_TUNING_DIR"
ALIAS_FILE = "same_as.json"
_ALIAS_OP = ALIAS_FILE[:-len(".json")]
_REPO_TUNING_DIR = Path(__file__).resolve().parent.parent / "tuning_configs"
_REPO_TUNING_DIR_STR = str(_REPO_TUNING_DIR)
_UNTUNED: dict[str, None] = {}  # the lookups that fell back to the defaults, in the order first seen (``untuned``)


class TuningConfigError(ValueError):
    """A tuning file exists but cannot be used (bad JSON or a bad layout)."""


def tuning_dir() -> Path:
    """The folder holding one sub-folder per device (``LORAPLEX_TUNING_DIR`` or the repo's tuning_configs/)."""
    override = os.environ.get(TUNING_DIR_ENV)
    return Path(override) if override else _REPO_TUNING_DIR


def device_folder_name(device_name: str) -> str:
    """``"NVIDIA H200"`` -> ``"NVIDIA_H200"`` (spaces and path separators become underscores)."""
    name = device_name.strip()
    for ch in (" ", "/", "\\", ":"):
        name = name.replace(ch, "_")
    if not name:
        raise ValueError("device name is empty; pass the name torch.cuda.get_device_name() reports")
    return name


def current_device_name() -> str:
    """The name torch reports for the current CUDA device ("cpu" without one)."""
    import torch

    return _cuda_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"


@functools.cache
def _cuda_device_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def shape_key(shape: Mapping[str, int]) -> str:
    """Canonical key of an op's static dims, in the order given: ``{"E": 32, "N": 5760}`` -> ``"E=32,N=5760"``."""
    return ",".join(f"{k}={int(v)}" for k, v in shape.items())


def config_path(op: str, device_name: str | None = None, root: str | os.PathLike | None = None) -> Path:
    """The device's own file for ``op`` (the tuner writes it; a read uses it when it exists, else an aliased
    folder's file: :func:`read_path`). ``same_as`` is not an op name."""
    if not op or "/" in op or "\\" in op or op == _ALIAS_OP:
        raise ValueError(f"bad op name {op!r}; expected a plain name such as 'fused_moe'")
    device = device_folder_name(device_name if device_name is not None else current_device_name())
    return Path(root if root is not None else tuning_dir()) / device / f"{op}.json"


def _json_object(path: Path, expected: str, fix: str = "") -> dict:
    """The JSON object in ``path``; TuningConfigError naming the file when it is not valid JSON or not an object."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TuningConfigError(f"{path} is not valid JSON ({e}){fix}") from None
    if not isinstance(raw, dict):
        raise TuningConfigError(f"{path}: expected {expected}, got {type(raw).__name__}")
    return raw


def _read_alias(path: Path) -> str:
    """The folder name a ``same_as.json`` points at (checked for shape, not for existence)."""
    raw = _json_object(path, "an object with a \"device\" key")
    target = raw.get("device")
    if not isinstance(target, str) or not target.strip():
        raise TuningConfigError(f"{path}: \"device\" must name a device folder, e.g. \"NVIDIA_H200\"; got {target!r}")
    if "/" in target or "\\" in target or target in (".", ".."):
        raise TuningConfigError(f"{path}: \"device\" must be a folder name under the same root, got {target!r}")
    return target


@functools.cache
def _chain(root: str, device: str) -> tuple[Path, ...]:
    """The device's folder, then each folder its ``same_as.json`` chain points at, in reading order."""
    base = Path(root)
    names = [device]
    aliases: list[Path] = []
    while (alias := base / names[-1] / ALIAS_FILE).is_file():
        aliases.append(alias)
        target = _read_alias(alias)
        if target in names:
            raise TuningConfigError("same_as.json aliases form a cycle: "
                                    + " -> ".join(str(a) for a in aliases) + f" -> {base / target}")
        if not (base / target).is_dir():
            raise TuningConfigError(f"{alias}: aliased folder {base / target} does not exist")
        names.append(target)
    return tuple(base / n for n in names)


def _folders(device_name: str | None, root: str | os.PathLike | None) -> tuple[Path, ...]:
    device = device_folder_name(device_name if device_name is not None else current_device_name())
    return _chain(str(root if root is not None else tuning_dir()), device)


def read_path(op: str, device_name: str | None = None, root: str | os.PathLike | None = None) -> Path | None:
    """The file a read of ``op``'s configs on ``device_name`` uses: the device folder's own ``<op>.json``, else the
    first one along its ``same_as.json`` chain; None when there is none."""
    name = config_path(op, device_name, root).name
    for folder in _folders(device_name, root):
        if (folder / name).is_file():
            return folder / name
    return None


def device_files(device_name: str | None = None, root: str | os.PathLike | None = None) -> dict[str, Path]:
    """``{op: file}`` for every op a read on ``device_name`` finds a file for (own files, then the alias chain's
    files for ops without an own file), sorted by op."""
    found: dict[str, Path] = {}
    for folder in _folders(device_name, root):
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            if path.name != ALIAS_FILE and path.is_file():
                found.setdefault(path.stem, path)
    return dict(sorted(found.items()))


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


@functools.cache
def _load(path: str) -> dict[str, dict[int, dict[str, Any]]] | None:
    p = Path(path)
    if not p.is_file():
        return None
    raw = _json_object(p, "an object keyed by shape", "; re-run `loraplex tune` or delete it")
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for skey, by_m in raw.items():
        if not isinstance(by_m, dict):
            raise TuningConfigError(f"{p}: entry {skey!r} must map M -> config, got {type(by_m).__name__}")
        try:
            table[skey] = {int(m): dict(cfg) for m, cfg in by_m.items()}
        except (TypeError, ValueError):
            raise TuningConfigError(f"{p}: entry {skey!r} has a non-integer M key or a non-object config") from None
    return table


def nearest_m(available: list[int] | set[int] | dict, m: int) -> int:
    """The available M closest to ``m``; ties go to the smaller."""
    if not available:
        raise ValueError("no M entries to choose from")
    return min(available, key=lambda k: (abs(k - m), k))


def tuned_ms(device_name: str | None = None, root: str | os.PathLike | None = None) -> set[int]:
    """Every token count M some tuning file a read on the device uses has an entry for (all ops and shapes, the
    files of :func:`device_files`): each is the middle of a range of M that shares one tuned config (the engine's
    eager warm-up runs one step per range)."""
    ms: set[int] = set()
    for path in device_files(device_name, root).values():
        table = _load(str(path))
        for by_m in (table or {}).values():
            ms.update(by_m)
    return ms


def get_config(op: str, shape: Mapping[str, int], m: int, default: Mapping[str, Any], *,
               device_name: str | None = None) -> dict[str, Any]:
    """The tuned config of ``op`` at ``shape`` nearest to ``m`` tokens, else a copy of ``default``.

    Keys missing from a tuned entry are taken from ``default`` so older files keep working. Lookups are memoised
    (every layer of an eager step asks again: a path, a shape key and a nearest-M search per call would cost
    ~40 us of host time each); ``clear_cache`` or ``write_configs`` forget them.
    """
    name = device_name if device_name is not None else current_device_name()
    root = os.environ.get(TUNING_DIR_ENV) or _REPO_TUNING_DIR_STR
    entry = _tuned_entry(op, tuple(shape.items()), int(m), name, root)
    return {**default, **entry} if entry is not None else dict(default)


@functools.lru_cache(maxsize=4096)
def _tuned_entry(op: str, shape: tuple[tuple[str, Any], ...], m: int, device_name: str,
                 root: str) -> dict[str, Any] | None:
    """The tuned entry for one lookup (never mutated by callers: ``get_config`` copies), or None. The file is
    resolved here (:func:`read_path`), so the alias chain is walked once per memoised lookup, not per call."""
    path = read_path(op, device_name, root)
    table = _load(str(path)) if path is not None else None
    if table is None:
        own = config_path(op, device_name, root)
        aliased = [str(f / own.name) for f in _folders(device_name, root)[1:]]
        also = f" (nor {', '.join(aliased)} through {ALIAS_FILE})" if aliased else ""
        _warn_once(f"no tuning file {own}{also}; using default {op} configs (run `loraplex tune` on this GPU)")
        _UNTUNED.setdefault(f"{op} (no tuning file for {device_name})")
        return None
    skey = shape_key(dict(shape))
    by_m = table.get(skey)
    if not by_m:
        _warn_once(f"{path} has no entry for shape {skey}; using default {op} configs")
        _UNTUNED.setdefault(f"{op} {skey}")
        return None
    return by_m[nearest_m(by_m, m)]


def plan_cache(make: Callable[..., T]) -> Callable[..., T]:
    """``make(cfg, **shape)`` remembered per (config items, shape items): what a launcher works out from its config
    and a call's static dims (grids, constexprs, launch options) is the same in every layer of a step, and working it
    out again costs more host time than the launch. What it returns is shared: read it only. A config holding an
    unhashable value is worked out afresh. ``.cache_clear()`` forgets."""

    @functools.lru_cache(maxsize=1024)
    def remembered(cfg_items: tuple, shape_items: tuple) -> T:
        return make(dict(cfg_items), **dict(shape_items))

    @functools.wraps(make)
    def plan(cfg: Mapping[str, Any], **shape) -> T:
        try:
            return remembered(tuple(cfg.items()), tuple(shape.items()))
        except TypeError:  # an unhashable value
            return make(dict(cfg), **shape)

    plan.cache_clear = remembered.cache_clear
    return plan


def write_configs(op: str, configs: Mapping[str, Mapping[int, Mapping[str, Any]]], *,
                  device_name: str | None = None, root: str | os.PathLike | None = None) -> Path:
    """Merge ``{shape key: {M: config}}`` into the op's file in the device's own folder (other shapes and M kept)
    and return its path. Without an own file yet, the merge starts from the file a read uses through
    ``same_as.json`` (the aliased file itself is left as it is): tuning a few M on a device that read another's
    configs keeps that device's other entries, and the new own file wins over the alias for this op."""
    path = config_path(op, device_name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    merged: dict[str, dict[str, Any]] = {}
    source = path if path.is_file() else read_path(op, device_name, root)
    if source is not None:
        merged = json.loads(source.read_text(encoding="utf-8"))
    for skey, by_m in configs.items():
        entry = merged.setdefault(skey, {})
        for m, cfg in by_m.items():
            entry[str(int(m))] = dict(cfg)
        merged[skey] = dict(sorted(entry.items(), key=lambda kv: int(kv[0])))
    path.write_text(json.dumps(merged, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    _load.cache_clear()
    _chain.cache_clear()
    _tuned_entry.cache_clear()
    _UNTUNED.clear()  # lookups are made afresh: what still falls back is listed again
    return path


def untuned() -> list[str]:
    """The lookups of this process that ran on the built-in defaults since the last ``clear_cache`` or
    ``write_configs``: "<op> <shape
    key>" where the device's file has no entry for the shape, "<op> (no tuning file for <device>)" where it has no
    file; in the order first seen. What ``loraplex bench serve`` reports, so that a shape the model needs and the
    committed files miss shows in the run's report, not only in its log."""
    return list(_UNTUNED)


def clear_cache() -> None:
    """Forget loaded files, resolved aliases, issued warnings and ``untuned`` (tests, or after writing new files)."""
    _load.cache_clear()
    _chain.cache_clear()
    _tuned_entry.cache_clear()
    _warn_once.cache_clear()
    _UNTUNED.clear()
