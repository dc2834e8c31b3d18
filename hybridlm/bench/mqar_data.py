"""MQAR data (multi-query associative recall, Zoology, Arora et al. 2023): the examples and their checks.

Non-standard here: the data follow Zoology's recipe: P key-value pairs (keys from the lower half of the vocabulary,
values from the upper half, drawn fresh for every example so nothing can be memorised across examples), then the
keys again at gaps drawn from a power law (most queries soon after the context, a long tail far away), each followed
by its value. Only the value positions are scored (labels IGNORE elsewhere). Other positions hold random tokens
(token 0 with random_non_queries=False).
"""

from __future__ import annotations

import torch

IGNORE = -100


def mqar_batch(
    n: int, *, seq_len: int, num_pairs: int, vocab_size: int, power_a: float = 0.01, random_non_queries: bool = True,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """n examples: inputs [n, seq_len] int64 and labels [n, seq_len] (IGNORE except where a value must be recalled).

    Layout before the one-token shift (Zoology's): [k1 v1 ... kP vP | query region of seq_len + 1 - 2P tokens].
    Keys are distinct within an example, from [1, V/2); values are distinct, from [V/2, V). Key ki reappears at the
    even offset 2*gap_i of the query region; the label at that position is vi (the value is not written into the
    input: the model must recall it). Gaps are drawn without replacement with probability proportional to
    a * x^(a-1) (a power law: most queries soon after the context, a long tail far away). Every other query-region
    position holds a random token of the whole vocabulary (Zoology's random_non_queries; token 0 when False), so a
    mixer that writes every token into a fixed-size state keeps writing noise after the context.
    The tensors are made on the generator's device (a CUDA generator keeps the sampling off the host: on the CPU it
    costs ~20 ms for 128 examples of 128 tokens, more than a GPU training step of a small model).
    """
    dev = generator.device
    check_mqar_setting(seq_len=seq_len, num_pairs=num_pairs, vocab_size=vocab_size)
    total = seq_len + 1
    half = vocab_size // 2
    keys = torch.argsort(torch.rand(n, half - 1, generator=generator, device=dev), dim=1)[:, :num_pairs] + 1
    values = torch.argsort(torch.rand(n, vocab_size - half, generator=generator, device=dev), dim=1)[:, :num_pairs]
    values = values + half
    context = torch.stack([keys, values], dim=2).reshape(n, 2 * num_pairs)

    space = (total - 2 * num_pairs) // 2  # query slots (pairs of positions)
    x = torch.arange(1, space + 1, dtype=torch.float64, device=dev)
    p = power_a * x ** (power_a - 1)
    p = (p / p.sum()).expand(n, space)
    gaps = torch.multinomial(p, num_pairs, replacement=False, generator=generator)  # [n, P]
    queries = torch.zeros(n, total - 2 * num_pairs, dtype=torch.int64, device=dev)
    queries.scatter_(1, 2 * gaps, keys)
    if random_non_queries:
        noise = torch.randint(0, vocab_size, queries.shape, generator=generator, device=dev)
        is_query = torch.zeros_like(queries, dtype=torch.bool).scatter_(1, 2 * gaps, True)
        queries = torch.where(is_query, queries, noise)
    seq = torch.cat([context, queries], dim=1)  # [n, total]

    labels = torch.full((n, total), IGNORE, dtype=torch.int64, device=dev)
    labels.scatter_(1, 2 * num_pairs + 2 * gaps + 1, values)  # the token after a query key is its value
    return seq[:, :-1].contiguous(), labels[:, 1:].contiguous()


def check_mqar_setting(*, seq_len: int, num_pairs: int, vocab_size: int) -> None:
    if num_pairs < 1:
        raise ValueError(f"num_pairs: expected >= 1, got {num_pairs}")
    if 4 * num_pairs > seq_len + 1:
        raise ValueError(
            f"num_pairs: expected 4 * num_pairs <= seq_len + 1 (context and queries must fit), got num_pairs="
            f"{num_pairs} with seq_len={seq_len}; use at most {(seq_len + 1) // 4} pairs or a longer sequence"
        )
    if vocab_size // 2 - 1 < num_pairs or vocab_size - vocab_size // 2 < num_pairs:
        raise ValueError(
            f"vocab_size: expected at least {2 * num_pairs + 2} (num_pairs={num_pairs} distinct keys in [1, V/2) and "
            f"values in [V/2, V)), got {vocab_size}"
        )
