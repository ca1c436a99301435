"""A workload that exercises what a real engine does to the cache: requests of different
lengths arriving over time, a shared system prompt (prefix hits), prompts longer than a
prefill chunk, and enough of them at once that a small pool must preempt."""

from __future__ import annotations

import random

from .models import VOCAB
from .scheduler import Request


def make_requests(
    n: int = 16,
    *,
    seed: int = 0,
    system_prompt: int = 40,
    prompt_range: tuple[int, int] = (8, 60),
    new_tokens_range: tuple[int, int] = (4, 24),
    arrival_every: int = 2,
    vocab: int = VOCAB,
) -> list[Request]:
    """``n`` requests; every other one starts with the same ``system_prompt`` tokens, then its
    own ``prompt_range`` tokens; request i arrives at step ``i * arrival_every // 2``."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, vocab) for _ in range(system_prompt)]
    out = []
    for i in range(n):
        own = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_range))]
        out.append(
            Request(
                request_id=f"req-{i:03d}",
                prompt=(shared + own) if i % 2 == 0 else own,
                max_new_tokens=rng.randint(*new_tokens_range),
                arrival_step=i * arrival_every // 2,
            )
        )
    return out
