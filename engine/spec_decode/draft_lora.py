"""Per-adapter draft LoRAs: a LoRA of the draft model registered as the draft of one target adapter, applied by the
draft model to that adapter's rows only (the engine's own multi-LoRA machinery, ``engine/lora/slots.py``).

    DraftAdapters(slots, model_config, max_rank=16, dtype=torch.float32)
    register("t/a/1", "/adapters/t/a/1")     # the folder itself, or a folder holding a ``draft/`` subfolder:
                                             #   <adapter>/adapter_config.json, adapter_model.safetensors  (target)
                                             #   <adapter>/draft/adapter_config.json, adapter_model.safetensors
    slot_of(ref)                             # resident slot of ref's draft LoRA, -1: none (the bare draft)
    unregister("t/a/1")

Every registered draft LoRA stays resident on the draft's device (they are small: a LoRA of the small model); one
propose step mixes rows of any number of them and bare rows. A draft LoRA is checked against the draft model's
config like any adapter (``load_adapter_weights``: PEFT format, shapes, rank <= ``max_rank``, finite weights).
Registering or replacing one while its adapter's sequences run changes only the drafts proposed from then on (the
K/V those sequences' drafts already hold stays as computed): acceptance may differ, output never does.
"""
from __future__ import annotations

import logging
import os
from typing import Any

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

    def __init__(self, slots: Any, model_config: ModelConfig, *, max_rank: int, dtype: torch.dtype) -> None:
        self.slots = slots
        self.model_config = model_config
        self.max_rank, self.dtype = max_rank, dtype
        self._slot: dict[str, int] = {}
        self._folder: dict[str, str] = {}

    def register(self, adapter_id: str, path: str | os.PathLike) -> int:
        """Load the draft LoRA at ``path`` (``resolve_draft_folder``) as the draft of ``adapter_id``, replacing any
        earlier one; returns its slot. AdapterFormatError (nothing changed) when the folder does not hold a LoRA
        of the draft model."""
        if not isinstance(adapter_id, str) or not adapter_id:
            raise ValueError("a draft LoRA needs the adapter_id of the target adapter it drafts for")
        folder = resolve_draft_folder(path)
        weights = load_adapter_weights(folder, self.model_config, max_rank=self.max_rank, dtype=self.dtype,
                                       adapter_id=f"draft:{adapter_id}")
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
        slot = self._slot.pop(adapter_id, None)
        if slot is None:
            return False
        self._folder.pop(adapter_id, None)
        self.slots.clear(slot)
        return True

    def slot_of(self, adapter: Any) -> int:
        """The slot of the draft LoRA of ``adapter`` (an AdapterRef or None), -1 for the bare draft."""
        adapter_id = getattr(adapter, "adapter_id", None)
        return self._slot.get(adapter_id, -1) if adapter_id is not None else -1

    def folders(self) -> dict[str, str]:
        """adapter_id -> the folder its draft LoRA was read from."""
        return dict(self._folder)

    def __len__(self) -> int:
        return len(self._slot)
