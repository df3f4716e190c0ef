"""Linear and embedding modules with stable attribute names, so transforms (LoRA, TP) can wrap them by name."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ weight.T (+ bias). ``output_sizes`` lists the slices of a fused layer's output rows
    (e.g. [q, k, v] for ``qkv_proj`` or [gate, up] for ``gate_up_proj``); [out_features] when not fused.
    ``output_names`` names those slices as the HF checkpoint does (e.g. ["q_proj", "k_proj", "v_proj"]),
    so a LoRA transform can find where a PEFT target module lives."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 output_sizes: list[int] | None = None, output_names: list[str] | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.output_sizes = list(output_sizes) if output_sizes else [out_features]
        if sum(self.output_sizes) != out_features:
            raise ValueError(f"output_sizes {self.output_sizes} do not sum to out_features {out_features}")
        self.output_names = list(output_names) if output_names else []
        if self.output_names and len(self.output_names) != len(self.output_sizes):
            raise ValueError(f"output_names {self.output_names} do not match output_sizes {self.output_sizes}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}"


class Embedding(nn.Module):
    """Token embedding: ids [T] -> [T, H]."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)  # [V, H]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
