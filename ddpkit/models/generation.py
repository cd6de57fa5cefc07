"""Sampling text from a language model: greedy, temperature, top-k and top-p, with a KV cache when the model has one.

    for token in generate(model, prompt_ids, max_new_tokens=256, temperature=0.8, top_k=200, seed=1):
        print(decoder.add(token), end="", flush=True)            # streamed as each token is chosen

**The protocol a model follows to be sampled from** (ddpkit's ``gpt`` follows it; so can yours):

- ``model(tokens)``: ``tokens`` int64 ``[B, T]`` -> next-token logits ``[B, T, V]``;
- ``model.max_len``: the longest sequence it takes (its context), and ``model.vocab_size``: ``V``;
- optional, for the cache: ``model.make_cache(batch)`` returns a cache object, and ``model(tokens, cache=cache)``
  takes only the tokens after those already cached (all of the prompt first, then one at a time).

Without ``make_cache`` every step feeds the whole sequence again: the same tokens, about ``T`` times the
work. Generation stops at ``max_new_tokens``, at ``eot`` (the end-of-text id, or a collection of ids, e.g. a
chat model's end-of-turn tokens; not yielded) or when the sequence fills the context. ``temperature: 0`` is
greedy (argmax), and gives the same tokens with and without the cache; a sample with the same ``seed`` is the
same sample.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Protocol

import torch

from ddpkit.errors import ConfigError

__all__ = ["SamplesFrom", "generate", "next_token", "check_prompt"]


class SamplesFrom(Protocol):
    """A model that can be sampled from (see the module docstring); ``make_cache`` is optional."""

    max_len: int
    vocab_size: int

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor: ...


def check_prompt(model: SamplesFrom, prompt: Sequence[int], *, what: str = "--prompt") -> None:
    """Refuse an empty prompt or one the model's context cannot hold, in one line."""
    if not prompt:
        raise ConfigError(f"{what}: the prompt is empty; give at least one token (e.g. a newline)")
    if len(prompt) >= model.max_len:
        raise ConfigError(
            f"{what}: {len(prompt):,} tokens, but the model's context is {model.max_len:,} "
            "(model.kwargs.max_len) and leaves no room to generate; shorten the prompt"
        )


def next_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One id per row of ``logits`` ``[B, V]``: argmax at temperature 0, else a draw from the tempered, cut softmax."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs > top_p  # tokens after the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(outside, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: SamplesFrom,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eot: int | Collection[int] | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    autocast: Any = None,
) -> Iterator[int]:
    """The new token ids after ``prompt``, one at a time as each is chosen (see the module docstring).

    ``autocast``: a context manager factory for the forward passes (bf16 on a GPU), or None.
    """
    check_prompt(model, prompt)
    # the end-of-text, or several ids a chat model stops at (its end-of-turn token among them)
    stops = {eot} if isinstance(eot, int) else set(eot or ())
    device = _device_of(model)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    cache = model.make_cache(1) if use_cache and hasattr(model, "make_cache") else None
    feed = tokens
    for _ in range(min(max_new_tokens, model.max_len - len(prompt))):
        with autocast() if autocast is not None else contextlib.nullcontext():
            logits = model(feed, cache=cache) if cache is not None else model(tokens)
        token = next_token(logits[:, -1], temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if int(token) in stops:
            return
        yield int(token)
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        feed = token[:, None]


def _device_of(model: Any) -> torch.device:
    parameter = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return parameter.device if parameter is not None else torch.device("cpu")
