"""``ddpkit generate RUN_OR_CHECKPOINT --prompt TEXT``: text from a trained language model, printed as it is sampled.

    $ ddpkit generate runs/lm_tiny --prompt "def main(" --max-new-tokens 200
    $ ddpkit generate runs/ft --prompt-file prompt.txt --tokenizer gpt2/tokenizer.json --num-samples 3 --top-p 0.9
    $ ddpkit generate runs/lm_tiny --prompt "import " --temperature 0        # greedy: the same text every time
    $ ddpkit generate runs/finetune_llama --chat "What is 2 + 2?"           # the chat template; stops at end-of-turn

The model and its trained weights come from a run directory (``model.pt``, else its newest
checkpoint) or a checkpoint (:mod:`ddpkit.tools.lm_source`); ddpkit's ``gpt`` samples with its KV
cache, other models through the protocol of :mod:`ddpkit.models.generation`. Tokens are bytes
unless ``--tokenizer`` names a local ``tokenizer.json`` (a ``gpt`` loaded with ``init_from`` uses the
one in that directory when there is one). Sampling stops at ``--max-new-tokens``, at end-of-text, at the
model's end-of-turn tokens (the ``eos_token_id`` of its ``generation_config.json``, its tokenizer's
``eos_token``, what its chat template closes a turn with), or when the context is full. ``--chat MESSAGE``
puts the message in the model's chat template as a user turn and prints the answer. The default is
nanoGPT's (temperature 0.8, top-k 200) and ``--seed 0``: the same command prints the same samples. On a GPU
(``--device auto`` picks one) the forward passes run in bf16.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import torch

from ddpkit.data.text_codec import TextCodec
from ddpkit.errors import ConfigError
from ddpkit.models.generation import check_prompt, generate
from ddpkit.tools.chat_template import chat_prompt, stop_ids
from ddpkit.tools.lm_source import load_model

__all__ = ["main", "sample_text"]

SEPARATOR = "\n---------------\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddpkit generate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "path", metavar="RUN_OR_CHECKPOINT", help="a run directory, a checkpoint, or a checkpoint directory"
    )
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
    prompt.add_argument("--prompt-file", help="read the prompt from this file")
    prompt.add_argument("--chat", metavar="MESSAGE", help="a user message in the model's chat template; its answer")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens to sample at most (default 256)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy; higher: more varied (default 0.8)")
    parser.add_argument(
        "--top-k", type=int, default=200, help="sample among the k likeliest tokens (default 200; 0: all)"
    )
    parser.add_argument(
        "--top-p", type=float, default=None, help="sample among the likeliest tokens whose mass is p (nucleus)"
    )
    parser.add_argument("--num-samples", type=int, default=1, help="how many samples (default 1)")
    parser.add_argument(
        "--seed", type=int, default=0, help="random seed; the same seed gives the same samples (default 0)"
    )
    parser.add_argument("--tokenizer", help="a local tokenizer.json (default: byte tokens)")
    parser.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu, cuda, cuda:1, ...")
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole sequence at every token (slow)")
    return parser


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """``ddpkit generate``: print ``--num-samples`` samples, each streamed as it is sampled."""
    args = _parser().parse_args(argv)
    out = out or sys.stdout
    _check_numbers(args)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    model, spec = load_model(args.path, device=device)
    init_from = spec.kwargs.get("init_from") if spec.name == "gpt" else None
    tokenizer = args.tokenizer or _tokenizer_beside(init_from)
    codec = TextCodec.open(tokenizer)
    codec.check_fits(getattr(model, "valid_vocab", None) or model.vocab_size)
    # the tokenizer's own directory: its chat template and the ids a chat model stops at
    folder = str(Path(tokenizer).parent) if tokenizer else None
    prompt = _prompt(args, folder)
    ids = codec.encode(prompt)
    check_prompt(model, ids, what="--prompt-file" if args.prompt_file else "--chat" if args.chat else "--prompt")
    args.stops = stop_ids(folder, codec)
    for index in range(args.num_samples):
        out.write(SEPARATOR if index else "")
        out.write(prompt)
        for piece in sample_text(model, codec, ids, args=args, seed=args.seed + index, device=device):
            out.write(piece)
            out.flush()
    out.write("\n")
    return 0


def sample_text(
    model: torch.nn.Module,
    codec: TextCodec,
    ids: list[int],
    *,
    args: argparse.Namespace,
    seed: int,
    device: torch.device,
):
    """The sample's text, piece by piece as its tokens are chosen."""
    stream = codec.stream()
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else None
    for token in generate(
        model,
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        eot=args.stops,
        seed=seed,
        use_cache=not args.no_cache,
        autocast=autocast,
    ):
        yield stream.add(token)
    yield stream.finish()


def _prompt(args: argparse.Namespace, folder: str | None) -> str:
    """The text to continue: ``--prompt``, ``--prompt-file``, or ``--chat``'s message in the chat template."""
    if args.chat is None:
        return Path(args.prompt_file).read_text() if args.prompt_file else args.prompt
    if folder is None:
        raise ConfigError("--chat needs the model's tokenizer directory: give --tokenizer DIR/tokenizer.json")
    return chat_prompt(folder, args.chat)


def _tokenizer_beside(init_from: str | None) -> str | None:
    """The ``tokenizer.json`` next to a pretrained model's weights, if there is one."""
    if init_from is not None and (Path(init_from) / "tokenizer.json").is_file():
        return str(Path(init_from) / "tokenizer.json")
    return None


def _check_numbers(args: argparse.Namespace) -> None:
    problems = {
        "--max-new-tokens": args.max_new_tokens >= 1,
        "--temperature": args.temperature >= 0,
        "--top-k": args.top_k >= 0,
        "--num-samples": args.num_samples >= 1,
        "--top-p": args.top_p is None or 0 < args.top_p <= 1,
    }
    for option, fine in problems.items():
        if not fine:
            raise ConfigError(
                f"{option}: {getattr(args, option[2:].replace('-', '_'))} is out of range; "
                "--max-new-tokens, --num-samples >= 1; --temperature, --top-k >= 0; 0 < --top-p <= 1"
            )
