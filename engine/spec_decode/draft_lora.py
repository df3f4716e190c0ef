"""Per-adapter draft LoRAs: a LoRA of the draft model registered as the draft of one target adapter, applied by the
draft model to that adapter's rows only (the engine's own multi-LoRA machinery, ``engine/lora/slots.py``).

    DraftAdapters(slots, model_config, max_rank=16, dtype=torch.float32)
    register("t/a/1", "/adapters/t/a/1")     # the folder itself, or a folder holding a ``draft/`` subfolder:
                                             #   <adapter>/adapter_config.json, adapter_model.safetensors  (target)
                                             #   <adapter>/draft/adapter_config.json, adapter_model.safetensors
    slot_of(ref)                             # resident slot of ref's draft LoRA, -1: none (the bare draft)
    unregister("t/a/1")

    DraftAdapters(..., discover=True)        # draft LoRAs uploaded beside file:// adapters, found by themselves:
    discover(ref); poll()                    # per propose step: the first sight of an adapter starts a background
                                             # look for <its folder>/draft/ and a load; poll() installs what is read

Discovery reads ``draft/`` beside the folder a ``file://`` adapter URI names (other schemes: not looked for), once
per adapter id: found, it is loaded (weights read off the step thread, copied to the device on it) and used from the
next step; not there or not valid, the adapter keeps the bare draft (a bad folder is logged once) until
``register`` or ``forget`` says otherwise. Until a discovered draft LoRA is installed the adapter's rows use the
bare draft.

Every registered draft LoRA stays resident on the draft's device (they are small: a LoRA of the small model); one
propose step mixes rows of any number of them and bare rows. A draft LoRA is checked against the draft model's
config like any adapter (``load_adapter_weights``: PEFT format, shapes, rank <= ``max_rank``, finite weights).
Registering or replacing one while its adapter's sequences run changes only the drafts proposed from then on (the
K/V those sequences' drafts already hold stays as computed): acceptance may differ, output never does.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote, urlparse

import torch

from loraplex.engine.config import ModelConfig
from loraplex.engine.lora.weights import load_adapter_weights

logger = logging.getLogger(__name__)

DRAFT_SUBFOLDER = "draft"
CONFIG_FILE = "adapter_config.json"


def resolve_draft_folder(path: str | os.PathLike) -> str:
    """The draft LoRA folder ``path`` names: ``path/draft`` when it holds an adapter_config.json (a draft uploaded
    beside the tenant's adapter), else ``path`` itself."""
    path = os.fspath(path)
    sub = os.path.join(path, DRAFT_SUBFOLDER)
    return sub if os.path.isfile(os.path.join(sub, CONFIG_FILE)) else path


class DraftAdapters:
    """adapter_id -> the resident slot of its draft LoRA in the draft model's ``LoRASlots`` (module docstring)."""

    def __init__(self, slots: Any, model_config: ModelConfig, *, max_rank: int, dtype: torch.dtype,
                 discover: bool = False) -> None:
        self.slots = slots
        self.model_config = model_config
        self.max_rank, self.dtype = max_rank, dtype
        self.discovering = discover
        self._slot: dict[str, int] = {}
        self._folder: dict[str, str] = {}
        self._looked: set[str] = set()                       # adapter ids discovery has started for
        self._loading: dict[str, tuple[str, Future]] = {}    # adapter id -> (folder, weights being read)
        self._pool: ThreadPoolExecutor | None = None
        self.errors: dict[str, str] = {}                     # adapter id -> why its discovered draft LoRA failed

    def register(self, adapter_id: str, path: str | os.PathLike) -> int:
        """Load the draft LoRA at ``path`` (``resolve_draft_folder``) as the draft of ``adapter_id``, replacing any
        earlier one; returns its slot. AdapterFormatError (nothing changed) when the folder does not hold a LoRA
        of the draft model."""
        if not isinstance(adapter_id, str) or not adapter_id:
            raise ValueError("a draft LoRA needs the adapter_id of the target adapter it drafts for")
        folder = resolve_draft_folder(path)
        slot = self._install(adapter_id, folder, self._read(adapter_id, folder))
        self._looked.add(adapter_id)
        self._loading.pop(adapter_id, None)
        self.errors.pop(adapter_id, None)
        return slot

    def _read(self, adapter_id: str, folder: str):
        return load_adapter_weights(folder, self.model_config, max_rank=self.max_rank, dtype=self.dtype,
                                    adapter_id=f"draft:{adapter_id}")

    def _install(self, adapter_id: str, folder: str, weights) -> int:
        slot = self._slot.get(adapter_id)
        if slot is None:
            used = set(self._slot.values())
            slot = next(i for i in range(len(used) + 1) if i not in used)
        handle = self.slots.load(slot, weights)
        while not handle.done():  # a side-stream copy of a small adapter, at registration only
            torch.cuda.synchronize(self.slots.device)
        self._slot[adapter_id], self._folder[adapter_id] = slot, folder
        logger.info("draft LoRA for adapter %s: rank %d, %d modules, slot %d", adapter_id, weights.rank,
                    len(weights.modules), slot)
        return slot

    def unregister(self, adapter_id: str) -> bool:
        """Drop ``adapter_id``'s draft LoRA (its requests then use the bare draft); False when it had none."""
        self._loading.pop(adapter_id, None)
        slot = self._slot.pop(adapter_id, None)
        if slot is None:
            return False
        self._folder.pop(adapter_id, None)
        self.slots.clear(slot)
        return True

    # ---- discovery -----------------------------------------------------------------------------------------
    def discover(self, adapter: Any) -> None:
        """With ``discover`` on: start looking for the draft LoRA beside ``adapter``'s folder (once per adapter id)."""
        adapter_id = getattr(adapter, "adapter_id", None)
        if not self.discovering or adapter_id is None or adapter_id in self._looked or adapter_id in self._slot:
            return
        self._looked.add(adapter_id)
        parsed = urlparse(getattr(adapter, "uri", ""))
        if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
            return
        folder = os.path.join(unquote(parsed.path), DRAFT_SUBFOLDER)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-draft-lora")
        self._loading[adapter_id] = (folder, self._pool.submit(self._read_if_there, adapter_id, folder))

    def _read_if_there(self, adapter_id: str, folder: str):
        return self._read(adapter_id, folder) if os.path.isfile(os.path.join(folder, CONFIG_FILE)) else None

    def poll(self) -> int:
        """Install the discovered draft LoRAs whose weights have been read (step thread); returns how many."""
        done = [(a, f, fut) for a, (f, fut) in self._loading.items() if fut.done()]
        installed = 0
        for adapter_id, folder, fut in done:
            del self._loading[adapter_id]
            try:
                weights = fut.result()
                if weights is None:
                    continue  # no draft/ beside the adapter
                self._install(adapter_id, folder, weights)
                installed += 1
            except (ValueError, OSError, RuntimeError) as e:  # a bad upload: the adapter keeps the bare draft
                self.errors[adapter_id] = str(e)
                logger.warning("draft LoRA beside adapter %s not used: %s", adapter_id, e)
        return installed

    def wait(self) -> None:
        """Block until every discovery started so far has been read (tests, start-up)."""
        for _, fut in list(self._loading.values()):
            fut.exception()

    def forget(self, adapter_id: str) -> None:
        """Look again for ``adapter_id``'s draft LoRA the next time a request uses it."""
        self._looked.discard(adapter_id)
        self.errors.pop(adapter_id, None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def slot_of(self, adapter: Any) -> int:
        """The slot of the draft LoRA of ``adapter`` (an AdapterRef or None), -1 for the bare draft."""
        adapter_id = getattr(adapter, "adapter_id", None)
        return self._slot.get(adapter_id, -1) if adapter_id is not None else -1

    def folders(self) -> dict[str, str]:
        """adapter_id -> the folder its draft LoRA was read from."""
        return dict(self._folder)

    def __len__(self) -> int:
        return len(self._slot)
