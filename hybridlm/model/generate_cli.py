"""`hybridlm generate --model PATH --prompt TEXT`: stream generated text to the terminal, report tokens/s.

Non-standard here: `--model` takes a checkpoint folder (transformers or hybridlm format) or a preset name; a
preset gives an untrained model (random weights, useful only to time the decoding loop), said on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint folder or preset name")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature when sampling (> 0)")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="weights and activations dtype")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda when available)")


def _load(name: str, dtype: torch.dtype):
    from .hybrid import HybridLM
    from .presets import PRESETS, get_preset

    if os.path.isdir(name):
        return HybridLM.from_pretrained(name, dtype=dtype), name
    if name in PRESETS:
        print(f"[{name} is a preset: random weights, the text is noise]", file=sys.stderr)
        torch.manual_seed(0)
        return HybridLM(get_preset(name)).to(dtype).eval(), None
    raise FileNotFoundError(f"--model {name!r}: neither a folder nor a preset")


def run(args: argparse.Namespace) -> int:
    from .tokenizer import load_tokenizer

    model, folder = _load(args.model, _DTYPES[args.dtype])
    model = model.to(args.device)
    tok = load_tokenizer(folder, model.config.vocab_size)
    ids = tok.encode(args.prompt)
    if not ids:
        raise SystemExit("hybridlm generate: the prompt encodes to no tokens")
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
                         do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         seed=args.seed, streamer=stream)
    elapsed = time.perf_counter() - start
    n = out.shape[1] - len(ids)
    sys.stdout.write("\n")
    print(f"[{n} tokens in {elapsed:.2f} s: {n / max(elapsed, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 0
