"""fla's side of the training benchmark (`hybridlm bench train`): its GatedDeltaNetForCausalLM at the benchmark's
shape, its loss, and the stand-ins its Attention needs where flash_attn is not installed.

Non-standard here: fla is imported only inside these functions, and only when asked for. fla 0.6.0 refuses its gated
chunk backward on Hopper with Triton < 3.7.1 (its issue #640); `patch_fla` lifts that guard and says so. Without
flash_attn, `flash_attn_func` becomes a stand-in on torch SDPA and `flash_attn_varlen_func` one on torch's
`varlen_attn` (the FlashAttention kernel our attention calls for packed documents).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridlm.layers.attention import varlen_available, varlen_causal
from hybridlm.train.data import IGNORE

GUARD_NOTE = ("fla 0.6.0's guard against its gated chunk backward on Hopper with Triton < 3.7.1 (fla #640) was "
              "lifted for this run: fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True")


def fla_config_kwargs(shape, seq_len: int) -> dict:
    """Keyword arguments of fla 0.6.0's GatedDeltaNetConfig for `shape` (the benchmark's `train.Shape`; plain data:
    testable without fla)."""
    if shape.hidden_size != shape.attn_heads * shape.attn_head_dim:
        raise ValueError(f"fla's Attention has head_dim = hidden_size // num_heads; the shape has hidden_size "
                         f"{shape.hidden_size} but {shape.attn_heads} x {shape.attn_head_dim} attention channels")
    return dict(
        attn_mode="chunk", hidden_size=shape.hidden_size, expand_v=1.0, use_gate=True, use_short_conv=True,
        conv_size=shape.conv_size, head_dim=shape.linear_head_dim, num_heads=shape.linear_heads,
        num_v_heads=shape.linear_value_heads, max_position_embeddings=seq_len, hidden_ratio=4,
        intermediate_size=shape.intermediate_size, hidden_act="swish", num_hidden_layers=shape.num_layers,
        norm_eps=1e-6, vocab_size=shape.vocab_size, tie_word_embeddings=shape.tie_embeddings, use_cache=False,
        attn={"layers": shape.attention_layers, "num_heads": shape.attn_heads, "num_kv_heads": shape.attn_kv_heads,
              "qkv_bias": False, "window_size": None, "rope_theta": shape.rope_theta},
    )


def sdpa_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                         softmax_scale: float | None = None, causal: bool = False,
                         window_size: tuple[int, int] = (-1, -1), **_ignored) -> torch.Tensor:
    """Stand-in for flash_attn_func on torch SDPA: q [B, T, H, d], k / v [B, S, Hkv, d] -> [B, T, H, d].

    Only what fla's Attention asks for in training: no dropout, no sliding window."""
    if dropout_p or tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"the SDPA stand-in for flash_attn_func takes no dropout ({dropout_p}) and no "
                                  f"window ({window_size})")
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                       scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def varlen_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), **_ignored) -> torch.Tensor:
    """Stand-in for flash_attn_varlen_func on torch's varlen_attn: q [N, H, d], k / v [N, Hkv, d] with documents
    at cu_seqlens [D+1] (int32) -> [N, H, d]. max_seqlen_* bound the document lengths (fla passes the row length).

    Only what fla's Attention asks for in training: no dropout, no sliding window; causal and GQA as
    `hybridlm.layers.attention.varlen_causal`."""
    if dropout_p or tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"the varlen_attn stand-in for flash_attn_varlen_func takes no dropout "
                                  f"({dropout_p}) and no window ({window_size})")
    return varlen_causal(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                         causal=causal)


def _no_varlen(*_args, **_kwargs):
    raise NotImplementedError("flash_attn is not installed and this torch has no torch.nn.attention.varlen "
                              "(torch < 2.10) to stand in for flash_attn_varlen_func")


def load_fla(device: torch.device, no_fla: bool) -> tuple[str | None, list[str], str | None]:
    """Import fla for the comparison -> (version, notes for the table, reason it is skipped or None)."""
    if no_fla:
        return None, [], "--no-fla"
    if device.type != "cuda":
        return None, [], f"fla's kernels need CUDA (device {device})"
    try:
        from importlib.metadata import version

        import fla

        notes = patch_fla()
    except Exception as e:  # noqa: BLE001  (any import failure only skips the fla row)
        return None, [], f"fla does not import: {e!r}"
    try:
        ver = version("fla-core")
    except Exception:  # noqa: BLE001
        ver = getattr(fla, "__version__", "unknown")
    return ver, notes, None


def patch_fla() -> list[str]:
    """Lift fla 0.6.0's Hopper guard and, without flash_attn, give its Attention the SDPA stand-in; -> notes."""
    import fla.layers.attn as fla_attn
    import fla.ops.common.chunk_o as fla_chunk_o

    notes = []
    if hasattr(fla_chunk_o, "TRITON_ABOVE_3_7_1"):
        fla_chunk_o.TRITON_ABOVE_3_7_1 = True
        notes.append(GUARD_NOTE)
    if getattr(fla_attn, "flash_attn_func", None) is None:
        fla_attn.flash_attn_func = sdpa_flash_attn_func
        varlen = varlen_available()
        fla_attn.flash_attn_varlen_func = varlen_flash_attn_func if varlen else _no_varlen
        notes.append("flash_attn is not installed: fla's Attention ran on a stand-in for flash_attn_func built on "
                     "torch SDPA (is_causal, enable_gqa), the same SDPA call as ours" +
                     (", and for packed documents on one for flash_attn_varlen_func built on torch's varlen_attn "
                      "(window (-1, 0), enable_gqa; fla passes the packed row's length as max_seqlen), the "
                      "FlashAttention kernel ours calls" if varlen else ""))
    return notes


def fla_packed_skip() -> str | None:
    """Why fla's model cannot take packed documents here (None: it can). Call after `patch_fla`."""
    import fla.layers.attn as fla_attn

    if getattr(fla_attn, "flash_attn_varlen_func", None) is _no_varlen:
        return ("not run here: fla's Attention needs flash_attn_varlen_func for cu_seqlens; flash_attn is not "
                "installed and this torch has no varlen_attn (torch >= 2.10) to stand in for it")
    return None


def build_fla(shape, seq_len: int, device: torch.device):
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    cfg = GatedDeltaNetConfig(**fla_config_kwargs(shape, seq_len))
    with torch.device(device):
        model = GatedDeltaNetForCausalLM(cfg)
    return model, cfg.to_dict(), fla_loss


def fla_labels(targets: torch.Tensor) -> torch.Tensor:
    """targets [B, T] -> the `labels` fla's CausalLM takes: it drops labels[:, 0] and predicts labels[:, t + 1] at t,
    with no target at t = T - 1, so targets[:, :-1] shifted right by one (targets[:, -1] must be ignored)."""
    return torch.cat((torch.full_like(targets[:, :1], IGNORE), targets[:, :-1]), 1)


def fla_loss(model, ids: torch.Tensor, targets: torch.Tensor, cu_seqlens: torch.Tensor | None,
             n_targets: int) -> torch.Tensor:
    """Mean token loss of fla's GatedDeltaNetForCausalLM through its own `labels` path (its config's loss)."""
    extra = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    return model(input_ids=ids, labels=fla_labels(targets), use_cache=False, **extra).loss


def loss_name(model: str, config: dict | None) -> str:
    """Which loss a row's model trained with (for the table)."""
    if model == "ours":
        return "fused linear + CE (chunked, no logits)"
    if config and config.get("fuse_linear_cross_entropy"):
        return "fla FusedLinearCrossEntropyLoss"
    if config and config.get("fuse_cross_entropy"):
        return "fla FusedCrossEntropyLoss on bf16 logits"
    return "nn.CrossEntropyLoss on logits"
