"""An EAGLE-style draft head: predicts the target's next final hidden state from its current one and the next token,
so the target's own ``lm_head`` turns it into a draft token (Li et al., 2024, "EAGLE"; here without the head's
attention layer: one fused projection and a gated MLP, no KV cache of its own).

    # H hidden (the target's), I the head's MLP width
    f_t  [B, H]   the target's final hidden state at position t (after its last norm: the lm_head input)
    x    [B]      the token at position t + 1
    f'   = out_norm(h + down(silu(g) * u)),  (g, u) = gate_up(mlp_norm(h)),  h = fc([e_norm(embed(x)); f_norm(f_t)])
    logits of position t + 2 = lm_head(f')

Drafting k tokens feeds f' back as the next step's f. A head folder holds ``config.json``
(``{"draft_head": "eagle_mlp", "hidden_size": H, "intermediate_size": I, "rms_norm_eps": eps}``) and
``model.safetensors`` (this module's state dict); ``save_eagle_head`` writes one, ``load_eagle_head`` reads it.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

HEAD_KIND = "eagle_mlp"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class EagleHeadConfig:
    hidden_size: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"draft head {name} must be a positive integer, got {value!r}")


class EagleHead(nn.Module):
    """f_t [B, H], next-token embeddings [B, H] -> predicted f_{t+1} [B, H] (module docstring)."""

    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        H, I, eps = config.hidden_size, config.intermediate_size, config.rms_norm_eps
        self.config = config
        self.e_norm, self.f_norm = nn.RMSNorm(H, eps=eps), nn.RMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.mlp_norm = nn.RMSNorm(H, eps=eps)
        self.gate_up = nn.Linear(H, 2 * I, bias=False)
        self.down = nn.Linear(I, H, bias=False)
        self.out_norm = nn.RMSNorm(H, eps=eps)

    def forward(self, feature: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        h = self.fc(torch.cat([self.e_norm(embedding), self.f_norm(feature)], dim=-1))
        g, u = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        return self.out_norm(h + self.down(F.silu(g) * u))


def save_eagle_head(head: EagleHead, folder: str | os.PathLike) -> str:
    """Write ``head`` as a head folder (module docstring); returns the folder."""
    from safetensors.torch import save_file

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump({"draft_head": HEAD_KIND, **asdict(head.config)}, f, indent=1)
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()},
              os.path.join(folder, WEIGHTS_FILE))
    return folder


def load_eagle_head(folder: str | os.PathLike, *, hidden_size: int, device: torch.device,
                    dtype: torch.dtype) -> EagleHead:
    """Read a head folder for a target of ``hidden_size``; ValueError saying what is wrong otherwise."""
    from safetensors.torch import load_file

    folder = os.fspath(folder)
    cfg_path, st_path = os.path.join(folder, CONFIG_FILE), os.path.join(folder, WEIGHTS_FILE)
    for path in (cfg_path, st_path):
        if not os.path.isfile(path):
            raise ValueError(f"draft head folder {folder!r} has no {os.path.basename(path)}; a head folder holds "
                             f"{CONFIG_FILE} and {WEIGHTS_FILE} (eagle_head.py)")
    with open(cfg_path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict) or raw.get("draft_head") != HEAD_KIND:
        raise ValueError(f"{cfg_path}: expected \"draft_head\": \"{HEAD_KIND}\", got {raw.get('draft_head')!r}"
                         if isinstance(raw, dict) else f"{cfg_path}: expected a JSON object")
    try:
        config = EagleHeadConfig(**{k: v for k, v in raw.items() if k != "draft_head"})
    except TypeError as e:
        raise ValueError(f"{cfg_path}: {e}; keys: draft_head, hidden_size, intermediate_size, rms_norm_eps") from None
    if config.hidden_size != hidden_size:
        raise ValueError(f"draft head {folder!r} has hidden_size {config.hidden_size}, the target {hidden_size}: "
                         "a head is trained on one target's hidden states")
    head = EagleHead(config)
    state = load_file(st_path)
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes that do not fit the config
        raise ValueError(f"draft head {folder!r}: {e}") from None
    if missing or unexpected:
        raise ValueError(f"draft head {folder!r}: missing tensors {sorted(missing)}, unexpected {sorted(unexpected)}")
    bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if bad:
        raise ValueError(f"draft head {folder!r}: non-finite values in {bad}")
    return head.to(device=device, dtype=dtype).eval()
