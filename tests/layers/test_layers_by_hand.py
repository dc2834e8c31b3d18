"""The PaTH, DeltaFormer and MesaNet layers against their definitions written out token by token in float64:
projections, short convs, gates, q/k norms, RoPE, the attention or the ridge-regression memory, output norms and
gates, output projection. The layer's output and the gradients of its input and of every parameter must agree
to 1e-12 (relative, per tensor): both sides are float64 throughout, so any wrong term is off by O(1).

The one rounding the references copy is the layers' float32 RoPE angle (hybridlm.layers.attention.Rotary keeps
its frequencies in float32 on purpose); everything after the angle is float64 here as there.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridlm.layers import DeltaFormerAttention, MesaNet, PaTHAttention

F64 = torch.float64
TOL = 1e-12


def _linear(x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    y = x @ lin.weight.T
    return y if lin.bias is None else y + lin.bias


def _causal_conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [B, T, C]; weight: [C, 1, W] with weight[:, 0, W-1] on the current token. silu(sum_s w[W-1-s] x_{t-s})."""
    W = weight.shape[-1]
    y = torch.zeros_like(x)
    for s in range(W):  # tap s reads the token s steps back
        y[:, s:] = y[:, s:] + weight[:, 0, W - 1 - s] * x[:, : x.shape[1] - s]
    return F.silu(y)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def _unit(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps): the ops' l2 norm (eps inside the root)."""
    return x / (x.pow(2).sum(-1, keepdim=True) + eps).sqrt()


def _heads_qk(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, nH, hd], k [B, T, nKV, hd]; qk_norm "head": zero-centred RMSNorm per head, x_hat * (1 + w)."""
    B, T, _ = x.shape
    q = (x @ m.q_proj.weight.T).reshape(B, T, m.nH, m.hd)
    k = (x @ m.k_proj.weight.T).reshape(B, T, m.nKV, m.hd)
    if m.qk_norm == "head":
        q = _rms(q, m.q_norm.eps) * (1 + m.q_norm.weight)
        k = _rms(k, m.k_norm.eps) * (1 + m.k_norm.weight)
    return q, k


def _softmax_read(logits: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """sum_j exp(l_j - max) v_j / sum_j exp(l_j - max), over the lists of scalar logits and value vectors."""
    top = max(lg.item() for lg in logits)
    weights = [torch.exp(lg - top) for lg in logits]
    return sum(w * v for w, v in zip(weights, values)) / sum(weights)


def _randomise(m: torch.nn.Module) -> None:
    """Every parameter away from its init (norm weights at 0 or 1, biases at 0 would hide a wrong term)."""
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.5 * torch.randn_like(p))


def _check(layer, reference, x: torch.Tensor, **kw) -> None:
    """Output, d(input) and d(every parameter) of layer(x, **kw) against reference(layer, x), float64."""
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got, want = layer(x1, **kw), reference(layer, x2)
    err = ((got - want).norm() / want.norm()).item()
    assert err <= TOL, f"output: relative error {err:.3e}"
    cot = torch.randn_like(want)
    params = [p for _, p in layer.named_parameters()]
    g_got = torch.autograd.grad((got * cot).sum(), [x1, *params])
    g_want = torch.autograd.grad((want * cot).sum(), [x2, *params], allow_unused=True, materialize_grads=True)
    names = ["x", *(n for n, _ in layer.named_parameters())]
    bad = {n: ((a - b).norm() / b.norm().clamp_min(1e-300)).item() for n, a, b in zip(names, g_got, g_want)}
    bad = {n: e for n, e in bad.items() if not e <= TOL}
    assert not bad, f"gradients off (relative error): {bad}"


# ------------------------------------------------------------------------------------------------------ PaTH


def _path_by_hand(m: PaTHAttention, x: torch.Tensor) -> torch.Tensor:
    """PaTH (Yang et al. 2025) with FoX's forget gate: w_t = l2norm(silu(conv(x W1 W2))) per kv head,
    beta_t = 2 sigmoid(x W_b + b_b), H_t = I - beta_t w_t w_t^T, g_t = logsigmoid(x W_g + b_g) per query head,
    logit(i, j) = hd^-1/2 q_i^T H_i ... H_{j+1} k_j + g_{j+1} + ... + g_i, o_i = softmax_j<=i . v_j, o W_o.
    Query head h reads kv head h // (nH / nKV)."""
    B, T, _ = x.shape
    nH, nKV, hd = m.nH, m.nKV, m.hd
    q, k = _heads_qk(m, x)
    v = (x @ m.v_proj.weight.T).reshape(B, T, nKV, hd)
    w_lin = x
    for lin in (m.w_proj if isinstance(m.w_proj, torch.nn.Sequential) else [m.w_proj]):
        w_lin = w_lin @ lin.weight.T
    w = _unit(_causal_conv_silu(w_lin, m.w_conv.weight).reshape(B, T, nKV, hd))
    beta = 2 * torch.sigmoid(_linear(x, m.bt_proj))
    g = F.logsigmoid(_linear(x, m.g_proj)) if m.g_proj is not None else x.new_zeros(B, T, nH)
    eye = torch.eye(hd, dtype=x.dtype)
    o = x.new_zeros(B, T, nH, hd)
    for b in range(B):
        for h in range(nH):
            kv = h // (nH // nKV)
            house = [eye - beta[b, t, kv] * torch.outer(w[b, t, kv], w[b, t, kv]) for t in range(T)]
            for i in range(T):
                P, logits, values = eye, [], []
                for j in range(i, -1, -1):  # P = H_i ... H_{j+1}
                    logits.append(hd**-0.5 * q[b, i, h] @ P @ k[b, j, kv] + g[b, j + 1 : i + 1, h].sum())
                    values.append(v[b, j, kv])
                    P = P @ house[j]
                o[b, i, h] = _softmax_read(logits, values)
    return o.reshape(B, T, nH * hd) @ m.o_proj.weight.T


@pytest.mark.parametrize("forget_gate,qk_norm,w_rank", [(True, "head", 32), (False, "none", 0)])
def test_path_layer_matches_the_formulas_fp64(forget_gate, qk_norm, w_rank):
    m = PaTHAttention(24, 4, 2, 8, forget_gate=forget_gate, qk_norm=qk_norm, w_rank=w_rank).double()
    _randomise(m)
    _check(m, _path_by_hand, torch.randn(2, 13, 24, dtype=F64), mask=None)


# ------------------------------------------------------------------------------------------------ DeltaFormer


def _rope(x: torch.Tensor, pos: torch.Tensor, rd: int, theta: float) -> torch.Tensor:
    """x: [B, T, h, hd]; pos: [B, T]. Rotates channel pairs (c, c + rd/2), c < rd/2, by pos * theta^(-2c/rd)
    (angle, cos and sin in float32, as the layer keeps them); channels from rd on pass through."""
    half = rd // 2
    c = torch.arange(half, dtype=torch.float32)
    angle = (pos[..., None].float() * (1.0 / theta ** (2 * c / rd)))[:, :, None]  # [B, T, 1, half]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:rd]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., rd:]], dim=-1)


def _deltaformer_by_hand(m: DeltaFormerAttention, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """DeltaFormer (Zhong et al. 2025) as the op defines it (the write reads with q_i, as fla): RoPE on q and k,
    beta_i = sigmoid(x W_b + b_b) per query head, s_ij = hd^-1/2 q_i.k_j,
    u_i = v_i - beta_i sum_{j<i} softmax_{j<i}(s_ij) u_j, o_i = sum_{j<=i} softmax_{j<=i}(s_ij) u_j, o W_o."""
    B, T, _ = x.shape
    nH, nKV, hd = m.nH, m.nKV, m.hd
    q, k = _heads_qk(m, x)
    if m.rotary is not None:
        q, k = (_rope(t, pos, m.rotary.rotary_dim, m.rotary.theta) for t in (q, k))
    v = (x @ m.v_proj.weight.T).reshape(B, T, nKV, hd)
    beta = torch.sigmoid(_linear(x, m.b_proj))
    o = x.new_zeros(B, T, nH, hd)
    for b in range(B):
        for h in range(nH):
            kv = h // (nH // nKV)
            u = []
            for i in range(T):
                s = [hd**-0.5 * q[b, i, h] @ k[b, j, kv] for j in range(i + 1)]
                u.append(v[b, i, kv] - beta[b, i, h] * _softmax_read(s[:i], u) if i else v[b, 0, kv])
                o[b, i, h] = _softmax_read(s, u)
    return o.reshape(B, T, nH * hd) @ m.o_proj.weight.T


@pytest.mark.parametrize("qk_norm,rotary_dim", [("head", 4), ("none", 8), ("head", 0)])
def test_deltaformer_layer_matches_the_formulas_fp64(qk_norm, rotary_dim):
    m = DeltaFormerAttention(24, 4, 2, 8, qk_norm=qk_norm, rotary_dim=rotary_dim, rope_theta=10.0).double()
    _randomise(m)
    B, T = 2, 13
    pos = torch.arange(3, 3 + T).expand(B, T)  # not from 0: the angle of every position shows
    _check(m, lambda layer, x: _deltaformer_by_hand(layer, x, pos), torch.randn(B, T, 24, dtype=F64), mask=None,
           position_ids=pos)


# ---------------------------------------------------------------------------------------------------- MesaNet


def _mesa_by_hand(m: MesaNet, x: torch.Tensor) -> torch.Tensor:
    """MesaNet (von Oswald et al. 2025) in fla's layout: q, k = silu(conv([x W_q, x W_k])) then l2-normalised per
    head, v = x W_v, g = logsigmoid(x W_a + b_a), beta = sigmoid(x W_b + b_b), lambda = softplus(p) + lower bound,
    H_t = e^{g_t} H_{t-1} + beta_t k_t k_t^T, G_t = e^{g_t} G_{t-1} + beta_t k_t v_t^T,
    o_t = G_t^T (H_t + diag(lambda))^{-1} q_t; RMSNorm per head (times silu(x W_g) with the output gate), o W_o."""
    B, T, _ = x.shape
    H, dk, dv = m.H, m.dk, m.dv
    qk = _causal_conv_silu(torch.cat([x @ m.q_proj.weight.T, x @ m.k_proj.weight.T], dim=-1), m.conv1d.weight)
    q, k = (_unit(t.reshape(B, T, H, dk)) for t in qk.split([H * dk, H * dk], dim=-1))
    v = (x @ m.v_proj.weight.T).reshape(B, T, H, dv)
    g = F.logsigmoid(_linear(x, m.a_proj))
    beta = torch.sigmoid(_linear(x, m.b_proj))
    lamb = (F.softplus(m.lambda_params) + m.lambda_lower_bound).reshape(H, dk)
    o = x.new_zeros(B, T, H, dv)
    for b in range(B):
        for h in range(H):
            Hs, Gs = x.new_zeros(dk, dk), x.new_zeros(dk, dv)
            for t in range(T):
                Hs = g[b, t, h].exp() * Hs + beta[b, t, h] * torch.outer(k[b, t, h], k[b, t, h])
                Gs = g[b, t, h].exp() * Gs + beta[b, t, h] * torch.outer(k[b, t, h], v[b, t, h])
                o[b, t, h] = Gs.T @ torch.linalg.solve(Hs + torch.diag(lamb[h]), q[b, t, h])
    o = _rms(o, m.o_norm.eps) * m.o_norm.weight
    if m.g_proj is not None:
        o = o * F.silu((x @ m.g_proj.weight.T).reshape(B, T, H, dv))
    return o.reshape(B, T, H * dv) @ m.o_proj.weight.T


@pytest.mark.parametrize("output_gate", [False, True], ids=["norm", "gated_norm"])
def test_mesa_net_layer_matches_the_formulas_fp64(output_gate):
    m = MesaNet(24, 2, 8, 6, output_gate=output_gate).double()
    _randomise(m)
    with torch.no_grad():
        m.lambda_params.normal_()  # lambda per channel, not one value
    _check(m, _mesa_by_hand, torch.randn(2, 13, 24, dtype=F64))
