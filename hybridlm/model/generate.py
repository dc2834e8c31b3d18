"""`generate`: autoregressive decoding with the hybrid cache (greedy or sampling), like transformers' generate.

Non-standard here:
- The prompt is prefilled in one forward (chunked linear recurrences with a state out), then every new token is
  one cached step (the recurrent form for linear layers, K/V or latent append for attention).
- Left padding: positions are cumsum(mask) - 1 (pads at 0), as transformers computes them in generate, and the
  linear layers zero the padded inputs so their state is untouched.
- Finished rows (after an eos token) receive pad_token_id until every row is done, as transformers does.
- eos_token_id=None means the config's eos (as transformers' generation config does); pass [] to never stop.
- Sampling draws from a private torch.Generator (seeded by `seed`, or from the OS when None): the caller's global
  RNG is never read or reseeded.
- `repetition_penalty` is transformers' (CTRL's): the logit of every token already in the row, prompt and pads
  included, is divided by the penalty when positive and multiplied when negative, before temperature.
- `stop_strings` (with `tokenizer`, as transformers asks) end a row once the text decoded from its new tokens
  contains one; the stop string stays in the output, like an eos token does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _check(input_ids, max_new_tokens, do_sample, temperature, top_p, top_k, max_len, repetition_penalty,
           stop_strings, tokenizer) -> None:
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
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty: expected > 0 (1.0: off), got {repetition_penalty}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings: need tokenizer= (anything with decode(ids) -> str) to read the text")
    if stop_strings and any(not s for s in stop_strings):
        raise ValueError(f"stop_strings: expected non-empty strings, got {list(stop_strings)}")


def _penalize(logits: torch.Tensor, tokens: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [B, V] float32, tokens [B, T]: every token seen in a row gets its logit divided by `penalty` when
    positive, multiplied when negative."""
    seen = logits.gather(-1, tokens)
    return logits.scatter(-1, tokens, torch.where(seen < 0, seen * penalty, seen / penalty))


class _StopStrings:
    """Which rows' new text contains a stop string (the new tokens of each row, decoded whole every step)."""

    def __init__(self, strings: list[str], tokenizer, batch: int):
        self.strings, self.tokenizer = strings, tokenizer
        self.new: list[list[int]] = [[] for _ in range(batch)]

    def hit(self, nxt: torch.Tensor, unfinished: torch.Tensor) -> torch.Tensor:
        """nxt [B] (the tokens just chosen), unfinished [B] bool -> [B] bool: rows that just wrote a stop string."""
        out = torch.zeros_like(unfinished)
        for b, (tok, alive) in enumerate(zip(nxt.tolist(), unfinished.tolist())):
            if not alive:
                continue
            self.new[b].append(tok)
            text = self.tokenizer.decode(self.new[b])
            out[b] = any(s in text for s in self.strings)
        return out


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
             repetition_penalty: float = 1.0, stop_strings: str | list[str] | None = None, tokenizer=None,
             streamer: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """input_ids: [B, T] (left-padded when ragged); attention_mask: [B, T]. Returns [B, T + n] (n <= max_new_tokens):
    the prompt followed by the new tokens. streamer(tokens [B]) is called with each new column."""
    cfg = model.config
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    _check(input_ids, max_new_tokens, do_sample, temperature, top_p, top_k, cfg.max_position_embeddings,
           repetition_penalty, stop_strings, tokenizer)
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
        if seed is None:
            gen.seed()  # from the OS, on this generator only
        else:
            gen.manual_seed(seed)
    stops = _StopStrings(stop_strings, tokenizer, B) if stop_strings else None
    cache = model.new_cache()
    tokens = input_ids
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    step_ids = input_ids
    for _ in range(max_new_tokens):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        logits = model(step_ids, attention_mask=mask, position_ids=pos, cache=cache).logits[:, -1].float()
        if repetition_penalty != 1.0:
            logits = _penalize(logits, tokens, repetition_penalty)
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
        if stops is not None:
            unfinished &= ~stops.hit(nxt, unfinished)
        if eos:
            unfinished &= ~torch.isin(nxt, torch.tensor(eos, device=device))
        if (stops is not None or eos) and not bool(unfinished.any()):
            break
        step_ids = nxt[:, None]
    return tokens
