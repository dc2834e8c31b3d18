"""`generate`: autoregressive decoding with the hybrid cache (greedy or sampling), like transformers' generate.

Non-standard here:
- The prompt is prefilled in one forward (chunked linear recurrences with a state out), then every new token is
  one cached step (the recurrent form for linear layers, K/V or latent append for attention).
- Left padding: positions are cumsum(mask) - 1 (pads at 0), as transformers computes them in generate, and the
  linear layers zero the padded inputs so their state is untouched.
- Finished rows (after an eos token) receive pad_token_id until every row is done, as transformers does.
- eos_token_id=None means the config's eos (as transformers' generation config does); pass [] to never stop.
- `seed` makes sampling reproducible without touching the global RNG (a private torch.Generator).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _check(input_ids, max_new_tokens, do_sample, temperature, top_p, top_k, max_len) -> None:
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected a non-empty prompt [B, T], got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected >= 0, got {max_new_tokens}")
    if input_ids.shape[1] + max_new_tokens > max_len:
        raise ValueError(f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"max_position_embeddings {max_len}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature: expected > 0 when sampling, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a value in (0, 1], got {top_p}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k: expected >= 1, got {top_k}")


def _filter(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """logits [B, V] (float32) with everything outside top-k / the top-p nucleus set to -inf."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token is always kept)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, max_new_tokens: int = 20,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None, seed: int | None = None,
             streamer: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """input_ids: [B, T] (left-padded when ragged); attention_mask: [B, T]. Returns [B, T + n] (n <= max_new_tokens):
    the prompt followed by the new tokens. streamer(tokens [B]) is called with each new column."""
    cfg = model.config
    _check(input_ids, max_new_tokens, do_sample, temperature, top_p, top_k, cfg.max_position_embeddings)
    B, T = input_ids.shape
    device = input_ids.device
    if eos_token_id is None:  # like transformers: the model's eos unless told otherwise ([] disables stopping)
        eos_token_id = cfg.eos_token_id
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    if pad_token_id is None:
        pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    mask = torch.ones(B, T, dtype=torch.long, device=device) if attention_mask is None else attention_mask.long()
    gen = None
    if do_sample:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed if seed is not None else torch.seed())
    cache = model.new_cache()
    tokens = input_ids
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    step_ids = input_ids
    for _ in range(max_new_tokens):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        logits = model(step_ids, attention_mask=mask, position_ids=pos, cache=cache).logits[:, -1].float()
        if do_sample:
            probs = _filter(logits / temperature, top_k, top_p).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad_token_id))
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=device)], dim=1)
        if streamer is not None:
            streamer(nxt)
        if eos:
            unfinished &= ~torch.isin(nxt, torch.tensor(eos, device=device))
            if not bool(unfinished.any()):
                break
        step_ids = nxt[:, None]
    return tokens
