"""The public multi-token decode entries of the Triton package, GDN's and KDA's: the input checks
(`hybridlm.ops.decode`), the impl from `hybridlm.ops.dispatch`'s table (its decode backends), then the decode
kernel's custom op (`gdn.gdn_decode`, `kda.kda_decode`) or the PyTorch path (`hybridlm.ops.decode.decode_torch`).

- `fused_recurrent_gated_delta_rule_update(q, k, v, g=, beta=, state_pool=, state_indices=, ...)`: T decode
  tokens (1..8) for N sequences, each reading `state_pool[state_indices[n]]` and writing back the state after its
  last (or accepted) token, or every token's state to a buffer (`hybridlm.ops.decode`); returns o.
- `fused_recurrent_kda_update(...)`: the same with g [N, T, HV, K], one log-decay per key channel.

Non-standard: they live apart from `gdn.py` / `kda.py` because they ask the dispatch for their impl, and the
dispatch reaches those modules itself (the Gluon KDA forward runs KDA's Triton prep): kept here, the imports run
one way.
"""

from __future__ import annotations

import torch

from .. import decode as dec
from .. import dispatch
from . import gdn
from .custom import call


def decode_call(op: str, q, k, v, g, beta, state_pool, state_indices, scale, use_qk_l2norm, intermediate_states,
                num_accepted, impl: str, *, channel: bool) -> torch.Tensor:
    """The public decode entries' body: checks (`hybridlm.ops.decode`), the impl (`hybridlm.ops.dispatch`'s decode
    backends), then the custom op `op` (the kernel) or `decode.decode_torch`."""
    dims = dec.check_decode_inputs(q, k, v, g, beta, state_pool, state_indices, channel=channel,
                                   max_dim=gdn.MAX_HEAD_DIM, intermediate_states=intermediate_states,
                                   num_accepted=num_accepted)
    scale = dims.K**-0.5 if scale is None else float(scale)
    if dispatch.resolve_impl(op, impl, q.device, q, v, needs_grad=False) == "torch":
        xs = [x.unsqueeze(1) if dims.one else x for x in (q, k, v, g, beta)]
        o = dec.decode_torch(*xs, state_pool, state_indices, scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
                             intermediate_states=intermediate_states, num_accepted=num_accepted)
        return o[:, 0] if dims.one else o
    gdn._check_device(q)
    return call(op, q, k, v, g, beta, state_pool, state_indices.contiguous(), scale, bool(use_qk_l2norm),
                intermediate_states, None if num_accepted is None else num_accepted.contiguous())


def fused_recurrent_gated_delta_rule_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, state_indices: torch.Tensor, scale: float | None = None, use_qk_l2norm: bool = False,
    intermediate_states: torch.Tensor | None = None, num_accepted: torch.Tensor | None = None, impl: str = "auto",
) -> torch.Tensor:
    """Decode T tokens (1..8: one step, or speculative draft tokens) for N sequences on a state pool.

    q, k: [N, T, H, K] (or [N, H, K], one token each: then every input and o drop the T axis); v: [N, T, HV, V];
    g, beta: [N, T, HV]; state_pool: [P, HV, K, V] float32 contiguous, read at rows state_indices (int32/int64 [N],
    distinct, valid). What is written (`hybridlm.ops.decode`): intermediate_states (float32 [N, T, HV, K, V]) gets
    the state after every token and leaves the pool as it was, unless num_accepted (int [N], 0..T) is given: then
    pool row n gets the state after token num_accepted[n] - 1 (0: unchanged); with neither, the state after the
    last token. impl: "auto" (the kernel on CUDA or under TRITON_INTERPRET=1, else PyTorch; logged once), "triton"
    or "torch". Returns o [N, T, HV, V] in q's dtype. Not differentiable."""
    return decode_call("gdn_decode", q, k, v, g, beta, state_pool, state_indices, scale, use_qk_l2norm,
                       intermediate_states, num_accepted, impl, channel=False)


def fused_recurrent_kda_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, state_indices: torch.Tensor, scale: float | None = None, use_qk_l2norm: bool = False,
    intermediate_states: torch.Tensor | None = None, num_accepted: torch.Tensor | None = None, impl: str = "auto",
) -> torch.Tensor:
    """KDA decode of T tokens (1..8) for N sequences on a state pool: as
    `fused_recurrent_gated_delta_rule_update` with g float32 [N, T, HV, K] (or [N, HV, K] with 3-d inputs),
    one log-decay per key channel. Returns o [N, T, HV, V] (or [N, HV, V])."""
    return decode_call("kda_decode", q, k, v, g, beta, state_pool, state_indices, scale, use_qk_l2norm,
                       intermediate_states, num_accepted, impl, channel=True)


__all__ = ["fused_recurrent_gated_delta_rule_update", "fused_recurrent_kda_update", "decode_call"]
