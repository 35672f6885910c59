"""Perplexity of a served model on a text, through the engine's prompt logprobs: how the
quantization tests and ``make bench`` compare a quantized model with its fp32 original."""

from __future__ import annotations

import math


def perplexity(llm, text: str, window: int = 256) -> float:
    """exp(mean negative log-likelihood) of ``text``'s tokens, scored in windows of ``window``
    tokens (each window's first token has no context and is not scored)."""
    from kiln.sampling_params import SamplingParams

    ids = llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"]
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    windows = [w for w in windows if len(w) > 1]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params)
    total, count = 0.0, 0
    for w, out in zip(windows, outputs):
        for token, position in zip(w[1:], out.prompt_logprobs[1:]):
            total -= position[token].logprob
            count += 1
    return math.exp(total / count)
