"""The target's own answers to training prompts: the text a draft (``draft distill``) or a head
(``head train``) must learn to predict, since it is what the target writes at serving time."""

from __future__ import annotations

import time
from typing import Any


def generate_answers(
    model: Any, prompts: list[list[int]], tokens: int, deadline: float, pad: int, temperature: float = 0.0
) -> list[list[int]]:
    """Target answers (prompt + answer), 8 prompts at a time, until the deadline: greedy, or sampled
    at ``temperature``. Prompts keep their last 384 tokens and are left-padded with ``pad``; a group
    started before the deadline runs to the end, later prompts get no answer (fewer texts back)."""
    import torch

    out = []
    for i in range(0, len(prompts), 8):
        if time.monotonic() > deadline:
            break
        group = [p[-384:] for p in prompts[i : i + 8]]
        n = max(map(len, group))
        ids = torch.full((len(group), n), pad)
        att = torch.zeros(len(group), n, dtype=torch.long)
        for j, p in enumerate(group):
            ids[j, n - len(p) :] = torch.tensor(p)
            att[j, n - len(p) :] = 1
        with torch.inference_mode():
            sampling = (
                {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
            )
            gen = model.generate(ids, attention_mask=att, max_new_tokens=tokens, pad_token_id=pad, **sampling)
        for j, p in enumerate(group):
            answer = [t for t in gen[j, n:].tolist() if t != pad]
            out.append(p + answer)
    return out
