"""The generation cache of a hybrid model: one entry per layer, by layer type.

Non-standard here:
- Linear layers (GDN / KDA) keep a fixed-size state: the conv state `[B, conv_dim, W]` (last W pre-conv inputs,
  model dtype) and the recurrent state `[B, HV, dk, dv]`, always float32 (float64 for float64 models): it does not
  grow with the context.
- Softmax attention keeps post-norm, post-RoPE K and V `[B, kv_heads, S, head_dim]`.
- MLA keeps the compressed, normed latent `[B, S, kv_lora_rank]` and the shared `k_rot` `[B, S, rope_dim]`, and
  re-expands them with kv_b_proj at every step (the memory saving of MLA).
- PaTH attention / DeltaFormer keep their layer's per-token inputs `[B, S, ...]` (`HistoryState`) and rerun the
  op over them at every step (hybridlm.layers.history): their old keys' contributions change with each new token.
- The cache counts the tokens it has seen; `HybridLM.forward(..., cache=...)` then expects the attention mask of
  the whole history ([B, past + T]), as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import HybridConfig


@dataclass
class LinearState:
    conv: torch.Tensor | None = None  # [B, conv_dim, W], model dtype
    recurrent: torch.Tensor | tuple | None = None  # [B, HV, dk, dv] float32; MesaNet: ([B, H, dk, dk], [B, H, dk, dv])


@dataclass
class KVState:
    k: torch.Tensor | None = None  # [B, kv_heads, S, head_dim]
    v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


@dataclass
class LatentState:
    latent: torch.Tensor | None = None  # [B, S, kv_lora_rank], after kv_a_layernorm
    k_rot: torch.Tensor | None = None  # [B, S, qk_rope_head_dim]

    def append(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.latent = latent if self.latent is None else torch.cat([self.latent, latent], dim=1)
        self.k_rot = k_rot if self.k_rot is None else torch.cat([self.k_rot, k_rot], dim=1)
        return self.latent, self.k_rot


@dataclass
class HistoryState:
    q: torch.Tensor | None = None  # [B, S, heads, head_dim], and so on: the parts a layer passes to `append`
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    w: torch.Tensor | None = None  # PaTH: Householder directions before the short conv
    beta: torch.Tensor | None = None
    g: torch.Tensor | None = None

    def append(self, **parts: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
        for name, t in parts.items():
            old = getattr(self, name)
            setattr(self, name, t if old is None or t is None else torch.cat([old, t], dim=1))
        return {name: getattr(self, name) for name in parts}


@dataclass
class HybridCache:
    layers: list = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def for_config(cls, config: HybridConfig) -> HybridCache:
        layers = []
        for t in config.layer_types:
            if t == "linear_attention":
                layers.append(LinearState())
            elif config.attention_kind == "mla":
                layers.append(LatentState())
            elif config.attention_kind in ("path", "deltaformer"):
                layers.append(HistoryState())
            else:
                layers.append(KVState())
        return cls(layers)

    def __getitem__(self, i: int):
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for st in self.layers:
            for t in vars(st).values():  # a tuple is MesaNet's (H, G) recurrent pair
                out += [x for x in (t if isinstance(t, tuple) else (t,)) if isinstance(x, torch.Tensor)]
        return out

    def nbytes(self) -> int:
        """Bytes held by every cache tensor (what `hybridlm memory` predicts)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())
