"""`hybridlm generate --model PATH --prompt TEXT`: stream generated text to the terminal, report tokens/s.

Non-standard here:
- `--model` takes what `hybridlm.model.locate` resolves: a training run folder or its checkpoints folder (the
  latest complete checkpoint, said on stderr), a checkpoint or Hugging Face folder, a Hub id, or a preset name; a
  preset gives an untrained model (random weights, useful only to time the decoding loop), said on stderr.
- It samples by default, as the training run's sample does (temperature 0.8, here with top-p 0.95), with a fresh
  seed printed on stderr so that a text can be had again; `--greedy` takes the most likely token instead.
- Bad input raises UsageError naming the flag (the command line prints it as one line, exit status 2).
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time

import torch

from .locate import UsageError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="training run folder (hybridlm train --out: its latest complete checkpoint), checkpoint "
                        "or Hugging Face folder, Hub id (org/name), or preset name (random weights)")
    parser.add_argument("--prompt", required=True, help="text to continue (not empty)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate, >= 1 (default: 64)")
    parser.add_argument("--greedy", action="store_true",
                        help="take the most likely token each step (default: off, i.e. sample)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="softmax temperature when sampling, > 0 (default: 0.8, as the training sample)")
    parser.add_argument("--top-p", type=float, default=0.95,
                        help="sample from the most likely tokens holding this probability mass, in (0, 1] "
                        "(default: 0.95; 1: off)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample from the k most likely tokens only (default: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="divide the logit of every token already in the text by this (multiply when negative), "
                        "as transformers does; > 1 discourages repeats (default: 1.0, off)")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="stop once the new text contains TEXT (kept in the output); repeat for several "
                        "(default: none)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampling (default: a fresh one each run, printed on stderr)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32",
                        help="weights and activations dtype (default: float32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda when available, else cpu)")


def _check(args: argparse.Namespace) -> None:
    if not args.prompt:
        raise UsageError("--prompt: empty; give the text to continue, e.g. --prompt 'To be, or not'")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens: expected >= 1, got {args.max_new_tokens}")
    if not args.greedy and not args.temperature > 0:
        raise UsageError(f"--temperature: expected > 0, got {args.temperature} (for greedy decoding pass --greedy)")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p: expected a value in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k: expected >= 1, got {args.top_k}")
    if not args.repetition_penalty > 0:
        raise UsageError(f"--repetition-penalty: expected > 0 (1.0: off), got {args.repetition_penalty}")
    if args.stop and not all(args.stop):
        raise UsageError("--stop: empty text; give the text that ends the generation")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device here; use --device cpu")


def _load(name: str, dtype: torch.dtype):
    """(model, folder or None) for --model."""
    from .hybrid import HybridLM
    from .locate import locate
    from .presets import PRESETS, get_preset

    try:
        found = locate(name, PRESETS)
    except UsageError as e:
        raise UsageError(f"--model {e}") from e
    if found.preset is not None:
        print(f"[{name} is a preset: random weights, the text is noise]", file=sys.stderr)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return HybridLM(get_preset(name)).to(dtype).eval(), None
    if found.folder is None:
        raise UsageError(f"--model {name}: a file; give the folder that holds config.json and the weights, or a "
                         "training run folder")
    if found.note:
        print(f"[loading {found.note}]", file=sys.stderr)
    try:
        return HybridLM.from_pretrained(found.folder, dtype=dtype), found.folder
    except UsageError as e:  # CheckpointError: a missing, truncated or mismatched file, named in the message
        raise UsageError(f"--model {name}: {e}; give a complete checkpoint (another step of the run, or save it "
                         "again)") from e


def run(args: argparse.Namespace) -> int:
    from .tokenizer import load_tokenizer

    _check(args)
    model, folder = _load(args.model, _DTYPES[args.dtype])
    model = model.to(args.device)
    try:
        tok = load_tokenizer(folder, model.config.vocab_size)
    except FileNotFoundError as e:
        raise UsageError(f"--model {args.model}: {e}; put the model's tokenizer.json in that folder") from e
    ids = tok.encode(args.prompt)
    if not ids:
        raise UsageError("--prompt: encodes to no tokens; give some text")
    positions = model.config.max_position_embeddings
    if args.max_new_tokens > positions - len(ids):
        raise UsageError(f"--max-new-tokens: expected <= {max(positions - len(ids), 0)} (the model's {positions} "
                         f"positions less the prompt's {len(ids)} tokens), got {args.max_new_tokens}")
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    if args.greedy:
        print("[greedy decoding]", file=sys.stderr)
    else:
        print(f"[sampling: temperature {args.temperature:g}, top-p {args.top_p:g}"
              f"{f', top-k {args.top_k}' if args.top_k else ''}, seed {seed} (--seed {seed} repeats this text; "
              "--greedy for greedy decoding)]", file=sys.stderr)
    new: list[int] = []
    printed = [0]

    def stream(col: torch.Tensor) -> None:
        new.append(int(col[0]))
        text = tok.decode(new)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            return
        sys.stdout.write(text[printed[0]:])
        sys.stdout.flush()
        printed[0] = len(text)

    sys.stdout.write(args.prompt)
    start = time.perf_counter()
    out = model.generate(torch.tensor([ids], device=args.device), max_new_tokens=args.max_new_tokens,
                         do_sample=not args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         seed=seed, repetition_penalty=args.repetition_penalty, stop_strings=args.stop,
                         tokenizer=tok, streamer=stream)
    elapsed = time.perf_counter() - start
    n = out.shape[1] - len(ids)
    sys.stdout.write("\n")
    print(f"[{n} tokens in {elapsed:.2f} s: {n / max(elapsed, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 0
