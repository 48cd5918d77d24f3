"""Sampling text from a trained model: ``dropless generate CHECKPOINT --prompt ...``."""

from __future__ import annotations

import contextlib

import torch

from dropless.train.data import decode, encode
from dropless.train.model import MoELanguageModel


@torch.no_grad()
def sample(model: MoELanguageModel, prompt: torch.Tensor, new_tokens: int, context: int, temperature: float = 0.8,
           top_k: int | None = 40, generator: torch.Generator | None = None) -> torch.Tensor:
    """``prompt`` int ``[N]`` (N >= 1) followed by ``new_tokens`` sampled ones: int64 ``[N + new_tokens]``.

    Each token is drawn from the softmax of the last position's logits over the ``context`` tokens
    before it (the training sequence length), divided by ``temperature`` and cut to the ``top_k``
    likeliest; ``temperature`` 0 takes the likeliest token. bf16 autocast on a GPU.
    """
    device = next(model.parameters()).device
    tokens = prompt.to(device=device, dtype=torch.int64)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext())
    for _ in range(new_tokens):
        with autocast:
            logits = model(tokens[-context:][None])[0, -1].float()
        if temperature <= 0:
            token = logits.argmax()[None]
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                cutoff = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            token = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)  # sync-ok: seeded draw
        tokens = torch.cat([tokens, token])
    return tokens


def generate_text(model: MoELanguageModel, prompt: str, new_tokens: int, context: int, temperature: float = 0.8,
                  top_k: int | None = 40, seed: int = 0) -> str:
    """``prompt`` and ``new_tokens`` bytes of continuation, as text (invalid UTF-8 shown as U+FFFD).
    An empty prompt starts from a newline."""
    generator = torch.Generator().manual_seed(seed)
    tokens = sample(model, encode(prompt or "\n"), new_tokens, context, temperature, top_k, generator)
    return decode(tokens.cpu())  # sync-ok: text out
